// A character-level GPT built from qkv::TransformerBlocks: token embedding, L causal pre-norm
// blocks with rotary positions (and optional grouped-query heads), a final LayerNorm and the LM
// head (optionally tied to the embedding). scripts/lm_pytorch.py is the same model in PyTorch.
//
// B = batch, N = positions, T = new positions, V = vocabulary, E = d_model, L = layers.
#pragma once

#include <qkv/qkv.h>

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace qkv_train::lm {

struct GptOptions {
  GptOptions(int64_t vocabulary, int64_t d_model, int64_t heads, int64_t layers, int64_t context)
      : vocabulary_(vocabulary), d_model_(d_model), heads_(heads), layers_(layers), context_(context) {}
  TORCH_ARG(int64_t, vocabulary);
  TORCH_ARG(int64_t, d_model);
  TORCH_ARG(int64_t, heads);
  TORCH_ARG(int64_t, layers);
  /// Positions the model is trained on, and the KV caches' capacity.
  TORCH_ARG(int64_t, context);
  TORCH_ARG(c10::optional<int64_t>, kv_heads) = c10::nullopt;
  TORCH_ARG(double, dropout) = 0.0;
  /// The LM head uses the token embedding's matrix (no head.weight parameter then).
  TORCH_ARG(bool, tie_weights) = false;
  /// Sliding-window attention of W positions in every block: the model then runs on sequences of
  /// any length (RoPE has no bound) and its KV caches roll (W slots each).
  TORCH_ARG(c10::optional<int64_t>, window) = c10::nullopt;
  /// Activation checkpointing of every block (TransformerBlockOptions::checkpoint).
  TORCH_ARG(bool, checkpoint) = false;
};

class GptImpl : public torch::nn::Cloneable<GptImpl> {
 public:
  explicit GptImpl(const GptOptions& options);
  void reset() override;

  /// ids (B, N) -> logits (B, N, V); N <= context unless the model has a sliding window.
  torch::Tensor forward(const torch::Tensor& ids);
  /// T new ids (B, T) after the caches' positions -> their logits (B, T, V); one cache per block.
  torch::Tensor forward_with_cache(const torch::Tensor& ids, std::vector<qkv::KVCache>& caches);
  /// One empty cache per block, each of capacity `context` (rolling, of `window` slots, with a window).
  std::vector<qkv::KVCache> make_caches(int64_t batch) const;
  /// The attention weights of every block on ids (B, N): L tensors (B, H, N, N). Eval mode, no gradients.
  std::vector<torch::Tensor> attention_weights(const torch::Tensor& ids);
  /// The attention backend the blocks run on for ids like these.
  qkv::AttentionBackend backend_for(const torch::Tensor& ids) const;

  GptOptions options;
  torch::nn::Embedding token_embedding{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm final_norm{nullptr};
  torch::nn::Linear head{nullptr};  // unset when tie_weights
  torch::nn::Dropout embedding_dropout{nullptr};

 private:
  torch::Tensor logits(const torch::Tensor& hidden);
  void check_ids(const torch::Tensor& ids, const char* caller) const;
};

TORCH_MODULE(Gpt);

/// The rows of `table` (V, E) at `ids` (any shape) -> (ids..., E), as torch::embedding. For a
/// bfloat16 or float16 table on the CPU that autograd tracks, the table's gradient is summed in
/// float32 and rounded once: LibTorch's own CPU backward adds each token's gradient rows in the
/// table's dtype, one rounding per occurrence (2026-12-05, LibTorch 1.13 and 2.14 alike: with
/// 8192 ids over 65 tokens, bfloat16 sums off by up to 0.92 where they reach 45).
torch::Tensor embed(const torch::Tensor& table, const torch::Tensor& ids);

}  // namespace qkv_train::lm
