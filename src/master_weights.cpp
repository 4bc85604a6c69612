// MasterWeights (include/qkv/precision.h): the optimizer of a half-precision model on float32 copies.
#include <qkv/precision.h>

#include "half_precision.h"

#include <torch/torch.h>

#include <cstring>
#include <unordered_map>

namespace qkv {

MasterWeights::MasterWeights(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  std::unordered_map<const void*, std::string> names;
  for (const auto& item : model.named_parameters()) names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  for (auto& group : optimizer.param_groups()) {
    for (auto& parameter : group.params()) {
      if (!detail::half_precision(parameter.scalar_type())) continue;
      TORCH_CHECK(optimizer.state().empty(),
                  "MasterWeights: expected an optimizer that has not stepped yet, got one with state for ",
                  optimizer.state().size(), " parameters (its state would stay in ", parameter.scalar_type(), ")");
      const auto name = names.find(parameter.unsafeGetTensorImpl());
      TORCH_CHECK(name != names.end(), "MasterWeights: expected the optimizer's ", parameter.scalar_type(),
                  " parameters to be the model's, got one of shape ", parameter.sizes(), " that the model lacks");
      auto master = parameter.detach().to(torch::kFloat).requires_grad_(true);  // a leaf of its own
      masters_.push_back({name->second, parameter, master});
      parameter = master;  // the optimizer's parameter from now on
    }
  }
  record_synced();
}

// The bits of a CPU master's first and last values. LibTorch's SGD steps through Tensor::data(),
// whose in-place changes the master's version counter does not see (Adam and AdamW step the
// parameter itself); a step changes these values unless their gradients are exactly 0. On another
// device reading them would wait for it, so there the version counter alone decides. Bits, not
// values: a NaN master equals itself.
MasterWeights::EndBits MasterWeights::end_bits(const torch::Tensor& master) {
  if (!master.device().is_cpu() || master.numel() == 0) return {};
  const float* first = master.data_ptr<float>();
  int64_t last_offset = 0;
  for (int64_t d = 0; d < master.dim(); ++d) last_offset += (master.size(d) - 1) * master.stride(d);
  EndBits bits;
  std::memcpy(&bits.first, first, sizeof(float));
  std::memcpy(&bits.last, first + last_offset, sizeof(float));
  bits.sampled = true;
  return bits;
}

// A master's version counter counts its in-place changes (Adam's and AdamW's steps among them).
void MasterWeights::record_synced() {
  synced_.clear();
  for (const auto& m : masters_) synced_.push_back({m.master._version(), end_bits(m.master)});
}

void MasterWeights::copy_from_model() {
  torch::NoGradGuard no_grad;
  for (auto& m : masters_) m.master.copy_(m.parameter);
  record_synced();
}

void MasterWeights::gradients_to_masters() {
  for (size_t i = 0; i < masters_.size(); ++i) {
    const auto now = end_bits(masters_[i].master);
    const auto& then = synced_[i].ends;
    const bool values_changed = now.sampled && then.sampled && (now.first != then.first || now.last != then.last);
    TORCH_CHECK(masters_[i].master._version() == synced_[i].version && !values_changed,
                "MasterWeights::gradients_to_masters: the master of ", masters_[i].name,
                " changed after the model last took the masters' values; call masters_to_model() after each "
                "optimizer step (this backward ran on stale weights)");
  }
  torch::NoGradGuard no_grad;
  for (auto& m : masters_) {
    auto& gradient = m.parameter.mutable_grad();
    if (!gradient.defined()) continue;
    auto widened = gradient.detach().to(torch::kFloat);  // exact: float32 holds every bfloat16 and float16
    auto& master_gradient = m.master.mutable_grad();
    if (master_gradient.defined()) {
      master_gradient.add_(widened);
    } else {
      master_gradient = std::move(widened);
    }
    gradient = torch::Tensor();
  }
}

void MasterWeights::masters_to_model() {
  torch::NoGradGuard no_grad;
  for (auto& m : masters_) m.parameter.copy_(m.master);
  record_synced();
}

std::vector<torch::Tensor> MasterWeights::stepped(std::vector<torch::Tensor> parameters) const {
  for (auto& parameter : parameters) {
    for (const auto& m : masters_) {
      if (m.parameter.is_same(parameter)) parameter = m.master;
    }
  }
  return parameters;
}

void MasterWeights::save(torch::serialize::OutputArchive& archive) const {
  // Keyed by position: a parameter's name, with its dots, is not an archive's attribute name.
  for (size_t i = 0; i < masters_.size(); ++i) archive.write(std::to_string(i), masters_[i].master);
}

void MasterWeights::load(torch::serialize::InputArchive& archive) {
  std::vector<torch::Tensor> read(masters_.size());
  for (size_t i = 0; i < read.size(); ++i) {
    const auto& m = masters_[i];
    TORCH_CHECK(archive.try_read(std::to_string(i), read[i]) && read[i].defined(), "MasterWeights::load: expected ",
                masters_.size(), " masters, got none for ", m.name, " (position ", i, ")");
    TORCH_CHECK(read[i].sizes() == m.master.sizes() && read[i].scalar_type() == torch::kFloat,
                "MasterWeights::load: expected the master of ", m.name, " to be ", m.master.sizes(), " ",
                m.master.dtype(), ", got ", read[i].sizes(), " ", read[i].dtype());
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < read.size(); ++i) masters_[i].master.copy_(read[i]);
  record_synced();  // the model takes them where the caller loads its weights (the same step's)
}

}  // namespace qkv
