// Finding the oneDNN that LibTorch loaded (see onednn_gemm.h).
#include "kernels/linear/onednn_gemm.h"

#include <c10/util/Exception.h>

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <cstring>

namespace qkv::kernels::linear {

namespace {

// oneDNN's C API (dnnl.h, the same from 1.x to 3.x): dnnl_dim_t is int64_t, dnnl_status_t an enum
// whose dnnl_success is 0; dnnl_version() returns a pointer to this struct.
struct DnnlVersion {
  int major, minor, patch;
  const char* hash;
};

// The path of a loaded library whose file name starts with "libdnnl.so", if any.
std::string loaded_onednn_path() {
  std::string found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        const char* name = info->dlpi_name ? info->dlpi_name : "";
        const char* slash = std::strrchr(name, '/');
        const char* file = slash ? slash + 1 : name;
        if (std::strncmp(file, "libdnnl.so", 10) != 0) return 0;
        *static_cast<std::string*>(out) = name;
        return 1;
      },
      &found);
  return found;
}

LinearGemmChoice read_linear_gemm_choice() {
  const char* value = std::getenv("QKV_LINEAR_GEMM");
  const std::string choice = value ? value : "";
  if (choice.empty()) return LinearGemmChoice::Fastest;
  if (choice == "libtorch") return LinearGemmChoice::LibTorch;
  TORCH_CHECK(choice == "no-onednn", "qkv: QKV_LINEAR_GEMM: expected libtorch or no-onednn (or unset), got '", choice,
              "'");
  return LinearGemmChoice::WithoutOneDnn;
}

}  // namespace

LinearGemmChoice linear_gemm_choice() {
  static const LinearGemmChoice chosen = read_linear_gemm_choice();  // a throw leaves it unset: read again
  return chosen;
}

bool onednn_float32_gemm_is_signal_safe(int major, int minor, int patch) {
  if (major != 3) return major > 3;
  return minor > 11 || (minor == 11 && patch >= 2);
}

OneDnnGemm::OneDnnGemm() {
  switch (linear_gemm_choice()) {
    case LinearGemmChoice::LibTorch:
      float32_unavailable_because_ = "QKV_LINEAR_GEMM=libtorch";
      return;
    case LinearGemmChoice::WithoutOneDnn:
      float32_unavailable_because_ = "QKV_LINEAR_GEMM=no-onednn: oneDNN not looked up";
      return;
    case LinearGemmChoice::Fastest: break;
  }
  // The process's global scope first (LibTorch linked as a program's dependency), then a oneDNN
  // loaded privately (LibTorch opened with RTLD_LOCAL): RTLD_NOLOAD never loads a second one.
  void* symbol = dlsym(RTLD_DEFAULT, "dnnl_sgemm");
  void* version_symbol = dlsym(RTLD_DEFAULT, "dnnl_version");
  void* bf16_symbol = dlsym(RTLD_DEFAULT, "dnnl_gemm_bf16bf16f32");
  if (!symbol) {
    const auto path = loaded_onednn_path();
    if (void* handle = path.empty() ? nullptr : dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD)) {
      symbol = dlsym(handle, "dnnl_sgemm");
      version_symbol = dlsym(handle, "dnnl_version");
      bf16_symbol = dlsym(handle, "dnnl_gemm_bf16bf16f32");
      // The handle stays open: the library is LibTorch's and lives as long as the process.
    }
  }
  if (!symbol) {
    float32_unavailable_because_ = "no oneDNN with dnnl_sgemm loaded";
    return;
  }
  const DnnlVersion* version =
      version_symbol ? reinterpret_cast<const DnnlVersion* (*)()>(version_symbol)() : nullptr;
  name_ = "oneDNN";
  if (version) {
    name_ += " " + std::to_string(version->major) + "." + std::to_string(version->minor) + "." +
             std::to_string(version->patch);
  }
  // A oneDNN that does not say its version is taken for one without the fix.
  if (version && onednn_float32_gemm_is_signal_safe(version->major, version->minor, version->patch)) {
    sgemm_ = reinterpret_cast<Sgemm>(symbol);
  } else {
    float32_unavailable_because_ = name_ +
                                   "'s float32 GEMM left out: a signal handled during one of its products "
                                   "corrupts the heap (oneDNN issue #4845, fixed in 3.11.2)";
  }
  if (bf16_symbol) {
    // 1.5 · 2 + 1 = 4, every value exact in bfloat16: a oneDNN that refuses (no AVX-512) or
    // computes something else is not used.
    const auto bf16 = reinterpret_cast<Bf16Gemm>(bf16_symbol);
    const uint16_t a = 0x3FC0, b = 0x4000;  // 1.5, 2.0
    float c = 1.0f;
    if (bf16('N', 'N', 1, 1, 1, 1.0f, &a, 1, &b, 1, 1.0f, &c, 1) == 0 && c == 4.0f) bf16_gemm_ = bf16;
  }
}

const OneDnnGemm& OneDnnGemm::instance() {
  static const OneDnnGemm found;
  return found;
}

void OneDnnGemm::multiply(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a,
                           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) const {
  TORCH_CHECK(sgemm_ && m > 0 && n > 0 && k > 0, "qkv: OneDnnGemm::multiply needs oneDNN's float32 GEMM (",
              float32_unavailable_because_, ") and m, n, k > 0, got ", m, ", ", n, ", ", k);
  const int status =
      sgemm_(transpose_a ? 'T' : 'N', transpose_b ? 'T' : 'N', m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
  TORCH_CHECK(status == 0, "qkv: oneDNN's dnnl_sgemm refused a ", m, "x", k, " by ", k, "x", n,
              " product (transa ", transpose_a, ", transb ", transpose_b, ", lda ", lda, ", ldb ", ldb, ", ldc ", ldc,
              "): status ", status);
}

void OneDnnGemm::multiply_bf16(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k,
                               const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
                               int64_t ldc) const {
  TORCH_CHECK(bf16_gemm_ && m > 0 && n > 0 && k > 0, "qkv: OneDnnGemm::multiply_bf16 needs oneDNN's bfloat16 GEMM (",
              name_.empty() ? "no oneDNN" : name_, ") and m, n, k > 0, got ", m, ", ", n, ", ", k);
  const int status =
      bf16_gemm_(transpose_a ? 'T' : 'N', transpose_b ? 'T' : 'N', m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
  TORCH_CHECK(status == 0, "qkv: oneDNN's dnnl_gemm_bf16bf16f32 refused a ", m, "x", k, " by ", k, "x", n,
              " product (transa ", transpose_a, ", transb ", transpose_b, ", lda ", lda, ", ldb ", ldb, ", ldc ", ldc,
              "): status ", status);
}

}  // namespace qkv::kernels::linear
