// qkv::checkpoint: activation checkpointing for LibTorch's C++ API, as torch.utils.checkpoint
// (pytorch/pytorch#52744 asks for it in C++ since 2021): trade compute for memory in training.
#pragma once

#include <torch/types.h>

#include <functional>
#include <vector>

namespace qkv {

/// The function checkpoint() runs twice: its inputs in, one tensor out.
using CheckpointedFunction = std::function<torch::Tensor(const std::vector<torch::Tensor>& inputs)>;

/// Runs `function(inputs)` without keeping the tensors it creates for its backward, and returns its
/// output. When a gradient is asked of the output, `function` runs again, with autograd on, from
/// the saved `inputs`, and that run is differentiated: the gradients of `inputs` and of
/// `parameters` (the tensors `function` reads besides its inputs whose gradients are wanted, e.g. a
/// module's parameters()) are the ones the plain function gives.
///
/// The second run replays the first one's random draws: the CPU generator's state (dropout masks,
/// the tiled kernel's dropout seed) and that of the inputs' device are saved before the first run,
/// set for the second, and restored after it; so is the autocast state (the second run computes
/// in the precision the first one did). Neither run uses or fills autocast's cache of weight
/// casts: a cast made in the first run, without autograd, would cut the weight it stands for off
/// from its gradient wherever it was reused. `function` must otherwise compute the same thing
/// twice (no state it changes, e.g. a BatchNorm's running statistics), and compute it the same
/// whether a backward follows or not. qkv's TransformerBlock does: checkpointed, its output and
/// gradients are the plain block's bit for bit (tested in float64 with dropout, and under bfloat16
/// autocast on every instruction set and linear-layer route). A function that rounds differently
/// without autograd gets the plain function's results only up to that rounding.
///
/// Without grad mode, or when nothing requires grad, it is `function(inputs)`. Works with
/// torch::autograd::grad and backward, and with create_graph (the second run is then kept).
torch::Tensor checkpoint(const CheckpointedFunction& function, const std::vector<torch::Tensor>& inputs,
                         const std::vector<torch::Tensor>& parameters);

}  // namespace qkv
