// SelfAttentionImpl: projections, head split/join and input checks around the functional core.
//
// B = batch, N = query positions, S = context positions, E = d_model, H = heads, D = E / H.
#include <qkv/self_attention.h>

#include <torch/torch.h>
#include <torch/version.h>

#include <cmath>

namespace qkv {

SelfAttentionImpl::SelfAttentionImpl(const SelfAttentionOptions& options_) : options(options_) { reset(); }

void SelfAttentionImpl::reset() {
  const auto d_model = options.d_model();
  const auto heads = options.num_heads();
  TORCH_CHECK(d_model > 0, "SelfAttention: expected d_model > 0, got ", d_model);
  TORCH_CHECK(heads > 0, "SelfAttention: expected num_heads > 0, got ", heads);
  TORCH_CHECK(d_model % heads == 0, "SelfAttention: expected d_model divisible by num_heads, got d_model = ", d_model,
              " and num_heads = ", heads);
  TORCH_CHECK(options.dropout() >= 0.0 && options.dropout() < 1.0, "SelfAttention: expected dropout in [0, 1), got ",
              options.dropout());
  if (options.scale()) {
    TORCH_CHECK(std::isfinite(*options.scale()), "SelfAttention: expected a finite scale, got ", *options.scale());
  }
  const auto kdim = options.kdim().value_or(d_model);
  const auto vdim = options.vdim().value_or(d_model);
  TORCH_CHECK(kdim > 0, "SelfAttention: expected kdim > 0, got ", kdim);
  TORCH_CHECK(vdim > 0, "SelfAttention: expected vdim > 0, got ", vdim);
  TORCH_CHECK(options.backend() != AttentionBackend::Fused || fused_backend_available(),
              "SelfAttention: the fused backend needs LibTorch >= 2.0, this build has ", TORCH_VERSION,
              "; use AttentionBackend::Auto or Math");

  // The order is a contract: W_q, W_k, W_v draw their initial weights from the generator in the
  // same order as the documents' Python module, so one seed gives the same weights in both.
  using torch::nn::Linear;
  using torch::nn::LinearOptions;
  W_q = register_module("W_q", Linear(LinearOptions(d_model, d_model).bias(options.bias())));
  W_k = register_module("W_k", Linear(LinearOptions(kdim, d_model).bias(options.bias())));
  W_v = register_module("W_v", Linear(LinearOptions(vdim, d_model).bias(options.bias())));
  if (options.out_proj()) {
    W_o = register_module("W_o", Linear(LinearOptions(d_model, d_model).bias(options.bias())));
  } else {
    W_o = nullptr;
  }
}

void SelfAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "qkv::SelfAttention(d_model=" << options.d_model() << ", num_heads=" << options.num_heads()
         << ", bias=" << std::boolalpha << options.bias() << ", causal=" << options.causal()
         << ", dropout=" << options.dropout() << ", scale=";
  if (options.scale()) {
    stream << *options.scale();
  } else {
    stream << "1/sqrt(" << options.d_model() / options.num_heads() << ")";
  }
  stream << ", out_proj=" << options.out_proj() << ", kdim=" << options.kdim().value_or(options.d_model())
         << ", vdim=" << options.vdim().value_or(options.d_model()) << ", backend=" << options.backend() << ")";
}

torch::Tensor SelfAttentionImpl::forward(const torch::Tensor& query, const torch::Tensor& context,
                                         const AttentionMask& mask) {
  const auto& source = context.defined() ? context : query;
  return attend(query, source, source, mask, /*need_weights=*/false).output;
}

SelfAttentionOutput SelfAttentionImpl::forward_with_weights(const torch::Tensor& query, const torch::Tensor& context,
                                                            const AttentionMask& mask) {
  const auto& source = context.defined() ? context : query;
  return attend(query, source, source, mask, /*need_weights=*/true);
}

namespace {

void check_input(const char* name, const torch::Tensor& input, int64_t rank, int64_t width,
                 const torch::Tensor& parameter) {
  TORCH_CHECK(input.defined(), "SelfAttention: expected a defined ", name, " tensor");
  TORCH_CHECK(input.dim() == rank, "SelfAttention: expected ", name, " of shape ",
              rank == 2 ? "(S, " : "(B, S, ", width, ") like the query's rank ", rank, ", got ", input.sizes());
  TORCH_CHECK(input.size(-1) == width, "SelfAttention: expected ", name, " with last dimension ", width, ", got ",
              input.sizes());
  TORCH_CHECK(input.scalar_type() == parameter.scalar_type(), "SelfAttention: expected ", name, " of dtype ",
              parameter.scalar_type(), " (the module's parameters), got ", input.scalar_type(),
              "; convert the input or the module with .to()");
  TORCH_CHECK(input.device() == parameter.device(), "SelfAttention: expected ", name, " on ", parameter.device(),
              " (the module's device), got ", input.device());
}

}  // namespace

ScaledDotProductAttentionOptions SelfAttentionImpl::attention_options(bool need_weights) const {
  return ScaledDotProductAttentionOptions()
      .causal(options.causal())
      .scale(options.scale())
      .dropout(options.dropout())
      .training(is_training())
      .need_weights(need_weights)
      .backend(need_weights ? AttentionBackend::Math : options.backend());  // only math returns weights
}

SelfAttentionOutput SelfAttentionImpl::attend(const torch::Tensor& query, const torch::Tensor& key,
                                              const torch::Tensor& value, const AttentionMask& mask,
                                              bool need_weights) {
  const int64_t E = options.d_model();
  const int64_t H = options.num_heads();
  const int64_t D = E / H;
  const int64_t kdim = options.kdim().value_or(E);
  const int64_t vdim = options.vdim().value_or(E);

  TORCH_CHECK(query.defined(), "SelfAttention: expected a defined query tensor");
  TORCH_CHECK(query.dim() == 2 || query.dim() == 3, "SelfAttention: expected query of shape (N, ", E, ") or (B, N, ",
              E, "), got ", query.sizes());
  TORCH_CHECK(query.size(-1) == E, "SelfAttention: expected query with last dimension d_model = ", E, ", got ",
              query.sizes());
  TORCH_CHECK(query.is_floating_point(), "SelfAttention: expected a floating-point query, got ", query.scalar_type());
  const auto& parameter = W_q->weight;
  check_input("query", query, query.dim(), E, parameter);
  if (key.is_same(query) && value.is_same(query)) {
    TORCH_CHECK(kdim == E && vdim == E, "SelfAttention: self-attention needs kdim == vdim == d_model = ", E,
                ", this module has kdim = ", kdim, " and vdim = ", vdim, "; pass a context");
  } else if (key.is_same(value)) {
    TORCH_CHECK(kdim == vdim, "SelfAttention: one context feeds both W_k and W_v, which needs kdim == vdim, this "
                "module has kdim = ", kdim, " and vdim = ", vdim, "; call attend(query, key, value)");
  }
  check_input("key", key, query.dim(), kdim, parameter);
  check_input("value", value, query.dim(), vdim, parameter);
  const bool batched = query.dim() == 3;
  if (batched) {
    TORCH_CHECK(key.size(0) == query.size(0) && value.size(0) == query.size(0),
                "SelfAttention: expected query, key and value with the same batch size, got query ", query.sizes(),
                ", key ", key.sizes(), ", value ", value.sizes());
  }
  TORCH_CHECK(key.size(-2) == value.size(-2), "SelfAttention: expected key and value with the same number of "
              "positions S, got key ", key.sizes(), " and value ", value.sizes());

  if (H == 1 && mask.empty()) {
    // One head, no padding or general mask (the documents' module): attention runs on the
    // projections as they are, (N, E) or (B, N, E). The head split and join below are views,
    // but each is an autograd node with a backward: at the documents' sizes they cost more than
    // the attention itself.
    auto result = scaled_dot_product_attention(W_q(query), W_k(key), W_v(value),
                                               attention_options(need_weights));  // (…, N, E)
    last_backend_ = result.backend;
    SelfAttentionOutput out;
    out.output = W_o ? W_o(result.output) : result.output;
    if (need_weights) out.weights = result.weights.unsqueeze(-3);  // (B, 1, N, S) / (1, N, S)
    out.backend = result.backend;
    return out;
  }

  const auto q_in = batched ? query : query.unsqueeze(0);  // (B, N, E)
  const auto k_in = batched ? key : key.unsqueeze(0);      // (B, S, kdim)
  const auto v_in = batched ? value : value.unsqueeze(0);  // (B, S, vdim)
  const int64_t B = q_in.size(0);
  const int64_t N = q_in.size(1);
  const int64_t S = k_in.size(1);

  // Project, then split E into H heads of width D.
  auto q = W_q(q_in).view({B, N, H, D}).transpose(1, 2);  // (B, H, N, D)
  auto k = W_k(k_in).view({B, S, H, D}).transpose(1, 2);  // (B, H, S, D)
  auto v = W_v(v_in).view({B, S, H, D}).transpose(1, 2);  // (B, H, S, D)

  auto attention = attention_options(need_weights).mask(
      detail::merge_attention_mask(mask, batched, B, H, N, S, q.scalar_type(), q.device()));
  auto result = scaled_dot_product_attention(q, k, v, attention);
  last_backend_ = result.backend;

  // Join the heads again.
  auto output = result.output.transpose(1, 2).reshape({B, N, E});  // (B, N, E)
  if (W_o) output = W_o(output);

  SelfAttentionOutput out;
  out.output = batched ? output : output.squeeze(0);
  if (need_weights) out.weights = batched ? result.weights : result.weights.squeeze(0);  // (B, H, N, S) / (H, N, S)
  out.backend = result.backend;
  return out;
}

}  // namespace qkv
