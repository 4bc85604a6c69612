// The tiled kernel's micro-kernels (src/kernels/tiled/packed_products.h) on every instruction set
// this CPU can run, against a float64 product of the same values: every edge of the tiles (m, n
// not multiples of MR, NR; odd k for bfloat16 pairs), strided and transposed operands, alpha and
// beta, and a C full of NaN that beta = 0 must not read. And its row operations (vector_math.h)
// against the C library, on the instruction set QKV_TILED_ISA leaves (ctest runs them on each).
#include "kernels/tiled/aligned_buffer.h"
#include "kernels/tiled/blocks.h"
#include "kernels/tiled/cpu_features.h"
#include "kernels/tiled/packed_products.h"
#include "kernels/tiled/vector_math.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace {

using qkv::kernels::kRowStatistics;
using qkv::kernels::tiled::detected_isa;
using qkv::kernels::tiled::isa_name;
using qkv::kernels::tiled::PackedRight;
using qkv::kernels::tiled::ProductIsa;
using qkv::kernels::tiled::ProductKind;
using qkv::kernels::tiled::Strided;

std::vector<ProductKind> runnable_kinds() {
  std::vector<ProductKind> kinds;
  for (auto isa : {ProductIsa::Portable, ProductIsa::Avx2, ProductIsa::Avx512, ProductIsa::Avx512Bf16,
                   ProductIsa::AmxBf16}) {
    if (!qkv::kernels::tiled::at_least(detected_isa(), isa)) break;
    if (isa != ProductIsa::AmxBf16) kinds.push_back({isa, false});  // AMX's float32 products are AVX-512's
    if (qkv::kernels::tiled::at_least(isa, ProductIsa::Avx512Bf16)) kinds.push_back({isa, true});
  }
  return kinds;
}

std::string describe(const ProductKind& kind) {
  return std::string(isa_name(kind.isa)) + (kind.bf16 ? " bf16 products" : " float32 products");
}

// What a value becomes on its way into the product: itself, or rounded to bfloat16.
double as_multiplied(float x, bool bf16) { return bf16 ? static_cast<double>(c10::BFloat16(x)) : x; }
double as_multiplied(c10::BFloat16 x, bool) { return static_cast<double>(x); }
double as_multiplied(c10::Half x, bool) { return static_cast<double>(x); }  // float16 multiplies as float32

template <typename T>
T draw(std::mt19937& random) {
  return static_cast<T>(std::normal_distribution<float>(0.0f, 1.0f)(random));
}

// One product with A (m × k) and B (k × n) stored as given (transposed or not, with padding
// between rows), against float64 of the values as multiplied. With extra_k, extra_n > 0, B is
// packed with that many more rows and columns and the product uses its leading k × n (Leading).
// With borrow, float32 B is taken where it lies where it can be (PackedRight::borrow).
template <typename T>
void check_product(const ProductKind& kind, int64_t m, int64_t n, int64_t k, bool a_transposed, bool b_transposed,
                   float alpha, float beta, std::mt19937& random, int64_t extra_k = 0, int64_t extra_n = 0,
                   bool borrow = false) {
  const int64_t pad = 3;
  const int64_t packed_k = k + extra_k, packed_n = n + extra_n;
  std::vector<T> a_store((m + pad) * (k + pad)), b_store((packed_k + pad) * (packed_n + pad));
  for (auto& x : a_store) x = draw<T>(random);
  for (auto& x : b_store) x = draw<T>(random);
  // A stored as rows of k (or, transposed, as k rows of m); likewise B.
  const Strided<T> a = a_transposed ? Strided<T>{a_store.data(), 1, m + pad} : Strided<T>{a_store.data(), k + pad, 1};
  const Strided<T> b = b_transposed ? Strided<T>{b_store.data(), 1, packed_k + pad}
                                    : Strided<T>{b_store.data(), packed_n + pad, 1};
  const int64_t ldc = n + 2;
  std::vector<float> c(m * ldc);
  for (auto& x : c) x = beta == 0.0f ? std::numeric_limits<float>::quiet_NaN() : draw<float>(random);
  const std::vector<float> c_before = c;

  PackedRight packed;
  if constexpr (std::is_same_v<T, float>) {
    if (borrow) {
      packed.borrow(b, packed_k, packed_n, kind);
    } else {
      packed.pack(b, packed_k, packed_n, kind);
    }
  } else {
    packed.pack(b, packed_k, packed_n, kind);
  }
  if (extra_k > 0 || extra_n > 0) {
    multiply(a, m, packed, alpha, beta, c.data(), ldc, qkv::kernels::tiled::Leading{k, n});
  } else {
    multiply(a, m, packed, alpha, beta, c.data(), ldc);
  }

  // The kernel's reference path for float32, OpenBLAS's sgemm on the same operands, agrees too.
  std::vector<float> blas = c_before;
  if constexpr (std::is_same_v<T, float>) {
    if (!kind.bf16) {
      qkv::kernels::tiled::gemm(a_transposed, b_transposed, m, n, k, alpha, a.data, a_transposed ? m + pad : k + pad,
                                b.data, b_transposed ? packed_k + pad : packed_n + pad, beta, blas.data(), ldc);
    }
  }

  double worst = 0.0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0.0, magnitude = 0.0;
      for (int64_t p = 0; p < k; ++p) {
        const double term = as_multiplied(a.data[i * a.row_stride + p * a.col_stride], kind.bf16) *
                            as_multiplied(b.data[p * b.row_stride + j * b.col_stride], kind.bf16);
        sum += term;
        magnitude += std::abs(term);
      }
      const double expected = alpha * sum + (beta == 0.0f ? 0.0 : beta * c_before[i * ldc + j]);
      // float32 accumulation of k terms: error below k · eps32 · Σ|terms| (a bound, with margin).
      const double bound = (static_cast<double>(k) + 2.0) * 1.2e-7 * (std::abs(alpha) * magnitude + 1.0) + 1e-6;
      const double error = std::abs(c[i * ldc + j] - expected);
      if (std::is_same_v<T, float> && !kind.bf16) {
        ASSERT_LE(std::abs(c[i * ldc + j] - blas[i * ldc + j]), 2.0 * bound) << "against sgemm, m" << m << " n" << n;
      }
      ASSERT_TRUE(std::isfinite(c[i * ldc + j])) << describe(kind) << " m" << m << " n" << n << " k" << k;
      worst = std::max(worst, error / bound);
    }
    for (int64_t j = n; j < ldc; ++j) {  // the padding between C's rows is left alone
      const float before = c_before[i * ldc + j], after = c[i * ldc + j];
      ASSERT_TRUE((std::isnan(before) && std::isnan(after)) || before == after) << "wrote past column " << n;
    }
  }
  EXPECT_LE(worst, 1.0) << describe(kind) << " m" << m << " n" << n << " k" << k << " A"
                        << (a_transposed ? "ᵀ" : "") << " B" << (b_transposed ? "ᵀ" : "") << " alpha " << alpha
                        << " beta " << beta;
}

TEST(PackedProducts, MatchFloat64OnEveryRunnableInstructionSet) {
  std::mt19937 random(7);
  // n = 33, 48, 80, 100: a last panel of 16 columns or fewer after whole ones, packed narrow.
  // k = 0: an empty sum (a head width of 0), C = beta · C (the bfloat16 values' widening divided
  // by k: SIGFPE on the portable, AVX2 and AVX-512 paths until 2026-12-07). float16 operands
  // (widened to float32, as the kernel takes them) on each float32 path, B transposed where the
  // float32 one is not.
  const std::vector<int64_t> sizes_m = {1, 5, 8, 13, 64}, sizes_n = {1, 15, 16, 17, 33, 48, 64, 80, 100},
                             sizes_k = {0, 1, 2, 7, 32, 64, 257};
  for (const auto& kind : runnable_kinds()) {
    SCOPED_TRACE(describe(kind));
    int cases = 0;
    for (int64_t m : sizes_m) {
      for (int64_t n : sizes_n) {
        for (int64_t k : sizes_k) {
          const bool a_transposed = (m + n + k) % 2 == 1, b_transposed = (m + k) % 3 == 0;
          const float alpha = cases % 3 == 0 ? 0.125f : 1.0f, beta = cases % 2 == 0 ? 0.0f : 1.0f;
          check_product<float>(kind, m, n, k, a_transposed, b_transposed, alpha, beta, random);
          check_product<c10::BFloat16>(kind, m, n, k, !a_transposed, b_transposed, alpha, beta, random);
          if (!kind.bf16) {  // float16 operands, widened: the float32 products only
            check_product<c10::Half>(kind, m, n, k, a_transposed, !b_transposed, alpha, beta, random);
          }
          ++cases;
        }
      }
    }
    EXPECT_EQ(cases, 5 * 9 * 7);
  }
}

// A block packed whole and multiplied by its leading rows and columns (a causal row block sees a
// prefix of the keys): an odd k among them, whose bfloat16 pair takes one row more of B.
TEST(PackedProducts, LeadingPartsOfAPackedOperandMatchFloat64) {
  std::mt19937 random(8);
  int cases = 0;
  for (const auto& kind : runnable_kinds()) {
    SCOPED_TRACE(describe(kind));
    for (const int64_t m : {5, 64}) {
      for (const auto& [k, extra_k] : std::vector<std::pair<int64_t, int64_t>>{{1, 3}, {7, 1}, {31, 33}, {64, 192}}) {
        // Packed n = 48 and 80 end in a narrow panel (packed_products.h): parts that stop short of
        // it ({20, 28}, {33, 47}) and parts that reach into it ({40, 8}, {70, 10}).
        for (const auto& [n, extra_n] : std::vector<std::pair<int64_t, int64_t>>{
                 {1, 40}, {17, 15}, {33, 31}, {8, 0}, {20, 28}, {40, 8}, {33, 47}, {70, 10}}) {
          const bool b_transposed = (k + n) % 2 == 0;
          check_product<float>(kind, m, n, k, m == 5, b_transposed, 1.0f, 0.0f, random, extra_k, extra_n);
          check_product<c10::BFloat16>(kind, m, n, k, m != 5, b_transposed, 0.5f, 1.0f, random, extra_k, extra_n);
          ++cases;
        }
      }
    }
  }
  EXPECT_GE(cases, 2 * 4 * 8);
}

// float32 rows taken where they lie (PackedRight::borrow: the forward's value blocks that few
// query rows meet): whole panels of 16 and 32 columns and a narrow last one (n = 48, 80) read from
// B's padded rows, and leading parts of them; where a panel would not be whole (n = 17, 100), B
// transposed, or the products bfloat16, borrow packs instead. Both against float64.
TEST(PackedProducts, BorrowedRowsMatchFloat64) {
  std::mt19937 random(9);
  int borrowed = 0;
  for (const auto& kind : runnable_kinds()) {
    SCOPED_TRACE(describe(kind));
    for (const int64_t m : {1, 5, 13, 64}) {
      for (const int64_t n : {16, 32, 48, 64, 80, 96, 17, 100}) {
        for (const int64_t k : {1, 7, 64, 256}) {
          const bool b_transposed = (m + k) % 5 == 0;
          check_product<float>(kind, m, n, k, m == 13, b_transposed, m == 5 ? 0.125f : 1.0f, k == 7 ? 1.0f : 0.0f,
                               random, 0, 0, true);
          if (m == 5) {  // a leading part: k of 2k rows, half of the columns
            check_product<float>(kind, m, n / 2, k, false, b_transposed, 1.0f, 0.0f, random, k, n - n / 2, true);
          }
        }
        std::vector<float> b(64 * (n + 3), 1.0f);
        PackedRight packed;
        packed.borrow(Strided<float>{b.data(), n + 3, 1}, 64, n, kind);
        const bool whole_panels = n % 16 == 0 && !kind.bf16;
        EXPECT_EQ(packed.borrowed_row_stride(), whole_panels ? n + 3 : 0) << "n = " << n;
        if (whole_panels) {
          EXPECT_EQ(packed.f32(), b.data());
        }
        packed.pack(Strided<float>{b.data(), n + 3, 1}, 64, n, kind);  // packing again forgets the borrowed rows
        EXPECT_EQ(packed.borrowed_row_stride(), 0);
        EXPECT_NE(packed.f32(), b.data());
        borrowed += whole_panels;
      }
    }
  }
  EXPECT_GE(borrowed, 4 * 6);
}

// Where 32-column panels would end in one of 16 columns or fewer, that last one is packed 16 wide
// for the narrow tiles (on AVX-512's paths; AVX2's and the portable panels are 16 wide anyway,
// AMX's bfloat16 ones one tile wide): the products then skip the zero columns.
TEST(PackedProducts, ALastPanelOfSixteenColumnsOrFewerIsPackedNarrow) {
  int wide_kinds = 0;
  for (const auto& kind : runnable_kinds()) {
    SCOPED_TRACE(describe(kind));
    PackedRight packed;
    std::vector<float> b(64 * 256, 1.0f);  // 64 rows of the widest n below
    packed.pack(Strided<float>{b.data(), 100, 1}, 64, 100, kind);
    if (packed.panel_width() != 32) {
      EXPECT_EQ(packed.wide_columns() % packed.panel_width(), 0);
      EXPECT_GE(packed.wide_columns(), 100);
      continue;
    }
    ++wide_kinds;
    // n: the columns in 32-wide panels: a narrow last panel where 1 to 16 columns are left over
    for (const auto& [n, wide] : std::vector<std::pair<int64_t, int64_t>>{
             {100, 96}, {80, 64}, {48, 32}, {33, 32}, {96, 96}, {81, 96}, {17, 32}, {32, 32}, {256, 256}}) {
      packed.pack(Strided<float>{b.data(), n, 1}, 64, n, kind);
      EXPECT_EQ(packed.wide_columns(), wide) << "n = " << n;
    }
  }
  if (qkv::kernels::tiled::at_least(detected_isa(), ProductIsa::Avx512)) {
    EXPECT_GE(wide_kinds, 1);
  }
}

// Packed panels start on a cache line whatever size they are packed to (and re-packed to, as the
// kernel reuses them): an AMX tile or AVX-512 row that straddles two lines made the products
// about 3x slower (aligned_buffer.h). std::vector's 16-byte alignment would fail this for most sizes.
TEST(PackedProducts, PanelsStartOnACacheLine) {
  const auto on_a_line = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 64 == 0; };
  std::mt19937 random(9);
  std::normal_distribution<float> normal;
  for (const auto& kind : runnable_kinds()) {
    SCOPED_TRACE(describe(kind));
    PackedRight packed;
    for (const auto& [k, n] : std::vector<std::pair<int64_t, int64_t>>{{32, 256}, {3, 5}, {64, 32}, {200, 300}, {1, 1}}) {
      std::vector<float> b(static_cast<size_t>(k * n));
      for (auto& x : b) x = normal(random);
      packed.pack(Strided<float>{b.data(), n, 1}, k, n, kind);
      EXPECT_TRUE(on_a_line(kind.bf16 ? static_cast<const void*>(packed.bf16()) : packed.f32()))
          << "packed " << k << " x " << n;
    }
  }
  // The kernel's scratch: aligned at every size it grows or shrinks to, as a std::vector would
  // behave otherwise (values kept, new ones zero), and so are its copies.
  qkv::kernels::tiled::AlignedVector<uint16_t> scratch;
  size_t previous = 0;
  for (const size_t size : {1, 7, 100, 5000, 300000, 20, 4000}) {
    scratch.resize(size);
    ASSERT_TRUE(on_a_line(scratch.data())) << size << " values";
    ASSERT_EQ(scratch.size(), size);
    for (size_t i = 0; i < size; ++i) {
      // values written before are kept; elements new to this size are zero
      const uint16_t expected = i < previous ? static_cast<uint16_t>(i * 7 + 1) : 0;
      ASSERT_EQ(scratch[i], expected) << "element " << i << " after resizing to " << size;
    }
    for (size_t i = 0; i < size; ++i) scratch[i] = static_cast<uint16_t>(i * 7 + 1);
    previous = size;
    const auto copy = scratch;
    ASSERT_TRUE(on_a_line(copy.data()));
    ASSERT_TRUE(std::equal(copy.begin(), copy.end(), scratch.begin(), scratch.end()));
  }
}

// The default instruction set is the best the CPU runs, but on Intel CPUs with AVX512_BF16 and no
// AMX, where vdpbf16ps was measured slower than the float32 micro-kernels (cpu_features.h); the
// environment variable still reaches every path the CPU has.
TEST(PackedProducts, DefaultInstructionSetSkipsVdpbf16psOnIntelCores) {
  using qkv::kernels::tiled::CpuVendor;
  using qkv::kernels::tiled::default_isa;
  for (const auto vendor : {CpuVendor::Intel, CpuVendor::Amd, CpuVendor::Other}) {
    for (const auto isa : {ProductIsa::Portable, ProductIsa::Avx2, ProductIsa::Avx512, ProductIsa::AmxBf16}) {
      EXPECT_EQ(default_isa(isa, vendor), isa);
    }
  }
  EXPECT_EQ(default_isa(ProductIsa::Avx512Bf16, CpuVendor::Intel), ProductIsa::Avx512);
  EXPECT_EQ(default_isa(ProductIsa::Avx512Bf16, CpuVendor::Amd), ProductIsa::Avx512Bf16);
  EXPECT_EQ(default_isa(ProductIsa::Avx512Bf16, CpuVendor::Other), ProductIsa::Avx512Bf16);
  // This machine: cpuid's vendor as /proc/cpuinfo has it.
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("vendor_id", 0) != 0) continue;
    const bool intel = line.find("GenuineIntel") != std::string::npos;
    const bool amd = line.find("AuthenticAMD") != std::string::npos;
    EXPECT_EQ(qkv::kernels::tiled::cpu_vendor(),
              intel ? CpuVendor::Intel : amd ? CpuVendor::Amd : CpuVendor::Other) << line;
    break;
  }
}

TEST(PackedProducts, ReportsWhatTheCpuHas) {
  const auto flags = qkv::kernels::tiled::cpu_flags();
  const ProductIsa isa = detected_isa();
  if (qkv::kernels::tiled::at_least(isa, ProductIsa::Avx2)) {
    EXPECT_NE(flags.find("avx2"), std::string::npos);
  }
  if (qkv::kernels::tiled::at_least(isa, ProductIsa::Avx512Bf16)) {
    EXPECT_NE(flags.find("avx512_bf16"), std::string::npos);
  }
  if (isa == ProductIsa::AmxBf16) {
    EXPECT_NE(flags.find("amx_bf16"), std::string::npos);
  }
  // The flags as /proc/cpuinfo has them, where it exists: cpuid and the kernel agree (a CPU with
  // AMX whose tiles the kernel withholds would run AVX512_BF16: not seen here).
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    const bool bf16 = line.find(" avx512_bf16") != std::string::npos;
    const bool dq = line.find(" avx512dq") != std::string::npos;  // the bfloat16 paths' vreduceps
    const bool amx = line.find(" amx_bf16") != std::string::npos && line.find(" amx_tile") != std::string::npos;
    EXPECT_EQ(dq, flags.find("avx512dq") != std::string::npos) << line;
    EXPECT_EQ(bf16 && dq, qkv::kernels::tiled::at_least(isa, ProductIsa::Avx512Bf16)) << line;
    EXPECT_EQ(bf16 && dq && amx, isa == ProductIsa::AmxBf16) << line;
    break;
  }
}

TEST(PackedProducts, RefusesBf16ProductsWithoutAvx512Bf16) {
  PackedRight packed;
  const float values[4] = {1, 2, 3, 4};
  EXPECT_THROW(packed.pack(Strided<float>{values, 2, 1}, 2, 2, ProductKind{ProductIsa::Avx512, true}), c10::Error);
  // float16 never multiplies in bfloat16 (it would lose 3 bits of each value), on any CPU.
  const c10::Half halves[4] = {1, 2, 3, 4};
  EXPECT_THROW(packed.pack(Strided<c10::Half>{halves, 2, 1}, 2, 2, ProductKind{ProductIsa::Avx512Bf16, true}),
               c10::Error);
}

// The AMX tiles' own edges, on a CPU that has them: products of more than one tile of 16 pairs
// (k = 33 ... 300) with every tail, row counts around the 16- and 32-row blocks, bfloat16 A in
// place (k a multiple of 32) and copied, float32 A rounded by rows and transposed; and a leading
// part whose last tile would reach rows of B past k holding infinities and NaN, which must not
// reach the sums (rows past k are zeroed before the product).
TEST(PackedProducts, AmxTilesMatchFloat64AtTheirEdges) {
  if (detected_isa() != ProductIsa::AmxBf16) GTEST_SKIP() << "no AMX-BF16 here: " << qkv::kernels::tiled::cpu_flags();
  const ProductKind amx{ProductIsa::AmxBf16, true};
  std::mt19937 random(9);
  int cases = 0;
  for (const int64_t m : {1, 15, 16, 17, 31, 32, 33, 64, 100}) {
    for (const int64_t k : {32, 33, 64, 95, 256, 300}) {
      for (const int64_t n : {16, 17, 32, 48, 64}) {
        const bool transposed = (m + k + n) % 2 == 0;
        const float alpha = cases % 3 == 0 ? 1.0f : 0.125f, beta = cases % 4 == 0 ? 1.0f : 0.0f;
        check_product<float>(amx, m, n, k, transposed, (k + n) % 2 == 0, alpha, beta, random);
        check_product<c10::BFloat16>(amx, m, n, k, cases % 5 == 0, (m + n) % 2 == 0, alpha, beta, random);
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 9 * 6 * 5);

  // One-pass products into C as it is (alpha 1, beta 0: the scores at D <= 32), which run 32 rows at
  // a time with the C tiles alternating in pairs: odd and even counts of column tiles, rows past the
  // last group of 32 (C starts as NaN: every value must be written).
  int one_pass = 0;
  for (const int64_t m : {32, 40, 64, 96}) {
    for (const int64_t k : {16, 32}) {
      for (const int64_t n : {16, 32, 48, 64, 256}) {
        check_product<float>(amx, m, n, k, one_pass % 2 == 0, n % 32 == 0, 1.0f, 0.0f, random);
        check_product<c10::BFloat16>(amx, m, n, k, false, one_pass % 3 == 0, 1.0f, 0.0f, random);
        ++one_pass;
      }
    }
  }
  EXPECT_EQ(one_pass, 4 * 2 * 5);

  // B (k_packed × n) with infinities and NaN in its rows past the leading k; A's k columns finite.
  for (const int64_t k : {1, 7, 31, 33, 100}) {
    const int64_t k_packed = k + 40, n = 40, m = 20;
    std::vector<float> b(k_packed * n), a(m * k);
    for (auto& x : a) x = draw<float>(random);
    for (int64_t p = 0; p < k_packed; ++p) {
      for (int64_t j = 0; j < n; ++j) {
        b[p * n + j] = p < k ? draw<float>(random) : (j % 2 == 0 ? std::numeric_limits<float>::infinity() : NAN);
      }
    }
    PackedRight packed;
    packed.pack(Strided<float>{b.data(), n, 1}, k_packed, n, amx);
    std::vector<float> c(m * n, 0.0f);
    multiply(Strided<float>{a.data(), k, 1}, m, packed, 1.0f, 0.0f, c.data(), n, qkv::kernels::tiled::Leading{k, n});
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double expected = 0.0, magnitude = 0.0;
        for (int64_t p = 0; p < k; ++p) {
          const double term = as_multiplied(a[i * k + p], true) * as_multiplied(b[p * n + j], true);
          expected += term, magnitude += std::abs(term);
        }
        ASSERT_TRUE(std::isfinite(c[i * n + j])) << "k " << k << ": row " << i << " column " << j;
        EXPECT_NEAR(c[i * n + j], expected, (k + 2) * 1.2e-7 * magnitude + 1e-6) << "k " << k;
      }
    }
  }
}

TEST(RowOperations, ExpShiftedSumMatchesStdExp) {
  std::mt19937 random(3);
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t n : {0, 1, 15, 16, 17, 100, 257}) {
    std::vector<float> x(n);
    for (auto& value : x) value = std::uniform_real_distribution<float>(-100.0f, 10.0f)(random);
    if (n > 3) x[1] = -inf, x[2] = -87.5f, x[3] = 0.0f;  // masked, below the cut, the maximum
    const float shift = 2.5f;
    auto result = x;
    const float sum = qkv::kernels::exp_shifted_sum(result.data(), n, shift);
    double expected_sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double v = x[i] - shift;  // the difference in float32, as the kernel forms it
      if (v < -87.0) {  // the contract: exactly 0 at or below shift - 87
        EXPECT_EQ(result[i], 0.0f) << "x = " << x[i];
        continue;
      }
      const double expected = std::exp(v);
      expected_sum += expected;
      EXPECT_LE(std::abs(result[i] - expected), 3e-7 * expected) << "x = " << x[i] << ", n = " << n;
    }
    EXPECT_LE(std::abs(sum - expected_sum), 1e-6 * expected_sum + 1e-30) << "n = " << n;
  }
  std::vector<float> with_nan = {0.0f, std::numeric_limits<float>::quiet_NaN(), -1.0f};
  qkv::kernels::exp_shifted_sum(with_nan.data(), 3, 0.0f);
  EXPECT_TRUE(std::isnan(with_nan[1]));
  EXPECT_EQ(with_nan[0], 1.0f);
}

// The backward's form: a softmax scale as the factor and the log of the row's sum as `then`, over
// lengths that end in every position of an 8- and a 16-float vector; a NaN in a whole vector and in
// the tail stays NaN and makes the sum NaN, and a score equal to the shift gives exp(-then).
TEST(RowOperations, ExpShiftedSumWithFactorAndLogSum) {
  std::mt19937 random(11);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float factor = 0.17677669f, shift = 3.0f, then = 1.75f;  // 1/sqrt(32)
  for (int64_t n : {1, 7, 8, 9, 15, 16, 23, 24, 31, 40, 65}) {
    std::vector<float> x(n);
    for (auto& value : x) value = std::uniform_real_distribution<float>(-600.0f, 40.0f)(random);
    x[0] = shift / factor;  // the row's maximum
    if (n > 2) x[n - 1] = -inf;
    auto result = x;
    const float sum = qkv::kernels::exp_shifted_sum(result.data(), n, factor, shift, then);
    double expected_sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double v = (static_cast<double>(factor) * x[i] - shift) - then;
      if (v < -87.0 - 1e-4) {
        EXPECT_EQ(result[i], 0.0f) << "x = " << x[i] << ", n = " << n;
        continue;
      }
      if (v < -87.0 + 1e-4) continue;  // at the cut, either side may round
      const double expected = std::exp(v);
      expected_sum += expected;
      // float32's rounding of factor · x (up to 2^-24 of |factor · x| ≤ 106) moves v by up to 6e-6.
      EXPECT_LE(std::abs(result[i] - expected), (3e-7 + 6.4e-6) * expected) << "x = " << x[i] << ", n = " << n;
    }
    EXPECT_NEAR(result[0], std::exp(-static_cast<double>(then)), 1e-6) << "n = " << n;
    EXPECT_LE(std::abs(sum - expected_sum), 8e-6 * expected_sum) << "n = " << n;
  }
  for (int64_t at : {3, 17, 22}) {  // in a whole vector of 16, a whole vector of 8, the tail
    std::vector<float> x(23, 1.0f);
    x[at] = nan;
    const float sum = qkv::kernels::exp_shifted_sum(x.data(), 23, factor, shift, then);
    EXPECT_TRUE(std::isnan(x[at])) << "NaN at " << at;
    EXPECT_TRUE(std::isnan(sum)) << "NaN at " << at;
    EXPECT_NEAR(x[at == 3 ? 4 : 3], std::exp((factor * 1.0 - shift) - then), 1e-7) << "NaN at " << at;
  }
}

// The exponentials rounded to bfloat16 on their way out (the bfloat16 products' weights), on the
// path QKV_TILED_ISA leaves: each within one rounding of exp itself (nearest even, so at most half a
// bfloat16 step of 2^-8 relative, plus the polynomial's 3e-6), the sum that of the float32 values,
// x untouched.
TEST(RowOperations, ExponentialsRoundedToBFloat16) {
  std::mt19937 random(5);
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t n : {1, 15, 16, 17, 100, 256}) {
    std::vector<float> x(n);
    // v = 0.7 x - 1.5 from -22.5 to 7.6: above 0 as far as the forward's speculative shift lets it
    // (kShiftSlack = 8, forward.cpp), where 2^floor(x) and the polynomial's f in [0, 1) both grow.
    for (auto& value : x) value = std::uniform_real_distribution<float>(-30.0f, 13.0f)(random);
    const bool with_nan = n == 100;
    if (n > 2) x[1] = -inf;
    if (with_nan) x[2] = std::numeric_limits<float>::quiet_NaN();
    const auto before = x;
    std::vector<uint16_t> bits(n, 0xFFFF);
    const float factor = 0.7f, shift = 1.5f;
    const float sum = qkv::kernels::exp_shifted_sum_to_bf16(x.data(), n, factor, shift, bits.data());
    double expected_sum = 0.0, sum_tolerance = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(x[i] == before[i] || (std::isnan(x[i]) && std::isnan(before[i]))) << "x changed at " << i;
      c10::BFloat16 got;
      got.x = bits[i];
      const double v = static_cast<double>(factor) * x[i] - shift;
      if (std::isnan(v)) {
        EXPECT_TRUE(std::isnan(static_cast<float>(got))) << "NaN at " << i << " of " << n;
        continue;
      }
      if (v < -87.0) {
        EXPECT_EQ(static_cast<float>(got), 0.0f);
        continue;
      }
      const double expected = std::exp(v);
      expected_sum += expected;
      // The kernel forms factor * x - shift in float32: one rounding with FMA, two without (the
      // portable path), each at most 2^-24 of |factor * x| <= |v| + shift, and exp's relative error
      // is the argument's absolute one. Near v = -17 that alone is 1e-6 of the value.
      const double argument_error = (std::abs(v) + 2.0 * shift) * std::ldexp(1.0, -23);
      // The AVX-512 version's polynomial: relative error below 3e-6 (the portable one's 1e-7).
      const double float32_error = (argument_error + 3e-6) * expected;
      sum_tolerance += float32_error;
      EXPECT_LE(std::abs(static_cast<double>(got) - expected), 0.5 / 128 * expected + float32_error) << "v = " << v;
    }
    if (with_nan) {
      EXPECT_TRUE(std::isnan(sum)) << "a NaN exponential must reach the sum";
    } else {
      // plus the float32 summation's roundings, at most n of 2^-24 of the sum
      sum_tolerance += static_cast<double>(n) * std::ldexp(1.0, -24) * expected_sum;
      EXPECT_NEAR(sum, expected_sum, sum_tolerance) << "n = " << n;
    }

  }
}

// exp_shifted_sum_for_bf16 keeps in float32 the exponentials exp_shifted_sum_to_bf16 rounds: each
// rounds (nearest even, as the bfloat16 products round a float32 operand) to exactly the bits the
// latter writes, and the two sums are the same float (the tiled forward's output must not depend on
// which of the two a block took: Tiled.BFloat16ForwardIsTheSameWhetherABackwardFollowsOrNot).
// Every tail length of a 16-lane vector, -inf and NaN among the scores, the largest exponent the
// forward's shift allows.
TEST(RowOperations, ExponentialsKeptInFloat32RoundToTheBFloat16Ones) {
  std::mt19937 random(6);
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t n = 1; n <= 40; ++n) {
    for (const bool with_nan : {false, true}) {
      std::vector<float> x(n);
      for (auto& value : x) value = std::uniform_real_distribution<float>(-150.0f, 13.0f)(random);
      if (n > 2) x[1] = -inf;
      if (with_nan) x[static_cast<size_t>(n - 1)] = std::numeric_limits<float>::quiet_NaN();
      std::vector<uint16_t> bits(n, 0xFFFF);
      const float factor = 0.7f, shift = 1.5f;
      const float rounded_sum = qkv::kernels::exp_shifted_sum_to_bf16(x.data(), n, factor, shift, bits.data());
      auto kept = x;
      const float kept_sum = qkv::kernels::exp_shifted_sum_for_bf16(kept.data(), n, factor, shift);
      if (with_nan) {
        EXPECT_TRUE(std::isnan(rounded_sum) && std::isnan(kept_sum)) << "n = " << n;
      } else {
        EXPECT_EQ(kept_sum, rounded_sum) << "n = " << n;
      }
      for (int64_t i = 0; i < n; ++i) {
        const c10::BFloat16 rounded(kept[i]);  // nearest even; a NaN stays NaN
        if (std::isnan(kept[i])) {
          EXPECT_EQ(bits[i] & 0x7F80u, 0x7F80u) << "NaN at " << i;
          EXPECT_NE(bits[i] & 0x007Fu, 0u) << "NaN at " << i;
          continue;
        }
        EXPECT_EQ(rounded.x, bits[i]) << "x = " << x[i] << " at " << i << " of " << n << ": float32 " << kept[i];
        EXPECT_TRUE(kept[i] == 0.0f || std::fpclassify(kept[i]) == FP_NORMAL) << "a subnormal exponential at " << i;
      }
    }
  }
}

TEST(RowOperations, MaxOfLetsANaNWin) {
  std::mt19937 random(4);
  for (int64_t n : {1, 7, 16, 24, 33, 41, 256}) {
    std::vector<float> x(n);
    for (auto& value : x) value = std::normal_distribution<float>(0.0f, 10.0f)(random);
    EXPECT_EQ(qkv::kernels::max_of(x.data(), n), *std::max_element(x.begin(), x.end())) << "n = " << n;
    // A NaN anywhere: up to 41 values at every position (each lane of the vector loops' one and two
    // vectors a step, and the scalar tail), else the first, the middle and the last.
    std::vector<int64_t> positions = {0, n / 2, n - 1};
    if (n <= 41) {
      positions.resize(static_cast<size_t>(n));
      std::iota(positions.begin(), positions.end(), int64_t{0});
    }
    for (int64_t at : positions) {
      auto poisoned = x;
      poisoned[at] = std::numeric_limits<float>::quiet_NaN();
      EXPECT_TRUE(std::isnan(qkv::kernels::max_of(poisoned.data(), n))) << "NaN at " << at << " of " << n;
    }
  }
  EXPECT_EQ(qkv::kernels::max_of(static_cast<const float*>(nullptr), 0), -std::numeric_limits<float>::infinity());
  const float masked[3] = {-std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity()};
  EXPECT_EQ(qkv::kernels::max_of(masked, 3), -std::numeric_limits<float>::infinity());
}

// The kernel's row writers and D_i's dot product, on whichever instruction set this run has
// (ctest repeats RowOperations under QKV_TILED_ISA=portable, avx2, avx512, ...): lengths around
// the 16-lane vectors, against float64 sums (error bound: n float32 products and additions of
// terms at most max|a·b|, n·2^-23 of Σ|a·b| with room) and against c10::BFloat16's own rounding,
// bit for bit, NaN, infinities and denormals included.
TEST(RowOperations, DotAndScaledWritesMatchFloat64AndBFloat16Rounding) {
  std::mt19937 random(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int64_t n : {0, 1, 5, 15, 16, 17, 31, 32, 33, 64, 100}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    std::vector<float> a(n), b(n), out(n);
    std::vector<c10::BFloat16> a16(n), b16(n);
    std::vector<uint16_t> bits(n);
    for (int64_t i = 0; i < n; ++i) a[i] = normal(random), b[i] = normal(random);
    for (int64_t i = 0; i < n; ++i) a16[i] = c10::BFloat16(a[i]), b16[i] = c10::BFloat16(b[i]);
    double exact = 0, magnitude = 0, exact16 = 0, magnitude16 = 0;
    for (int64_t i = 0; i < n; ++i) {
      exact += double(a[i]) * double(b[i]), magnitude += std::abs(double(a[i]) * double(b[i]));
      exact16 += double(float(a16[i])) * double(float(b16[i]));
      magnitude16 += std::abs(double(float(a16[i])) * double(float(b16[i])));
    }
    const double bound = (double(n) + 2) * std::ldexp(1.0, -23) * magnitude + 1e-30;
    EXPECT_NEAR(qkv::kernels::dot(a.data(), b.data(), n), exact, bound);
    const double bound16 = (double(n) + 2) * std::ldexp(1.0, -23) * magnitude16 + 1e-30;
    EXPECT_NEAR(qkv::kernels::dot(reinterpret_cast<const uint16_t*>(a16.data()),
                                  reinterpret_cast<const uint16_t*>(b16.data()), n),
                exact16, bound16);
    // Specials among the values to write: NaN, ±inf, a denormal, ±0, values halfway between two
    // bfloat16 (ties to even both ways).
    std::vector<float> x = a;
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(), 1e-39f, -0.0f, 1.00390625f, 1.01171875f};
    for (int64_t i = 0; i < n && i < 7; ++i) x[(i * 5) % n] = specials[i];
    for (const float factor : {1.0f, 0.125f, -3.0f}) {
      qkv::kernels::scale_into(x.data(), n, factor, out.data());
      qkv::kernels::scale_into(x.data(), n, factor, bits.data());
      for (int64_t i = 0; i < n; ++i) {
        const float expected = x[i] * factor;
        if (std::isnan(expected)) {
          EXPECT_TRUE(std::isnan(out[i])) << i;
          c10::BFloat16 got;
          got.x = bits[i];
          EXPECT_TRUE(std::isnan(float(got))) << "bfloat16 at " << i;
          continue;
        }
        EXPECT_EQ(out[i], expected) << i;
        EXPECT_EQ(std::signbit(out[i]), std::signbit(expected)) << i;
        EXPECT_EQ(bits[i], c10::BFloat16(expected).x) << "rounded differently from c10::BFloat16 at " << i << " ("
                                                        << expected << ", factor " << factor << ")";
      }
    }
  }
}

// The block versions: rows of a strided block, each row's dot product against float64 within the
// bound above and equal to the bit to dot()'s (the summation order the backward relies on), each
// row scaled by its own factor or a common one and rounded as c10::BFloat16 rounds; the gaps
// between the written rows are left as they were.
TEST(RowOperations, RowDotsAndScaledRowWritesOfStridedBlocks) {
  std::mt19937 random(6);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (int64_t n : {1, 16, 17, 32, 40}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const int64_t rows = 9, x_stride = n + 3, out_stride = n + 5;
    std::vector<float> a(rows * x_stride), b(rows * x_stride);
    for (auto& value : a) value = normal(random);
    for (auto& value : b) value = normal(random);
    std::vector<c10::BFloat16> a16(a.begin(), a.end()), b16(b.begin(), b.end());
    std::vector<float> dots(rows), dots16(rows);
    qkv::kernels::row_dots(a.data(), x_stride, b.data(), x_stride, rows, n, dots.data());
    qkv::kernels::row_dots(reinterpret_cast<const uint16_t*>(a16.data()), x_stride,
                           reinterpret_cast<const uint16_t*>(b16.data()), x_stride, rows, n, dots16.data());
    for (int64_t r = 0; r < rows; ++r) {
      double exact = 0, magnitude = 0;
      for (int64_t i = 0; i < n; ++i) {
        exact += double(a[r * x_stride + i]) * double(b[r * x_stride + i]);
        magnitude += std::abs(double(a[r * x_stride + i]) * double(b[r * x_stride + i]));
      }
      EXPECT_NEAR(dots[r], exact, (double(n) + 2) * std::ldexp(1.0, -23) * magnitude) << "row " << r;
      EXPECT_EQ(dots[r], qkv::kernels::dot(a.data() + r * x_stride, b.data() + r * x_stride, n)) << "row " << r;
      EXPECT_EQ(dots16[r], qkv::kernels::dot(reinterpret_cast<const uint16_t*>(a16.data() + r * x_stride),
                                             reinterpret_cast<const uint16_t*>(b16.data() + r * x_stride), n))
          << "row " << r;
    }
    std::vector<float> factors(rows);
    for (auto& factor : factors) factor = normal(random);
    for (const bool own_factors : {true, false}) {
      const qkv::kernels::RowFactors row_factors{own_factors ? factors.data() : nullptr, -0.375f};
      constexpr float kUntouched = 12345.0f;
      constexpr uint16_t kUntouchedBits = 0xBEEF;
      std::vector<float> out(rows * out_stride, kUntouched);
      std::vector<uint16_t> bits(rows * out_stride, kUntouchedBits);
      qkv::kernels::scale_rows_into(a.data(), x_stride, rows, n, row_factors, out.data(), out_stride);
      qkv::kernels::scale_rows_into(a.data(), x_stride, rows, n, row_factors, bits.data(), out_stride);
      for (int64_t r = 0; r < rows; ++r) {
        const float factor = own_factors ? factors[r] : -0.375f;
        for (int64_t i = 0; i < out_stride; ++i) {
          if (i >= n) {
            EXPECT_EQ(out[r * out_stride + i], kUntouched) << "row " << r << ", gap " << i;
            EXPECT_EQ(bits[r * out_stride + i], kUntouchedBits) << "row " << r << ", gap " << i;
            continue;
          }
          const float expected = a[r * x_stride + i] * factor;
          EXPECT_EQ(out[r * out_stride + i], expected) << "row " << r << ", " << i;
          EXPECT_EQ(bits[r * out_stride + i], c10::BFloat16(expected).x) << "row " << r << ", " << i;
        }
      }
    }
  }
}

// float16 through the kernel's row operations (its blocks multiply as float32): widened exactly,
// transposed while widened, dotted in float32, and written back rounded as c10::Half rounds,
// bit for bit (nearest even, ties both ways, overflow to infinity, subnormals kept, -0), on the
// instruction set this run has (ctest repeats RowOperations on the narrower ones). NaN: NaN.
TEST(RowOperations, Float16WidensAndRoundsAsC10Half) {
  std::mt19937 random(13);
  const auto bits_of = [](float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    return bits;
  };
  // Every bit pattern of float16, widened (in runs of odd lengths, so that every tail is taken).
  std::vector<c10::Half> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = c10::Half(static_cast<uint16_t>(i), c10::Half::from_bits());
  std::vector<float> widened(all.size(), -7.0f);
  for (int64_t first = 0, length = 1; first < 65536; first += length, length = length % 37 + 1) {
    qkv::kernels::widen(all.data() + first, std::min<int64_t>(length, 65536 - first), widened.data() + first);
  }
  for (uint32_t i = 0; i < 65536; ++i) {
    const float expected = static_cast<float>(all[i]);
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(widened[i])) << "bits " << i;
    } else {
      ASSERT_EQ(bits_of(widened[i]), bits_of(expected)) << "bits " << i;
    }
  }
  for (int64_t rows : {1, 8, 15, 16, 17, 33}) {
    for (int64_t cols : {1, 7, 8, 9, 16, 40}) {
      SCOPED_TRACE("rows " + std::to_string(rows) + ", cols " + std::to_string(cols));
      const int64_t x_stride = cols + 3;
      std::vector<c10::Half> x(rows * x_stride);
      for (auto& value : x) value = all[random() % 65536];
      std::vector<float> out(cols * (rows + 3), -7.0f);
      qkv::kernels::transpose(x.data(), x_stride, rows, cols, out.data(), rows + 3);
      for (int64_t c = 0; c < cols; ++c) {
        for (int64_t r = 0; r < rows + 3; ++r) {
          const float got = out[c * (rows + 3) + r];
          const float expected = r < rows ? static_cast<float>(x[r * x_stride + c]) : -7.0f;
          if (std::isnan(expected)) {
            ASSERT_TRUE(std::isnan(got)) << "column " << c << ", row " << r;
          } else {
            ASSERT_EQ(bits_of(got), bits_of(expected)) << "column " << c << ", row " << r;
          }
        }
      }
    }
  }
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 33, 100}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const int64_t rows = 5, stride = n + 3;
    std::vector<c10::Half> a(rows * stride), b(rows * stride);
    for (auto& value : a) value = c10::Half(normal(random));
    for (auto& value : b) value = c10::Half(normal(random));
    std::vector<float> dots(rows);
    qkv::kernels::row_dots(a.data(), stride, b.data(), stride, rows, n, dots.data());
    for (int64_t r = 0; r < rows; ++r) {
      double exact = 0, magnitude = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double term = double(float(a[r * stride + i])) * double(float(b[r * stride + i]));
        exact += term, magnitude += std::abs(term);
      }
      EXPECT_NEAR(dots[r], exact, (double(n) + 2) * std::ldexp(1.0, -23) * magnitude + 1e-30) << "row " << r;
      EXPECT_EQ(dots[r], qkv::kernels::dot(a.data() + r * stride, b.data() + r * stride, n)) << "row " << r;
    }
    // Values to write: random ones and specials (NaN, ±inf, beyond float16's range, float16
    // subnormals and below them, -0, ties between two float16 values both ways).
    std::vector<float> x(rows * stride);
    for (auto& value : x) value = normal(random);
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(), 70000.0f, 65519.0f, 65520.0f, 1e-5f, 3e-8f,
                              2.9e-8f, -0.0f, 1.00048828125f, 1.00146484375f, -2.0009765625f};
    for (size_t i = 0; i < std::size(specials) && n > 0; ++i) x[(i * 7) % (rows * stride)] = specials[i];
    std::vector<float> factors(rows);
    for (auto& factor : factors) factor = normal(random);
    for (const bool own_factors : {true, false}) {
      const qkv::kernels::RowFactors row_factors{own_factors ? factors.data() : nullptr, 1.0f};
      const c10::Half untouched(12.5f);
      std::vector<c10::Half> written(rows * stride, untouched);
      qkv::kernels::scale_rows_into(x.data(), stride, rows, n, row_factors, written.data(), stride);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < stride; ++i) {
          const c10::Half got = written[r * stride + i];
          if (i >= n) {
            EXPECT_EQ(got.x, untouched.x) << "row " << r << ", gap " << i;
            continue;
          }
          const float expected = x[r * stride + i] * (own_factors ? factors[r] : 1.0f);
          if (std::isnan(expected)) {
            EXPECT_TRUE(std::isnan(static_cast<float>(got))) << "row " << r << ", " << i;
          } else {
            EXPECT_EQ(got.x, c10::Half(expected).x) << "rounded differently from c10::Half: row " << r << ", " << i
                                                    << " (" << expected << ")";
          }
        }
      }
    }
  }
}

// The forward's rows by dot products (kernel.h): a few query rows' dot products with a block of
// rows, and rows added into a few accumulators with each one's weights, in float32, bfloat16 and
// float16, on the instruction set this run has (ctest repeats RowOperations on the narrower ones):
// 1 to 9 query rows (AVX-512 and AVX2 take them in tiles of 4 or 2 rows, a last single one alone),
// counts and widths around 4 and 16, strided rows, against float64 sums within n float32 roundings
// of the terms' size; nothing written past the rows, keys or width asked for.
template <typename T>
void check_dots_and_weighted_rows(std::mt19937& random) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const auto bits = [](const T* x) { return qkv::kernels::vector_values(x); };
  using Bits = std::remove_cv_t<std::remove_pointer_t<decltype(bits(static_cast<const T*>(nullptr)))>>;
  constexpr float kUntouched = -7.0f;
  for (int64_t queries : {1, 2, 3, 4, 5, 6, 7, 9}) {
    for (int64_t count : {1, 3, 4, 15, 16, 17, 40}) {
      for (int64_t n : {1, 8, 16, 17, 64, 80}) {
        SCOPED_TRACE(std::string(c10::toString(c10::CppTypeToScalarType<T>::value)) + ", " + std::to_string(queries) +
                     " query rows, " + std::to_string(count) + " rows of " + std::to_string(n));
        const int64_t stride = n + 3, x_stride = n + 5, out_stride = count + 2, acc_stride = n + 1;
        std::vector<T> x(queries * x_stride), rows(count * stride);
        for (auto& value : x) value = static_cast<T>(normal(random));
        for (auto& value : rows) value = static_cast<T>(normal(random));
        std::vector<const Bits*> query_rows;
        for (int64_t r = 0; r < queries; ++r) query_rows.push_back(bits(x.data() + r * x_stride));
        // One row more than asked for: it must stay untouched.
        std::vector<float> dots((queries + 1) * out_stride, kUntouched);
        qkv::kernels::dots_with_rows(query_rows.data(), queries, bits(rows.data()), stride, count, n, dots.data(),
                                     out_stride);
        for (int64_t r = 0; r < queries; ++r) {
          for (int64_t j = 0; j < count; ++j) {
            double exact = 0, magnitude = 0;
            for (int64_t d = 0; d < n; ++d) {
              const double term = double(float(x[r * x_stride + d])) * double(float(rows[j * stride + d]));
              exact += term, magnitude += std::abs(term);
            }
            EXPECT_NEAR(dots[r * out_stride + j], exact, (double(n) + 2) * std::ldexp(1.0, -23) * magnitude + 1e-30)
                << "query " << r << ", row " << j;
          }
          for (int64_t j = count; j < out_stride; ++j) EXPECT_EQ(dots[r * out_stride + j], kUntouched) << "past the rows";
        }
        for (int64_t j = 0; j < out_stride; ++j) EXPECT_EQ(dots[queries * out_stride + j], kUntouched) << "past the queries";
        std::vector<float> weights(queries * out_stride);
        for (auto& w : weights) w = normal(random);
        std::vector<float> acc((queries + 1) * acc_stride);
        for (auto& value : acc) value = normal(random);
        const std::vector<float> before = acc;
        qkv::kernels::add_weighted_rows(bits(rows.data()), stride, count, n, weights.data(), out_stride, queries,
                                        acc.data(), acc_stride);
        for (int64_t r = 0; r < queries; ++r) {
          for (int64_t d = 0; d < n; ++d) {
            double exact = before[r * acc_stride + d], magnitude = std::abs(exact);
            for (int64_t j = 0; j < count; ++j) {
              const double term = double(weights[r * out_stride + j]) * double(float(rows[j * stride + d]));
              exact += term, magnitude += std::abs(term);
            }
            EXPECT_NEAR(acc[r * acc_stride + d], exact, (double(count) + 2) * std::ldexp(1.0, -23) * magnitude)
                << "query " << r << ", column " << d;
          }
          EXPECT_EQ(acc[r * acc_stride + n], before[r * acc_stride + n]) << "wrote past the width";
        }
        for (int64_t d = 0; d < acc_stride; ++d) {
          EXPECT_EQ(acc[queries * acc_stride + d], before[queries * acc_stride + d]) << "wrote past the queries";
        }
      }
    }
  }
}

TEST(RowOperations, DotsWithRowsAndWeightedRowsMatchFloat64) {
  std::mt19937 random(14);
  check_dots_and_weighted_rows<float>(random);
  check_dots_and_weighted_rows<c10::BFloat16>(random);
  check_dots_and_weighted_rows<c10::Half>(random);
}

// Where the test expects pair (2t, 2t + 1) of column j of a panel: its own statement of the
// layout PackedRight's bfloat16 operands have (packed_products.h).
int64_t pair_index(int64_t t, int64_t j, int64_t width, int64_t depth) {
  return (j / width) * depth * 2 * width + t * 2 * width + (j % width) * 2;
}

double from_bits(uint16_t bits) { return static_cast<double>(static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()))); }

// The backward's one pass over a block with bfloat16 products (softmax_backward_block), on the path
// QKV_TILED_ISA leaves, against float64: P = exp((factor · S - m) - log l) or the kept P, dropout's kept
// pairs scaled by 1 / (1 - p), dS = P ⊙ (dP' - D); the panels of P ⊙ Z / (1 - p) and of dS and the
// rows of dS each within one bfloat16 rounding (2^-9 relative; 2^-8 allowed for the float32 work
// before it), zeros in every pair past the rows and every column past n up to the panel width,
// nothing written past n in the rows; a dead row (m = +inf) all zeros; a NaN score a NaN; and a row
// whose scores are all -2^30 (a finite mask over the whole row) gets 1 / n for every key.
TEST(RowOperations, SoftmaxBackwardBlockFillsPairPanelsAsFloat64) {
  std::mt19937 random(11);
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t width : {16, 32}) {
    for (int64_t rows : {1, 2, 5, 64}) {
      for (int64_t n : {1, 15, 16, 17, 40, 256}) {
        // bit 0: kept P (no exponentials); bit 1: dropout; bit 2: no float32 dS (no additive mask's
        // gradient), as most blocks run
        for (int mode = 0; mode < 8; ++mode) {
          const bool kept_p = mode & 1, dropout = mode & 2, float_out = !(mode & 4);
          SCOPED_TRACE("width " + std::to_string(width) + ", rows " + std::to_string(rows) + ", n " +
                       std::to_string(n) + ", mode " + std::to_string(mode));
          const int64_t stride = n + 3, depth = (rows + 1) / 2 + 2;
          const float factor = 0.35f, keep_scale = 1.25f;
          std::vector<float> scores(rows * stride), grad_p(rows * stride), delta(rows);
          std::vector<float> statistics(kRowStatistics * rows);
          std::vector<uint8_t> keep(rows * stride);
          for (int64_t i = 0; i < rows * stride; ++i) {
            scores[i] = kept_p ? std::uniform_real_distribution<float>(0.0f, 0.2f)(random)
                               : std::uniform_real_distribution<float>(-6.0f, 6.0f)(random);
            grad_p[i] = draw<float>(random);
            keep[i] = std::bernoulli_distribution(0.8)(random) ? 1 : 0;
          }
          for (int64_t r = 0; r < rows; ++r) {
            statistics[kRowStatistics * r] = std::uniform_real_distribution<float>(-1.0f, 2.0f)(random);      // m
            statistics[kRowStatistics * r + 1] = std::uniform_real_distribution<float>(0.0f, 3.0f)(random);  // log l
            delta[r] = draw<float>(random);
          }
          const bool dead_row = !kept_p && rows > 2;  // row 1 attends to nothing
          if (dead_row) statistics[kRowStatistics * 1] = inf;
          const bool masked_row = !kept_p && rows > 3;  // row 2: a finite mask over all of it
          if (masked_row) {
            // A power of two, so that factor · S is exact in float32 and m = factor · S exactly: the
            // forward's n exponentials are each exp(0), l = n. m + log l (about -3.8e8 + 3) would
            // round to m.
            for (int64_t j = 0; j < n; ++j) scores[2 * stride + j] = -0x1p30f;
            statistics[kRowStatistics * 2] = factor * -0x1p30f;
            statistics[kRowStatistics * 2 + 1] = static_cast<float>(std::log(static_cast<double>(n)));
          }
          const bool with_nan = rows == 5 && n == 17;
          if (with_nan) scores[0 * stride + 3] = std::numeric_limits<float>::quiet_NaN();
          const int64_t panel_values = (n + width - 1) / width * depth * 2 * width;
          std::vector<uint16_t> weights(panel_values, 0xFFFF), grad_scores(panel_values, 0xFFFF),
              rows_out(rows * stride, 0xFFFF);
          std::vector<float> floats(rows * stride, -1234.5f);
          qkv::kernels::GradScoresBlock block;
          block.rows = rows, block.n = n;
          block.scores = scores.data(), block.scores_stride = stride;
          block.row_statistics = kept_p ? nullptr : statistics.data();
          block.factor = factor;
          block.grad_probabilities = grad_p.data(), block.grad_probabilities_stride = stride;
          block.delta = delta.data();
          if (dropout) {
            block.keep = keep.data(), block.keep_stride = stride, block.keep_scale = keep_scale;
          }
          block.weights = {weights.data(), width, depth};
          block.grad_scores = {grad_scores.data(), width, depth};
          block.grad_score_rows = rows_out.data(), block.grad_score_rows_stride = stride;
          if (float_out) block.grad_scores_float = floats.data(), block.grad_scores_float_stride = stride;
          qkv::kernels::softmax_backward_block(block);
          const auto close = [](double got, double expected, double scale) {
            return std::abs(got - expected) <= std::ldexp(1.0, -8) * std::abs(expected) + 5e-6 * scale + 1e-30;
          };
          for (int64_t t = 0; t < depth; ++t) {
            for (int64_t j = 0; j < (n + width - 1) / width * width; ++j) {
              for (int64_t k = 0; k < 2; ++k) {
                const int64_t r = 2 * t + k, index = pair_index(t, j, width, depth) + k;
                if (r >= rows || j >= n) {
                  ASSERT_EQ(weights[index], 0) << "padding at pair " << t << ", column " << j;
                  ASSERT_EQ(grad_scores[index], 0) << "padding at pair " << t << ", column " << j;
                  continue;
                }
                const int64_t at = r * stride + j;
                // factor · S - m first (exactly 0 for the -2^30 row; m + log l formed first would lose log l).
                const double m = statistics[kRowStatistics * r], log_sum = statistics[kRowStatistics * r + 1];
                const double difference = double(factor) * scores[at] - m;
                const double probability = kept_p ? double(scores[at]) : m == inf ? 0.0 : std::exp(difference - log_sum);
                const bool kept = !dropout || keep[at] != 0;
                const double scale = dropout ? double(keep_scale) : 1.0;
                const double weight = kept ? probability * scale : 0.0;
                const double ds = probability * ((kept ? grad_p[at] * scale : 0.0) - delta[r]);
                if (with_nan && at == 3) {
                  EXPECT_TRUE(std::isnan(from_bits(grad_scores[index])) && std::isnan(floats[at]) == float_out);
                  if (kept) {
                    EXPECT_TRUE(std::isnan(from_bits(weights[index])));
                  }
                  continue;
                }
                const double magnitude = std::abs(probability) * (std::abs(grad_p[at]) * scale + std::abs(delta[r]));
                EXPECT_TRUE(close(from_bits(weights[index]), weight, probability)) << r << ", " << j << ": " << from_bits(weights[index]) << " vs " << weight;
                EXPECT_TRUE(close(from_bits(grad_scores[index]), ds, magnitude)) << r << ", " << j;
                EXPECT_TRUE(close(from_bits(rows_out[at]), ds, magnitude)) << r << ", " << j;
                // float32: P's relative error (the exponential's polynomial, 3e-6, and forming v · log2(e))
                // times |dP' - D|, and the float32 operations after it.
                const double v = kept_p || m == inf ? 0.0 : std::abs(difference - log_sum);
                if (float_out) {
                  EXPECT_NEAR(floats[at], ds, (4e-6 + 1.2e-7 * v) * magnitude + 1e-30) << r << ", " << j;
                } else {
                  EXPECT_EQ(floats[at], -1234.5f) << "a float32 dS nobody asked for at " << r << ", " << j;
                }
              }
            }
          }
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = n; j < stride; ++j) {
              EXPECT_EQ(rows_out[r * stride + j], 0xFFFF) << "written past n at " << r << ", " << j;
              EXPECT_EQ(floats[r * stride + j], -1234.5f) << "written past n at " << r << ", " << j;
            }
          }
        }
      }
    }
  }
}

// The transposes around the backward's bfloat16 products (Qᵀ, dOᵀ with zero padding; dKᵀ, dVᵀ
// back to rows) and the widening one of a bfloat16 Kᵀ for float32 products, bit for bit, on the path QKV_TILED_ISA leaves; nothing written past the columns.
TEST(RowOperations, TransposesCopyEveryValueAndPadWithZeros) {
  std::mt19937 random(12);
  for (int64_t rows : {1, 16, 31, 32, 33, 64}) {
    for (int64_t cols : {1, 15, 16, 17, 64}) {
      SCOPED_TRACE("rows " + std::to_string(rows) + ", cols " + std::to_string(cols));
      const int64_t x_stride = cols + 5, padded = (rows + 31) / 32 * 32, out_stride = padded + 32;
      std::vector<uint16_t> x(rows * x_stride), out(cols * out_stride + 7, 0xABCD);
      for (auto& value : x) value = static_cast<uint16_t>(random());
      qkv::kernels::transpose_bf16(x.data(), x_stride, rows, cols, padded, out.data(), out_stride);
      for (int64_t c = 0; c < cols; ++c) {
        for (int64_t r = 0; r < out_stride; ++r) {
          const uint16_t expected = r < rows ? x[r * x_stride + c] : r < padded ? 0 : 0xABCD;
          ASSERT_EQ(out[c * out_stride + r], expected) << "column " << c << ", row " << r;
        }
      }
      std::vector<float> xf(rows * x_stride), outf(cols * (rows + 3), -7.0f);
      for (auto& value : xf) value = draw<float>(random);
      qkv::kernels::transpose(xf.data(), x_stride, rows, cols, outf.data(), rows + 3);
      for (int64_t c = 0; c < cols; ++c) {
        for (int64_t r = 0; r < rows + 3; ++r) {
          ASSERT_EQ(outf[c * (rows + 3) + r], r < rows ? xf[r * x_stride + c] : -7.0f) << "column " << c << ", row " << r;
        }
      }
      // bfloat16 bits widened on the way (a bfloat16 Kᵀ packed for float32 products): exactly the
      // float each stands for, NaN and infinity patterns among them.
      for (auto& value : outf) value = -7.0f;
      qkv::kernels::transpose(x.data(), x_stride, rows, cols, outf.data(), rows + 3);
      for (int64_t c = 0; c < cols; ++c) {
        for (int64_t r = 0; r < rows + 3; ++r) {
          const float expected =
              r < rows ? static_cast<float>(c10::BFloat16(x[r * x_stride + c], c10::BFloat16::from_bits())) : -7.0f;
          uint32_t got_bits, expected_bits;
          std::memcpy(&got_bits, &outf[c * (rows + 3) + r], sizeof got_bits);
          std::memcpy(&expected_bits, &expected, sizeof expected_bits);
          ASSERT_EQ(got_bits, expected_bits) << "widened: column " << c << ", row " << r;
        }
      }
    }
  }
  EXPECT_THROW(qkv::kernels::transpose_bf16(nullptr, 1, 1, 1, 16, nullptr, 16), c10::Error);
}

}  // namespace
