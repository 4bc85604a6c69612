// The tiled backend as LibTorch's autograd sees it: one autograd::Function whose forward and
// backward run the kernel's two passes (forward.cpp, backward.cpp) on operands normalised at the
// kernel's one entry (operands.cpp), dispatched over float32, float64, bfloat16 and float16. It
// takes q, k, v as the caller has them and returns the output and their gradients in the caller's
// shapes: the reshaping to 4-D happens inside, where it records no autograd node.
//
// Gradients: q, k, v always; an additive mask's when it requires grad (the kernel writes dS,
// which is that gradient before broadcasting); second order (create_graph) by recomputing the
// attention with the math backend's differentiable operations on the saved inputs, with the
// kernel's own dropout mask, so the gradients' history is real, not dropped.
//
// B = batch, H = query heads, Hkv = key/value heads, N = queries, S = keys, D = head width, Dv = value width.
#include "kernels/kernels.h"
#include "kernels/tiled/blocks.h"
#include "kernels/tiled/kernel.h"
#include "kernels/tiled/operands.h"
#include "kernels/tiled/tiled_cpu.h"
#include "torch_compat.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/torch.h>

#include <mutex>

namespace qkv::kernels {
namespace tiled {
namespace {

// What the kernel needs besides the tensors.
struct Settings {
  double scale = 1.0, dropout = 0.0;
  bool causal = false;
  int64_t window = 0;  // 0: none
  uint64_t seed = 0;
  bool grouped = false;  // enable_gqa with grouped heads: a rank-3 operand's first dimension holds the heads
};

template <typename acc_t>
Problem<acc_t> problem_of(const Operands& o, const Settings& settings) {
  Problem<acc_t> p;
  p.B = o.q.size(0), p.H = o.q.size(1), p.Hkv = o.k.size(1), p.N = o.q.size(2), p.S = o.k.size(2);
  p.D = o.q.size(3), p.Dv = o.v.size(3);
  p.scale = static_cast<acc_t>(settings.scale);
  p.causal = settings.causal;
  p.window = settings.window;
  p.key_lengths = o.key_lengths.numel() > 0 ? o.key_lengths.data_ptr<int64_t>() : nullptr;
  if (o.mask.dim() == 4) {
    // No step along a dimension of size 1 (the batch or heads of a mask that serves them all),
    // whatever its stride.
    const auto step = [&](int64_t dim) { return o.mask.size(dim) == 1 ? 0 : o.mask.stride(dim); };
    p.mask.stride_b = step(0), p.mask.stride_h = step(1), p.mask.stride_row = step(2), p.mask.stride_key = step(3);
    p.mask.batches = o.mask.size(0), p.mask.heads = o.mask.size(1);
    if (o.mask.scalar_type() == torch::kBool) {
      p.mask.bools = o.mask.data_ptr<bool>();
    } else {
      p.mask.values = o.mask.template data_ptr<acc_t>();
    }
  }
  p.dropout = DropoutStream(settings.seed, settings.dropout);
  return p;
}

// The pointers and strides of a kernel_readable operand. A dimension of size 1 is never stepped
// along, whatever its stride; BLAS still checks the leading dimension, so a single row gets its width.
template <typename T>
Matrix4<T> matrix_of(const torch::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.dim() == 4 && kernel_readable(t), "tiled kernel: operand not normalised, sizes ", t.sizes(),
                        " strides ", t.strides());
  const int64_t row_stride = t.size(2) > 1 ? t.stride(2) : std::max<int64_t>(t.size(3), 1);
  return {t.template data_ptr<T>(), t.stride(0), t.stride(1), std::max<int64_t>(row_stride, 1)};
}

template <typename T>
OutputMatrix4<T> output_of(const torch::Tensor& t) {
  const auto readable = matrix_of<T>(t);
  return {t.template data_ptr<T>(), readable.stride_b, readable.stride_h, readable.stride_row};
}

// The forward's outputs: the attention output (B, H, N, Dv), the rows' statistics (B, H, N, 2:
// m and log l, kernel.h), and,
// when a backward will follow and the problem is small (keeps_probabilities), the probabilities
// (B, H, N, S) for it (else an empty tensor).
struct ForwardResult {
  torch::Tensor output, row_statistics, probabilities;
};

// Runs the forward into `output` (B, H, N, Dv), kernel_readable.
ForwardResult run_forward(const Operands& o, const Settings& settings, bool backward_follows,
                          const torch::Tensor& output) {
  const auto& q = o.q;
  ForwardResult result;
  result.output = output;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "qkv_tiled_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    auto p = problem_of<acc_t>(o, settings);
    // A checkpoint's first run computes as its recomputation with autograd will (kernels.h).
    p.forward_only = !backward_follows && !recomputed_later();
    const auto accumulation = q.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
    result.row_statistics = torch::empty({p.B, p.H, p.N, kRowStatistics}, accumulation);
    const bool keep = backward_follows && keeps_probabilities(p);
    result.probabilities = keep ? torch::empty({p.B, p.H, p.N, p.S}, accumulation) : torch::empty({0}, accumulation);
    forward_blocks<scalar_t, acc_t>(p, matrix_of<scalar_t>(o.q), matrix_of<scalar_t>(o.k), matrix_of<scalar_t>(o.v),
                                    output_of<scalar_t>(result.output), result.row_statistics.data_ptr<acc_t>(),
                                    keep ? result.probabilities.data_ptr<acc_t>() : nullptr);
  });
  return result;
}

struct Gradients {
  torch::Tensor q, k, v, mask;
};

// The gradients of q, k, v, each in its operand's layout, and of an additive mask when asked.
Gradients run_backward(const Operands& o, const ForwardResult& forward, const torch::Tensor& grad_out,
                       const Settings& settings, bool want_mask_gradient) {
  const auto& out = forward.output;
  const auto& row_statistics = forward.row_statistics;
  const auto& q = o.q;
  Gradients grads;
  if (grad_out.numel() == 0) {
    // No output element (B, H, N or Dv is 0): every gradient is zero, and the kernel has no row to
    // run whose key and value blocks would write them.
    grads.q = torch::zeros_like(o.q), grads.k = torch::zeros_like(o.k), grads.v = torch::zeros_like(o.v);
    if (want_mask_gradient) grads.mask = torch::zeros_like(o.mask);
    return grads;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "qkv_tiled_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = problem_of<acc_t>(o, settings);
    grads.q = empty_in_layout_of(o.q, p.D, q.options());
    grads.k = empty_in_layout_of(o.k, p.D, q.options());
    grads.v = empty_in_layout_of(o.v, p.Dv, q.options());
    // The mask's gradient summed by the kernel, or per batch element and head and summed here.
    const bool summed = want_mask_gradient && sums_mask_gradient(p);
    if (want_mask_gradient) {
      grads.mask = torch::zeros(summed ? std::vector<int64_t>{p.mask.batches, p.mask.heads, p.N, p.S}
                                       : std::vector<int64_t>{p.B, p.H, p.N, p.S},
                                row_statistics.options());
    }
    // The upstream gradient as it comes (after the module's head join: the output's layout), unless
    // the kernel cannot read it in place (an expanded gradient of a sum, say).
    const auto grad = kernel_readable(grad_out) ? grad_out : grad_out.contiguous();
    Gradients4<scalar_t, acc_t> results{output_of<scalar_t>(grads.q), output_of<scalar_t>(grads.k),
                                        output_of<scalar_t>(grads.v),
                                        want_mask_gradient ? grads.mask.data_ptr<acc_t>() : nullptr, summed};
    backward_blocks<scalar_t, acc_t>(p, matrix_of<scalar_t>(o.q), matrix_of<scalar_t>(o.k), matrix_of<scalar_t>(o.v),
                                     matrix_of<scalar_t>(out), matrix_of<scalar_t>(grad),
                                     row_statistics.data_ptr<acc_t>(),
                                     forward.probabilities.numel() > 0 ? forward.probabilities.data_ptr<acc_t>()
                                                                       : nullptr,
                                     results);
    if (want_mask_gradient && !summed) grads.mask = grads.mask.sum_to_size(o.mask.sizes());
  });
  return grads;
}

// The same attention with the math backend's differentiable operations (the kernel's own dropout
// mask included): what a second-order gradient differentiates.
torch::Tensor math_recomputation(const Operands& o, const Settings& settings) {
  auto options = ScaledDotProductAttentionOptions()
                     .causal(settings.causal)
                     .window(settings.window > 0 ? c10::optional<int64_t>(settings.window) : c10::nullopt)
                     .scale(settings.scale)
                     .enable_gqa(o.q.size(1) != o.k.size(1))
                     .backend(AttentionBackend::Math);
  if (o.mask.dim() == 4) options.mask(o.mask);
  if (o.key_lengths.numel() > 0) options.key_lengths(o.key_lengths);
  torch::Tensor keep;
  if (settings.dropout > 0) {
    options.dropout(settings.dropout).training(true);
    keep = tiled_dropout_keep_mask(settings.seed, settings.dropout, o.q.size(0), o.q.size(1), o.q.size(2), o.k.size(2));
  }
  return math_attention(o.q, o.k, o.v, options, keep).output;
}

// The tensors the forward keeps for the backward, by name. They go through save_for_backward (so
// autograd refuses a backward after any of them was modified in place); the settings through
// saved_data. The output is kept as the Function returned it (autograd saves its own outputs
// without a reference cycle) and seen as 4-D again in the backward.
struct SavedState {
  torch::Tensor q, k, v;  // as the caller passed them: what a second-order gradient differentiates
  Operands operands;      // the kernel's views (or copies) of them, and the mask and key lengths
  ForwardResult forward;  // forward.output: the Function's output, in the caller's shape
  Settings settings;

  void save(torch::autograd::AutogradContext* ctx) const {
    const auto& o = operands;
    ctx->save_for_backward(
        {q, k, v, o.q, o.k, o.v, o.mask, o.key_lengths, forward.output, forward.row_statistics, forward.probabilities});
    ctx->saved_data["scale"] = settings.scale;
    ctx->saved_data["dropout"] = settings.dropout;
    ctx->saved_data["causal"] = settings.causal;
    ctx->saved_data["window"] = settings.window;
    ctx->saved_data["seed"] = static_cast<int64_t>(settings.seed);
    ctx->saved_data["grouped"] = settings.grouped;
  }

  static SavedState load(torch::autograd::AutogradContext* ctx) {
    const auto saved = ctx->get_saved_variables();
    SavedState state;
    state.q = saved[0], state.k = saved[1], state.v = saved[2];
    auto& o = state.operands;
    o.q = saved[3], o.k = saved[4], o.v = saved[5], o.mask = saved[6], o.key_lengths = saved[7];
    state.forward.output = saved[8], state.forward.row_statistics = saved[9], state.forward.probabilities = saved[10];
    state.settings.scale = ctx->saved_data["scale"].toDouble();
    state.settings.dropout = ctx->saved_data["dropout"].toDouble();
    state.settings.causal = ctx->saved_data["causal"].toBool();
    state.settings.window = ctx->saved_data["window"].toInt();
    state.settings.seed = static_cast<uint64_t>(ctx->saved_data["seed"].toInt());
    state.settings.grouped = ctx->saved_data["grouped"].toBool();
    return state;
  }
};

class TiledAttentionFunction : public torch::autograd::Function<TiledAttentionFunction> {
 public:
  // The inputs in this order, so that the backward returns one gradient per input.
  enum Input {
    kQuery, kKey, kValue, kMask, kKeyLengths, kScale, kCausal, kWindow, kDropout, kSeed, kBackwardFollows, kGrouped,
    kInputs
  };

  // q (..., N, D), k (..., S, D), v (..., S, Dv) as the caller has them (rank 4: (B, H, ·, ·));
  // mask (B, H, N, S) view or empty and key_lengths (B,) or empty from kernel_conditions. Returns
  // the output (..., N, Dv): for 4-D q (B, H, N, Dv) in q's layout, else contiguous.
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& mask, const torch::Tensor& key_lengths,
                               double scale, bool causal, int64_t window, double dropout, int64_t seed,
                               bool backward_follows, bool grouped) {
    SavedState state;
    state.q = q, state.k = k, state.v = v;
    auto& o = state.operands;
    o.q = kernel_operand(q, grouped), o.k = kernel_operand(k, grouped), o.v = kernel_operand(v, grouped);
    o.mask = mask, o.key_lengths = key_lengths;
    state.settings = Settings{scale, dropout, causal, window, static_cast<uint64_t>(seed), grouped};
    torch::Tensor output;
    if (q.dim() == 4) {
      output = empty_in_layout_of(o.q, v.size(-1), q.options());
    } else {
      auto shape = q.sizes().vec();
      shape.back() = v.size(-1);
      output = torch::empty(shape, q.options());
    }
    state.forward = run_forward(o, state.settings, backward_follows, kernel_operand(output, grouped));
    state.forward.output = output;
    state.save(ctx);
    return output;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    const auto state = SavedState::load(ctx);
    const auto& o = state.operands;
    if (torch::GradMode::is_enabled()) {
      // create_graph: the gradients must themselves be differentiable.
      return second_order_ready_gradients(ctx, state, grad_outputs[0]);
    }
    const bool mask_gradient = ctx->needs_input_grad(kMask) && o.mask.is_floating_point();
    torch::autograd::tensor_list grads(kInputs);
    auto forward = state.forward;
    forward.output = kernel_operand(forward.output, state.settings.grouped);  // a view: the output is readable
    auto computed = run_backward(o, forward, kernel_operand(grad_outputs[0], state.settings.grouped), state.settings,
                                 mask_gradient);
    // In the callers' shapes (views: the 4-D ones only added dimensions of size 1, or split a contiguous one)
    grads[kQuery] = computed.q.reshape(state.q.sizes());
    grads[kKey] = computed.k.reshape(state.k.sizes());
    grads[kValue] = computed.v.reshape(state.v.sizes());
    if (mask_gradient) grads[kMask] = computed.mask;
    return grads;
  }

 private:
  static torch::autograd::tensor_list second_order_ready_gradients(torch::autograd::AutogradContext* ctx,
                                                                   const SavedState& state,
                                                                   const torch::Tensor& grad_out) {
    const auto& o = state.operands;
    std::vector<torch::Tensor> inputs;
    std::vector<Input> which;
    for (const auto& [index, tensor] : {std::pair{kQuery, state.q}, std::pair{kKey, state.k},
                                        std::pair{kValue, state.v}, std::pair{kMask, o.mask}}) {
      if (ctx->needs_input_grad(index) && tensor.requires_grad()) inputs.push_back(tensor), which.push_back(index);
    }
    torch::autograd::tensor_list grads(kInputs);
    if (inputs.empty()) return grads;
    // The kernel's operands again, now recorded by autograd from the caller's tensors.
    const bool grouped = state.settings.grouped;
    const Operands recorded{kernel_operand(state.q, grouped), kernel_operand(state.k, grouped),
                            kernel_operand(state.v, grouped), o.mask, o.key_lengths};
    const auto output = math_recomputation(recorded, state.settings).reshape(grad_out.sizes());
    const auto computed = torch::autograd::grad({output}, inputs, {grad_out}, /*retain_graph=*/true,
                                                /*create_graph=*/true, /*allow_unused=*/true);
    for (size_t i = 0; i < which.size(); ++i) grads[which[i]] = computed[i];
    return grads;
  }
};

}  // namespace
}  // namespace tiled

bool tiled_supports(const torch::Tensor& q) {
  const auto dtype = q.scalar_type();
  return q.device().is_cpu() && (dtype == torch::kFloat || dtype == torch::kDouble || dtype == torch::kBFloat16 ||
                                 dtype == torch::kHalf);
}

bool tiled_uses_blas() { return tiled::gemm_uses_blas(); }

bool tiled_fast_for(const torch::Tensor& q) { return q.scalar_type() != torch::kDouble || tiled::gemm_uses_blas(); }

AttentionResult tiled_attention_with_seed(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          const ScaledDotProductAttentionOptions& options, uint64_t seed) {
  TORCH_CHECK(tiled_supports(q),
              "scaled_dot_product_attention: the tiled backend runs on the CPU in float32, float64, "
              "bfloat16 or float16, got ",
              q.scalar_type(), " on ", q.device());
  const bool grouped = tiled::grouped_heads(q, k, options);
  const auto [mask, key_lengths] = tiled::kernel_conditions(q, k, options, grouped);
  const double dropout = options.training() ? options.dropout() : 0.0;
  // Whether autograd will record this call (inside the Function's forward grad mode is off).
  const bool backward_follows = torch::GradMode::is_enabled() &&
                                (q.requires_grad() || k.requires_grad() || v.requires_grad() || mask.requires_grad());
  AttentionResult result;
  result.output = compat::apply_autograd_function<tiled::TiledAttentionFunction>(
      q, k, v, mask, key_lengths, resolved_scale(options, q.size(-1)), options.causal(), options.window().value_or(0),
      dropout, static_cast<int64_t>(seed), backward_follows, grouped);
  result.backend = AttentionBackend::Tiled;
  return result;
}

AttentionResult tiled_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const ScaledDotProductAttentionOptions& options) {
  uint64_t seed = 0;
  if (options.training() && options.dropout() > 0.0) {
    // From LibTorch's CPU generator, so that torch::manual_seed makes runs repeatable.
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    seed = generator.get<at::CPUGeneratorImpl>()->random64();
  }
  return tiled_attention_with_seed(q, k, v, options, seed);
}

}  // namespace qkv::kernels
