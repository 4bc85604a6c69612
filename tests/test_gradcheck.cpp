// Finite differences in float64: the gradient autograd gives through qkv's module equals the
// central difference (L(θ + ε) - L(θ - ε)) / 2ε of the loss, for every parameter and input element.
#include "support/fixtures.h"

namespace {

struct Problem {
  qkv::SelfAttention module{nullptr};
  torch::Tensor query, context, target;
  qkv::AttentionMask mask;

  double loss() {
    torch::NoGradGuard no_grad;
    return torch::mse_loss(module(query, context, mask), target).item<double>();
  }
};

// Compares autograd's gradient of `tensor` with central differences, element by element. `scale`:
// the largest gradient of the problem, against which a gradient that is exactly 0 (W_k's bias) is judged.
void expect_gradient_matches_finite_differences(Problem& problem, torch::Tensor tensor, const std::string& name,
                                                double scale) {
  ASSERT_TRUE(tensor.grad().defined()) << name;
  auto analytic = tensor.grad().clone();
  auto numeric = torch::zeros_like(analytic);
  constexpr double kStep = 1e-6;
  auto flat = tensor.data().view(-1);
  auto numeric_flat = numeric.view(-1);
  for (int64_t i = 0; i < flat.numel(); ++i) {
    const double original = flat[i].item<double>();
    flat[i] = original + kStep;
    const double plus = problem.loss();
    flat[i] = original - kStep;
    const double minus = problem.loss();
    flat[i] = original;
    numeric_flat[i] = (plus - minus) / (2 * kStep);
  }
  // Central differences with step h err by about h^2 times the third derivative plus eps |f| / h, about 1e-10 here;
  // 1e-7 relative to the gradients' size leaves room for large third derivatives.
  EXPECT_TRUE(qkv_test::tensors_close(analytic, numeric, 1e-7, scale)) << "gradient of " << name;
}

void check_problem(Problem& problem) {
  problem.module->to(torch::kDouble);
  problem.query.requires_grad_(true);
  if (problem.context.defined()) problem.context.requires_grad_(true);
  torch::mse_loss(problem.module(problem.query, problem.context, problem.mask), problem.target).backward();
  double scale = qkv_test::max_abs(problem.query.grad());
  for (const auto& p : problem.module->parameters()) scale = std::max(scale, qkv_test::max_abs(p.grad()));
  for (auto& item : problem.module->named_parameters()) {
    expect_gradient_matches_finite_differences(problem, item.value(), item.key(), scale);
  }
  expect_gradient_matches_finite_differences(problem, problem.query, "query", scale);
  if (problem.context.defined()) {
    expect_gradient_matches_finite_differences(problem, problem.context, "context", scale);
  }
}

TEST(FiniteDifferences, MultiHeadCausalWithOutputMap) {
  torch::manual_seed(3);
  Problem problem;
  problem.module = qkv::SelfAttention(qkv::SelfAttentionOptions(6).num_heads(2).causal(true).out_proj(true));
  problem.query = torch::randn({2, 4, 6}, torch::kDouble);
  problem.target = torch::randn({2, 4, 6}, torch::kDouble);
  check_problem(problem);
}

TEST(FiniteDifferences, CrossAttentionWithPaddingAndAnEmptyRow) {
  torch::manual_seed(4);
  Problem problem;
  problem.module = qkv::SelfAttention(qkv::SelfAttentionOptions(4).num_heads(2).kdim(3).vdim(3));
  problem.query = torch::randn({2, 3, 4}, torch::kDouble);
  problem.context = torch::randn({2, 5, 3}, torch::kDouble);
  problem.target = torch::randn({2, 3, 4}, torch::kDouble);
  problem.mask.key_lengths = torch::tensor({5, 0}, torch::kLong);  // batch 1 has no key at all
  check_problem(problem);
}

TEST(FiniteDifferences, UnbatchedDocumentsModule) {
  torch::manual_seed(5);
  Problem problem;
  problem.module = qkv::SelfAttention(5);
  problem.query = torch::randn({3, 5}, torch::kDouble);
  problem.target = torch::randn({3, 5}, torch::kDouble);
  check_problem(problem);
}

}  // namespace
