// qkv::KVCache: the keys and values of the positions a decoder has seen, for incremental decoding.
#pragma once

#include <c10/util/Optional.h>
#include <torch/types.h>

#include <cstdint>
#include <utility>

namespace qkv {

class SelfAttentionImpl;

/// The projected (and, with RoPE, rotated) keys and values of the first length() positions of a
/// batch of sequences, in storage preallocated for capacity() positions: appending a position
/// never reallocates. Made by SelfAttention::make_cache or TransformerBlock::make_cache, which
/// size it for the module, and filled by their forward_with_cache. One cache serves one module
/// (one layer); a model of L layers keeps L caches.
///
/// Cached decoding is for inference: call it under torch::NoGradGuard, on a module in eval() mode
/// (or without dropout). A failed call (overflow, wrong batch size, dtype or device, a cache made
/// by a module of another shape or rotary base) throws c10::Error and leaves the cache as it was.
///
/// A cache owns its storage and is move-only: a copy would share the keys and values but keep its
/// own length, and two copies would overwrite each other's positions. clone() makes an independent
/// one (e.g. to branch a beam or a draft from a common prefix).
class KVCache {
 public:
  /// An empty cache for `batch` sequences of up to `capacity` positions, with `kv_heads` heads of
  /// keys of width `head_dim` and values of width `value_dim`, of `options`' dtype and device.
  KVCache(int64_t batch, int64_t kv_heads, int64_t capacity, int64_t head_dim, int64_t value_dim,
          const torch::TensorOptions& options);

  KVCache(KVCache&&) noexcept = default;
  KVCache& operator=(KVCache&&) noexcept = default;
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  /// An independent cache with the same positions: its own copy of the storage.
  KVCache clone() const;

  /// Positions held.
  int64_t length() const { return length_; }
  /// Positions it can hold, fixed at creation.
  int64_t capacity() const { return keys_.size(2); }
  int64_t batch_size() const { return keys_.size(0); }
  int64_t kv_heads() const { return keys_.size(1); }
  int64_t head_dim() const { return keys_.size(3); }
  int64_t value_dim() const { return values_.size(3); }
  torch::ScalarType dtype() const { return keys_.scalar_type(); }
  torch::Device device() const { return keys_.device(); }

  /// Forgets every position (length 0) and keeps the storage, for the next sequence.
  void reset() { length_ = 0; }
  /// Forgets the positions from `length` on (rolling back tokens, e.g. a rejected draft); the
  /// storage is kept. Throws c10::Error unless 0 <= length <= length().
  void truncate(int64_t length);

  /// The cached keys (B, Hkv, length, D) and values (B, Hkv, length, Dv): views of the storage.
  torch::Tensor keys() const;
  torch::Tensor values() const;

  /// Checks, naming `caller` and what does not fit, that `new_positions` more positions of a
  /// batch of `batch` in `dtype` on `device` fit into this cache; changes nothing.
  void check_append(const char* caller, int64_t batch, int64_t new_positions, torch::ScalarType dtype,
                    const torch::Device& device) const;

  /// Writes `keys` (B, Hkv, T, D) and `values` (B, Hkv, T, Dv) at positions [length, length + T)
  /// and returns the views of all cached keys and values, [0, length + T). Checks first
  /// (check_append and the head geometry), so a failure leaves the cache unchanged.
  std::pair<torch::Tensor, torch::Tensor> append(const torch::Tensor& keys, const torch::Tensor& values);

 private:
  friend class SelfAttentionImpl;  // stores and reads the rotary tables below

  KVCache() = default;  // for clone()

  torch::Tensor keys_;    // (B, Hkv, capacity, D)
  torch::Tensor values_;  // (B, Hkv, capacity, Dv)
  int64_t length_ = 0;
  // The rotary base of the module that made the cache (unset: a module without RoPE): keys
  // rotated with one base are wrong for a module with another, so a mismatch is refused.
  c10::optional<double> rope_base_;
  // A RoPE module's cos θ / sin θ for positions [0, capacity), (capacity, D/2) each, computed
  // once by make_cache instead of at every decoded position; undefined without RoPE.
  torch::Tensor rope_cos_, rope_sin_;
};

}  // namespace qkv
