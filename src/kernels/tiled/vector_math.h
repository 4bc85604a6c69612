// Row operations of the tiled kernel, vectorised: the compiler emits AVX-512 and AVX2/FMA code
// beside the baseline and the CPU picks one at load time (GCC's target_clones). Private to qkv.
#pragma once

#include <cstdint>

namespace qkv::kernels {

/// x[i] <- exp(factor · x[i] - shift) for i < n (factor > 0), and returns their sum. Entries
/// where factor · x[i] - shift is below -87 (masked ones are -inf) become exactly 0; a NaN stays
/// NaN. float: a Cephes-style polynomial, relative error below 1e-7 (factor · x[i] - shift formed
/// by one fused multiply-add); double: std::exp. The factor is the softmax scale when the scores
/// come unscaled from their product (kernel.h, Problem::deferred_scale).
float exp_shifted_sum(float* x, int64_t n, float factor, float shift);
double exp_shifted_sum(double* x, int64_t n, double factor, double shift);
inline float exp_shifted_sum(float* x, int64_t n, float shift) { return exp_shifted_sum(x, n, 1.0f, shift); }

/// As exp_shifted_sum, but the exponentials go to `out` as bfloat16 (raw bits, rounded to nearest
/// even), for the bfloat16 block products that multiply them next, and x is left as it was; the
/// sum is of the float32 values. One pass where rounding the float32 results afterwards took two.
float exp_shifted_sum_to_bf16(const float* x, int64_t n, float factor, float shift, uint16_t* out);
inline double exp_shifted_sum(double* x, int64_t n, double shift) { return exp_shifted_sum(x, n, 1.0, shift); }

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

/// ds[i] <- p[i] * (ds[i] - delta): softmax's backward for one row.
void softmax_backward(const float* p, float* ds, int64_t n, float delta);
void softmax_backward(const double* p, double* ds, int64_t n, double delta);
/// The same, and ds also to `out` as bfloat16 (raw bits, nearest even) for the bfloat16 product
/// that multiplies it next.
void softmax_backward_to_bf16(const float* p, float* ds, int64_t n, float delta, uint16_t* out);

/// keep[c] <- 1 when hash(row_key, first + c) >= threshold, else 0, for c < n: dropout's decision
/// for n consecutive columns of one row. The hash chains lowbias32 (Wellons' integer hash) over the
/// column number and the two halves of the row's 64-bit key: a pure function of its inputs.
void dropout_keep(uint64_t row_key, uint32_t first, int64_t n, uint32_t threshold, uint8_t* keep);

}  // namespace qkv::kernels
