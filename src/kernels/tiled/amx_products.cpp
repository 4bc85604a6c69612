// AMX block products. A tile of C is 16 rows × 16 float32 columns; each pass of the reduction
// loads A's tiles (16 rows × 16 pairs) and B's (16 pairs × 16 columns) and runs TDPBF16PS on up to
// 2 × 2 C tiles (32 × 32 of C: 4 of the 8 tile registers for C, 2 for A, 2 for B), as oneDNN's
// brgemm and PyTorch's CPU flash attention block their AMX products.
//
// The tile configuration (every tile 16 rows of 64 bytes) is per thread and shared with whatever
// else uses AMX on it (oneDNN inside LibTorch configures its own): each product reads the current
// one (sttilecfg, about 10 ns here) and loads its own (ldtilecfg, about 100 ns) only when it differs.
// The code is compiled for AMX by target attributes, so the file needs no special flags; it runs
// only where cpu_features.cpp found AMX-BF16 and the kernel granted the tiles.
#include "kernels/tiled/amx_products.h"

#include "kernels/tiled/lane_shuffles.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 intrinsics pass an undefined vector as the unused merge source, which its own
// -Wuninitialized and -Wmaybe-uninitialized then report at each use (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#define QKV_AMX 1
#define QKV_TARGET_AMX \
  __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
#endif

namespace qkv::kernels::tiled::amx {

#if defined(QKV_AMX)
namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kValuesPerTileRow = 2 * kPairsPerTile;  // 32 bfloat16 = 64 bytes

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }
inline uint16_t bf16_bits(float x) { return c10::BFloat16(x).x; }  // nearest even
inline uint16_t bf16_bits(c10::BFloat16 x) { return x.x; }

// palette 1, every tile 16 rows × 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

const TileConfig& our_config() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.bytes_per_row[t] = 64, c.rows[t] = kTileRows;
    return c;
  }();
  return config;
}

QKV_TARGET_AMX void configure_tiles() {
  TileConfig current;
  _tile_storeconfig(&current);
  if (std::memcmp(&current, &our_config(), sizeof(TileConfig)) != 0) _tile_loadconfig(&our_config());
}

QKV_TARGET_AMX inline __mmask16 lanes16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1u);
}
QKV_TARGET_AMX inline __mmask32 lanes32(int64_t n) {
  return n >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << std::max<int64_t>(n, 0)) - 1u);
}

// A's tiles: rows [0, main_rows) at `main` (main_stride bfloat16 values apart), the rest (one
// group of 16 at most) at `tail` (tail_stride apart); each row holds the product's pairs padded
// with zeros to whole tiles, and rows past m are zeros.
struct LeftTiles {
  const uint16_t* main = nullptr;
  int64_t main_stride = 0, main_rows = 0;
  const uint16_t* tail = nullptr;
  int64_t tail_stride = 0;
  // Row i0's tile (i0 a multiple of 16) and its row stride in bytes.
  const uint16_t* tile(int64_t i0, int64_t& stride_bytes) const {
    if (i0 < main_rows) {
      stride_bytes = main_stride * 2;
      return main + i0 * main_stride;
    }
    stride_bytes = tail_stride * 2;
    return tail + (i0 - main_rows) * tail_stride;
  }
};

// A (m × k) float32 rows, rounded into `out` (rows of `padded_k`, m_pad rows; zeros past k and m).
QKV_TARGET_AMX void round_rows(const float* a, int64_t ars, int64_t m, int64_t m_pad, int64_t k, int64_t padded_k,
                               uint16_t* out) {
  for (int64_t r = 0; r < m; ++r) {
    const float* row = a + r * ars;
    uint16_t* to = out + r * padded_k;
    for (int64_t p = 0; p < padded_k; p += 32) {
      const __m512 low = _mm512_maskz_loadu_ps(lanes16(k - p), row + p);
      const __m512 high = _mm512_maskz_loadu_ps(lanes16(k - p - 16), row + p + 16);
      _mm512_storeu_si512(to + p, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
  }
  std::fill(out + m * padded_k, out + m_pad * padded_k, uint16_t(0));
}

// A stored transposed (k rows of m float32 values, `stride` apart: element (r, p) at x[p·stride + r]),
// rounded into rows of A as above: for 16 rows × 16 pairs at a time, each pair of stored rows is
// rounded and interleaved value by value (one 32-bit pair per row of A), and the 16 × 16 pairs transposed.
QKV_TARGET_AMX void round_transposed(const float* x, int64_t stride, int64_t m, int64_t m_pad, int64_t k,
                                     int64_t padded_k, uint16_t* out) {
  for (int64_t r0 = 0; r0 < m_pad; r0 += 16) {
    const __mmask16 rows = lanes16(m - r0);
    for (int64_t p0 = 0; p0 < padded_k; p0 += 32) {
      __m512i pairs[16];
      for (int t = 0; t < 16; ++t) {
        const int64_t p = p0 + 2 * t;
        const __m512 even = p < k ? _mm512_maskz_loadu_ps(rows, x + p * stride + r0) : _mm512_setzero_ps();
        const __m512 odd = p + 1 < k ? _mm512_maskz_loadu_ps(rows, x + (p + 1) * stride + r0) : _mm512_setzero_ps();
        pairs[t] = interleave_halves((__m512i)_mm512_cvtne2ps_pbh(odd, even));
      }
      transpose_16x16(pairs);  // pairs[r]: row r0 + r's 16 pairs from p0 on
      for (int r = 0; r < 16; ++r) _mm512_storeu_si512(out + (r0 + r) * padded_k + p0, pairs[r]);
    }
  }
}

// bfloat16 rows [first, m) copied with zeros past k (and rows up to m_pad of zeros).
QKV_TARGET_AMX void copy_rows(const uint16_t* a, int64_t ars, int64_t first, int64_t m, int64_t m_pad, int64_t k,
                              int64_t padded_k, uint16_t* out) {
  for (int64_t r = first; r < m; ++r) {
    for (int64_t p = 0; p < padded_k; p += 32) {
      _mm512_storeu_si512(out + (r - first) * padded_k + p, _mm512_maskz_loadu_epi16(lanes32(k - p), a + r * ars + p));
    }
  }
  std::fill(out + (m - first) * padded_k, out + (m_pad - first) * padded_k, uint16_t(0));
}

template <typename T>
LeftTiles left_tiles(Strided<T> a, int64_t m, int64_t k, int64_t padded_k, AlignedVector<uint16_t>& scratch) {
  const int64_t m_pad = round_up(m, kTileRows);
  LeftTiles tiles;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const auto* bits = reinterpret_cast<const uint16_t*>(a.data);
    if (a.col_stride == 1 && k == padded_k) {  // whole tiles where they lie; the last rows copied
      tiles.main = bits, tiles.main_stride = a.row_stride, tiles.main_rows = m / kTileRows * kTileRows;
      if (tiles.main_rows < m) {
        scratch.resize(static_cast<size_t>(kTileRows * padded_k));
        copy_rows(bits, a.row_stride, tiles.main_rows, m, m_pad, k, padded_k, scratch.data());
        tiles.tail = scratch.data(), tiles.tail_stride = padded_k;
      }
      return tiles;
    }
  }
  scratch.resize(static_cast<size_t>(m_pad * padded_k));
  tiles.main = scratch.data(), tiles.main_stride = padded_k, tiles.main_rows = m_pad;
  if constexpr (std::is_same_v<T, float>) {
    if (a.col_stride == 1) {
      round_rows(a.data, a.row_stride, m, m_pad, k, padded_k, scratch.data());
      return tiles;
    }
    if (a.row_stride == 1) {
      round_transposed(a.data, a.col_stride, m, m_pad, k, padded_k, scratch.data());
      return tiles;
    }
  } else {
    if (a.col_stride == 1) {
      copy_rows(reinterpret_cast<const uint16_t*>(a.data), a.row_stride, 0, m, m_pad, k, padded_k, scratch.data());
      return tiles;
    }
  }
  std::fill(scratch.begin(), scratch.end(), uint16_t(0));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t p = 0; p < k; ++p) scratch[r * padded_k + p] = bf16_bits(a.data[r * a.row_stride + p * a.col_stride]);
  }
  return tiles;
}

// One block of RT × CT C tiles at rows i0: column tile t of B is `panels` + t · panel_step (B's
// panels are one tile wide, its tiles 1 KiB in one piece); `clean_last` replaces their last pass
// (rows of B past the product's k zeroed) where not null, its column tiles one tile apart. Valid
// rows and columns of C may be fewer than the tiles cover.
template <int RT, int CT>
QKV_TARGET_AMX void block(const LeftTiles& a, int64_t i0, const uint16_t* panels, int64_t panel_step, int64_t passes,
                          const uint16_t* clean_last, int64_t rows, int64_t cols, float alpha, float beta, float* c,
                          int64_t ldc) {
  constexpr int64_t kTileValues = kPairsPerTile * 2 * 16;  // one tile of B: 16 pairs × 16 columns × 2
  constexpr int64_t kBStride = 16 * 2 * sizeof(uint16_t);
  const int64_t c_stride = ldc * static_cast<int64_t>(sizeof(float));
  // Whole tiles of C that take the sums as they are (alpha = 1) are multiplied into where they lie:
  // loaded first where beta = 1 (the kernel's accumulators), stored at the end.
  const bool whole = rows >= 16 * RT && cols >= 16 * CT && alpha == 1.0f;
  const bool accumulate_in_place = whole && beta == 1.0f;
  if (accumulate_in_place) {
    _tile_loadd(0, c, c_stride);
    if constexpr (CT == 2) _tile_loadd(1, c + 16, c_stride);
    if constexpr (RT == 2) _tile_loadd(2, c + 16 * ldc, c_stride);
    if constexpr (RT == 2 && CT == 2) _tile_loadd(3, c + 16 * ldc + 16, c_stride);
  } else {
    _tile_zero(0);
    if constexpr (CT == 2) _tile_zero(1);
    if constexpr (RT == 2) _tile_zero(2);
    if constexpr (RT == 2 && CT == 2) _tile_zero(3);
  }
  int64_t a0_stride = 0, a1_stride = 0;
  const uint16_t* a0 = a.tile(i0, a0_stride);
  const uint16_t* a1 = RT == 2 ? a.tile(i0 + 16, a1_stride) : nullptr;
  for (int64_t pass = 0; pass < passes; ++pass) {
    const bool last_clean = pass + 1 == passes && clean_last != nullptr;
    const uint16_t* b0 = last_clean ? clean_last : panels + pass * kTileValues;
    const uint16_t* b1 = last_clean ? clean_last + kTileValues : b0 + panel_step;
    _tile_loadd(4, a0 + pass * kValuesPerTileRow, a0_stride);
    if constexpr (RT == 2) _tile_loadd(5, a1 + pass * kValuesPerTileRow, a1_stride);
    _tile_loadd(6, b0, kBStride);
    if constexpr (CT == 2) _tile_loadd(7, b1, kBStride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RT == 2 && CT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  // C's rows should then not lie a multiple of 1 KiB apart (the stores measured 10% slower where
  // they did: kernel.h, kScoresStride).
  if (accumulate_in_place || (whole && beta == 0.0f)) {
    _tile_stored(0, c, c_stride);
    if constexpr (CT == 2) _tile_stored(1, c + 16, c_stride);
    if constexpr (RT == 2) _tile_stored(2, c + 16 * ldc, c_stride);
    if constexpr (RT == 2 && CT == 2) _tile_stored(3, c + 16 * ldc + 16, c_stride);
    return;
  }
  // Otherwise the sums leave the tiles into a buffer of whole tiles (1 KiB each, in one piece),
  // then alpha · sums + beta · C go into C's valid rows and columns.
  alignas(64) float sums[4][16 * 16];
  constexpr int64_t kSumsStride = 16 * sizeof(float);
  _tile_stored(0, sums[0], kSumsStride);
  if constexpr (CT == 2) _tile_stored(1, sums[1], kSumsStride);
  if constexpr (RT == 2) _tile_stored(2, sums[2], kSumsStride);
  if constexpr (RT == 2 && CT == 2) _tile_stored(3, sums[3], kSumsStride);
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  const int64_t valid_rows = std::min<int64_t>(rows, 16 * RT);
  for (int64_t r = 0; r < valid_rows; ++r) {
    float* row = c + r * ldc;
    const float* tile_row = sums[(r / 16) * 2] + (r % 16) * 16;
    for (int v = 0; v < CT; ++v) {
      const __mmask16 mask = lanes16(cols - 16 * v);
      __m512 value = _mm512_load_ps(tile_row + v * 16 * 16);
      if (alpha != 1.0f) value = _mm512_mul_ps(value, va);
      if (beta != 0.0f) value = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, row + 16 * v), vb, value);
      _mm512_mask_storeu_ps(row + 16 * v, mask, value);
    }
  }
}

// C (32 rows × n_tiles · 16 columns, whole tiles) = A · B for a reduction of one pass (k <= 32:
// the scores QKᵀ and dP = dO Vᵀ at D <= 32), alpha = 1, beta = 0, straight into C. A's two tiles
// stay loaded across the row, and the C tiles alternate in pairs so that one column tile's products
// can run while the previous one's sums are stored; block<2, 2> zeroes, multiplies into and stores
// the same four C tiles block after block, so that its next products wait for its stores.
// On the bfloat16 core at B=8 H=8 N=512 D=32 1-4% faster than block<2, 2> in five comparisons with
// the build before (Intel Xeon with AMX, 2026-12-02, 2 threads and 1; the machine's noise is of
// that size): a tile store there costs as much as a product and does not overlap it
// (docs/PERFORMANCE.md), so at one pass per tile the products wait on the stores either way.
QKV_TARGET_AMX void single_pass_rows(const LeftTiles& a, int64_t i0, const uint16_t* panels, int64_t panel_step,
                                     int64_t n_tiles, float* c, int64_t ldc) {
  int64_t s0 = 0, s1 = 0;
  const uint16_t* a0 = a.tile(i0, s0);
  const uint16_t* a1 = a.tile(i0 + 16, s1);
  constexpr int64_t kBStride = 16 * 2 * sizeof(uint16_t);
  const int64_t cs = ldc * static_cast<int64_t>(sizeof(float));
  _tile_loadd(4, a0, s0);
  _tile_loadd(5, a1, s1);
  // Column tile T into C tiles C0 (rows 0-15) and C1 (rows 16-31), B's tile in register B; and the
  // storing of such a pair. Macros, not templates: GCC's tile intrinsics paste the register number
  // into their assembly text.
#define QKV_ONE_PASS_COLUMN(C0, C1, B, T)                \
  _tile_zero(C0);                                        \
  _tile_zero(C1);                                        \
  _tile_loadd(B, panels + (T) * panel_step, kBStride);   \
  _tile_dpbf16ps(C0, 4, B);                              \
  _tile_dpbf16ps(C1, 5, B);
#define QKV_STORE_COLUMN(C0, C1, T)                      \
  _tile_stored(C0, c + 16 * (T), cs);                    \
  _tile_stored(C1, c + 16 * ldc + 16 * (T), cs);
  // Column tile t into C tiles 0, 1 (t even) or 2, 3 (t odd); each pair stored after the other's products.
  int64_t t = 0;
  for (; t + 1 < n_tiles; t += 2) {
    QKV_ONE_PASS_COLUMN(0, 1, 6, t)
    if (t > 0) {
      QKV_STORE_COLUMN(2, 3, t - 1)
    }
    QKV_ONE_PASS_COLUMN(2, 3, 7, t + 1)
    QKV_STORE_COLUMN(0, 1, t)
  }
  if (t > 0) {
    QKV_STORE_COLUMN(2, 3, t - 1)
  }
  if (t < n_tiles) {  // an odd count: the last column tile
    QKV_ONE_PASS_COLUMN(0, 1, 6, t)
    QKV_STORE_COLUMN(0, 1, t)
  }
#undef QKV_ONE_PASS_COLUMN
#undef QKV_STORE_COLUMN
}

template <typename T>
QKV_TARGET_AMX void multiply_any(Strided<T> a, int64_t m, const PackedRight& b, int64_t k, int64_t n, float alpha,
                                 float beta, float* c, int64_t ldc) {
  TORCH_CHECK(b.kind().bf16 && b.kind().isa == ProductIsa::AmxBf16 && b.panel_width() == 16,
              "tiled kernel: an AMX product of an operand packed for ", isa_name(b.kind().isa));
  TORCH_CHECK(b.pair_depth() % kPairsPerTile == 0, "tiled kernel: an AMX operand of ", b.pair_depth(),
              " pairs (not whole tiles)");
  if (m == 0 || n == 0) return;
  configure_tiles();
  const int64_t pairs = (k + 1) / 2, passes = (pairs + kPairsPerTile - 1) / kPairsPerTile;
  const int64_t padded_k = passes * kValuesPerTileRow;
  thread_local AlignedVector<uint16_t> a_scratch, b_scratch;
  const LeftTiles left = left_tiles(a, m, k, padded_k, a_scratch);
  const int64_t panel_step = b.pair_depth() * 2 * 16;  // values from one column tile's panel to the next
  constexpr int64_t kRowValues = 2 * 16;                // one pair-row of a panel
  // A leading part whose last pass reaches into rows of B past k: that pass from a copy with them
  // zeroed (an odd k keeps only the first value of its last pair), so that a NaN or infinity in B
  // past the product cannot meet A's zeros.
  const bool clean = k < b.k() && k % kValuesPerTileRow != 0;
  const int64_t first = (passes - 1) * kPairsPerTile, whole = k / 2 - first;  // pairs of the last pass inside k
  // Whole groups of 32 rows of a one-pass product into C as it is: single_pass_rows; the rest below.
  int64_t first_row = 0;
  if (alpha == 1.0f && beta == 0.0f && passes == 1 && !clean && n % 16 == 0) {
    for (; first_row + 32 <= m; first_row += 32) {
      single_pass_rows(left, first_row, b.bf16(), panel_step, n / 16, c + first_row * ldc, ldc);
    }
  }
  for (int64_t j0 = 0; j0 < n; j0 += 32) {
    const int64_t cols = std::min<int64_t>(32, n - j0);
    const bool two_cols = cols > 16;
    const uint16_t* panels = b.bf16() + (j0 / 16) * panel_step;
    const uint16_t* clean_last = nullptr;
    if (clean) {
      b_scratch.assign(static_cast<size_t>(2 * kPairsPerTile * kRowValues), 0);
      for (int t = 0; t < (two_cols ? 2 : 1); ++t) {
        const uint16_t* from = panels + t * panel_step + first * kRowValues;
        uint16_t* to = b_scratch.data() + t * kPairsPerTile * kRowValues;
        std::memcpy(to, from, sizeof(uint16_t) * static_cast<size_t>(whole * kRowValues));
        if (k % 2 == 1) {
          for (int64_t j = 0; j < 16; ++j) to[whole * kRowValues + 2 * j] = from[whole * kRowValues + 2 * j];
        }
      }
      clean_last = b_scratch.data();
    }
    for (int64_t i0 = first_row; i0 < m; i0 += 32) {
      const int64_t rows = std::min<int64_t>(32, m - i0);
      float* c_block = c + i0 * ldc + j0;
      if (rows > 16 && two_cols) {
        block<2, 2>(left, i0, panels, panel_step, passes, clean_last, rows, cols, alpha, beta, c_block, ldc);
      } else if (rows > 16) {
        block<2, 1>(left, i0, panels, panel_step, passes, clean_last, rows, cols, alpha, beta, c_block, ldc);
      } else if (two_cols) {
        block<1, 2>(left, i0, panels, panel_step, passes, clean_last, rows, cols, alpha, beta, c_block, ldc);
      } else {
        block<1, 1>(left, i0, panels, panel_step, passes, clean_last, rows, cols, alpha, beta, c_block, ldc);
      }
    }
  }
}

}  // namespace

QKV_TARGET_AMX void pack_rows(const uint16_t* b, int64_t b_stride, int64_t k, int64_t n, int64_t depth,
                              uint16_t* panels) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const __mmask16 columns = lanes16(n - j0);
    uint16_t* panel = panels + (j0 / 16) * depth * 32;
    for (int64_t p = 0; p < k; p += 2) {
      const __m256i even = _mm256_maskz_loadu_epi16(columns, b + p * b_stride + j0);
      const __m256i odd = p + 1 < k ? _mm256_maskz_loadu_epi16(columns, b + (p + 1) * b_stride + j0) : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1);
      _mm512_storeu_si512(panel + (p / 2) * 32, interleave_halves(both));
    }
  }
}

QKV_TARGET_AMX void pack_columns(const uint16_t* x, int64_t x_stride, int64_t k, int64_t n, int64_t depth,
                                 uint16_t* panels) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    uint16_t* panel = panels + (j0 / 16) * depth * 32;
    for (int64_t t0 = 0; 2 * t0 < k; t0 += 16) {
      __m512i pairs[16];  // pairs[r]: column j0 + r's pairs t0 ..., then (transposed) pair t0 + r of every column
      const __mmask32 values = lanes32(k - 2 * t0);
      for (int r = 0; r < 16; ++r) {
        pairs[r] = j0 + r < n ? _mm512_maskz_loadu_epi16(values, x + (j0 + r) * x_stride + 2 * t0) : _mm512_setzero_si512();
      }
      transpose_16x16(pairs);
      for (int t = 0; t < 16; ++t) _mm512_storeu_si512(panel + (t0 + t) * 32, pairs[t]);
    }
  }
}

void multiply(Strided<float> a, int64_t m, const PackedRight& b, int64_t k, int64_t n, float alpha, float beta,
              float* c, int64_t ldc) {
  multiply_any(a, m, b, k, n, alpha, beta, c, ldc);
}
void multiply(Strided<c10::BFloat16> a, int64_t m, const PackedRight& b, int64_t k, int64_t n, float alpha,
              float beta, float* c, int64_t ldc) {
  multiply_any(a, m, b, k, n, alpha, beta, c, ldc);
}

bool request_tile_permission() {
  constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

#else  // no AMX on this platform: cpu_features.cpp never reports it

void multiply(Strided<float>, int64_t, const PackedRight&, int64_t, int64_t, float, float, float*, int64_t) {
  TORCH_CHECK(false, "tiled kernel: AMX products on a platform without AMX");
}
void multiply(Strided<c10::BFloat16>, int64_t, const PackedRight&, int64_t, int64_t, float, float, float*, int64_t) {
  TORCH_CHECK(false, "tiled kernel: AMX products on a platform without AMX");
}
bool request_tile_permission() { return false; }
void pack_rows(const uint16_t*, int64_t, int64_t, int64_t, int64_t, uint16_t*) {
  TORCH_CHECK(false, "tiled kernel: AMX packing on a platform without AMX");
}
void pack_columns(const uint16_t*, int64_t, int64_t, int64_t, int64_t, uint16_t*) {
  TORCH_CHECK(false, "tiled kernel: AMX packing on a platform without AMX");
}

#endif

}  // namespace qkv::kernels::tiled::amx
