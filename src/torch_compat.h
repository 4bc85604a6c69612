// Every difference between the LibTorch versions qkv supports (Debian 12's 1.13 to the newest 2.x)
// that qkv's code meets, in one place. Code elsewhere asks these macros and helpers instead of
// comparing TORCH_VERSION itself. Private to qkv's build (library, apps, tests); not installed.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/InferenceMode.h>
#include <torch/version.h>

#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#define QKV_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// at::scaled_dot_product_attention (fused CPU and CUDA kernels) arrived in 2.0, its `scale`
// argument in 2.1 (2.0 always scales by 1/sqrt(D)), and `enable_gqa` (key/value heads shared by
// groups of query heads, without copying them) in 2.5.
#define QKV_TORCH_HAS_SDPA QKV_TORCH_AT_LEAST(2, 0)
#define QKV_TORCH_SDPA_HAS_SCALE QKV_TORCH_AT_LEAST(2, 1)
#define QKV_TORCH_SDPA_HAS_GQA QKV_TORCH_AT_LEAST(2, 5)

// c10d: in 1.13 a ProcessGroup (ProcessGroupGloo, ProcessGroupNCCL) implements the collectives; from
// 2.0 those classes are Backends behind a dispatching ProcessGroup. qkv drives them directly.
#define QKV_TORCH_C10D_BACKEND_CLASS QKV_TORCH_AT_LEAST(2, 0)

namespace qkv::compat {

// Autocast's state per device type: LibTorch 2.4 made it one set of functions taking the device
// type; 1.13 to 2.3 have one function per device (set_enabled for CUDA, set_cpu_enabled, ...).
#define QKV_TORCH_AUTOCAST_BY_DEVICE_TYPE QKV_TORCH_AT_LEAST(2, 4)

inline bool autocast_enabled(at::DeviceType type) {
#if QKV_TORCH_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::is_autocast_enabled(type);
#else
  return type == at::kCPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}

inline void set_autocast_enabled(at::DeviceType type, bool enabled) {
#if QKV_TORCH_AUTOCAST_BY_DEVICE_TYPE
  at::autocast::set_autocast_enabled(type, enabled);
#else
  if (type == at::kCPU) {
    at::autocast::set_cpu_enabled(enabled);
  } else {
    at::autocast::set_enabled(enabled);
  }
#endif
}

inline at::ScalarType autocast_dtype(at::DeviceType type) {
#if QKV_TORCH_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::get_autocast_dtype(type);
#else
  return type == at::kCPU ? at::autocast::get_autocast_cpu_dtype() : at::autocast::get_autocast_gpu_dtype();
#endif
}

inline void set_autocast_dtype(at::DeviceType type, at::ScalarType dtype) {
#if QKV_TORCH_AUTOCAST_BY_DEVICE_TYPE
  at::autocast::set_autocast_dtype(type, dtype);
#else
  if (type == at::kCPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
#endif
}

namespace detail {
template <typename Options>
auto disable_libuv(Options& options, int) -> decltype(options.useLibUV = false, void()) {
  options.useLibUV = false;
}
template <typename Options>
void disable_libuv(Options&, long) {}
}  // namespace detail

/// c10d's TCPStore gained a libuv server (`TCPStoreOptions::useLibUV`) in 2.x and made it the
/// default in 2.4, but LibTorch builds without libuv (Debian's among them) then fail at the
/// rendezvous with "use_libuv was requested but PyTorch was build without libuv support". qkv
/// asks for the classic server, which every version has; a no-op where the field does not exist.
template <typename TCPStoreOptions>
void use_classic_tcp_store(TCPStoreOptions& options) {
  detail::disable_libuv(options, 0);
}

/// The entry of `parameter` in an optimizer's state (Optimizer::state()), or its end: the state is
/// keyed by the parameter's TensorImpl, as the address in text on LibTorch 1.x ("0x55d0c4a0b2f0",
/// c10::guts::to_string's) and as the pointer itself on 2.x.
template <typename State, typename Tensor>
auto find_optimizer_state(State& state, const Tensor& parameter) {
  using Key = typename std::decay_t<State>::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream address;
    address << static_cast<void*>(parameter.unsafeGetTensorImpl());
    return state.find(address.str());
  } else {
    return state.find(parameter.unsafeGetTensorImpl());
  }
}

/// Function::apply(args...) of a custom autograd function (torch::autograd::Function). LibTorch
/// 2.x's apply records which arguments are tensors in a std::vector<bool>, whose reserve GCC 14
/// (Debian 13) reports, wrongly, as writing out of bounds (-Warray-bounds, "forming offset 8 is out
/// of the bounds [0, 8]", and -Wstringop-overflow; a false positive other projects met too) at
/// qkv's calls; silenced here, for the inlined apply only, instead of at each caller.
/// GCC 14 keeps some of those applies out of line (rope.cpp, activation.cpp), where the pragma
/// does not reach them; flatten has it inline them here. Other compilers do not warn and keep
/// their own inlining choice.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
template <typename Function, typename... Args>
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 14
__attribute__((flatten))
#endif
decltype(auto) apply_autograd_function(Args&&... args) {
  return Function::apply(std::forward<Args>(args)...);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/// c10::InferenceMode as a guard. GCC 16 (Debian unstable) reads LibTorch 2.14's InferenceMode,
/// whose saved state holds a std::optional, as used uninitialized where the guard's destructor is
/// inlined (std::optional's long-known false -Wmaybe-uninitialized, GCC bug 80635); silenced here,
/// for the guard alone, instead of around every function that takes one.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
class InferenceModeGuard {
 public:
  InferenceModeGuard() = default;
  InferenceModeGuard(const InferenceModeGuard&) = delete;
  InferenceModeGuard& operator=(const InferenceModeGuard&) = delete;

 private:
  c10::InferenceMode mode_;
};
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace qkv::compat
