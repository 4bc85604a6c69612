// float32 master weights for a model held in bfloat16 or float16 (qkv-train --dtype bfloat16).
//
// LibTorch's optimizers update a parameter in its own dtype, so a bfloat16 weight takes only the
// updates of at least half its spacing: measured 2026-12-05 (LibTorch 1.13), the lm's default run
// in bfloat16 never moved a single LayerNorm gain (near 1, spacing 2^-7; AdamW's steps are at most
// the learning rate, 2e-3) and its weight decay (a factor 1 - 2e-4 per step) changed nothing. As
// DeepSpeed's and Megatron's bfloat16 optimizers do, the optimizer here steps on float32 copies and
// the model takes each step's result rounded once; the forward and backward stay in bfloat16.
//
// Per step: optimizer.zero_grad() and zero_grad(); backward (and any all-reduce of the model's
// gradients); gradients_to_masters(); clipping, unscaling and optimizer.step() on the optimizer's
// parameters (the masters); masters_to_model(). Checkpoints carry the masters (checkpoint.h).
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

namespace qkv_train {

class MasterWeights {
 public:
  /// A master: the float32 copy the optimizer steps in place of the model's parameter `name`.
  struct Master {
    std::string name;
    torch::Tensor parameter;  // the model's, bfloat16 or float16
    torch::Tensor master;     // float32, in the optimizer
  };

  /// Takes `optimizer`'s bfloat16 and float16 parameters (of `model`) over before its first step:
  /// from then on the optimizer steps on float32 copies of them, its state float32 too. Does nothing
  /// where every parameter is float32 or float64 (active() false; every call below a no-op).
  MasterWeights(torch::nn::Module& model, torch::optim::Optimizer& optimizer);

  bool active() const { return !masters_.empty(); }
  /// In the order the optimizer holds them (the same in a resumed run).
  const std::vector<Master>& masters() const { return masters_; }

  /// The masters take the model's values (after it was initialised, loaded or broadcast).
  void copy_from_model();
  /// Clears the model's gradients of the parameters taken over (the optimizer clears the masters').
  void zero_grad();
  /// The model's gradients, widened exactly, become the masters'.
  void gradients_to_masters();
  /// The model's parameters take the masters' values, rounded once.
  void masters_to_model();
  /// `parameters` (the model's), each one taken over replaced by its master: what the optimizer
  /// steps, in the model's order (for clipping the gradients it applies).
  std::vector<torch::Tensor> stepped(std::vector<torch::Tensor> parameters) const;

 private:
  std::vector<Master> masters_;
};

}  // namespace qkv_train
