// qkv::SelfAttention: the documents' trainable self-attention module, grown into multi-head,
// grouped-query, masked and cross-attention with rotary positions, an optional output map, a KV
// cache for incremental decoding and a fused backend.
#pragma once

#include <qkv/functional.h>
#include <qkv/kv_cache.h>
#include <qkv/masks.h>
#include <qkv/options.h>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <ostream>

/// LibTorch's FORWARD_HAS_DEFAULT_ARGS (AnyModule and Sequential call forward with the trailing
/// arguments left out), for qkv's modules. The macro calls TORCH_INTERNAL_ASSERT with no message,
/// which clang's -Wpedantic reports, as a GNU extension, in every program that includes a qkv
/// module's header; silenced here for the expansion alone.
#if defined(__clang__)
#define QKV_FORWARD_HAS_DEFAULT_ARGS(...)                                              \
  _Pragma("clang diagnostic push")                                                     \
  _Pragma("clang diagnostic ignored \"-Wgnu-zero-variadic-macro-arguments\"")          \
  FORWARD_HAS_DEFAULT_ARGS(__VA_ARGS__)                                                \
  _Pragma("clang diagnostic pop")
#else
#define QKV_FORWARD_HAS_DEFAULT_ARGS(...) FORWARD_HAS_DEFAULT_ARGS(__VA_ARGS__)
#endif

namespace qkv {

/// What forward_with_weights returns.
struct SelfAttentionOutput {
  torch::Tensor output;                               // (B, N, E) batched, (N, E) unbatched
  torch::Tensor weights;                              // (B, H, N, S) batched, (H, N, S) unbatched; each row sums to 1
  AttentionBackend backend = AttentionBackend::Math;  // the backend that computed it
};

/// Q = x W_qᵀ, K = c W_kᵀ, V = c W_vᵀ (c = x for self-attention), split into H query heads and
/// Hkv key/value heads, rotated (RoPE) when asked, softmax(Q Kᵀ · scale + mask) V per head, heads
/// joined, then W_o when out_proj is set.
///
/// Parameters, in registration order: W_q, W_k, W_v (then W_o), so named_parameters() has the
/// keys of the documents' Python module's state_dict(), and the same seed gives the same weights.
class SelfAttentionImpl : public torch::nn::Cloneable<SelfAttentionImpl> {
 public:
  explicit SelfAttentionImpl(const SelfAttentionOptions& options);
  SelfAttentionImpl(int64_t d_model) : SelfAttentionImpl(SelfAttentionOptions(d_model)) {}

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  /// As Module::to; moving gives each parameter its own storage, so W_q, W_k, W_v are then laid
  /// side by side again (self-attention's one projection product, see project_self).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  /// Self-attention on `query` (N, E) or (B, N, E) when `context` is undefined; else
  /// cross-attention from `query` to `context` (S, kdim) or (B, S, kdim). Returns (…, N, E).
  /// Callable with one argument by torch::nn::Sequential and AnyModule.
  torch::Tensor forward(const torch::Tensor& query, const torch::Tensor& context = {}, const AttentionMask& mask = {});

  /// forward, and the softmax weights (always computed by the math backend).
  SelfAttentionOutput forward_with_weights(const torch::Tensor& query, const torch::Tensor& context = {},
                                           const AttentionMask& mask = {});

  /// The general form with separate key and value inputs (needed when kdim != vdim):
  /// query (…, N, E), key (…, S, kdim), value (…, S, vdim). The result says which backend ran.
  SelfAttentionOutput attend(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                             const AttentionMask& mask = {}, bool need_weights = false);

  /// The backend forward(query, context, mask) would run on, without running it.
  AttentionBackend backend_for(const torch::Tensor& query, const torch::Tensor& context = {},
                               const AttentionMask& mask = {}) const;

  /// An empty KVCache for `batch` sequences of up to `capacity` positions, sized for this module
  /// (its key/value heads and head width) in its parameters' dtype and on their device. With a
  /// sliding window W < capacity it is a rolling cache of W slots instead, which decodes any
  /// number of positions in constant memory.
  KVCache make_cache(int64_t batch, int64_t capacity) const;

  /// Incremental causal self-attention: `x` (B, T, E) holds T new positions of each sequence,
  /// which follow the cache's length() positions. Their keys and values (rotated at their
  /// positions with RoPE) are appended to `cache`, and each new position attends to every cached
  /// position up to and including itself. Returns (B, T, E): the same as rows length()..length()+T-1
  /// of one causal (windowed) forward over the whole sequence. A prompt goes in as one call, then
  /// one token at a time (or chunks). Inference only (under torch::NoGradGuard); needs a causal module
  /// without a cross-attention context (kdim, vdim unset).
  torch::Tensor forward_with_cache(const torch::Tensor& x, KVCache& cache);

  SelfAttentionOptions options;

  torch::nn::Linear W_q{nullptr};
  torch::nn::Linear W_k{nullptr};
  torch::nn::Linear W_v{nullptr};
  torch::nn::Linear W_o{nullptr};  // only when options.out_proj()

 protected:
  QKV_FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(torch::Tensor())}, {2, torch::nn::AnyValue(AttentionMask())})

 private:
  /// The module's options as the attention core's (no mask: the caller adds it).
  ScaledDotProductAttentionOptions attention_options(bool need_weights) const;

  /// W_q, W_k, W_v (and their biases) into one storage each, every one still its own parameter.
  void stack_projections();

  /// Self-attention's three projections of x (…, E): (x W_qᵀ + b_q, x W_kᵀ + b_k, x W_vᵀ + b_v),
  /// as views of one (…, E + 2·Hkv·D) product for many rows and for decoding, else three products.
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> project_self(const torch::Tensor& x, bool decoding) const;
};

TORCH_MODULE(SelfAttention);

}  // namespace qkv
