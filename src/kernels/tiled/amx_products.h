// Block products on Intel AMX tiles (AMX-BF16: TDPBF16PS multiplies a 16 × 32 bfloat16 tile of A
// by a 16-pair × 16-column tile of B, 16 × 16 float32 sums), for the CPUs that have them
// (Sapphire Rapids and later; cpu_features.h asks the CPU and the kernel). Private to qkv.
//
// B comes packed by PackedRight exactly as for AVX512_BF16 (column panels of bfloat16 row pairs,
// which is AMX's own "VNNI" layout for B), only with its pairs padded with zeros to whole tiles.
// A is read where it lies when it is bfloat16 rows of whole tiles, and otherwise rounded (float32)
// or copied into rows padded with zeros: A's padding meets B's zeros, or rows of B past a leading
// part, which are replaced by zeros first, so that no value outside the product reaches a sum.
#pragma once

#include "kernels/tiled/packed_products.h"

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace qkv::kernels::tiled::amx {

/// Pairs of B per tile (the reduction of one TDPBF16PS is 16 pairs = 32 values); PackedRight pads
/// an AMX operand's pairs to a multiple of it.
constexpr int64_t kPairsPerTile = 16;

/// C (m × n, row stride ldc) = alpha · A · B + beta · C over B's leading k × n, as multiply() in
/// packed_products.h: `b` must be packed for ProductIsa::AmxBf16 with bfloat16 products.
void multiply(Strided<float> a, int64_t m, const PackedRight& b, int64_t k, int64_t n, float alpha, float beta,
              float* c, int64_t ldc);
void multiply(Strided<c10::BFloat16> a, int64_t m, const PackedRight& b, int64_t k, int64_t n, float alpha,
              float beta, float* c, int64_t ldc);

/// B (k × n) of bfloat16 values into PackedRight's AMX panels: one tile (16 columns) wide,
/// `depth` pairs of rows deep (a multiple of kPairsPerTile), row pairs interleaved value by value;
/// `panels` must hold zeros where B has no values. From B's rows (b_stride apart), or from X = Bᵀ's
/// rows (B's columns, x_stride apart: the keys of Kᵀ), 16 × 16 pairs at a time.
void pack_rows(const uint16_t* b, int64_t b_stride, int64_t k, int64_t n, int64_t depth, uint16_t* panels);
void pack_columns(const uint16_t* x, int64_t x_stride, int64_t k, int64_t n, int64_t depth, uint16_t* panels);

/// Asks Linux for this process's permission to use the tiles' 8 KiB register state (arch_prctl
/// ARCH_REQ_XCOMP_PERM for XTILEDATA; without it the first tile instruction raises SIGILL). True
/// when granted (or where no such permission exists); called once, by cpu_features.cpp.
bool request_tile_permission();

}  // namespace qkv::kernels::tiled::amx
