// Linear layers on oneDNN's GEMM where the process has it (see linear.h).
//
// M = rows of the input (all leading dimensions), K = in features, N = out features.
#include "linear.h"

#include "kernels/linear/onednn_sgemm.h"
#include "torch_compat.h"

#include <ATen/Functions.h>
#include <torch/autograd.h>

namespace qkv::detail {

namespace {

using kernels::linear::OneDnnSgemm;

// A weight (N × K) as oneDNN reads it: its rows (transposed, Wᵀ's columns) or its columns.
struct WeightOperand {
  at::Tensor tensor;  // the weight itself, or a contiguous copy when its strides fit neither
  bool rows = true;   // stored as N rows of K (row stride ld) or as a K × N row-major matrix
  int64_t ld = 0;
};

WeightOperand weight_operand(const at::Tensor& weight) {
  const int64_t N = weight.size(0), K = weight.size(1);
  if (weight.stride(1) == 1 && weight.stride(0) >= K) return {weight, true, weight.stride(0)};
  if (weight.stride(0) == 1 && weight.stride(1) >= N) return {weight, false, weight.stride(1)};
  return {weight.contiguous(), true, K};
}

// y = x Wᵀ + b on oneDNN; x (M × K) contiguous. Returns (M × N).
at::Tensor onednn_linear_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const auto w = weight_operand(weight);
  auto y = at::empty({M, N}, x.options());
  if (bias.defined()) y.copy_(bias.expand({M, N}));  // then accumulated into: one pass fewer than adding after
  OneDnnSgemm::instance().multiply(/*transpose_a=*/false, /*transpose_b=*/w.rows, M, N, K, x.data_ptr<float>(), K,
                                   w.tensor.data_ptr<float>(), w.ld, bias.defined() ? 1.0f : 0.0f,
                                   y.data_ptr<float>(), N);
  return y;
}

// The autograd of y = x Wᵀ (+ b) on oneDNN; x (M × K) contiguous, weight (N × K), bias (N).
// LibTorch's Function takes no undefined tensor, so the bias comes in only where there is one.
// The gradients of x (saved first), the weight (saved second) and (with_bias) the bias.
torch::autograd::tensor_list gradients(torch::autograd::AutogradContext* ctx, const at::Tensor& output_grad,
                                       bool with_bias) {
  const auto saved = ctx->get_saved_variables();
  const auto &x = saved[0], &weight = saved[1];
  const auto grad = output_grad.contiguous();  // (M × N)
  at::Tensor grad_x, grad_weight, grad_bias;
  if (with_bias && ctx->needs_input_grad(2)) grad_bias = grad.sum(0);
  if (torch::GradMode::is_enabled()) {
    // create_graph: the gradients must themselves be differentiable, so they are LibTorch's ops.
    if (ctx->needs_input_grad(0)) grad_x = grad.mm(weight);
    if (ctx->needs_input_grad(1)) grad_weight = grad.t().mm(x);
    return {grad_x, grad_weight, grad_bias};
  }
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const auto& gemm = OneDnnSgemm::instance();
  if (ctx->needs_input_grad(0)) {  // dx (M × K) = grad (M × N) · W (N × K)
    const auto w = weight_operand(weight);
    grad_x = at::empty({M, K}, x.options());
    gemm.multiply(false, /*transpose_b=*/!w.rows, M, K, N, grad.data_ptr<float>(), N, w.tensor.data_ptr<float>(),
                  w.ld, 0.0f, grad_x.data_ptr<float>(), K);
  }
  if (ctx->needs_input_grad(1)) {  // dW (N × K) = gradᵀ (N × M) · x (M × K)
    grad_weight = at::empty({N, K}, weight.options());
    gemm.multiply(/*transpose_a=*/true, false, N, K, M, grad.data_ptr<float>(), N, x.data_ptr<float>(), K, 0.0f,
                  grad_weight.data_ptr<float>(), K);
  }
  return {grad_x, grad_weight, grad_bias};
}

struct OneDnnLinear : torch::autograd::Function<OneDnnLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias) {
    ctx->save_for_backward({x, weight});
    return onednn_linear_forward(x, weight, bias);  // (M × N)
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    return gradients(ctx, grads[0], /*with_bias=*/true);
  }
};

struct OneDnnLinearWithoutBias : torch::autograd::Function<OneDnnLinearWithoutBias> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    ctx->save_for_backward({x, weight});
    return onednn_linear_forward(x, weight, at::Tensor());  // (M × N)
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto all = gradients(ctx, grads[0], /*with_bias=*/false);
    return {all[0], all[1]};
  }
};

bool float32_on_cpu(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided && t.scalar_type() == at::kFloat && !t.is_neg() &&
         !t.is_conj();
}

// The contract of the oneDNN route, checked here once; anything else goes to LibTorch, which
// also gives mismatched shapes their error.
bool onednn_takes(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (!OneDnnSgemm::instance().available()) return false;
  if (!x.defined() || !weight.defined() || x.dim() < 2 || weight.dim() != 2) return false;
  if (!float32_on_cpu(x) || !float32_on_cpu(weight)) return false;
  if (bias.defined() && (!float32_on_cpu(bias) || bias.dim() != 1 || bias.size(0) != weight.size(0))) return false;
  if (compat::autocast_enabled(at::kCPU)) return false;  // autocast casts inside at::linear
  const int64_t K = x.size(-1), N = weight.size(0);
  if (K != weight.size(1) || K == 0 || N == 0 || x.numel() == 0) return false;
  const int64_t M = x.numel() / K;
  return M >= kOneDnnFromRows && static_cast<double>(M) * K * N >= static_cast<double>(kOneDnnFromMultiplyAdds);
}

// LibTorch's route alone: what linear() does with an input that the oneDNN route does not take.
at::Tensor linear_by_libtorch(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (bias.defined() && x.dim() >= 3 && x.is_contiguous() && weight.dim() == 2 && bias.dim() == 1) {
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    return at::addmm(bias, x.view({-1, x.size(-1)}), weight.t()).view(sizes);
  }
  return at::linear(x, weight, bias);
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (!onednn_takes(x, weight, bias)) return linear_by_libtorch(x, weight, bias);
  const int64_t K = x.size(-1);
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  const auto rows = x.contiguous().view({-1, K});  // (M × K)
  const auto product = bias.defined() ? OneDnnLinear::apply(rows, weight, bias)
                                      : OneDnnLinearWithoutBias::apply(rows, weight);  // (M × N)
  return product.view(sizes);
}

}  // namespace qkv::detail
