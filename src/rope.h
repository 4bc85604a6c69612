// Rotary position embedding (RoPE), the half-split ("rotate_half") convention of GPT-NeoX and
// Hugging Face's LLaMA. Private to qkv; SelfAttentionOptions::rope turns it on.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace qkv::detail {

/// x (..., N, D), D even, rotated as position offset + n for row n: with x = [x1, x2] split in
/// halves and θ_i = position · base^(-2i/D), i < D/2,
///   rope(x) = [x1 ⊙ cos θ - x2 ⊙ sin θ,  x2 ⊙ cos θ + x1 ⊙ sin θ].
/// The angles are computed in float64 and rounded once to x's dtype (float32 for half types).
torch::Tensor apply_rope(const torch::Tensor& x, int64_t offset, double base);

}  // namespace qkv::detail
