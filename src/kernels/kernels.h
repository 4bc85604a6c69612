// The backends of qkv::scaled_dot_product_attention, one file each, and what they share. Private:
// they take inputs that src/functional.cpp has already checked.
//
// B = batch, H = query heads, Hkv = key/value heads, G = H / Hkv, N = query positions,
// S = key positions, D = head width, Dv = value width.
#pragma once

#include <qkv/functional.h>

#include <torch/types.h>

namespace qkv::kernels {

/// The documents' four steps with tensor ops: the reference every other backend is tested against.
/// With dropout, `dropout_keep` (bool, broadcastable to the weights (..., H, N, S)), when given, is
/// the mask of kept pairs instead of a fresh draw: the tiled kernel's, for its second-order gradients.
AttentionResult math_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const ScaledDotProductAttentionOptions& options,
                               const torch::Tensor& dropout_keep = {});

/// `at::scaled_dot_product_attention` (LibTorch >= 2.0); throws on older LibTorch.
AttentionResult fused_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const ScaledDotProductAttentionOptions& options);

/// qkv's tiled CPU kernel (see tiled/); CPU float32, float64, bfloat16.
AttentionResult tiled_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const ScaledDotProductAttentionOptions& options);

/// While one lives on a thread, the forwards run there will be run again with autograd to take
/// their gradients: an activation checkpoint's first run (src/checkpoint.cpp), whose output the
/// recomputation must reproduce bit for bit. A backend then computes as it does when a backward
/// follows (the tiled kernel: no dot-product path for a few rows, kernel.h), though autograd is off.
class RecomputedLater {
 public:
  RecomputedLater();
  ~RecomputedLater();
  RecomputedLater(const RecomputedLater&) = delete;
  RecomputedLater& operator=(const RecomputedLater&) = delete;
};
/// Whether a RecomputedLater lives on this thread.
bool recomputed_later();

/// The multiplier of QKᵀ: the option, else 1/sqrt(D); 1 for D = 0, where every score is an empty
/// dot product, 0 whatever the scale (1/√0 would make a kernel's 0 · ∞ NaN).
double resolved_scale(const ScaledDotProductAttentionOptions& options, int64_t head_width);

/// Query heads per key/value head: H / Hkv with enable_gqa, else 1.
int64_t query_groups(const torch::Tensor& q, const torch::Tensor& k);

/// Grouped-query attention without copying keys or values: the G query heads that share a
/// key/value head stacked along the query axis, (..., H, N, X) -> (..., Hkv, G·N, X), so that each
/// key/value head meets all of its queries in one product (a view where the layout allows).
torch::Tensor stack_groups(const torch::Tensor& t, int64_t groups);
/// The inverse: (..., Hkv, G·N, X) -> (..., H, N, X), a view of a contiguous result.
torch::Tensor unstack_groups(const torch::Tensor& t, int64_t groups);

/// The mask every backend applies, with the causal mask folded in, and the rows that it leaves
/// without any key ("dead" rows). Softmax over a row of -inf is NaN; qkv gives such rows a zero
/// output and zero gradients instead.
struct PreparedMask {
  torch::Tensor mask;       // bool (true = attend) or floating, broadcastable to (..., N, S); may be undefined
  torch::Tensor dead_rows;  // bool (..., N, 1): rows with no key left; undefined when there cannot be any
};
PreparedMask prepare_mask(const ScaledDotProductAttentionOptions& options, const torch::Tensor& q, int64_t num_keys);

}  // namespace qkv::kernels
