// qkv::TransformerBlock: a pre-norm decoder/encoder block around qkv::SelfAttention, batch-first,
// with grouped-query heads, rotary positions and the KV cache (what LibTorch's C++
// TransformerEncoderLayer lacks: batch_first, norm_first, a cache).
#pragma once

#include <qkv/kv_cache.h>
#include <qkv/masks.h>
#include <qkv/options.h>
#include <qkv/self_attention.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <ostream>
#include <vector>

namespace qkv {

/// Options of qkv::TransformerBlock.
struct TransformerBlockOptions {
  TransformerBlockOptions(int64_t d_model, int64_t num_heads) : d_model_(d_model), num_heads_(num_heads) {}

  /// Width E of the block's input and output.
  TORCH_ARG(int64_t, d_model);
  /// Query heads H of the attention; d_model must be divisible by it.
  TORCH_ARG(int64_t, num_heads);
  /// Key/value heads (grouped-query attention); unset: num_heads. See SelfAttentionOptions.
  TORCH_ARG(c10::optional<int64_t>, num_kv_heads) = c10::nullopt;
  /// Rotary position embedding of queries and keys (half-split convention; see SelfAttentionOptions).
  TORCH_ARG(bool, rope) = false;
  TORCH_ARG(double, rope_base) = 10000.0;
  /// Causal self-attention (a decoder block). Needed by forward_with_cache.
  TORCH_ARG(bool, causal) = false;
  /// Sliding-window attention of W positions (needs causal; see SelfAttentionOptions::window).
  TORCH_ARG(c10::optional<int64_t>, window) = c10::nullopt;
  /// Activation checkpointing: while training, the block keeps only its input (and its mask) for
  /// the backward and recomputes its forward there (qkv::checkpoint), replaying the forward's
  /// random draws: the same gradients for about one more forward's time, and the memory of its
  /// intermediate tensors (attention, MLP) freed right after the forward.
  TORCH_ARG(bool, checkpoint) = false;
  /// Dropout probability while training, on the attention weights and on each residual branch
  /// (after the attention's output map and after the MLP), as GPT-2 and nanoGPT.
  TORCH_ARG(double, dropout) = 0.0;
  /// Hidden width of the MLP as a multiple of d_model.
  TORCH_ARG(int64_t, mlp_ratio) = 4;
  /// Biases in the attention's and the MLP's Linear layers (the LayerNorms always have theirs).
  TORCH_ARG(bool, bias) = true;
  /// LayerNorm's epsilon.
  TORCH_ARG(double, layer_norm_eps) = 1e-5;
  /// The attention backend (see AttentionBackend).
  TORCH_ARG(AttentionBackend, backend) = AttentionBackend::Auto;
};

/// x + Dropout(Attention(LayerNorm(x))), then h + Dropout(MLP(LayerNorm(h))) with
/// MLP(h) = mlp_proj(GELU(mlp_fc(h))), GELU exact (erf), on x (B, N, E) (or unbatched (N, E)).
///
/// Parameter names (state_dict keys): ln_1.{weight,bias}, attn.W_q.*, attn.W_k.*, attn.W_v.*,
/// attn.W_o.*, ln_2.{weight,bias}, mlp_fc.*, mlp_proj.*: the names of the Python reference module
/// in scripts/gen_reference.py, so weights move between the two with load/save_state_dict.
class TransformerBlockImpl : public torch::nn::Cloneable<TransformerBlockImpl> {
 public:
  explicit TransformerBlockImpl(const TransformerBlockOptions& options);
  TransformerBlockImpl(int64_t d_model, int64_t num_heads)
      : TransformerBlockImpl(TransformerBlockOptions(d_model, num_heads)) {}

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  /// x (B, N, E) -> (B, N, E). `mask` as for SelfAttention (key padding, general masks).
  /// Callable with one argument by torch::nn::Sequential and AnyModule.
  torch::Tensor forward(const torch::Tensor& x, const AttentionMask& mask = {});

  /// The softmax weights of the block's attention on x (B, N, E): (B, H, N, N), rows summing to 1
  /// (the math path's; as SelfAttention::forward_with_weights on the block's first LayerNorm of x).
  torch::Tensor attention_weights(const torch::Tensor& x, const AttentionMask& mask = {});

  /// An empty KVCache sized for this block's attention (see SelfAttention::make_cache).
  KVCache make_cache(int64_t batch, int64_t capacity) const;

  /// Incremental decoding: x (B, T, E) holds T new positions after the cache's; returns (B, T, E),
  /// what forward over the whole sequence gives at those positions. Inference only; needs a causal block.
  torch::Tensor forward_with_cache(const torch::Tensor& x, KVCache& cache);

  TransformerBlockOptions options;

  torch::nn::LayerNorm ln_1{nullptr};
  SelfAttention attn{nullptr};
  torch::nn::LayerNorm ln_2{nullptr};
  torch::nn::Linear mlp_fc{nullptr};
  torch::nn::Linear mlp_proj{nullptr};
  torch::nn::Dropout residual_dropout{nullptr};

 protected:
  QKV_FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(AttentionMask())})

 private:
  torch::Tensor mlp(const torch::Tensor& x);
  /// The block's computation, which checkpointing runs once more in the backward.
  torch::Tensor plain_forward(const torch::Tensor& x, const AttentionMask& mask);
  /// The same with each residual branch checkpointed: what the checkpointed block recomputes.
  torch::Tensor checkpointed_branches(const torch::Tensor& x, const AttentionMask& mask);
  /// The residual branches: Dropout(Attention(LayerNorm(x))) and Dropout(MLP(LayerNorm(h))).
  torch::Tensor attention_branch(const torch::Tensor& x, const AttentionMask& mask);
  torch::Tensor mlp_branch(const torch::Tensor& h);
  static std::vector<torch::Tensor> checkpoint_inputs(const torch::Tensor& x, const AttentionMask& mask);
  static AttentionMask with_learned_mask(const AttentionMask& mask, const std::vector<torch::Tensor>& in);
};

TORCH_MODULE(TransformerBlock);

}  // namespace qkv
