#include "support/fixtures.h"

#include "kernels/tiled/tiled_cpu.h"
#include "torch_file.h"

#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>

namespace qkv_test {

std::string data_path(const std::string& name) { return std::string(QKV_TEST_DATA_DIR) + "/" + name; }

namespace {

c10::impl::GenericDict load_fixture(const std::string& path) {
  if (!std::ifstream(path)) throw std::runtime_error("cannot open fixture " + path + " (run scripts/gen_reference.py)");
  return qkv::detail::read_torch_file(qkv::detail::read_file_bytes(path, "fixture"), path, "fixture").toGenericDict();
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

std::string Fixture::text(const std::string& key) const { return dict_.at(key).toStringRef(); }

bool Fixture::flag(const std::string& key, bool fallback) const { return has(key) ? dict_.at(key).toBool() : fallback; }

qkv::SelfAttention Fixture::make_module() const {
  qkv::SelfAttentionOptions options(integer("config.d_model"));
  options.num_heads(integer("config.num_heads"))
      .bias(flag("config.bias", true))
      .out_proj(flag("config.out_proj", false))
      .causal(flag("config.causal", false));
  if (has("config.kdim")) options.kdim(integer("config.kdim")).vdim(integer("config.vdim"));
  if (has("config.scale")) options.scale(real("config.scale"));
  if (has("config.num_kv_heads")) options.num_kv_heads(integer("config.num_kv_heads"));
  if (has("config.rope")) options.rope(flag("config.rope", false)).rope_base(real("config.rope_base"));
  qkv::SelfAttention module(options);
  module->to(tensor("input.query").scalar_type());
  qkv::load_state_dict(module, parameters(), name_);  // every name must match: nothing missing or extra
  return module;
}

qkv::TransformerBlock Fixture::make_block() const {
  qkv::TransformerBlock block(qkv::TransformerBlockOptions(integer("config.d_model"), integer("config.num_heads"))
                                  .num_kv_heads(integer("config.num_kv_heads"))
                                  .rope(flag("config.rope", false))
                                  .rope_base(real("config.rope_base"))
                                  .causal(flag("config.causal", false))
                                  .mlp_ratio(integer("config.mlp_ratio")));
  block->to(tensor("input.query").scalar_type());
  qkv::load_state_dict(block, parameters(), name_);
  return block;
}

std::map<std::string, torch::Tensor> Fixture::parameters() const {
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& entry : dict_) {
    const auto& key = entry.key().toStringRef();
    if (key.rfind("param.", 0) == 0) tensors.emplace(key.substr(6), entry.value().toTensor());
  }
  return tensors;
}

qkv::AttentionMask Fixture::mask() const {
  qkv::AttentionMask mask;
  if (has("input.key_lengths")) mask.key_lengths = tensor("input.key_lengths");
  if (has("input.attn_mask")) mask.attn_mask = tensor("input.attn_mask");
  return mask;
}


qkv::AttentionBackend default_cpu_backend() {
  // For float32 inputs, as Auto decides: the tiled kernel runs them on its own micro-kernels.
  if (qkv::kernels::tiled_fast_for(torch::empty({0}, torch::kFloat))) return qkv::AttentionBackend::Tiled;
  return qkv::fused_backend_available() ? qkv::AttentionBackend::Fused : qkv::AttentionBackend::Math;
}


void expect_gradients_match(const Fixture& fixture, const torch::nn::Module& module, const torch::Tensor& input,
                            double tolerance, const std::string& label) {
  double scale = max_abs(input.grad());
  for (const auto& p : module.parameters()) scale = std::max(scale, max_abs(p.grad()));
  EXPECT_TRUE(tensors_close(input.grad(), fixture.tensor("grad.query"), tolerance, scale))
      << label << ": gradient of the input";
  for (const auto& item : module.named_parameters()) {
    EXPECT_TRUE(tensors_close(item.value().grad(), fixture.tensor("grad." + item.key()), tolerance, scale))
        << label << ": gradient of " << item.key();
  }
}


::testing::AssertionResult tensors_close(const torch::Tensor& actual, const torch::Tensor& expected, double tolerance,
                                         double scale) {
  if (!actual.defined() || !expected.defined()) {
    return ::testing::AssertionFailure() << "undefined tensor";
  }
  if (actual.sizes() != expected.sizes()) {
    std::ostringstream message;
    message << "shape " << actual.sizes() << " != expected " << expected.sizes();
    return ::testing::AssertionFailure() << message.str();
  }
  const double error = relative_error(actual, expected, scale);
  if (!(error <= tolerance)) {
    return ::testing::AssertionFailure() << "relative error " << error << " > tolerance " << tolerance
                                         << " (max |expected| " << max_abs(expected) << ", scale " << scale << ")";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult within_one_rounding(const torch::Tensor& actual, const torch::Tensor& reference,
                                               double unit_roundoff) {
  if (!actual.defined() || !reference.defined() || actual.sizes() != reference.sizes()) {
    return ::testing::AssertionFailure() << "undefined, or of another shape than the reference";
  }
  const auto wide = reference.detach().to(torch::kDouble);
  const auto error = (actual.detach().to(torch::kDouble) - wide).abs();
  const auto allowed = unit_roundoff * wide.abs() + 1e-4 * wide.abs().max();
  if ((error <= allowed).all().item<bool>()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "off by up to " << error.max().item<double>() << ", "
                                       << (error / allowed).max().item<double>()
                                       << " times one rounding (largest value " << max_abs(wide) << ")";
}

std::pair<uint32_t, uint32_t> seed_range(const char* variable, std::pair<uint32_t, uint32_t> fallback) {
  const char* chosen = std::getenv(variable);
  if (chosen == nullptr) return fallback;
  const std::string seeds(chosen);
  const auto colon = seeds.find(':');
  const auto first = static_cast<uint32_t>(std::stoul(seeds.substr(0, colon)));
  return {first, colon == std::string::npos ? first + 1 : static_cast<uint32_t>(std::stoul(seeds.substr(colon + 1)))};
}

std::string rewrite_archive(const std::string& bytes,
                            const std::function<void(const std::string& name, std::string& contents)>& change) {
  caffe2::serialize::PyTorchStreamReader reader(
      std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(), static_cast<off_t>(bytes.size())));
  std::string rewritten;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) -> size_t {
    rewritten.append(static_cast<const char*>(data), size);
    return size;
  });
  for (const auto& name : reader.getAllRecords()) {
    if (name == "version") continue;  // the writer writes its own
    const auto [record, size] = reader.getRecord(name);
    std::string contents(static_cast<const char*>(record.get()), size);
    change(name, contents);
    writer.writeRecord(name, contents.data(), contents.size());
  }
  writer.writeEndOfFile();
  return rewritten;
}

}  // namespace qkv_test
