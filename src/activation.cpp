// GELU through float32 for bfloat16 on CPUs without AVX-512 (see activation.h).
#include "activation.h"

#include "kernels/linear/products.h"
#include "kernels/tiled/cpu_features.h"
#include "torch_compat.h"

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>

#include <algorithm>
#include <vector>

// at::parallel_for is an inline `#pragma omp parallel` in an OpenMP build of LibTorch (see
// src/CMakeLists.txt, which gives this file -fopenmp).
#if AT_PARALLEL_OPENMP && defined(QKV_OPENMP_FOUND) && !defined(_OPENMP)
#error "activation.cpp calls at::parallel_for: compile it with OpenMP (src/CMakeLists.txt)"
#endif

namespace qkv::detail {

namespace {

using kernels::linear::round_values;
using kernels::linear::widen_values;

// Values per chunk: widened into float32 scratch, through LibTorch's float32 GELU (or its
// backward), and rounded into the output. Each chunk costs a dispatch of LibTorch's GELU (about
// 8 µs with oneDNN's primitive lookup), so chunks are large: the lm's 4096 × 512 GELU forward and
// backward took 4.2, 2.5, 2.2 and 2.1 ms in chunks of 8Ki, 32Ki, 128Ki and 256Ki values (against
// 2.2 for 1Mi, and 1.6 for the same GELU in float32 through autograd; AVX2 emulated on AMD EPYC
// Zen 5, 2 threads, 2026-12-03). Whole tensors widened, GELU'd and rounded in passes of their own
// took 2.9 ms. A GELU of qkv's own in AVX2 registers (erf by Abramowitz & Stegun, as LibTorch's)
// was no faster: 2.0 ms forward on one thread against oneDNN's 1.3 in float32.
constexpr int64_t kChunk = 1 << 17;

const uint16_t* bits_of(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

// A bfloat16 tensor shaped as `first` whose values are f(first, second) computed in float32 (1.5 MiB
// of scratch per thread, kept):
// `apply(out, first, second)` on float32 views of a chunk of each (second undefined when not given).
template <typename Apply>
at::Tensor through_float32(const at::Tensor& first, const at::Tensor& second, Apply apply) {
  auto out = at::empty_like(first, at::MemoryFormat::Contiguous);
  const int64_t count = first.numel();
  const uint16_t* first_bits = bits_of(first);
  const uint16_t* second_bits = second.defined() ? bits_of(second) : nullptr;
  auto* out_bits = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, (count + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;
    scratch.resize(3 * kChunk);
    const auto view = [&](int64_t slot, int64_t length) {
      return at::from_blob(scratch.data() + slot * kChunk, {length}, at::TensorOptions().dtype(at::kFloat));
    };
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t offset = chunk * kChunk, length = std::min(kChunk, count - offset);
      widen_values(first_bits + offset, scratch.data(), length);
      if (second_bits) widen_values(second_bits + offset, scratch.data() + kChunk, length);
      auto result = view(2, length);
      apply(result, view(0, length), second_bits ? view(1, length) : at::Tensor());
      round_values(scratch.data() + 2 * kChunk, out_bits + offset, length);
    }
  });
  return out;
}

struct GeluThroughFloat32 : torch::autograd::Function<GeluThroughFloat32> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    // x in bfloat16, not its float32 copy: the activation's memory stays what bfloat16 promised.
    ctx->save_for_backward({x});
    return through_float32(x, at::Tensor(), [](at::Tensor& out, const at::Tensor& values, const at::Tensor&) {
      at::gelu_out(out, values);
    });
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto x = ctx->get_saved_variables()[0];
    if (at::GradMode::is_enabled()) {  // create_graph: LibTorch's differentiable ops on x itself
      return {at::gelu_backward(grads[0].to(at::kFloat), x.to(at::kFloat)).to(at::kBFloat16)};
    }
    // The gradient of a bfloat16 output is bfloat16: widened exactly, as x.
    return {through_float32(grads[0].contiguous(), x,
                            [](at::Tensor& out, const at::Tensor& grad, const at::Tensor& values) {
                              at::gelu_backward_out(out, grad, values);
                            })};
  }
};

}  // namespace

bool gelu_through_float32() {
  return kernels::tiled::libtorch_bfloat16_on_own_loops();
}

at::Tensor gelu(const at::Tensor& x) {
  if (x.defined() && x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.layout() == at::kStrided &&
      x.is_contiguous() && gelu_through_float32()) {
    return compat::apply_autograd_function<GeluThroughFloat32>(x);
  }
  return at::gelu(x);
}

}  // namespace qkv::detail
