// The functional core: scaled dot-product attention, the free function SelfAttention calls.
//
// Dimension legend used in qkv's comments:
//   B = batch, H = heads, N = query positions, S = key/value positions,
//   E = d_model, D = head width (E / H), Dv = value head width.
#pragma once

#include <qkv/options.h>

#include <torch/types.h>

namespace qkv {

struct AttentionResult {
  torch::Tensor output;   // (..., N, Dv)
  torch::Tensor weights;  // (..., N, S), rows sum to 1 (0 for fully masked rows); undefined unless asked
  AttentionBackend backend = AttentionBackend::Math;  // the backend that ran (never Auto)
};

/// softmax(q kᵀ · scale + mask) v for q (..., N, D), k (..., S, D), v (..., S, Dv), where the
/// leading dimensions of q, k and v are equal. A query row whose keys are all masked gets a
/// zero output and zero gradients, never NaN.
AttentionResult scaled_dot_product_attention(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const ScaledDotProductAttentionOptions& options = {});

namespace detail {
/// The plain reference path: the documents' four steps. Always available; returns weights.
AttentionResult math_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const ScaledDotProductAttentionOptions& options);
/// `at::scaled_dot_product_attention`. Throws where LibTorch < 2.0.
AttentionResult fused_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const ScaledDotProductAttentionOptions& options);
}  // namespace detail

}  // namespace qkv
