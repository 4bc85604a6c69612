// bfloat16 ⇄ float32 on the bits, written so that loops over them vectorize. Private to qkv.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define QKV_BFLOAT16_AVX2 1
#endif

namespace qkv::kernels {

/// The float32 a bfloat16 stands for (exact: bfloat16 is float32's upper half).
inline float bfloat16_bits_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof value);
  return value;
}

/// `value` rounded to bfloat16, to nearest, ties to even, a NaN made the quiet NaN 0x7FC0: the same
/// bits as c10::BFloat16's conversion. Adding 0x7FFF plus the lowest kept bit carries into the kept
/// half exactly when the dropped half is above the midpoint, or at it with an odd kept half.
inline uint16_t float_to_bfloat16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return nan ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

#if defined(QKV_BFLOAT16_AVX2)
// The same on 8 lanes, for functions compiled for AVX2 (target("avx2,fma")) that the caller
// dispatches to at run time.

/// 8 bfloat16 values (their bits) widened to float32.
__attribute__((target("avx2,fma"))) inline __m256 widen8_bfloat16(const uint16_t* x) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

/// 8 float32 values rounded to bfloat16 as float_to_bfloat16_bits rounds them, in the low half of
/// each 32-bit lane; a NaN keeps its sign and its payload's high half, made quiet.
__attribute__((target("avx2,fma"))) inline __m256i round8_to_bfloat16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v), high = _mm256_srli_epi32(bits, 16);
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), _mm256_and_si256(high, _mm256_set1_epi32(1))),
      16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
}

/// round8_to_bfloat16's 8 lanes stored as 8 bfloat16 values.
__attribute__((target("avx2,fma"))) inline void store8_bfloat16(__m256i rounded, uint16_t* out) {
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
}
#endif

}  // namespace qkv::kernels
