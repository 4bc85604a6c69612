// The linear layers' products on the CPU, where they do not take LibTorch's (src/linear.h picks):
// - bfloat16 (CPU autocast to bfloat16) on oneDNN's bfloat16 GEMM, or, where the CPU has no
//   bfloat16 instructions, on qkv's own float32 micro-kernels (the tiled kernel's,
//   kernels/tiled/packed_products.h) with the bfloat16 operands widened as they are packed (where
//   those kernels are plain C++, on a signal-safe oneDNN's float32 GEMM with the operands widened
//   first), their float32 results rounded to bfloat16 while they are still in cache;
// - float32 on the same micro-kernels, where the process's oneDNN float32 GEMM cannot be used
//   (kernels/linear/onednn_gemm.h: none loaded, or one before 3.11.2, whose kernels corrupt the heap
//   when a signal is handled during a product).
// Private to qkv.
//
// Why qkv's micro-kernels and not oneDNN's float32 GEMM for widened bfloat16: oneDNN's GEMM takes
// float32 only, so each block of bfloat16 operands was widened into scratch first and then read
// again by the GEMM, which packs it once more. The micro-kernels take B packed once per call
// (widened on the way) and widen A's rows into a block of their own. Single products on one
// thread, operands in cache (AMD EPYC Zen 5, 2026-12-04, 256 rows, 128 → 384): oneDNN 2.6.3's
// sgemm 112 GFLOP/s on AVX2 and 207 on AVX-512, the micro-kernels 117 and 234. The lm's linear
// layers under bf16-mixed (4096 rows, 2 threads, a one-off harness timing detail::linear, not
// kept; medians of 50 calls): forward 2–6% faster on AVX2, 8–13% on AVX-512 without AVX512_BF16
// (both emulated), backward 1–13% and 0–5%. For float32 alone they are no faster than oneDNN
// 2.6.3's GEMM (the lm's float32 step 2–3% slower on AVX-512, 4% faster on AVX2; docs/PERFORMANCE.md,
// twenty-second session): where oneDNN's GEMM is signal-safe the float32 route stays on it.
//
// oneDNN's GEMM API writes float32. Written whole and rounded in a second pass, the lm's outputs
// went to memory and back (4 + 4 + 2 bytes a value against 2): as slow as LibTorch's bfloat16
// matmul, whose oneDNN primitive writes bfloat16 itself. Here each task multiplies a block of rows
// into a float32 scratch of its own and rounds it into the output at once. LibTorch 1.13's own
// conversion (Tensor::to(kBFloat16)) rounds one value at a time (1.17 ms for 2M values on AMD EPYC
// Zen 5, 2 threads, 2026-12-03); round_to_bfloat16 is the same rounding in a vector loop.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace qkv::kernels::linear {

/// `t` (float32) rounded to bfloat16 to nearest, ties to even, a NaN kept a (quiet) NaN: the same
/// bits as c10::BFloat16's conversion. A contiguous float32 CPU tensor by qkv's loop, anything else
/// by t.to(kBFloat16).
at::Tensor round_to_bfloat16(const at::Tensor& t);

/// `count` float32 values rounded to bfloat16 bits as round_to_bfloat16 rounds them, and `count`
/// bfloat16 bits widened to float32 (exact): vector loops on the calling thread.
void round_values(const float* from, uint16_t* into, int64_t count);
void widen_values(const uint16_t* from, float* into, int64_t count);

/// `t` (float32) in `dtype`: round_to_bfloat16 for bfloat16, else t.to(dtype).
at::Tensor float32_to(const at::Tensor& t, at::ScalarType dtype);


/// Which GEMM multiplies bfloat16 operands: oneDNN's bfloat16 GEMM (OneDnnGemm::multiply_bf16,
/// which must be available), or float32 products: qkv's float32 micro-kernels on the tiled kernel's
/// active instruction set, B widened as it is packed and A a block of rows at a time, in cache
/// (oneDNN's float32 GEMM on widened blocks where that instruction set is portable) (CPUs
/// without bfloat16 instructions: whole operands widened first cost a pass over memory each, 3.2%
/// of the lm's bf16-mixed step there); a long sum (a weight's gradient) 256 at a time.
enum class Bfloat16Gemm { OneDnn, Float32 };

/// Whether Bfloat16Gemm::Float32 multiplies on qkv's vector micro-kernels (the tiled kernel's active
/// instruction set has AVX2 + FMA or more); where it does not, it needs oneDNN's float32 GEMM.
bool float32_products_on_micro_kernels();

/// C (m × n, float32, row stride ldc) = op(A) · op(B) + beta · C, A and B bfloat16 (the raw bits),
/// each row-major with its row stride or transposed (as OneDnnGemm::multiply), on `gemm`; m, n, k > 0.
void multiply_bfloat16(Bfloat16Gemm gemm, bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k,
                       const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
                       int64_t ldc);

/// The same product with A and B in float32, on qkv's float32 micro-kernels as Bfloat16Gemm::Float32
/// multiplies (as tasks: blocks of C's rows sharing op(B) packed once; for few rows or a short
/// weight-gradient sum, blocks of C's columns each packing its own; or a long sum's groups, added
/// in a fixed order: each value is summed in the same order whatever the threads). Where the tiled
/// kernel's instruction set is portable the micro-kernels are plain C++: right, but about 40× slower
/// than a BLAS (the linear layers then use LibTorch's products, linear.h). For float32 linear
/// layers where the process's oneDNN GEMM cannot be used (onednn_gemm.h: none loaded, or one that
/// is not signal-safe).
void multiply_float32(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                      const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

/// A bfloat16 matrix operand of a product: row-major with row stride `ld`, or (transposed) its
/// transpose stored so.
struct Bf16Operand {
  const at::Tensor& tensor;  // bfloat16
  bool transposed = false;
  int64_t ld = 0;
};

/// (m × n) bfloat16 = round(op(a) (m × k) · op(b) (k × n) + bias), accumulated in float32 on `gemm`,
/// the bias (float32 or bfloat16, n values, or undefined) added in float32 before the one rounding.
/// `a` must not be transposed (its rows are split among the threads).
at::Tensor bfloat16_product(Bfloat16Gemm gemm, int64_t m, int64_t n, int64_t k, const Bf16Operand& a,
                            const Bf16Operand& b, const at::Tensor& bias);

/// The float32 sums of the columns of a (m × n) contiguous bfloat16 matrix, as one GEMM on `gemm`
/// with a row of ones: (n).
at::Tensor bfloat16_column_sums(Bfloat16Gemm gemm, const at::Tensor& rows);

/// The rows of one group of a long sum on the float32 route (a weight gradient's): one task each.
constexpr int64_t kRowsPerSumGroup = 1024;

/// What linear_gradients_widened computes: each gradient undefined where it was not asked for.
struct LinearGradients {
  at::Tensor grad_x, grad_weight, grad_bias;
};

/// The gradients of y = x Wᵀ + b whose products multiply bfloat16 on the float32 route
/// (Bfloat16Gemm::Float32), in one pass over blocks of 256 rows: each block of grad (M × N) is
/// widened once for all three products, where the separate products widened it three times
/// (dx = grad · W, dW = gradᵀ · x, db = the column sums of grad). grad and x (M × K) contiguous
/// bfloat16 (x unused unless want_weight); W, the bfloat16 weight (N × K), as the right operand of
/// dx (transposed: stored as Wᵀ, a K × N matrix). dx comes in float32, or rounded to bfloat16 where
/// round_grad_x; dW (N × K) and db (N) in float32. The sums over the rows run in groups of
/// kRowsPerSumGroup rows, one task each, added in a fixed order: the results do not depend on the
/// threads. A single group (up to kRowsPerSumGroup rows) runs as three products instead, each split
/// among the threads as multiply_float32's are, with the same sums in the same order.
///
/// At the lm's shapes (4096 rows; AVX2 emulated on AMD EPYC Zen 5, 2 threads, 2026-12-03) the
/// backward went from 5.30 to 5.05 ms (128 → 384), 7.41 to 7.11 (128 → 512) and 7.13 to 6.73
/// (512 → 128); a later run timed both precisions in one process: bf16-mixed 4.66, 6.15, 6.55 ms
/// against float32's 5.20, 7.13, 7.18 (then on oneDNN's float32 GEMM; see the top of this file for
/// the micro-kernels').
LinearGradients linear_gradients_widened(const at::Tensor& grad, const at::Tensor& x, const Bf16Operand& weight,
                                         bool want_x, bool round_grad_x, bool want_weight, bool want_bias);

}  // namespace qkv::kernels::linear
