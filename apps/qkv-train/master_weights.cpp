#include "master_weights.h"

#include "half_precision.h"

#include <stdexcept>
#include <unordered_map>

namespace qkv_train {

MasterWeights::MasterWeights(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  std::unordered_map<const void*, std::string> names;
  for (const auto& item : model.named_parameters()) names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  for (auto& group : optimizer.param_groups()) {
    for (auto& parameter : group.params()) {
      if (!qkv::detail::half_precision(parameter.scalar_type())) continue;
      if (!optimizer.state().empty()) {
        throw std::logic_error("MasterWeights: the optimizer has stepped already; take its parameters over before");
      }
      const auto name = names.find(parameter.unsafeGetTensorImpl());
      if (name == names.end()) throw std::logic_error("MasterWeights: the optimizer steps a tensor the model lacks");
      auto master = parameter.detach().to(torch::kFloat).requires_grad_(true);  // a leaf of its own
      masters_.push_back({name->second, parameter, master});
      parameter = master;  // the optimizer's parameter from now on
    }
  }
}

void MasterWeights::copy_from_model() {
  torch::NoGradGuard no_grad;
  for (auto& m : masters_) m.master.copy_(m.parameter);
}

void MasterWeights::zero_grad() {
  for (auto& m : masters_) m.parameter.mutable_grad() = torch::Tensor();
}

void MasterWeights::gradients_to_masters() {
  for (auto& m : masters_) {
    const auto& gradient = m.parameter.grad();
    m.master.mutable_grad() = gradient.defined() ? gradient.detach().to(torch::kFloat) : torch::Tensor();
  }
}

void MasterWeights::masters_to_model() {
  torch::NoGradGuard no_grad;
  for (auto& m : masters_) m.parameter.copy_(m.master);
}

std::vector<torch::Tensor> MasterWeights::stepped(std::vector<torch::Tensor> parameters) const {
  for (auto& parameter : parameters) {
    for (const auto& m : masters_) {
      if (m.parameter.is_same(parameter)) parameter = m.master;
    }
  }
  return parameters;
}

}  // namespace qkv_train
