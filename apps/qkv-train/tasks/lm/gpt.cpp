#include "tasks/lm/gpt.h"

#include "eval_mode.h"
#include "half_precision.h"
#include "layer_norm.h"
#include "linear.h"

#include <cmath>

namespace qkv_train::lm {

torch::Tensor embed(const torch::Tensor& table, const torch::Tensor& ids) {
  const bool half_on_cpu = qkv::detail::half_precision(table.scalar_type()) && table.device().is_cpu();
  if (half_on_cpu && table.requires_grad() && torch::GradMode::is_enabled()) {
    // Gathering float32 copies of half-precision numbers and rounding back is exact; autograd then
    // sums the rows' gradients in float32 and rounds the table's gradient once, on the way back
    // through the widening. Costs a float32 copy of the table per call (small: a character vocabulary).
    return torch::embedding(table.to(torch::kFloat), ids).to(table.scalar_type());
  }
  return torch::embedding(table, ids);
}

GptImpl::GptImpl(const GptOptions& options_) : options(options_) { reset(); }

void GptImpl::reset() {
  const auto E = options.d_model();
  token_embedding = register_module("token_embedding", torch::nn::Embedding(options.vocabulary(), E));
  embedding_dropout = register_module("embedding_dropout", torch::nn::Dropout(options.dropout()));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t layer = 0; layer < options.layers(); ++layer) {
    blocks->push_back(qkv::TransformerBlock(qkv::TransformerBlockOptions(E, options.heads())
                                                .num_kv_heads(options.kv_heads())
                                                .rope(true)
                                                .causal(true)
                                                .window(options.window())
                                                .checkpoint(options.checkpoint())
                                                .dropout(options.dropout())));
  }
  final_norm = register_module("final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({E})));
  if (!options.tie_weights()) {
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(E, options.vocabulary()).bias(false)));
  } else {
    head = nullptr;
  }
  // GPT-2's initialisation: N(0, 0.02) for matrices and embeddings, zero biases, and the layers
  // that end a residual branch scaled down by sqrt(2L) so the residual stream does not grow with depth.
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    const auto& name = item.key();
    auto& p = item.value();
    if (p.dim() < 2) {
      if (name.find("norm") == std::string::npos && name.find("ln_") == std::string::npos) p.zero_();
      continue;
    }
    const bool ends_residual_branch =
        name.find("mlp_proj") != std::string::npos || name.find("W_o") != std::string::npos;
    p.normal_(0.0, ends_residual_branch ? 0.02 / std::sqrt(2.0 * static_cast<double>(options.layers())) : 0.02);
  }
}

void GptImpl::check_ids(const torch::Tensor& ids, const char* caller) const {
  TORCH_CHECK(ids.defined() && ids.dim() == 2 && ids.scalar_type() == torch::kLong, caller,
              ": expected int64 token ids of shape (B, N), got ",
              ids.defined() ? c10::toString(ids.scalar_type()) : "undefined", " ",
              ids.defined() ? ids.sizes() : c10::IntArrayRef{});
}

torch::Tensor GptImpl::logits(const torch::Tensor& hidden) {
  // As the blocks' LayerNorms: rounded once in half precision (layer_norm.h).
  const auto normed = qkv::detail::layer_norm(final_norm, hidden);  // (B, N, E)
  // qkv's linear route (oneDNN's GEMM for float32 where LibTorch has it), as in the blocks.
  const auto& weight = options.tie_weights() ? token_embedding->weight : head->weight;  // (V, E)
  return qkv::detail::linear(normed, weight, torch::Tensor());                          // (B, N, V)
}

torch::Tensor GptImpl::forward(const torch::Tensor& ids) {
  check_ids(ids, "Gpt::forward");
  TORCH_CHECK(options.window() || ids.size(1) <= options.context(), "Gpt::forward: ", ids.size(1),
              " positions exceed the context of ", options.context(), " (only a model with a sliding window runs longer)");
  auto x = embedding_dropout(embed(token_embedding->weight, ids));  // (B, N, E)
  for (const auto& block : *blocks) x = block->as<qkv::TransformerBlock>()->forward(x);
  return logits(x);
}

torch::Tensor GptImpl::forward_with_cache(const torch::Tensor& ids, std::vector<qkv::KVCache>& caches) {
  check_ids(ids, "Gpt::forward_with_cache");
  TORCH_CHECK(static_cast<int64_t>(caches.size()) == options.layers(), "Gpt::forward_with_cache: expected ",
              options.layers(), " caches (one per block), got ", caches.size());
  auto x = embed(token_embedding->weight, ids);  // (B, T, E)
  for (size_t layer = 0; layer < caches.size(); ++layer) {
    x = blocks[layer]->as<qkv::TransformerBlock>()->forward_with_cache(x, caches[layer]);
  }
  return logits(x);  // (B, T, V)
}

std::vector<qkv::KVCache> GptImpl::make_caches(int64_t batch) const {
  std::vector<qkv::KVCache> caches;
  for (size_t layer = 0; layer < blocks->size(); ++layer) {
    caches.push_back(blocks->ptr<qkv::TransformerBlockImpl>(layer)->make_cache(batch, options.context()));
  }
  return caches;
}

std::vector<torch::Tensor> GptImpl::attention_weights(const torch::Tensor& ids) {
  check_ids(ids, "Gpt::attention_weights");
  torch::NoGradGuard no_grad;
  const EvalModeGuard eval_mode(*this);
  std::vector<torch::Tensor> weights;
  auto x = embed(token_embedding->weight, ids);
  for (const auto& module : *blocks) {
    auto block = module->as<qkv::TransformerBlock>();
    weights.push_back(block->attention_weights(x));  // (B, H, N, N)
    x = block->forward(x);
  }
  return weights;
}

qkv::AttentionBackend GptImpl::backend_for(const torch::Tensor& ids) const {
  const auto stand_in = torch::empty({1}, token_embedding->weight.options().requires_grad(false))
                            .expand({ids.size(0), ids.size(1), options.d_model()});
  return blocks->ptr<qkv::TransformerBlockImpl>(0)->attn->backend_for(stand_in);
}

}  // namespace qkv_train::lm
