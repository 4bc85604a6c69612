// Finite differences in float64: the gradient autograd gives through qkv's module equals the
// central difference (L(θ + ε) - L(θ - ε)) / 2ε of the loss, for every parameter and input element.
#include "support/fixtures.h"

namespace {

// A module, its inputs and a target: the loss is the MSE of the module's output.
struct Problem {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor& query, const torch::Tensor& context)> run;
  torch::Tensor query, context, target;

  double loss() {
    torch::NoGradGuard no_grad;
    return torch::mse_loss(run(query, context), target).item<double>();
  }
};

Problem attention_problem(qkv::SelfAttention attention, const qkv::AttentionMask& mask = {}) {
  Problem problem;
  problem.module = attention.ptr();
  problem.run = [attention, mask](const torch::Tensor& query, const torch::Tensor& context) mutable {
    return attention(query, context, mask);
  };
  return problem;
}

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
  torch::mse_loss(problem.run(problem.query, problem.context), problem.target).backward();
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
  Problem problem =
      attention_problem(qkv::SelfAttention(qkv::SelfAttentionOptions(6).num_heads(2).causal(true).out_proj(true)));
  problem.query = torch::randn({2, 4, 6}, torch::kDouble);
  problem.target = torch::randn({2, 4, 6}, torch::kDouble);
  check_problem(problem);
}

TEST(FiniteDifferences, CrossAttentionWithPaddingAndAnEmptyRow) {
  torch::manual_seed(4);
  // Batch 1 has no key at all.
  Problem problem = attention_problem(qkv::SelfAttention(qkv::SelfAttentionOptions(4).num_heads(2).kdim(3).vdim(3)),
                                      qkv::AttentionMask::from_lengths(torch::tensor({5, 0}, torch::kLong)));
  problem.query = torch::randn({2, 3, 4}, torch::kDouble);
  problem.context = torch::randn({2, 5, 3}, torch::kDouble);
  problem.target = torch::randn({2, 3, 4}, torch::kDouble);
  check_problem(problem);
}

TEST(FiniteDifferences, UnbatchedDocumentsModule) {
  torch::manual_seed(5);
  Problem problem = attention_problem(qkv::SelfAttention(5));
  problem.query = torch::randn({3, 5}, torch::kDouble);
  problem.target = torch::randn({3, 5}, torch::kDouble);
  check_problem(problem);
}

TEST(FiniteDifferences, GroupedQueryHeadsWithRotaryPositions) {
  torch::manual_seed(6);
  Problem problem = attention_problem(qkv::SelfAttention(
      qkv::SelfAttentionOptions(8).num_heads(4).num_kv_heads(2).rope(true).causal(true).out_proj(true)));
  problem.query = torch::randn({2, 5, 8}, torch::kDouble);
  problem.target = torch::randn({2, 5, 8}, torch::kDouble);
  check_problem(problem);
}

TEST(FiniteDifferences, MultiQueryHeadsWithoutRotaryPositions) {
  torch::manual_seed(7);
  Problem problem = attention_problem(qkv::SelfAttention(qkv::SelfAttentionOptions(8).num_heads(4).num_kv_heads(1)));
  problem.query = torch::randn({1, 4, 8}, torch::kDouble);
  problem.target = torch::randn({1, 4, 8}, torch::kDouble);
  check_problem(problem);
}

TEST(FiniteDifferences, TransformerBlockWithGroupedQueryHeadsAndRotaryPositions) {
  torch::manual_seed(8);
  qkv::TransformerBlock block(qkv::TransformerBlockOptions(8, 4).num_kv_heads(2).rope(true).causal(true).mlp_ratio(2));
  Problem problem;
  problem.module = block.ptr();
  problem.run = [block](const torch::Tensor& query, const torch::Tensor&) mutable { return block(query); };
  problem.query = torch::randn({2, 4, 8}, torch::kDouble);
  problem.target = torch::randn({2, 4, 8}, torch::kDouble);
  check_problem(problem);
}

}  // namespace
