// scaled_dot_product_attention: argument checks, the math (reference) path written as the
// documents' four steps, and the fused path on LibTorch >= 2.0.
//
// B = batch, H = heads, N = query positions, S = key positions, D = head width, Dv = value width.
#include <qkv/functional.h>

#include <qkv/masks.h>

#include <ATen/ATen.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cmath>
#include <limits>

#if TORCH_VERSION_MAJOR >= 2
#define QKV_HAS_FUSED_SDPA 1
#else
#define QKV_HAS_FUSED_SDPA 0
#endif

namespace qkv {

const char* to_string(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::Auto: return "auto";
    case AttentionBackend::Math: return "math";
    case AttentionBackend::Fused: return "fused";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& stream, AttentionBackend backend) { return stream << to_string(backend); }

bool fused_backend_available() { return QKV_HAS_FUSED_SDPA != 0; }

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

void check_attention_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const ScaledDotProductAttentionOptions& options) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined(),
              "scaled_dot_product_attention: expected defined tensors q, k and v, got q ",
              q.defined() ? "defined" : "undefined", ", k ", k.defined() ? "defined" : "undefined", ", v ",
              v.defined() ? "defined" : "undefined");
  TORCH_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim(),
              "scaled_dot_product_attention: expected q (..., N, D), k (..., S, D) and v (..., S, Dv) of the same "
              "rank >= 2, got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  const auto leading = q.dim() - 2;
  TORCH_CHECK(q.sizes().slice(0, leading) == k.sizes().slice(0, leading) &&
                  q.sizes().slice(0, leading) == v.sizes().slice(0, leading),
              "scaled_dot_product_attention: expected equal leading (batch, head) dimensions, got q ", q.sizes(),
              ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(q.size(-1) == k.size(-1), "scaled_dot_product_attention: expected q and k of the same width D, got q ",
              q.sizes(), " and k ", k.sizes());
  TORCH_CHECK(k.size(-2) == v.size(-2),
              "scaled_dot_product_attention: expected k and v with the same number of positions S, got k ", k.sizes(),
              " and v ", v.sizes());
  TORCH_CHECK(at::isFloatingType(q.scalar_type()),
              "scaled_dot_product_attention: expected floating-point q, k, v, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "scaled_dot_product_attention: expected q, k and v of one dtype, got q ", q.scalar_type(), ", k ",
              k.scalar_type(), ", v ", v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(),
              "scaled_dot_product_attention: expected q, k and v on one device, got q on ", q.device(), ", k on ",
              k.device(), ", v on ", v.device());
  TORCH_CHECK(options.dropout() >= 0.0 && options.dropout() < 1.0,
              "scaled_dot_product_attention: expected dropout in [0, 1), got ", options.dropout());
  if (options.scale()) {
    TORCH_CHECK(std::isfinite(*options.scale()), "scaled_dot_product_attention: expected a finite scale, got ",
                *options.scale());
  }
  const auto& mask = options.mask();
  if (mask.defined()) {
    TORCH_CHECK(mask.scalar_type() == torch::kBool || at::isFloatingType(mask.scalar_type()),
                "scaled_dot_product_attention: expected a bool mask (true = attend) or a floating mask (added to "
                "the scores), got ", mask.scalar_type());
    TORCH_CHECK(mask.device() == q.device(), "scaled_dot_product_attention: expected the mask on ", q.device(),
                " like q, got ", mask.device());
    // The scores have shape (..., N, S); the mask must broadcast to it.
    auto scores_shape = q.sizes().vec();
    scores_shape.back() = k.size(-2);
    bool broadcastable = mask.dim() <= static_cast<int64_t>(scores_shape.size());
    for (int64_t i = 1; broadcastable && i <= mask.dim(); ++i) {
      const auto m = mask.size(-i);
      broadcastable = m == 1 || m == scores_shape[scores_shape.size() - i];
    }
    TORCH_CHECK(broadcastable, "scaled_dot_product_attention: expected a mask broadcastable to the scores' shape ",
                c10::IntArrayRef(scores_shape), " (..., N, S), got ", mask.sizes());
  }
  if (options.backend() == AttentionBackend::Fused) {
    TORCH_CHECK(fused_backend_available(), "scaled_dot_product_attention: the fused backend needs LibTorch >= 2.0, "
                "this build has ", TORCH_VERSION, "; use AttentionBackend::Auto or Math");
    TORCH_CHECK(!options.need_weights(), "scaled_dot_product_attention: the fused backend cannot return the "
                "attention weights; use AttentionBackend::Auto or Math with need_weights");
  }
}

double resolved_scale(const ScaledDotProductAttentionOptions& options, int64_t head_width) {
  return options.scale() ? *options.scale() : 1.0 / std::sqrt(static_cast<double>(head_width));
}

// The mask both paths apply, with the causal mask folded in, and the rows that it leaves
// without any key ("dead" rows). Softmax over a row of -inf is NaN; qkv gives such rows a
// zero output and zero gradients instead.
struct PreparedMask {
  torch::Tensor mask;       // bool (true = attend) or floating, broadcastable to (..., N, S); may be undefined
  torch::Tensor dead_rows;  // bool (..., N, 1): rows with no key left; undefined when there cannot be any
};

PreparedMask prepare_mask(const torch::Tensor& user_mask, bool causal, const torch::Tensor& q, int64_t num_keys) {
  PreparedMask prepared;
  const int64_t num_queries = q.size(-2);
  torch::Tensor mask = user_mask;
  if (mask.defined() && mask.is_floating_point()) mask = mask.to(q.scalar_type());
  if (causal) {
    auto allowed = causal_mask(num_queries, num_keys, q.device());  // (N, S)
    if (!mask.defined()) {
      mask = allowed;
    } else if (mask.scalar_type() == torch::kBool) {
      mask = mask.logical_and(allowed);
    } else {
      mask = mask.masked_fill(allowed.logical_not(), kNegInf);
    }
  }
  prepared.mask = mask;
  // Causal masks alone never empty a row (query i always sees key 0); other masks can. With S = 0
  // every row is empty, but then the products are empty sums and already give zero.
  if (user_mask.defined() && num_keys > 0) {
    prepared.dead_rows = mask.scalar_type() == torch::kBool ? mask.logical_not().all(/*dim=*/-1, /*keepdim=*/true)
                                                           : (mask == kNegInf).all(/*dim=*/-1, /*keepdim=*/true);
  }
  return prepared;
}

}  // namespace

namespace detail {

AttentionResult math_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const ScaledDotProductAttentionOptions& options) {
  const auto prepared = prepare_mask(options.mask(), options.causal(), q, k.size(-2));

  // Steps 1 and 2: the dot product of every query with every key, scaled by 1/sqrt(d_k) unless
  // told otherwise, so that softmax does not saturate. The scale is applied to q, (..., N, D),
  // rather than to the scores, (..., N, S): the same numbers up to rounding, without another
  // N×S tensor (at N = 512 a fresh 67 MB scores tensor costs more than its arithmetic).
  const double scale = resolved_scale(options, q.size(-1));
  auto scores = torch::matmul(scale == 1.0 ? q : q * scale, k.transpose(-2, -1));  // (..., N, S)
  if (prepared.mask.defined()) {
    // In place: the product's backward needs its inputs, not its output, and masking's backward
    // only the mask.
    if (prepared.mask.scalar_type() == torch::kBool) {
      scores.masked_fill_(prepared.mask.logical_not(), kNegInf);
    } else {
      scores.add_(prepared.mask);
    }
    // A row with no key left would be softmax(-inf, ...) = NaN: give it finite scores here and
    // zero weights below, so its output and gradients are zero.
    if (prepared.dead_rows.defined()) scores.masked_fill_(prepared.dead_rows, 0.0);
  }
  // Step 3: softmax per row turns scores into weights that sum to 1. Half-precision scores are
  // normalised in float32: exp() of bf16 scores loses too much to sum reliably.
  const bool reduced_precision = q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16;
  auto weights = reduced_precision ? torch::softmax(scores, /*dim=*/-1, torch::kFloat).to(q.scalar_type())
                                   : torch::softmax(scores, /*dim=*/-1);  // (..., N, S)
  if (prepared.dead_rows.defined()) weights = weights.masked_fill(prepared.dead_rows, 0.0);
  const bool apply_dropout = options.training() && options.dropout() > 0.0;
  const auto mixing = apply_dropout ? torch::dropout(weights, options.dropout(), /*train=*/true) : weights;
  // Step 4: each query's output is the weighted sum of the values.
  auto output = torch::matmul(mixing, v);  // (..., N, Dv)

  AttentionResult result;
  result.output = std::move(output);
  if (options.need_weights()) result.weights = std::move(weights);
  result.backend = AttentionBackend::Math;
  return result;
}

AttentionResult fused_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const ScaledDotProductAttentionOptions& options) {
#if QKV_HAS_FUSED_SDPA
  const int64_t num_queries = q.size(-2);
  const int64_t num_keys = k.size(-2);
  // Without a user mask, a square causal pattern goes to the kernels as is_causal, which lets
  // them skip the masked half. Everything else becomes one explicit mask.
  const bool kernel_causal = options.causal() && !options.mask().defined() && num_queries == num_keys;
  c10::optional<torch::Tensor> mask;
  torch::Tensor dead_rows;
  if (!kernel_causal && (options.mask().defined() || options.causal())) {
    auto prepared = prepare_mask(options.mask(), options.causal(), q, num_keys);
    dead_rows = prepared.dead_rows;
    if (dead_rows.defined()) {
      // Let dead rows attend everywhere inside the kernel, then zero them (see math_attention).
      prepared.mask = prepared.mask.scalar_type() == torch::kBool ? prepared.mask.logical_or(dead_rows)
                                                                  : prepared.mask.masked_fill(dead_rows, 0.0);
    }
    mask = prepared.mask;
  }
  const double dropout = options.training() ? options.dropout() : 0.0;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  auto output = at::scaled_dot_product_attention(q, k, v, mask, dropout, kernel_causal,
                                                 resolved_scale(options, q.size(-1)));
#else
  // LibTorch 2.0's kernels always scale by 1/sqrt(D): fold the requested scale into q.
  const double correction = resolved_scale(options, q.size(-1)) * std::sqrt(static_cast<double>(q.size(-1)));
  auto output = at::scaled_dot_product_attention(q * correction, k, v, mask, dropout, kernel_causal);
#endif
  if (dead_rows.defined()) output = output.masked_fill(dead_rows, 0.0);
  AttentionResult result;
  result.output = std::move(output);
  result.backend = AttentionBackend::Fused;
  return result;
#else
  TORCH_CHECK(false, "scaled_dot_product_attention: the fused backend needs LibTorch >= 2.0, this build has ",
              TORCH_VERSION);
#endif
}

}  // namespace detail

AttentionResult scaled_dot_product_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                             const ScaledDotProductAttentionOptions& options) {
  check_attention_inputs(q, k, v, options);
  bool use_fused = options.backend() == AttentionBackend::Fused;
  if (options.backend() == AttentionBackend::Auto) {
    // Empty inputs go to the math path: some fused kernels reject zero-sized launches.
    use_fused = fused_backend_available() && !options.need_weights() && q.numel() > 0 && k.numel() > 0;
  }
  return use_fused ? detail::fused_attention(q, k, v, options) : detail::math_attention(q, k, v, options);
}

}  // namespace qkv
