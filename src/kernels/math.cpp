// The math backend: the documents' four steps, written out with tensor operations. It is the
// reference the other backends are tested against, and the only one that returns the weights.
//
// B = batch, H = query heads, Hkv = key/value heads, G = H / Hkv, N = query positions,
// S = key positions, D = head width, Dv = value width.
#include "kernels/kernels.h"

#include <torch/torch.h>

#include <limits>

namespace qkv::kernels {
namespace {

// Grouped-query attention without copying keys or values: the G query heads that share a
// key/value head are stacked along the query axis, (..., H, N, X) -> (..., Hkv, G·N, X), so each
// key/value head meets all of its queries in one product.
torch::Tensor stack_groups(const torch::Tensor& t, int64_t groups) {
  auto sizes = t.sizes().vec();
  const auto heads = sizes[sizes.size() - 3];
  sizes[sizes.size() - 3] = heads / groups;
  sizes[sizes.size() - 2] *= groups;
  return t.reshape(sizes);
}

// The inverse: (..., Hkv, G·N, X) -> (..., H, N, X), a view of the product's contiguous result.
torch::Tensor unstack_groups(const torch::Tensor& t, int64_t groups) {
  auto sizes = t.sizes().vec();
  sizes[sizes.size() - 3] *= groups;
  sizes[sizes.size() - 2] /= groups;
  return t.reshape(sizes);
}

}  // namespace

AttentionResult math_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const ScaledDotProductAttentionOptions& options) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  const auto prepared = prepare_mask(options, q, k.size(-2));
  const int64_t groups = options.enable_gqa() ? query_groups(q, k) : 1;
  // q·kᵀ and weights·v, for one head per key/value head or for groups of them.
  auto times = [groups](const torch::Tensor& left, const torch::Tensor& right) {
    if (groups == 1) return torch::matmul(left, right);
    return unstack_groups(torch::matmul(stack_groups(left, groups), right), groups);
  };

  // Steps 1 and 2: the dot product of every query with every key, scaled by 1/sqrt(d_k) unless
  // told otherwise, so that softmax does not saturate. The scale is applied to q, (..., N, D),
  // rather than to the scores, (..., N, S): the same numbers up to rounding, without another
  // N×S tensor (at N = 512 a fresh 67 MB scores tensor costs more than its arithmetic).
  const double scale = resolved_scale(options, q.size(-1));
  auto scores = times(scale == 1.0 ? q : q * scale, k.transpose(-2, -1));  // (..., H, N, S)
  if (prepared.mask.defined()) {
    // In place: the product's backward needs its inputs, not its output, and masking's backward
    // only the mask.
    if (prepared.mask.scalar_type() == torch::kBool) {
      scores.masked_fill_(prepared.mask.logical_not(), kNegInf);
    } else {
      scores.add_(prepared.mask);
    }
    // A row with no key left would be softmax(-inf, ...) = NaN: give it finite scores here and
    // zero weights below, so its output and gradients are zero.
    if (prepared.dead_rows.defined()) scores.masked_fill_(prepared.dead_rows, 0.0);
  }
  // Step 3: softmax per row turns scores into weights that sum to 1. Half-precision scores are
  // normalised in float32: exp() of bf16 scores loses too much to sum reliably.
  const bool reduced_precision = q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16;
  auto weights = reduced_precision ? torch::softmax(scores, /*dim=*/-1, torch::kFloat).to(q.scalar_type())
                                   : torch::softmax(scores, /*dim=*/-1);  // (..., H, N, S)
  if (prepared.dead_rows.defined()) weights = weights.masked_fill(prepared.dead_rows, 0.0);
  const bool apply_dropout = options.training() && options.dropout() > 0.0;
  const auto mixing = apply_dropout ? torch::dropout(weights, options.dropout(), /*train=*/true) : weights;
  // Step 4: each query's output is the weighted sum of the values.
  auto output = times(mixing, v);  // (..., H, N, Dv)

  AttentionResult result;
  result.output = std::move(output);
  if (options.need_weights()) result.weights = std::move(weights);
  result.backend = AttentionBackend::Math;
  return result;
}

}  // namespace qkv::kernels
