// Row operations of the tiled kernel, vectorised: the compiler emits AVX-512 and AVX2/FMA code
// beside the baseline and the CPU picks one at load time (GCC's target_clones). Private to qkv.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

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

/// Σ a[i] · b[i] for i < n, in float32: 16 partial sums side by side (lane i mod 16, whichever
/// vectors the CPU has), then those added. The rows' D_i = rowsum(dO ⊙ O) of the backward.
float dot(const float* a, const float* b, int64_t n);
/// The same of bfloat16 values (raw bits), each widened exactly to float32.
float dot(const uint16_t* a, const uint16_t* b, int64_t n);

/// out[i] <- x[i] · factor: the float32 accumulators written out (the output, dQ, dK, dV).
void scale_into(const float* x, int64_t n, float factor, float* out);
/// The same rounded to bfloat16 (raw bits, nearest even, a NaN stays NaN; denormals kept): bit for
/// bit what converting each value to c10::BFloat16 gives.
void scale_into(const float* x, int64_t n, float factor, uint16_t* out);

/// dot and scale_into for the kernel's element types: float32 and bfloat16 operands with float32
/// accumulators by the functions above, float64 by plain loops.
template <typename scalar_t, typename acc_t>
inline acc_t dot_of(const scalar_t* a, const scalar_t* b, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return dot(a, b, n);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return dot(reinterpret_cast<const uint16_t*>(a), reinterpret_cast<const uint16_t*>(b), n);
  } else {
    acc_t sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += static_cast<acc_t>(a[i]) * static_cast<acc_t>(b[i]);
    return sum;
  }
}

template <typename scalar_t, typename acc_t>
inline void write_scaled(const acc_t* x, int64_t n, acc_t factor, scalar_t* out) {
  if constexpr (std::is_same_v<acc_t, float> && std::is_same_v<scalar_t, float>) {
    scale_into(x, n, factor, out);
  } else if constexpr (std::is_same_v<acc_t, float> && std::is_same_v<scalar_t, c10::BFloat16>) {
    scale_into(x, n, factor, reinterpret_cast<uint16_t*>(out));
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<scalar_t>(x[i] * factor);
  }
}

/// keep[c] <- 1 when hash(row_key, first + c) >= threshold, else 0, for c < n: dropout's decision
/// for n consecutive columns of one row. The hash chains lowbias32 (Wellons' integer hash) over the
/// column number and the two halves of the row's 64-bit key: a pure function of its inputs.
void dropout_keep(uint64_t row_key, uint32_t first, int64_t n, uint32_t threshold, uint8_t* keep);

}  // namespace qkv::kernels
