// Compiled with -fno-trapping-math -fno-math-errno (see src/CMakeLists.txt): without them GCC
// keeps the comparisons below as branches and does not vectorise the loops.
#include "kernels/tiled/vector_math.h"

#include "kernels/bfloat16_bits.h"
#include "kernels/tiled/cpu_features.h"
#include "kernels/tiled/lane_shuffles.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 intrinsics pass an undefined vector as the unused merge source, which its own
// -Wmaybe-uninitialized (and, with the sanitizers' -O1, -Wuninitialized) then reports at each use
// (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// Plain loops that the compiler vectorises, cloned for AVX2 beside the baseline (the CPU picks one
// at load time). None of them gains from fused multiply-adds; the one that would, the exponential,
// has intrinsics of its own for AVX2 + FMA and AVX-512 (a clone list of "avx2,fma" names two
// clones, AVX2 without FMA and FMA without AVX2, not one with both).
#define QKV_VECTORISED __attribute__((target_clones("avx2", "default")))

namespace qkv::kernels {

namespace {

// log2(e): every exponential here is 2^(v · log2(e)).
constexpr float kLog2e = 1.44269504088896341f;

// The float32 exponential's pieces, shared by its three versions (exp_shifted_sum_compiled, and
// exp_of and exp_of_avx2 by intrinsics): exp(v) = 2^k · exp(r) with k = round(v · log2(e)) and
// r = v - k · ln 2, ln 2 split in two (Cody and Waite) so that k · kLn2High is exact; exp(r) =
// 1 + r + r² · p(r), p by Horner from the highest coefficient (Cephes' expf, relative error below
// 1e-7 on r in [-ln 2 / 2, ln 2 / 2]).
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPolynomial[] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                                    4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

float exp_shifted_sum_compiled(float* __restrict x, int64_t n, float factor, float shift, float then);

// Whether the row operations take their AVX-512 versions (the instruction set the kernel's
// products use, so QKV_TILED_ISA lowers both together).
bool wide_vectors() { return tiled::at_least(tiled::active_isa(), tiled::ProductIsa::Avx512); }

// Whether they take their AVX2 versions instead of the portable ones.
bool avx2_vectors() { return tiled::at_least(tiled::active_isa(), tiled::ProductIsa::Avx2); }

// Whether the bfloat16 passes (and the exponentials the bfloat16 products take) take their
// AVX-512 versions: where the products multiply bfloat16 (their only callers in the kernel); the
// tests run both.
bool bf16_vectors() { return tiled::at_least(tiled::active_isa(), tiled::ProductIsa::Avx512Bf16); }

// A value as float32: float32 as it is, bfloat16 (raw bits) widened exactly.
inline float widened(float value) { return value; }
inline float widened(uint16_t bits) { return bfloat16_bits_to_float(bits); }
inline float widened(c10::Half value) { return static_cast<float>(value); }

#if defined(__x86_64__)
// The lanes of a 16-float vector that hold one of the `left` values still to do.
__attribute__((target("avx512f"))) inline __mmask16 tail_lanes(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1u);
}

// 16 bfloat16 values widened to float32 (0 in the lanes not asked for): their bits are the high
// half of the float's.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 widen_bf16(const uint16_t* x, __mmask16 lanes) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, x)), 16));
}

// 16 float16 values widened to float32 (0 in the lanes not asked for), exactly: vcvtph2ps.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 widen_half(const c10::Half* x, __mmask16 lanes) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, x));
}

// 8 float16 values widened to float32 (F16C, which the AVX2 paths require: cpu_features.cpp).
__attribute__((target("avx2,fma,f16c"))) inline __m256 widen8_half(const c10::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}

// 16 values of a row as float32 (0 in the lanes not asked for): float32 as they are, bfloat16
// (raw bits) and float16 widened exactly. Every AVX-512 loop over the three element types loads
// through it.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16_widened(const float* x, __mmask16 lanes) {
  return _mm512_maskz_loadu_ps(lanes, x);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16_widened(const uint16_t* x,
                                                                                 __mmask16 lanes) {
  return widen_bf16(x, lanes);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16_widened(const c10::Half* x,
                                                                                 __mmask16 lanes) {
  return widen_half(x, lanes);
}

// float32 to float16, nearest even (vcvtps2ph with its rounding given, not MXCSR's).
constexpr int kHalfRounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// kExpPolynomial's exponential written for AVX-512: vscalefps multiplies by 2^k (the compiler's
// version of the bit assembly and the NaN blends cost a fifth of the bf16 backward), and a NaN
// passes through every step by itself. No clamping: vscalefps gives infinity for a large k by
// itself, and the lanes below -87 (-inf's among them, whose r is NaN) are set to 0 at the end.
__attribute__((target("avx512f"))) inline __m512 exp_of(__m512 v, __mmask16 lanes) {
  const __m512 log2e = _mm512_set1_ps(kLog2e), ln2_high = _mm512_set1_ps(kLn2High),
               ln2_low = _mm512_set1_ps(kLn2Low), one = _mm512_set1_ps(1.0f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);  // -inf included
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(k, ln2_low, _mm512_fnmadd_ps(k, ln2_high, v));
  __m512 p = _mm512_set1_ps(kExpPolynomial[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPolynomial[i]));
  const __m512 exp_r = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, one));
  return _mm512_maskz_mov_ps(lanes & ~underflow, _mm512_scalef_ps(exp_r, k));
}

// exp(v) = 2^x, x = v · log2(e), for values rounded to bfloat16 next (whose own step is 2^-8 of a
// value), taking x: its callers form x = s · (factor · log2(e)) - shift · log2(e) in one FMA, one
// instruction fewer per 16 values than forming v and then x. x = floor(x) + f, f in [0, 1) by
// vreduceps (one instruction for what a rounding and a subtraction did), 2^f by a degree-4
// polynomial (minimax in relative error, fitted for qkv: 2.6e-6 on [0, 1), 2.7e-6 evaluated in
// float32), 2^floor(x) by vscalefps, which floors its exponent itself. 7 instructions where exp_of
// takes 16. Lanes below x = -87 · log2(e) (v = -87, and -inf) are 0, as in exp_of; a NaN stays NaN.
// Needs AVX512DQ (vreduceps), which every CPU with AVX512_BF16 has (cpu_features.cpp).
__attribute__((target("avx512f,avx512dq"))) inline __m512 exp2_for_bf16(__m512 x, __mmask16 lanes) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f * kLog2e), _CMP_LT_OQ);
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // x - floor(x)
  __m512 p = _mm512_set1_ps(0.013534074649214745f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05201144143939018f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24144293367862701f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69300377368927f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000026226043701f));
  return _mm512_maskz_scalef_ps(lanes & ~underflow, p, x);
}

__attribute__((target("avx512f"))) float exp_shifted_sum_avx512(float* x, int64_t n, float factor, float shift,
                                                                float then) {
  const __m512 factor_v = _mm512_set1_ps(factor), shift_v = _mm512_set1_ps(shift), then_v = _mm512_set1_ps(then);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = tail_lanes(n - i);
    const __m512 e =
        exp_of(_mm512_sub_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(lanes, x + i), factor_v, shift_v), then_v), lanes);
    _mm512_mask_storeu_ps(x + i, lanes, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// The exponentials that bfloat16 products take next, by exp2_for_bf16: rounded to bfloat16 into
// `out` (kKeep false), or kept in float32 in `kept` (kKeep true; x itself, in place), from which
// the products round them to the same bits. One loop for both, so that their exponentials and sums
// are the same instructions in the same order.
template <bool kKeep>
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16"))) inline float exp_shifted_for_bf16_avx512(
    const float* x, int64_t n, float factor, float shift, uint16_t* out, float* kept, float* largest) {
  // exp(factor · x - shift) = 2^((factor · x - shift) · log2(e)): the difference first, by the same
  // fused multiply-add as every other exponential of the kernel's, forward and backward (RowStatistics
  // in kernel.h), so that a row's scores equal to its maximum give exactly 2^0 at any magnitude.
  const __m512 factor_v = _mm512_set1_ps(factor), shift_v = _mm512_set1_ps(shift), log2e = _mm512_set1_ps(kLog2e);
  __m512 sum = _mm512_setzero_ps(), top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = tail_lanes(n - i);
    const __m512 values = _mm512_maskz_loadu_ps(lanes, x + i);
    const __m512 e = exp2_for_bf16(_mm512_mul_ps(_mm512_fmsub_ps(values, factor_v, shift_v), log2e), lanes);
    if constexpr (kKeep) {
      _mm512_mask_storeu_ps(kept + i, lanes, e);
    } else {
      _mm256_mask_storeu_epi16(out + i, lanes, (__m256i)_mm512_cvtneps_pbh(e));
    }
    sum = _mm512_add_ps(sum, e);
    top = _mm512_mask_max_ps(top, lanes, top, values);
  }
  if (largest != nullptr) *largest = _mm512_reduce_max_ps(top);
  return _mm512_reduce_add_ps(sum);
}

__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16"))) float exp_shifted_sum_to_bf16_avx512(
    const float* x, int64_t n, float factor, float shift, uint16_t* out, float* largest) {
  return exp_shifted_for_bf16_avx512<false>(x, n, factor, shift, out, nullptr, largest);
}

__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16"))) float exp_shifted_sum_for_bf16_avx512(
    float* x, int64_t n, float factor, float shift) {
  return exp_shifted_for_bf16_avx512<true>(x, n, factor, shift, nullptr, x, nullptr);
}

// The sum of the 16 lanes of two 8-float vectors.
__attribute__((target("avx2,fma"))) inline float sum_of_lanes(__m256 low, __m256 high) {
  const __m256 both = _mm256_add_ps(low, high);
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// The lanes of an 8-float vector that hold one of the `left` values still to do (all bits set).
__attribute__((target("avx2"))) inline __m256i tail_lanes8(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// exp_of's polynomial on AVX2 + FMA. Without vscalefps, k is added to exp(r)'s exponent bits, so v
// is clamped to [-87, 88] first: k is then in [-126, 127], and exp(r) · 2^k stays a normal float
// (r > 0 where k = -126, r < 0 where k = 127). The lanes below -87 (-inf's among them) are set to 0
// at the end. A NaN passes through by itself: max and min return their second operand where either
// is NaN, and the conversion of a NaN k is 0x80000000, which shifted by 23 adds nothing to exp(r)'s
// NaN bits.
__attribute__((target("avx2,fma"))) inline __m256 exp_of_avx2(__m256 v) {
  const __m256 log2e = _mm256_set1_ps(kLog2e), ln2_high = _mm256_set1_ps(kLn2High), ln2_low = _mm256_set1_ps(kLn2Low),
               one = _mm256_set1_ps(1.0f), lowest = _mm256_set1_ps(-87.0f);
  const __m256 clamped = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(lowest, v));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(clamped, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(k, ln2_low, _mm256_fnmadd_ps(k, ln2_high, clamped));
  __m256 p = _mm256_set1_ps(kExpPolynomial[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPolynomial[i]));
  const __m256 exp_r = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, one));
  const __m256i scaled = _mm256_add_epi32(_mm256_castps_si256(exp_r), _mm256_slli_epi32(_mm256_cvtps_epi32(k), 23));
  return _mm256_andnot_ps(_mm256_cmp_ps(v, lowest, _CMP_LT_OQ), _mm256_castsi256_ps(scaled));
}

// exp((factor · x - shift) - then), the difference formed as exp_shifted_sum_avx512 forms it; the
// forward's then = 0 is left out.
template <bool kThen>
__attribute__((target("avx2,fma"))) inline __m256 exp_shifted_avx2(__m256 x, __m256 factor, __m256 shift,
                                                                    __m256 then) {
  const __m256 v = _mm256_fmsub_ps(x, factor, shift);
  return exp_of_avx2(kThen ? _mm256_sub_ps(v, then) : v);
}

// The exponentials and their sum in one pass (the compiled loop took two, and GCC's AVX2 clone
// of it has no fused multiply-adds: target_clones' "avx2,fma" names two clones, not one); two
// sums, so that the additions of consecutive vectors do not wait on each other.
template <bool kThen>
__attribute__((target("avx2,fma"))) float exp_shifted_sum_avx2_with(float* x, int64_t n, float factor, float shift,
                                                                   float then) {
  const __m256 factor_v = _mm256_set1_ps(factor), shift_v = _mm256_set1_ps(shift), then_v = _mm256_set1_ps(then);
  __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 e0 = exp_shifted_avx2<kThen>(_mm256_loadu_ps(x + i), factor_v, shift_v, then_v);
    const __m256 e1 = exp_shifted_avx2<kThen>(_mm256_loadu_ps(x + i + 8), factor_v, shift_v, then_v);
    _mm256_storeu_ps(x + i, e0);
    _mm256_storeu_ps(x + i + 8, e1);
    sum0 = _mm256_add_ps(sum0, e0);
    sum1 = _mm256_add_ps(sum1, e1);
  }
  for (; i < n; i += 8) {
    const __m256i lanes = tail_lanes8(n - i);
    const __m256 e = _mm256_and_ps(exp_shifted_avx2<kThen>(_mm256_maskload_ps(x + i, lanes), factor_v, shift_v, then_v),
                                   _mm256_castsi256_ps(lanes));
    _mm256_maskstore_ps(x + i, lanes, e);
    sum0 = _mm256_add_ps(sum0, e);
  }
  return sum_of_lanes(sum0, sum1);
}

float exp_shifted_sum_avx2(float* x, int64_t n, float factor, float shift, float then) {
  return then == 0.0f ? exp_shifted_sum_avx2_with<false>(x, n, factor, shift, then)
                      : exp_shifted_sum_avx2_with<true>(x, n, factor, shift, then);
}
#endif

}  // namespace

float exp_shifted_sum(float* x, int64_t n, float factor, float shift, float then) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (wide_vectors()) return &exp_shifted_sum_avx512;
    if (avx2_vectors()) return &exp_shifted_sum_avx2;
#endif
    return &exp_shifted_sum_compiled;
  }();
  return implementation(x, n, factor, shift, then);
}

namespace {

// float32 to bfloat16 bits, rounded to nearest even; a NaN stays a (quiet) NaN.
uint16_t bf16_bits(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  if (value != value) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float exp_shifted_sum_to_bf16_portable(const float* x, int64_t n, float factor, float shift, uint16_t* out,
                                       float* largest) {
  thread_local std::vector<float> values;
  values.assign(x, x + n);
  const float sum = exp_shifted_sum(values.data(), n, factor, shift);
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(values[i]);
  if (largest != nullptr) *largest = max_of(x, n);
  return sum;
}

}  // namespace

float exp_shifted_sum_to_bf16(const float* x, int64_t n, float factor, float shift, uint16_t* out, float* largest) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (bf16_vectors()) return &exp_shifted_sum_to_bf16_avx512;
#endif
    return &exp_shifted_sum_to_bf16_portable;
  }();
  return implementation(x, n, factor, shift, out, largest);
}

float exp_shifted_sum_for_bf16(float* x, int64_t n, float factor, float shift) {
  // The same choice as exp_shifted_sum_to_bf16's: its portable version rounds exp_shifted_sum's.
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (bf16_vectors()) return &exp_shifted_sum_for_bf16_avx512;
#endif
    return +[](float* values, int64_t count, float f, float s) { return exp_shifted_sum(values, count, f, s); };
  }();
  return implementation(x, n, factor, shift);
}

namespace {

QKV_VECTORISED float exp_shifted_sum_compiled(float* __restrict x, int64_t n, float factor, float shift, float then) {
  // kExpPolynomial's exponential, 2^k by writing k into the exponent bits: that of CPUs without
  // AVX2 (exp_shifted_sum_avx2 and exp_shifted_sum_avx512 are this, by hand) and of the bfloat16
  // passes' portable reference.
  constexpr float kRound = 12582912.0f;  // 1.5 · 2^23: adding and subtracting it rounds to an integer
  for (int64_t i = 0; i < n; ++i) {
    const float v = (factor * x[i] - shift) - then;
    // Written so that a NaN lands on -87 (every comparison with NaN is false): k then stays a small
    // integer, whose conversion and shift below are defined; the NaN itself is restored at the end.
    const float clamped = v >= -87.0f ? (v <= 88.0f ? v : 88.0f) : -87.0f;
    const float k = (clamped * kLog2e + kRound) - kRound;
    const float r = clamped - k * kLn2High - k * kLn2Low;
    float p = kExpPolynomial[0];
    for (int c = 1; c < 6; ++c) p = p * r + kExpPolynomial[c];
    const float exp_r = p * (r * r) + r + 1.0f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23;  // k in [-126, 127]
    float two_to_k;
    std::memcpy(&two_to_k, &bits, sizeof two_to_k);
    x[i] = v < -87.0f ? 0.0f : (v != v ? v : exp_r * two_to_k);  // a NaN score stays NaN
  }
  // Eight running sums so that the additions vectorise (and round less).
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int lane = 0; lane < 8; ++lane) partial[lane] += x[i + lane];
  }
  float sum = 0.0f;
  for (; i < n; ++i) sum += x[i];
  for (float lane : partial) sum += lane;
  return sum;
}

}  // namespace

double exp_shifted_sum(double* x, int64_t n, double factor, double shift, double then) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp((factor * x[i] - shift) - then);
    sum += x[i];
  }
  return sum;
}

namespace {

#if defined(__x86_64__)
__attribute__((target("avx512f"))) float max_of_avx512(const float* x, int64_t n) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = lowest;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = tail_lanes(n - i);
    const __m512 v = _mm512_mask_loadu_ps(lowest, lanes, x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  if (nan != 0) return std::numeric_limits<float>::quiet_NaN();
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, best);
  float result = lanes[0];
  for (float lane : lanes) result = lane > result ? lane : result;
  return result;
}

// Two vectors a step, each with its own maximum, so that consecutive maxima do not wait on each
// other; one unordered comparison of the two flags a NaN in either.
__attribute__((target("avx2"))) float max_of_avx2(const float* x, int64_t n) {
  __m256 best0 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), best1 = best0;
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q));
    best0 = _mm256_max_ps(best0, v0);
    best1 = _mm256_max_ps(best1, v1);
  }
  if (i + 8 <= n) {  // at most one whole vector is left
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best0 = _mm256_max_ps(best0, v);
    i += 8;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(best0, best1));
  float result = -std::numeric_limits<float>::infinity();
  for (float lane : lanes) result = nan_max(result, lane);
  for (; i < n; ++i) result = nan_max(result, x[i]);
  return _mm256_movemask_ps(nan) != 0 ? std::numeric_limits<float>::quiet_NaN() : result;
}
#endif

float max_of_portable(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) best = nan_max(best, x[i]);
  return best;
}

}  // namespace

float max_of(const float* x, int64_t n) {
  // A maximum does not vectorise by itself: a NaN must win, which plain max instructions do not
  // promise, so the lanes carry a NaN flag beside their maxima.
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (wide_vectors()) return &max_of_avx512;
    if (avx2_vectors()) return &max_of_avx2;
#endif
    return &max_of_portable;
  }();
  return implementation(x, n);
}

double max_of(const double* x, int64_t n) {
  double best = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) best = nan_max(best, x[i]);
  return best;
}

QKV_VECTORISED void scale(float* __restrict x, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

void scale(double* x, int64_t n, double factor) {
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

QKV_VECTORISED void scale_add(float* __restrict x, int64_t n, float factor, const float* __restrict bias) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * factor + bias[i];
}

void scale_add(double* __restrict x, int64_t n, double factor, const double* __restrict bias) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * factor + bias[i];
}

QKV_VECTORISED void add_into(float* __restrict x, int64_t n, const float* __restrict y) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void add_into(double* __restrict x, int64_t n, const double* __restrict y) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

QKV_VECTORISED void mask_out(float* __restrict x, int64_t n, const bool* __restrict allowed) {
  for (int64_t i = 0; i < n; ++i) x[i] = allowed[i] ? x[i] : -std::numeric_limits<float>::infinity();
}

void mask_out(double* __restrict x, int64_t n, const bool* __restrict allowed) {
  for (int64_t i = 0; i < n; ++i) x[i] = allowed[i] ? x[i] : -std::numeric_limits<double>::infinity();
}

QKV_VECTORISED void softmax_backward(const float* __restrict p, float* __restrict ds, int64_t n, float delta) {
  for (int64_t i = 0; i < n; ++i) ds[i] = p[i] * (ds[i] - delta);
}

void softmax_backward(const double* p, double* ds, int64_t n, double delta) {
  for (int64_t i = 0; i < n; ++i) ds[i] = p[i] * (ds[i] - delta);
}

namespace {

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Where column j0 (a multiple of 16) of pair t starts in a panel: 16 pairs of that column on.
inline int64_t pair_offset(const PairPanels& panels, int64_t t, int64_t j0) {
  return (j0 / panels.width) * panels.depth * 2 * panels.width + t * 2 * panels.width + (j0 % panels.width) * 2;
}

#if defined(__x86_64__)
#define QKV_TARGET_BF16 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16")))

// Two vectors of 16 floats, rounded to bfloat16 and interleaved value by value (even's first):
// 16 pairs of a panel.
QKV_TARGET_BF16 inline __m512i rounded_pairs(__m512 even, __m512 odd) {
  return tiled::interleave_halves((__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// One row of a block's pass: where its inputs and outputs lie, its m, log l (to base 2) and D
// broadcast, and its lanes:
// `present` none for the missing odd row of an odd count (nothing of it is written), `live` none
// for that row and for a row with no key, whose P and dS are 0.
struct BlockRow {
  const float *scores, *grad_probabilities;
  const uint8_t* keep;
  uint16_t* grad_score_row;
  float* grad_scores_float;
  __m512 row_max, log2_sum, delta;
  __mmask16 present, live;
};

// P ⊙ Z / (1 - p) into `weight` and dS into `grad_score` for 16 columns of a row (lanes: those
// inside n), dS also out to the row's float32 output where there is one (its bfloat16 row is
// written by the caller, from the rounding that also makes the panel's pairs). The block's choices
// (exponentiate or read P, dropout, a float32 dS) are template arguments: one loop each, with no
// test per column.
template <bool kExponentiate, bool kKeep, bool kFloatOut>
QKV_TARGET_BF16 inline void block_row_step(const BlockRow& row, int64_t j0, __mmask16 lanes, __m512 factor,
                                           __m512 keep_scale, __m512& weight, __m512& grad_score) {
  const __mmask16 written = lanes & row.present;
  lanes &= row.live;
  __m512 p;
  if constexpr (kExponentiate) {
    // P = exp((factor · S - m) - log l) = 2^((factor · S - m) · log2(e) - log2(l)), the difference
    // first, as the forward formed it (RowStatistics in kernel.h).
    const __m512 difference = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(lanes, row.scores + j0), factor, row.row_max);
    p = exp2_for_bf16(_mm512_fmsub_ps(difference, _mm512_set1_ps(kLog2e), row.log2_sum), lanes);
  } else {
    p = _mm512_maskz_loadu_ps(lanes, row.scores + j0);
  }
  __m512 dp = _mm512_maskz_loadu_ps(lanes, row.grad_probabilities + j0);
  weight = p;
  if constexpr (kKeep) {
    const __mmask16 kept = _mm_mask_cmpneq_epi8_mask(lanes, _mm_maskz_loadu_epi8(lanes, row.keep + j0), _mm_setzero_si128());
    weight = _mm512_maskz_mul_ps(kept, p, keep_scale);
    dp = _mm512_maskz_mul_ps(kept, dp, keep_scale);
  }
  grad_score = _mm512_maskz_mul_ps(lanes, p, _mm512_sub_ps(dp, row.delta));
  if constexpr (kFloatOut) _mm512_mask_storeu_ps(row.grad_scores_float + j0, written, grad_score);
}

QKV_TARGET_BF16 inline BlockRow block_row(const GradScoresBlock& g, int64_t r, bool present) {
  const float* statistics = g.row_statistics != nullptr ? g.row_statistics + kRowStatistics * r : nullptr;
  const bool dead = statistics != nullptr && statistics[0] == std::numeric_limits<float>::infinity();
  const bool exponentiated = statistics != nullptr && !dead;
  return BlockRow{g.scores + r * g.scores_stride,
                  g.grad_probabilities + r * g.grad_probabilities_stride,
                  g.keep != nullptr ? g.keep + r * g.keep_stride : nullptr,
                  g.grad_score_rows + r * g.grad_score_rows_stride,
                  g.grad_scores_float != nullptr ? g.grad_scores_float + r * g.grad_scores_float_stride : nullptr,
                  _mm512_set1_ps(exponentiated ? statistics[0] : 0.0f),
                  _mm512_set1_ps(exponentiated ? statistics[1] * kLog2e : 0.0f),  // log2(l)
                  _mm512_set1_ps(g.delta[r]),
                  static_cast<__mmask16>(present ? 0xFFFF : 0),
                  static_cast<__mmask16>(present && !dead ? 0xFFFF : 0)};
}

template <bool kExponentiate, bool kKeep, bool kFloatOut>
QKV_TARGET_BF16 void softmax_backward_pairs(const GradScoresBlock& g) {
  // Locals, not g's fields: the stores below could alias them as far as the compiler knows.
  const int64_t rows = g.rows, n = g.n, width = g.weights.width, depth = g.weights.depth;
  const int64_t panel_values = depth * 2 * width, panels = (n + width - 1) / width;
  uint16_t* const weight_panels = g.weights.data;
  uint16_t* const grad_score_panels = g.grad_scores.data;
  const __m512 factor = _mm512_set1_ps(g.factor), keep_scale = _mm512_set1_ps(g.keep_scale);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t = 0; t < depth; ++t) {
    // Pair t's 16 pairs of columns j0 ... lie at panel (j0 / width), offset t · 2 · width + (j0 % width) · 2.
    uint16_t* weight_pairs = weight_panels + t * 2 * width;
    uint16_t* grad_score_pairs = grad_score_panels + t * 2 * width;
    const int64_t r = 2 * t;
    if (r >= rows) {  // padding: zeros
      for (int64_t jp = 0; jp < panels; ++jp) {
        for (int64_t half = 0; half < width; half += 16) {
          _mm512_storeu_si512(weight_pairs + jp * panel_values + 2 * half, zero);
          _mm512_storeu_si512(grad_score_pairs + jp * panel_values + 2 * half, zero);
        }
      }
      continue;
    }
    // An odd count's last row pairs with nothing: the even row stands in, with no lanes (zeros
    // into the panels, nothing written to its rows).
    const bool has_odd = r + 1 < rows;
    const BlockRow even = block_row(g, r, true), odd = block_row(g, has_odd ? r + 1 : r, has_odd);
    for (int64_t jp = 0; jp < panels; ++jp) {
      for (int64_t half = 0; half < width; half += 16) {
        const int64_t j0 = jp * width + half;
        const __mmask16 lanes = tail_lanes(n - j0);
        __m512 w0, w1, ds0, ds1;
        block_row_step<kExponentiate, kKeep, kFloatOut>(even, j0, lanes, factor, keep_scale, w0, ds0);
        block_row_step<kExponentiate, kKeep, kFloatOut>(odd, j0, lanes, factor, keep_scale, w1, ds1);
        _mm512_storeu_si512(weight_pairs + jp * panel_values + 2 * half, rounded_pairs(w0, w1));
        // dS of both rows rounded once: the even row's 16 values in the low half, the odd row's in
        // the high half, as the rows take them; interleaved, as the panel takes them.
        const __m512i grad_scores = (__m512i)_mm512_cvtne2ps_pbh(ds1, ds0);
        _mm512_storeu_si512(grad_score_pairs + jp * panel_values + 2 * half, tiled::interleave_halves(grad_scores));
        _mm256_mask_storeu_epi16(even.grad_score_row + j0, lanes, _mm512_castsi512_si256(grad_scores));
        _mm256_mask_storeu_epi16(odd.grad_score_row + j0, lanes & odd.present, _mm512_extracti64x4_epi64(grad_scores, 1));
      }
    }
  }
}

QKV_TARGET_BF16 void softmax_backward_block_avx512(const GradScoresBlock& g) {
  using Pass = void (*)(const GradScoresBlock&);
  // [exponentiate][dropout][float32 dS]
  static constexpr Pass kPasses[2][2][2] = {
      {{softmax_backward_pairs<false, false, false>, softmax_backward_pairs<false, false, true>},
       {softmax_backward_pairs<false, true, false>, softmax_backward_pairs<false, true, true>}},
      {{softmax_backward_pairs<true, false, false>, softmax_backward_pairs<true, false, true>},
       {softmax_backward_pairs<true, true, false>, softmax_backward_pairs<true, true, true>}}};
  kPasses[g.row_statistics != nullptr][g.keep != nullptr][g.grad_scores_float != nullptr](g);
}

QKV_TARGET_BF16 void transpose_bf16_avx512(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t cols,
                                           int64_t padded_rows, uint16_t* out, int64_t out_stride) {
  for (int64_t t0 = 0; 2 * t0 < padded_rows; t0 += 16) {  // 16 pairs of rows: 32 rows
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const __mmask16 lanes = tail_lanes(cols - c0);
      __m512i pairs[16];  // pairs[i]: rows 2(t0 + i), 2(t0 + i) + 1 of columns c0 ..., interleaved
      for (int i = 0; i < 16; ++i) {
        const int64_t r = 2 * (t0 + i);
        const __m256i even = r < rows ? _mm256_maskz_loadu_epi16(lanes, x + r * x_stride + c0) : _mm256_setzero_si256();
        const __m256i odd =
            r + 1 < rows ? _mm256_maskz_loadu_epi16(lanes, x + (r + 1) * x_stride + c0) : _mm256_setzero_si256();
        pairs[i] = tiled::interleave_halves(_mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1));
      }
      tiled::transpose_16x16(pairs);  // pairs[c]: column c0 + c's values of rows 2 t0 ... 2 t0 + 31
      for (int64_t c = 0; c < std::min<int64_t>(16, cols - c0); ++c) {
        _mm512_storeu_si512(out + (c0 + c) * out_stride + 2 * t0, pairs[c]);
      }
    }
  }
}

template <typename T>
QKV_TARGET_BF16 void transpose_avx512(const T* x, int64_t x_stride, int64_t rows, int64_t cols, float* out,
                                      int64_t out_stride) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const __mmask16 row_lanes = tail_lanes(rows - r0);
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const __mmask16 lanes = tail_lanes(cols - c0);
      __m512i block[16];
      for (int64_t i = 0; i < 16; ++i) {
        block[i] = r0 + i < rows ? _mm512_castps_si512(load16_widened(x + (r0 + i) * x_stride + c0, lanes))
                                 : _mm512_setzero_si512();
      }
      tiled::transpose_16x16(block);
      for (int64_t c = 0; c < std::min<int64_t>(16, cols - c0); ++c) {
        _mm512_mask_storeu_ps(out + (c0 + c) * out_stride + r0, row_lanes, _mm512_castsi512_ps(block[c]));
      }
    }
  }
}

// 8 values of a row as float32 (bfloat16 and float16 ones widened).
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* x) { return widen8_bfloat16(x); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const c10::Half* x) { return widen8_half(x); }

// transpose in 8 × 8 squares of AVX2 registers; the squares cut by the edges value by value.
template <typename T>
__attribute__((target("avx2,fma,f16c"))) void transpose_avx2(const T* x, int64_t x_stride, int64_t rows, int64_t cols,
                                                        float* out, int64_t out_stride) {
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    for (int64_t c0 = 0; c0 < cols; c0 += 8) {
      if (r0 + 8 > rows || c0 + 8 > cols) {
        for (int64_t r = r0; r < std::min(rows, r0 + 8); ++r) {
          for (int64_t c = c0; c < std::min(cols, c0 + 8); ++c) out[c * out_stride + r] = widened(x[r * x_stride + c]);
        }
        continue;
      }
      __m256 row[8], pair[8];
      for (int64_t i = 0; i < 8; ++i) row[i] = load8(x + (r0 + i) * x_stride + c0);
      for (int64_t i = 0; i < 8; i += 2) {  // (r_i c_j, r_i+1 c_j) side by side, per 128-bit half
        pair[i] = _mm256_unpacklo_ps(row[i], row[i + 1]);
        pair[i + 1] = _mm256_unpackhi_ps(row[i], row[i + 1]);
      }
      for (int64_t i = 0; i < 8; i += 4) {  // four rows of one column per 128-bit half
        row[i] = _mm256_shuffle_ps(pair[i], pair[i + 2], 0x44);
        row[i + 1] = _mm256_shuffle_ps(pair[i], pair[i + 2], 0xEE);
        row[i + 2] = _mm256_shuffle_ps(pair[i + 1], pair[i + 3], 0x44);
        row[i + 3] = _mm256_shuffle_ps(pair[i + 1], pair[i + 3], 0xEE);
      }
      for (int64_t c = 0; c < 4; ++c) {  // rows 0-3 and 4-7 of columns c and c + 4 joined
        _mm256_storeu_ps(out + (c0 + c) * out_stride + r0, _mm256_permute2f128_ps(row[c], row[c + 4], 0x20));
        _mm256_storeu_ps(out + (c0 + c + 4) * out_stride + r0, _mm256_permute2f128_ps(row[c], row[c + 4], 0x31));
      }
    }
  }
}
#endif

// The same passes in plain C++ (and the reference their tests hold the vector ones to): P by the
// portable exponential, each value rounded by bf16_bits.
void softmax_backward_block_portable(const GradScoresBlock& g) {
  thread_local std::vector<float> weights, grad_scores;
  weights.assign(static_cast<size_t>(g.rows * g.n), 0.0f);
  grad_scores.assign(static_cast<size_t>(g.rows * g.n), 0.0f);
  for (int64_t r = 0; r < g.rows; ++r) {
    float* p = weights.data() + r * g.n;
    std::copy(g.scores + r * g.scores_stride, g.scores + r * g.scores_stride + g.n, p);
    if (g.row_statistics != nullptr) {
      const float* statistics = g.row_statistics + kRowStatistics * r;
      const float row_max = statistics[0], log_sum = statistics[1];
      if (row_max == std::numeric_limits<float>::infinity()) {
        std::fill(p, p + g.n, 0.0f);
      } else {
        exp_shifted_sum_compiled(p, g.n, g.factor, row_max, log_sum);
      }
    }
    const float* dp = g.grad_probabilities + r * g.grad_probabilities_stride;
    float* ds = grad_scores.data() + r * g.n;
    for (int64_t c = 0; c < g.n; ++c) {
      const bool kept = g.keep == nullptr || g.keep[r * g.keep_stride + c] != 0;
      const float scale = g.keep == nullptr ? 1.0f : g.keep_scale;
      ds[c] = p[c] * ((kept ? dp[c] * scale : 0.0f) - g.delta[r]);
      p[c] = kept ? p[c] * scale : 0.0f;
      g.grad_score_rows[r * g.grad_score_rows_stride + c] = bf16_bits(ds[c]);
      if (g.grad_scores_float != nullptr) g.grad_scores_float[r * g.grad_scores_float_stride + c] = ds[c];
    }
  }
  const int64_t columns = round_up(g.n, g.weights.width);
  for (const auto& [panels, values] : {std::pair{g.weights, &weights}, std::pair{g.grad_scores, &grad_scores}}) {
    for (int64_t t = 0; t < panels.depth; ++t) {
      for (int64_t j0 = 0; j0 < columns; j0 += 16) {
        uint16_t* to = panels.data + pair_offset(panels, t, j0);
        for (int64_t j = 0; j < 16; ++j) {
          for (int64_t k = 0; k < 2; ++k) {
            const int64_t r = 2 * t + k, c = j0 + j;
            to[2 * j + k] = r < g.rows && c < g.n ? bf16_bits((*values)[r * g.n + c]) : uint16_t(0);
          }
        }
      }
    }
  }
}

void transpose_bf16_portable(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t cols, int64_t padded_rows,
                             uint16_t* out, int64_t out_stride) {
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < padded_rows; ++r) out[c * out_stride + r] = r < rows ? x[r * x_stride + c] : uint16_t(0);
  }
}

template <typename T>
void transpose_portable(const T* x, int64_t x_stride, int64_t rows, int64_t cols, float* out, int64_t out_stride) {
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r) out[c * out_stride + r] = widened(x[r * x_stride + c]);
  }
}

}  // namespace

void softmax_backward_block(const GradScoresBlock& block) {
  TORCH_CHECK(block.weights.width % 16 == 0 && block.weights.width == block.grad_scores.width &&
                  block.weights.depth == block.grad_scores.depth && 2 * block.weights.depth >= block.rows,
              "softmax_backward_block: panels of width ", block.weights.width, " and ", block.grad_scores.width,
              ", depth ", block.weights.depth, " and ", block.grad_scores.depth, " for ", block.rows, " rows");
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (bf16_vectors()) return &softmax_backward_block_avx512;
#endif
    return &softmax_backward_block_portable;
  }();
  implementation(block);
}

void transpose_bf16(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t cols, int64_t padded_rows,
                    uint16_t* out, int64_t out_stride) {
  TORCH_CHECK(padded_rows % 32 == 0 && padded_rows >= rows, "transpose_bf16: ", rows,
              " rows padded to ", padded_rows, " (expected a multiple of 32, at least the rows)");
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (bf16_vectors()) return &transpose_bf16_avx512;
#endif
    return &transpose_bf16_portable;
  }();
  implementation(x, x_stride, rows, cols, padded_rows, out, out_stride);
}

namespace {

template <typename T>
void transpose_any(const T* x, int64_t x_stride, int64_t rows, int64_t cols, float* out, int64_t out_stride) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (bf16_vectors()) return &transpose_avx512<T>;
    if (avx2_vectors()) return &transpose_avx2<T>;
#endif
    return &transpose_portable<T>;
  }();
  implementation(x, x_stride, rows, cols, out, out_stride);
}

}  // namespace

void transpose(const float* x, int64_t x_stride, int64_t rows, int64_t cols, float* out, int64_t out_stride) {
  transpose_any(x, x_stride, rows, cols, out, out_stride);
}

void transpose(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t cols, float* out, int64_t out_stride) {
  transpose_any(x, x_stride, rows, cols, out, out_stride);
}

void transpose(const c10::Half* x, int64_t x_stride, int64_t rows, int64_t cols, float* out, int64_t out_stride) {
  transpose_any(x, x_stride, rows, cols, out, out_stride);
}

namespace {


#if defined(__x86_64__)
// float32, bfloat16 (raw bits) or float16 values, widened by load16_widened.
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) float dot_avx512(const T* a, const T* b, int64_t n) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = tail_lanes(n - i);
    sum = _mm512_fmadd_ps(load16_widened(a + i, lanes), load16_widened(b + i, lanes), sum);
  }
  return _mm512_reduce_add_ps(sum);
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void scale_into_half_avx512(const float* x, int64_t n,
                                                                                 float factor, c10::Half* out) {
  const __m512 factor_v = _mm512_set1_ps(factor);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = tail_lanes(n - i);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, x + i), factor_v);
    _mm256_mask_storeu_epi16(out + i, lanes, _mm512_cvtps_ph(v, kHalfRounding));
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void widen_avx512(const c10::Half* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = tail_lanes(n - i);
    _mm512_mask_storeu_ps(out + i, lanes, widen_half(x + i, lanes));
  }
}

// bf16_bits on 16 lanes with integer operations (no AVX512_BF16, whose conversion also flushes
// denormals to zero): + 0x7FFF + the lowest kept bit, then the high half; a NaN keeps its high half, made quiet.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void scale_into_bf16_avx512(const float* x, int64_t n,
                                                                                 float factor, uint16_t* out) {
  const __m512 factor_v = _mm512_set1_ps(factor);
  const __m512i rounding = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x40);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = tail_lanes(n - i);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, x + i), factor_v);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i high = _mm512_srli_epi32(bits, 16);
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, rounding), _mm512_and_si512(high, one)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, quiet));
    _mm256_mask_storeu_epi16(out + i, lanes, _mm512_cvtepi32_epi16(rounded));
  }
}
// The same row operations on 8-lane AVX2 vectors, for CPUs without AVX-512 (where a bfloat16
// attention runs float32 products on widened blocks). The dot products keep two vectors of
// partial sums, the 16 lanes of the other versions.

template <typename T>
__attribute__((target("avx2,fma,f16c"))) float dot_avx2(const T* a, const T* b, int64_t n) {
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    low = _mm256_fmadd_ps(load8(a + i), load8(b + i), low);
    high = _mm256_fmadd_ps(load8(a + i + 8), load8(b + i + 8), high);
  }
  float sum = sum_of_lanes(low, high);
  for (; i < n; ++i) sum += widened(a[i]) * widened(b[i]);
  return sum;
}

__attribute__((target("avx2,fma"))) void scale_into_bf16_avx2(const float* x, int64_t n, float factor,
                                                              uint16_t* out) {
  const __m256 factor_v = _mm256_set1_ps(factor);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    store8_bfloat16(round8_to_bfloat16(_mm256_mul_ps(_mm256_loadu_ps(x + i), factor_v)), out + i);
    store8_bfloat16(round8_to_bfloat16(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), factor_v)), out + i + 8);
  }
  for (; i < n; ++i) out[i] = bf16_bits(x[i] * factor);
}

__attribute__((target("avx2,fma,f16c"))) void scale_into_half_avx2(const float* x, int64_t n, float factor,
                                                                   c10::Half* out) {
  const __m256 factor_v = _mm256_set1_ps(factor);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i rounded = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(x + i), factor_v), kHalfRounding);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), rounded);
  }
  for (; i < n; ++i) out[i] = static_cast<c10::Half>(x[i] * factor);
}

__attribute__((target("avx2,fma,f16c"))) void widen_avx2(const c10::Half* x, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, widen8_half(x + i));
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
}
#endif


// The vector versions' 16 partial sums (lane i mod 16), then added in order.
template <typename T>
float dot_portable(const T* a, const T* b, int64_t n) {
  float partial[16] = {};
  for (int64_t i = 0; i < n; ++i) partial[i % 16] += widened(a[i]) * widened(b[i]);
  float sum = 0;
  for (float p : partial) sum += p;
  return sum;
}

void scale_into_bf16_portable(const float* x, int64_t n, float factor, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(x[i] * factor);
}

void scale_into_half_portable(const float* x, int64_t n, float factor, c10::Half* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<c10::Half>(x[i] * factor);
}

void widen_portable(const c10::Half* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

}  // namespace

namespace {

// The row loops of row_dots and scale_rows_into: one dispatch per block, the row functions above
// inlined into a loop compiled for the same instructions.
#if defined(__x86_64__)
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void row_dots_avx512(const T* a, int64_t a_stride, const T* b,
                                                                         int64_t b_stride, int64_t rows, int64_t n,
                                                                         float* out) {
  for (int64_t r = 0; r < rows; ++r) out[r] = dot_avx512(a + r * a_stride, b + r * b_stride, n);
}

template <typename T>
__attribute__((target("avx2,fma,f16c"))) void row_dots_avx2(const T* a, int64_t a_stride, const T* b, int64_t b_stride,
                                                       int64_t rows, int64_t n, float* out) {
  for (int64_t r = 0; r < rows; ++r) out[r] = dot_avx2(a + r * a_stride, b + r * b_stride, n);
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void scale_rows_into_bf16_avx512(
    const float* x, int64_t x_stride, int64_t rows, int64_t n, RowFactors factors, uint16_t* out, int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) scale_into_bf16_avx512(x + r * x_stride, n, factors.of(r), out + r * out_stride);
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void scale_rows_into_half_avx512(
    const float* x, int64_t x_stride, int64_t rows, int64_t n, RowFactors factors, c10::Half* out,
    int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) scale_into_half_avx512(x + r * x_stride, n, factors.of(r), out + r * out_stride);
}

__attribute__((target("avx2,fma,f16c"))) void scale_rows_into_half_avx2(const float* x, int64_t x_stride,
                                                                        int64_t rows, int64_t n, RowFactors factors,
                                                                        c10::Half* out, int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) scale_into_half_avx2(x + r * x_stride, n, factors.of(r), out + r * out_stride);
}

__attribute__((target("avx2,fma"))) void scale_rows_into_bf16_avx2(const float* x, int64_t x_stride, int64_t rows,
                                                                   int64_t n, RowFactors factors, uint16_t* out,
                                                                   int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) scale_into_bf16_avx2(x + r * x_stride, n, factors.of(r), out + r * out_stride);
}
#endif

template <typename T>
void row_dots_portable(const T* a, int64_t a_stride, const T* b, int64_t b_stride, int64_t rows, int64_t n,
                       float* out) {
  for (int64_t r = 0; r < rows; ++r) out[r] = dot_portable(a + r * a_stride, b + r * b_stride, n);
}

void scale_rows_into_bf16_portable(const float* x, int64_t x_stride, int64_t rows, int64_t n, RowFactors factors,
                                   uint16_t* out, int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) scale_into_bf16_portable(x + r * x_stride, n, factors.of(r), out + r * out_stride);
}

void scale_rows_into_half_portable(const float* x, int64_t x_stride, int64_t rows, int64_t n, RowFactors factors,
                                   c10::Half* out, int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) scale_into_half_portable(x + r * x_stride, n, factors.of(r), out + r * out_stride);
}

}  // namespace

void row_dots(const float* a, int64_t a_stride, const float* b, int64_t b_stride, int64_t rows, int64_t n,
              float* out) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (wide_vectors()) return &row_dots_avx512<float>;
    if (avx2_vectors()) return &row_dots_avx2<float>;
#endif
    return &row_dots_portable<float>;
  }();
  implementation(a, a_stride, b, b_stride, rows, n, out);
}

void row_dots(const uint16_t* a, int64_t a_stride, const uint16_t* b, int64_t b_stride, int64_t rows, int64_t n,
              float* out) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (wide_vectors()) return &row_dots_avx512<uint16_t>;
    if (avx2_vectors()) return &row_dots_avx2<uint16_t>;
#endif
    return &row_dots_portable<uint16_t>;
  }();
  implementation(a, a_stride, b, b_stride, rows, n, out);
}

void row_dots(const c10::Half* a, int64_t a_stride, const c10::Half* b, int64_t b_stride, int64_t rows, int64_t n,
              float* out) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (wide_vectors()) return &row_dots_avx512<c10::Half>;
    if (avx2_vectors()) return &row_dots_avx2<c10::Half>;
#endif
    return &row_dots_portable<c10::Half>;
  }();
  implementation(a, a_stride, b, b_stride, rows, n, out);
}

QKV_VECTORISED void scale_rows_into(const float* __restrict x, int64_t x_stride, int64_t rows, int64_t n,
                                    RowFactors factors, float* __restrict out, int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const float factor = factors.of(r);
    const float* __restrict row = x + r * x_stride;
    float* __restrict out_row = out + r * out_stride;
    for (int64_t i = 0; i < n; ++i) out_row[i] = row[i] * factor;
  }
}

void scale_rows_into(const float* x, int64_t x_stride, int64_t rows, int64_t n, RowFactors factors, uint16_t* out,
                     int64_t out_stride) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (wide_vectors()) return &scale_rows_into_bf16_avx512;
    if (avx2_vectors()) return &scale_rows_into_bf16_avx2;
#endif
    return &scale_rows_into_bf16_portable;
  }();
  implementation(x, x_stride, rows, n, factors, out, out_stride);
}

void scale_rows_into(const float* x, int64_t x_stride, int64_t rows, int64_t n, RowFactors factors, c10::Half* out,
                     int64_t out_stride) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (wide_vectors()) return &scale_rows_into_half_avx512;
    if (avx2_vectors()) return &scale_rows_into_half_avx2;
#endif
    return &scale_rows_into_half_portable;
  }();
  implementation(x, x_stride, rows, n, factors, out, out_stride);
}

void widen(const c10::Half* x, int64_t n, float* out) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (wide_vectors()) return &widen_avx512;
    if (avx2_vectors()) return &widen_avx2;
#endif
    return &widen_portable;
  }();
  implementation(x, n, out);
}

namespace {

// How far ahead the row-streaming routines below (a decoded token's dot products with the key rows
// and its weighted sum of the value rows) ask for the rows they will read: about 4 KiB, as whole
// rows. Each key and value row is read once per token, from memory or the last-level cache, and
// the CPU's own prefetchers did not keep up with rows read 16 at a time: at 4096 keys (8 heads of
// width 64, float32) a software prefetch 16 rows (4 KiB) ahead took a token from 0.17-0.21 ms to
// 0.13 ms (AMD EPYC Zen 5, 2 threads, 2026-12-07; 2 and 8 KiB ahead were no better).
constexpr int64_t kPrefetchBytes = 4096;

// How many bytes ahead of a row of n values to prefetch, rows `stride` values apart: whole rows,
// about kPrefetchBytes of them (at least one).
template <typename T>
int64_t prefetch_distance(int64_t n, int64_t stride) {
  const int64_t row_bytes = std::max<int64_t>(n * static_cast<int64_t>(sizeof(T)), 1);
  return std::max<int64_t>(1, kPrefetchBytes / row_bytes) * stride * static_cast<int64_t>(sizeof(T));
}

// A hint that the n values at x will be read soon: their cache lines asked for, nothing read. The
// address goes through an integer because the rows ahead may lie past the operand's end (the last
// rows of the last block), where forming the pointer would be undefined; a prefetch never faults.
template <typename T>
inline void prefetch_values(const T* x, int64_t ahead_bytes, int64_t n) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(x) + static_cast<uintptr_t>(ahead_bytes);
  const uintptr_t end = first + static_cast<uintptr_t>(n) * sizeof(T);
  for (uintptr_t line = first & ~uintptr_t{63}; line < end; line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 3);
  }
}

// The rows of a tile of several query rows against several keys (dots_of_rows_avx512 and _avx2):
// kRows query rows, x's first x_count with the last one repeated to fill the tile.
template <int kRows, typename T>
inline void tile_query_rows(const T* const* x, int64_t x_count, const T* (&query)[kRows]) {
  for (int64_t r = 0; r < kRows; ++r) query[r] = x[std::min<int64_t>(r, x_count - 1)];
}

// And kKeys key rows from row j0 on (`keys` of them real, the last one repeated), each asked for
// `ahead` bytes ahead (prefetch_distance).
template <int kKeys, typename T>
inline void tile_key_rows(const T* rows, int64_t row_stride, int64_t j0, int64_t keys, int64_t ahead, int64_t n,
                          const T* (&key)[kKeys]) {
  for (int64_t c = 0; c < kKeys; ++c) {
    key[c] = rows + (j0 + std::min<int64_t>(c, keys - 1)) * row_stride;
    prefetch_values(key[c], ahead, n);
  }
}

// add_weighted_rows: 64 columns of acc at a time in four registers, every row added into them
// before they are stored (V's rows are read once per 64 columns, acc once).
#if defined(__x86_64__)
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void add_weighted_rows_avx512(const T* x, int64_t x_stride,
                                                                                  int64_t rows, int64_t n,
                                                                                  const float* weights, float* acc) {
  const int64_t ahead = prefetch_distance<T>(n, x_stride);
  for (int64_t d0 = 0; d0 < n; d0 += 64) {
    __mmask16 lanes[4];
    __m512 sum[4];
    for (int i = 0; i < 4; ++i) {
      lanes[i] = tail_lanes(n - d0 - 16 * i);
      sum[i] = _mm512_maskz_loadu_ps(lanes[i], acc + d0 + 16 * i);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 w = _mm512_set1_ps(weights[r]);
      const T* row = x + r * x_stride + d0;
      prefetch_values(row, ahead, std::min<int64_t>(64, n - d0));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        sum[i] = _mm512_fmadd_ps(w, load16_widened(row + 16 * i, lanes[i]), sum[i]);
      }
    }
    for (int i = 0; i < 4; ++i) _mm512_mask_storeu_ps(acc + d0 + 16 * i, lanes[i], sum[i]);
  }
}

// 16 columns at a time in two registers; the last columns one by one.
template <typename T>
__attribute__((target("avx2,fma,f16c"))) void add_weighted_rows_avx2(const T* x, int64_t x_stride, int64_t rows,
                                                                     int64_t n, const float* weights, float* acc) {
  const int64_t ahead = prefetch_distance<T>(n, x_stride);
  int64_t d0 = 0;
  for (; d0 + 16 <= n; d0 += 16) {
    __m256 low = _mm256_loadu_ps(acc + d0), high = _mm256_loadu_ps(acc + d0 + 8);
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 w = _mm256_set1_ps(weights[r]);
      const T* row = x + r * x_stride + d0;
      prefetch_values(row, ahead, 16);
      low = _mm256_fmadd_ps(w, load8(row), low);
      high = _mm256_fmadd_ps(w, load8(row + 8), high);
    }
    _mm256_storeu_ps(acc + d0, low), _mm256_storeu_ps(acc + d0 + 8, high);
  }
  for (; d0 < n; ++d0) {
    float sum = acc[d0];
    for (int64_t r = 0; r < rows; ++r) sum = std::fma(weights[r], widened(x[r * x_stride + d0]), sum);
    acc[d0] = sum;
  }
}

// The 16 sums of acc[0..15]'s lanes as one register, lane i holding acc[i]'s: pairs of registers
// folded in halves (within 128-bit lanes, then across them), 45 instructions for 16 sums where one
// horizontal sum each took about as many instructions as the row's products.
__attribute__((target("avx512f"))) inline __m512 lane_sums_of_16(const __m512 (&acc)[16]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {  // lanes (4L + j): rows 2i, 2i + 1 alternating, half of each 128-bit lane
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                             _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // each 128-bit lane: rows 4i .. 4i + 3, that lane's part
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void dots_with_rows_avx512(const T* x, const T* rows,
                                                                               int64_t row_stride, int64_t count,
                                                                               int64_t n, float* out) {
  const int64_t ahead = prefetch_distance<T>(n, row_stride);
  int64_t r0 = 0;
  for (; r0 + 16 <= count; r0 += 16) {
    __m512 acc[16];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int i = 0; i < 16; ++i) prefetch_values(rows + (r0 + i) * row_stride, ahead, n);
    for (int64_t d0 = 0; d0 < n; d0 += 16) {
      const __mmask16 lanes = tail_lanes(n - d0);
      const __m512 xv = load16_widened(x + d0, lanes);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_fmadd_ps(xv, load16_widened(rows + (r0 + i) * row_stride + d0, lanes), acc[i]);
      }
    }
    _mm512_storeu_ps(out + r0, lane_sums_of_16(acc));
  }
  for (; r0 < count; ++r0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d0 = 0; d0 < n; d0 += 16) {
      const __mmask16 lanes = tail_lanes(n - d0);
      acc = _mm512_fmadd_ps(load16_widened(x + d0, lanes), load16_widened(rows + r0 * row_stride + d0, lanes), acc);
    }
    out[r0] = _mm512_reduce_add_ps(acc);
  }
}

// Dot products of a few query rows with the same key rows, in tiles of kRows rows × kKeys keys
// (4 × 4, or 2 × 8): 16 registers of partial sums, each key chunk loaded once for the kRows rows and
// each query chunk once for the kKeys keys (8 or 10 loads a 16 multiply-adds, where one row against
// 16 keys takes 17), the tile's 16 sums reduced together (lanes r·kKeys .. r·kKeys + kKeys - 1 of
// the result: row r's keys). Fewer than kRows rows or kKeys keys repeat the last one's pointer; only
// the real ones are stored.
template <int kRows, typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void dots_of_rows_avx512(const T* const* x, int64_t x_count,
                                                                             const T* rows, int64_t row_stride,
                                                                             int64_t count, int64_t n, float* out,
                                                                             int64_t out_stride) {
  static_assert(kRows == 2 || kRows == 4, "tiles of 2 × 8 or 4 × 4");
  constexpr int kKeys = 16 / kRows;
  const T* query[kRows];
  tile_query_rows(x, x_count, query);
  const int64_t ahead = prefetch_distance<T>(n, row_stride);
  for (int64_t j0 = 0; j0 < count; j0 += kKeys) {
    const int64_t keys = std::min<int64_t>(kKeys, count - j0);
    const T* key[kKeys];
    tile_key_rows(rows, row_stride, j0, keys, ahead, n, key);
    __m512 acc[16];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int64_t d0 = 0; d0 < n; d0 += 16) {
      const __mmask16 lanes = tail_lanes(n - d0);
      __m512 key_chunk[kKeys];
#pragma GCC unroll 8
      for (int c = 0; c < kKeys; ++c) key_chunk[c] = load16_widened(key[c] + d0, lanes);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m512 query_chunk = load16_widened(query[r] + d0, lanes);
#pragma GCC unroll 8
        for (int c = 0; c < kKeys; ++c) acc[kKeys * r + c] = _mm512_fmadd_ps(query_chunk, key_chunk[c], acc[kKeys * r + c]);
      }
    }
    const __m512 sums = lane_sums_of_16(acc);
    const auto stored = static_cast<__mmask8>((1u << keys) - 1u);
    if constexpr (kRows == 4) {
      _mm_mask_storeu_ps(out + j0, stored, _mm512_extractf32x4_ps(sums, 0));
      if (x_count > 1) _mm_mask_storeu_ps(out + out_stride + j0, stored, _mm512_extractf32x4_ps(sums, 1));
      if (x_count > 2) _mm_mask_storeu_ps(out + 2 * out_stride + j0, stored, _mm512_extractf32x4_ps(sums, 2));
      if (x_count > 3) _mm_mask_storeu_ps(out + 3 * out_stride + j0, stored, _mm512_extractf32x4_ps(sums, 3));
    } else {
      _mm256_mask_storeu_ps(out + j0, stored, _mm512_castps512_ps256(sums));
      if (x_count > 1) {
        const __m512 high = _mm512_shuffle_f32x4(sums, sums, 0xEE);  // lanes 8..15 moved down
        _mm256_mask_storeu_ps(out + out_stride + j0, stored, _mm512_castps512_ps256(high));
      }
    }
  }
}

// Weighted value rows added into kRows (2 to 4) query rows' accumulators: 64 columns of each in
// 4·kRows registers, each value row's chunk loaded once for the kRows rows (4 loads and kRows
// broadcasts a 4·kRows multiply-adds, where one row takes 4 loads a 4).
template <int kRows, typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void add_weighted_rows_into_avx512(
    const T* x, int64_t x_stride, int64_t count, int64_t n, const float* weights, int64_t weight_stride, float* acc,
    int64_t acc_stride) {
  static_assert(kRows >= 2 && kRows <= 4, "2 to 4 rows");
  const int64_t ahead = prefetch_distance<T>(n, x_stride);
  for (int64_t d0 = 0; d0 < n; d0 += 64) {
    __mmask16 lanes[4];
    __m512 sum[kRows][4];
    for (int i = 0; i < 4; ++i) lanes[i] = tail_lanes(n - d0 - 16 * i);
    for (int r = 0; r < kRows; ++r) {
      for (int i = 0; i < 4; ++i) sum[r][i] = _mm512_maskz_loadu_ps(lanes[i], acc + r * acc_stride + d0 + 16 * i);
    }
    for (int64_t j = 0; j < count; ++j) {
      const T* row = x + j * x_stride + d0;
      prefetch_values(row, ahead, std::min<int64_t>(64, n - d0));
      __m512 values[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) values[i] = load16_widened(row + 16 * i, lanes[i]);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m512 w = _mm512_set1_ps(weights[r * weight_stride + j]);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) sum[r][i] = _mm512_fmadd_ps(w, values[i], sum[r][i]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      for (int i = 0; i < 4; ++i) _mm512_mask_storeu_ps(acc + r * acc_stride + d0 + 16 * i, lanes[i], sum[r][i]);
    }
  }
}

#endif

template <typename T>
void dots_with_rows_portable(const T* x, const T* rows, int64_t row_stride, int64_t count, int64_t n, float* out) {
  row_dots(x, 0, rows, row_stride, count, n, out);  // one dot product a row
}

#if defined(__x86_64__)
// The 8 sums of acc[0..7]'s lanes as one register, lane i holding acc[i]'s: horizontal adds of
// pairs, then the two 128-bit halves added.
__attribute__((target("avx2,fma"))) inline __m256 lane_sums_of_8(const __m256 (&acc)[8]) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

// 8 rows at a time, as the AVX-512 version does 16; a width no 8 divides ends value by value.
template <typename T>
__attribute__((target("avx2,fma,f16c"))) void dots_with_rows_avx2(const T* x, const T* rows, int64_t row_stride,
                                                                  int64_t count, int64_t n, float* out) {
  const int64_t ahead = prefetch_distance<T>(n, row_stride);
  const int64_t whole = n - n % 8;
  int64_t r0 = 0;
  for (; r0 + 8 <= count; r0 += 8) {
    __m256 acc[8];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int i = 0; i < 8; ++i) prefetch_values(rows + (r0 + i) * row_stride, ahead, n);
    for (int64_t d0 = 0; d0 < whole; d0 += 8) {
      const __m256 xv = load8(x + d0);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(xv, load8(rows + (r0 + i) * row_stride + d0), acc[i]);
    }
    _mm256_storeu_ps(out + r0, lane_sums_of_8(acc));
    for (int64_t d = whole; d < n; ++d) {
      for (int i = 0; i < 8; ++i) out[r0 + i] = std::fma(widened(x[d]), widened(rows[(r0 + i) * row_stride + d]), out[r0 + i]);
    }
  }
  for (; r0 < count; ++r0) out[r0] = dot_avx2(x, rows + r0 * row_stride, n);
}

// Dot products of a few query rows with the same key rows in tiles of kRows rows × kKeys keys (4 × 2,
// or 2 × 4), as dots_of_rows_avx512 does with 16 registers: here 8 registers of partial sums (AVX2
// has 16 in all), reduced together by lane_sums_of_8 (lanes r·kKeys .. r·kKeys + kKeys - 1: row r's
// keys); each key chunk loaded once for the kRows rows, each query chunk once for the kKeys keys (6
// loads for 8 multiply-adds, where one row against 8 keys takes 9). A width no 8 divides ends value by
// value. Fewer than kRows rows or kKeys keys repeat the last one's pointer; only the real ones are
// stored.
template <int kRows, typename T>
__attribute__((target("avx2,fma,f16c"))) void dots_of_rows_avx2(const T* const* x, int64_t x_count, const T* rows,
                                                                int64_t row_stride, int64_t count, int64_t n,
                                                                float* out, int64_t out_stride) {
  static_assert(kRows == 2 || kRows == 4, "tiles of 2 × 4 or 4 × 2");
  constexpr int kKeys = 8 / kRows;
  const T* query[kRows];
  tile_query_rows(x, x_count, query);
  const int64_t stored_rows = std::min<int64_t>(kRows, x_count);
  const int64_t ahead = prefetch_distance<T>(n, row_stride);
  const int64_t whole = n - n % 8;
  for (int64_t j0 = 0; j0 < count; j0 += kKeys) {
    const int64_t keys = std::min<int64_t>(kKeys, count - j0);
    const T* key[kKeys];
    tile_key_rows(rows, row_stride, j0, keys, ahead, n, key);
    __m256 acc[8];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t d0 = 0; d0 < whole; d0 += 8) {
      __m256 key_chunk[kKeys];
#pragma GCC unroll 4
      for (int c = 0; c < kKeys; ++c) key_chunk[c] = load8(key[c] + d0);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m256 query_chunk = load8(query[r] + d0);
#pragma GCC unroll 4
        for (int c = 0; c < kKeys; ++c) acc[kKeys * r + c] = _mm256_fmadd_ps(query_chunk, key_chunk[c], acc[kKeys * r + c]);
      }
    }
    alignas(32) float sums[8];
    _mm256_store_ps(sums, lane_sums_of_8(acc));
    for (int64_t d = whole; d < n; ++d) {
      for (int r = 0; r < kRows; ++r) {
        for (int c = 0; c < kKeys; ++c) sums[kKeys * r + c] = std::fma(widened(query[r][d]), widened(key[c][d]), sums[kKeys * r + c]);
      }
    }
    for (int64_t r = 0; r < stored_rows; ++r) {
      for (int64_t c = 0; c < keys; ++c) out[r * out_stride + j0 + c] = sums[kKeys * r + c];
    }
  }
}

// Weighted value rows added into kRows (2 to 4) query rows' accumulators: 16 columns of each in
// 2·kRows registers, each value row's 16 values loaded once for the kRows rows (2 loads and kRows
// broadcasts a 2·kRows multiply-adds, where one row takes 2 loads a 2); the last columns (a width no
// 16 divides) value by value.
template <int kRows, typename T>
__attribute__((target("avx2,fma,f16c"))) void add_weighted_rows_into_avx2(const T* x, int64_t x_stride, int64_t count,
                                                                          int64_t n, const float* weights,
                                                                          int64_t weight_stride, float* acc,
                                                                          int64_t acc_stride) {
  static_assert(kRows >= 2 && kRows <= 4, "2 to 4 rows");
  const int64_t ahead = prefetch_distance<T>(n, x_stride);
  int64_t d0 = 0;
  for (; d0 + 16 <= n; d0 += 16) {
    __m256 sum[kRows][2];
    for (int r = 0; r < kRows; ++r) {
      sum[r][0] = _mm256_loadu_ps(acc + r * acc_stride + d0), sum[r][1] = _mm256_loadu_ps(acc + r * acc_stride + d0 + 8);
    }
    for (int64_t j = 0; j < count; ++j) {
      const T* row = x + j * x_stride + d0;
      prefetch_values(row, ahead, 16);
      const __m256 low = load8(row), high = load8(row + 8);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m256 w = _mm256_set1_ps(weights[r * weight_stride + j]);
        sum[r][0] = _mm256_fmadd_ps(w, low, sum[r][0]), sum[r][1] = _mm256_fmadd_ps(w, high, sum[r][1]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm256_storeu_ps(acc + r * acc_stride + d0, sum[r][0]), _mm256_storeu_ps(acc + r * acc_stride + d0 + 8, sum[r][1]);
    }
  }
  for (; d0 < n; ++d0) {
    for (int r = 0; r < kRows; ++r) {
      float sum = acc[r * acc_stride + d0];
      for (int64_t j = 0; j < count; ++j) sum = std::fma(weights[r * weight_stride + j], widened(x[j * x_stride + d0]), sum);
      acc[r * acc_stride + d0] = sum;
    }
  }
}
#endif

template <typename T>
void add_weighted_rows_portable(const T* x, int64_t x_stride, int64_t rows, int64_t n, const float* weights,
                                float* acc) {
  for (int64_t d = 0; d < n; ++d) {
    float sum = acc[d];
    for (int64_t r = 0; r < rows; ++r) sum += weights[r] * widened(x[r * x_stride + d]);
    acc[d] = sum;
  }
}

#if defined(__x86_64__)
// Which tiles of several query rows the row operations below take: AVX-512's (16 registers of sums)
// or AVX2's (8).
enum class RowTiles { Avx512, Avx2 };

// The query rows 4 at a time; 3 as a 4-row tile with one row repeated; 2 as a 2-row tile (2 × 8 keys
// on AVX-512, 2 × 4 on AVX2); a single row on the one-row routine (16 or 8 keys at a time).
template <RowTiles kTiles, typename T>
void dots_with_rows_in_tiles(const T* const* x, int64_t x_count, const T* rows, int64_t row_stride, int64_t count,
                             int64_t n, float* out, int64_t out_stride) {
  constexpr bool wide = kTiles == RowTiles::Avx512;
  for (int64_t r0 = 0; r0 < x_count; r0 += 4) {
    const int64_t group = std::min<int64_t>(4, x_count - r0);
    float* group_out = out + r0 * out_stride;
    if (group >= 3) {
      (wide ? dots_of_rows_avx512<4, T> : dots_of_rows_avx2<4, T>)(x + r0, group, rows, row_stride, count, n,
                                                                   group_out, out_stride);
    } else if (group == 2) {
      (wide ? dots_of_rows_avx512<2, T> : dots_of_rows_avx2<2, T>)(x + r0, group, rows, row_stride, count, n,
                                                                   group_out, out_stride);
    } else {
      (wide ? dots_with_rows_avx512<T> : dots_with_rows_avx2<T>)(x[r0], rows, row_stride, count, n, group_out);
    }
  }
}

// The accumulators 4 at a time (2 or 3 for the last ones); a single one on the one-row routine.
template <RowTiles kTiles, typename T>
void add_weighted_rows_in_tiles(const T* x, int64_t x_stride, int64_t count, int64_t n, const float* weights,
                                int64_t weight_stride, int64_t weight_rows, float* acc, int64_t acc_stride) {
  constexpr bool wide = kTiles == RowTiles::Avx512;
  for (int64_t r0 = 0; r0 < weight_rows; r0 += 4) {
    const int64_t group = std::min<int64_t>(4, weight_rows - r0);
    const float* group_weights = weights + r0 * weight_stride;
    float* group_acc = acc + r0 * acc_stride;
    const auto tile = [&](auto rows_of_tile) {
      constexpr int kRows = decltype(rows_of_tile)::value;
      (wide ? add_weighted_rows_into_avx512<kRows, T> : add_weighted_rows_into_avx2<kRows, T>)(
          x, x_stride, count, n, group_weights, weight_stride, group_acc, acc_stride);
    };
    switch (group) {
      case 4: tile(std::integral_constant<int, 4>{}); break;
      case 3: tile(std::integral_constant<int, 3>{}); break;
      case 2: tile(std::integral_constant<int, 2>{}); break;
      default: (wide ? add_weighted_rows_avx512<T> : add_weighted_rows_avx2<T>)(x, x_stride, count, n, group_weights, group_acc);
    }
  }
}
#endif

// Where neither is used: the query rows one at a time, on the one-row version.
template <typename T, void (*one_row)(const T*, const T*, int64_t, int64_t, int64_t, float*)>
void dots_with_rows_one_by_one(const T* const* x, int64_t x_count, const T* rows, int64_t row_stride, int64_t count,
                               int64_t n, float* out, int64_t out_stride) {
  for (int64_t r = 0; r < x_count; ++r) one_row(x[r], rows, row_stride, count, n, out + r * out_stride);
}

template <typename T, void (*one_row)(const T*, int64_t, int64_t, int64_t, const float*, float*)>
void add_weighted_rows_one_by_one(const T* x, int64_t x_stride, int64_t count, int64_t n, const float* weights,
                                  int64_t weight_stride, int64_t weight_rows, float* acc, int64_t acc_stride) {
  for (int64_t r = 0; r < weight_rows; ++r) one_row(x, x_stride, count, n, weights + r * weight_stride, acc + r * acc_stride);
}

template <typename T>
void dots_with_rows_any(const T* const* x, int64_t x_count, const T* rows, int64_t row_stride, int64_t count,
                        int64_t n, float* out, int64_t out_stride) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (wide_vectors()) return &dots_with_rows_in_tiles<RowTiles::Avx512, T>;
    if (avx2_vectors()) return &dots_with_rows_in_tiles<RowTiles::Avx2, T>;
#endif
    return &dots_with_rows_one_by_one<T, dots_with_rows_portable<T>>;
  }();
  implementation(x, x_count, rows, row_stride, count, n, out, out_stride);
}

template <typename T>
void add_weighted_rows_any(const T* x, int64_t x_stride, int64_t count, int64_t n, const float* weights,
                           int64_t weight_stride, int64_t weight_rows, float* acc, int64_t acc_stride) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (wide_vectors()) return &add_weighted_rows_in_tiles<RowTiles::Avx512, T>;
    if (avx2_vectors()) return &add_weighted_rows_in_tiles<RowTiles::Avx2, T>;
#endif
    return &add_weighted_rows_one_by_one<T, add_weighted_rows_portable<T>>;
  }();
  implementation(x, x_stride, count, n, weights, weight_stride, weight_rows, acc, acc_stride);
}

}  // namespace

void dots_with_rows(const float* const* x, int64_t x_count, const float* rows, int64_t row_stride, int64_t count,
                    int64_t n, float* out, int64_t out_stride) {
  dots_with_rows_any(x, x_count, rows, row_stride, count, n, out, out_stride);
}

void dots_with_rows(const uint16_t* const* x, int64_t x_count, const uint16_t* rows, int64_t row_stride,
                    int64_t count, int64_t n, float* out, int64_t out_stride) {
  dots_with_rows_any(x, x_count, rows, row_stride, count, n, out, out_stride);
}

void dots_with_rows(const c10::Half* const* x, int64_t x_count, const c10::Half* rows, int64_t row_stride,
                    int64_t count, int64_t n, float* out, int64_t out_stride) {
  dots_with_rows_any(x, x_count, rows, row_stride, count, n, out, out_stride);
}

void add_weighted_rows(const float* x, int64_t x_stride, int64_t count, int64_t n, const float* weights,
                       int64_t weight_stride, int64_t weight_rows, float* acc, int64_t acc_stride) {
  add_weighted_rows_any(x, x_stride, count, n, weights, weight_stride, weight_rows, acc, acc_stride);
}

void add_weighted_rows(const uint16_t* x, int64_t x_stride, int64_t count, int64_t n, const float* weights,
                       int64_t weight_stride, int64_t weight_rows, float* acc, int64_t acc_stride) {
  add_weighted_rows_any(x, x_stride, count, n, weights, weight_stride, weight_rows, acc, acc_stride);
}

void add_weighted_rows(const c10::Half* x, int64_t x_stride, int64_t count, int64_t n, const float* weights,
                       int64_t weight_stride, int64_t weight_rows, float* acc, int64_t acc_stride) {
  add_weighted_rows_any(x, x_stride, count, n, weights, weight_stride, weight_rows, acc, acc_stride);
}

// The one-row forms: the block versions over a single row (one dispatch mechanism for both).
float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  row_dots(a, 0, b, 0, 1, n, &sum);
  return sum;
}

float dot(const uint16_t* a, const uint16_t* b, int64_t n) {
  float sum = 0.0f;
  row_dots(a, 0, b, 0, 1, n, &sum);
  return sum;
}

float dot(const c10::Half* a, const c10::Half* b, int64_t n) {
  float sum = 0.0f;
  row_dots(a, 0, b, 0, 1, n, &sum);
  return sum;
}

void scale_into(const float* x, int64_t n, float factor, float* out) {
  scale_rows_into(x, 0, 1, n, RowFactors{nullptr, factor}, out, 0);
}

void scale_into(const float* x, int64_t n, float factor, uint16_t* out) {
  scale_rows_into(x, 0, 1, n, RowFactors{nullptr, factor}, out, 0);
}

namespace {

// lowbias32 (Chris Wellons' integer hash search): a bijection of 32-bit words with low bias.
inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

}  // namespace

QKV_VECTORISED void dropout_keep(uint64_t row_key, uint32_t first, int64_t n, uint32_t threshold,
                                 uint8_t* __restrict keep) {
  // Both halves of the 64-bit key take part: the column is mixed with the low half, hashed, mixed
  // with the high half and hashed again. Since lowbias32 is a bijection, two rows whose keys differ
  // in either half get different words in every column; rows collide only if all 64 bits agree.
  const uint32_t low = static_cast<uint32_t>(row_key), high = static_cast<uint32_t>(row_key >> 32);
  for (int64_t c = 0; c < n; ++c) {
    const uint32_t x = lowbias32(lowbias32((first + static_cast<uint32_t>(c)) * 0x9E3779B9u ^ low) ^ high);
    keep[c] = x >= threshold ? 1 : 0;
  }
}

}  // namespace qkv::kernels
