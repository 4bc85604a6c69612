// Backends: the math path is the reference; every other backend must agree with it on outputs and
// every gradient, in every dtype, for every kind of mask, including rows with no key left. CUDA
// tests skip with a reason on machines without a GPU.
#include "kernels/tiled/cpu_features.h"
#include "support/fixtures.h"

#include <limits>

namespace {

using qkv::AttentionBackend;

bool cuda() { return torch::cuda::is_available(); }

TEST(Backends, TheResultSaysWhichBackendRan) {
  torch::manual_seed(0);
  qkv::SelfAttention module(qkv::SelfAttentionOptions(8).num_heads(2));
  auto x = torch::randn({2, 3, 8});
  EXPECT_EQ(module->forward_with_weights(x).backend, AttentionBackend::Math);  // only math returns weights
  const auto expected = qkv_test::default_cpu_backend();
  EXPECT_EQ(module->attend(x, x, x).backend, expected);
  EXPECT_EQ(module->backend_for(x), expected);  // the same answer without running anything
  module->options.backend(AttentionBackend::Math);
  EXPECT_EQ(module->attend(x, x, x).backend, AttentionBackend::Math);
  EXPECT_EQ(module->backend_for(x), AttentionBackend::Math);
}

TEST(Backends, DecodedTokenGoesToTheTiledKernelInEveryDtype) {
  // A decoded token (one query row, no gradient) goes to the tiled kernel, which takes it by dot
  // products (kernel.h, rows_by_dot_products): faster there than the math path's matmuls, and in
  // bfloat16 and float16 than LibTorch 2.14's fused CPU kernel (docs/PERFORMANCE.md, "float16 on the
  // CPU, and decoded tokens by dot products"); until 2026-12-07 it went to LibTorch's, except in bfloat16 on CPUs
  // without AVX-512 (ctest's routes.isa_avx2 rerun makes the CPU look so). The output is the float64
  // math path's, in the module (float32, bfloat16) and in the core (float16, whose module LibTorch
  // 1.13's CPU linear layers refuse).
  torch::manual_seed(19);
  qkv::SelfAttention module(qkv::SelfAttentionOptions(64).num_heads(4).causal(true));
  qkv::SelfAttention reference(qkv::SelfAttentionOptions(64).num_heads(4).causal(true).backend(AttentionBackend::Math));
  reference->to(torch::kDouble);
  {
    torch::NoGradGuard no_grad;
    for (auto& item : reference->named_parameters()) item.value().copy_(module->named_parameters()[item.key()]);
  }
  const auto token = torch::randn({2, 1, 64});
  torch::NoGradGuard no_grad;
  EXPECT_EQ(module->backend_for(token), AttentionBackend::Tiled);
  EXPECT_LT(qkv_test::relative_error(module(token), reference(token.to(torch::kDouble))),
            qkv_test::tolerance_for(torch::kFloat, 64));
  module->to(torch::kBFloat16);
  const auto bf16_token = token.to(torch::kBFloat16);
  EXPECT_EQ(module->backend_for(bf16_token), AttentionBackend::Tiled)
      << "usable instruction set " << qkv::kernels::tiled::isa_name(qkv::kernels::tiled::usable_isa());
  const auto want = reference(bf16_token.to(torch::kDouble));
  EXPECT_LT(qkv_test::relative_error(module(bf16_token), want), qkv_test::tolerance_for(torch::kBFloat16, 64));
  // The core in float16: one query row of 4 heads against 300 cached keys (two key blocks).
  const auto q = torch::randn({2, 4, 1, 16}, torch::kDouble), k = torch::randn({2, 4, 300, 16}, torch::kDouble);
  const auto v = torch::randn({2, 4, 300, 16}, torch::kDouble);
  const auto half = [](const torch::Tensor& t) { return t.to(torch::kHalf); };
  const auto got = qkv::scaled_dot_product_attention(half(q), half(k), half(v));
  EXPECT_EQ(got.backend, AttentionBackend::Tiled);
  const auto math = qkv::scaled_dot_product_attention(
      half(q).to(torch::kDouble), half(k).to(torch::kDouble), half(v).to(torch::kDouble),
      qkv::ScaledDotProductAttentionOptions().backend(AttentionBackend::Math));
  EXPECT_LT(qkv_test::relative_error(got.output.to(torch::kDouble), math.output),
            qkv_test::tolerance_for(torch::kHalf, 300));
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

// One comparison: a module configuration, its inputs' sizes and its mask.
struct BackendCase {
  std::string name;
  qkv::SelfAttentionOptions options;
  int64_t queries, keys;
  std::function<qkv::AttentionMask(int64_t batch, int64_t queries, int64_t keys)> mask = nullptr;
};

std::vector<BackendCase> backend_cases() {
  const auto E = 32;
  return {
      {"plain", qkv::SelfAttentionOptions(E).num_heads(4), 7, 7},
      {"causal", qkv::SelfAttentionOptions(E).num_heads(4).causal(true), 7, 7},
      {"causal_cross_n_ne_s", qkv::SelfAttentionOptions(E).num_heads(4).causal(true), 5, 9},
      {"key_lengths_with_an_empty_sequence", qkv::SelfAttentionOptions(E).num_heads(2), 6, 6,
       [](int64_t, int64_t, int64_t keys) {
         return qkv::AttentionMask::from_lengths(torch::tensor({keys, int64_t{0}}, torch::kLong));
       }},
      {"key_mask", qkv::SelfAttentionOptions(E).num_heads(2), 6, 6,
       [](int64_t, int64_t, int64_t) {
         return qkv::AttentionMask::from_key_mask(
             torch::tensor({{true, false, true, true, false, true}, {false, true, true, true, true, false}}));
       }},
      {"bool_mask_with_a_dead_row", qkv::SelfAttentionOptions(E).num_heads(4), 5, 5,
       [](int64_t batch, int64_t queries, int64_t keys) {
         auto mask = torch::rand({batch, queries, keys}) > 0.3;
         mask[0][2].fill_(false);  // query 2 of batch 0 sees no key
         return qkv::AttentionMask::from_attn_mask(mask);
       }},
      {"float_mask", qkv::SelfAttentionOptions(E).num_heads(4), 5, 8,
       [](int64_t, int64_t queries, int64_t keys) {
         auto mask = torch::randn({queries, keys});
         mask[1][3] = -std::numeric_limits<float>::infinity();
         return qkv::AttentionMask::from_attn_mask(mask);
       }},
      {"unscaled_out_proj", qkv::SelfAttentionOptions(E).num_heads(4).scale(1.0).out_proj(true), 6, 6},
      {"grouped_query", qkv::SelfAttentionOptions(E).num_heads(4).num_kv_heads(2), 6, 6},
      {"multi_query_rope_causal", qkv::SelfAttentionOptions(E).num_heads(4).num_kv_heads(1).rope(true).causal(true), 7,
       7},
  };
}

// Runs `c` with `backend` in `dtype` on `device`, and with the math backend in float64 on the CPU
// from the same weights and inputs (rounded to `dtype` first, so that both see the same numbers),
// then compares the outputs and the gradients of every parameter and input.
void expect_backend_matches_float64_math(const BackendCase& c, AttentionBackend backend, torch::Device device,
                                         torch::ScalarType dtype) {
  torch::manual_seed(1);
  const int64_t batch = 2;
  qkv::SelfAttention reference(c.options);
  reference->options.backend(AttentionBackend::Math);
  reference->to(torch::kDouble);
  auto tested = std::dynamic_pointer_cast<qkv::SelfAttentionImpl>(reference->clone());
  tested->options.backend(backend);
  tested->to(device, dtype);
  {
    torch::NoGradGuard no_grad;  // the reference takes the tested weights' rounded values
    for (auto& item : reference->named_parameters()) item.value().copy_(tested->named_parameters()[item.key()]);
  }
  const bool cross = c.queries != c.keys;
  const auto query = torch::randn({batch, c.queries, c.options.d_model()}).to(dtype);
  const auto context = torch::randn({batch, c.keys, c.options.d_model()}).to(dtype);
  const auto mask = c.mask ? c.mask(batch, c.queries, c.keys) : qkv::AttentionMask();
  auto mask_on = [](qkv::AttentionMask m, torch::Device d, torch::ScalarType t) {
    if (m.key_lengths.defined()) m.key_lengths = m.key_lengths.to(d);
    if (m.key_mask.defined()) m.key_mask = m.key_mask.to(d);
    if (m.attn_mask.defined()) m.attn_mask = m.attn_mask.is_floating_point() ? m.attn_mask.to(d, t) : m.attn_mask.to(d);
    return m;
  };

  struct Run {
    torch::Tensor output;
    std::vector<torch::Tensor> gradients;  // query, context (when cross), parameters in order
  };
  auto run = [&](qkv::SelfAttentionImpl& module, torch::Device d, torch::ScalarType t) {
    auto q = query.to(d, t).requires_grad_(true);
    auto k = context.to(d, t).requires_grad_(true);
    auto out = module.forward(q, cross ? k : torch::Tensor(), mask_on(mask, d, t));
    // A fixed upstream gradient, the same for both runs.
    torch::manual_seed(2);
    const auto upstream = torch::randn(out.sizes()).to(d, t);
    (out * upstream).sum().backward();
    Run r{out.detach().to(torch::kCPU, torch::kDouble), {q.grad().to(torch::kCPU, torch::kDouble)}};
    if (cross) r.gradients.push_back(k.grad().to(torch::kCPU, torch::kDouble));
    for (const auto& p : module.parameters()) r.gradients.push_back(p.grad().to(torch::kCPU, torch::kDouble));
    return r;
  };
  EXPECT_EQ(tested->backend_for(query.to(device, dtype), cross ? context.to(device, dtype) : torch::Tensor(),
                                mask_on(mask, device, dtype)),
            backend)
      << c.name;
  const auto expected = run(*reference, torch::kCPU, torch::kDouble);
  const auto actual = run(*tested, device, dtype);
  const double tolerance = qkv_test::tolerance_for(dtype, std::max({c.queries, c.keys, c.options.d_model()}));
  EXPECT_TRUE(actual.output.isfinite().all().item<bool>()) << c.name;
  EXPECT_TRUE(qkv_test::tensors_close(actual.output, expected.output, tolerance)) << c.name << " output";
  double scale = 0;
  for (const auto& g : expected.gradients) scale = std::max(scale, qkv_test::max_abs(g));
  for (size_t i = 0; i < expected.gradients.size(); ++i) {
    EXPECT_TRUE(actual.gradients[i].isfinite().all().item<bool>()) << c.name << " gradient " << i;
    EXPECT_TRUE(qkv_test::tensors_close(actual.gradients[i], expected.gradients[i], tolerance, scale))
        << c.name << " gradient " << i << " of " << expected.gradients.size();
  }
}

TEST(Backends, MathInEveryDtypeMatchesFloat64) {
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (const auto& c : backend_cases())
      expect_backend_matches_float64_math(c, AttentionBackend::Math, torch::kCPU, dtype);
  }
}

class FusedOnCpu : public ::testing::TestWithParam<torch::ScalarType> {};

TEST_P(FusedOnCpu, MatchesTheMathPathOnOutputsAndEveryGradient) {
  if (!qkv::fused_backend_available()) {
    GTEST_SKIP() << "the fused backend needs LibTorch >= 2.0; this build has " << TORCH_VERSION;
  }
  for (const auto& c : backend_cases()) {
    expect_backend_matches_float64_math(c, AttentionBackend::Fused, torch::kCPU, GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedOnCpu, ::testing::Values(torch::kDouble, torch::kFloat, torch::kBFloat16),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

class TiledOnCpu : public ::testing::TestWithParam<torch::ScalarType> {};

TEST_P(TiledOnCpu, MatchesTheMathPathOnOutputsAndEveryGradient) {
  for (const auto& c : backend_cases()) {
    expect_backend_matches_float64_math(c, AttentionBackend::Tiled, torch::kCPU, GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, TiledOnCpu, ::testing::Values(torch::kDouble, torch::kFloat, torch::kBFloat16),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

// Empty operands (no batch, no head, no query, no key, values of width 0) and a head width of 0
// are valid inputs: every backend, forced, gives the output and every gradient of the plain
// formula softmax(q kᵀ · scale) v in float64, with softmax over no key empty (so a query with no key
// gets 0, as a fully masked row) and, for D = 0, scores of 0 whatever the scale: the weights are
// uniform over the keys a query sees. Until 2026-12-07 the tiled kernel, forced, stopped on an
// internal assert in the backward of an empty batch or query set, and gave NaN for D = 0 (0 · 1/√0).
TEST(Backends, EmptyOperandsAndZeroHeadWidthInEveryBackend) {
  struct Shape {
    int64_t B, H, N, S, D, Dv;
  };
  const std::vector<Shape> shapes{{0, 2, 5, 6, 8, 8}, {2, 0, 5, 6, 8, 8}, {2, 2, 0, 6, 8, 8},
                                  {2, 2, 5, 0, 8, 8}, {2, 2, 5, 6, 8, 0}, {2, 2, 5, 6, 0, 8},
                                  {2, 3, 70, 300, 0, 5}};
  std::vector<AttentionBackend> backends{AttentionBackend::Math, AttentionBackend::Tiled, AttentionBackend::Auto};
  if (qkv::fused_backend_available()) backends.push_back(AttentionBackend::Fused);
  torch::manual_seed(23);
  for (const auto& s : shapes) {
    for (const bool causal : {false, true}) {
      for (const bool lengths : {false, true}) {
        const auto q = torch::randn({s.B, s.H, s.N, s.D}, torch::kDouble);
        const auto k = torch::randn({s.B, s.H, s.S, s.D}, torch::kDouble);
        const auto v = torch::randn({s.B, s.H, s.S, s.Dv}, torch::kDouble);
        const auto upstream = torch::randn({s.B, s.H, s.N, s.Dv}, torch::kDouble);
        // Key lengths S - 1 and S (at least 0) alternating over the batch.
        const auto key_lengths = (torch::full({s.B}, s.S, torch::kLong) - torch::arange(s.B) % 2).clamp_min(0);
        // The reference: plain tensor operations, the masks as -inf.
        auto allowed = torch::ones({s.B, 1, s.N, s.S}, torch::kBool);
        if (causal) allowed &= torch::ones({s.N, s.S}, torch::kBool).tril();
        if (lengths) allowed &= (torch::arange(s.S).view({1, -1}) < key_lengths.view({-1, 1})).view({s.B, 1, 1, s.S});
        const auto rq = q.clone().requires_grad_(), rk = k.clone().requires_grad_(), rv = v.clone().requires_grad_();
        const double scale = s.D > 0 ? 1.0 / std::sqrt(static_cast<double>(s.D)) : 1.0;
        auto weights = torch::softmax(torch::matmul(rq, rk.transpose(-2, -1)).mul(scale).masked_fill(
                                          allowed.logical_not(), -std::numeric_limits<double>::infinity()),
                                      -1);
        weights = weights.masked_fill(allowed.logical_not().all(-1, /*keepdim=*/true), 0.0);  // no key: 0
        const auto want = torch::matmul(weights, rv);
        want.backward(upstream);
        for (const auto backend : backends) {
          for (const auto dtype : {torch::kDouble, torch::kFloat}) {
            std::ostringstream name;
            name << "B" << s.B << " H" << s.H << " N" << s.N << " S" << s.S << " D" << s.D << " Dv" << s.Dv
                 << (causal ? " causal" : "") << (lengths ? " key_lengths" : "") << " backend "
                 << static_cast<int>(backend) << " " << dtype;
            SCOPED_TRACE(name.str());
            const auto leaf = [&](const torch::Tensor& t) { return t.to(dtype).clone().requires_grad_(); };
            auto tq = leaf(q), tk = leaf(k), tv = leaf(v);
            auto options = qkv::ScaledDotProductAttentionOptions().causal(causal).backend(backend);
            if (lengths) options.key_lengths(key_lengths);
            torch::Tensor output;
            ASSERT_NO_THROW(output = qkv::scaled_dot_product_attention(tq, tk, tv, options).output);
            ASSERT_NO_THROW(output.backward(upstream.to(dtype)));
            const double tolerance = dtype == torch::kDouble ? 1e-12 : 1e-5;
            ASSERT_EQ(output.sizes(), want.sizes());
            EXPECT_LE(qkv_test::max_abs(output.to(torch::kDouble) - want), tolerance);
            for (const auto& [got, expected] : {std::pair{tq.grad(), rq.grad()}, std::pair{tk.grad(), rk.grad()},
                                                std::pair{tv.grad(), rv.grad()}}) {
              ASSERT_TRUE(got.defined());
              ASSERT_EQ(got.sizes(), expected.sizes());
              EXPECT_LE(qkv_test::max_abs(got.to(torch::kDouble) - expected), tolerance);
            }
          }
        }
      }
    }
  }
}

// The PyTorch fixtures with the fused backend forced (the module's default picks it anyway where
// it exists; forcing it makes the test fail, not pass, if Auto ever stops choosing it).
TEST(Backends, ParityFixturesWithTheFusedBackend) {
  if (!qkv::fused_backend_available()) {
    GTEST_SKIP() << "the fused backend needs LibTorch >= 2.0; this build has " << TORCH_VERSION;
  }
  for (const std::string name : {"documents", "multihead", "multihead_f64", "causal", "padded", "cross", "out_proj",
                                 "bool_mask", "float_mask", "unscaled", "no_bias_causal_f64"}) {
    const qkv_test::Fixture fixture(name);
    auto module = fixture.make_module();
    module->options.backend(AttentionBackend::Fused);
    auto query = fixture.tensor("input.query").clone().requires_grad_(true);
    torch::Tensor context;
    if (fixture.has("input.context")) context = fixture.tensor("input.context");
    auto output = module(query, context, fixture.mask());
    const double tolerance = qkv_test::tolerance_for(query.scalar_type(), query.size(-2) * query.size(-1));
    EXPECT_TRUE(qkv_test::tensors_close(output, fixture.tensor("expected.output"), tolerance)) << name;
    torch::mse_loss(output, fixture.tensor("target")).backward();
    qkv_test::expect_gradients_match(fixture, *module, query, tolerance, name);
  }
}

TEST(BackendsCUDA, FusedMatchesMathFloat32) {
  if (!cuda()) GTEST_SKIP() << "CUDA not available";
  if (!qkv::fused_backend_available()) GTEST_SKIP() << "the fused backend needs LibTorch >= 2.0";
  for (const auto& c : backend_cases()) {
    expect_backend_matches_float64_math(c, AttentionBackend::Fused, torch::kCUDA, torch::kFloat);
  }
}

TEST(BackendsCUDA, FusedMatchesMathBFloat16) {
  if (!cuda()) GTEST_SKIP() << "CUDA not available";
  if (!qkv::fused_backend_available()) GTEST_SKIP() << "the fused backend needs LibTorch >= 2.0";
  for (const auto& c : backend_cases()) {
    expect_backend_matches_float64_math(c, AttentionBackend::Fused, torch::kCUDA, torch::kBFloat16);
  }
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
    if (mask.attn_mask.defined()) mask.attn_mask = mask.attn_mask.to(torch::kCUDA);
    auto output = module(query, context, mask);
    EXPECT_TRUE(output.is_cuda());
    const double tolerance = qkv_test::tolerance_for(query.scalar_type(), query.size(-2) * query.size(-1));
    EXPECT_TRUE(qkv_test::tensors_close(output, fixture.tensor("expected.output"), tolerance)) << name;
    torch::mse_loss(output, fixture.tensor("target").to(torch::kCUDA)).backward();
    qkv_test::expect_gradients_match(fixture, *module, query, tolerance, name);
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
