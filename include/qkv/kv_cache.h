// qkv::KVCache: the keys and values of the positions a decoder has seen, for incremental decoding.
#pragma once

#include <c10/util/Optional.h>
#include <torch/types.h>

#include <cstdint>
#include <utility>

namespace qkv {

class SelfAttentionImpl;

/// The projected (and, with RoPE, rotated) keys and values of the positions a batch of sequences
/// has seen, in storage preallocated once: appending a position never reallocates. Made by
/// SelfAttention::make_cache or TransformerBlock::make_cache, which size it for the module, and
/// filled by their forward_with_cache. One cache serves one module (one layer); a model of L
/// layers keeps L caches.
///
/// Two kinds. A plain cache holds positions 0 .. capacity() - 1 and refuses more. A rolling cache
/// (made for a module with a sliding window W) has W slots and keeps the last W positions: slot
/// p mod W holds position p, decoding never stops, and its memory stays W positions however long
/// the sequence grows.
///
/// Cached decoding is for inference: call it under torch::NoGradGuard, on a module in eval() mode
/// (or without dropout). A failed call (overflow, wrong batch size, dtype or device, a cache made
/// by a module of another shape, rotary base or window) throws c10::Error and leaves the cache as
/// it was.
///
/// A cache owns its storage and is move-only: a copy would share the keys and values but keep its
/// own length, and two copies would overwrite each other's positions. clone() makes an independent
/// one (e.g. to branch a beam or a draft from a common prefix).
class KVCache {
 public:
  /// An empty plain cache for `batch` sequences of up to `capacity` positions, with `kv_heads`
  /// heads of keys of width `head_dim` and values of width `value_dim`, of `options`' dtype and device.
  KVCache(int64_t batch, int64_t kv_heads, int64_t capacity, int64_t head_dim, int64_t value_dim,
          const torch::TensorOptions& options);

  /// An empty rolling cache of `window` slots (see above).
  static KVCache rolling(int64_t batch, int64_t kv_heads, int64_t window, int64_t head_dim, int64_t value_dim,
                         const torch::TensorOptions& options);

  KVCache(KVCache&&) noexcept = default;
  KVCache& operator=(KVCache&&) noexcept = default;
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  /// An independent cache with the same positions: its own copy of the storage.
  KVCache clone() const;

  /// Positions seen (for a rolling cache, possibly more than it holds).
  int64_t length() const { return length_; }
  /// Slots: the positions a plain cache can hold, the window of a rolling one. Fixed at creation.
  int64_t capacity() const { return keys_.size(2); }
  /// Whether the cache rolls (keeps the last capacity() positions) instead of refusing more.
  bool rolling() const { return window_.has_value(); }
  /// Positions held now: the last held() of the length() seen.
  int64_t held() const { return std::min(length_, capacity()); }
  int64_t batch_size() const { return keys_.size(0); }
  int64_t kv_heads() const { return keys_.size(1); }
  int64_t head_dim() const { return keys_.size(3); }
  int64_t value_dim() const { return values_.size(3); }
  /// Bytes of the keys' and values' storage: fixed at creation (capacity() slots), however many
  /// positions pass through a rolling cache.
  int64_t storage_bytes() const { return static_cast<int64_t>(keys_.nbytes() + values_.nbytes()); }
  torch::ScalarType dtype() const { return keys_.scalar_type(); }
  torch::Device device() const { return keys_.device(); }

  /// Forgets every position (length 0) and keeps the storage, for the next sequence.
  void reset() { length_ = 0; }
  /// Forgets the positions from `length` on (rolling back tokens, e.g. a rejected draft); the
  /// storage is kept. Throws c10::Error unless 0 <= length <= length(); a rolling cache that has
  /// wrapped cannot go back (the window of the next position would reach positions overwritten).
  void truncate(int64_t length);

  /// The held keys (B, Hkv, held(), D) and values (B, Hkv, held(), Dv), oldest first: views of the
  /// storage, or a new tensor for a rolling cache that has wrapped.
  torch::Tensor keys() const;
  torch::Tensor values() const;

  /// Checks, naming `caller` and what does not fit, that `new_positions` more positions of a
  /// batch of `batch` in `dtype` on `device` fit into this cache; changes nothing.
  void check_append(const char* caller, int64_t batch, int64_t new_positions, torch::ScalarType dtype,
                    const torch::Device& device) const;

  /// Writes `keys` (B, Hkv, T, D) and `values` (B, Hkv, T, Dv) as positions [length, length + T)
  /// (a rolling cache keeps the last capacity() of them) and returns keys() and values() after it.
  /// Checks first (check_append and the head geometry), so a failure leaves the cache unchanged.
  std::pair<torch::Tensor, torch::Tensor> append(const torch::Tensor& keys, const torch::Tensor& values);

 private:
  friend class SelfAttentionImpl;  // reads the slots and the rotary tables directly

  KVCache() = default;  // for clone() and rolling()

  // The held positions from `first` on, oldest first (rolling: put back in order when wrapped).
  torch::Tensor chronological(const torch::Tensor& storage, int64_t first) const;
  // Writes new positions into their slots, without checks.
  void write(const torch::Tensor& keys, const torch::Tensor& values);

  torch::Tensor keys_;    // (B, Hkv, capacity, D)
  torch::Tensor values_;  // (B, Hkv, capacity, Dv)
  int64_t length_ = 0;
  // The rotary base of the module that made the cache (unset: a module without RoPE): keys
  // rotated with one base are wrong for a module with another, so a mismatch is refused.
  c10::optional<double> rope_base_;
  // The window of the module that made a rolling cache; unset: a plain cache.
  c10::optional<int64_t> window_;
  // A RoPE module's cos θ / sin θ for positions [0, capacity), (capacity, D/2) each, computed
  // once by make_cache instead of at every decoded position; undefined without RoPE, and for a
  // rolling cache (whose positions grow without bound: computed per call).
  torch::Tensor rope_cos_, rope_sin_;
};

}  // namespace qkv
