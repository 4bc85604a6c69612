// The tiled kernel's dropout: which (row, key) pairs are kept, as a pure function of a seed and
// the pair's position, so that the backward regenerates the forward's mask without storing it.
// Private to qkv.
#pragma once

#include <cstdint>

namespace qkv::kernels::tiled {

/// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): four
/// random 32-bit words for a 128-bit counter under a 64-bit key.
struct Philox {
  uint32_t key0, key1;
  void generate(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t out[4]) const;
};

/// Dropout with probability p under one seed. Each row of each head gets a 64-bit key from Philox
/// of (row, head); a vectorised hash of (row key, key position) then decides each pair
/// (vector_math.h). With 64-bit row keys two of R rows share a mask with probability about
/// R² / 2⁶⁵, not R² / 2³³ as with 32-bit keys (a million rows: 3e-8 instead of 100 shared masks).
class DropoutStream {
 public:
  DropoutStream(uint64_t seed, double p);

  bool active() const { return active_; }
  /// 1 / (1 - p): what kept pairs are multiplied by.
  double scale() const { return scale_; }

  /// The 64-bit key of `row` of head `head` (head counts batch and heads: b · H + h).
  uint64_t row_key(int64_t head, int64_t row) const;

  /// keep[c] for keys j0 .. j0 + count - 1 of `row` of `head`: 1 kept, 0 dropped.
  void keep(int64_t head, int64_t row, int64_t j0, int64_t count, uint8_t* keep) const;

 private:
  Philox philox_;
  uint32_t threshold_;  // a hash below it drops the pair: probability p
  double scale_;
  bool active_;
};

}  // namespace qkv::kernels::tiled
