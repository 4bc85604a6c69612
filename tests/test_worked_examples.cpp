// The documents' worked numbers (../shared/seeds), computed through qkv's functional API and
// the module. Expected values are the documents' own, to the precision they print.
#include "support/fixtures.h"

#include <nlohmann/json.hpp>

#include <fstream>

namespace {

qkv::AttentionResult attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            c10::optional<double> scale = c10::nullopt) {
  return qkv::scaled_dot_product_attention(q, k, v,
                                           qkv::ScaledDotProductAttentionOptions().scale(scale).need_weights(true));
}

// 002_*.txt, "手算一个极简例子": Q = K = I (d_k = 2), V = (10, 20)ᵀ.
TEST(WorkedExamples, TwoTokensIdentityQueriesAndKeys) {
  auto eye = torch::eye(2);
  auto v = torch::tensor({{10.0f}, {20.0f}});
  auto result = attend(eye, eye, v);
  // Rows (0.67, 0.33) and (0.33, 0.67): each token attends most to itself.
  // The documents print two decimals: an absolute error of half a unit in the last place.
  EXPECT_TRUE(qkv_test::tensors_close(result.weights, torch::tensor({{0.67f, 0.33f}, {0.33f, 0.67f}}), 0.005,
                                      /*scale=*/1.0));
  // Outputs 13.3 and 16.7.
  EXPECT_NEAR(result.output[0][0].item<double>(), 13.3, 0.05);
  EXPECT_NEAR(result.output[1][0].item<double>(), 16.7, 0.05);
  // The attention matrix: rows sum to 1, entries are non-negative.
  EXPECT_TRUE(qkv_test::tensors_close(result.weights.sum(-1), torch::ones({2}), 1e-6));
  EXPECT_GE(result.weights.min().item<double>(), 0.0);
}

// 000_*.txt, step 1: q = [1, 0, 1, 0] against three keys gives scores 2, 0, 1.
TEST(WorkedExamples, ThreeKeysScores) {
  auto q = torch::tensor({{1.0, 0.0, 1.0, 0.0}}, torch::kDouble);
  auto k = torch::tensor({{1.0, 0.0, 1.0, 0.0}, {0.0, 1.0, 0.0, 1.0}, {1.0, 0.0, 0.0, 0.0}}, torch::kDouble);
  auto v = torch::eye(3, torch::kDouble);
  // Unscaled, the weights are softmax(2, 0, 1) = e^s / (e^2 + e^0 + e^1).
  auto result = attend(q, k, v, /*scale=*/1.0);
  const double total = std::exp(2.0) + 1.0 + std::exp(1.0);
  auto expected = torch::tensor({{std::exp(2.0) / total, 1.0 / total, std::exp(1.0) / total}}, torch::kDouble);
  EXPECT_TRUE(qkv_test::tensors_close(result.weights, expected, 1e-12));
  // Default scaling divides the scores by sqrt(d_k) = 2: softmax(1, 0, 0.5).
  auto scaled = attend(q, k, v);
  const double scaled_total = std::exp(1.0) + 1.0 + std::exp(0.5);
  EXPECT_NEAR(scaled.weights[0][0].item<double>(), std::exp(1.0) / scaled_total, 1e-12);
}

// 000_*.txt, steps 3 and 4: scaled scores [1.0, 0.5, 0.0] give softmax [0.506, 0.307, 0.186],
// and weighting V1 = [0.8, 0.2], V2 = [0.3, 0.7], V3 = [0.1, 0.9] gives [0.516, 0.483].
TEST(WorkedExamples, SoftmaxAndWeightedValues) {
  auto q = torch::tensor({{1.0f, 0.0f}});
  auto k = torch::tensor({{1.0f, 0.0f}, {0.5f, 0.0f}, {0.0f, 0.0f}});  // q·k = 1.0, 0.5, 0.0
  auto v = torch::tensor({{0.8f, 0.2f}, {0.3f, 0.7f}, {0.1f, 0.9f}});
  auto result = attend(q, k, v, /*scale=*/1.0);
  EXPECT_TRUE(qkv_test::tensors_close(result.weights, torch::tensor({{0.506f, 0.307f, 0.186f}}), 0.0006,
                                      /*scale=*/1.0));  // three decimals printed
  // The documents add rounded terms (0.405 + 0.092 + 0.019 ...); the exact sum differs by < 0.0015.
  EXPECT_TRUE(qkv_test::tensors_close(result.output, torch::tensor({{0.516f, 0.483f}}), 0.0015,
                                      /*scale=*/1.0));
}

// 000_*.txt: scores [2, 1, 0] give [0.67, 0.24, 0.09]; [20, 10, 0] give [0.9999, 0.0001, 0.0000].
TEST(WorkedExamples, SoftmaxSaturation) {
  auto q = torch::tensor({{1.0}}, torch::kDouble);
  auto v = torch::eye(3, torch::kDouble);
  auto mild = attend(q, torch::tensor({{2.0}, {1.0}, {0.0}}, torch::kDouble), v, 1.0);
  EXPECT_TRUE(qkv_test::tensors_close(mild.weights, torch::tensor({{0.67, 0.24, 0.09}}, torch::kDouble), 0.005,
                                      /*scale=*/1.0));
  auto saturated = attend(q, torch::tensor({{20.0}, {10.0}, {0.0}}, torch::kDouble), v, 1.0);
  EXPECT_TRUE(qkv_test::tensors_close(saturated.weights, torch::tensor({{0.9999, 0.0001, 0.0}}, torch::kDouble), 1e-4,
                                      /*scale=*/1.0));
}

// 002_*.txt: the attention matrix is row-stochastic but not symmetric in general.
TEST(WorkedExamples, AttentionMatrixRowsSumToOneAndAreNotSymmetric) {
  torch::manual_seed(0);
  qkv::SelfAttention attention(8);
  auto result = attention->forward_with_weights(torch::randn({4, 8}));
  ASSERT_EQ(result.weights.sizes(), (std::vector<int64_t>{1, 4, 4}));
  auto matrix = result.weights[0];
  EXPECT_TRUE(qkv_test::tensors_close(matrix.sum(-1), torch::ones({4}), 1e-6));
  EXPECT_GT((matrix - matrix.t()).abs().max().item<double>(), 1e-3);
}

// 002_*.txt, "完整代码": the complete example gives the loss the Python script prints.
TEST(WorkedExamples, DocumentsCompleteExampleLoss) {
  std::ifstream file(qkv_test::data_path("seed_example.json"));
  ASSERT_TRUE(file) << "missing tests/data/seed_example.json";
  const double python_loss = nlohmann::json::parse(file).at("loss").get<double>();

  torch::manual_seed(42);
  auto x = torch::randn({4, 8});
  qkv::SelfAttention attention(8);
  auto output = attention(x);
  auto target = torch::randn_like(output);
  auto loss = torch::mse_loss(output, target);
  loss.backward();
  EXPECT_EQ(output.sizes(), x.sizes());
  EXPECT_NEAR(loss.item<double>(), python_loss, 1e-6);
  for (const auto& parameter : attention->parameters()) {
    ASSERT_TRUE(parameter.grad().defined());
    EXPECT_TRUE(parameter.grad().isfinite().all().item<bool>());
  }
}

}  // namespace
