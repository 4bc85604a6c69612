// The math backend: the documents' four steps, written out with tensor operations. It is the
// reference the other backends are tested against, and the only one that returns the weights.
//
// B = batch, H = query heads, Hkv = key/value heads, G = H / Hkv, N = query positions,
// S = key positions, D = head width, Dv = value width.
#include "kernels/kernels.h"
#include "half_precision.h"

#include <qkv/precision.h>

#include <torch/torch.h>

#include <limits>
#include <optional>

namespace qkv::kernels {

AttentionResult math_attention(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                               const ScaledDotProductAttentionOptions& options, const torch::Tensor& dropout_keep) {
  // Half precision on the CPU is computed in float32 and rounded once at the end, as PyTorch's own
  // math SDPA does: LibTorch's CPU bfloat16 matmul accumulates in bfloat16 for small operands (1.13:
  // 8% off for a sum of 1000 terms), which would make the reference less exact than the kernels it
  // checks. (It also fails outright, "could not execute a primitive", on some strided operands.)
  // Inside an autocast scope too: its CPU autocast would multiply the float32 operands in bfloat16
  // again, so autocast is off for this function's operations (and so for their backward).
  const auto dtype = q_in.scalar_type();
  const bool upcast = q_in.device().is_cpu() && detail::half_precision(dtype);
  std::optional<AutocastGuard> float32_products;
  if (upcast) float32_products.emplace(q_in.device(), dtype, /*enabled=*/false);
  const auto q = upcast ? q_in.to(torch::kFloat) : q_in;
  const auto k = upcast ? k_in.to(torch::kFloat) : k_in;
  const auto v = upcast ? v_in.to(torch::kFloat) : v_in;
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
  // Step 3: softmax per row turns scores into weights that sum to 1. Half-precision scores (on
  // CUDA) are normalised in float32: exp() of bf16 scores loses too much to sum reliably.
  const bool reduced_precision = detail::half_precision(q.scalar_type());
  auto weights = reduced_precision ? torch::softmax(scores, /*dim=*/-1, torch::kFloat).to(q.scalar_type())
                                   : torch::softmax(scores, /*dim=*/-1);  // (..., H, N, S)
  if (prepared.dead_rows.defined()) weights = weights.masked_fill(prepared.dead_rows, 0.0);
  const bool apply_dropout = options.training() && options.dropout() > 0.0;
  torch::Tensor mixing = weights;
  if (apply_dropout && dropout_keep.defined()) {
    mixing = weights * dropout_keep * (1.0 / (1.0 - options.dropout()));
  } else if (apply_dropout) {
    mixing = torch::dropout(weights, options.dropout(), /*train=*/true);
  }
  // Step 4: each query's output is the weighted sum of the values.
  auto output = times(mixing, v);  // (..., H, N, Dv)

  AttentionResult result;
  result.output = upcast ? output.to(dtype) : std::move(output);
  if (options.need_weights()) result.weights = upcast ? weights.to(dtype) : std::move(weights);
  result.backend = AttentionBackend::Math;
  return result;
}

}  // namespace qkv::kernels
