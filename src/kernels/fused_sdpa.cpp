// The fused backend: LibTorch's own at::scaled_dot_product_attention (LibTorch >= 2.0), which
// dispatches to flash / cuDNN / memory-efficient kernels on CUDA and a fused kernel on the CPU.
// qkv adds what it does not do: dead rows (fully masked queries) give zero, not NaN.
#include "kernels/kernels.h"
#include "torch_compat.h"

#include <torch/torch.h>

#include <cmath>

namespace qkv::kernels {

#if QKV_TORCH_HAS_SDPA
namespace {

// at::scaled_dot_product_attention's CPU kernels take only dense operands: found by qkv's
// differential test on PyTorch 2.6, a query made with unfold (overlapping rows) gave outputs off by
// 2.4 (relative) with a key-length mask, and bfloat16 keys made with unfold beside expanded values
// threw oneDNN's "could not construct a memory descriptor using strides". Such operands are made
// contiguous here, once; dense views (the module's head split, a transpose) pass as they are.
torch::Tensor dense(const torch::Tensor& t) {
  return t.is_non_overlapping_and_dense() && (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

// Heads of width 1 go to the CPU kernels one zero column wider: PyTorch 2.6's CPU flash attention
// returned bfloat16 gradients off by 100% of their size for such heads past 128 keys with more than
// one head (its output, its float32 and float16, and PyTorch 2.14's were right; found by qkv's
// differential test, tests/test_backends_agree.cpp). The widened attention is the same: each score
// q·k gains 0·0, the output's extra column (V's zero one) is cut off, and what the pads receive as
// gradient goes nowhere. Exact in every dtype, and heads this narrow are small, so every dtype takes it.
torch::Tensor widened(const torch::Tensor& t) { return at::constant_pad_nd(t, {0, 1}); }

// An additive mask whose row is huge in magnitude everywhere (a finite mask over the whole row:
// -1e9, or the dtype's lowest value, on a query that sees only padding) takes that row's largest
// value off, which leaves its softmax as it was. PyTorch's CPU kernels keep a row's log-sum-exp
// L = m + log l for their backward, which at |m| = 1e9 rounds to m: their gradients came out up to
// 82 times their size for such rows (PyTorch 2.6 and 2.14, float32 and bfloat16; the same mistake
// qkv's tiled kernel made, kernel.h). Rows whose largest value is below 64 in magnitude, where that
// rounding is below float32's own step at the scores, are left as they are (no rounding is added to
// a bfloat16 learned bias); the shift is constant in the mask (detached), as softmax does not see it.
torch::Tensor centred_rows(const torch::Tensor& mask) {
  const auto row_max = mask.amax(-1, /*keepdim=*/true).detach();
  const auto huge = torch::isfinite(row_max).logical_and(row_max.abs() > 64.0);
  if (!huge.any().item<bool>()) return mask;
  return mask - row_max.masked_fill(huge.logical_not(), 0.0);
}

// at::scaled_dot_product_attention as each LibTorch version has it: the scale argument since 2.1,
// grouped key/value heads (enable_gqa) since 2.5.
torch::Tensor call_kernel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const c10::optional<torch::Tensor>& mask, double dropout, bool causal, double scale,
                          int64_t groups) {
#if QKV_TORCH_SDPA_HAS_GQA
  return at::scaled_dot_product_attention(q, k, v, mask, dropout, causal, scale, /*enable_gqa=*/groups > 1);
#else
  // Before 2.5 the kernels need one key/value head per query head: repeat them (a copy).
  const auto keys = groups > 1 ? k.repeat_interleave(groups, /*dim=*/-3) : k;
  const auto values = groups > 1 ? v.repeat_interleave(groups, /*dim=*/-3) : v;
#if QKV_TORCH_SDPA_HAS_SCALE
  return at::scaled_dot_product_attention(q, keys, values, mask, dropout, causal, scale);
#else
  // 2.0's kernels always scale by 1/sqrt(D): fold the requested scale into q.
  const double correction = scale * std::sqrt(static_cast<double>(q.size(-1)));
  return at::scaled_dot_product_attention(q * correction, keys, values, mask, dropout, causal);
#endif
#endif
}

}  // namespace
#endif

AttentionResult fused_attention(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                                const ScaledDotProductAttentionOptions& options) {
#if QKV_TORCH_HAS_SDPA
  // Empty operands (no batch, query or key, values of width 0): nothing for a kernel to compute,
  // and LibTorch's kernels give them no mask gradient (a learned bias beside values of width 0)
  // or disagree (an empty batch with a bias): the math path, as Auto sends them.
  if (q_in.numel() == 0 || k_in.numel() == 0 || v_in.numel() == 0) return math_attention(q_in, k_in, v_in, options);
  const auto q = dense(q_in), k = dense(k_in), v = dense(v_in);
  const int64_t num_queries = q.size(-2);
  const int64_t num_keys = k.size(-2);
  // Without a user mask, a square causal pattern goes to the kernels as is_causal, which lets
  // them skip the masked half. Everything else becomes one explicit mask.
  // A sliding window goes to the kernels as a band mask (they have no window of their own on the CPU).
  const bool kernel_causal = options.causal() && !options.window() && !options.mask().defined() &&
                             !options.key_lengths().defined() && num_queries == num_keys;
  c10::optional<torch::Tensor> mask;
  torch::Tensor dead_rows;
  if (!kernel_causal && (options.mask().defined() || options.key_lengths().defined() || options.causal())) {
    auto prepared = prepare_mask(options, q, num_keys);
    dead_rows = prepared.dead_rows;
    if (dead_rows.defined()) {
      // Let dead rows attend everywhere inside the kernel, then zero them (see math_attention).
      prepared.mask = prepared.mask.scalar_type() == torch::kBool ? prepared.mask.logical_or(dead_rows)
                                                                  : prepared.mask.masked_fill(dead_rows, 0.0);
    }
    mask = prepared.mask;
    if (q.is_cpu() && mask->is_floating_point()) mask = centred_rows(*mask);
  }
  const double dropout = options.training() ? options.dropout() : 0.0;
  const double scale = resolved_scale(options, q.size(-1));
  const int64_t groups = options.enable_gqa() ? query_groups(q, k) : 1;
  // The scale above is of the caller's width, and call_kernel passes it on as it is.
  const bool widen_keys = q.is_cpu() && q.size(-1) == 1, widen_values = q.is_cpu() && v.size(-1) == 1;
  const auto queries = widen_keys ? widened(q) : q, keys = widen_keys ? widened(k) : k;
  const auto values = widen_values ? widened(v) : v;
  torch::Tensor output;
  if (groups > 1 && num_queries == 1 && !kernel_causal) {
    // One query row per head (a decoded token) with grouped key/value heads: the G query heads of a
    // key/value head are G rows against the same keys, q (..., H, 1, D) viewed as (..., Hkv, G, D),
    // so the kernel needs no grouped-head support. That support is slow or a copy: PyTorch 2.6's CPU
    // kernel with enable_gqa took 86 µs at 128 keys and 1234 µs at 1024 for one row of 8 heads on 2,
    // against 13 and 28 µs with the key/value heads repeated (docs/PERFORMANCE.md, issue 22's
    // decoding figures); before 2.5 they are repeated, a copy of the whole cache for every token.
    // A mask with a head dimension (validated as H) stacks like q; one without broadcasts over the rows.
    if (mask && mask->dim() >= 3 && mask->size(-3) > 1) mask = stack_groups(*mask, groups);
    output = unstack_groups(call_kernel(stack_groups(queries, groups), keys, values, mask, dropout,
                                        /*causal=*/false, scale, /*groups=*/1),
                            groups);  // (..., Hkv, G, Dv) -> (..., H, 1, Dv)
  } else {
    output = call_kernel(queries, keys, values, mask, dropout, kernel_causal, scale, groups);
  }
  if (widen_values) output = output.narrow(-1, 0, 1);
  if (dead_rows.defined()) output = output.masked_fill(dead_rows, 0.0);
  AttentionResult result;
  result.output = std::move(output);
  result.backend = AttentionBackend::Fused;
  return result;
#else
  (void)q_in, (void)k_in, (void)v_in, (void)options;
  TORCH_CHECK(false, "scaled_dot_product_attention: the fused backend needs LibTorch >= 2.0, this build has ",
              TORCH_VERSION);
#endif
}

}  // namespace qkv::kernels
