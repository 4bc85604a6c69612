// GELU through float32 for bfloat16 on CPUs without AVX-512 (see activation.h).
#include "activation.h"

#include "kernels/linear/bfloat16_products.h"
#include "kernels/tiled/cpu_features.h"

#include <ATen/Functions.h>
#include <torch/autograd.h>

namespace qkv::detail {

namespace {

using kernels::linear::bfloat16_values;
using kernels::linear::round_to_bfloat16;

struct GeluThroughFloat32 : torch::autograd::Function<GeluThroughFloat32> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    // x in bfloat16, not its float32 copy: the activation's memory stays what bfloat16 promised
    // (widening it again in the backward takes about 0.2 ms for 2M values).
    ctx->save_for_backward({x});
    return round_to_bfloat16(at::gelu(bfloat16_values(x)));  // (…)
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto x = ctx->get_saved_variables()[0];
    if (torch::GradMode::is_enabled()) {  // create_graph: LibTorch's differentiable ops on x itself
      return {at::gelu_backward(grads[0].to(at::kFloat), x.to(at::kFloat)).to(at::kBFloat16)};
    }
    // The gradient of a bfloat16 output is bfloat16: widened exactly, as x.
    return {round_to_bfloat16(at::gelu_backward(bfloat16_values(grads[0].contiguous()), bfloat16_values(x)))};
  }
};

}  // namespace

bool gelu_through_float32() {
  return kernels::tiled::libtorch_bfloat16_on_own_loops();
}

at::Tensor gelu(const at::Tensor& x) {
  if (x.defined() && x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.layout() == at::kStrided &&
      x.is_contiguous() && gelu_through_float32()) {
    return GeluThroughFloat32::apply(x);
  }
  return at::gelu(x);
}

}  // namespace qkv::detail
