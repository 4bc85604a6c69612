// Masks for SelfAttention: which keys each query may attend to.
//
// Polarity, the same in all of qkv: TRUE MEANS "MAY ATTEND". A boolean mask is true at the
// (query, key) pairs that take part in attention and false at those that are masked out, as in
// `at::scaled_dot_product_attention`. PyTorch's nn.MultiheadAttention uses the opposite polarity
// for its boolean masks (true = ignore); invert those (`~mask`) when porting code.
// A floating mask is added to the scaled scores: 0 keeps a pair, -inf removes it.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace qkv {

/// The masks SelfAttention::forward accepts; every field is optional and they combine (a pair is
/// attended only if every given mask allows it). Shapes are for batched input (B, N, E) with a
/// context of S positions; for unbatched input (N, E) leave out the B dimension.
struct AttentionMask {
  /// int64 (B,): batch element b has key_lengths[b] real keys; keys at positions >= that are padding.
  torch::Tensor key_lengths;
  /// bool (B, S): true for real keys, false for padding.
  torch::Tensor key_mask;
  /// bool (true = attend) or floating (added to scores), of shape (N, S), (B, N, S) or (B, H, N, S),
  /// 1 for B or H where one mask serves the whole batch or every head (a learned bias (1, H, N, S)).
  torch::Tensor attn_mask;

  bool empty() const { return !key_lengths.defined() && !key_mask.defined() && !attn_mask.defined(); }

  static AttentionMask from_lengths(torch::Tensor lengths) {
    AttentionMask mask;
    mask.key_lengths = std::move(lengths);
    return mask;
  }
  static AttentionMask from_key_mask(torch::Tensor key_mask) {
    AttentionMask mask;
    mask.key_mask = std::move(key_mask);
    return mask;
  }
  static AttentionMask from_attn_mask(torch::Tensor attn_mask) {
    AttentionMask mask;
    mask.attn_mask = std::move(attn_mask);
    return mask;
  }
};

/// bool (B, S), true for the first lengths[b] positions of row b: the key mask of padded batches.
torch::Tensor key_mask_from_lengths(const torch::Tensor& lengths, int64_t max_len);

/// bool (N, S), true where key j <= query i (top-left aligned, as PyTorch's is_causal).
torch::Tensor causal_mask(int64_t num_queries, int64_t num_keys, const torch::Device& device = torch::kCPU);

/// bool (N, S), true where i - window < j <= i: causal attention within a sliding window of
/// `window` keys (the band SelfAttentionOptions::window attends to), top-left aligned.
torch::Tensor sliding_window_mask(int64_t num_queries, int64_t num_keys, int64_t window,
                                  const torch::Device& device = torch::kCPU);

}  // namespace qkv
