// Linear layers on oneDNN's GEMM or qkv's own micro-kernels (see linear.h).
//
// M = rows of the input (all leading dimensions), K = in features, N = out features.
#include "linear.h"

#include "kernels/linear/products.h"
#include "kernels/linear/onednn_gemm.h"
#include "kernels/tiled/cpu_features.h"
#include "torch_compat.h"

#include <ATen/Functions.h>
#include <torch/autograd.h>

#include <optional>

namespace qkv::detail {

using kernels::tiled::at_least;
using kernels::tiled::ProductIsa;

namespace {

using kernels::linear::LinearGemmChoice;
using kernels::linear::OneDnnGemm;

// Which GEMM a product takes: oneDNN's float32 one, or operands rounded to bfloat16 (CPU autocast
// to bfloat16; bfloat16_gemm() says how they are multiplied); both accumulate and write float32.
enum class GemmInputs { Float32, BFloat16 };

// How bfloat16 operands are multiplied: by oneDNN's bfloat16 GEMM, or where the CPU has no bfloat16
// instructions by qkv's float32 micro-kernels, widened as they are packed (bfloat16_products()).
kernels::linear::Bfloat16Gemm bfloat16_gemm() {
  return bfloat16_products() == Bfloat16Products::Float32 ? kernels::linear::Bfloat16Gemm::Float32
                                                           : kernels::linear::Bfloat16Gemm::OneDnn;
}

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

// An operand as the GEMM takes it: float32 as it is, else rounded to bfloat16 (a contiguous
// float32 one by qkv's vector loop, anything else by LibTorch, strides kept).
at::Tensor gemm_operand(const at::Tensor& t, GemmInputs inputs) {
  return inputs == GemmInputs::BFloat16 ? kernels::linear::float32_to(t, at::kBFloat16) : t;
}

// c (float32, row-major, row stride ldc) = op(a) · op(b) + beta · c, a and b both float32 (on
// float32_products()) or both bfloat16 (on bfloat16_gemm()); see OneDnnGemm::multiply.
void product(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const at::Tensor& a, int64_t lda,
             const at::Tensor& b, int64_t ldb, float beta, at::Tensor& c, int64_t ldc) {
  if (a.scalar_type() == at::kBFloat16) {
    const auto bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
    kernels::linear::multiply_bfloat16(bfloat16_gemm(), transpose_a, transpose_b, m, n, k, bits(a), lda, bits(b), ldb,
                                       beta, c.data_ptr<float>(), ldc);
  } else if (float32_products() == Float32Products::OneDnn) {
    OneDnnGemm::instance().multiply(transpose_a, transpose_b, m, n, k, a.data_ptr<float>(), lda, b.data_ptr<float>(),
                                    ldb, beta, c.data_ptr<float>(), ldc);
  } else {
    kernels::linear::multiply_float32(transpose_a, transpose_b, m, n, k, a.data_ptr<float>(), lda, b.data_ptr<float>(),
                                      ldb, beta, c.data_ptr<float>(), ldc);
  }
}

// y = x Wᵀ + b in float32 on float32_products(); x (M × K) contiguous, x and the weight GEMM
// operands. Returns (M × N).
at::Tensor float32_linear_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const auto w = weight_operand(weight);
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (bias.defined()) y.copy_(bias.expand({M, N}));  // then accumulated into: one pass fewer than adding after
  product(/*transpose_a=*/false, /*transpose_b=*/w.rows, M, N, K, x, K, w.tensor, w.ld, bias.defined() ? 1.0f : 0.0f,
          y, N);
  return y;
}

// The forward of both functions below (float32 on float32_products(), bfloat16 on bfloat16_gemm()): saves what
// the backward needs, returns (M × N) in float32, or in bfloat16 when the operands were rounded to
// it (autocast's type for a linear layer's output).
at::Tensor forward_on_gemm(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& bias, GemmInputs inputs) {
  const auto x_operand = gemm_operand(x, inputs), w_operand = gemm_operand(weight, inputs);
  // The operands for the backward's products; the inputs themselves (the same tensors in float32)
  // for a create_graph backward, whose gradients must reach them through autograd.
  ctx->save_for_backward({x_operand, w_operand, x, weight});
  // The gradients go back in the types that came (float32 for autocast's float32 weights).
  ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
  ctx->saved_data["w_dtype"] = static_cast<int64_t>(weight.scalar_type());
  ctx->saved_data["b_dtype"] = static_cast<int64_t>(bias.defined() ? bias.scalar_type() : at::kFloat);
  if (inputs == GemmInputs::Float32) return float32_linear_forward(x_operand, w_operand, bias);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const auto w = weight_operand(w_operand);
  return kernels::linear::bfloat16_product(bfloat16_gemm(), M, N, K, {x_operand, false, K}, {w.tensor, w.rows, w.ld},
                                          bias);
}

// The autograd of y = x Wᵀ (+ b) on the route's GEMM; x (M × K) contiguous, weight (N × K), bias (N).
// LibTorch's Function takes no undefined tensor, so the bias comes in only where there is one.
// The gradients of x, the weight and (with_bias) the bias, each in its input's type; the products
// in the forward's GEMM (bfloat16 operands give float32 gradients, rounded only if the input was
// bfloat16).
torch::autograd::tensor_list gradients(torch::autograd::AutogradContext* ctx, const at::Tensor& output_grad,
                                       bool with_bias) {
  const auto saved = ctx->get_saved_variables();
  const auto &x = saved[0], &weight = saved[1];  // as the GEMM took them
  const auto dtype = [&](const char* key) { return static_cast<at::ScalarType>(ctx->saved_data[key].toInt()); };
  const auto operand_type = x.scalar_type();
  at::Tensor grad_x, grad_weight, grad_bias;
  if (torch::GradMode::is_enabled()) {
    // create_graph: the gradients must themselves be differentiable, so they are LibTorch's ops on
    // the inputs themselves, rounded by LibTorch's (recorded) conversion where the GEMM rounded.
    const auto &x_input = saved[2], &w_input = saved[3];
    const auto grad = output_grad.to(operand_type);  // (M × N)
    if (with_bias && ctx->needs_input_grad(2)) grad_bias = at::sum(grad, {0}, false, at::kFloat).to(dtype("b_dtype"));
    if (ctx->needs_input_grad(0)) grad_x = grad.mm(w_input.to(operand_type)).to(dtype("x_dtype"));
    if (ctx->needs_input_grad(1)) grad_weight = grad.t().mm(x_input.to(operand_type)).to(dtype("w_dtype"));
    return {grad_x, grad_weight, grad_bias};
  }
  const auto grad = kernels::linear::float32_to(output_grad, operand_type).contiguous();  // (M × N)
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const bool want_x = ctx->needs_input_grad(0), want_weight = ctx->needs_input_grad(1),
             want_bias = with_bias && ctx->needs_input_grad(2);
  if (operand_type == at::kBFloat16 && bfloat16_gemm() == kernels::linear::Bfloat16Gemm::Float32 &&
      M > kernels::linear::kRowsPerSumGroup) {
    // On the float32 route: each block of grad widened once for the three products. Over
    // fewer rows (one group of the sum) the separate products, which spread over the threads.
    const auto w = weight_operand(weight);
    auto all = kernels::linear::linear_gradients_widened(grad, x, {w.tensor, !w.rows, w.ld}, want_x,
                                                         dtype("x_dtype") == at::kBFloat16, want_weight, want_bias);
    if (want_x) grad_x = all.grad_x.to(dtype("x_dtype"));
    if (want_weight) grad_weight = kernels::linear::float32_to(all.grad_weight, dtype("w_dtype"));
    if (want_bias) grad_bias = all.grad_bias.to(dtype("b_dtype"));
    return {grad_x, grad_weight, grad_bias};
  }
  if (want_bias) {
    grad_bias = (operand_type == at::kBFloat16 ? kernels::linear::bfloat16_column_sums(bfloat16_gemm(), grad)
                                               : grad.sum(0))
                    .to(dtype("b_dtype"));
  }
  const auto float32 = x.options().dtype(at::kFloat);
  if (want_x) {  // dx (M × K) = grad (M × N) · W (N × K)
    const auto w = weight_operand(weight);
    if (dtype("x_dtype") == at::kBFloat16) {  // rounded in cache
      grad_x = kernels::linear::bfloat16_product(bfloat16_gemm(), M, K, N, {grad, false, N}, {w.tensor, !w.rows, w.ld},
                                                 at::Tensor());
    } else {
      grad_x = at::empty({M, K}, float32);
      product(false, /*transpose_b=*/!w.rows, M, K, N, grad, N, w.tensor, w.ld, 0.0f, grad_x, K);
      grad_x = grad_x.to(dtype("x_dtype"));
    }
  }
  if (want_weight) {  // dW (N × K) = gradᵀ (N × M) · x (M × K)
    grad_weight = at::empty({N, K}, float32);
    product(/*transpose_a=*/true, false, N, K, M, grad, N, x, K, 0.0f, grad_weight, K);
    grad_weight = kernels::linear::float32_to(grad_weight, dtype("w_dtype"));  // float32 under autocast
  }
  return {grad_x, grad_weight, grad_bias};
}

struct GemmLinear : torch::autograd::Function<GemmLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, GemmInputs inputs) {
    return forward_on_gemm(ctx, x, weight, bias, inputs);  // (M × N)
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto all = gradients(ctx, grads[0], /*with_bias=*/true);
    return {all[0], all[1], all[2], at::Tensor()};
  }
};

struct GemmLinearWithoutBias : torch::autograd::Function<GemmLinearWithoutBias> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            GemmInputs inputs) {
    return forward_on_gemm(ctx, x, weight, at::Tensor(), inputs);  // (M × N)
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto all = gradients(ctx, grads[0], /*with_bias=*/false);
    return {all[0], all[1], at::Tensor()};
  }
};

// A real CPU tensor of a type the route takes: float32, or (under bfloat16 autocast) bfloat16.
bool cpu_tensor_of(const at::Tensor& t, bool bfloat16_too) {
  return t.device().is_cpu() && t.layout() == at::kStrided && !t.is_neg() && !t.is_conj() &&
         (t.scalar_type() == at::kFloat || (bfloat16_too && t.scalar_type() == at::kBFloat16));
}

// The contract of the GEMM route, checked here once: which GEMM takes the product, if any;
// anything else goes to LibTorch, which also gives mismatched shapes their error.
std::optional<GemmInputs> gemm_route(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (!x.defined() || !weight.defined() || x.dim() < 2 || weight.dim() != 2) return std::nullopt;
  // Under autocast LibTorch's at::linear computes in autocast's type: bfloat16 comes here unless
  // LibTorch's own bfloat16 products are the faster (bfloat16_products()), anything else stays.
  // Float32 comes here unless its products are LibTorch's (float32_products()).
  const bool autocast = compat::autocast_enabled(at::kCPU);
  const auto products = autocast ? bfloat16_products() : Bfloat16Products::LibTorch;
  if (autocast && (compat::autocast_dtype(at::kCPU) != at::kBFloat16 || products == Bfloat16Products::LibTorch)) {
    return std::nullopt;
  }
  if (!autocast && float32_products() == Float32Products::LibTorch) return std::nullopt;
  if (!cpu_tensor_of(x, autocast) || !cpu_tensor_of(weight, autocast)) return std::nullopt;
  if (bias.defined() && (!cpu_tensor_of(bias, autocast) || bias.dim() != 1 || bias.size(0) != weight.size(0))) {
    return std::nullopt;
  }
  const int64_t K = x.size(-1), N = weight.size(0);
  if (K != weight.size(1) || K == 0 || N == 0 || x.numel() == 0) return std::nullopt;
  const int64_t M = x.numel() / K;
  // Without bfloat16 instructions LibTorch's bfloat16 products are slow at every size (a decoded
  // token's 1 × 128 × 384: 67 µs against 20 for float32, 16 rows: 843 against 35; LibTorch 1.13,
  // Python, mkldnn off, AMD EPYC Zen 5, 2026-12-03): oneDNN's fixed cost is worth paying for all.
  const bool every_size = autocast && products == Bfloat16Products::Float32;
  if (!every_size &&
      (M < kGemmRouteFromRows || static_cast<double>(M) * K * N < static_cast<double>(kGemmRouteFromMultiplyAdds))) {
    return std::nullopt;
  }
  return autocast ? GemmInputs::BFloat16 : GemmInputs::Float32;
}

// LibTorch's route alone: what linear() does with an input that the GEMM route does not take.
at::Tensor linear_by_libtorch(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (bias.defined() && x.dim() >= 3 && x.is_contiguous() && weight.dim() == 2 && bias.dim() == 1) {
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    return at::addmm(bias, x.view({-1, x.size(-1)}), weight.t()).view(sizes);
  }
  return at::linear(x, weight, bias);
}

}  // namespace

Float32Products float32_products() {
  static const Float32Products chosen = [] {
    if (kernels::linear::linear_gemm_choice() == LinearGemmChoice::LibTorch) return Float32Products::LibTorch;
    if (OneDnnGemm::instance().available()) return Float32Products::OneDnn;
    // The lm's float32 step (qkv-train, 2 threads, AMD EPYC Zen 5, 2026-12-04): 105-107 ms on the
    // AVX-512 micro-kernels against 103-104 on oneDNN 2.6.3's GEMM and 130-175 on OpenBLAS 0.3.21;
    // on AVX2 (emulated) 159-160 against oneDNN's 166. Plain C++ micro-kernels are too slow.
    return kernels::linear::float32_products_on_micro_kernels() ? Float32Products::MicroKernels
                                                                : Float32Products::LibTorch;
  }();
  return chosen;
}

Bfloat16Products bfloat16_products() {
  static const Bfloat16Products chosen = [] {
    if (kernels::linear::linear_gemm_choice() == LinearGemmChoice::LibTorch) return Bfloat16Products::LibTorch;
    const auto& gemm = OneDnnGemm::instance();
    // The CPU as qkv sees it (QKV_TILED_ISA makes it look narrower, for tests and measurements).
    const ProductIsa usable = kernels::tiled::usable_isa();
    if (!at_least(usable, ProductIsa::Avx512Bf16)) {
      // qkv's vector micro-kernels need no oneDNN; its plain C++ ones are too slow to use alone.
      return kernels::linear::float32_products_on_micro_kernels() || gemm.available() ? Bfloat16Products::Float32
                                                                                       : Bfloat16Products::LibTorch;
    }
    if (usable == ProductIsa::Avx512Bf16 && kernels::tiled::active_isa() == ProductIsa::Avx512Bf16 &&
        gemm.bfloat16_available()) {
      return Bfloat16Products::OneDnnBfloat16;
    }
    return Bfloat16Products::LibTorch;
  }();
  return chosen;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const auto inputs = gemm_route(x, weight, bias);
  if (!inputs) return linear_by_libtorch(x, weight, bias);
  const int64_t K = x.size(-1);
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  const auto rows = x.contiguous().view({-1, K});  // (M × K)
  const auto y = bias.defined()  // (M × N)
                     ? compat::apply_autograd_function<GemmLinear>(rows, weight, bias, *inputs)
                     : compat::apply_autograd_function<GemmLinearWithoutBias>(rows, weight, *inputs);
  return y.view(sizes);
}

}  // namespace qkv::detail
