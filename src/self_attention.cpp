// SelfAttentionImpl: projections, head split/join, rotary positions, the KV cache and input
// checks around the functional core.
//
// B = batch, N = query positions, S = context positions, T = new positions (cached decoding),
// L = cached positions, E = d_model, H = query heads, Hkv = key/value heads, D = E / H.
#include <qkv/self_attention.h>

#include "linear.h"
#include "mask_algebra.h"
#include "rope.h"
#include "torch_compat.h"

#include <torch/torch.h>
#include <torch/version.h>

#include <cmath>
#include <tuple>

namespace qkv {

namespace {

int64_t kv_heads_of(const SelfAttentionOptions& options) {
  return options.num_kv_heads().value_or(options.num_heads());
}

// The dtype the projections compute in: the parameters', or autocast's where autocast is on for
// their device and they are float32 (qkv::AutocastGuard, mixed precision).
torch::ScalarType projection_dtype(const torch::Tensor& weight) {
  const auto type = weight.device().type();
  const bool autocast = (type == torch::kCPU || type == torch::kCUDA) && compat::autocast_enabled(type);
  return autocast && weight.scalar_type() == torch::kFloat ? compat::autocast_dtype(type) : weight.scalar_type();
}

}  // namespace

SelfAttentionImpl::SelfAttentionImpl(const SelfAttentionOptions& options_) : options(options_) { reset(); }

void SelfAttentionImpl::reset() {
  const auto d_model = options.d_model();
  const auto heads = options.num_heads();
  TORCH_CHECK(d_model > 0, "SelfAttention: expected d_model > 0, got ", d_model);
  TORCH_CHECK(heads > 0, "SelfAttention: expected num_heads > 0, got ", heads);
  TORCH_CHECK(d_model % heads == 0, "SelfAttention: expected d_model divisible by num_heads, got d_model = ", d_model,
              " and num_heads = ", heads);
  const auto kv_heads = kv_heads_of(options);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0,
              "SelfAttention: expected num_kv_heads dividing num_heads (each key/value head serves a group of query "
              "heads), got num_heads = ",
              heads, " and num_kv_heads = ", kv_heads);
  const auto head_width = d_model / heads;
  TORCH_CHECK(options.dropout() >= 0.0 && options.dropout() < 1.0, "SelfAttention: expected dropout in [0, 1), got ",
              options.dropout());
  if (options.scale()) {
    TORCH_CHECK(std::isfinite(*options.scale()), "SelfAttention: expected a finite scale, got ", *options.scale());
  }
  if (options.rope()) {
    TORCH_CHECK(head_width % 2 == 0,
                "SelfAttention: rope needs an even head width D = d_model / num_heads, got D = ", head_width,
                " (d_model = ", d_model, ", num_heads = ", heads, ")");
    TORCH_CHECK(std::isfinite(options.rope_base()) && options.rope_base() > 1.0,
                "SelfAttention: expected rope_base > 1, got ", options.rope_base());
  }
  if (options.window()) {
    TORCH_CHECK(*options.window() >= 1, "SelfAttention: expected a window of at least 1 position, got ",
                *options.window());
    TORCH_CHECK(options.causal(),
                "SelfAttention: a sliding window (query i attends to keys i - W + 1 ... i) needs causal(true)");
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
  W_k = register_module("W_k", Linear(LinearOptions(kdim, kv_heads * head_width).bias(options.bias())));
  W_v = register_module("W_v", Linear(LinearOptions(vdim, kv_heads * head_width).bias(options.bias())));
  if (options.out_proj()) {
    W_o = register_module("W_o", Linear(LinearOptions(d_model, d_model).bias(options.bias())));
  } else {
    W_o = nullptr;
  }
  stack_projections();
}

// W_q, W_k, W_v (and their biases) side by side in one storage, each still its own parameter:
// self-attention then multiplies by all three at once without gathering them (project_self).
void SelfAttentionImpl::stack_projections() {
  const auto d_model = options.d_model();
  if (options.kdim().value_or(d_model) != d_model || options.vdim().value_or(d_model) != d_model) return;
  torch::NoGradGuard no_grad;
  const auto stack = [](std::initializer_list<torch::Tensor*> parameters) {
    std::vector<torch::Tensor> parts;
    for (auto* parameter : parameters) parts.push_back(*parameter);
    const auto joined = torch::cat(parts);
    int64_t offset = 0;
    for (auto* parameter : parameters) {
      const int64_t rows = parameter->size(0);
      parameter->set_data(joined.narrow(0, offset, rows));
      offset += rows;
    }
  };
  stack({&W_q->weight, &W_k->weight, &W_v->weight});
  if (options.bias()) stack({&W_q->bias, &W_k->bias, &W_v->bias});
}

void SelfAttentionImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(device, dtype, non_blocking);
  stack_projections();
}

void SelfAttentionImpl::to(torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(dtype, non_blocking);
  stack_projections();
}

void SelfAttentionImpl::to(torch::Device device, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
  stack_projections();
}

void SelfAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "qkv::SelfAttention(d_model=" << options.d_model() << ", num_heads=" << options.num_heads();
  if (options.num_kv_heads()) stream << ", num_kv_heads=" << *options.num_kv_heads();
  stream << ", bias=" << std::boolalpha << options.bias() << ", causal=" << options.causal();
  if (options.window()) stream << ", window=" << *options.window();
  stream
         << ", dropout=" << options.dropout() << ", scale=";
  if (options.scale()) {
    stream << *options.scale();
  } else {
    stream << "1/sqrt(" << options.d_model() / options.num_heads() << ")";
  }
  if (options.rope()) stream << ", rope_base=" << options.rope_base();
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
  TORCH_CHECK(input.dim() == rank, "SelfAttention: expected ", name, " of shape ", rank == 2 ? "(S, " : "(B, S, ",
              width, ") like the query's rank ", rank, ", got ", input.sizes());
  TORCH_CHECK(input.size(-1) == width, "SelfAttention: expected ", name, " with last dimension ", width, ", got ",
              input.sizes());
  TORCH_CHECK(input.scalar_type() == parameter.scalar_type(), "SelfAttention: expected ", name, " of dtype ",
              parameter.scalar_type(), " (the module's parameters), got ", input.scalar_type(),
              "; convert the input or the module with .to()");
  TORCH_CHECK(input.device() == parameter.device(), "SelfAttention: expected ", name, " on ", parameter.device(),
              " (the module's device), got ", input.device());
}

// Whether `parts` lie one after another in one storage, each contiguous: then `parts[0]` seen
// with the parts' total rows is all of them, stacked.
bool stacked_in_place(std::initializer_list<const torch::Tensor*> parts) {
  const auto& first = *parts.begin();
  int64_t next = first->storage_offset();
  for (const auto* part : parts) {
    if (!part->is_contiguous() || !part->is_alias_of(*first) || part->storage_offset() != next ||
        part->scalar_type() != first->scalar_type()) {
      return false;
    }
    next += part->numel();
  }
  return true;
}

// (B, N, heads · D) -> (B, heads, N, D)
torch::Tensor split_heads(const torch::Tensor& x, int64_t heads) {
  return x.view({x.size(0), x.size(1), heads, x.size(2) / heads}).transpose(1, 2);
}

// (B, H, N, D) -> (B, N, H · D)
torch::Tensor join_heads(const torch::Tensor& x) {
  return x.transpose(1, 2).reshape({x.size(0), x.size(2), x.size(1) * x.size(3)});
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> SelfAttentionImpl::project_self(const torch::Tensor& x,
                                                                                       bool decoding) const {
  const int64_t E = options.d_model();
  const int64_t KD = W_k->weight.size(0);  // Hkv · D
  const auto &wq = W_q->weight, &wk = W_k->weight, &wv = W_v->weight;
  const bool bias = options.bias();
  const auto separately = [&]() -> std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> {
    return {detail::linear(x, wq, W_q->bias), detail::linear(x, wk, W_k->bias), detail::linear(x, wv, W_v->bias)};
  };
  // One product or three by the number of rows alone, never by grad mode: a checkpointed block's
  // forward (without autograd) and its recomputation (with) must compute the same numbers. One
  // product costs gathering the matrices for autograd, which pays for itself with many rows (the
  // toy step's 2048: 4% faster) but not with the documents' 4 (4% slower), measured 2026-12-01 on
  // AMD EPYC; decoding (inference only) always takes it, on the parameters as they lie.
  constexpr int64_t kOneProductFromRows = 64;
  const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  if (!decoding && rows < kOneProductFromRows) return separately();
  const bool recorded = torch::GradMode::is_enabled() && (wq.requires_grad() || wk.requires_grad() ||
                                                          wv.requires_grad() || x.requires_grad());
  const bool stacked =
      stacked_in_place({&wq, &wk, &wv}) && (!bias || stacked_in_place({&W_q->bias, &W_k->bias, &W_v->bias}));
  torch::Tensor weight, bias_vector;  // (E + 2·KD, E), (E + 2·KD)
  if (!recorded && stacked) {
    // The parameters as reset() (or to()) laid them, side by side: no copy.
    weight = wq.detach().as_strided({E + 2 * KD, wq.size(1)}, {wq.size(1), 1});
    if (bias) bias_vector = W_q->bias.detach().as_strided({E + 2 * KD}, {1});
  } else if (!recorded && decoding) {
    // Moved apart (a clone): three products rather than gathering the matrices for every token.
    return separately();
  } else {
    // Gathered (for autograd, which hands each parameter its part of the gradient): the same
    // values in the same layout as above, so the same product and the same numbers.
    weight = torch::cat({wq, wk, wv});
    if (bias) bias_vector = torch::cat({W_q->bias, W_k->bias, W_v->bias});
  }
  const auto projected = detail::linear(x, weight, bias_vector);  // (…, E + 2·KD)
  auto parts = projected.split_with_sizes({E, KD, KD}, /*dim=*/-1);
  return {parts[0], parts[1], parts[2]};
}

ScaledDotProductAttentionOptions SelfAttentionImpl::attention_options(bool need_weights) const {
  return ScaledDotProductAttentionOptions()
      .causal(options.causal())
      .window(options.window())
      .scale(options.scale())
      .dropout(options.dropout())
      .training(is_training())
      .enable_gqa(kv_heads_of(options) != options.num_heads())
      .need_weights(need_weights)
      .backend(need_weights ? AttentionBackend::Math : options.backend());  // only math returns weights
}

SelfAttentionOutput SelfAttentionImpl::attend(const torch::Tensor& query, const torch::Tensor& key,
                                              const torch::Tensor& value, const AttentionMask& mask,
                                              bool need_weights) {
  const int64_t E = options.d_model();
  const int64_t H = options.num_heads();
  const int64_t Hkv = kv_heads_of(options);
  const int64_t kdim = options.kdim().value_or(E);
  const int64_t vdim = options.vdim().value_or(E);

  TORCH_CHECK(query.defined(), "SelfAttention: expected a defined query tensor");
  TORCH_CHECK(query.dim() == 2 || query.dim() == 3, "SelfAttention: expected query of shape (N, ", E, ") or (B, N, ", E,
              "), got ", query.sizes());
  TORCH_CHECK(query.size(-1) == E, "SelfAttention: expected query with last dimension d_model = ", E, ", got ",
              query.sizes());
  TORCH_CHECK(query.is_floating_point(), "SelfAttention: expected a floating-point query, got ", query.scalar_type());
  const auto& parameter = W_q->weight;
  check_input("query", query, query.dim(), E, parameter);
  if (key.is_same(query) && value.is_same(query)) {
    TORCH_CHECK(kdim == E && vdim == E, "SelfAttention: self-attention needs kdim == vdim == d_model = ", E,
                ", this module has kdim = ", kdim, " and vdim = ", vdim, "; pass a context");
  } else if (key.is_same(value)) {
    TORCH_CHECK(kdim == vdim,
                "SelfAttention: one context feeds both W_k and W_v, which needs kdim == vdim, this "
                "module has kdim = ",
                kdim, " and vdim = ", vdim, "; call attend(query, key, value)");
  }
  check_input("key", key, query.dim(), kdim, parameter);
  check_input("value", value, query.dim(), vdim, parameter);
  const bool batched = query.dim() == 3;
  if (batched) {
    TORCH_CHECK(key.size(0) == query.size(0) && value.size(0) == query.size(0),
                "SelfAttention: expected query, key and value with the same batch size, got query ", query.sizes(),
                ", key ", key.sizes(), ", value ", value.sizes());
  }
  TORCH_CHECK(key.size(-2) == value.size(-2),
              "SelfAttention: expected key and value with the same number of "
              "positions S, got key ",
              key.sizes(), " and value ", value.sizes());

  // Self-attention projects once with the three matrices side by side; cross-attention separately.
  const bool self = key.is_same(query) && value.is_same(query);
  torch::Tensor q_projected, k_projected, v_projected;  // (…, N, E), (…, S, Hkv·D), (…, S, Hkv·D)
  if (self) {
    std::tie(q_projected, k_projected, v_projected) = project_self(query, /*decoding=*/false);
  } else {
    q_projected = detail::linear(query, W_q->weight, W_q->bias);
    k_projected = detail::linear(key, W_k->weight, W_k->bias);
    v_projected = detail::linear(value, W_v->weight, W_v->bias);
  }

  if (H == 1 && Hkv == 1 && mask.empty() && !options.rope()) {
    // One head, no padding or general mask (the documents' module): attention runs on the
    // projections as they are, (N, E) or (B, N, E). The head split and join below are views,
    // but each is an autograd node with a backward: at the documents' sizes they cost more than
    // the attention itself.
    auto result = scaled_dot_product_attention(q_projected, k_projected, v_projected,
                                               attention_options(need_weights));  // (…, N, E)
    SelfAttentionOutput out;
    out.output = W_o ? detail::linear(result.output, W_o->weight, W_o->bias) : result.output;
    if (need_weights) out.weights = result.weights.unsqueeze(-3);  // (B, 1, N, S) / (1, N, S)
    out.backend = result.backend;
    return out;
  }

  const auto batch = [&](const torch::Tensor& t) { return batched ? t : t.unsqueeze(0); };
  const int64_t B = batched ? query.size(0) : 1;
  const int64_t N = query.size(-2);
  const int64_t S = key.size(-2);

  // Split the projections into heads of width D.
  auto q = split_heads(batch(q_projected), H);    // (B, H, N, D)
  auto k = split_heads(batch(k_projected), Hkv);  // (B, Hkv, S, D)
  auto v = split_heads(batch(v_projected), Hkv);  // (B, Hkv, S, D)
  if (options.rope()) {
    const auto D = q.size(-1);
    const auto queries = detail::rope_table(0, N, D, options.rope_base(), q.scalar_type(), q.device());
    q = detail::apply_rope(q, queries);  // (B, H, N, D)
    k = detail::apply_rope(k, S == N ? queries
                                     : detail::rope_table(0, S, D, options.rope_base(), k.scalar_type(),
                                                          k.device()));  // (B, Hkv, S, D)
  }

  detail::MaskTarget target;
  target.batched = batched, target.batch = B, target.heads = H, target.num_queries = N, target.num_keys = S;
  target.dtype = q.scalar_type(), target.device = q.device();
  // Key lengths go to the core as lengths (backends that know them skip the padding); the other
  // parts become one mask.
  auto other_parts = mask;
  other_parts.key_lengths = torch::Tensor();
  auto lengths = mask.key_lengths.defined() ? detail::checked_key_lengths(mask, target) : torch::Tensor();
  // Beside an attn_mask, a key_mask that only pads goes as lengths too: merged in, it would widen the
  // attn_mask (a learned bias (1, H, N, S), say) to (B, H, N, S), and the bias's gradient with it.
  if (mask.key_mask.defined() && mask.attn_mask.defined()) {
    if (const auto padding = detail::key_mask_as_lengths(mask.key_mask, target); padding.defined()) {
      lengths = lengths.defined() ? torch::minimum(lengths, padding) : padding;
      other_parts.key_mask = torch::Tensor();
    }
  }
  auto result = scaled_dot_product_attention(
      q, k, v,
      attention_options(need_weights).mask(detail::merge_attention_mask(other_parts, target)).key_lengths(lengths));

  auto output = join_heads(result.output);  // (B, N, E)
  if (W_o) output = detail::linear(output, W_o->weight, W_o->bias);

  SelfAttentionOutput out;
  out.output = batched ? output : output.squeeze(0);
  if (need_weights) out.weights = batched ? result.weights : result.weights.squeeze(0);  // (B, H, N, S) / (H, N, S)
  out.backend = result.backend;
  return out;
}

AttentionBackend SelfAttentionImpl::backend_for(const torch::Tensor& query, const torch::Tensor& context,
                                                const AttentionMask& mask) const {
  TORCH_CHECK(query.defined() && (query.dim() == 2 || query.dim() == 3),
              "SelfAttention::backend_for: expected query of shape (N, E) or (B, N, E), got ",
              query.defined() ? query.sizes() : c10::IntArrayRef{});
  const auto& source = context.defined() ? context : query;
  const int64_t B = query.dim() == 3 ? query.size(0) : 1;
  const int64_t D = options.d_model() / options.num_heads();
  // Stand-ins with the shapes, dtype and device of the attention core's inputs, one element each,
  // requiring grad as the projections' outputs would.
  const auto stand_in = torch::empty({1}, W_q->weight.options().requires_grad(W_q->weight.requires_grad()));
  const auto q = stand_in.expand({B, options.num_heads(), query.size(-2), D});
  const auto k = stand_in.expand({B, kv_heads_of(options), source.size(-2), D});
  auto attention = attention_options(/*need_weights=*/false);
  const auto bools = torch::TensorOptions(torch::kBool).device(query.device());
  if (mask.key_mask.defined() || mask.attn_mask.defined()) attention.mask(torch::ones({1}, bools));
  if (mask.key_lengths.defined()) attention.key_lengths(torch::zeros({B}, bools.dtype(torch::kLong)));
  return choose_backend(q, k, attention);
}

KVCache SelfAttentionImpl::make_cache(int64_t batch, int64_t capacity) const {
  const int64_t D = options.d_model() / options.num_heads();
  // With a window of W < capacity, no position ever attends further back than W - 1: a rolling
  // cache of W slots serves any length. (capacity <= W: a plain cache, whose positions are all
  // within every window anyway.)
  const bool rolls = options.window() && *options.window() < capacity;
  // In the dtype the keys will have: the parameters', or autocast's (mixed precision) where autocast
  // is on for their device when the cache is made.
  const auto storage = W_q->weight.options().dtype(projection_dtype(W_q->weight));
  KVCache cache = rolls ? KVCache::rolling(batch, kv_heads_of(options), *options.window(), D, D, storage)
                        : KVCache(batch, kv_heads_of(options), capacity, D, D, storage);
  if (options.rope()) {
    cache.rope_base_ = options.rope_base();
    if (!rolls) {  // positions 0 .. capacity - 1, computed once (a rolling cache's positions have no bound)
      auto table = detail::rope_table(/*offset=*/0, capacity, D, options.rope_base(), W_q->weight.scalar_type(),
                                      W_q->weight.device());
      cache.rope_cos_ = std::move(table.cos), cache.rope_sin_ = std::move(table.sin);
    }
  }
  return cache;
}

namespace {

// bool (T, S): new position first_query + t may attend to held position first_key + s when
// first_key + s <= first_query + t and, with a window W, first_key + s > first_query + t - W.
torch::Tensor positions_mask(int64_t first_query, int64_t queries, int64_t first_key, int64_t keys,
                             const c10::optional<int64_t>& window, const torch::Device& device) {
  const auto options = torch::TensorOptions(torch::kLong).device(device);
  const auto query_positions = torch::arange(first_query, first_query + queries, options).unsqueeze(1);  // (T, 1)
  const auto key_positions = torch::arange(first_key, first_key + keys, options).unsqueeze(0);          // (1, S)
  auto allowed = key_positions <= query_positions;
  if (window) allowed = allowed.logical_and(key_positions > query_positions - *window);
  return allowed;  // (T, S)
}

}  // namespace

torch::Tensor SelfAttentionImpl::forward_with_cache(const torch::Tensor& x, KVCache& cache) {
  const int64_t E = options.d_model();
  const int64_t H = options.num_heads();
  const int64_t Hkv = kv_heads_of(options);
  const int64_t D = E / H;
  TORCH_CHECK(options.causal(),
              "SelfAttention::forward_with_cache: expected a causal module (SelfAttentionOptions::"
              "causal(true)); cached decoding attends to past positions only, and this module is not causal");
  TORCH_CHECK(options.kdim().value_or(E) == E && options.vdim().value_or(E) == E,
              "SelfAttention::forward_with_cache: caches hold self-attention's keys, and this module is built for "
              "cross-attention (kdim = ",
              options.kdim().value_or(E), ", vdim = ", options.vdim().value_or(E), ")");
  TORCH_CHECK(x.defined() && x.dim() == 3 && x.size(-1) == E,
              "SelfAttention::forward_with_cache: expected x of shape (B, T, ", E, "), got ",
              x.defined() ? x.sizes() : c10::IntArrayRef{});
  check_input("x", x, 3, E, W_q->weight);
  TORCH_CHECK(!torch::GradMode::is_enabled() || (!x.requires_grad() && !W_q->weight.requires_grad()),
              "SelfAttention::forward_with_cache: cached decoding is for inference and keeps no autograd history of "
              "the cached keys; call it under torch::NoGradGuard");
  TORCH_CHECK(cache.kv_heads() == Hkv && cache.head_dim() == D && cache.value_dim() == D,
              "SelfAttention::forward_with_cache: the KVCache has ", cache.kv_heads(), " heads of width ",
              cache.head_dim(), ", this module ", Hkv, " of width ", D, "; make it with this module's make_cache");
  const auto module_rope = options.rope() ? c10::optional<double>(options.rope_base()) : c10::nullopt;
  TORCH_CHECK(cache.rope_base_ == module_rope,
              "SelfAttention::forward_with_cache: the KVCache holds keys rotated ",
              cache.rope_base_ ? "with rope_base " + std::to_string(*cache.rope_base_) : std::string("without RoPE"),
              ", this module rotates ",
              module_rope ? "with rope_base " + std::to_string(*module_rope) : std::string("none (rope is off)"),
              "; make the cache with this module's make_cache");
  TORCH_CHECK(!cache.rolling() || cache.window_ == options.window(),
              "SelfAttention::forward_with_cache: the KVCache rolls over a window of ", cache.window_.value_or(0),
              " positions, this module's window is ",
              options.window() ? std::to_string(*options.window()) : std::string("unset (full attention)"),
              "; make the cache with this module's make_cache");
  TORCH_CHECK(!(is_training() && options.dropout() > 0.0),
              "SelfAttention::forward_with_cache: the module is in training mode with dropout ", options.dropout(),
              "; cached decoding is inference, so call eval() first (a cache filled with dropped-out "
              "attention would not equal the full forward)");
  const int64_t B = x.size(0);
  const int64_t T = x.size(1);
  const int64_t L = cache.length();
  cache.check_append("SelfAttention::forward_with_cache", B, T, projection_dtype(W_q->weight), x.device());

  const auto [q_projected, k_projected, v_projected] = project_self(x, /*decoding=*/true);
  auto q = split_heads(q_projected, H);    // (B, H, T, D)
  auto k = split_heads(k_projected, Hkv);  // (B, Hkv, T, D)
  auto v = split_heads(v_projected, Hkv);  // (B, Hkv, T, D)
  if (options.rope()) {
    // The new positions are L .. L+T-1: their rows of the cache's tables (a rolling cache's on the spot).
    const auto table = cache.rope_cos_.defined()
                           ? detail::RopeTable{cache.rope_cos_.narrow(0, L, T), cache.rope_sin_.narrow(0, L, T)}
                           : detail::rope_table(L, T, D, options.rope_base(), q.scalar_type(), q.device());
    q = detail::apply_rope(q, table);
    k = detail::apply_rope(k, table);
  }
  // The masks below say which keys each new position attends to; the core gets no causal flag or
  // window of its own, except for a prompt into an empty cache.
  auto attention = attention_options(/*need_weights=*/false).causal(false).window(c10::nullopt);
  torch::Tensor keys, values;  // (B, Hkv, S, D): what the new positions attend to
  if (cache.rolling() && T == 1) {
    // One new position L into the ring: it takes the slot of position L - W, the one key that has
    // left its window, so every held key is attended to, in slot order (attention does not care),
    // without a mask or a copy.
    cache.write(k, v);
    keys = cache.keys_.narrow(2, 0, cache.held()), values = cache.values_.narrow(2, 0, cache.held());
  } else if (cache.rolling()) {
    // Several new positions: the held keys still inside the first one's window (at most W - 1) and
    // the new ones, oldest first, with the band by position; then the ring keeps the newest W.
    const int64_t recent = std::min(cache.held(), *options.window() - 1);
    keys = torch::cat({cache.chronological(cache.keys_, L - recent), k}, /*dim=*/2);
    values = torch::cat({cache.chronological(cache.values_, L - recent), v}, /*dim=*/2);
    attention.mask(positions_mask(L, T, L - recent, recent + T, options.window(), x.device()));  // (T, recent+T)
    cache.write(k, v);
  } else {
    std::tie(keys, values) = cache.append(k, v);  // (B, Hkv, L+T, D)
    // New position L+t attends to keys 0 .. L+t (and within its window): every cached key, and the
    // new ones up to itself (the causal mask aligned to the bottom right). One new position needs
    // no mask, unless the cache holds more than the module's window (one made by hand).
    const bool beyond_window = options.window() && L + T > *options.window();
    if (T > 1 && L == 0) {
      attention.causal(true).window(options.window());  // a prompt: plain causal, which kernels can skip blocks of
    } else if (T > 1 || beyond_window) {
      attention.mask(positions_mask(L, T, 0, L + T, options.window(), x.device()));  // (T, L+T)
    }
  }
  auto output = join_heads(scaled_dot_product_attention(q, keys, values, attention).output);  // (B, T, E)
  return W_o ? detail::linear(output, W_o->weight, W_o->bias) : output;
}

}  // namespace qkv
