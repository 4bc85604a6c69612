// The two shuffles behind the tiled kernel's bfloat16 pair layouts (packed right operands, AMX's
// tiles, the backward's transposes): two rows' values interleaved into pairs, and 16 × 16 32-bit
// values (pairs) transposed. Callers compile them into their own AVX-512 targets (a function may
// inline a callee whose target is a subset of its own). Private to qkv.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

namespace qkv::kernels::tiled {

// A register holding 16 bfloat16 values of one row in its low half and 16 of the next row in its
// high half, interleaved value by value: 16 pairs (even row's value first).
__attribute__((target("avx512f,avx512bw"))) inline __m512i interleave_halves(__m512i halves) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, halves);
}

// 16 × 16 32-bit values in 16 registers, transposed in place. Rows become columns: unpack the 32-bit and 64-bit halves within 128-bit lanes, then exchange
// the lanes.
__attribute__((target("avx512f"))) inline void transpose_16x16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + c], lane L: rows i .. i + 3 of column 4L + c
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  __m512i columns[16];
  for (int c = 0; c < 4; ++c) {
    const __m512i low01 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), high01 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i low23 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i high23 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    columns[c] = _mm512_shuffle_i32x4(low01, low23, 0x88);
    columns[4 + c] = _mm512_shuffle_i32x4(low01, low23, 0xDD);
    columns[8 + c] = _mm512_shuffle_i32x4(high01, high23, 0x88);
    columns[12 + c] = _mm512_shuffle_i32x4(high01, high23, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = columns[i];
}

}  // namespace qkv::kernels::tiled

#endif
