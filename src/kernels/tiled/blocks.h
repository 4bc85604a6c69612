// Block products of the tiled kernel and what they need around them. Private to qkv.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace qkv::kernels::tiled {

/// C = alpha · op(A) · op(B) + beta · C for row-major blocks (op = transpose or not), through the
/// CBLAS found at build time (OpenBLAS's sgemm / dgemm), else plain loops. Leading dimensions must
/// be at least the row widths: operands.cpp guarantees it for every tensor the kernel reads.
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

/// Whether gemm goes through a CBLAS (else plain loops).
bool gemm_uses_blas();

/// For the lifetime of the guard the calling thread asks OpenMP for one thread, then restores the
/// previous setting. Each task of at::parallel_for calls BLAS on its own small blocks; OpenBLAS's
/// OpenMP build would open a parallel region of its own inside every task (libgomp nests by
/// default), so that 2 workers on 2 cores ran 2 × 2 threads and were slower than 1.
class SingleThreadedBlas {
 public:
  SingleThreadedBlas();
  ~SingleThreadedBlas();
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int saved_ = 1;
};

/// `rows` rows of `width` elements, `stride` apart, in the accumulation type: a pointer into the
/// tensor when it already is that type (ld = stride), else converted into `scratch` (bfloat16 ->
/// float32, ld = width).
template <typename scalar_t, typename acc_t>
const acc_t* rows_as(const scalar_t* source, int64_t stride, int64_t rows, int64_t width, std::vector<acc_t>& scratch,
                     int64_t& ld) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    ld = stride;
    return source;
  } else {
    scratch.resize(static_cast<size_t>(rows * width));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < width; ++c) scratch[r * width + c] = static_cast<acc_t>(source[r * stride + c]);
    }
    ld = width;
    return scratch.data();
  }
}

}  // namespace qkv::kernels::tiled
