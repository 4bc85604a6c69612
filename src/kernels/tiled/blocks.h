// Block products of the tiled kernel and what they need around them. Private to qkv.
#pragma once

#include "kernels/tiled/cpu_features.h"
#include "kernels/tiled/packed_products.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

namespace qkv::kernels::tiled {

/// C = alpha · op(A) · op(B) + beta · C for row-major blocks (op = transpose or not), through the
/// CBLAS found at build time (OpenBLAS's sgemm / dgemm), else plain loops. Leading dimensions must
/// be at least the row widths: operands.cpp guarantees it for every tensor the kernel reads. The
/// kernel multiplies float64 blocks with it; the float32 one is the reference the packed
/// micro-kernels are tested against (tests/test_packed_products.cpp).
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

/// Whether gemm goes through a CBLAS (else plain loops).
bool gemm_uses_blas();

/// The CPU OpenBLAS chose its kernels for (openblas_get_corename: "SkylakeX", "Cooperlake",
/// "Zen", ...), "" without OpenBLAS. LibTorch's float32 products on Debian run on the same choice.
std::string blas_core();

/// "" unless OpenBLAS fell back to its generic kernels on a CPU with AVX2 or more (Debian 12's
/// OpenBLAS 0.3.21 takes an Intel Xeon of the Emerald Rapids generation for a "Prescott": float32
/// products at 29 instead of 150-220 GFLOP/s, measured on 2 cores here); then what to do about it
/// (OPENBLAS_CORETYPE, read when OpenBLAS loads, before any of qkv's code runs).
std::string blas_core_advice();

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

/// How float32 and bfloat16 blocks multiply on this CPU: the active instruction set's float32
/// micro-kernel, or for bfloat16 inputs its bfloat16 products where the CPU has them (AMX tiles,
/// else AVX512_BF16).
template <typename scalar_t>
ProductKind product_kind() {
  const ProductIsa isa = active_isa();
  return {isa, std::is_same_v<scalar_t, c10::BFloat16> && at_least(isa, ProductIsa::Avx512Bf16)};
}

/// The right operand B (k × n) of the kernel's block products C = alpha · A · B + beta · C, prepared
/// once and multiplied by many A: packed panels for float32 and bfloat16 (packed_products.h);
/// float64, the precision the tests compare against, keeps OpenBLAS's dgemm and a plain view.
template <typename scalar_t>
class RightOperand {
 public:
  /// Packs b; with `borrow`, float32 rows are read where they lie where they can be
  /// (PackedRight::borrow).
  void prepare(Strided<scalar_t> b, int64_t k, int64_t n, bool borrow = false) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (borrow) return packed_.borrow(b, k, n, product_kind<scalar_t>());
    }
    packed_.pack(b, k, n, product_kind<scalar_t>());
  }
  template <typename a_t>
  void multiply_into(Strided<a_t> a, int64_t m, float alpha, float beta, float* c, int64_t ldc,
                     Leading part = {}) const {
    multiply(a, m, packed_, alpha, beta, c, ldc, part);
  }

 private:
  PackedRight packed_;
};

template <>
class RightOperand<double> {
 public:
  // Read where it lies always (BLAS packs it), so `borrow` changes nothing.
  void prepare(Strided<double> b, int64_t k, int64_t n, bool /*borrow*/ = false) { b_ = b, k_ = k, n_ = n; }
  void multiply_into(Strided<double> a, int64_t m, double alpha, double beta, double* c, int64_t ldc,
                     Leading part = {}) const {
    const int64_t k = part.k < 0 ? k_ : part.k, n = part.n < 0 ? n_ : part.n;
    TORCH_CHECK(k <= k_ && n <= n_, "tiled kernel: a product of B's leading ", k, " x ", n, " of a ", k_, " x ", n_);
    if (m == 0 || n == 0) return;
    const auto [a_transposed, lda] = blas_layout(a, m, k);
    const auto [b_transposed, ldb] = blas_layout(b_, k, n);
    gemm(a_transposed, b_transposed, m, n, k, alpha, a.data, lda, b_.data, ldb, beta, c, ldc);
  }

 private:
  // Row-major BLAS takes an operand as rows (unit column stride, rows at least `cols` apart) or
  // as the transpose of such; a single row or column fits either, with its extent as the leading
  // dimension (BLAS checks it even when it never steps along it).
  static std::pair<bool, int64_t> blas_layout(Strided<double> x, int64_t rows, int64_t cols) {
    if (x.col_stride == 1 && (rows == 1 || x.row_stride >= cols)) {
      return {false, std::max<int64_t>({x.row_stride, cols, 1})};
    }
    return {true, std::max<int64_t>({x.col_stride, rows, 1})};
  }

  Strided<double> b_;
  int64_t k_ = 0, n_ = 0;
};

}  // namespace qkv::kernels::tiled
