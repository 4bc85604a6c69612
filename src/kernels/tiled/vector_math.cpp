// Compiled with -fno-trapping-math -fno-math-errno (see src/CMakeLists.txt): without them GCC
// keeps the comparisons below as branches and does not vectorise the loops.
#include "kernels/tiled/vector_math.h"

#include "kernels/tiled/cpu_features.h"

#include <cmath>
#include <cstring>
#include <limits>
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

#define QKV_VECTORISED __attribute__((target_clones("avx2,fma", "default")))

namespace qkv::kernels {

namespace {

float exp_shifted_sum_compiled(float* __restrict x, int64_t n, float factor, float shift);

// Whether the row operations take their AVX-512 versions (the instruction set the kernel's
// products use, so QKV_TILED_ISA lowers both together).
bool wide_vectors() { return tiled::at_least(tiled::active_isa(), tiled::ProductIsa::Avx512); }

#if defined(__x86_64__)
// The lanes of a 16-float vector that hold one of the `left` values still to do.
__attribute__((target("avx512f"))) inline __mmask16 tail_lanes(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
}

// The same polynomial as below, written for AVX-512: vscalefps multiplies by 2^k (the compiler's
// version of the bit assembly and the NaN blends cost a fifth of the bf16 backward), and a NaN
// passes through every step by itself. No clamping: vscalefps gives infinity for a large k by
// itself, and the lanes below -87 (-inf's among them, whose r is NaN) are set to 0 at the end.
__attribute__((target("avx512f"))) inline __m512 exp_of(__m512 v, __mmask16 lanes) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), ln2_high = _mm512_set1_ps(0.693359375f),
               ln2_low = _mm512_set1_ps(-2.12194440e-4f), one = _mm512_set1_ps(1.0f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);  // -inf included
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(k, ln2_low, _mm512_fnmadd_ps(k, ln2_high, v));
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  const __m512 exp_r = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, one));
  return _mm512_maskz_mov_ps(lanes & ~underflow, _mm512_scalef_ps(exp_r, k));
}

__attribute__((target("avx512f"))) float exp_shifted_sum_avx512(float* x, int64_t n, float factor, float shift) {
  const __m512 factor_v = _mm512_set1_ps(factor), shift_v = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = tail_lanes(n - i);
    const __m512 e = exp_of(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(lanes, x + i), factor_v, shift_v), lanes);
    _mm512_mask_storeu_ps(x + i, lanes, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) float exp_shifted_sum_to_bf16_avx512(const float* x, int64_t n,
                                                                                  float factor, float shift,
                                                                                  uint16_t* out) {
  const __m512 factor_v = _mm512_set1_ps(factor), shift_v = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = tail_lanes(n - i);
    const __m512 e = exp_of(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(lanes, x + i), factor_v, shift_v), lanes);
    _mm256_mask_storeu_epi16(out + i, lanes, (__m256i)_mm512_cvtneps_pbh(e));
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}
#endif

}  // namespace

float exp_shifted_sum(float* x, int64_t n, float factor, float shift) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (wide_vectors()) return &exp_shifted_sum_avx512;
#endif
    return &exp_shifted_sum_compiled;
  }();
  return implementation(x, n, factor, shift);
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

float exp_shifted_sum_to_bf16_portable(const float* x, int64_t n, float factor, float shift, uint16_t* out) {
  thread_local std::vector<float> values;
  values.assign(x, x + n);
  const float sum = exp_shifted_sum(values.data(), n, factor, shift);
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(values[i]);
  return sum;
}

}  // namespace

float exp_shifted_sum_to_bf16(const float* x, int64_t n, float factor, float shift, uint16_t* out) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (tiled::at_least(tiled::active_isa(), tiled::ProductIsa::Avx512Bf16)) return &exp_shifted_sum_to_bf16_avx512;
#endif
    return &exp_shifted_sum_to_bf16_portable;
  }();
  return implementation(x, n, factor, shift, out);
}

namespace {

QKV_VECTORISED float exp_shifted_sum_compiled(float* __restrict x, int64_t n, float factor, float shift) {
  // exp(v) = 2^k · exp(r), k = round(v / ln 2), r = v - k ln 2 in [-ln2/2, ln2/2]; exp(r) by the
  // minimax polynomial of Cephes' expf; 2^k by writing k into the exponent bits.
  constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 · 2^23: adding and subtracting it rounds to an integer
  for (int64_t i = 0; i < n; ++i) {
    const float v = factor * x[i] - shift;  // one fused multiply-add where the clone has FMA
    // Written so that a NaN lands on -87 (every comparison with NaN is false): k then stays a small
    // integer, whose conversion and shift below are defined; the NaN itself is restored at the end.
    const float clamped = v >= -87.0f ? (v <= 88.0f ? v : 88.0f) : -87.0f;
    const float k = (clamped * kLog2e + kRound) - kRound;
    const float r = clamped - k * kLn2High - k * kLn2Low;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
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

double exp_shifted_sum(double* x, int64_t n, double factor, double shift) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(factor * x[i] - shift);
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

__attribute__((target("avx2"))) float max_of_avx2(const float* x, int64_t n) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best = _mm256_max_ps(best, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
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
    if (tiled::at_least(tiled::active_isa(), tiled::ProductIsa::Avx2)) return &max_of_avx2;
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

QKV_VECTORISED void softmax_backward(const float* __restrict p, float* __restrict ds, int64_t n, float delta) {
  for (int64_t i = 0; i < n; ++i) ds[i] = p[i] * (ds[i] - delta);
}

void softmax_backward(const double* p, double* ds, int64_t n, double delta) {
  for (int64_t i = 0; i < n; ++i) ds[i] = p[i] * (ds[i] - delta);
}

namespace {

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void softmax_backward_to_bf16_avx512(
    const float* p, float* ds, int64_t n, float delta, uint16_t* out) {
  const __m512 delta_v = _mm512_set1_ps(delta);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = tail_lanes(n - i);
    const __m512 value = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, p + i),
                                       _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, ds + i), delta_v));
    _mm512_mask_storeu_ps(ds + i, lanes, value);
    _mm256_mask_storeu_epi16(out + i, lanes, (__m256i)_mm512_cvtneps_pbh(value));
  }
}
#endif

void softmax_backward_to_bf16_portable(const float* p, float* ds, int64_t n, float delta, uint16_t* out) {
  softmax_backward(p, ds, n, delta);
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(ds[i]);
}

}  // namespace

void softmax_backward_to_bf16(const float* p, float* ds, int64_t n, float delta, uint16_t* out) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (tiled::at_least(tiled::active_isa(), tiled::ProductIsa::Avx512Bf16)) return &softmax_backward_to_bf16_avx512;
#endif
    return &softmax_backward_to_bf16_portable;
  }();
  implementation(p, ds, n, delta, out);
}

namespace {

#if defined(__x86_64__)
__attribute__((target("avx512f"))) float dot_avx512(const float* a, const float* b, int64_t n) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = tail_lanes(n - i);
    sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, a + i), _mm512_maskz_loadu_ps(lanes, b + i), sum);
  }
  return _mm512_reduce_add_ps(sum);
}

// 16 bfloat16 values widened to float32: their bits are the high half of the float's.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 widen_bf16(const uint16_t* x, __mmask16 lanes) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, x)), 16));
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) float dot_bf16_avx512(const uint16_t* a, const uint16_t* b,
                                                                           int64_t n) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = tail_lanes(n - i);
    sum = _mm512_fmadd_ps(widen_bf16(a + i, lanes), widen_bf16(b + i, lanes), sum);
  }
  return _mm512_reduce_add_ps(sum);
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
#endif

inline float widened(float value) { return value; }
inline float widened(uint16_t bits) { return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits())); }

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

}  // namespace

float dot(const float* a, const float* b, int64_t n) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (wide_vectors()) return &dot_avx512;
#endif
    return &dot_portable<float>;
  }();
  return implementation(a, b, n);
}

float dot(const uint16_t* a, const uint16_t* b, int64_t n) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (wide_vectors()) return &dot_bf16_avx512;
#endif
    return &dot_portable<uint16_t>;
  }();
  return implementation(a, b, n);
}

QKV_VECTORISED void scale_into(const float* __restrict x, int64_t n, float factor, float* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * factor;
}

void scale_into(const float* x, int64_t n, float factor, uint16_t* out) {
  static const auto implementation = [] {
#if defined(__x86_64__)
    if (wide_vectors()) return &scale_into_bf16_avx512;
#endif
    return &scale_into_bf16_portable;
  }();
  implementation(x, n, factor, out);
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
