#include "master_weights.h"

#include "torch_compat.h"

#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace qkv_train {
namespace {

bool is_half(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf;
}

std::string describe(const torch::Tensor& t) {
  std::ostringstream text;
  text << t.sizes() << " " << t.dtype() << " on " << t.device();
  return text.str();
}

// `tensor` widened to float32 where it is a half-precision tensor; untouched otherwise.
torch::Tensor widened(const torch::Tensor& tensor) {
  return tensor.defined() && is_half(tensor) ? tensor.to(torch::kFloat) : tensor;
}

template <typename AdamState>
void widen_adam_state(AdamState& state) {
  state.exp_avg(widened(state.exp_avg()));
  state.exp_avg_sq(widened(state.exp_avg_sq()));
  state.max_exp_avg_sq(widened(state.max_exp_avg_sq()));
}

}  // namespace

MasterWeights::MasterWeights(torch::nn::Module& model, torch::optim::Optimizer& optimizer) : optimizer_(optimizer) {
  std::unordered_map<const void*, std::string> names;
  for (const auto& item : model.named_parameters()) names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  for (auto& group : optimizer.param_groups()) {
    for (auto& parameter : group.params()) {
      if (!is_half(parameter)) continue;
      if (!optimizer.state().empty()) {
        throw std::logic_error("MasterWeights: the optimizer has stepped already; take its parameters over before");
      }
      const auto name = names.find(parameter.unsafeGetTensorImpl());
      if (name == names.end()) throw std::logic_error("MasterWeights: the optimizer steps a tensor the model lacks");
      auto master = parameter.detach().to(torch::kFloat).requires_grad_(true);  // a leaf of its own
      pairs_.push_back({name->second, parameter, master});
      parameter = master;  // the optimizer's parameter from now on
    }
  }
}

void MasterWeights::copy_from_model() {
  torch::NoGradGuard no_grad;
  for (auto& pair : pairs_) pair.master.copy_(pair.parameter);
}

void MasterWeights::zero_grad() {
  for (auto& pair : pairs_) pair.parameter.mutable_grad() = torch::Tensor();
}

void MasterWeights::gradients_to_masters() {
  for (auto& pair : pairs_) {
    const auto& gradient = pair.parameter.grad();
    pair.master.mutable_grad() = gradient.defined() ? gradient.detach().to(torch::kFloat) : torch::Tensor();
  }
}

void MasterWeights::masters_to_model() {
  torch::NoGradGuard no_grad;
  for (auto& pair : pairs_) pair.parameter.copy_(pair.master);
}

std::vector<torch::Tensor> MasterWeights::stepped(std::vector<torch::Tensor> parameters) const {
  for (auto& parameter : parameters) {
    for (const auto& pair : pairs_) {
      if (pair.parameter.is_same(parameter)) parameter = pair.master;
    }
  }
  return parameters;
}

// Keyed by position among the masters (the optimizer's order, the same in a resumed run): a
// parameter's name, with its dots, is not an archive's attribute name.
void MasterWeights::save(torch::serialize::OutputArchive& archive) const {
  for (size_t i = 0; i < pairs_.size(); ++i) archive.write(std::to_string(i), pairs_[i].master);
}

bool MasterWeights::load(torch::serialize::InputArchive& archive) {
  std::vector<torch::Tensor> read(pairs_.size());
  for (size_t i = 0; i < pairs_.size(); ++i) {
    const auto& pair = pairs_[i];
    if (!archive.try_read(std::to_string(i), read[i])) {
      if (i == 0) return false;
      throw std::runtime_error("it has no master weight of " + pair.name);
    }
    if (read[i].sizes() != pair.master.sizes() || read[i].dtype() != pair.master.dtype() ||
        read[i].device() != pair.master.device()) {
      throw std::runtime_error("its master weight of " + pair.name + " is " + describe(read[i]) +
                               ", where the run's is " + describe(pair.master));
    }
  }
  // Every master checked before any is set: a refused checkpoint leaves them as they were.
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < pairs_.size(); ++i) pairs_[i].master.copy_(read[i]);
  return true;
}

void MasterWeights::widen_optimizer_state() {
  for (const auto& pair : pairs_) {
    const auto found = qkv::compat::find_optimizer_state(optimizer_.state(), pair.master);
    if (found == optimizer_.state().end() || found->second == nullptr) continue;
    auto* state = found->second.get();
    if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(state)) {
      widen_adam_state(*adam);
    } else if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(state)) {
      widen_adam_state(*adamw);
    } else if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(state)) {
      sgd->momentum_buffer(widened(sgd->momentum_buffer()));
    }
  }
}

}  // namespace qkv_train
