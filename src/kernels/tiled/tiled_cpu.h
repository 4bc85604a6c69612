// The tiled CPU backend's entry points beyond kernels.h: what tests need to check its dropout.
// Private to qkv.
#pragma once

#include <qkv/functional.h>

#include <cstdint>

namespace qkv::kernels {

/// Whether the tiled backend can take q: a CPU tensor of float32, float64, bfloat16 or float16.
bool tiled_supports(const torch::Tensor& q);
/// Whether the float64 block products go through a CBLAS found at build time (else plain loops).
bool tiled_uses_blas();
/// Whether q's dtype runs on fast block products: float32, bfloat16 and float16 always (qkv's
/// packed micro-kernels), float64 where tiled_uses_blas().
bool tiled_fast_for(const torch::Tensor& q);

/// The tiled backend with a given dropout seed (tiled_attention draws it from LibTorch's CPU generator).
AttentionResult tiled_attention_with_seed(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          const ScaledDotProductAttentionOptions& options, uint64_t seed);

/// The pairs that dropout with probability p and this seed keeps, bool (B, H, N, S): what the
/// kernel regenerates in its forward and backward, for tests to compare against.
torch::Tensor tiled_dropout_keep_mask(uint64_t seed, double p, int64_t batch, int64_t heads, int64_t rows,
                                      int64_t keys);

}  // namespace qkv::kernels
