// qkv::SelfAttention: the documents' trainable self-attention module, grown into multi-head,
// masked and cross-attention with an optional output map and a fused backend.
#pragma once

#include <qkv/functional.h>
#include <qkv/masks.h>
#include <qkv/options.h>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <ostream>

namespace qkv {

/// What forward_with_weights returns.
struct SelfAttentionOutput {
  torch::Tensor output;   // (B, N, E) batched, (N, E) unbatched
  torch::Tensor weights;  // (B, H, N, S) batched, (H, N, S) unbatched; each row sums to 1
  AttentionBackend backend = AttentionBackend::Math;
};

/// Q = x W_qᵀ, K = c W_kᵀ, V = c W_vᵀ (c = x for self-attention), split into H heads,
/// softmax(Q Kᵀ · scale + mask) V per head, heads joined, then W_o when out_proj is set.
///
/// Parameters, in registration order: W_q, W_k, W_v (then W_o), so named_parameters() has the
/// keys of the documents' Python module's state_dict(), and the same seed gives the same weights.
class SelfAttentionImpl : public torch::nn::Cloneable<SelfAttentionImpl> {
 public:
  explicit SelfAttentionImpl(const SelfAttentionOptions& options);
  SelfAttentionImpl(int64_t d_model) : SelfAttentionImpl(SelfAttentionOptions(d_model)) {}

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  /// Self-attention on `query` (N, E) or (B, N, E) when `context` is undefined; else
  /// cross-attention from `query` to `context` (S, kdim) or (B, S, kdim). Returns (…, N, E).
  torch::Tensor forward(const torch::Tensor& query, const torch::Tensor& context = {},
                        const AttentionMask& mask = {});

  /// forward, and the softmax weights (always computed by the math backend).
  SelfAttentionOutput forward_with_weights(const torch::Tensor& query, const torch::Tensor& context = {},
                                           const AttentionMask& mask = {});

  /// The general form with separate key and value inputs (needed when kdim != vdim):
  /// query (…, N, E), key (…, S, kdim), value (…, S, vdim).
  SelfAttentionOutput attend(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                             const AttentionMask& mask = {}, bool need_weights = false);

  /// The backend the last forward ran on (Auto before the first forward).
  AttentionBackend last_backend() const { return last_backend_; }

  SelfAttentionOptions options;

  torch::nn::Linear W_q{nullptr};
  torch::nn::Linear W_k{nullptr};
  torch::nn::Linear W_v{nullptr};
  torch::nn::Linear W_o{nullptr};  // only when options.out_proj()

 private:
  /// The module's options as the attention core's (no mask: the caller adds it).
  ScaledDotProductAttentionOptions attention_options(bool need_weights) const;

  AttentionBackend last_backend_ = AttentionBackend::Auto;
};

TORCH_MODULE(SelfAttention);

}  // namespace qkv
