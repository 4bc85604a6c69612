// The tiled kernel's block products C = alpha · A · B + beta · C on qkv's own register-blocked
// micro-kernels, with B packed once into column panels and then multiplied by many A (the key and
// value blocks of a head meet every query block). Float32 products on AVX-512, AVX2 + FMA or plain
// C++; bfloat16 products on AVX512_BF16 (vdpbf16ps: bfloat16 pairs multiplied and summed in
// float32), chosen at run time (cpu_features.h). The kernel's reference for them is OpenBLAS
// (blocks.h), which the tests compare against. Private to qkv.
//
// The layout follows BLIS and the GEMM micro-kernels of PyTorch's and oneDNN's CPU attention: a
// tile of MR rows × NR columns of C lives in registers for the whole reduction; each step loads
// one row of a B panel (NR contiguous values) and broadcasts one value of each of A's MR rows.
#pragma once

#include "kernels/tiled/aligned_buffer.h"
#include "kernels/tiled/cpu_features.h"
#include "kernels/tiled/vector_math.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

namespace qkv::kernels::tiled {

/// A matrix as it lies in memory: element (r, c) at data[r * row_stride + c * col_stride]. A
/// transposed view swaps the strides.
template <typename T>
struct Strided {
  const T* data = nullptr;
  int64_t row_stride = 0, col_stride = 1;
  Strided transposed() const { return {data, col_stride, row_stride}; }
};

/// How a block product multiplies: float32 values on an instruction set's float path, or bfloat16
/// pairs (on ProductIsa::Avx512Bf16 with vdpbf16ps, on ProductIsa::AmxBf16 with AMX tiles)
/// accumulated in float32.
struct ProductKind {
  ProductIsa isa = ProductIsa::Portable;
  bool bf16 = false;
};

/// The right operand B (k × n) of a block product, packed: float32 panels [n / NR][k][NR], or
/// bfloat16 panels [n / 32][pair_depth()][32][2] (row pairs interleaved for vdpbf16ps, which is
/// also AMX's layout of B; pair_depth() = ceil(k / 2), for AMX rounded up to whole tiles of 16
/// pairs); padded with zeros. Where the last of several 32-column panels would hold 16 columns or
/// fewer (n = 80 = 32 + 32 + 16: a head width of 80, or a key block's last columns), it is packed
/// 16 wide and multiplied by the narrow tiles, which spares the products the zero columns (n = 80
/// multiplied 96 columns; the 16-wide panel starts where a 32-wide one would, so every panel keeps
/// its offset). Its storage is kept between packs, so a reused one allocates once.
class PackedRight {
 public:
  /// Packs b (k × n); bfloat16 products round float32 values to bfloat16 (nearest even). float16
  /// values are widened to float32: they multiply on the float32 products only.
  void pack(Strided<float> b, int64_t k, int64_t n, ProductKind kind);
  void pack(Strided<c10::BFloat16> b, int64_t k, int64_t n, ProductKind kind);
  void pack(Strided<c10::Half> b, int64_t k, int64_t n, ProductKind kind);
  /// Lays this operand out as a bfloat16 B (k × n) for `kind`'s bfloat16 products and hands its
  /// panels to the caller to fill, whole: every pair up to pair_depth() of every column up to a
  /// multiple of panel_width(), zeros past k and n (softmax_backward_block writes them so).
  PairPanels bf16_panels_to_fill(int64_t k, int64_t n, ProductKind kind);
  /// Takes b (k × n) where it lies, without packing, where its rows are contiguous float32 values
  /// (unit column stride) and every panel is whole (n a multiple of 16): the products then read
  /// each panel's rows row_stride apart. Otherwise packs it. For an operand used by few rows of A
  /// (a few query rows against a long cache), whose packing cost as much as the products.
  /// b must outlive the products.
  void borrow(Strided<float> b, int64_t k, int64_t n, ProductKind kind);

  int64_t k() const { return k_; }
  int64_t n() const { return n_; }
  ProductKind kind() const { return kind_; }
  int64_t panel_width() const { return panel_; }
  /// The columns that lie in panels panel_width() wide: n rounded up to a whole panel, or short of
  /// n by the narrow last panel (kNarrowPanelWidth columns wide) where there is one.
  int64_t wide_columns() const { return wide_columns_; }
  int64_t pair_depth() const { return depth_; }
  const float* f32() const { return borrowed_ != nullptr ? borrowed_ : f32_.data(); }
  /// The row stride of a borrowed B; 0 where it is packed.
  int64_t borrowed_row_stride() const { return borrowed_row_stride_; }
  const uint16_t* bf16() const { return bf16_.data(); }

 private:
  template <typename T>
  void pack_any(Strided<T> b, int64_t k, int64_t n, ProductKind kind);
  // The operand's shape and kind, no borrowed rows (every way of filling it starts here); refuses an
  // instruction set this CPU lacks.
  void take_shape(int64_t k, int64_t n, ProductKind kind);

  ProductKind kind_;
  // Lays out panels for `kind` (panel_, wide_columns_); returns the values the panels hold.
  int64_t lay_out(int64_t n, ProductKind kind, int64_t values_per_column, bool narrow_tail);
  int64_t width_at(int64_t j0) const { return j0 < wide_columns_ ? panel_ : kNarrowPanelWidth; }
  static constexpr int64_t kNarrowPanelWidth = 16;

  int64_t k_ = 0, n_ = 0, panel_ = 0, wide_columns_ = 0, depth_ = 0;
  AlignedVector<float> f32_;  // on cache lines: each panel row and AMX tile starts on one
  AlignedVector<uint16_t> bf16_;
  const float* borrowed_ = nullptr;
  int64_t borrowed_row_stride_ = 0;
};

/// The part of a packed B a product uses: its first k rows and first n columns (-1: all of them).
/// A causal block's rows see a prefix of its keys: the block is packed once, whole, and each
/// query block multiplies by the prefix it sees.
struct Leading {
  int64_t k = -1, n = -1;
};

/// C (m × n, row stride ldc) = alpha · A · B + beta · C with A (m × k) as strided and B's leading
/// k × n (default: all of b); beta = 0 never reads C. Accumulates in float32; bfloat16 products
/// round A to bfloat16 first.
void multiply(Strided<float> a, int64_t m, const PackedRight& b, float alpha, float beta, float* c, int64_t ldc,
              Leading part = {});
void multiply(Strided<c10::BFloat16> a, int64_t m, const PackedRight& b, float alpha, float beta, float* c,
              int64_t ldc, Leading part = {});
/// float16 rows of A, widened to float32 (b packed for float32 products).
void multiply(Strided<c10::Half> a, int64_t m, const PackedRight& b, float alpha, float beta, float* c, int64_t ldc,
              Leading part = {});

}  // namespace qkv::kernels::tiled
