// A module in eval mode for the length of a scope: evaluation, sampling and attention pictures
// switch dropout off and must give the module back in the mode it had, also when they throw.
#pragma once

#include <torch/nn/module.h>

namespace qkv_train {

class EvalModeGuard {
 public:
  explicit EvalModeGuard(torch::nn::Module& module) : module_(module), was_training_(module.is_training()) {
    module_.eval();
  }
  ~EvalModeGuard() { module_.train(was_training_); }
  EvalModeGuard(const EvalModeGuard&) = delete;
  EvalModeGuard& operator=(const EvalModeGuard&) = delete;

 private:
  torch::nn::Module& module_;
  bool was_training_;
};

}  // namespace qkv_train
