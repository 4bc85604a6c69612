// 16 × 16 32-bit values in 16 AVX-512 registers, transposed in place: the one shuffle network
// behind the tiled kernel's transposes (AMX's packing of B, float32 and bfloat16-pair transposes
// of the backward). Callers compile it into their own AVX-512 targets (a function may inline a
// callee whose target is a subset of its own). Private to qkv.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

namespace qkv::kernels::tiled {

// Rows become columns: unpack the 32-bit and 64-bit halves within 128-bit lanes, then exchange
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
