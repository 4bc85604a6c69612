// Rotary position embedding (RoPE), the half-split ("rotate_half") convention of GPT-NeoX and
// Hugging Face's LLaMA. Private to qkv; SelfAttentionOptions::rope turns it on.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace qkv::detail {

/// cos θ and sin θ, (positions, D/2) each, for positions offset .. offset + positions - 1 and
/// θ_i = position · base^(-2i/D): computed in float64, rounded once to `dtype` (float32 for half types).
struct RopeTable {
  torch::Tensor cos, sin;
};
RopeTable rope_table(int64_t offset, int64_t positions, int64_t head_dim, double base, torch::ScalarType dtype,
                     const torch::Device& device);

/// x (..., N, D), D even, row n rotated by the table's row n: with x = [x1, x2] split in halves,
///   rope(x) = [x1 ⊙ cos θ - x2 ⊙ sin θ,  x2 ⊙ cos θ + x1 ⊙ sin θ].
torch::Tensor apply_rope(const torch::Tensor& x, const RopeTable& table);

/// The same with the table of positions offset .. offset + N - 1 computed on the spot.
torch::Tensor apply_rope(const torch::Tensor& x, int64_t offset, double base);

}  // namespace qkv::detail
