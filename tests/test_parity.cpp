// PyTorch parity: every configuration written by scripts/gen_reference.py must give PyTorch's
// output, attention weights, loss, and gradient of every parameter and input.
#include "support/fixtures.h"

namespace {

// The longest sum behind the fixtures' results: the sequence, or the model width (the projections
// and the gradients of W sum over both).
double tolerance_for(const torch::Tensor& query) {
  return qkv_test::tolerance_for(query.scalar_type(), query.size(-2) * query.size(-1));
}

// The scale against which gradients are judged: the largest of them (a gradient whose exact value
// is 0, such as W_k's bias, is noise in both implementations).
double gradient_scale(const qkv::SelfAttention& module, const torch::Tensor& query) {
  double scale = qkv_test::max_abs(query.grad());
  for (const auto& p : module->parameters()) scale = std::max(scale, qkv_test::max_abs(p.grad()));
  return scale;
}

class Parity : public ::testing::TestWithParam<std::string> {};

TEST_P(Parity, OutputWeightsLossAndEveryGradient) {
  const qkv_test::Fixture fixture(GetParam());
  auto module = fixture.make_module();
  auto query = fixture.tensor("input.query").clone().requires_grad_(true);
  torch::Tensor context;
  if (fixture.has("input.context")) context = fixture.tensor("input.context").clone().requires_grad_(true);
  const double tolerance = tolerance_for(query);

  auto result = module->forward_with_weights(query, context, fixture.mask());
  EXPECT_TRUE(qkv_test::tensors_close(result.output, fixture.tensor("expected.output"), tolerance)) << "output";
  auto expected_weights = fixture.tensor("expected.weights");
  EXPECT_TRUE(qkv_test::tensors_close(result.weights, expected_weights, tolerance)) << "weights";

  auto loss = torch::mse_loss(result.output, fixture.tensor("target"));
  EXPECT_TRUE(qkv_test::tensors_close(loss, fixture.tensor("expected.loss"), tolerance)) << "loss";
  loss.backward();
  const double scale = gradient_scale(module, query);
  for (const auto& item : module->named_parameters()) {
    EXPECT_TRUE(qkv_test::tensors_close(item.value().grad(), fixture.tensor("grad." + item.key()), tolerance, scale))
        << "gradient of " << item.key();
  }
  EXPECT_TRUE(qkv_test::tensors_close(query.grad(), fixture.tensor("grad.query"), tolerance, scale))
      << "gradient of query";
  if (context.defined()) {
    EXPECT_TRUE(qkv_test::tensors_close(context.grad(), fixture.tensor("grad.context"), tolerance, scale))
        << "gradient of context";
  }
}

TEST_P(Parity, DefaultBackendGivesTheSameOutput) {
  const qkv_test::Fixture fixture(GetParam());
  auto module = fixture.make_module();
  torch::Tensor context;
  if (fixture.has("input.context")) context = fixture.tensor("input.context");
  torch::NoGradGuard no_grad;
  auto output = module(fixture.tensor("input.query"), context, fixture.mask());
  EXPECT_TRUE(qkv_test::tensors_close(output, fixture.tensor("expected.output"), tolerance_for(output)))
      << "backend " << module->backend_for(fixture.tensor("input.query"), context, fixture.mask());
}

INSTANTIATE_TEST_SUITE_P(PyTorch, Parity,
                         ::testing::Values("documents", "multihead", "multihead_f64", "causal", "padded", "cross",
                                           "out_proj", "bool_mask", "float_mask", "unscaled", "no_bias_causal_f64"));

// The documents' module with the same seed gets the same initial weights as PyTorch's.
TEST(ParityDocuments, SameSeedSameInitialWeights) {
  const qkv_test::Fixture fixture("documents");
  torch::manual_seed(42);
  auto x = torch::randn({4, 8});
  qkv::SelfAttention module(8);
  EXPECT_TRUE(qkv_test::tensors_close(x, fixture.tensor("input.query"), 0.0));
  std::vector<std::string> keys;
  for (const auto& item : module->named_parameters()) {
    keys.push_back(item.key());
    EXPECT_TRUE(qkv_test::tensors_close(item.value(), fixture.tensor("param." + item.key()), 0.0)) << item.key();
  }
  // The Python module's state_dict() keys, in its order.
  EXPECT_EQ(keys,
            (std::vector<std::string>{"W_q.weight", "W_q.bias", "W_k.weight", "W_k.bias", "W_v.weight", "W_v.bias"}));
}

// Three Adam steps from the same weights give PyTorch's losses (llm.c's test_gpt2 in miniature).
TEST(ParityDocuments, AdamStepsFollowPyTorch) {
  const qkv_test::Fixture fixture("documents");
  auto module = fixture.make_module();
  torch::optim::Adam optimizer(module->parameters(), torch::optim::AdamOptions(fixture.real("adam.lr")));
  auto x = fixture.tensor("input.query");
  auto target = fixture.tensor("target");
  auto expected = fixture.tensor("adam.losses");
  for (int64_t step = 0; step < expected.size(0); ++step) {
    optimizer.zero_grad();
    auto loss = torch::mse_loss(module(x), target);
    loss.backward();
    optimizer.step();
    EXPECT_NEAR(loss.item<double>(), expected[step].item<double>(), 1e-6) << "step " << step;
  }
}

}  // namespace
