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

}  // namespace
#endif

AttentionResult fused_attention(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                                const ScaledDotProductAttentionOptions& options) {
#if QKV_TORCH_HAS_SDPA
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
  }
  const double dropout = options.training() ? options.dropout() : 0.0;
  const double scale = resolved_scale(options, q.size(-1));
  const int64_t groups = options.enable_gqa() ? query_groups(q, k) : 1;
#if QKV_TORCH_SDPA_HAS_GQA
  auto output = at::scaled_dot_product_attention(q, k, v, mask, dropout, kernel_causal, scale,
                                                 /*enable_gqa=*/groups > 1);
#else
  // Before 2.5 the kernels need one key/value head per query head: repeat them (a copy).
  const auto keys = groups > 1 ? k.repeat_interleave(groups, /*dim=*/-3) : k;
  const auto values = groups > 1 ? v.repeat_interleave(groups, /*dim=*/-3) : v;
#if QKV_TORCH_SDPA_HAS_SCALE
  auto output = at::scaled_dot_product_attention(q, keys, values, mask, dropout, kernel_causal, scale);
#else
  // 2.0's kernels always scale by 1/sqrt(D): fold the requested scale into q.
  const double correction = scale * std::sqrt(static_cast<double>(q.size(-1)));
  auto output = at::scaled_dot_product_attention(q * correction, keys, values, mask, dropout, kernel_causal);
#endif
#endif
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
