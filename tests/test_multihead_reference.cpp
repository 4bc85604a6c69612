// An independent reference inside LibTorch: torch::nn::MultiheadAttention with the same weights.
// LibTorch's module takes sequence-first input (N, B, E), averages the weights over heads, and
// uses the opposite mask polarity; its float masks are used here (its bool attn_mask is
// ignored on some versions, pytorch#80494).
#include "support/fixtures.h"

#include <limits>

namespace {

constexpr int64_t kDModel = 16;
constexpr int64_t kHeads = 4;

struct Pair {
  torch::nn::MultiheadAttention reference{nullptr};
  qkv::SelfAttention module{nullptr};
};

Pair make_pair() {
  torch::manual_seed(11);
  Pair pair;
  pair.reference = torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(kDModel, kHeads));
  pair.module = qkv::SelfAttention(qkv::SelfAttentionOptions(kDModel).num_heads(kHeads).out_proj(true));
  torch::NoGradGuard no_grad;
  // Give the reference random biases too (LibTorch initialises them to zero).
  pair.reference->in_proj_bias.uniform_(-0.5, 0.5);
  pair.reference->out_proj->bias.uniform_(-0.5, 0.5);
  auto weights = pair.reference->in_proj_weight.chunk(3);
  auto biases = pair.reference->in_proj_bias.chunk(3);
  pair.module->W_q->weight.copy_(weights[0]);
  pair.module->W_k->weight.copy_(weights[1]);
  pair.module->W_v->weight.copy_(weights[2]);
  pair.module->W_q->bias.copy_(biases[0]);
  pair.module->W_k->bias.copy_(biases[1]);
  pair.module->W_v->bias.copy_(biases[2]);
  pair.module->W_o->weight.copy_(pair.reference->out_proj->weight);
  pair.module->W_o->bias.copy_(pair.reference->out_proj->bias);
  return pair;
}

// qkv's (B, N, E) batch-first layout from LibTorch's (N, B, E).
torch::Tensor batch_first(const torch::Tensor& t) { return t.transpose(0, 1); }

TEST(MultiheadAttentionReference, SelfAttention) {
  auto pair = make_pair();
  auto x = torch::randn({5, 3, kDModel});  // (N, B, E)
  auto expected = pair.reference->forward(x, x, x);
  auto got = pair.module->forward_with_weights(batch_first(x));
  EXPECT_TRUE(qkv_test::tensors_close(got.output, batch_first(std::get<0>(expected)), 1e-5));
  EXPECT_TRUE(qkv_test::tensors_close(got.weights.mean(/*dim=*/1), std::get<1>(expected), 1e-6));
}

TEST(MultiheadAttentionReference, CausalFloatMask) {
  auto pair = make_pair();
  auto x = torch::randn({6, 2, kDModel});
  auto future = torch::full({6, 6}, -std::numeric_limits<float>::infinity()).triu(/*diagonal=*/1);
  auto expected = pair.reference->forward(x, x, x, /*key_padding_mask=*/{}, /*need_weights=*/true, future);
  pair.module->options.causal(true);
  auto got = pair.module->forward_with_weights(batch_first(x));
  EXPECT_TRUE(qkv_test::tensors_close(got.output, batch_first(std::get<0>(expected)), 1e-5));
  EXPECT_TRUE(qkv_test::tensors_close(got.weights.mean(1), std::get<1>(expected), 1e-6));
  // The same float mask passed to qkv directly.
  pair.module->options.causal(false);
  auto with_mask = pair.module->forward(batch_first(x), {}, qkv::AttentionMask::from_attn_mask(future));
  EXPECT_TRUE(qkv_test::tensors_close(with_mask, batch_first(std::get<0>(expected)), 1e-5));
}

TEST(MultiheadAttentionReference, KeyPaddingWithOppositePolarity) {
  auto pair = make_pair();
  auto x = torch::randn({5, 2, kDModel});
  auto lengths = torch::tensor({5, 3}, torch::kLong);
  auto is_padding = torch::arange(5).unsqueeze(0) >= lengths.unsqueeze(1);  // (B, S): PyTorch's true = ignore
  auto expected = pair.reference->forward(x, x, x, is_padding);
  auto by_mask = pair.module->forward(batch_first(x), {}, qkv::AttentionMask::from_key_mask(is_padding.logical_not()));
  auto by_lengths = pair.module->forward(batch_first(x), {}, qkv::AttentionMask::from_lengths(lengths));
  EXPECT_TRUE(qkv_test::tensors_close(by_mask, batch_first(std::get<0>(expected)), 1e-5));
  EXPECT_TRUE(qkv_test::tensors_close(by_lengths, batch_first(std::get<0>(expected)), 1e-5));
}

TEST(MultiheadAttentionReference, CrossAttentionWithDifferentLengths) {
  auto pair = make_pair();
  auto query = torch::randn({3, 2, kDModel});    // N = 3
  auto context = torch::randn({7, 2, kDModel});  // S = 7
  auto expected = pair.reference->forward(query, context, context);
  auto got = pair.module->forward_with_weights(batch_first(query), batch_first(context));
  EXPECT_TRUE(qkv_test::tensors_close(got.output, batch_first(std::get<0>(expected)), 1e-5));
  EXPECT_TRUE(qkv_test::tensors_close(got.weights.mean(1), std::get<1>(expected), 1e-6));
}

TEST(MultiheadAttentionReference, GradientsMatch) {
  auto pair = make_pair();
  auto x = torch::randn({4, 2, kDModel});
  auto target = torch::randn({4, 2, kDModel});
  torch::mse_loss(std::get<0>(pair.reference->forward(x, x, x)), target).backward();
  torch::mse_loss(pair.module(batch_first(x)), batch_first(target)).backward();
  auto in_proj_grad = torch::cat({pair.module->W_q->weight.grad(), pair.module->W_k->weight.grad(),
                                  pair.module->W_v->weight.grad()});
  EXPECT_TRUE(qkv_test::tensors_close(in_proj_grad, pair.reference->in_proj_weight.grad(), 1e-5));
  EXPECT_TRUE(qkv_test::tensors_close(pair.module->W_o->weight.grad(), pair.reference->out_proj->weight.grad(), 1e-5));
}

}  // namespace
