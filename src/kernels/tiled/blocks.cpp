#include "kernels/tiled/blocks.h"

#include <cstdlib>

#if defined(QKV_HAVE_CBLAS)
#include <cblas.h>
#endif
#if defined(QKV_HAVE_OPENMP)
#include <omp.h>
#endif

namespace qkv::kernels::tiled {
namespace {

#if !defined(QKV_HAVE_CBLAS)
// Without a CBLAS at build time: plain loops (correct, slow; Auto then prefers other backends).
template <typename T>
void loop_gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
               const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      T sum = 0;
      for (int64_t p = 0; p < k; ++p) {
        const T x = transpose_a ? a[p * lda + i] : a[i * lda + p];
        const T y = transpose_b ? b[j * ldb + p] : b[p * ldb + j];
        sum += x * y;
      }
      c[i * ldc + j] = alpha * sum + (beta == T(0) ? T(0) : beta * c[i * ldc + j]);
    }
  }
}
#endif

}  // namespace

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
#if defined(QKV_HAVE_CBLAS)
  cblas_sgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans, transpose_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
              static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
#else
  loop_gemm(transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#endif
}

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
#if defined(QKV_HAVE_CBLAS)
  cblas_dgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans, transpose_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
              static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
#else
  loop_gemm(transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#endif
}

bool gemm_uses_blas() {
#if defined(QKV_HAVE_CBLAS)
  return true;
#else
  return false;
#endif
}

std::string blas_core() {
#if defined(QKV_HAVE_CBLAS) && defined(OPENBLAS_VERSION)
  const char* name = openblas_get_corename();
  return name != nullptr ? name : "";
#else
  return "";
#endif
}

std::string blas_core_advice() {
  const std::string core = blas_core();
  // The CPU as qkv sees it: one that QKV_TILED_ISA makes look like an AVX2 CPU (to measure such
  // CPUs, scripts/bench_env.sh's emulate_cpu) fits OpenBLAS's AVX2 kernels.
  const ProductIsa isa = usable_isa();
  const std::string flags = cpu_flags();
  const bool avx512_kernels_run = at_least(isa, ProductIsa::Avx512) && flags.find("avx512dq") != std::string::npos;
  const char* avx512_core = at_least(isa, ProductIsa::Avx512Bf16) ? "COOPERLAKE" : "SKYLAKEX";
  // OpenBLAS's fallbacks for a CPU it does not know: its oldest x86-64 cores, SSE3 at most.
  const bool generic = core == "Prescott" || core == "Core2" || core == "Penryn" || core == "Dunnington" ||
                       core == "Nehalem" || core == "Atom" || core == "Barcelona" || core == "Opteron";
  // Its AVX2 cores on a CPU with AVX-512 (F, BW, VL and DQ, which its SkylakeX kernels use).
  const bool avx2_core = core == "Haswell" || core == "Zen" || core == "SandyBridge";
  const bool below_generic = generic && at_least(isa, ProductIsa::Avx2);
  const bool below_avx512 = avx2_core && avx512_kernels_run;
  if (!below_generic && !below_avx512) return "";
  const char* suggested = avx512_kernels_run ? avx512_core : "HASWELL";
  // A core type the environment forces: the machines qkv is developed on have had
  // OPENBLAS_CORETYPE=Haswell set for every process on an AMD EPYC of family 26 (Zen 5), where
  // OpenBLAS by itself picks its Cooper Lake kernels, which multiply 2048² float32 matrices at
  // 1.8× the rate (347 against 190 GFLOP/s, 2 threads, 2026-12-02, docs/PERFORMANCE.md).
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  const bool forced = coretype != nullptr && *coretype != '\0';
  const std::string cause =
      forced ? "OPENBLAS_CORETYPE=" + std::string(coretype) + " in the environment makes OpenBLAS run"
             : "OpenBLAS runs";
  const std::string kernels = below_generic ? "its generic '" + core + "' kernels" : "its AVX2 '" + core + "' kernels";
  const std::string why = below_generic ? (forced ? "" : ", which it does not recognise") : ", which has AVX-512";
  const std::string effect = below_generic
                                 ? "LibTorch's float32 matrix products are several times slower than they could be"
                                 : "LibTorch's float32 matrix products may be faster with its AVX-512 kernels "
                                   "(1.8x on an AMD Zen 5)";
  return cause + " " + kernels + " on this CPU (" + flags + ")" + why + ": " + effect +
         "; run with OPENBLAS_CORETYPE=" + suggested;
}

SingleThreadedBlas::SingleThreadedBlas() {
#if defined(QKV_HAVE_OPENMP)
  saved_ = omp_get_max_threads();
  omp_set_num_threads(1);
#endif
}

SingleThreadedBlas::~SingleThreadedBlas() {
#if defined(QKV_HAVE_OPENMP)
  omp_set_num_threads(saved_);
#endif
}

}  // namespace qkv::kernels::tiled
