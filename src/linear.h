// Linear layers as one product with their bias. Private to qkv.
#pragma once

#include <ATen/Functions.h>

namespace qkv::detail {

/// x Wᵀ + b with an input of 3 or more dimensions, contiguous, as its rows side by side in one
/// addmm with the bias (what PyTorch's Python F.linear does through at::linear on 2.x). The C++
/// frontend's torch::nn::functional::linear, and so nn::Linear, multiplies such an input first and
/// adds the bias in a second pass over the output, on every LibTorch version; under bf16 autocast
/// that pass also converts (a float32 bias added into a bfloat16 product): 3.0 of 68.8 ms of a
/// bf16-mixed SelfAttention step at B=8 N=512 E=256 on LibTorch 1.13 (its profiler, 2026-12-01).
/// Anything else goes to at::linear.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (bias.defined() && x.dim() >= 3 && x.is_contiguous() && weight.dim() == 2 && bias.dim() == 1) {
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    return at::addmm(bias, x.view({-1, x.size(-1)}), weight.t()).view(sizes);
  }
  return at::linear(x, weight, bias);
}

}  // namespace qkv::detail
