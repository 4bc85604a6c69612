// Mixed precision: qkv::AutocastGuard (LibTorch's autocast state for a scope) and qkv::GradScaler
// (torch.amp.GradScaler's loss scaling) on the CPU and, where there is one, on a CUDA device, against
// what they must do by definition.
#include "support/fixtures.h"

#include <gmock/gmock.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using ::testing::HasSubstr;

TEST(AutocastGuard, LinearLayersComputeInBFloat16InsideAndTheStateIsRestoredAfter) {
  torch::nn::Linear linear(8, 8);
  const auto x = torch::randn({4, 8});
  {
    const qkv::AutocastGuard outer(torch::kCPU, torch::kBFloat16);
    EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
    {
      const qkv::AutocastGuard off(torch::kCPU, torch::kBFloat16, /*enabled=*/false);  // a float32 island
      EXPECT_EQ(linear(x).scalar_type(), torch::kFloat);
    }
    EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16) << "the inner guard restored the outer state";
  }
  EXPECT_EQ(linear(x).scalar_type(), torch::kFloat);
  EXPECT_EQ(linear->weight.scalar_type(), torch::kFloat) << "the weights stay float32";
}

// The attention inside autocast: q, k, v come out of the projections in bfloat16 and the core
// keeps its softmax statistics in float32; the result is close to the float32 module's.
TEST(AutocastGuard, SelfAttentionUnderAutocastIsCloseToFloat32) {
  torch::manual_seed(2);
  qkv::SelfAttention attention(qkv::SelfAttentionOptions(64).num_heads(4).causal(true));
  const auto x = torch::randn({2, 40, 64});
  const auto reference = attention(x);
  torch::Tensor mixed;
  {
    const qkv::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
    mixed = attention(x);
  }
  EXPECT_EQ(mixed.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(qkv_test::tensors_close(mixed.to(torch::kFloat), reference,
                                      qkv_test::tolerance_for(torch::kBFloat16, 64)));
}

// The math path computes bfloat16 inputs in float32 and rounds once at the end (src/kernels/math.cpp),
// and it must do so inside an autocast scope too, where LibTorch's CPU autocast would otherwise
// turn its float32 products back into bfloat16 ones: on LibTorch 1.13 the output and every gradient
// here were then off by 7 to 60 times one rounding, and the backward of some operands failed
// outright ("could not execute a primitive", 1.13's oneDNN: ModuleAgrees' seed 9249, grouped heads
// of width 1 with a learned mask). Against softmax(q kᵀ/√d + bias) v and its gradients in float64
// from the same bfloat16 numbers, each within one bfloat16 rounding of its own size.
TEST(AutocastGuard, TheMathPathMultipliesInFloat32InsideAnAutocastScope) {
  torch::manual_seed(9);
  struct Shape {
    int64_t B, H, Hkv, N, S, D;
  };
  for (const auto& shape : {Shape{1, 2, 2, 8, 1000, 16}, Shape{1, 6, 2, 257, 7, 1}}) {
    const auto leaf = [](std::vector<int64_t> sizes) {
      return torch::randn(sizes).to(torch::kBFloat16).requires_grad_(true);
    };
    const auto q = leaf({shape.B, shape.H, shape.N, shape.D});
    const auto k = leaf({shape.B, shape.Hkv, shape.S, shape.D});
    const auto v = leaf({shape.B, shape.Hkv, shape.S, shape.D});
    const auto bias = torch::randn({shape.N, shape.S}).requires_grad_(true);  // a learned float32 mask
    const auto grad_out = torch::randn({shape.B, shape.H, shape.N, shape.D}).to(torch::kBFloat16);
    torch::Tensor out;
    {
      const qkv::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      out = qkv::scaled_dot_product_attention(q, k, v,
                                              qkv::ScaledDotProductAttentionOptions()
                                                  .mask(bias)
                                                  .enable_gqa(true)
                                                  .backend(qkv::AttentionBackend::Math))
                .output;
    }
    ASSERT_EQ(out.scalar_type(), torch::kBFloat16);
    out.backward(grad_out);

    // The reference in float64, written out here: each key/value head repeated for its G query heads.
    const int64_t G = shape.H / shape.Hkv;
    const auto wide = [](const torch::Tensor& t) { return t.detach().to(torch::kDouble).requires_grad_(true); };
    const auto q64 = wide(q), k64 = wide(k), v64 = wide(v), bias64 = wide(bias);
    const auto scores = torch::matmul(q64, k64.repeat_interleave(G, 1).transpose(-2, -1)) /
                            std::sqrt(static_cast<double>(shape.D)) +
                        bias64;
    const auto expected = torch::matmul(torch::softmax(scores, -1), v64.repeat_interleave(G, 1));
    expected.backward(grad_out.to(torch::kDouble));

    const double one_rounding = std::ldexp(1.0, -8);  // bfloat16's unit roundoff: one rounding's worst relative error
    const std::string what = "B " + std::to_string(shape.B) + " H " + std::to_string(shape.H) + " Hkv " +
                             std::to_string(shape.Hkv) + " N " + std::to_string(shape.N) + " S " +
                             std::to_string(shape.S) + " D " + std::to_string(shape.D);
    for (const auto& [name, actual, reference] :
         std::vector<std::tuple<std::string, torch::Tensor, torch::Tensor>>{{"output", out, expected},
                                                                            {"dq", q.grad(), q64.grad()},
                                                                            {"dk", k.grad(), k64.grad()},
                                                                            {"dv", v.grad(), v64.grad()},
                                                                            {"dbias", bias.grad(), bias64.grad()}}) {
      EXPECT_TRUE(qkv_test::within_one_rounding(actual, reference, one_rounding)) << what << ": " << name;
    }
  }
}

// A cache made inside an autocast scope holds the keys in the autocast dtype; decoding through it
// equals the full causal forward under the same autocast.
TEST(AutocastGuard, CachedDecodingUnderAutocastEqualsTheFullForward) {
  torch::manual_seed(3);
  qkv::TransformerBlock block(qkv::TransformerBlockOptions(32, 4).num_kv_heads(2).rope(true).causal(true));
  block->eval();
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({2, 12, 32});
  const qkv::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
  const auto full = block(x);
  auto cache = block->make_cache(/*batch=*/2, /*capacity=*/12);
  EXPECT_EQ(cache.dtype(), torch::kBFloat16);
  std::vector<torch::Tensor> pieces{block->forward_with_cache(x.narrow(1, 0, 5), cache)};
  for (int64_t t = 5; t < 12; ++t) pieces.push_back(block->forward_with_cache(x.narrow(1, t, 1), cache));
  EXPECT_TRUE(qkv_test::tensors_close(torch::cat(pieces, 1).to(torch::kFloat), full.to(torch::kFloat),
                                      qkv_test::tolerance_for(torch::kBFloat16, 32)));
}

TEST(AutocastGuard, UnsupportedCombinationsAreRefusedNamingThem) {
  EXPECT_THAT([] { qkv::AutocastGuard guard(torch::kCPU, torch::kFloat); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("does not take Float")));
  if (!qkv::AutocastGuard::supports(torch::kCPU, torch::kHalf)) {  // LibTorch 1.13
    EXPECT_THAT([] { qkv::AutocastGuard guard(torch::kCPU, torch::kHalf); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr("float16 needs LibTorch 2.x")));
  } else {
    torch::nn::Linear linear(4, 4);
    const qkv::AutocastGuard guard(torch::kCPU, torch::kHalf);
    EXPECT_EQ(linear(torch::randn({2, 4})).scalar_type(), torch::kHalf);
  }
}

// On CUDA both dtypes are autocast's; the guard sets CUDA's state and leaves the CPU's alone.
TEST(AutocastGuard, CudaLinearLayersComputeInTheGuardsDtypeAndTheCpuStateStays) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "CUDA not available";
  torch::nn::Linear linear(8, 8);
  linear->to(torch::kCUDA);
  const auto x = torch::randn({4, 8}, torch::kCUDA);
  for (const auto dtype : {torch::kHalf, torch::kBFloat16}) {
    ASSERT_TRUE(qkv::AutocastGuard::supports(torch::kCUDA, dtype)) << dtype;
    {
      const qkv::AutocastGuard autocast(torch::kCUDA, dtype);
      EXPECT_EQ(linear(x).scalar_type(), dtype);
      EXPECT_EQ(torch::nn::Linear(8, 8)(torch::randn({4, 8})).scalar_type(), torch::kFloat)
          << "a CUDA guard made the CPU's products " << dtype;
    }
    EXPECT_EQ(linear(x).scalar_type(), torch::kFloat) << "the state after the guard";
  }
  EXPECT_EQ(linear->weight.scalar_type(), torch::kFloat);
}

// The module under CUDA autocast (float16 and bfloat16): output and every gradient close to the
// float32 module's on the same device, within the half type's tolerance for the longest sum.
TEST(AutocastGuard, CudaSelfAttentionForwardAndGradientsAreCloseToFloat32) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "CUDA not available";
  torch::manual_seed(2);
  qkv::SelfAttention attention(qkv::SelfAttentionOptions(64).num_heads(4).causal(true));
  attention->to(torch::kCUDA);
  const auto x = torch::randn({2, 40, 64}, torch::kCUDA);
  const auto target = torch::randn({2, 40, 64}, torch::kCUDA);
  auto run = [&](c10::optional<torch::ScalarType> dtype) {
    const auto input = x.clone().requires_grad_(true);
    attention->zero_grad();
    torch::Tensor output;
    {
      const qkv::AutocastGuard autocast(torch::kCUDA, dtype.value_or(torch::kHalf), dtype.has_value());
      output = attention(input);
    }
    torch::mse_loss(output.to(torch::kFloat), target).backward();
    std::vector<torch::Tensor> results{output.detach().to(torch::kFloat), input.grad()};
    for (const auto& parameter : attention->parameters()) results.push_back(parameter.grad().clone());
    return std::make_pair(output.scalar_type(), results);
  };
  const auto [reference_dtype, reference] = run(c10::nullopt);
  EXPECT_EQ(reference_dtype, torch::kFloat);
  double parameter_scale = 0.0;
  for (size_t i = 2; i < reference.size(); ++i) parameter_scale = std::max(parameter_scale, qkv_test::max_abs(reference[i]));
  for (const auto dtype : {torch::kHalf, torch::kBFloat16}) {
    const auto [mixed_dtype, mixed] = run(dtype);
    EXPECT_EQ(mixed_dtype, dtype);
    ASSERT_EQ(mixed.size(), reference.size());
    for (size_t i = 0; i < mixed.size(); ++i) {
      // A parameter's gradient is judged against the largest of them (the key bias's exact
      // gradient is 0: softmax ignores it, and what comes out is rounding noise).
      EXPECT_TRUE(qkv_test::tensors_close(mixed[i].to(torch::kFloat), reference[i],
                                          qkv_test::tolerance_for(dtype, 2 * 40 * 64),
                                          i >= 2 ? parameter_scale : 0.0))
          << dtype << ", result " << i << " (0 the output, 1 the input's gradient, then the parameters')";
    }
  }
}

// A tiny model and an SGD optimizer for the scaler's tests, on the CPU or a CUDA device.
struct ScalerProblem {
  torch::Device device;
  torch::nn::Linear model{4, 3};
  std::unique_ptr<torch::optim::SGD> optimizer;
  explicit ScalerProblem(torch::Device on = torch::kCPU) : device(on) {
    torch::manual_seed(5);
    model = torch::nn::Linear(4, 3);
    model->to(device);
    optimizer = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
  }
  torch::Tensor loss() { return model(torch::ones({2, 4}, device)).pow(2).sum(); }
};

// `archive` written to bytes and read back, as a checkpoint file is.
torch::serialize::InputArchive through_bytes(torch::serialize::OutputArchive& archive) {
  std::ostringstream bytes;
  archive.save_to(bytes);
  std::istringstream stream(bytes.str());
  torch::serialize::InputArchive in;
  in.load_from(stream);
  return in;
}

// An inf in the first parameter's gradient, or a NaN in the last one's after finite ones (every
// gradient's verdict counts), skips the step and halves the scale; the next good step's unscaled
// gradients are the true ones.
TEST(GradScaler, AStepWithAnInfOrNanGradientIsSkippedAndTheScaleHalves) {
  ScalerProblem p;
  qkv::GradScaler scaler(qkv::GradScalerOptions().init_scale(1024.0));
  const std::vector<std::pair<std::string, std::function<void()>>> injections{
      {"inf in weight", [&] { p.model->weight.mutable_grad()[0][0] = std::numeric_limits<float>::infinity(); }},
      {"NaN in bias", [&] { p.model->bias.mutable_grad()[2] = std::numeric_limits<float>::quiet_NaN(); }}};
  for (const auto& [name, inject] : injections) {
    const auto weight = p.model->weight.detach().clone(), bias = p.model->bias.detach().clone();
    const double scale = scaler.get_scale();
    p.optimizer->zero_grad();
    scaler.scale(p.loss()).backward();
    inject();
    EXPECT_FALSE(scaler.step(*p.optimizer)) << name;
    scaler.update();
    EXPECT_TRUE(torch::equal(p.model->weight, weight) && torch::equal(p.model->bias, bias))
        << name << ": the step was applied";
    EXPECT_EQ(scaler.get_scale(), scale / 2) << name;
    EXPECT_TRUE(scaler.last_step_skipped()) << name;
  }
  // A good step then goes through with the halved scale, and its gradients are the true ones.
  p.optimizer->zero_grad();
  scaler.scale(p.loss()).backward();
  scaler.unscale_(*p.optimizer);
  const auto unscaled = p.model->weight.grad().clone();
  p.optimizer->zero_grad();
  p.loss().backward();
  EXPECT_TRUE(qkv_test::tensors_close(unscaled, p.model->weight.grad(), 1e-6));
}

// The same on CUDA, under float16 autocast as fp16-mixed trains: an overflow in the second
// parameter's gradient (after a finite first one) skips the step and halves the scale; the next
// step's unscaled gradients are the true ones.
TEST(GradScaler, OnCudaAnInfOrNanGradientIsSkippedAndTheScaleHalves) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "CUDA not available";
  ScalerProblem p(torch::kCUDA);
  qkv::GradScaler scaler(qkv::GradScalerOptions().init_scale(1024.0));
  for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    const auto before = p.model->weight.detach().clone();
    const auto scale_before = scaler.get_scale();
    p.optimizer->zero_grad();
    {
      const qkv::AutocastGuard autocast(torch::kCUDA, torch::kHalf);
      scaler.scale(p.loss()).backward();
    }
    p.model->bias.mutable_grad()[1] = bad;
    EXPECT_FALSE(scaler.step(*p.optimizer)) << bad;
    scaler.update();
    EXPECT_TRUE(torch::equal(p.model->weight, before)) << "the step was applied (" << bad << ")";
    EXPECT_EQ(scaler.get_scale(), scale_before / 2) << bad;
  }
  p.optimizer->zero_grad();
  scaler.scale(p.loss()).backward();
  scaler.unscale_(*p.optimizer);
  const auto unscaled = p.model->weight.grad().clone();
  p.optimizer->zero_grad();
  p.loss().backward();
  EXPECT_TRUE(unscaled.is_cuda());
  EXPECT_TRUE(qkv_test::tensors_close(unscaled, p.model->weight.grad(), 1e-6));
}

TEST(GradScaler, TheScaleGrowsAfterGrowthIntervalGoodSteps) {
  ScalerProblem p;
  qkv::GradScaler scaler(qkv::GradScalerOptions().init_scale(8.0).growth_interval(3));
  for (int step = 1; step <= 7; ++step) {
    p.optimizer->zero_grad();
    scaler.scale(p.loss()).backward();
    EXPECT_TRUE(scaler.step(*p.optimizer));
    scaler.update();
    const double expected = step < 3 ? 8.0 : (step < 6 ? 16.0 : 32.0);
    EXPECT_EQ(scaler.get_scale(), expected) << "after step " << step;
  }
  EXPECT_EQ(scaler.growth_tracker(), 1);
}

// unscale_ then clip_grad_norm_ gives the gradients that clipping the unscaled ones gives.
TEST(GradScaler, UnscaleThenClipEqualsClippingTheTrueGradients) {
  ScalerProblem scaled, plain;
  qkv::GradScaler scaler(qkv::GradScalerOptions().init_scale(4096.0));
  scaled.optimizer->zero_grad();
  scaler.scale(scaled.loss()).backward();
  scaler.unscale_(*scaled.optimizer);
  torch::nn::utils::clip_grad_norm_(scaled.model->parameters(), 0.5);
  plain.optimizer->zero_grad();
  plain.loss().backward();
  torch::nn::utils::clip_grad_norm_(plain.model->parameters(), 0.5);
  EXPECT_TRUE(qkv_test::tensors_close(scaled.model->weight.grad(), plain.model->weight.grad(), 1e-6));
  EXPECT_TRUE(qkv_test::tensors_close(scaled.model->bias.grad(), plain.model->bias.grad(), 1e-6));
  EXPECT_TRUE(scaler.step(*scaled.optimizer));  // step after an explicit unscale_ does not unscale again
  plain.optimizer->step();
  EXPECT_TRUE(qkv_test::tensors_close(scaled.model->weight, plain.model->weight, 1e-6));
}

TEST(GradScaler, StateRoundTripsAndMisuseIsAnError) {
  ScalerProblem p;
  qkv::GradScaler scaler(qkv::GradScalerOptions().init_scale(256.0).growth_interval(5));
  p.optimizer->zero_grad();
  scaler.scale(p.loss()).backward();
  scaler.step(*p.optimizer);
  scaler.update();
  torch::serialize::OutputArchive out;
  scaler.save(out);
  qkv::GradScaler restored;
  auto in = through_bytes(out);
  restored.load(in);
  EXPECT_EQ(restored.get_scale(), 256.0);
  EXPECT_EQ(restored.growth_tracker(), 1);
  EXPECT_EQ(restored.state_dict(), scaler.state_dict());
  // A state no scaler could have (a damaged or crafted checkpoint's) is refused, naming the entry,
  // and leaves the scaler as it was; casting 1e300 or NaN to a count would be undefined.
  const std::vector<std::pair<std::string, double>> impossible = {
      {"scale", -1.0},           {"scale", std::nan("")},          {"growth_factor", 1.0},
      {"growth_factor", INFINITY}, {"backoff_factor", 1.0},        {"backoff_factor", 0.0},
      {"growth_interval", 0.0},  {"growth_interval", 1e300},       {"growth_interval", std::nan("")},
      {"growth_interval", 2.5},  {"_growth_tracker", -1.0},        {"_growth_tracker", 5.0},
      {"_growth_tracker", 0.5},  {"_growth_tracker", std::nan("")}};
  for (const auto& [key, value] : impossible) {
    auto state = scaler.state_dict();
    state[key] = value;
    EXPECT_THAT([&] { restored.load_state_dict(state); },
                ::testing::ThrowsMessage<c10::Error>(
                    ::testing::AllOf(HasSubstr("GradScaler::load_state_dict: expected"), HasSubstr(key))))
        << key << " = " << value;
    EXPECT_EQ(restored.state_dict(), scaler.state_dict()) << key << " = " << value;
  }

  p.optimizer->zero_grad();
  scaler.scale(p.loss()).backward();
  scaler.unscale_(*p.optimizer);
  EXPECT_THAT([&] { scaler.unscale_(*p.optimizer); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("already called for this optimizer")));
  qkv::GradScaler fresh;
  EXPECT_THAT([&] { fresh.update(); }, ::testing::ThrowsMessage<c10::Error>(HasSubstr("no step() or unscale_()")));
  // Options the constructor refuses: the same bounds as load_state_dict's.
  const std::vector<std::pair<qkv::GradScalerOptions, std::string>> bad_options = {
      {qkv::GradScalerOptions().init_scale(0.0), "a positive finite init_scale, got 0"},
      {qkv::GradScalerOptions().init_scale(INFINITY), "a positive finite init_scale, got inf"},
      {qkv::GradScalerOptions().growth_factor(1.0), "a finite growth_factor > 1, got 1"},
      {qkv::GradScalerOptions().growth_factor(INFINITY), "a finite growth_factor > 1, got inf"},
      {qkv::GradScalerOptions().growth_factor(std::nan("")), "a finite growth_factor > 1, got nan"},
      {qkv::GradScalerOptions().backoff_factor(std::nan("")), "backoff_factor in (0, 1), got nan"},
      {qkv::GradScalerOptions().growth_interval(0), "growth_interval >= 1, got 0"}};
  for (const auto& [options, message] : bad_options) {
    EXPECT_THAT([&] { qkv::GradScaler refused(options); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr("GradScaler: expected " + message)))
        << message;
  }
  // Disabled: a pass-through.
  qkv::GradScaler disabled(qkv::GradScalerOptions().enabled(false));
  const auto loss = p.loss();
  EXPECT_TRUE(disabled.scale(loss).is_same(loss));
  EXPECT_EQ(disabled.get_scale(), 1.0);
}

// MasterWeights: the optimizer of a half-precision model steps on float32 copies.

// AdamW with a constant gradient g moves a weight by lr·g/(|g| + eps) a step after decaying it by
// 1 - lr·wd (Adam's bias corrections cancel): 20 steps of lr 1e-3 take 1 to about 0.98, which
// LibTorch's AdamW on the bfloat16 weight itself never leaves (each step under half of bfloat16's
// spacing there, 2^-8). Through the loop the header shows, the masters follow float64's arithmetic
// within float32's rounding and the model holds them rounded once.
TEST(MasterWeights, TheyTakeTheStepsABFloat16WeightCannotHold) {
  const double lr = 1e-3, decay = 0.1;
  torch::nn::Linear model(torch::nn::LinearOptions(3, 1).bias(false));
  const std::vector<double> start{1.0, 0.02, -100.0}, gradient{1.0, -0.5, 2.0};
  {
    torch::NoGradGuard no_grad;
    model->weight.copy_(torch::tensor(start, torch::kDouble).view({1, 3}));
  }
  model->to(torch::kBFloat16);
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(lr).weight_decay(decay));
  qkv::MasterWeights masters(*model, adamw);
  ASSERT_TRUE(masters.active());
  ASSERT_EQ(masters.masters().size(), 1u);
  EXPECT_EQ(masters.masters()[0].name, "weight");
  auto expected = model->weight.detach().to(torch::kDouble).view({3});  // 0.02 as bfloat16 holds it
  const auto g = torch::tensor(gradient, torch::kDouble);
  for (int step = 1; step <= 20; ++step) {
    adamw.zero_grad();
    const auto loss = (model->weight * torch::tensor(gradient).to(torch::kBFloat16).view({1, 3})).sum();
    loss.backward();  // the gradient is `gradient`, exact in bfloat16
    masters.gradients_to_masters();
    EXPECT_FALSE(model->weight.grad().defined()) << "released, so the next backward does not add to it";
    // The clipped gradients are the ones the optimizer applies: the masters', whose norm is g's.
    const double norm = torch::nn::utils::clip_grad_norm_(masters.stepped(model->parameters()), 10.0);
    EXPECT_NEAR(norm, std::sqrt(1.0 + 0.25 + 4.0), 1e-6);
    adamw.step();
    masters.masters_to_model();
    expected = expected * (1 - lr * decay) - lr * g / (g.abs() + 1e-8);
  }
  EXPECT_EQ(model->weight.scalar_type(), torch::kBFloat16);
  // The master: the only parameter the optimizer holds, float32, its state float32 too.
  const auto master = adamw.param_groups()[0].params()[0];
  ASSERT_EQ(master.scalar_type(), torch::kFloat);
  EXPECT_TRUE(master.is_same(masters.masters()[0].master));
  EXPECT_TRUE(torch::allclose(master.to(torch::kDouble).view({3}), expected, 1e-6, 0.0))
      << master.to(torch::kDouble).view({3}) - expected;
  EXPECT_TRUE(qkv_test::within_one_rounding(model->weight.view({3}), expected, std::ldexp(1.0, -8)));
  EXPECT_LT(model->weight[0][0].item<double>(), 0.99);  // moved off 1, as the masters did
}

// Micro-batches, each a backward and gradients_to_masters(), add up in float32: gradients of 1
// and then eight of 2^-9 make 1 + 2^-6. Left to accumulate in the bfloat16 model, each 2^-9 (under
// half of bfloat16's spacing at 1) is lost and the sum stays 1.
TEST(MasterWeights, MicroBatchGradientsAddUpInFloat32) {
  torch::nn::Linear model(torch::nn::LinearOptions(1, 1).bias(false));
  {
    torch::NoGradGuard no_grad;
    model->weight.fill_(1.0);
  }
  model->to(torch::kBFloat16);
  const auto backward_with_gradient = [&](double gradient) {
    (model->weight * torch::tensor(gradient).to(torch::kBFloat16)).sum().backward();
  };
  std::vector<double> gradients{1.0};
  for (int i = 0; i < 8; ++i) gradients.push_back(std::ldexp(1.0, -9));

  for (double gradient : gradients) backward_with_gradient(gradient);  // the model's own accumulation
  EXPECT_EQ(model->weight.grad().item<double>(), 1.0);
  model->weight.mutable_grad() = torch::Tensor();

  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(1.0));
  qkv::MasterWeights masters(*model, sgd);
  sgd.zero_grad();
  for (double gradient : gradients) {
    backward_with_gradient(gradient);
    masters.gradients_to_masters();
  }
  const auto& master = masters.masters()[0].master;
  EXPECT_EQ(master.grad().item<double>(), 1.0 + std::ldexp(1.0, -6));
  sgd.step();
  masters.masters_to_model();
  EXPECT_EQ(master.item<double>(), -std::ldexp(1.0, -6));
  EXPECT_EQ(model->weight.item<double>(), -std::ldexp(1.0, -6));  // exact in bfloat16 too
}

// A float16 model with a GradScaler: a gradient that overflows float16 (1 · 2^16 > 65504) reaches
// the masters as inf, so the step is skipped and the scale halves; at 2^15 a gradient of 2^-26,
// which float16 flushes to zero unscaled, reaches the masters exactly and moves one by a step the
// float16 weight cannot hold.
TEST(MasterWeights, WithAGradScalerAFloat16OverflowSkipsTheStep) {
  torch::nn::Linear model(torch::nn::LinearOptions(2, 1).bias(false));
  {
    torch::NoGradGuard no_grad;
    model->weight.copy_(torch::tensor({{1.0F, 0.0F}}));
  }
  model->to(torch::kHalf);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.5));
  qkv::MasterWeights masters(*model, sgd);
  qkv::GradScaler scaler(qkv::GradScalerOptions().init_scale(65536.0));
  const auto x = torch::tensor({{1.0F, static_cast<float>(std::ldexp(1.0, -26))}});
  const auto step = [&] {
    sgd.zero_grad();
    const auto loss = (model->weight.to(torch::kFloat) * x).sum();  // the loss in float32, as under autocast
    scaler.scale(loss).backward();
    masters.gradients_to_masters();
    const bool stepped = scaler.step(sgd);
    scaler.update();
    masters.masters_to_model();
    return stepped;
  };
  const auto& master = masters.masters()[0].master;
  EXPECT_FALSE(step());
  EXPECT_EQ(scaler.get_scale(), 32768.0);
  EXPECT_TRUE(torch::equal(master, torch::tensor({{1.0F, 0.0F}})));
  EXPECT_TRUE(step());
  EXPECT_EQ(master[0][0].item<double>(), 0.5);
  EXPECT_EQ(master[0][1].item<double>(), -std::ldexp(1.0, -27));
  EXPECT_EQ(model->weight[0][0].item<double>(), 0.5);
  EXPECT_EQ(model->weight[0][1].item<double>(), 0.0);  // under float16's smallest subnormal, 2^-24
}

// save() and load() carry the masters bit for bit (not the model's rounding of them). An archive
// that does not fit is refused, naming the master and both shapes, before any master is set.
TEST(MasterWeights, TheyLoadBitForBitAndALoadThatDoesNotFitChangesNothing) {
  const auto make = [](int64_t outputs) {
    torch::manual_seed(7);
    torch::nn::Sequential model(torch::nn::Linear(4, 3), torch::nn::Linear(3, outputs));
    model->to(torch::kBFloat16);
    return model;
  };
  auto saved = make(2);
  torch::optim::Adam adam(saved->parameters(), torch::optim::AdamOptions(1e-3));
  qkv::MasterWeights masters(*saved, adam);
  adam.zero_grad();
  saved->forward(torch::ones({2, 4}, torch::kBFloat16)).to(torch::kFloat).square().sum().backward();
  masters.gradients_to_masters();
  adam.step();
  masters.masters_to_model();
  torch::serialize::OutputArchive out;
  masters.save(out);

  auto model = make(2);
  torch::optim::Adam resumed_adam(model->parameters(), torch::optim::AdamOptions(1e-3));
  qkv::MasterWeights resumed(*model, resumed_adam);
  auto in = through_bytes(out);
  resumed.load(in);
  ASSERT_EQ(resumed.masters().size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(torch::equal(resumed.masters()[i].master, masters.masters()[i].master)) << i;
    EXPECT_FALSE(torch::equal(resumed.masters()[i].master, saved->parameters()[i].to(torch::kFloat))) << i;
  }

  auto other = make(5);
  torch::optim::Adam other_adam(other->parameters(), torch::optim::AdamOptions(1e-3));
  qkv::MasterWeights other_masters(*other, other_adam);
  const auto before = other_masters.masters()[0].master.clone();
  auto again = through_bytes(out);
  EXPECT_THAT([&] { other_masters.load(again); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr(
                  "MasterWeights::load: expected the master of 1.weight to be [5, 3] float, got [2, 3] float")));
  EXPECT_TRUE(torch::equal(other_masters.masters()[0].master, before)) << "0.weight fits, but nothing is set";

  torch::serialize::OutputArchive empty;
  auto nothing = through_bytes(empty);
  EXPECT_THAT([&] { resumed.load(nothing); },
              ::testing::ThrowsMessage<c10::Error>(
                  HasSubstr("MasterWeights::load: expected 4 masters, got none for 0.weight (position 0)")));
}

// Where every parameter is float32, MasterWeights is a no-op and the optimizer keeps its own. It
// takes an optimizer over only before its first step, and only the model's parameters; a step the
// model did not take (no masters_to_model()) is an error at the next gradients_to_masters(): Adam's
// and AdamW's steps count as changes of the masters' versions, SGD's (through Tensor::data()) do not,
// and are seen in the CPU masters' values.
TEST(MasterWeights, FloatModelsAreLeftAloneAndMisuseIsAnError) {
  torch::nn::Linear float_model(2, 2);
  torch::optim::SGD float_sgd(float_model->parameters(), torch::optim::SGDOptions(0.1));
  qkv::MasterWeights none(*float_model, float_sgd);
  EXPECT_FALSE(none.active());
  EXPECT_TRUE(float_sgd.param_groups()[0].params()[0].is_same(float_model->weight));
  float_model(torch::ones({1, 2})).sum().backward();
  none.gradients_to_masters();
  EXPECT_TRUE(float_model->weight.grad().defined()) << "a float32 parameter's gradient is the optimizer's";

  torch::nn::Linear model(2, 2);
  model->to(torch::kBFloat16);
  torch::optim::Adam stepped(model->parameters(), torch::optim::AdamOptions(0.1));
  model(torch::ones({1, 2}, torch::kBFloat16)).sum().backward();
  stepped.step();
  EXPECT_THAT([&] { qkv::MasterWeights late(*model, stepped); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("expected an optimizer that has not stepped yet")));

  // A step whose result the model never took: the next backward ran on stale weights. AdamW's step
  // counts in the masters' version counters, SGD's (with momentum or without) does not.
  using MakeOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;
  const std::vector<std::pair<std::string, MakeOptimizer>> optimizers = {
      {"AdamW", [](auto p) { return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.1)); }},
      {"SGD", [](auto p) { return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1)); }},
      {"SGD with momentum",
       [](auto p) { return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9)); }}};
  for (const auto& [name, make] : optimizers) {
    torch::nn::Linear half(2, 2);
    half->to(torch::kBFloat16);
    const auto optimizer = make(half->parameters());
    qkv::MasterWeights masters(*half, *optimizer);
    const auto backward = [&] { half(torch::ones({1, 2}, torch::kBFloat16)).sum().backward(); };
    backward();
    masters.gradients_to_masters();
    optimizer->step();
    backward();
    EXPECT_THAT([&] { masters.gradients_to_masters(); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr("call masters_to_model() after each optimizer step")))
        << name;
    masters.masters_to_model();
    backward();
    masters.gradients_to_masters();  // the step taken: no error
    optimizer->zero_grad();
    backward();  // a step skipped (no optimizer step, as GradScaler skips one): no error either
    masters.gradients_to_masters();
  }

  const auto stranger = torch::zeros({3}, torch::kBFloat16).requires_grad_(true);
  torch::optim::SGD foreign(std::vector<torch::Tensor>{stranger}, torch::optim::SGDOptions(0.1));
  EXPECT_THAT([&] { qkv::MasterWeights wrong(*model, foreign); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("got one of shape [3] that the model lacks")));
}

}  // namespace
