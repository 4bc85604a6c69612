// TransformerBlockImpl: pre-norm attention and MLP, each on a residual branch.
//
// B = batch, N = positions, T = new positions (cached decoding), E = d_model.
#include <qkv/transformer_block.h>

#include <qkv/checkpoint.h>

#include "activation.h"
#include "layer_norm.h"
#include "linear.h"

#include <torch/torch.h>

namespace qkv {

TransformerBlockImpl::TransformerBlockImpl(const TransformerBlockOptions& options_) : options(options_) { reset(); }

void TransformerBlockImpl::reset() {
  const auto E = options.d_model();
  TORCH_CHECK(E > 0, "TransformerBlock: expected d_model > 0, got ", E);
  TORCH_CHECK(options.mlp_ratio() > 0, "TransformerBlock: expected mlp_ratio > 0, got ", options.mlp_ratio());
  TORCH_CHECK(options.dropout() >= 0.0 && options.dropout() < 1.0, "TransformerBlock: expected dropout in [0, 1), got ",
              options.dropout());
  TORCH_CHECK(options.layer_norm_eps() > 0.0 && std::isfinite(options.layer_norm_eps()),
              "TransformerBlock: expected a finite layer_norm_eps > 0, got ", options.layer_norm_eps());
  const auto hidden = options.mlp_ratio() * E;
  ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({E}).eps(options.layer_norm_eps())));
  attn = register_module("attn", SelfAttention(SelfAttentionOptions(E)
                                                   .num_heads(options.num_heads())
                                                   .num_kv_heads(options.num_kv_heads())
                                                   .rope(options.rope())
                                                   .rope_base(options.rope_base())
                                                   .causal(options.causal())
                                                   .window(options.window())
                                                   .dropout(options.dropout())
                                                   .bias(options.bias())
                                                   .out_proj(true)
                                                   .backend(options.backend())));
  ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({E}).eps(options.layer_norm_eps())));
  mlp_fc = register_module("mlp_fc", torch::nn::Linear(torch::nn::LinearOptions(E, hidden).bias(options.bias())));
  mlp_proj = register_module("mlp_proj", torch::nn::Linear(torch::nn::LinearOptions(hidden, E).bias(options.bias())));
  residual_dropout = register_module("residual_dropout", torch::nn::Dropout(options.dropout()));
}

void TransformerBlockImpl::pretty_print(std::ostream& stream) const {
  stream << "qkv::TransformerBlock(d_model=" << options.d_model() << ", num_heads=" << options.num_heads();
  if (options.num_kv_heads()) stream << ", num_kv_heads=" << *options.num_kv_heads();
  stream << std::boolalpha << ", rope=" << options.rope() << ", causal=" << options.causal();
  if (options.window()) stream << ", window=" << *options.window();
  if (options.checkpoint()) stream << ", checkpoint=true";
  stream
         << ", dropout=" << options.dropout() << ", mlp_ratio=" << options.mlp_ratio() << ", bias=" << options.bias()
         << ")";
}

torch::Tensor TransformerBlockImpl::mlp(const torch::Tensor& x) {
  return detail::linear(detail::gelu(detail::linear(x, mlp_fc->weight, mlp_fc->bias)), mlp_proj->weight,
                        mlp_proj->bias);  // (…, E) -> (…, mlp_ratio·E) -> (…, E)
}

namespace {

void check_input(const torch::Tensor& x, int64_t d_model, const char* caller) {
  TORCH_CHECK(x.defined() && (x.dim() == 2 || x.dim() == 3) && x.size(-1) == d_model, caller,
              ": expected x of shape (B, N, ", d_model, ") or (N, ", d_model, "), got ",
              x.defined() ? x.sizes() : c10::IntArrayRef{});
}

}  // namespace

torch::Tensor TransformerBlockImpl::forward(const torch::Tensor& x, const AttentionMask& mask) {
  check_input(x, options.d_model(), "TransformerBlock");
  if (!options.checkpoint()) return plain_forward(x, mask);
  // Checkpointed: the function holds the block (a shared pointer where it is owned by one, as
  // TORCH_MODULE's holder does) until the backward.
  auto owner = std::dynamic_pointer_cast<TransformerBlockImpl>(weak_from_this().lock());
  auto* block = this;
  auto function = [owner, block, mask](const std::vector<torch::Tensor>& in) {
    return (owner ? owner.get() : block)->checkpointed_branches(in[0], with_learned_mask(mask, in));
  };
  return checkpoint(function, checkpoint_inputs(x, mask), parameters());
}

namespace {

// The parameters of some of a block's layers, for a checkpoint of the branch that uses them.
std::vector<torch::Tensor> parameters_of(std::initializer_list<const torch::nn::Module*> layers) {
  std::vector<torch::Tensor> parameters;
  for (const auto* layer : layers) {
    for (const auto& p : layer->parameters()) parameters.push_back(p);
  }
  return parameters;
}

}  // namespace

// The inputs of a checkpoint whose gradients flow: x, and a floating attn_mask (a learned bias);
// the other mask parts ride along in the function.
std::vector<torch::Tensor> TransformerBlockImpl::checkpoint_inputs(const torch::Tensor& x, const AttentionMask& mask) {
  std::vector<torch::Tensor> inputs{x};
  if (mask.attn_mask.defined() && mask.attn_mask.is_floating_point()) inputs.push_back(mask.attn_mask);
  return inputs;
}

// `mask` with the learned attn_mask the checkpoint passes back in (the second input, if any).
AttentionMask TransformerBlockImpl::with_learned_mask(const AttentionMask& mask, const std::vector<torch::Tensor>& in) {
  auto replayed = mask;
  if (in.size() > 1) replayed.attn_mask = in[1];
  return replayed;
}

// The block's computation with each residual branch checkpointed once more. In the forward (no
// autograd inside the block's checkpoint) it is plain_forward. In the block's recomputation it
// keeps only x and h for the backward, and each branch is recomputed when its gradient is asked,
// so the backward holds one branch's tensors at a time instead of the whole block's. Measured with
// the language model's defaults at 4096 positions (docs/PERFORMANCE.md): peak resident memory
// 3.31 GB plain, 1.36 GB checkpointing whole blocks, 1.19 GB with the branches too, for one more
// forward of each branch (6972, 5035 and 4225 tokens/s).
torch::Tensor TransformerBlockImpl::checkpointed_branches(const torch::Tensor& x, const AttentionMask& mask) {
  auto attention = [this, mask](const std::vector<torch::Tensor>& in) {
    return attention_branch(in[0], with_learned_mask(mask, in));
  };
  const auto h = x + checkpoint(attention, checkpoint_inputs(x, mask), parameters_of({ln_1.get(), attn.get()}));
  auto mlp = [this](const std::vector<torch::Tensor>& in) { return mlp_branch(in[0]); };
  return h + checkpoint(mlp, {h}, parameters_of({ln_2.get(), mlp_fc.get(), mlp_proj.get()}));  // (B, N, E)
}

torch::Tensor TransformerBlockImpl::attention_branch(const torch::Tensor& x, const AttentionMask& mask) {
  return residual_dropout(attn(detail::layer_norm(ln_1, x), /*context=*/torch::Tensor(), mask));  // (B, N, E)
}

torch::Tensor TransformerBlockImpl::mlp_branch(const torch::Tensor& h) {
  return residual_dropout(mlp(detail::layer_norm(ln_2, h)));  // (B, N, E)
}

torch::Tensor TransformerBlockImpl::plain_forward(const torch::Tensor& x, const AttentionMask& mask) {
  const auto h = x + attention_branch(x, mask);  // (B, N, E)
  return h + mlp_branch(h);                       // (B, N, E)
}

torch::Tensor TransformerBlockImpl::attention_weights(const torch::Tensor& x, const AttentionMask& mask) {
  check_input(x, options.d_model(), "TransformerBlock::attention_weights");
  return attn->forward_with_weights(detail::layer_norm(ln_1, x), /*context=*/torch::Tensor(), mask).weights;
}

KVCache TransformerBlockImpl::make_cache(int64_t batch, int64_t capacity) const {
  return attn->make_cache(batch, capacity);
}

torch::Tensor TransformerBlockImpl::forward_with_cache(const torch::Tensor& x, KVCache& cache) {
  TORCH_CHECK(x.defined() && x.dim() == 3 && x.size(-1) == options.d_model(),
              "TransformerBlock::forward_with_cache: expected x of shape (B, T, ", options.d_model(), "), got ",
              x.defined() ? x.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(!(is_training() && options.dropout() > 0.0),
              "TransformerBlock::forward_with_cache: the block is in training mode with dropout ", options.dropout(),
              "; cached decoding is inference, so call eval() first");
  auto h = x + residual_dropout(attn->forward_with_cache(detail::layer_norm(ln_1, x), cache));  // (B, T, E)
  return h + mlp_branch(h);                                                 // (B, T, E)
}

}  // namespace qkv
