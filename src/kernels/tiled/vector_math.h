// Row operations of the tiled kernel, vectorised: AVX-512 and AVX2 versions (intrinsics, or loops
// the compiler clones) beside the baseline, chosen at run time by the instruction set the kernel's
// products use (QKV_TILED_ISA lowers both) or by the CPU. Private to qkv.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

namespace qkv::kernels {

/// x[i] <- exp((factor · x[i] - shift) - then) for i < n (factor > 0), and returns their sum.
/// Entries where the exponent is below -87 (masked ones are -inf) become exactly 0; a NaN stays
/// NaN. float: a Cephes-style polynomial, relative error below 1e-7 (factor · x[i] - shift formed
/// by one fused multiply-add); double: std::exp. The factor is the softmax scale when the scores
/// come unscaled from their product (kernel.h, Problem::deferred_scale). `then` is the backward's
/// log of the row's sum, taken after its maximum `shift` (RowStatistics in kernel.h).
float exp_shifted_sum(float* x, int64_t n, float factor, float shift, float then = 0.0f);
double exp_shifted_sum(double* x, int64_t n, double factor, double shift, double then = 0.0);
inline float exp_shifted_sum(float* x, int64_t n, float shift) { return exp_shifted_sum(x, n, 1.0f, shift); }

/// As exp_shifted_sum, but the exponentials go to `out` as bfloat16 (raw bits, rounded to nearest
/// even), for the bfloat16 block products that multiply them next, and x is left as it was; the
/// sum is of the float32 values. One pass where rounding the float32 results afterwards took two.
/// On AVX-512 the exponentials are those of a shorter polynomial (relative error below 3e-6, plus
/// |v| · 6e-8 from forming v · log2(e): far below bfloat16's 2^-9), as are softmax_backward_block's.
/// Where `largest` is not null it receives the largest x[i] of the same pass (-inf for n = 0; a NaN
/// may or may not be taken, but it always reaches the sum): the forward's shift for a block is
/// then the row maximum so far, checked afterwards, instead of a pass for the block's maximum first.
float exp_shifted_sum_to_bf16(const float* x, int64_t n, float factor, float shift, uint16_t* out,
                              float* largest = nullptr);
inline double exp_shifted_sum(double* x, int64_t n, double shift) { return exp_shifted_sum(x, n, 1.0, shift); }

/// The exponentials and sum of exp_shifted_sum_to_bf16, bit for bit, kept in float32 in place of
/// x: the weights of a block whose bfloat16 products round them next (to the same bfloat16 values
/// as exp_shifted_sum_to_bf16 writes) but which are also needed in float32 (probabilities kept for
/// the backward, dropout). With it the forward's output does not depend on whether a backward
/// follows.
float exp_shifted_sum_for_bf16(float* x, int64_t n, float factor, float shift);

/// The larger of a and b, where a NaN in either wins: a row with a NaN score must give NaN, as
/// softmax does, not pass for a fully masked row (whose maximum is -inf). std::max drops a NaN in
/// its second argument.
template <typename T>
inline T nan_max(T a, T b) {
  return (b > a || b != b) ? b : a;
}

/// The largest of x[0 .. n) (-inf for n = 0; NaN if any is NaN).
float max_of(const float* x, int64_t n);
double max_of(const double* x, int64_t n);

/// x[i] <- x[i] * factor.
void scale(float* x, int64_t n, float factor);
void scale(double* x, int64_t n, double factor);

/// x[i] <- x[i] * factor + bias[i]: an additive mask added to scores still to be scaled.
void scale_add(float* x, int64_t n, float factor, const float* bias);
void scale_add(double* x, int64_t n, double factor, const double* bias);

/// x[i] <- x[i] + y[i].
void add_into(float* x, int64_t n, const float* y);
void add_into(double* x, int64_t n, const double* y);

/// x[i] <- -inf where allowed[i] is false: a boolean mask applied to scores.
void mask_out(float* x, int64_t n, const bool* allowed);
void mask_out(double* x, int64_t n, const bool* allowed);

/// ds[i] <- p[i] * (ds[i] - delta): softmax's backward for one row.
void softmax_backward(const float* p, float* ds, int64_t n, float delta);
void softmax_backward(const double* p, double* ds, int64_t n, double delta);

/// Where a bfloat16 right operand's pairs lie in its panels (PackedRight, packed_products.h): the
/// pair of rows (2t, 2t + 1) of column j at data[(j / width) · depth · 2 · width + t · 2 · width +
/// (j % width) · 2], the even row's value first.
struct PairPanels {
  uint16_t* data = nullptr;
  int64_t width = 0, depth = 0;
};

/// Values of each row's softmax statistics, m then log l (what they are: kernel.h).
constexpr int64_t kRowStatistics = 2;

/// One block of the backward whose products multiply bfloat16 (`rows` query rows × `n` keys), in
/// one pass: the probabilities P = exp((factor · S - m) - log l) (or P itself where the forward kept it),
/// dropout's kept pairs, dS = P ⊙ (dP - D), and what the block's three products take next, rounded
/// to bfloat16 (nearest even): P ⊙ Z / (1 - p) and dS as the pair panels of right operands (dVᵀ +=
/// dOᵀ · P, dKᵀ += Qᵀ · dS: their reduction runs along the rows, so no operand is transposed per
/// block), dS as rows (dQ += dS · K), and dS in float32 where asked (an additive mask's gradient).
struct GradScoresBlock {
  int64_t rows = 0, n = 0;
  const float* scores = nullptr;  // S, unscaled by `factor` (P itself where row_statistics is null)
  int64_t scores_stride = 0;
  const float* row_statistics = nullptr;  // kRowStatistics of each row; m = +inf: a row with no key, P = 0
  float factor = 1;
  const float* grad_probabilities = nullptr;  // dP = dO Vᵀ
  int64_t grad_probabilities_stride = 0;
  const float* delta = nullptr;  // D = rowsum(dO ⊙ O) of each row
  const uint8_t* keep = nullptr;  // dropout's decisions (1: kept); null: no dropout
  int64_t keep_stride = 0;
  float keep_scale = 1;  // 1 / (1 - p)
  // Outputs. The panels are written whole, for every pair up to their depth and every column up to
  // a multiple of their width: zeros past `rows` and past `n`.
  PairPanels weights, grad_scores;
  uint16_t* grad_score_rows = nullptr;
  int64_t grad_score_rows_stride = 0;
  float* grad_scores_float = nullptr;  // may be null
  int64_t grad_scores_float_stride = 0;
};
void softmax_backward_block(const GradScoresBlock& block);

/// out[c · out_stride + r] = x[r · x_stride + c] for r < rows, c < cols, and 0 for rows ≤ r <
/// padded_rows (a multiple of 32), of bfloat16 values (raw bits): a query block's Q or dO as the
/// left operand Qᵀ or dOᵀ of the backward's products with bfloat16 pairs along the query rows.
void transpose_bf16(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t cols, int64_t padded_rows,
                    uint16_t* out, int64_t out_stride);
/// out[c · out_stride + r] = x[r · x_stride + c] for r < rows, c < cols (float32): dKᵀ and dVᵀ back
/// to rows of keys.
void transpose(const float* x, int64_t x_stride, int64_t rows, int64_t cols, float* out, int64_t out_stride);
/// The same of bfloat16 values (raw bits), each widened exactly to float32: a bfloat16 Kᵀ packed
/// for the float32 products of CPUs without bfloat16 instructions.
void transpose(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t cols, float* out, int64_t out_stride);
/// The same of float16 values, each widened exactly to float32 (F16C's vcvtph2ps where the
/// vectors are AVX2 or AVX-512): float16 blocks always multiply as float32.
void transpose(const c10::Half* x, int64_t x_stride, int64_t rows, int64_t cols, float* out, int64_t out_stride);

/// out[i] <- x[i] widened exactly to float32, for i < n: a float16 row of a block product's operand.
void widen(const c10::Half* x, int64_t n, float* out);

/// Σ a[i] · b[i] for i < n, in float32: 16 partial sums side by side (lane i mod 16, whichever
/// vectors the CPU has), then those added. The rows' D_i = rowsum(dO ⊙ O) of the backward.
float dot(const float* a, const float* b, int64_t n);
/// The same of bfloat16 values (raw bits), each widened exactly to float32.
float dot(const uint16_t* a, const uint16_t* b, int64_t n);
/// The same of float16 values.
float dot(const c10::Half* a, const c10::Half* b, int64_t n);

/// out[i] <- x[i] · factor: the float32 accumulators written out (the output, dQ, dK, dV).
void scale_into(const float* x, int64_t n, float factor, float* out);
/// The same rounded to bfloat16 (raw bits, nearest even, a NaN stays NaN; denormals kept): bit for
/// bit what converting each value to c10::BFloat16 gives.
void scale_into(const float* x, int64_t n, float factor, uint16_t* out);

/// The factors of scale_rows_into: one per row, or one for every row.
struct RowFactors {
  const float* each = nullptr;  // row r's factor is each[r]; null: `all` for every row
  float all = 1.0f;
  float of(int64_t row) const { return each != nullptr ? each[row] : all; }
};

/// scale_into for `rows` rows of n values, x's rows x_stride apart and out's out_stride apart, row
/// r times factors.of(r): a block's accumulators written out (the output, dQ, dK, dV) in one call
/// rather than one per row, whose dispatch cost as much as the arithmetic for rows of 32 values.
void scale_rows_into(const float* x, int64_t x_stride, int64_t rows, int64_t n, RowFactors factors, float* out,
                     int64_t out_stride);
/// The same rounded to bfloat16 (raw bits), each value as scale_into rounds it.
void scale_rows_into(const float* x, int64_t x_stride, int64_t rows, int64_t n, RowFactors factors, uint16_t* out,
                     int64_t out_stride);
/// The same rounded to float16 (nearest even; beyond its range ±inf, a NaN stays NaN, subnormals
/// kept): what converting each value to c10::Half gives, NaN payloads aside.
void scale_rows_into(const float* x, int64_t x_stride, int64_t rows, int64_t n, RowFactors factors, c10::Half* out,
                     int64_t out_stride);

/// out[r] <- dot(a + r · a_stride, b + r · b_stride, n) for r < rows, each summed exactly as dot()
/// sums it: the backward's D = rowsum(dO ⊙ O) of a head in one call.
void row_dots(const float* a, int64_t a_stride, const float* b, int64_t b_stride, int64_t rows, int64_t n,
              float* out);
void row_dots(const uint16_t* a, int64_t a_stride, const uint16_t* b, int64_t b_stride, int64_t rows, int64_t n,
              float* out);
void row_dots(const c10::Half* a, int64_t a_stride, const c10::Half* b, int64_t b_stride, int64_t rows, int64_t n,
              float* out);

/// out[r · out_stride + j] <- Σ_d x[r][d] · rows[j · row_stride + d] for r < x_count, j < count,
/// d < n, in float32 (values widened exactly): a few query rows' scores against a block of key rows
/// (the forward's rows by dot products, kernel.h). On AVX-512, 4 query rows at a time against 4
/// keys at a time (each key row read once for the 4), a single row against 16 keys at a time; on
/// AVX2, 4 rows against 2 keys (or 2 against 4), a single row against 8; the sums of a tile reduced
/// together. The portable path takes one query row at a time.
void dots_with_rows(const float* const* x, int64_t x_count, const float* rows, int64_t row_stride, int64_t count,
                    int64_t n, float* out, int64_t out_stride);
void dots_with_rows(const uint16_t* const* x, int64_t x_count, const uint16_t* rows, int64_t row_stride,
                    int64_t count, int64_t n, float* out, int64_t out_stride);
void dots_with_rows(const c10::Half* const* x, int64_t x_count, const c10::Half* rows, int64_t row_stride,
                    int64_t count, int64_t n, float* out, int64_t out_stride);

/// acc[r · acc_stride + d] += Σ_j weights[r · weight_stride + j] · x[j · x_stride + d] for
/// r < weight_rows, d < n, j < count, the rows of x widened exactly to float32: a few query rows'
/// weighted values without packing V (the forward's rows by dot products, kernel.h). Each acc
/// value sums its terms in the order of j. On AVX-512 and AVX2, 4 query rows at a time (each value
/// row read once for the 4).
void add_weighted_rows(const float* x, int64_t x_stride, int64_t count, int64_t n, const float* weights,
                       int64_t weight_stride, int64_t weight_rows, float* acc, int64_t acc_stride);
void add_weighted_rows(const uint16_t* x, int64_t x_stride, int64_t count, int64_t n, const float* weights,
                       int64_t weight_stride, int64_t weight_rows, float* acc, int64_t acc_stride);
void add_weighted_rows(const c10::Half* x, int64_t x_stride, int64_t count, int64_t n, const float* weights,
                       int64_t weight_stride, int64_t weight_rows, float* acc, int64_t acc_stride);

/// Values as the functions above take them: float32 and float16 as they are, bfloat16 as raw bits.
inline const float* vector_values(const float* x) { return x; }
inline const uint16_t* vector_values(const c10::BFloat16* x) { return reinterpret_cast<const uint16_t*>(x); }
inline const c10::Half* vector_values(const c10::Half* x) { return x; }

/// row_dots and scale_rows_into for the kernel's element types: float32, bfloat16 and float16
/// operands with float32 accumulators by the functions above, float64 by plain loops.
template <typename scalar_t, typename acc_t>
inline void dot_rows(const scalar_t* a, int64_t a_stride, const scalar_t* b, int64_t b_stride, int64_t rows, int64_t n,
                     acc_t* out) {
  if constexpr (std::is_same_v<acc_t, float>) {
    row_dots(vector_values(a), a_stride, vector_values(b), b_stride, rows, n, out);
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      acc_t sum = 0;
      for (int64_t i = 0; i < n; ++i) sum += static_cast<acc_t>(a[r * a_stride + i]) * static_cast<acc_t>(b[r * b_stride + i]);
      out[r] = sum;
    }
  }
}

/// `factors` one per row (null: `factor` for all; its type is not deduced, so that a literal nullptr
/// can stand for it).
template <typename scalar_t, typename acc_t>
inline void write_scaled_rows(const acc_t* x, int64_t x_stride, int64_t rows, int64_t n,
                              const std::common_type_t<acc_t>* factors, acc_t factor, scalar_t* out,
                              int64_t out_stride) {
  constexpr bool float_or_half = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::Half>;
  if constexpr (std::is_same_v<acc_t, float> && float_or_half) {
    scale_rows_into(x, x_stride, rows, n, RowFactors{factors, factor}, out, out_stride);
  } else if constexpr (std::is_same_v<acc_t, float> && std::is_same_v<scalar_t, c10::BFloat16>) {
    scale_rows_into(x, x_stride, rows, n, RowFactors{factors, factor}, reinterpret_cast<uint16_t*>(out), out_stride);
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      const acc_t row_factor = factors != nullptr ? factors[r] : factor;
      for (int64_t i = 0; i < n; ++i) out[r * out_stride + i] = static_cast<scalar_t>(x[r * x_stride + i] * row_factor);
    }
  }
}

/// keep[c] <- 1 when hash(row_key, first + c) >= threshold, else 0, for c < n: dropout's decision
/// for n consecutive columns of one row. The hash chains lowbias32 (Wellons' integer hash) over the
/// column number and the two halves of the row's 64-bit key: a pure function of its inputs.
void dropout_keep(uint64_t row_key, uint32_t first, int64_t n, uint32_t threshold, uint8_t* keep);

}  // namespace qkv::kernels
