// Options of qkv's attention: the module's (SelfAttentionOptions) and the functional core's
// (ScaledDotProductAttentionOptions), in the shape of LibTorch's own options structs.
#pragma once

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <ostream>

namespace qkv {

/// Which implementation computes softmax(QKᵀ·scale)·V.
enum class AttentionBackend {
  /// The fastest available one that can do what is asked (see choose_backend in functional.h).
  Auto,
  /// The documents' four steps written out with tensor ops; always available, can return weights.
  Math,
  /// `at::scaled_dot_product_attention` (LibTorch >= 2.0): flash / cuDNN / memory-efficient
  /// kernels on CUDA, a fused kernel on the CPU. Never materialises the (N, S) weights, so it
  /// cannot return them.
  Fused,
  /// qkv's own tiled CPU kernel (FlashAttention-2 style, forward and backward, O(N) memory, dropout
  /// inside the kernel), on every LibTorch. CPU tensors of float32, float64 or bfloat16.
  Tiled,
};

const char* to_string(AttentionBackend backend);
std::ostream& operator<<(std::ostream& stream, AttentionBackend backend);

/// True when this build's LibTorch has `at::scaled_dot_product_attention` (>= 2.0).
bool fused_backend_available();

/// Options of `qkv::scaled_dot_product_attention`.
///
/// Mask polarity, the same everywhere in qkv: a boolean mask is true where a query MAY attend to
/// a key (as `at::scaled_dot_product_attention`; the opposite of nn.MultiheadAttention's
/// `key_padding_mask`). A floating mask is added to the scaled scores (0 = attend, -inf = not).
struct ScaledDotProductAttentionOptions {
  /// Boolean (true = attend) or floating (added to the scores) mask, broadcastable to the
  /// scores' shape (..., H, N, S). Undefined: no mask.
  TORCH_ARG(torch::Tensor, mask) = {};
  /// Query i attends only to keys j <= i (top-left aligned when N != S, as PyTorch).
  TORCH_ARG(bool, causal) = false;
  /// Sliding-window attention (Mistral; FlashAttention's window_size = (W - 1, 0)): with `causal`,
  /// query i attends only to keys i - W + 1 ... i. Unset: full (causal) attention. Needs causal.
  TORCH_ARG(c10::optional<int64_t>, window) = c10::nullopt;
  /// Integers (B,) in [0, S] for inputs (B, H, N, D), of any integer dtype: keys at positions >=
  /// key_lengths[b] are padding (as a mask false there). Backends that know it skip those keys
  /// instead of masking them.
  TORCH_ARG(torch::Tensor, key_lengths) = {};
  /// Multiplier of QKᵀ. Unset: 1/sqrt(d_k), d_k = q.size(-1). 1.0 gives the unscaled variant.
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
  /// Dropout probability on the attention weights, applied only when `training` is true.
  TORCH_ARG(double, dropout) = 0.0;
  TORCH_ARG(bool, training) = false;
  /// Grouped-query attention: k and v may have fewer heads (dimension -3) than q, Hkv dividing H;
  /// query head h then uses key/value head h / (H / Hkv), as PyTorch's `enable_gqa`.
  TORCH_ARG(bool, enable_gqa) = false;
  /// Return the softmax weights too (forces the math backend).
  TORCH_ARG(bool, need_weights) = false;
  TORCH_ARG(AttentionBackend, backend) = AttentionBackend::Auto;
};

/// Options of `qkv::SelfAttention`. With only `d_model` given it is the documents' module:
/// three Linear(d_model, d_model) with bias, one head, scale 1/sqrt(d_model), no output map.
struct SelfAttentionOptions {
  /* implicit */ SelfAttentionOptions(int64_t d_model) : d_model_(d_model) {}

  /// Width E of the queries and of the module's output.
  TORCH_ARG(int64_t, d_model);
  /// Number of query heads H; d_model must be divisible by it. Each head has width D = E / H.
  TORCH_ARG(int64_t, num_heads) = 1;
  /// Number of key/value heads Hkv (grouped-query attention): W_k and W_v project to Hkv · D and
  /// each group of H / Hkv query heads shares one key/value head. Unset: H (ordinary multi-head);
  /// 1: multi-query attention. Must divide num_heads.
  TORCH_ARG(c10::optional<int64_t>, num_kv_heads) = c10::nullopt;
  /// Biases in W_q, W_k, W_v (and W_o).
  TORCH_ARG(bool, bias) = true;
  /// Causal mask: query i attends only to keys j <= i.
  TORCH_ARG(bool, causal) = false;
  /// Sliding window W (needs causal): query i attends only to keys i - W + 1 ... i, so the cost
  /// grows as N · W instead of N², and a KV cache needs only the last W positions (it then rolls:
  /// make_cache). Unset: full causal attention.
  TORCH_ARG(c10::optional<int64_t>, window) = c10::nullopt;
  /// Dropout probability on the attention weights while training; in [0, 1).
  TORCH_ARG(double, dropout) = 0.0;
  /// Multiplier of QKᵀ. Unset: 1/sqrt(D). 1.0 gives the unscaled variant the documents warn about.
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
  /// Rotary position embedding (RoPE) of each head's queries and keys, after the projections and
  /// before the scores, in the half-split ("rotate_half") convention of GPT-NeoX and Hugging
  /// Face's LLaMA: the pairs rotated together are (x[i], x[i + D/2]), i < D/2, by the angle
  /// position · rope_base^(-2i/D). Needs an even head width D. Self-attention positions count from
  /// 0 (from the cache's length with forward_with_cache); a cross-attention context's keys are
  /// numbered from 0 too.
  TORCH_ARG(bool, rope) = false;
  /// The base of RoPE's frequencies (10000 as in RoFormer and LLaMA).
  TORCH_ARG(double, rope_base) = 10000.0;
  /// Add an output map W_o: Linear(d_model, d_model) after the heads are joined.
  TORCH_ARG(bool, out_proj) = false;
  /// Width of the inputs that feed W_k (cross-attention context). Unset: d_model.
  TORCH_ARG(c10::optional<int64_t>, kdim) = c10::nullopt;
  /// Width of the inputs that feed W_v. Unset: d_model.
  TORCH_ARG(c10::optional<int64_t>, vdim) = c10::nullopt;
  TORCH_ARG(AttentionBackend, backend) = AttentionBackend::Auto;
};

}  // namespace qkv
