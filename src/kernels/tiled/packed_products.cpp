// Each instruction set's micro-kernel is a function template over MR (the rows of its tile, so
// that the edge rows of a block run the same code with fewer accumulators), compiled for that
// instruction set by a target attribute: the file needs no special flags and the CPU decides at
// run time which of them may run (cpu_features.cpp).
#include "kernels/tiled/packed_products.h"

#include "kernels/linear/products.h"
#include "kernels/tiled/amx_products.h"
#include "kernels/tiled/lane_shuffles.h"
#include "kernels/tiled/vector_math.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#define QKV_X86_64 1
#define QKV_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define QKV_TARGET_AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl")))
#define QKV_TARGET_AVX512_BF16 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

namespace qkv::kernels::tiled {
namespace {

// Columns of a panel: two registers' worth on AVX-512 (32 floats, or 32 bfloat16 pairs), one for a
// product of at most 16 columns there (the narrow tiles); 16 on AVX2 and the portable path, and for
// AMX's bfloat16 products (one tile wide: each tile of B is then 1 KiB in one piece, which the
// tiles load fastest).
int64_t columns_per_panel(ProductKind kind, int64_t n) {
  if (kind.bf16 && kind.isa == ProductIsa::AmxBf16) return 16;
  return at_least(kind.isa, ProductIsa::Avx512) && n > 16 ? 32 : 16;
}

inline float as_float(float x) { return x; }
inline float as_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float as_float(c10::Half x) { return static_cast<float>(x); }

// out[j] <- x[j] for j < n: float32 copied, bfloat16 widened (by the linear layers' vector loop),
// float16 widened (vcvtph2ps).
inline void copy_as_float(const float* x, int64_t n, float* out) {
  std::memcpy(out, x, sizeof(float) * static_cast<size_t>(n));
}
inline void copy_as_float(const c10::BFloat16* x, int64_t n, float* out) {
  linear::widen_values(vector_values(x), out, n);
}
inline void copy_as_float(const c10::Half* x, int64_t n, float* out) { widen(x, n, out); }
// B's rows (contiguous, every panel W values wide and full) into its panels, row by row: each row
// is read once, whole, in order, where panel by panel the reads strode through B once per panel.
template <int64_t W>
void copy_rows_to_panels(const float* b, int64_t row_stride, int64_t k, int64_t panels, float* out) {
  for (int64_t p = 0; p < k; ++p) {
    for (int64_t q = 0; q < panels; ++q) {
      std::memcpy(out + (q * k + p) * W, b + p * row_stride + q * W, W * sizeof(float));
    }
  }
}
inline uint16_t bf16_bits(float x) { return c10::BFloat16(x).x; }  // rounds to nearest even
inline uint16_t bf16_bits(c10::BFloat16 x) { return x.x; }

// ---- The tiles: MR rows × NR columns of C, accumulated over k ------------------------------------
// Arguments: k; A's first row, its row and column strides; the B panel; the valid columns
// (≤ NR: the last panel is padded); alpha, beta; C's first element and row stride.

template <int MR>
struct PortableTile {
  static constexpr int NR = 16;
  static void run(int64_t k, const float* a, int64_t ars, int64_t acs, const float* panel, int64_t panel_stride,
                  int64_t cols, float alpha, float beta, float* c, int64_t ldc) {
    float acc[MR][NR] = {};
    for (int64_t p = 0; p < k; ++p) {
      const float* b = panel + p * panel_stride;
      for (int r = 0; r < MR; ++r) {
        const float x = a[r * ars + p * acs];
        for (int j = 0; j < NR; ++j) acc[r][j] += x * b[j];
      }
    }
    for (int r = 0; r < MR; ++r) {
      float* row = c + r * ldc;
      for (int64_t j = 0; j < cols; ++j) row[j] = alpha * acc[r][j] + (beta == 0.0f ? 0.0f : beta * row[j]);
    }
  }
};

#if defined(QKV_X86_64)
template <int MR>
struct Avx2Tile {
  static constexpr int NR = 16;
  QKV_TARGET_AVX2 static void run(int64_t k, const float* a, int64_t ars, int64_t acs, const float* panel,
                                  int64_t panel_stride, int64_t cols, float alpha, float beta, float* c, int64_t ldc) {
    __m256 acc[MR][2];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t p = 0; p < k; ++p) {
      const __m256 b0 = _mm256_loadu_ps(panel + p * panel_stride), b1 = _mm256_loadu_ps(panel + p * panel_stride + 8);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m256 x = _mm256_broadcast_ss(a + r * ars + p * acs);
        acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
      }
    }
    const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      float* row = c + r * ldc;
      __m256 v0 = _mm256_mul_ps(acc[r][0], va), v1 = _mm256_mul_ps(acc[r][1], va);
      if (cols == NR) {
        if (beta != 0.0f) {
          v0 = _mm256_fmadd_ps(_mm256_loadu_ps(row), vb, v0);
          v1 = _mm256_fmadd_ps(_mm256_loadu_ps(row + 8), vb, v1);
        }
        _mm256_storeu_ps(row, v0);
        _mm256_storeu_ps(row + 8, v1);
      } else {
        float tile[NR];
        _mm256_storeu_ps(tile, v0);
        _mm256_storeu_ps(tile + 8, v1);
        for (int64_t j = 0; j < cols; ++j) row[j] = tile[j] + (beta == 0.0f ? 0.0f : beta * row[j]);
      }
    }
  }
};

// The valid lanes of a 16-lane half of a 32-column tile.
QKV_TARGET_AVX512 inline __mmask16 lanes(int64_t cols, int half) {
  const int64_t n = std::clamp<int64_t>(cols - 16 * half, 0, 16);
  return static_cast<__mmask16>(n == 16 ? 0xFFFFu : (1u << n) - 1u);
}

// alpha · acc + beta · C into C's valid lanes; beta = 0 reads nothing. V vectors of 16 per row.
template <int MR, int V>
QKV_TARGET_AVX512 inline void store_tile(const __m512 (&acc)[MR][V], int64_t cols, float alpha, float beta, float* c,
                                         int64_t ldc) {
  __mmask16 masks[V];
  for (int v = 0; v < V; ++v) masks[v] = lanes(cols, v);
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    float* row = c + r * ldc;
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      __m512 value = _mm512_mul_ps(acc[r][v], va);
      if (beta != 0.0f) value = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(masks[v], row + 16 * v), vb, value);
      _mm512_mask_storeu_ps(row + 16 * v, masks[v], value);
    }
  }
}

// MR rows × 16·V columns. Two vectors a row (32 columns) as a rule; one (16 columns, with more
// rows) for products 16 wide or narrower, which a 32-column tile would half waste (head width 16).
template <int MR, int V>
struct Avx512TileOf {
  static constexpr int NR = 16 * V;
  QKV_TARGET_AVX512 static void run(int64_t k, const float* a, int64_t ars, int64_t acs, const float* panel,
                                    int64_t panel_stride, int64_t cols, float alpha, float beta, float* c,
                                    int64_t ldc) {
    __m512 acc[MR][V];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < k; ++p) {
      __m512 b[V];
      for (int v = 0; v < V; ++v) b[v] = _mm512_loadu_ps(panel + p * panel_stride + 16 * v);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m512 x = _mm512_set1_ps(a[r * ars + p * acs]);
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(x, b[v], acc[r][v]);
      }
    }
    store_tile<MR, V>(acc, cols, alpha, beta, c, ldc);
  }
};
template <int MR>
using Avx512Tile = Avx512TileOf<MR, 2>;
template <int MR>
using Avx512NarrowTile = Avx512TileOf<MR, 1>;

// A here is bfloat16 pairs: A[r][2t] and A[r][2t + 1] side by side at a + r * ars + t * acs
// (strides in bfloat16 values); the first argument counts the pairs. The panel holds B's row
// pairs: 16·V columns × 2 values per pair of rows.
template <int MR, int V>
struct Avx512Bf16TileOf {
  static constexpr int NR = 16 * V;
  QKV_TARGET_AVX512_BF16 static void run(int64_t pairs, const uint16_t* a, int64_t ars, int64_t acs,
                                         const uint16_t* panel, int64_t panel_stride, int64_t cols, float alpha,
                                         float beta, float* c, int64_t ldc) {
    __m512 acc[MR][V];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
    }
    for (int64_t t = 0; t < pairs; ++t) {
      __m512bh b[V];
      for (int v = 0; v < V; ++v) b[v] = (__m512bh)_mm512_loadu_si512(panel + t * panel_stride + 32 * v);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, a + r * ars + t * acs, sizeof pair);
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, b[v]);
      }
    }
    store_tile<MR, V>(acc, cols, alpha, beta, c, ldc);
  }
};
template <int MR>
using Avx512Bf16Tile = Avx512Bf16TileOf<MR, 2>;
template <int MR>
using Avx512Bf16NarrowTile = Avx512Bf16TileOf<MR, 1>;
#endif

// Runs Tile<rows> for 1 ≤ rows ≤ MR (the block's last rows get a smaller tile).
template <template <int> class Tile, int MR, typename... Args>
void tile_of(int rows, Args... args) {
  if (rows == MR) {
    Tile<MR>::run(args...);
  } else if constexpr (MR > 1) {
    tile_of<Tile, MR - 1>(rows, args...);
  }
}

// Every row of A against one panel (columns j0 .. j0 + cols of C), MR rows at a time.
template <template <int> class Tile, int MR, typename a_t, typename b_t>
void multiply_panel(const a_t* a, int64_t ars, int64_t acs, int64_t m, const b_t* panel, int64_t panel_stride,
                    int64_t steps, int64_t j0, int64_t cols, float alpha, float beta, float* c, int64_t ldc) {
  for (int64_t i0 = 0; i0 < m; i0 += MR) {
    const int rows = static_cast<int>(std::min<int64_t>(MR, m - i0));
    tile_of<Tile, MR>(rows, steps, a + i0 * ars, ars, acs, panel, panel_stride, cols, alpha, beta, c + i0 * ldc + j0,
                      ldc);
  }
}

// C = alpha · A · B + beta · C, panel by panel (a panel stays in L1 while every row of A meets it):
// Tile over the panels of the first `wide_columns` columns, TailTile over the narrower last panel
// past them, if n reaches it (PackedRight::wide_columns; a panel starts at its first column times
// the values a column holds, whatever its width). `depth` is the panel's rows: k for float32, the
// pairs for bfloat16; `steps` of them are used. A borrowed B (row_stride > 0: float32 rows read
// where they lie, PackedRight::borrow) has its panels side by side in its rows.
template <template <int> class Tile, int MR, template <int> class TailTile = Tile, int TailMR = MR, typename a_t,
          typename b_t>
void drive(const a_t* a, int64_t ars, int64_t acs, int64_t m, const b_t* panels, int64_t depth, int64_t steps,
           int64_t values_per_step, int64_t n, int64_t wide_columns, float alpha, float beta, float* c, int64_t ldc,
           int64_t row_stride = 0) {
  constexpr int64_t NR = Tile<1>::NR, TailNR = TailTile<1>::NR;
  const bool borrowed = row_stride > 0;
  const auto panel_at = [&](int64_t j0) { return panels + (borrowed ? j0 : j0 * depth * values_per_step); };
  const int64_t wide_end = std::min(n, wide_columns);
  for (int64_t j0 = 0; j0 < wide_end; j0 += NR) {
    multiply_panel<Tile, MR>(a, ars, acs, m, panel_at(j0), borrowed ? row_stride : NR * values_per_step, steps, j0,
                             std::min<int64_t>(NR, wide_end - j0), alpha, beta, c, ldc);
  }
  if (n > wide_columns) {  // at most TailTile's width past them (PackedRight::lay_out)
    multiply_panel<TailTile, TailMR>(a, ars, acs, m, panel_at(wide_columns),
                                     borrowed ? row_stride : TailNR * values_per_step, steps, wide_columns,
                                     n - wide_columns, alpha, beta, c, ldc);
  }
}

void multiply_float(const float* a, int64_t ars, int64_t acs, int64_t m, const PackedRight& b, int64_t k, int64_t n,
                    float alpha, float beta, float* c, int64_t ldc) {
  const int64_t depth = b.k();
  switch (b.kind().isa) {
#if defined(QKV_X86_64)
    case ProductIsa::Avx512:
    case ProductIsa::Avx512Bf16:
    case ProductIsa::AmxBf16:
      if (b.panel_width() == 16) {
        drive<Avx512NarrowTile, 12>(a, ars, acs, m, b.f32(), depth, k, 1, n, b.wide_columns(), alpha, beta, c, ldc,
                                    b.borrowed_row_stride());
      } else {
        drive<Avx512Tile, 8, Avx512NarrowTile, 12>(a, ars, acs, m, b.f32(), depth, k, 1, n, b.wide_columns(), alpha,
                                                   beta, c, ldc, b.borrowed_row_stride());
      }
      return;
    case ProductIsa::Avx2:
      drive<Avx2Tile, 6>(a, ars, acs, m, b.f32(), depth, k, 1, n, b.wide_columns(), alpha, beta, c, ldc,
                         b.borrowed_row_stride());
      return;
#endif
    default:
      drive<PortableTile, 4>(a, ars, acs, m, b.f32(), depth, k, 1, n, b.wide_columns(), alpha, beta, c, ldc,
                             b.borrowed_row_stride());
  }
}

// A (m × k) as bfloat16 pairs for vdpbf16ps: a pointer and the strides (in bfloat16 values) of
// its rows and of its pairs. bfloat16 rows with an even k are read where they lie; anything else
// is rounded (float32) or copied into `scratch`, float32 rows and columns with AVX512_BF16's
// conversions, a zero after an odd k.
struct Pairs {
  const uint16_t* data;
  int64_t row_stride, pair_stride;
};

#if defined(QKV_X86_64)
// Rows of float32 values, each rounded to bfloat16 (nearest even) in place order: pairs row-major.
QKV_TARGET_AVX512_BF16 void round_rows(const float* a, int64_t ars, int64_t m, int64_t k, uint16_t* out,
                                       int64_t out_stride) {
  for (int64_t r = 0; r < m; ++r) {
    const float* row = a + r * ars;
    uint16_t* to = out + r * out_stride;
    int64_t p = 0;
    for (; p + 32 <= k; p += 32) {
      const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + p + 16), _mm512_loadu_ps(row + p));
      _mm512_storeu_si512(to + p, (__m512i)both);
    }
    for (; p < k; ++p) to[p] = bf16_bits(row[p]);
    if (k % 2 == 1) to[k] = 0;
  }
}

// A stored transposed (k rows of m float32 values, `stride` apart): for each pair of stored rows
// (2t, 2t + 1), their values side by side for every i: pair-major [t][i][2].
QKV_TARGET_AVX512_BF16 void round_column_pairs(const float* x, int64_t stride, int64_t m, int64_t k, uint16_t* out) {
  for (int64_t t = 0; t < (k + 1) / 2; ++t) {
    const float* even = x + 2 * t * stride;
    const float* odd = 2 * t + 1 < k ? even + stride : nullptr;
    uint16_t* to = out + t * 2 * m;
    int64_t i = 0;
    if (odd != nullptr) {
      for (; i + 16 <= m; i += 16) {
        const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(odd + i), _mm512_loadu_ps(even + i));
        _mm512_storeu_si512(to + 2 * i, interleave_halves((__m512i)both));
      }
    }
    for (; i < m; ++i) {
      to[2 * i] = bf16_bits(even[i]);
      to[2 * i + 1] = odd != nullptr ? bf16_bits(odd[i]) : uint16_t(0);
    }
  }
}
// Two rows of 32 bfloat16 values, interleaved value by value into a panel's pair of rows.
QKV_TARGET_AVX512_BF16 void interleave_rows(const uint16_t* even, const uint16_t* odd, uint16_t* out) {
  static const auto indices = [] {
    std::array<uint16_t, 64> order{};
    for (uint16_t i = 0; i < 32; ++i) order[2 * i] = i, order[2 * i + 1] = static_cast<uint16_t>(32 + i);
    return order;
  }();
  const __m512i e = _mm512_loadu_si512(even), o = _mm512_loadu_si512(odd);
  _mm512_storeu_si512(out, _mm512_permutex2var_epi16(e, _mm512_loadu_si512(indices.data()), o));
  _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(e, _mm512_loadu_si512(indices.data() + 32), o));
}
#endif

template <typename T>
Pairs pairs_of(Strided<T> a, int64_t m, int64_t k, AlignedVector<uint16_t>& scratch) {
  const int64_t pairs = (k + 1) / 2;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (a.col_stride == 1 && k % 2 == 0) return {reinterpret_cast<const uint16_t*>(a.data), a.row_stride, 2};
  }
  scratch.resize(static_cast<size_t>(m * pairs * 2));
#if defined(QKV_X86_64)
  if constexpr (std::is_same_v<T, float>) {
    if (a.col_stride == 1) {
      round_rows(a.data, a.row_stride, m, k, scratch.data(), pairs * 2);
      return {scratch.data(), pairs * 2, 2};
    }
    if (a.row_stride == 1) {
      round_column_pairs(a.data, a.col_stride, m, k, scratch.data());
      return {scratch.data(), 2, 2 * m};
    }
  }
#endif
  for (int64_t r = 0; r < m; ++r) {
    uint16_t* out = scratch.data() + r * pairs * 2;
    for (int64_t p = 0; p < pairs * 2; ++p) out[p] = p < k ? bf16_bits(a.data[r * a.row_stride + p * a.col_stride]) : 0;
  }
  return {scratch.data(), pairs * 2, 2};
}

// The most float32 values a thread keeps for bfloat16 rows of A widened on a float32 path (4 MiB).
constexpr int64_t kWidenedFloatsKept = int64_t{1} << 20;

template <typename T>
void multiply_any(Strided<T> a, int64_t m, const PackedRight& b, float alpha, float beta, float* c, int64_t ldc,
                  Leading part) {
  const int64_t k = part.k < 0 ? b.k() : part.k, n = part.n < 0 ? b.n() : part.n;
  TORCH_CHECK(k <= b.k() && n <= b.n(), "tiled kernel: a product of B's leading ", k, " x ", n, " of a packed ", b.k(),
              " x ", b.n());
  if (m == 0 || n == 0) return;
  if (k == 0) {
    // An empty sum (a head width of 0): C = beta · C, here for every instruction set, so that no
    // micro-kernel loop sees a depth of 0 (the widening below divided by it: SIGFPE, 2026-12-07).
    for (int64_t r = 0; r < m; ++r) {
      float* row = c + r * ldc;
      if (beta == 0.0f) {
        std::fill(row, row + n, 0.0f);
      } else {
        for (int64_t j = 0; j < n; ++j) row[j] *= beta;
      }
    }
    return;
  }
  if constexpr (std::is_same_v<T, c10::Half>) {
    TORCH_CHECK(!b.kind().bf16, "tiled kernel: a float16 left operand for a bfloat16 product (float16 blocks ",
                "multiply as float32)");
  } else if (b.kind().bf16 && b.kind().isa == ProductIsa::AmxBf16) {
    amx::multiply(a, m, b, k, n, alpha, beta, c, ldc);
    return;
  } else if (b.kind().bf16) {
#if defined(QKV_X86_64)
    thread_local AlignedVector<uint16_t> scratch;
    // Pairs of B's rows: an odd k uses one more row of B, which A's zero after its k-th value cancels.
    const int64_t depth = b.pair_depth(), pairs = (k + 1) / 2;
    const Pairs a_pairs = pairs_of(a, m, k, scratch);
    if (b.panel_width() == 16) {
      drive<Avx512Bf16NarrowTile, 12>(a_pairs.data, a_pairs.row_stride, a_pairs.pair_stride, m, b.bf16(), depth, pairs,
                                      2, n, b.wide_columns(), alpha, beta, c, ldc);
    } else {
      drive<Avx512Bf16Tile, 8, Avx512Bf16NarrowTile, 12>(a_pairs.data, a_pairs.row_stride, a_pairs.pair_stride, m,
                                                         b.bf16(), depth, pairs, 2, n, b.wide_columns(), alpha, beta,
                                                         c, ldc);
    }
    return;
#endif
  }
  if constexpr (std::is_same_v<T, float>) {
    multiply_float(a.data, a.row_stride, a.col_stride, m, b, k, n, alpha, beta, c, ldc);
  } else {  // bfloat16 or float16 values on a float32 path: each row widened once, into scratch the thread
    // keeps, so at most kWidenedFloatsKept at a time (the linear layers' row blocks pass it for a
    // long k; the attention's blocks never do)
    const int64_t rows_per_pass = std::clamp<int64_t>(kWidenedFloatsKept / k, 1, m);
    thread_local AlignedVector<float> scratch;
    scratch.resize(static_cast<size_t>(rows_per_pass * k));
    for (int64_t first = 0; first < m; first += rows_per_pass) {
      const int64_t rows = std::min(rows_per_pass, m - first);
      for (int64_t r = 0; r < rows; ++r) {
        const T* row = a.data + (first + r) * a.row_stride;
        if (a.col_stride == 1) {
          copy_as_float(row, k, scratch.data() + r * k);
        } else {
          for (int64_t p = 0; p < k; ++p) scratch[r * k + p] = as_float(row[p * a.col_stride]);
        }
      }
      multiply_float(scratch.data(), k, 1, rows, b, k, n, alpha, beta, c + first * ldc, ldc);
    }
  }
}

}  // namespace

template <typename T>
void PackedRight::pack_any(Strided<T> b, int64_t k, int64_t n, ProductKind kind) {
  TORCH_CHECK(!kind.bf16 || at_least(kind.isa, ProductIsa::Avx512Bf16),
              "tiled kernel: bfloat16 products need AVX512_BF16 or AMX-BF16, asked of ", isa_name(kind.isa));
  TORCH_CHECK(!(kind.bf16 && std::is_same_v<T, c10::Half>),
              "tiled kernel: float16 blocks multiply as float32, not in bfloat16");
  take_shape(k, n, kind);
  const auto at = [&](int64_t p, int64_t j) { return b.data[p * b.row_stride + j * b.col_stride]; };
  if (kind.bf16) {
    const int64_t pairs = (k + 1) / 2;
    depth_ = kind.isa == ProductIsa::AmxBf16
                 ? (pairs + amx::kPairsPerTile - 1) / amx::kPairsPerTile * amx::kPairsPerTile
                 : pairs;
    bf16_.assign(static_cast<size_t>(lay_out(n, kind, depth_ * 2, true)), 0);
    int64_t first_column = 0;
#if defined(QKV_X86_64)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (kind.isa == ProductIsa::AmxBf16) {  // one tile wide: AMX's own packing
        const auto* values = reinterpret_cast<const uint16_t*>(b.data);
        if (b.col_stride == 1) return amx::pack_rows(values, b.row_stride, k, n, depth_, bf16_.data());
        if (b.row_stride == 1) return amx::pack_columns(values, b.col_stride, k, n, depth_, bf16_.data());
      }
      if (b.col_stride == 1 && panel_ == 32) {  // B's rows lie contiguous: whole panels, two rows at a time
        const auto* values = reinterpret_cast<const uint16_t*>(b.data);
        for (; first_column + panel_ <= std::min(n, wide_columns_); first_column += panel_) {
          uint16_t* panel = bf16_.data() + first_column * depth_ * 2;
          for (int64_t p = 0; p + 2 <= k; p += 2) {
            interleave_rows(values + p * b.row_stride + first_column, values + (p + 1) * b.row_stride + first_column,
                            panel + (p / 2) * 2 * panel_);
          }
          if (k % 2 == 1) {
            for (int64_t j = 0; j < panel_; ++j) {
              panel[(k / 2) * 2 * panel_ + 2 * j] = values[(k - 1) * b.row_stride + first_column + j];
            }
          }
        }
      }
    }
#endif
    for (int64_t j = first_column; j < n; ++j) {
      const int64_t j0 = j < wide_columns_ ? j / panel_ * panel_ : wide_columns_, width = width_at(j0);
      uint16_t* column = bf16_.data() + j0 * depth_ * 2 + (j - j0) * 2;
      int64_t p = 0;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (b.row_stride == 1) {  // B = Xᵀ of a bfloat16 X: a pair of B's rows is two neighbours in X's row
          const c10::BFloat16* row = b.data + j * b.col_stride;
          for (; p + 2 <= k; p += 2) std::memcpy(column + (p / 2) * 2 * width, row + p, 2 * sizeof(uint16_t));
        }
      }
      for (; p < k; ++p) column[(p / 2) * 2 * width + (p % 2)] = bf16_bits(at(p, j));
    }
    return;
  }
  depth_ = 0;
  f32_.resize(static_cast<size_t>(lay_out(n, kind, k, true)));
  if constexpr (std::is_same_v<T, float>) {
    if (b.col_stride == 1 && wide_columns_ == n) {  // every panel whole
      if (panel_ == 16) return copy_rows_to_panels<16>(b.data, b.row_stride, k, n / 16, f32_.data());
      if (panel_ == 32) return copy_rows_to_panels<32>(b.data, b.row_stride, k, n / 32, f32_.data());
    }
  }
  for (int64_t j0 = 0, width = width_at(0); j0 < n; j0 += width, width = width_at(j0)) {
    float* panel = f32_.data() + j0 * k;
    const int64_t cols = std::min(width, n - j0);
    if (b.row_stride == 1 && b.col_stride != 1) {
      // B = Xᵀ: X's cols × k block, transposed in 16 × 16 or 8 × 8 squares (vector_math.h), bfloat16
      // widened on the way. Value by value through the runtime strides, packing took 9.3% of the lm
      // attention's float32 samples and 4.7% of its bfloat16 ones (perf, AMD EPYC Zen 5).
      if (cols < width) std::fill(panel, panel + k * width, 0.0f);
      transpose(vector_values(b.data + j0 * b.col_stride), b.col_stride, cols, k, panel, width);
    } else if (b.col_stride == 1) {  // B's rows lie contiguous: whole rows at a time
      for (int64_t p = 0; p < k; ++p) {
        float* out = panel + p * width;
        copy_as_float(b.data + p * b.row_stride + j0, cols, out);
        std::fill(out + cols, out + width, 0.0f);
      }
    } else {
      for (int64_t p = 0; p < k; ++p) {
        float* out = panel + p * width;
        for (int64_t j = 0; j < cols; ++j) out[j] = as_float(at(p, j0 + j));
        std::fill(out + cols, out + width, 0.0f);
      }
    }
  }
}

void PackedRight::borrow(Strided<float> b, int64_t k, int64_t n, ProductKind kind) {
  if (kind.bf16 || b.col_stride != 1 || n % kNarrowPanelWidth != 0 || b.row_stride < n || k == 0) {
    return pack(b, k, n, kind);
  }
  take_shape(k, n, kind);
  depth_ = 0;
  lay_out(n, kind, k, true);
  borrowed_ = b.data, borrowed_row_stride_ = b.row_stride;
}

void PackedRight::take_shape(int64_t k, int64_t n, ProductKind kind) {
  TORCH_CHECK(at_least(detected_isa(), kind.isa), "tiled kernel: ", isa_name(kind.isa),
              " products asked of a CPU with ", isa_name(detected_isa()));
  kind_ = kind, k_ = k, n_ = n;
  borrowed_ = nullptr, borrowed_row_stride_ = 0;
}

int64_t PackedRight::lay_out(int64_t n, ProductKind kind, int64_t values_per_column, bool narrow_tail) {
  panel_ = columns_per_panel(kind, n);
  const int64_t whole = n / panel_ * panel_, rest = n - whole;
  const bool narrow_last = narrow_tail && panel_ > kNarrowPanelWidth && whole > 0 && rest > 0 &&
                           rest <= kNarrowPanelWidth;
  wide_columns_ = narrow_last ? whole : (n + panel_ - 1) / panel_ * panel_;
  return (wide_columns_ + (narrow_last ? kNarrowPanelWidth : 0)) * values_per_column;
}

PairPanels PackedRight::bf16_panels_to_fill(int64_t k, int64_t n, ProductKind kind) {
  TORCH_CHECK(kind.bf16 && at_least(kind.isa, ProductIsa::Avx512Bf16) && at_least(detected_isa(), kind.isa),
              "tiled kernel: bfloat16 panels asked for ", isa_name(kind.isa), " products on a CPU with ",
              isa_name(detected_isa()));
  take_shape(k, n, kind);
  const int64_t pairs = (k + 1) / 2;
  depth_ = kind.isa == ProductIsa::AmxBf16 ? (pairs + amx::kPairsPerTile - 1) / amx::kPairsPerTile * amx::kPairsPerTile
                                           : pairs;
  // Panels of one width throughout (PairPanels' layout): no narrow last panel.
  bf16_.resize(static_cast<size_t>(lay_out(n, kind, depth_ * 2, false)));  // no zeros: all is written
  return {bf16_.data(), panel_, depth_};
}

void PackedRight::pack(Strided<float> b, int64_t k, int64_t n, ProductKind kind) { pack_any(b, k, n, kind); }
void PackedRight::pack(Strided<c10::BFloat16> b, int64_t k, int64_t n, ProductKind kind) { pack_any(b, k, n, kind); }
void PackedRight::pack(Strided<c10::Half> b, int64_t k, int64_t n, ProductKind kind) { pack_any(b, k, n, kind); }

void multiply(Strided<float> a, int64_t m, const PackedRight& b, float alpha, float beta, float* c, int64_t ldc,
              Leading part) {
  multiply_any(a, m, b, alpha, beta, c, ldc, part);
}

void multiply(Strided<c10::BFloat16> a, int64_t m, const PackedRight& b, float alpha, float beta, float* c,
              int64_t ldc, Leading part) {
  multiply_any(a, m, b, alpha, beta, c, ldc, part);
}

void multiply(Strided<c10::Half> a, int64_t m, const PackedRight& b, float alpha, float beta, float* c, int64_t ldc,
              Leading part) {
  multiply_any(a, m, b, alpha, beta, c, ldc, part);
}

}  // namespace qkv::kernels::tiled
