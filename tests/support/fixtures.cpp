#include "support/fixtures.h"

#include <fstream>
#include <iterator>
#include <sstream>

namespace qkv_test {

std::string data_path(const std::string& name) { return std::string(QKV_TEST_DATA_DIR) + "/" + name; }

namespace {

c10::impl::GenericDict load_fixture(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error("cannot open fixture " + path + " (run scripts/gen_reference.py)");
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes).toGenericDict();
}

}  // namespace

Fixture::Fixture(const std::string& case_name)
    : name_(case_name),
      dict_(load_fixture(data_path(case_name.size() > 3 && case_name.substr(case_name.size() - 3) == ".pt"
                                       ? case_name
                                       : "parity_" + case_name + ".pt"))) {}

bool Fixture::has(const std::string& key) const { return dict_.contains(key); }

torch::Tensor Fixture::tensor(const std::string& key) const {
  if (!has(key)) throw std::runtime_error("fixture " + name_ + " has no key " + key);
  return dict_.at(key).toTensor();
}

int64_t Fixture::integer(const std::string& key) const { return dict_.at(key).toInt(); }

double Fixture::real(const std::string& key) const {
  const auto value = dict_.at(key);
  return value.isDouble() ? value.toDouble() : static_cast<double>(value.toInt());
}

bool Fixture::flag(const std::string& key, bool fallback) const {
  return has(key) ? dict_.at(key).toBool() : fallback;
}

qkv::SelfAttention Fixture::make_module() const {
  qkv::SelfAttentionOptions options(integer("config.d_model"));
  options.num_heads(integer("config.num_heads"))
      .bias(flag("config.bias", true))
      .out_proj(flag("config.out_proj", false))
      .causal(flag("config.causal", false));
  if (has("config.kdim")) options.kdim(integer("config.kdim")).vdim(integer("config.vdim"));
  if (has("config.scale")) options.scale(real("config.scale"));
  qkv::SelfAttention module(options);
  module->to(tensor("input.query").scalar_type());
  torch::NoGradGuard no_grad;
  for (auto& item : module->named_parameters()) {
    item.value().copy_(tensor("param." + item.key()));
  }
  return module;
}

qkv::AttentionMask Fixture::mask() const {
  qkv::AttentionMask mask;
  if (has("input.key_lengths")) mask.key_lengths = tensor("input.key_lengths");
  if (has("input.attn_mask")) mask.attn_mask = tensor("input.attn_mask");
  return mask;
}

double relative_error(const torch::Tensor& actual, const torch::Tensor& expected) {
  auto a = actual.detach().to(torch::kCPU, torch::kDouble);
  auto b = expected.detach().to(torch::kCPU, torch::kDouble);
  if (b.numel() == 0) return 0.0;
  const double scale = std::max(1.0, b.abs().max().item<double>());
  return (a - b).abs().max().item<double>() / scale;
}

::testing::AssertionResult tensors_close(const torch::Tensor& actual, const torch::Tensor& expected,
                                         double tolerance) {
  if (!actual.defined() || !expected.defined()) {
    return ::testing::AssertionFailure() << "undefined tensor";
  }
  if (actual.sizes() != expected.sizes()) {
    std::ostringstream message;
    message << "shape " << actual.sizes() << " != expected " << expected.sizes();
    return ::testing::AssertionFailure() << message.str();
  }
  const double error = relative_error(actual, expected);
  if (!(error <= tolerance)) {
    return ::testing::AssertionFailure() << "relative error " << error << " > tolerance " << tolerance;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace qkv_test
