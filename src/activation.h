// Elementwise activations where LibTorch's own loop would be the slow part. Private to qkv.
#pragma once

#include <ATen/core/Tensor.h>

namespace qkv::detail {

/// Whether a bfloat16 CPU tensor's GELU goes through float32 here: where the CPU has no AVX-512
/// (kernels::tiled::libtorch_bfloat16_on_own_loops()). There LibTorch's bfloat16 GELU is its own
/// loop (oneDNN's, which its float32 GELU takes, wants AVX-512 for bfloat16): 5.4 ms forward and
/// 9.4 ms backward for the lm's 4096 × 512 activations, against 0.54 and 0.94 ms for oneDNN's
/// float32 GELU (LibTorch 1.13, 2 threads, AMD EPYC Zen 5 with LibTorch's mkldnn turned off and
/// ATEN_CPU_CAPABILITY=avx2, 2026-12-03).
bool gelu_through_float32();

/// torch::gelu(x) (exact, with erf): the same values and gradients (create_graph included), but a
/// contiguous bfloat16 CPU tensor, where gelu_through_float32(), is widened to float32 (exact), its
/// GELU and GELU's backward computed by LibTorch in float32, and rounded back to bfloat16: what
/// LibTorch's bfloat16 GELU computes (it too works in float32 and rounds once).
at::Tensor gelu(const at::Tensor& x);

}  // namespace qkv::detail
