// oneDNN's GEMMs (float32, and bfloat16 inputs accumulated into float32), taken from the oneDNN
// that LibTorch itself loaded. Private to qkv.
//
// Debian's LibTorch links oneDNN (libdnnl) but multiplies float32 matrices with OpenBLAS; on the
// small-K products of a transformer's linear layers Debian 12's OpenBLAS 0.3.21 reaches about 60%
// of the CPU's peak where oneDNN's JIT GEMM reaches about 90% (docs/PERFORMANCE.md). qkv does not
// link a oneDNN of its own: Debian 13's and unstable's libdnnl-dev are newer than the oneDNN their
// LibTorch links (3.7 and 3.12 against 3.6), and two oneDNNs in one process share their exported
// names. It looks up `dnnl_sgemm` among the libraries already loaded instead; where there is none
// (a LibTorch with oneDNN linked in statically and hidden, as the official downloads have it, or
// built without it) float32 linear layers run on qkv's own micro-kernels, or LibTorch's products
// where those are plain C++ (linear.h).
//
// oneDNN's float32 GEMM is taken only from a oneDNN whose JIT kernels keep the stack pointer
// (3.11.2, 3.12 and later): before, its AVX2 and AVX-512 kernels pointed rsp into a heap workspace
// while they ran, so a signal handled during a product wrote its frame into the heap (oneDNN issue
// #4845, fixed by 6191181). Debian 12's 2.6.3 and Debian 13's 3.7.2 are such: a Ctrl-C or SIGTERM
// to qkv-train (whose handlers save a checkpoint), or a profiler's SIGPROF, corrupted the heap
// (glibc: "corrupted size vs. prev_size"; reproduced on AMD EPYC Zen 5 with dnnl_sgemm alone,
// 48 × 512 by 512 × 48, and in qkv-train's distributed test). There the float32 linear layers run on
// qkv's own micro-kernels (linear.h). The bfloat16 GEMM has no such code (the fix touched the
// float32 kernels only; 2.6.3's passed the same signal storm at the lm's shapes) and stays.
//
// `dnnl_gemm_bf16bf16f32`, with the signature of dnnl_sgemm but bfloat16 A and B (oneDNN's own
// tests declare it; dnnl.h does not), is exported by the oneDNNs of Debian 12, 13 and unstable
// (2.6.3, 3.7, 3.12). It is taken
// only where a 1 × 1 × 1 product through it gives the right value (a oneDNN for a CPU without
// AVX-512 refuses it).
#pragma once

#include <cstdint>
#include <string>

namespace qkv::kernels::linear {

/// What the environment variable QKV_LINEAR_GEMM asks of the linear layers' products, read once:
enum class LinearGemmChoice {
  /// unset or empty: the fastest route qkv has (linear.h), oneDNN's GEMMs where LibTorch loaded them;
  Fastest,
  /// "libtorch": LibTorch's own products for every linear layer (to compare against);
  LibTorch,
  /// "no-onednn": oneDNN not looked up, as where LibTorch's is hidden (float32 on LibTorch's
  /// products; bfloat16 autocast on qkv's own micro-kernels where the CPU has no bfloat16
  /// instructions): to test that case on a LibTorch whose oneDNN qkv would find.
  WithoutOneDnn,
};
/// Throws c10::Error naming the accepted values for any other value (at every call: nothing is
/// multiplied on a route the variable did not ask for).
LinearGemmChoice linear_gemm_choice();

/// Whether oneDNN major.minor.patch's float32 GEMM keeps the stack pointer while it runs (see the
/// top of this file): 3.11.2 and later on the 3.11 branch, 3.12.0 and later.
bool onednn_float32_gemm_is_signal_safe(int major, int minor, int patch);

/// The loaded oneDNN's GEMMs, or none.
class OneDnnGemm {
 public:
  /// The process's oneDNN, looked up once (thread-safe); unavailable when linear_gemm_choice() is
  /// not Fastest.
  static const OneDnnGemm& instance();

  /// Whether the float32 GEMM is there and safe to call (a oneDNN with the signal fix).
  bool available() const { return sgemm_ != nullptr; }
  /// Whether the bfloat16 GEMM is there, and works on this CPU.
  bool bfloat16_available() const { return bf16_gemm_ != nullptr; }
  /// "oneDNN 2.6.3" (the loaded oneDNN, or "oneDNN" where it has no dnnl_version), or "" where none
  /// was found or looked up.
  const std::string& name() const { return name_; }
  /// Where the float32 GEMM is unavailable, why: "QKV_LINEAR_GEMM=libtorch", "no oneDNN with
  /// dnnl_sgemm loaded", or that the loaded one's float32 GEMM is not signal-safe; "" where available.
  const std::string& float32_unavailable_because() const { return float32_unavailable_because_; }

  /// C (m × n, row-major, row stride ldc) = A · B + beta · C, where A is m × k and B is k × n, each
  /// row-major with the given row stride, or transposed ('T': the matrix stored is its transpose,
  /// k × m or n × k). Requires available() and m, n, k > 0; throws c10::Error naming the status if
  /// oneDNN refuses.
  void multiply(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                const float* b, int64_t ldb, float beta, float* c, int64_t ldc) const;

  /// The same product with A and B in bfloat16 (the raw bits, as c10::BFloat16 stores them),
  /// accumulated and written in float32. Requires bfloat16_available().
  void multiply_bf16(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const uint16_t* a,
                     int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) const;

 private:
  OneDnnGemm();
  using Sgemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                        float, float*, int64_t);
  using Bf16Gemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const uint16_t*, int64_t, const uint16_t*,
                           int64_t, float, float*, int64_t);
  Sgemm sgemm_ = nullptr;
  Bf16Gemm bf16_gemm_ = nullptr;
  std::string name_, float32_unavailable_because_;
};

}  // namespace qkv::kernels::linear
