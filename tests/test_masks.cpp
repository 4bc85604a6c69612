// Masks by behaviour: a masked key gets zero weight and its content cannot change the output;
// a query with no key left gets a zero output and finite gradients, never NaN.
#include "support/fixtures.h"

#include "mask_algebra.h"

#include <limits>

namespace {

class Masks : public ::testing::Test {
 protected:
  Masks() { torch::manual_seed(0); }
  qkv::SelfAttention module_{qkv::SelfAttentionOptions(8).num_heads(2)};
};

TEST_F(Masks, CausalRowsNeverWeighFutureKeys) {
  module_->options.causal(true);
  auto x = torch::randn({2, 6, 8});
  auto result = module_->forward_with_weights(x);
  auto future = torch::ones({6, 6}, torch::kBool).triu(/*diagonal=*/1);  // key j > query i
  EXPECT_EQ(result.weights.masked_select(future.expand_as(result.weights)).abs().max().item<float>(), 0.0f);
  EXPECT_TRUE(qkv_test::tensors_close(result.weights.sum(-1), torch::ones({2, 2, 6}), 1e-6));
  // Changing the last position's content changes no earlier output: exactly, within one backend
  // (the same arithmetic on the same earlier keys), and to float32's precision across backends.
  auto changed = x.clone();
  changed.select(1, 5).normal_();
  const auto changed_weights = module_->forward_with_weights(changed);
  EXPECT_TRUE(qkv_test::tensors_close(changed_weights.output.narrow(1, 0, 5), result.output.narrow(1, 0, 5), 0.0));
  const auto before = module_(x), after = module_(changed);  // the default backend
  EXPECT_TRUE(qkv_test::tensors_close(after.narrow(1, 0, 5), before.narrow(1, 0, 5), 0.0));
  EXPECT_TRUE(qkv_test::tensors_close(before, result.output, qkv_test::tolerance_for(torch::kFloat, 8)));
  EXPECT_FALSE(qkv_test::tensors_close(after.narrow(1, 5, 1), before.narrow(1, 5, 1), 1e-3));
}

TEST_F(Masks, CausalCrossAttentionIsTopLeftAligned) {
  module_->options.causal(true);
  auto result = module_->forward_with_weights(torch::randn({1, 3, 8}), torch::randn({1, 5, 8}));
  auto weights = result.weights[0][0];  // (N = 3, S = 5)
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(weights[i].narrow(0, i + 1, 5 - i - 1).abs().sum().item<float>(), 0.0f) << "row " << i;
    EXPECT_GT(weights[i][i].item<float>(), 0.0f) << "row " << i;
  }
}

TEST_F(Masks, PaddedKeysGetZeroWeightAndCannotChangeTheOutput) {
  auto x = torch::randn({2, 5, 8});
  auto mask = qkv::AttentionMask::from_lengths(torch::tensor({5, 3}, torch::kLong));
  auto result = module_->forward_with_weights(x, {}, mask);
  EXPECT_EQ(result.weights[1].narrow(/*dim=*/-1, 3, 2).abs().max().item<float>(), 0.0f);
  EXPECT_GT(result.weights[0].narrow(-1, 3, 2).abs().min().item<float>(), 0.0f);
  // New content in batch 1's padding keys leaves batch 1's real queries unchanged.
  auto context = x.clone();
  context[1].narrow(0, 3, 2).normal_();
  auto query = x;
  auto changed = module_->forward(query, context, mask);
  EXPECT_TRUE(qkv_test::tensors_close(changed[1], result.output[1], 1e-6));
}

TEST_F(Masks, BoolKeyMaskTrueMeansAttend) {
  auto x = torch::randn({1, 4, 8});
  auto keep = torch::tensor({{true, false, true, false}});
  auto result = module_->forward_with_weights(x, {}, qkv::AttentionMask::from_key_mask(keep));
  EXPECT_EQ(result.weights.select(-1, 1).abs().max().item<float>(), 0.0f);
  EXPECT_EQ(result.weights.select(-1, 3).abs().max().item<float>(), 0.0f);
  EXPECT_GT(result.weights.select(-1, 0).min().item<float>(), 0.0f);
}

TEST_F(Masks, FullyMaskedRowsAreZeroAndGradientsFinite) {
  auto x = torch::randn({2, 4, 8}, torch::requires_grad());
  auto attn_mask = torch::ones({2, 4, 4}, torch::kBool);
  attn_mask[0][2].fill_(false);  // query 2 of batch 0 may see no key
  qkv::AttentionMask mask = qkv::AttentionMask::from_attn_mask(attn_mask);
  mask.key_lengths = torch::tensor({4, 0}, torch::kLong);  // batch 1 has no key at all
  auto result = module_->forward_with_weights(x, {}, mask);
  EXPECT_TRUE(result.output.isfinite().all().item<bool>());
  EXPECT_EQ(result.output[0][2].abs().max().item<float>(), 0.0f);
  EXPECT_EQ(result.output[1].abs().max().item<float>(), 0.0f);
  EXPECT_EQ(result.weights[1].abs().max().item<float>(), 0.0f);
  EXPECT_GT(result.output[0][1].abs().max().item<float>(), 0.0f);
  result.output.sum().backward();
  EXPECT_TRUE(x.grad().isfinite().all().item<bool>());
  for (const auto& parameter : module_->parameters()) {
    EXPECT_TRUE(parameter.grad().isfinite().all().item<bool>());
  }
  // The same through the default (possibly fused) path.
  auto output = module_->forward(x, {}, mask);
  EXPECT_TRUE(qkv_test::tensors_close(output, result.output, 1e-5)) << "backend " << module_->backend_for(x);
}

TEST_F(Masks, FloatMaskAddsToScores) {
  // A float mask of -inf equals a false bool mask; a finite float mask shifts the scores.
  auto x = torch::randn({1, 3, 8});
  auto blocked = torch::zeros({3, 3});
  blocked[0][1] = -std::numeric_limits<float>::infinity();
  auto by_float = module_->forward_with_weights(x, {}, qkv::AttentionMask::from_attn_mask(blocked));
  EXPECT_EQ(by_float.weights[0][0][0][1].item<float>(), 0.0f);
  // Adding log(2) to one key's score doubles its odds against the others.
  auto plain = module_->forward_with_weights(x);
  auto boost = torch::zeros({3, 3});
  boost.select(1, 2).fill_(std::log(2.0f));
  auto boosted = module_->forward_with_weights(x, {}, qkv::AttentionMask::from_attn_mask(boost));
  auto odds_plain = plain.weights.select(-1, 2) / plain.weights.select(-1, 0);
  auto odds_boosted = boosted.weights.select(-1, 2) / boosted.weights.select(-1, 0);
  EXPECT_TRUE(qkv_test::tensors_close(odds_boosted, 2 * odds_plain, 1e-5));
}

TEST_F(Masks, UnbatchedInputTakesMasksWithoutBatchDimension) {
  auto x = torch::randn({4, 8});
  qkv::AttentionMask mask;
  mask.key_mask = torch::tensor({true, true, true, false});
  mask.attn_mask = torch::ones({2, 4, 4}, torch::kBool);  // (H, N, S)
  auto result = module_->forward_with_weights(x, {}, mask);
  ASSERT_EQ(result.weights.sizes(), (std::vector<int64_t>{2, 4, 4}));
  EXPECT_EQ(result.weights.select(-1, 3).abs().max().item<float>(), 0.0f);
}

TEST(MaskHelpers, LengthsAndCausal) {
  auto mask = qkv::key_mask_from_lengths(torch::tensor({2, 0, 3}), 3);
  EXPECT_TRUE(torch::equal(mask, torch::tensor({{true, true, false}, {false, false, false}, {true, true, true}})));
  auto causal = qkv::causal_mask(2, 3);
  EXPECT_TRUE(torch::equal(causal, torch::tensor({{true, false, false}, {true, true, false}})));
}

// A key_mask that only pads (true for a prefix of each row's keys) beside an attn_mask goes to the
// core as key lengths, so that merging does not widen a per-head bias to every batch element; any
// other key_mask is merged as before. The helper's answers, and the module's outputs and every
// gradient (a learned (1, H, N, S) bias's included) against the same module given that key_mask as
// key_lengths, which the core has always taken apart.
TEST(MaskHelpers, PaddingKeyMaskBesideAnAttnMaskGoesAsKeyLengths) {
  qkv::detail::MaskTarget target;
  target.batch = 3, target.heads = 2, target.num_queries = 5, target.num_keys = 4;
  const auto padding = torch::tensor({{true, true, true, true}, {true, false, false, false}, {false, false, false, false}});
  EXPECT_TRUE(qkv::detail::key_mask_as_lengths(padding, target).equal(torch::tensor({4, 1, 0}, torch::kLong)));
  auto hole = padding.clone();
  hole[0][1] = false;
  EXPECT_FALSE(qkv::detail::key_mask_as_lengths(hole, target).defined());
  EXPECT_THROW(qkv::detail::key_mask_as_lengths(padding.to(torch::kLong), target), c10::Error);

  torch::manual_seed(5);
  const int64_t B = 3, N = 6, E = 8, H = 2;
  auto module = qkv::SelfAttention(qkv::SelfAttentionOptions(E).num_heads(H));
  module->to(torch::kDouble);
  const auto lengths = torch::tensor({6, 2, 0}, torch::kLong);
  const auto x = torch::randn({B, N, E}, torch::kDouble), upstream = torch::randn({B, N, E}, torch::kDouble);
  const auto bias_values = torch::randn({1, H, N, N}, torch::kDouble);
  for (const auto backend : {qkv::AttentionBackend::Tiled, qkv::AttentionBackend::Math}) {
    module->options.backend(backend);
    auto run = [&](const qkv::AttentionMask& mask, const torch::Tensor& bias) {
      module->zero_grad();
      auto input = x.clone().requires_grad_(true);
      (module->forward(input, {}, mask) * upstream).sum().backward();
      return std::vector<torch::Tensor>{input.grad(), bias.grad(), module->W_q->weight.grad()};
    };
    auto bias_a = bias_values.clone().requires_grad_(true), bias_b = bias_values.clone().requires_grad_(true);
    qkv::AttentionMask as_key_mask, as_lengths;
    as_key_mask.key_mask = qkv::key_mask_from_lengths(lengths, N), as_key_mask.attn_mask = bias_a;
    as_lengths.key_lengths = lengths, as_lengths.attn_mask = bias_b;
    const auto tested = run(as_key_mask, bias_a), expected = run(as_lengths, bias_b);
    for (size_t i = 0; i < tested.size(); ++i) {
      EXPECT_TRUE(qkv_test::tensors_close(tested[i], expected[i], 1e-12)) << "result " << i;
    }
  }
}

}  // namespace
