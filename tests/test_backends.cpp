// Backends: the math path is the reference; the fused path (LibTorch >= 2.0) must agree with it
// on outputs and gradients; CUDA runs must agree with the CPU fixtures. CUDA tests skip with a
// reason on machines without a GPU.
#include "support/fixtures.h"

namespace {

using qkv::AttentionBackend;

bool cuda() { return torch::cuda::is_available(); }

TEST(Backends, WeightsComeFromTheMathBackend) {
  torch::manual_seed(0);
  qkv::SelfAttention module(qkv::SelfAttentionOptions(8).num_heads(2));
  auto result = module->forward_with_weights(torch::randn({2, 3, 8}));
  EXPECT_EQ(result.backend, AttentionBackend::Math);
  EXPECT_EQ(module->last_backend(), AttentionBackend::Math);
}

TEST(Backends, AutoReportsWhatRan) {
  torch::manual_seed(0);
  qkv::SelfAttention module(qkv::SelfAttentionOptions(8).num_heads(2));
  EXPECT_EQ(module->last_backend(), AttentionBackend::Auto);
  module(torch::randn({2, 3, 8}));
  EXPECT_EQ(module->last_backend(), qkv::fused_backend_available() ? AttentionBackend::Fused : AttentionBackend::Math);
  module->options.backend(AttentionBackend::Math);
  module(torch::randn({2, 3, 8}));
  EXPECT_EQ(module->last_backend(), AttentionBackend::Math);
}

TEST(Backends, DropoutOnlyWhileTraining) {
  torch::manual_seed(0);
  qkv::SelfAttention with_dropout(qkv::SelfAttentionOptions(8).num_heads(2).dropout(0.5));
  qkv::SelfAttention without(qkv::SelfAttentionOptions(8).num_heads(2));
  {
    torch::NoGradGuard no_grad;
    for (auto& item : without->named_parameters()) item.value().copy_(with_dropout->named_parameters()[item.key()]);
  }
  auto x = torch::randn({2, 5, 8});
  with_dropout->eval();
  EXPECT_TRUE(qkv_test::tensors_close(with_dropout(x), without(x), 0.0));
  with_dropout->train();
  auto trained = with_dropout->forward_with_weights(x);
  EXPECT_FALSE(qkv_test::tensors_close(trained.output, without(x), 1e-3));
  // The returned weights are the softmax before dropout: rows still sum to 1.
  EXPECT_TRUE(qkv_test::tensors_close(trained.weights.sum(-1), torch::ones({2, 2, 5}), 1e-6));
}

// Inputs for comparing two backends on one device: several mask situations.
struct BackendCase {
  std::string name;
  qkv::SelfAttentionOptions options;
  int64_t queries, keys;
  bool lengths;
};

std::vector<BackendCase> backend_cases() {
  return {
      {"plain", qkv::SelfAttentionOptions(32).num_heads(4), 7, 7, false},
      {"causal", qkv::SelfAttentionOptions(32).num_heads(4).causal(true), 7, 7, false},
      {"causal_cross", qkv::SelfAttentionOptions(32).num_heads(4).causal(true), 5, 9, false},
      {"padded_with_empty_row", qkv::SelfAttentionOptions(32).num_heads(2), 6, 6, true},
      {"unscaled_out_proj", qkv::SelfAttentionOptions(32).num_heads(4).scale(1.0).out_proj(true), 6, 6, false},
  };
}

// Runs `c` with the math and the fused backend on `device` in `dtype` and compares outputs and
// gradients of parameters and inputs.
void expect_fused_matches_math(const BackendCase& c, torch::Device device, torch::ScalarType dtype,
                               double tolerance) {
  torch::manual_seed(1);
  auto options = c.options;
  qkv::SelfAttention math(options.backend(AttentionBackend::Math));
  math->to(device, dtype);
  auto fused = std::dynamic_pointer_cast<qkv::SelfAttentionImpl>(math->clone(device));
  fused->options.backend(AttentionBackend::Fused);
  auto query = torch::randn({2, c.queries, 32}, torch::TensorOptions(dtype).device(device));
  auto context = torch::randn({2, c.keys, 32}, torch::TensorOptions(dtype).device(device));
  qkv::AttentionMask mask;
  if (c.lengths) mask.key_lengths = torch::tensor({c.keys, int64_t{0}}, torch::TensorOptions(torch::kLong).device(device));

  std::vector<torch::Tensor> outputs, gradients;
  for (auto* module : {math.get(), fused.get()}) {
    auto q = query.clone().requires_grad_(true);
    auto out = module->forward(q, c.queries == c.keys ? torch::Tensor() : context, mask);
    EXPECT_EQ(module->last_backend(), module->options.backend()) << c.name;
    out.pow(2).sum().backward();
    outputs.push_back(out);
    gradients.push_back(q.grad());
    for (const auto& p : module->parameters()) gradients.push_back(p.grad());
  }
  EXPECT_TRUE(qkv_test::tensors_close(outputs[1], outputs[0], tolerance)) << c.name << " output";
  const size_t half = gradients.size() / 2;
  for (size_t i = 0; i < half; ++i) {
    EXPECT_TRUE(qkv_test::tensors_close(gradients[half + i], gradients[i], tolerance * 10)) << c.name << " grad " << i;
  }
}

TEST(Backends, FusedMatchesMathOnCpu) {
  if (!qkv::fused_backend_available()) {
    GTEST_SKIP() << "the fused backend needs LibTorch >= 2.0; this build has " << TORCH_VERSION;
  }
  for (const auto& c : backend_cases()) expect_fused_matches_math(c, torch::kCPU, torch::kFloat, 1e-5);
}

TEST(BackendsCUDA, FusedMatchesMathFloat32) {
  if (!cuda()) GTEST_SKIP() << "CUDA not available";
  if (!qkv::fused_backend_available()) GTEST_SKIP() << "the fused backend needs LibTorch >= 2.0";
  for (const auto& c : backend_cases()) expect_fused_matches_math(c, torch::kCUDA, torch::kFloat, 1e-4);
}

TEST(BackendsCUDA, FusedMatchesMathBFloat16) {
  if (!cuda()) GTEST_SKIP() << "CUDA not available";
  if (!qkv::fused_backend_available()) GTEST_SKIP() << "the fused backend needs LibTorch >= 2.0";
  for (const auto& c : backend_cases()) expect_fused_matches_math(c, torch::kCUDA, torch::kBFloat16, 3e-2);
}

// The PyTorch fixtures, run on the GPU.
TEST(BackendsCUDA, ParityFixturesOnGpu) {
  if (!cuda()) GTEST_SKIP() << "CUDA not available";
  for (const std::string name : {"multihead", "padded", "cross", "out_proj", "no_bias_causal_f64"}) {
    const qkv_test::Fixture fixture(name);
    auto module = fixture.make_module();
    module->to(torch::kCUDA);
    auto query = fixture.tensor("input.query").to(torch::kCUDA).requires_grad_(true);
    torch::Tensor context;
    if (fixture.has("input.context")) context = fixture.tensor("input.context").to(torch::kCUDA);
    auto mask = fixture.mask();
    if (mask.key_lengths.defined()) mask.key_lengths = mask.key_lengths.to(torch::kCUDA);
    auto output = module(query, context, mask);
    EXPECT_TRUE(output.is_cuda());
    const double tolerance = output.scalar_type() == torch::kDouble ? 1e-10 : 1e-4;
    EXPECT_TRUE(qkv_test::tensors_close(output, fixture.tensor("expected.output"), tolerance)) << name;
    torch::mse_loss(output, fixture.tensor("target").to(torch::kCUDA)).backward();
    EXPECT_TRUE(qkv_test::tensors_close(query.grad(), fixture.tensor("grad.query"), tolerance * 10)) << name;
    for (const auto& item : module->named_parameters()) {
      EXPECT_TRUE(qkv_test::tensors_close(item.value().grad(), fixture.tensor("grad." + item.key()), tolerance * 10))
          << name << " " << item.key();
    }
  }
}

TEST(BackendsCUDA, TrainingStepsLowerTheLossInBFloat16) {
  if (!cuda()) GTEST_SKIP() << "CUDA not available";
  torch::manual_seed(2);
  qkv::SelfAttention module(qkv::SelfAttentionOptions(64).num_heads(4).causal(true));
  module->to(torch::kCUDA, torch::kBFloat16);
  auto x = torch::randn({4, 32, 64}, torch::TensorOptions(torch::kBFloat16).device(torch::kCUDA));
  auto target = x.flip(1);
  torch::optim::Adam optimizer(module->parameters(), torch::optim::AdamOptions(1e-2));
  double first = 0.0, last = 0.0;
  for (int step = 0; step < 30; ++step) {
    optimizer.zero_grad();
    auto loss = torch::mse_loss(module(x).to(torch::kFloat), target.to(torch::kFloat));
    loss.backward();
    optimizer.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_TRUE(std::isfinite(last));
  EXPECT_LT(last, first);
}

}  // namespace
