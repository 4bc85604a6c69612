// The tiled CPU backend against the math path (the reference): outputs and every gradient over
// random configurations with every kind of mask, finite differences, dropout, and the PyTorch
// fixtures with the backend forced.
//
// B = batch, H = query heads, Hkv = key/value heads, N = queries, S = keys, D = head width.
#include "support/fixtures.h"

#include "kernels/kernels.h"
#include "kernels/tiled/kernel.h"
#include "kernels/tiled/operands.h"
#include "kernels/tiled/task_queue.h"
#include "kernels/tiled/tiled_cpu.h"

#include <gmock/gmock.h>

#include <array>
#include <atomic>
#include <limits>
#include <random>
#include <set>

namespace {

using qkv::AttentionBackend;

// One random configuration of the attention core.
struct Config {
  int64_t B, H, Hkv, N, S, D, Dv;
  bool causal;
  std::string mask;  // none | key_lengths | key_mask | bool | float | dead_rows
  c10::optional<double> scale;

  std::string name() const {
    std::ostringstream text;
    text << "B" << B << " H" << H << " Hkv" << Hkv << " N" << N << " S" << S << " D" << D << " Dv" << Dv
         << (causal ? " causal" : "") << " mask " << mask << (scale ? " scale " + std::to_string(*scale) : "");
    return text.str();
  }
};

Config random_config(std::mt19937& random) {
  auto pick = [&](std::vector<int64_t> values) {
    return values[std::uniform_int_distribution<size_t>(0, values.size() - 1)(random)];
  };
  Config c;
  c.B = pick({1, 2, 3});
  c.Hkv = pick({1, 2, 3});
  c.H = c.Hkv * pick({1, 1, 2, 4});
  // Sizes around the block sizes (64 rows, 256 keys) and below them, odd ones included: S <= 256
  // runs with the probabilities kept from the forward, S > 256 with them recomputed.
  c.N = pick({1, 2, 7, 63, 64, 65, 100, 129, 200});
  c.S = std::uniform_int_distribution<int>(0, 2)(random) == 0 ? c.N : pick({1, 5, 31, 127, 128, 129, 150, 256, 257, 300});
  c.D = pick({1, 3, 8, 16, 33, 64});
  c.Dv = std::uniform_int_distribution<int>(0, 3)(random) == 0 ? pick({1, 5, 16}) : c.D;
  c.causal = std::uniform_int_distribution<int>(0, 2)(random) == 0;
  c.mask =
      std::vector<std::string>{
          "none", "key_lengths", "key_mask", "bool", "float", "dead_rows"}[std::uniform_int_distribution<size_t>(
          0, 5)(random)];
  if (std::uniform_int_distribution<int>(0, 4)(random) == 0) c.scale = 0.37;
  return c;
}

qkv::ScaledDotProductAttentionOptions options_for(const Config& c, std::mt19937& random) {
  auto options = qkv::ScaledDotProductAttentionOptions().causal(c.causal).scale(c.scale).enable_gqa(c.H != c.Hkv);
  std::bernoulli_distribution coin(0.7);
  if (c.mask == "key_lengths") {
    std::vector<int64_t> lengths;
    for (int64_t b = 0; b < c.B; ++b) lengths.push_back(std::uniform_int_distribution<int64_t>(0, c.S)(random));
    options.key_lengths(torch::tensor(lengths, torch::kLong));
  } else if (c.mask == "key_mask") {
    auto mask = torch::rand({c.B, 1, 1, c.S}) < 0.7;
    options.mask(mask);
  } else if (c.mask == "bool" || c.mask == "dead_rows") {
    auto mask = torch::rand({c.B, c.H, c.N, c.S}) < 0.6;
    if (c.mask == "dead_rows") mask.select(2, c.N / 2).fill_(false);  // a query with no key in every head
    options.mask(mask);
  } else if (c.mask == "float") {
    auto mask = torch::randn({c.N, c.S});  // broadcast over B and H
    mask.masked_fill_(torch::rand({c.N, c.S}) < 0.2, -std::numeric_limits<float>::infinity());
    options.mask(mask);
  }
  return options;
}

struct Outcome {
  torch::Tensor output, grad_q, grad_k, grad_v;
};

Outcome run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& upstream,
            qkv::ScaledDotProductAttentionOptions options, AttentionBackend backend) {
  auto q_ = q.clone().requires_grad_(true), k_ = k.clone().requires_grad_(true), v_ = v.clone().requires_grad_(true);
  auto result = qkv::scaled_dot_product_attention(q_, k_, v_, options.backend(backend));
  EXPECT_EQ(result.backend, backend);
  (result.output * upstream).sum().backward();
  return {result.output.detach(), q_.grad(), k_.grad(), v_.grad()};
}

// The outcome of one backend on leaf copies of q, k, v in `dtype`, with `bias` (if defined) as a
// learned additive mask, and that mask's gradient.
std::pair<Outcome, torch::Tensor> run_with_learned_mask(const torch::Tensor& q, const torch::Tensor& k,
                                                        const torch::Tensor& v, const torch::Tensor& upstream,
                                                        qkv::ScaledDotProductAttentionOptions options,
                                                        const torch::Tensor& bias, AttentionBackend backend,
                                                        torch::ScalarType dtype) {
  auto leaf = [&](const torch::Tensor& t) { return t.to(dtype).clone().requires_grad_(true); };
  auto q_ = leaf(q), k_ = leaf(k), v_ = leaf(v);
  auto bias_ = bias.defined() ? bias.detach().clone().requires_grad_(true) : torch::Tensor();
  if (bias_.defined()) options.mask(bias_);
  auto result = qkv::scaled_dot_product_attention(q_, k_, v_, options.backend(backend));
  (result.output * upstream.to(dtype)).sum().backward();
  return {Outcome{result.output.detach(), q_.grad(), k_.grad(), v_.grad()},
          bias_.defined() ? bias_.grad() : torch::Tensor()};
}

void expect_same(const Outcome& actual, const Outcome& expected, double tolerance, const std::string& what) {
  double scale = 0;
  for (const auto* t : {&expected.grad_q, &expected.grad_k, &expected.grad_v})
    scale = std::max(scale, qkv_test::max_abs(*t));
  EXPECT_TRUE(actual.output.isfinite().all().item<bool>()) << what;
  EXPECT_TRUE(qkv_test::tensors_close(actual.output, expected.output, tolerance)) << what << ": output";
  EXPECT_TRUE(qkv_test::tensors_close(actual.grad_q, expected.grad_q, tolerance, scale)) << what << ": dQ";
  EXPECT_TRUE(qkv_test::tensors_close(actual.grad_k, expected.grad_k, tolerance, scale)) << what << ": dK";
  EXPECT_TRUE(qkv_test::tensors_close(actual.grad_v, expected.grad_v, tolerance, scale)) << what << ": dV";
}

// Dropout with the kernel's own mask Z (tiled_dropout_keep_mask for `seed`): the tiled kernel's
// outcome on leaf copies of q, k, v (B, H or Hkv, rows, D) in their dtype, and the reference
// softmax(S) ⊙ Z / (1 - p) · V computed plainly by the math path in float64, both with `options`
// (no dropout, no backend: enable_gqa where H ≠ Hkv) and the same upstream gradient.
std::pair<Outcome, Outcome> dropout_against_the_kernels_mask(const torch::Tensor& q, const torch::Tensor& k,
                                                             const torch::Tensor& v, const torch::Tensor& upstream,
                                                             qkv::ScaledDotProductAttentionOptions options, double p,
                                                             uint64_t seed) {
  auto tq = q.clone().requires_grad_(true), tk = k.clone().requires_grad_(true), tv = v.clone().requires_grad_(true);
  auto with_dropout = options;
  with_dropout.dropout(p).training(true).backend(AttentionBackend::Tiled);
  const auto tiled = qkv::kernels::tiled_attention_with_seed(tq, tk, tv, with_dropout, seed).output;
  (tiled * upstream).sum().backward();
  const auto keep =
      qkv::kernels::tiled_dropout_keep_mask(seed, p, q.size(0), q.size(1), q.size(2), k.size(2)).to(torch::kDouble);
  auto wide = [](const torch::Tensor& t) { return t.to(torch::kDouble).requires_grad_(true); };
  auto mq = wide(q), mk = wide(k), mv = wide(v);
  auto math = options;
  math.need_weights(true).backend(AttentionBackend::Math);
  const auto weights = qkv::scaled_dot_product_attention(mq, mk, mv, math).weights;  // (B, H, N, S)
  const auto expected = torch::matmul(weights * keep / (1 - p), mv.repeat_interleave(q.size(1) / k.size(1), 1));
  (expected * upstream.to(torch::kDouble)).sum().backward();
  return {Outcome{tiled.detach(), tq.grad(), tk.grad(), tv.grad()},
          Outcome{expected.detach(), mq.grad(), mk.grad(), mv.grad()}};
}

// ≥ 100 random configurations per dtype: outputs and every gradient equal the math path's
// (float64 within 1e-10, float32 within 1e-5 relative to each tensor's size).
TEST(Tiled, MatchesTheMathPathOverRandomConfigurations) {
  std::mt19937 random(2026);
  for (const auto dtype : {torch::kDouble, torch::kFloat}) {
    const double tolerance = dtype == torch::kDouble ? 1e-10 : 1e-5;
    int checked = 0;
    for (int trial = 0; trial < 110; ++trial) {
      const auto c = random_config(random);
      torch::manual_seed(trial);
      const auto q = torch::randn({c.B, c.H, c.N, c.D}, dtype);
      const auto k = torch::randn({c.B, c.Hkv, c.S, c.D}, dtype);
      const auto v = torch::randn({c.B, c.Hkv, c.S, c.Dv}, dtype);
      const auto upstream = torch::randn({c.B, c.H, c.N, c.Dv}, dtype);
      const auto options = options_for(c, random);
      const auto expected = run(q, k, v, upstream, options, AttentionBackend::Math);
      const auto actual = run(q, k, v, upstream, options, AttentionBackend::Tiled);
      expect_same(actual, expected, tolerance, c.name() + " " + c10::toString(dtype));
      ++checked;
    }
    EXPECT_GE(checked, 100);
  }
}

TEST(Tiled, FullyMaskedRowsGiveZeroOutputAndZeroGradients) {
  torch::manual_seed(3);
  const auto q = torch::randn({1, 2, 70, 16}), k = torch::randn({1, 2, 140, 16}), v = torch::randn({1, 2, 140, 16});
  auto mask = torch::ones({1, 2, 70, 140}, torch::kBool);
  mask.select(2, 5).fill_(false);
  const auto upstream = torch::randn({1, 2, 70, 16});
  auto outcome = run(q, k, v, upstream, qkv::ScaledDotProductAttentionOptions().mask(mask), AttentionBackend::Tiled);
  EXPECT_EQ(qkv_test::max_abs(outcome.output.select(2, 5)), 0.0);
  EXPECT_EQ(qkv_test::max_abs(outcome.grad_q.select(2, 5)), 0.0);
  EXPECT_TRUE(outcome.grad_k.isfinite().all().item<bool>());
  // Every key of a sequence of length 0: all zero.
  auto empty =
      run(q, k, v, upstream, qkv::ScaledDotProductAttentionOptions().key_lengths(torch::zeros({1}, torch::kLong)),
          AttentionBackend::Tiled);
  EXPECT_EQ(qkv_test::max_abs(empty.output), 0.0);
  EXPECT_EQ(qkv_test::max_abs(empty.grad_k), 0.0);
  EXPECT_EQ(qkv_test::max_abs(empty.grad_v), 0.0);
}

// A NaN in the input must come out where the math path puts it, never be turned into a number:
// a NaN query row gives a NaN output row (its scores are all NaN), a NaN key every row that sees it.
// (Its exponential also used to run into undefined behaviour, which UBSan reported.)
TEST(Tiled, NaNInputsGiveNaNWhereTheMathPathGivesNaN) {
  torch::manual_seed(4);
  for (const auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16, torch::kHalf}) {
    auto q = torch::randn({2, 2, 40, 16}, dtype), k = torch::randn({2, 2, 300, 16}, dtype);
    const auto v = torch::randn({2, 2, 300, 16}, dtype);
    q[0][1][7][3] = std::numeric_limits<double>::quiet_NaN();
    k[1][0][250][0] = std::numeric_limits<double>::quiet_NaN();
    // In the second key block: bfloat16 exponentiates it with the first block's maximum as the shift.
    k[1][1][280][0] = std::numeric_limits<double>::quiet_NaN();
    const auto upstream = torch::randn({2, 2, 40, 16}, dtype);
    const auto options = qkv::ScaledDotProductAttentionOptions();
    const auto tiled = run(q, k, v, upstream, options, AttentionBackend::Tiled);
    const auto math = run(q, k, v, upstream, options, AttentionBackend::Math);
    const auto nan_rows = [](const torch::Tensor& output) { return output.isnan().any(/*dim=*/-1); };  // (B, H, N)
    ASSERT_TRUE(nan_rows(math.output).any().item<bool>());
    EXPECT_TRUE(torch::equal(nan_rows(tiled.output), nan_rows(math.output))) << c10::toString(dtype);
    EXPECT_TRUE(tiled.output[0][1][7].isnan().all().item<bool>());
    EXPECT_TRUE(tiled.output[1][0].isnan().all().item<bool>());
    EXPECT_TRUE(tiled.output[1][1].isnan().all().item<bool>());
    EXPECT_FALSE(tiled.output[0][0].isnan().any().item<bool>());
  }
}

// A decoded token against a long cache with few heads: the dot-product forward splits the keys into
// ranges by the shape alone (forward.cpp, decode_key_ranges), so the output has the same bits on 1,
// 2 and 3 threads; a NaN in one range's keys makes NaN exactly the rows of the heads that read that
// key/value head, as the math path does, and the other rows match it.
TEST(Tiled, DecodedTokensOverKeyRangesGiveTheSameBitsOnAnyThreadCount) {
  const qkv_test::ThreadCount restore_thread_count(at::get_num_threads());  // the loop sets its own
  torch::manual_seed(46);
  const int64_t H = 4, Hkv = 2, S = 3000, D = 32;  // 2 key/value heads: 4 ranges of 768 keys each
  for (const auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto q = torch::randn({1, H, 1, D}, dtype), v = torch::randn({1, Hkv, S, D}, dtype);
    auto k = torch::randn({1, Hkv, S, D}, dtype);
    k[0][1][2000][5] = std::numeric_limits<double>::quiet_NaN();  // the third range of key/value head 1
    const auto options = qkv::ScaledDotProductAttentionOptions().enable_gqa(true).backend(AttentionBackend::Tiled);
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> outputs;
    for (const int threads : {1, 2, 3}) {
      at::set_num_threads(threads);
      outputs.push_back(qkv::scaled_dot_product_attention(q, k, v, options).output);
    }
    for (int64_t h = 0; h < H; ++h) {
      for (size_t t = 1; t < outputs.size(); ++t) {
        const auto one = outputs[0][0][h], other = outputs[t][0][h];
        EXPECT_TRUE(h / 2 == 1 ? one.isnan().all().item<bool>() && other.isnan().all().item<bool>() : one.equal(other))
            << "head " << h << ", run " << t;
      }
    }
    const auto math = qkv::scaled_dot_product_attention(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble),
                                                        qkv::ScaledDotProductAttentionOptions().enable_gqa(true).backend(AttentionBackend::Math))
                          .output;
    EXPECT_TRUE(math[0].slice(0, 2, 4).isnan().all().item<bool>());
    EXPECT_LT(qkv_test::relative_error(outputs[0][0].slice(0, 0, 2), math[0].slice(0, 0, 2)),
              qkv_test::tolerance_for(dtype, S));
  }
}

// With bfloat16 weights the forward exponentiates a row's later key blocks with the row maximum of
// the blocks before as the shift, and redoes a block with its own maximum where that rose more than
// a slack (e^8) above it. Rows whose later blocks' scores rise by 3 and 6 (kept: weights above 1),
// by 12 and by 100 (redone; e^100 would overflow float32), fall by 40, or rise block after block,
// against float64 math, with every
// gradient (the backward's probabilities come from the forward's log-sum-exp), on one thread and two.
TEST(Tiled, BFloat16ForwardShiftsLaterBlocksByTheRowMaximumSoFar) {
  const qkv_test::ThreadCount restore_thread_count(at::get_num_threads());  // the loop sets its own
  torch::manual_seed(45);
  const int64_t N = 96, S = 800, D = 16;  // four key blocks, the last one partial
  const auto q = torch::randn({1, 2, N, D}, torch::kDouble), k = torch::randn({1, 2, S, D}, torch::kDouble);
  const auto v = torch::randn({1, 2, S, D}, torch::kDouble), upstream = torch::randn({1, 2, N, D}, torch::kDouble);
  // Additive mask (H, N, S): what each group of 16 rows adds to the keys of blocks 1, 2 and 3.
  auto bias = torch::zeros({2, N, S}, torch::kDouble);
  const std::vector<std::array<double, 3>> rises{{3, 3, 3}, {6, 0, 6}, {12, 0, 0}, {0, 100, 0}, {-40, -40, -40},
                                                 {7, 14, 21}};
  for (int64_t group = 0; group < 6; ++group) {
    for (int64_t block = 1; block < 4; ++block) {
      bias.slice(1, 16 * group, 16 * group + 16).slice(2, 256 * block, std::min<int64_t>(S, 256 * block + 256)) +=
          rises[group][block - 1];
    }
  }
  for (const int threads : {1, 2}) {
    SCOPED_TRACE(std::to_string(threads) + " threads");
    at::set_num_threads(threads);
    const auto options = qkv::ScaledDotProductAttentionOptions();
    const auto [tiled, tiled_bias_grad] =
        run_with_learned_mask(q, k, v, upstream, options, bias, AttentionBackend::Tiled, torch::kBFloat16);
    const auto [math, math_bias_grad] =
        run_with_learned_mask(q, k, v, upstream, options, bias, AttentionBackend::Math, torch::kDouble);
    const double tolerance = qkv_test::tolerance_for(torch::kBFloat16, S);
    expect_same(tiled, math, tolerance, "rising and falling blocks");
    EXPECT_TRUE(qkv_test::tensors_close(tiled_bias_grad, math_bias_grad, tolerance)) << "the mask's gradient";
  }
}

TEST(Tiled, BFloat16MatchesFloat64Math) {
  std::mt19937 random(7);
  for (int trial = 0; trial < 12; ++trial) {
    auto c = random_config(random);
    torch::manual_seed(trial);
    const auto q = torch::randn({c.B, c.H, c.N, c.D}).to(torch::kBFloat16);
    const auto k = torch::randn({c.B, c.Hkv, c.S, c.D}).to(torch::kBFloat16);
    const auto v = torch::randn({c.B, c.Hkv, c.S, c.Dv}).to(torch::kBFloat16);
    const auto upstream = torch::randn({c.B, c.H, c.N, c.Dv}).to(torch::kBFloat16);
    const auto options = options_for(c, random);
    auto float64 = options;
    if (float64.mask().defined() && float64.mask().is_floating_point()) float64.mask(float64.mask().to(torch::kDouble));
    const auto expected = run(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble),
                              upstream.to(torch::kDouble), float64, AttentionBackend::Math);
    const auto actual = run(q, k, v, upstream, options, AttentionBackend::Tiled);
    Outcome widened{actual.output.to(torch::kDouble), actual.grad_q.to(torch::kDouble),
                    actual.grad_k.to(torch::kDouble), actual.grad_v.to(torch::kDouble)};
    expect_same(widened, expected, qkv_test::tolerance_for(torch::kBFloat16, std::max({c.N, c.S, c.D})),
                c.name() + " bfloat16");
  }
}

// Where whole heads would leave threads idle (B = 1, Hkv = 1; or 3 key/value heads on 2 threads)
// the backward splits each head's keys into parts run as separate tasks, each with a partial dQ
// summed at the end: every gradient, the learned mask's included, against the math path in
// float64, causal (uneven work per key block), windowed, with key lengths, GQA, bfloat16, and
// dropout with the kernel's mask.
TEST(Tiled, BackwardSplitOverKeysMatchesTheMathPath) {
  const qkv_test::ThreadCount thread_count(std::max(at::get_num_threads(), 2));
  torch::manual_seed(21);
  const int64_t N = 300, S = 700, D = 16;  // 3 key blocks; about 13 MFLOP: worth splitting
  struct Variant {
    const char* name;
    bool causal;
    c10::optional<int64_t> window;
    int64_t H, Hkv;
    bool learned_mask, key_lengths;
    torch::ScalarType dtype;
  };
  for (const auto& variant :
       {Variant{"plain", false, c10::nullopt, 1, 1, false, false, torch::kDouble},
        Variant{"causal", true, c10::nullopt, 1, 1, false, false, torch::kDouble},
        Variant{"window 200", true, 200, 1, 1, false, false, torch::kDouble},
        Variant{"GQA, key lengths, learned mask", false, c10::nullopt, 2, 1, true, true, torch::kDouble},
        Variant{"bfloat16 causal", true, c10::nullopt, 1, 1, false, false, torch::kBFloat16},
        Variant{"3 heads (split in two on 2 threads), causal, learned mask", true, c10::nullopt, 3, 3, true, false,
                torch::kDouble},
        Variant{"3 heads, bfloat16", false, c10::nullopt, 3, 3, false, false, torch::kBFloat16},
        Variant{"3 heads, float16, causal, learned mask", true, c10::nullopt, 3, 3, true, false, torch::kHalf}}) {
    SCOPED_TRACE(variant.name);
    auto options = qkv::ScaledDotProductAttentionOptions().causal(variant.causal).window(variant.window).enable_gqa(
        variant.H > variant.Hkv);
    const auto q = torch::randn({1, variant.H, N, D}, torch::kDouble).to(variant.dtype);
    const auto k = torch::randn({1, variant.Hkv, S, D}, torch::kDouble).to(variant.dtype);
    const auto v = torch::randn({1, variant.Hkv, S, D}, torch::kDouble).to(variant.dtype);
    const auto upstream = torch::randn({1, variant.H, N, D}, torch::kDouble).to(variant.dtype);
    torch::Tensor bias;
    if (variant.key_lengths) options.key_lengths(torch::tensor({S - 100}, torch::kLong));
    if (variant.learned_mask) bias = torch::randn({variant.H, N, S}, torch::kDouble).requires_grad_(true);
    auto outcome = [&](AttentionBackend backend, torch::ScalarType dtype) {
      return run_with_learned_mask(q, k, v, upstream, options, bias, backend, dtype);
    };
    const auto [tiled, tiled_bias_grad] = outcome(AttentionBackend::Tiled, variant.dtype);
    const auto [math, math_bias_grad] = outcome(AttentionBackend::Math, torch::kDouble);
    const double tolerance =
        variant.dtype == torch::kDouble ? 1e-10 : qkv_test::tolerance_for(variant.dtype, std::max(N, S));
    expect_same(tiled, math, tolerance, variant.name);
    if (variant.learned_mask) {
      EXPECT_TRUE(qkv_test::tensors_close(tiled_bias_grad, math_bias_grad, tolerance)) << "the mask's gradient";
    }
  }
  // Dropout: the kernel's mask, regenerated by every part.
  {
    const uint64_t seed = 99;
    const double p = 0.2;
    const auto q = torch::randn({1, 1, N, D}, torch::kDouble), k = torch::randn({1, 1, S, D}, torch::kDouble);
    const auto v = torch::randn({1, 1, S, D}, torch::kDouble), upstream = torch::randn({1, 1, N, D}, torch::kDouble);
    const auto [tiled, reference] = dropout_against_the_kernels_mask(
        q, k, v, upstream, qkv::ScaledDotProductAttentionOptions().causal(true), p, seed);
    expect_same(tiled, reference, 1e-10, "dropout, keys split");
  }
}

// A learned mask that serves the whole batch or every head has its gradient summed over them. The
// backward does it itself where the heads that add to one place can share a task without idling
// threads (sums_mask_gradient), else writes one per batch element and head for autograd to sum.
// Both, chosen by the thread count, against the math path: masks (N, S), (1, H, N, S), (B, 1, N, S),
// (H, 1, S) and (B, H, N, S), with and without grouped heads (2 query heads of one key/value head
// adding to one place in one task), over one key block (P kept by the
// forward) and three (recomputed, keys split), in float64 and bfloat16.
TEST(Tiled, LearnedMaskGradientsSummedOverTheBatchAndHeadsTheyServe) {
  const int64_t B = 3, N = 70, D = 16;
  std::set<bool> ways;  // which of the two ways ran
  for (const int threads : {1, 2, 3}) {
    const qkv_test::ThreadCount thread_count(threads);
    for (const int64_t S : {int64_t{90}, int64_t{600}}) {
      for (const auto& [H, Hkv] : {std::pair<int64_t, int64_t>{2, 2}, {4, 2}, {2, 1}}) {
        const std::vector<std::vector<int64_t>> shapes{{N, S}, {1, H, N, S}, {B, 1, N, S}, {H, 1, S}, {B, H, N, S}};
        for (const auto& shape : shapes) {
          for (const auto dtype : {torch::kDouble, torch::kBFloat16}) {
            if (dtype == torch::kBFloat16 && threads != 2) continue;
            std::ostringstream what;
            what << threads << " threads, S=" << S << " H=" << H << " Hkv=" << Hkv << ", mask "
                 << c10::IntArrayRef(shape) << " " << dtype;
            SCOPED_TRACE(what.str());
            qkv::kernels::tiled::Problem<double> problem;
            problem.B = B, problem.H = H, problem.Hkv = Hkv, problem.N = N, problem.S = S, problem.D = D, problem.Dv = D;
            const double any_value = 0;
            problem.mask.values = &any_value;
            problem.mask.batches = shape.size() == 4 ? shape[0] : 1;
            problem.mask.heads = shape.size() >= 3 ? shape[shape.size() - 3] : 1;
            ways.insert(qkv::kernels::tiled::sums_mask_gradient(problem));
            torch::manual_seed(S + H);
            const auto q = torch::randn({B, H, N, D}, torch::kDouble), k = torch::randn({B, Hkv, S, D}, torch::kDouble),
                       v = torch::randn({B, Hkv, S, D}, torch::kDouble),
                       upstream = torch::randn({B, H, N, D}, torch::kDouble);
            const auto bias = torch::randn(shape, torch::kDouble);
            const auto options = qkv::ScaledDotProductAttentionOptions().enable_gqa(H > Hkv);
            const auto [tiled, tiled_bias_grad] =
                run_with_learned_mask(q, k, v, upstream, options, bias, AttentionBackend::Tiled, dtype);
            const auto [math, math_bias_grad] =
                run_with_learned_mask(q, k, v, upstream, options, bias, AttentionBackend::Math, torch::kDouble);
            const double tolerance = dtype == torch::kDouble ? 1e-10 : qkv_test::tolerance_for(dtype, S);
            expect_same(tiled, math, tolerance, what.str());
            EXPECT_TRUE(qkv_test::tensors_close(tiled_bias_grad, math_bias_grad, tolerance)) << "the mask's gradient";
          }
        }
      }
    }
  }
  EXPECT_EQ(ways.size(), 2u) << "the thread counts should have taken both ways";
}

// Up to one key block (S <= Bc) and within a budget the forward keeps the probabilities for the
// backward; past it the backward recomputes them. Both sides of each boundary against float64 math,
// with what touches P: causal within a window, key lengths (one sequence empty), a learned mask's
// gradient, grouped heads, bfloat16.
TEST(Tiled, KeptAndRecomputedProbabilitiesBothMatchTheMathPath) {
  using qkv::kernels::tiled::kKeysPerBlock;
  const auto keeps = [](int64_t B, int64_t H, int64_t N, int64_t S) {
    qkv::kernels::tiled::Problem<double> problem;
    problem.B = B, problem.H = H, problem.N = N, problem.S = S;
    return qkv::kernels::tiled::keeps_probabilities(problem);
  };
  struct Variant {
    std::string name;
    int64_t B, H, Hkv, N, S, D;
    bool causal;
    c10::optional<int64_t> window;
    bool key_lengths, learned_mask;
    torch::ScalarType dtype;
  };
  std::vector<Variant> variants;
  for (const int64_t S : {kKeysPerBlock - 1, kKeysPerBlock, kKeysPerBlock + 1}) {
    const auto at = " S " + std::to_string(S);
    variants.push_back({"plain" + at, 2, 2, 2, 70, S, 8, false, c10::nullopt, false, false, torch::kDouble});
    variants.push_back({"causal window 37" + at, 1, 2, 1, S, S, 8, true, 37, false, false, torch::kDouble});
    variants.push_back({"GQA, key lengths, learned mask" + at, 2, 4, 2, 65, S, 5, false, c10::nullopt, true, true,
                        torch::kDouble});
    variants.push_back({"bfloat16 causal" + at, 1, 2, 2, S, S, 16, true, c10::nullopt, false, false, torch::kBFloat16});
  }
  // Past the budget at one key block: the probabilities would take more than kKeptProbabilitiesBytes.
  const int64_t rows_past_budget = qkv::kernels::tiled::kKeptProbabilitiesBytes / (kKeysPerBlock * 8) + 1;
  variants.push_back({"past the budget", 1, 1, 1, rows_past_budget, kKeysPerBlock, 4, true, c10::nullopt, false, false,
                      torch::kDouble});
  for (const auto& c : variants) {
    SCOPED_TRACE(c.name);
    // The path each variant is meant to take.
    EXPECT_EQ(keeps(c.B, c.H, c.N, c.S), c.S <= kKeysPerBlock && c.name != "past the budget");
    torch::manual_seed(31);
    auto options = qkv::ScaledDotProductAttentionOptions().causal(c.causal).window(c.window).enable_gqa(c.H != c.Hkv);
    if (c.key_lengths) options.key_lengths(torch::tensor({c.S - 3, int64_t{0}}, torch::kLong));
    const auto q = torch::randn({c.B, c.H, c.N, c.D}, torch::kDouble).to(c.dtype);
    const auto k = torch::randn({c.B, c.Hkv, c.S, c.D}, torch::kDouble).to(c.dtype);
    const auto v = torch::randn({c.B, c.Hkv, c.S, c.D}, torch::kDouble).to(c.dtype);
    const auto upstream = torch::randn({c.B, c.H, c.N, c.D}, torch::kDouble).to(c.dtype);
    const auto bias = c.learned_mask ? torch::randn({c.H, c.N, c.S}, torch::kDouble) : torch::Tensor();
    auto outcome = [&](AttentionBackend backend, torch::ScalarType dtype) {
      return run_with_learned_mask(q, k, v, upstream, options, bias, backend, dtype);
    };
    const auto [tiled, tiled_bias_grad] = outcome(AttentionBackend::Tiled, c.dtype);
    const auto [math, math_bias_grad] = outcome(AttentionBackend::Math, torch::kDouble);
    const double tolerance = c.dtype == torch::kDouble ? 1e-10 : qkv_test::tolerance_for(c.dtype, c.S);
    expect_same(tiled, math, tolerance, c.name);
    if (c.learned_mask) {
      EXPECT_TRUE(qkv_test::tensors_close(tiled_bias_grad, math_bias_grad, tolerance)) << "the mask's gradient";
    }
  }
}

// A forward's output does not depend on whether a backward follows. With autograd the kernel keeps
// a block's exponentials in float32 (the probabilities, up to one key block; dropout), without it
// rounds them to bfloat16 as it computes them; where the products take bfloat16 both must give the
// same bfloat16 weights, so that evaluating and training (and a checkpoint's recomputation, which
// must reproduce the output its forward gave without autograd) agree bit for bit. Each side of the
// one-block boundary, causal or with key lengths, grouped heads, a float mask; both against float64.
// The exception: at most direct_rows_limit() query rows a head without autograd (decoded tokens)
// go by dot products with their weights in float32 (kernel.h), within bfloat16's tolerance of
// float64 but not the same bits; an activation checkpoint's first run (kernels::RecomputedLater)
// takes the path its recomputation will, and must give those bits.
TEST(Tiled, BFloat16ForwardIsTheSameWhetherABackwardFollowsOrNot) {
  using qkv::kernels::tiled::kKeysPerBlock;
  torch::manual_seed(46);
  for (const int64_t S : {int64_t{1}, int64_t{7}, int64_t{100}, kKeysPerBlock - 1, kKeysPerBlock, kKeysPerBlock + 1,
                          int64_t{700}}) {
    for (const bool causal : {false, true}) {
      const int64_t B = 2, H = 4, Hkv = 2, D = 32, N = causal ? S : 90;
      SCOPED_TRACE("S " + std::to_string(S) + (causal ? ", causal" : ", key lengths and a float mask"));
      auto options = qkv::ScaledDotProductAttentionOptions().causal(causal).enable_gqa(true);
      if (!causal) {
        options.key_lengths(torch::tensor({std::max<int64_t>(S - 5, 1), S}, torch::kLong));
        options.mask(torch::randn({N, S}));
      }
      const auto q = torch::randn({B, H, N, D}), k = torch::randn({B, Hkv, S, D}), v = torch::randn({B, Hkv, S, D});
      const auto run = [&](bool with_autograd) {
        auto leaf = [&](const torch::Tensor& t) { return t.to(torch::kBFloat16).requires_grad_(with_autograd); };
        return qkv::scaled_dot_product_attention(leaf(q), leaf(k), leaf(v), options.backend(AttentionBackend::Tiled))
            .output.detach();
      };
      const bool few_rows = N <= qkv::kernels::tiled::direct_rows_limit();
      const auto evaluated = [&] {
        torch::NoGradGuard no_grad;
        return run(false);
      }();
      const auto checkpointed = [&] {  // as an activation checkpoint's first run
        torch::NoGradGuard no_grad;
        const qkv::kernels::RecomputedLater recomputed_later;
        return run(false);
      }();
      const auto trained = run(true);
      EXPECT_TRUE(torch::equal(trained, checkpointed))
          << "with autograd and before a recomputation, largest difference "
          << (trained.to(torch::kFloat) - checkpointed.to(torch::kFloat)).abs().max().item<float>();
      if (!few_rows) {
        EXPECT_TRUE(torch::equal(trained, evaluated))
            << "with and without autograd, largest difference "
            << (trained.to(torch::kFloat) - evaluated.to(torch::kFloat)).abs().max().item<float>();
      }
      const auto reference = qkv::scaled_dot_product_attention(q.to(torch::kDouble), k.to(torch::kDouble),
                                                               v.to(torch::kDouble),
                                                               options.backend(AttentionBackend::Math))
                                 .output;
      for (const auto* output : {&evaluated, &trained}) {
        EXPECT_LT(qkv_test::relative_error(output->to(torch::kDouble), reference),
                  qkv_test::tolerance_for(torch::kBFloat16, S));
      }
    }
  }
}

// The probabilities the forward keeps are read by the backward as they are, so every pair the
// forward does not compute must be written 0 by it: keys before a window, past a row block's
// causal end or a sequence's length, and every pair of a row that attends to nothing. The kernel's
// forward straight into a buffer of NaNs, against float64 softmax.
TEST(Tiled, KeptProbabilitiesAreWrittenWholeOverAnyBuffer) {
  namespace tiled = qkv::kernels::tiled;
  struct Variant {
    std::string name;
    int64_t B, N, S;
    bool causal;
    int64_t window;
    bool key_lengths, dead_rows;
  };
  const std::vector<Variant> variants = {
      {"causal, the language model's shape", 1, 128, 128, true, 0, false, false},
      {"causal window 37", 1, 150, 150, true, 37, false, false},
      {"key lengths, one sequence empty", 2, 70, 100, false, 0, true, false},
      {"bool mask with rows that attend to nothing", 1, 90, 256, false, 0, false, true},
  };
  const int64_t H = 2, D = 8;
  for (const auto& c : variants) {
    SCOPED_TRACE(c.name);
    torch::manual_seed(5);
    const auto q = torch::randn({c.B, H, c.N, D}, torch::kDouble);
    const auto k = torch::randn({c.B, H, c.S, D}, torch::kDouble);
    const auto v = torch::randn({c.B, H, c.S, D}, torch::kDouble);
    // What may be attended (B, 1, N, S), broadcast over the heads.
    auto allowed = torch::ones({c.B, 1, c.N, c.S}, torch::kBool);
    const auto rows = torch::arange(c.N).view({-1, 1}), keys = torch::arange(c.S).view({1, -1});
    if (c.causal) allowed &= keys.le(rows);
    if (c.window > 0) allowed &= keys.gt(rows - c.window);
    const auto lengths = torch::tensor({c.S - 3, int64_t{0}}, torch::kLong).narrow(0, 0, c.B).contiguous();
    if (c.key_lengths) allowed &= keys.lt(lengths.view({-1, 1, 1, 1}));
    auto mask = torch::rand({c.B, 1, c.N, c.S}).gt(0.3);
    if (c.dead_rows) {
      mask.index_put_({torch::indexing::Slice(), 0, torch::indexing::Slice(3, 9)}, false);
      mask.index_put_({torch::indexing::Slice(), 0, 70}, false);
      allowed &= mask;
    }

    tiled::Problem<double> p;
    p.B = c.B, p.H = H, p.Hkv = H, p.N = c.N, p.S = c.S, p.D = D, p.Dv = D;
    p.scale = 1.0 / std::sqrt(static_cast<double>(D));
    p.causal = c.causal;
    p.window = c.window;
    if (c.key_lengths) p.key_lengths = lengths.data_ptr<int64_t>();
    if (c.dead_rows) {
      p.mask.bools = mask.data_ptr<bool>();
      p.mask.stride_b = c.N * c.S, p.mask.stride_h = 0, p.mask.stride_row = c.S, p.mask.stride_key = 1;
    }
    ASSERT_TRUE(tiled::keeps_probabilities(p));
    const auto view = [](const torch::Tensor& t) {
      return tiled::Matrix4<double>{t.data_ptr<double>(), t.stride(0), t.stride(1), t.stride(2)};
    };
    auto out = torch::empty({c.B, H, c.N, D}, torch::kDouble);
    auto row_statistics = torch::empty({c.B, H, c.N, tiled::kRowStatistics}, torch::kDouble);
    auto kept = torch::full({c.B, H, c.N, c.S}, std::numeric_limits<double>::quiet_NaN(), torch::kDouble);
    tiled::forward_blocks<double, double>(
        p, view(q), view(k), view(v),
        tiled::OutputMatrix4<double>{out.data_ptr<double>(), out.stride(0), out.stride(1), out.stride(2)},
        row_statistics.data_ptr<double>(), kept.data_ptr<double>());

    const auto scores = torch::matmul(q, k.transpose(-2, -1)) * p.scale;
    const auto masked = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
    // softmax, with 0 for a row that attends to nothing (softmax itself would give NaN there)
    const auto attends = allowed.any(-1, /*keepdim=*/true);
    const auto expected = torch::softmax(masked.masked_fill(attends.logical_not(), 0.0), -1) * allowed;
    ASSERT_TRUE(torch::isfinite(kept).all().item<bool>()) << "a pair of P left unwritten";
    EXPECT_TRUE(torch::allclose(kept, expected, 1e-12, 1e-12)) << (kept - expected).abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(out, torch::matmul(expected, v), 1e-12, 1e-12));
  }
}

// The bfloat16 backward over many query and key blocks on one thread, so that every key block of a
// head runs after the one before it in the same scratch panels (a causal block whose rows see 64
// of its keys after one whose rows saw all 256): several query blocks per key block (N up to 600),
// a window, grouped heads, a learned mask's gradient, and dropout with the kernel's own mask,
// against float64 math.
TEST(Tiled, BFloat16BackwardOverManyBlocksMatchesTheMathPath) {
  const qkv_test::ThreadCount thread_count(1);
  struct Variant {
    std::string name;
    int64_t H, Hkv, N;
    c10::optional<int64_t> window;
    bool learned_mask;
    double dropout;
  };
  for (const auto& c : {Variant{"causal", 1, 1, 600, c10::nullopt, false, 0.0},
                        Variant{"causal, GQA, window 300", 4, 2, 600, 300, false, 0.0},
                        Variant{"causal, learned mask", 1, 1, 520, c10::nullopt, true, 0.0},
                        Variant{"causal, dropout", 2, 2, 450, c10::nullopt, false, 0.3}}) {
    SCOPED_TRACE(c.name);
    torch::manual_seed(41);
    const int64_t D = 16;
    auto options = qkv::ScaledDotProductAttentionOptions().causal(true).window(c.window).enable_gqa(c.H != c.Hkv);
    const auto q = torch::randn({1, c.H, c.N, D}, torch::kDouble).to(torch::kBFloat16);
    const auto k = torch::randn({1, c.Hkv, c.N, D}, torch::kDouble).to(torch::kBFloat16);
    const auto v = torch::randn({1, c.Hkv, c.N, D}, torch::kDouble).to(torch::kBFloat16);
    const auto upstream = torch::randn({1, c.H, c.N, D}, torch::kDouble).to(torch::kBFloat16);
    const auto bias = c.learned_mask ? torch::randn({c.H, c.N, c.N}, torch::kDouble) : torch::Tensor();
    if (c.dropout > 0) {  // the kernel's own mask Z: softmax(S) ⊙ Z / (1 - p) times V in float64 math
      const auto [tiled, reference] =
          dropout_against_the_kernels_mask(q, k, v, upstream, options, c.dropout, /*seed=*/77);
      expect_same(tiled, reference, qkv_test::tolerance_for(torch::kBFloat16, c.N), c.name);
      continue;
    }
    const auto [tiled, tiled_bias_grad] =
        run_with_learned_mask(q, k, v, upstream, options, bias, AttentionBackend::Tiled, torch::kBFloat16);
    const auto [math, math_bias_grad] =
        run_with_learned_mask(q, k, v, upstream, options, bias, AttentionBackend::Math, torch::kDouble);
    const double tolerance = qkv_test::tolerance_for(torch::kBFloat16, c.N);
    expect_same(tiled, math, tolerance, c.name);
    if (c.learned_mask) {
      EXPECT_TRUE(qkv_test::tensors_close(tiled_bias_grad, math_bias_grad, tolerance)) << "the mask's gradient";
    }
  }
}

// The output and the gradients come in the layout of the operand they belong to: from (B, N, H, D)
// storage seen as (B, H, N, D) (the module's head split), (B, N, H, D) storage again, so that
// joining the heads and the gradients' way back through the split copy nothing; from contiguous
// operands, contiguous results. An upstream gradient in any layout is read as it comes.
TEST(Tiled, ResultsTakeTheLayoutOfTheirOperands) {
  torch::manual_seed(32);
  const int64_t B = 2, N = 33, H = 4, D = 8;
  for (const bool split_heads : {true, false}) {
    SCOPED_TRACE(split_heads ? "(B, N, H, D) storage" : "contiguous (B, H, N, D)");
    auto leaf = [&] {
      return (split_heads ? torch::randn({B, N, H, D}, torch::kDouble) : torch::randn({B, H, N, D}, torch::kDouble))
          .requires_grad_(true);
    };
    auto as_heads = [&](const torch::Tensor& t) { return split_heads ? t.transpose(1, 2) : t; };  // (B, H, N, D)
    const auto q = leaf(), k = leaf(), v = leaf();
    // The upstream gradient as a transposed view of (B, H, D, N) storage: neither layout above.
    const auto upstream = torch::randn({B, H, D, N}, torch::kDouble).transpose(2, 3);
    auto result =
        qkv::scaled_dot_product_attention(as_heads(q), as_heads(k), as_heads(v),
                                          qkv::ScaledDotProductAttentionOptions().backend(AttentionBackend::Tiled));
    const auto output = result.output;
    EXPECT_TRUE((split_heads ? output.transpose(1, 2) : output).is_contiguous()) << output.strides();
    output.backward(upstream);
    for (const auto* operand : {&q, &k, &v}) EXPECT_TRUE(operand->grad().is_contiguous()) << operand->grad().strides();

    auto mq = q.detach().clone().requires_grad_(true), mk = k.detach().clone().requires_grad_(true),
         mv = v.detach().clone().requires_grad_(true);
    const auto expected =
        qkv::scaled_dot_product_attention(as_heads(mq), as_heads(mk), as_heads(mv),
                                          qkv::ScaledDotProductAttentionOptions().backend(AttentionBackend::Math))
            .output;
    expected.backward(upstream);
    expect_same(Outcome{output.detach(), q.grad(), k.grad(), v.grad()},
                Outcome{expected.detach(), mq.grad(), mk.grad(), mv.grad()}, 1e-10, "layouts");
  }
}

// q, k, v of every rank the API takes, reshaped to 4-D inside the kernel's autograd node: the
// output and the gradients in the callers' shapes, equal to float64 math, first and second order;
// and no node between the kernel's and the operands (the reshaping records none: at the
// documents' sizes such nodes cost a third of the attention's forward and backward).
TEST(Tiled, OperandsOfEveryRankGetGradientsInTheirOwnShape) {
  torch::manual_seed(44);
  struct Shapes {
    const char* name;
    std::vector<int64_t> q, kv;
    bool gqa;
  };
  for (const auto& shapes : {Shapes{"(N, D), the documents'", {5, 8}, {7, 8}, false},
                             Shapes{"(B, N, D)", {3, 5, 8}, {3, 7, 8}, false},
                             Shapes{"(H, N, D) grouped", {4, 5, 8}, {2, 7, 8}, true},
                             Shapes{"(B, H, N, D) grouped", {2, 4, 5, 8}, {2, 2, 7, 8}, true},
                             Shapes{"(A, B, H, N, D)", {2, 3, 2, 5, 8}, {2, 3, 2, 7, 8}, false}}) {
    SCOPED_TRACE(shapes.name);
    const auto options = qkv::ScaledDotProductAttentionOptions().causal(true).enable_gqa(shapes.gqa);
    const auto q0 = torch::randn(shapes.q, torch::kDouble), k0 = torch::randn(shapes.kv, torch::kDouble);
    // v as a transposed view of (…, D, S) storage: not readable in place, copied inside the node.
    const auto v0 = torch::randn(shapes.kv, torch::kDouble).transpose(-1, -2).contiguous().transpose(-1, -2);
    const auto upstream = torch::randn(shapes.q, torch::kDouble);
    const auto weights = torch::randn(shapes.q, torch::kDouble);  // for <dL/dq, weights>, the second order
    auto run = [&](AttentionBackend backend) {
      auto q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true);
      auto v = v0.detach().requires_grad_(true);
      const auto result = qkv::scaled_dot_product_attention(q, k, v, qkv::ScaledDotProductAttentionOptions(options).backend(backend));
      EXPECT_EQ(result.output.sizes(), q.sizes());
      if (backend == AttentionBackend::Tiled) {
        // The kernel's node leads straight to the leaves' gradient accumulators.
        const auto& edges = result.output.grad_fn()->next_edges();
        for (size_t i = 0; i < 3; ++i) {
          EXPECT_EQ(edges.at(i).function.get(), torch::autograd::impl::gradient_edge(std::vector<torch::Tensor>{q, k, v}[i]).function.get())
              << "operand " << i << " reaches its leaf through " << edges.at(i).function->name();
        }
      }
      const auto grads = torch::autograd::grad({result.output}, {q, k, v}, {upstream}, /*retain_graph=*/true,
                                               /*create_graph=*/true);
      const auto second = torch::autograd::grad({(grads[0] * weights).sum()}, {q, k, v});
      return std::vector<torch::Tensor>{result.output.detach(), grads[0].detach(), grads[1].detach(), grads[2].detach(),
                                        second[0], second[1], second[2]};
    };
    const auto tiled = run(AttentionBackend::Tiled), math = run(AttentionBackend::Math);
    const char* names[] = {"output", "dQ", "dK", "dV", "d(dQ·w)/dq", "d(dQ·w)/dk", "d(dQ·w)/dv"};
    for (size_t i = 0; i < tiled.size(); ++i) {
      EXPECT_EQ(tiled[i].sizes(), math[i].sizes()) << names[i];
      EXPECT_TRUE(qkv_test::tensors_close(tiled[i], math[i], 1e-10)) << names[i];
    }
  }
}

// Central differences in float64 (kernel with GQA, causal N != S, a float mask, a custom scale).
TEST(Tiled, GradientsMatchFiniteDifferences) {
  torch::manual_seed(5);
  const int64_t B = 1, H = 4, Hkv = 2, N = 5, S = 7, D = 3;
  auto q = torch::randn({B, H, N, D}, torch::kDouble), k = torch::randn({B, Hkv, S, D}, torch::kDouble);
  auto v = torch::randn({B, Hkv, S, D}, torch::kDouble);
  auto mask = torch::randn({N, S}, torch::kDouble);
  mask[2][0] = -std::numeric_limits<double>::infinity();
  const auto upstream = torch::randn({B, H, N, D}, torch::kDouble);
  const auto options = qkv::ScaledDotProductAttentionOptions().causal(true).mask(mask).scale(0.8).enable_gqa(true);
  auto loss = [&](const torch::Tensor& q_, const torch::Tensor& k_, const torch::Tensor& v_) {
    auto tiled = options;
    return (qkv::scaled_dot_product_attention(q_, k_, v_, tiled.backend(AttentionBackend::Tiled)).output * upstream)
        .sum();
  };
  const auto analytic = run(q, k, v, upstream, options, AttentionBackend::Tiled);
  constexpr double kStep = 1e-6;
  for (auto [tensor, grad, name] : {std::tuple{&q, analytic.grad_q, "q"}, std::tuple{&k, analytic.grad_k, "k"},
                                    std::tuple{&v, analytic.grad_v, "v"}}) {
    auto numeric = torch::zeros_like(*tensor);
    auto flat = tensor->view(-1);
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const double original = flat[i].item<double>();
      flat[i] = original + kStep;
      const double plus = loss(q, k, v).item<double>();
      flat[i] = original - kStep;
      const double minus = loss(q, k, v).item<double>();
      flat[i] = original;
      numeric.view(-1)[i] = (plus - minus) / (2 * kStep);
    }
    EXPECT_TRUE(qkv_test::tensors_close(grad, numeric, 1e-7, qkv_test::max_abs(analytic.grad_q))) << name;
  }
}

// ---- Dropout inside the kernel ----

TEST(TiledDropout, SameSeedSameResultAndTheKeptFractionIsOneMinusP) {
  torch::manual_seed(8);
  const auto q = torch::randn({2, 2, 100, 16}), k = torch::randn({2, 2, 150, 16}), v = torch::randn({2, 2, 150, 16});
  const auto upstream = torch::randn({2, 2, 100, 16});
  const auto options = qkv::ScaledDotProductAttentionOptions().dropout(0.3).training(true);
  torch::manual_seed(9);
  const auto first = run(q, k, v, upstream, options, AttentionBackend::Tiled);
  torch::manual_seed(9);
  const auto second = run(q, k, v, upstream, options, AttentionBackend::Tiled);
  expect_same(second, first, 0.0, "the same seed twice");
  const auto third = run(q, k, v, upstream, options, AttentionBackend::Tiled);  // the generator moved on
  EXPECT_FALSE(qkv_test::tensors_close(third.output, first.output, 1e-3));

  const double p = 0.3;
  const auto keep = qkv::kernels::tiled_dropout_keep_mask(/*seed=*/12345, p, 4, 8, 300, 300);
  const double n = static_cast<double>(keep.numel());
  const double kept = keep.to(torch::kDouble).mean().item<double>();
  const double standard_error = std::sqrt(p * (1 - p) / n);
  EXPECT_NEAR(kept, 1 - p, 4 * standard_error) << "kept " << kept << " of " << n;
}

// Rows must not share a dropout mask. With 32-bit row keys, R rows share one with probability
// about R² / 2³³ per pair of keys: at 2^18 rows, 8 expected pairs of identical 63-column masks.
// With 64-bit keys: 2^36 / 2^65, none. Two distinct masks of 63 columns at p = 0.5 are equal by
// chance with probability 2^-63, so any equal pair here is a key collision.
TEST(TiledDropout, NoTwoRowsShareAMask) {
  const int64_t heads = 4, rows = 65536, keys = 63;
  const auto keep = qkv::kernels::tiled_dropout_keep_mask(/*seed=*/0xC0FFEE, /*p=*/0.5, 1, heads, rows, keys);
  const auto bits = torch::pow(2, torch::arange(keys, torch::kLong));  // (keys,)
  const auto packed = (keep.view({heads * rows, keys}).to(torch::kLong) * bits).sum(/*dim=*/1);  // one int64 per row
  const auto sorted = std::get<0>(packed.sort());
  const int64_t shared = (sorted.slice(0, 1) == sorted.slice(0, 0, -1)).sum().item<int64_t>();
  EXPECT_EQ(shared, 0) << shared << " pairs of rows (of " << heads * rows << ") share their dropout mask";
}

// With the kernel's own mask Z, the math of dropout is softmax(S) ⊙ Z / (1 - p) times V: the
// kernel's output and gradients must be that, computed plainly in float64.
TEST(TiledDropout, EqualsTheMathPathGivenTheKernelsMask) {
  // Causal, and causal within a sliding window of 9 keys (whose blocks start off the block grid);
  // float64, and bfloat16 (on AVX512_BF16 CPUs its products multiply bfloat16 pairs: the kept
  // probabilities and dS rounded to bfloat16) and float16 (widened to float32) against float64 of
  // the same half-precision inputs.
  for (const auto dtype : {torch::kDouble, torch::kBFloat16, torch::kHalf}) {
    for (const auto window : {c10::optional<int64_t>(), c10::optional<int64_t>(9)}) {
      torch::manual_seed(10);
      const int64_t B = 2, H = 4, Hkv = 2, N = 70, S = 130, D = 8;
      const double p = 0.25;
      const uint64_t seed = 0x1234567890ABCDEFULL;
      // The inputs as the kernel gets them, and in float64 for the reference.
      auto input = [&](std::vector<int64_t> shape) { return torch::randn(shape, torch::kDouble).to(dtype); };
      const auto q = input({B, H, N, D}), k = input({B, Hkv, S, D}), v = input({B, Hkv, S, D});
      const auto upstream = input({B, H, N, D});
      const auto options = qkv::ScaledDotProductAttentionOptions().causal(true).window(window).enable_gqa(true);
      const auto [actual, reference] = dropout_against_the_kernels_mask(q, k, v, upstream, options, p, seed);
      const double tolerance = dtype == torch::kDouble ? 1e-10 : qkv_test::tolerance_for(dtype, S);
      expect_same(actual, reference, tolerance,
                  "dropout with the kernel's mask, " + std::string(c10::toString(dtype)) +
                      (window ? ", window " + std::to_string(*window) : std::string()));
    }
  }
}

// Dropout while training without gradients (Monte Carlo dropout at inference) on the dot-product
// forward of a few rows (kernel.h, rows_by_dot_products), grouped heads and keys split into ranges
// (1300 keys, 2 key/value heads of 2 batch elements): the same mask as the block path draws, so the
// output is the float64 math path's weights times that mask, over 1 - p, times V.
TEST(TiledDropout, DecodedTokensEqualTheMathPathGivenTheKernelsMask) {
  torch::manual_seed(12);
  const int64_t B = 2, H = 4, Hkv = 2, N = 3, S = 1300, D = 16;
  const double p = 0.3;
  const uint64_t seed = 0x5EED;
  for (const auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    const auto q = torch::randn({B, H, N, D}, dtype), k = torch::randn({B, Hkv, S, D}, dtype);
    const auto v = torch::randn({B, Hkv, S, D}, dtype);
    const auto options = qkv::ScaledDotProductAttentionOptions().enable_gqa(true);
    auto with_dropout = options;
    with_dropout.dropout(p).training(true).backend(AttentionBackend::Tiled);
    torch::NoGradGuard no_grad;
    const auto tiled = qkv::kernels::tiled_attention_with_seed(q, k, v, with_dropout, seed).output;
    const auto keep = qkv::kernels::tiled_dropout_keep_mask(seed, p, B, H, N, S).to(torch::kDouble);
    auto math = options;
    math.need_weights(true).backend(AttentionBackend::Math);
    const auto wide_v = v.to(torch::kDouble);
    const auto weights =
        qkv::scaled_dot_product_attention(q.to(torch::kDouble), k.to(torch::kDouble), wide_v, math).weights;
    const auto expected = torch::matmul(weights * keep / (1 - p), wide_v.repeat_interleave(H / Hkv, 1));
    EXPECT_LT(qkv_test::relative_error(tiled, expected), qkv_test::tolerance_for(dtype, S)) << c10::toString(dtype);
  }
}

// ---- The PyTorch fixtures and the module, with the tiled backend forced ----

TEST(Tiled, ParityFixturesWithTheTiledBackend) {
  for (const std::string name :
       {"documents", "multihead", "multihead_f64", "causal", "padded", "cross", "out_proj", "bool_mask", "float_mask",
        "unscaled", "no_bias_causal_f64", "gqa_h8_kv2", "rope_gqa_causal_f64"}) {
    const qkv_test::Fixture fixture(name);
    auto module = fixture.make_module();
    module->options.backend(AttentionBackend::Tiled);
    auto query = fixture.tensor("input.query").clone().requires_grad_(true);
    torch::Tensor context;
    if (fixture.has("input.context")) context = fixture.tensor("input.context");
    const auto result =
        module->attend(query, context.defined() ? context : query, context.defined() ? context : query, fixture.mask());
    EXPECT_EQ(result.backend, AttentionBackend::Tiled) << name;
    const double tolerance = qkv_test::tolerance_for(query.scalar_type(), query.size(-2) * query.size(-1));
    EXPECT_TRUE(qkv_test::tensors_close(result.output, fixture.tensor("expected.output"), tolerance)) << name;
    torch::mse_loss(result.output, fixture.tensor("target")).backward();
    qkv_test::expect_gradients_match(fixture, *module, query, tolerance, name);
  }
}

// The kernel's tasks go to threads as they become free (task_queue.h): every task runs exactly
// once, whatever the thread count and chunk size, the calling thread's share included.
TEST(Tiled, EveryTaskRunsExactlyOnce) {
  const qkv_test::ThreadCount restore_thread_count(at::get_num_threads());  // the loop sets its own
  for (const int threads : {1, 2, 5}) {
    at::set_num_threads(threads);
    for (const int64_t tasks : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}}) {
      for (const int64_t min_chunk : {int64_t{1}, int64_t{3}, int64_t{2000}}) {
        std::vector<std::atomic<int>> runs(static_cast<size_t>(tasks));
        std::atomic<int> bodies{0};
        qkv::kernels::tiled::run_tasks(tasks, min_chunk, [&](qkv::kernels::tiled::ThreadTasks& mine) {
          bodies.fetch_add(1);
          for (int64_t task = 0; mine.next(task);) runs[static_cast<size_t>(task)].fetch_add(1);
        });
        for (int64_t task = 0; task < tasks; ++task) {
          ASSERT_EQ(runs[static_cast<size_t>(task)].load(), 1)
              << "task " << task << " of " << tasks << ", " << threads << " threads, chunks of at least " << min_chunk;
        }
        // Never more threads than LibTorch has, and none for no work.
        EXPECT_LE(bodies.load(), threads);
        EXPECT_EQ(bodies.load() == 0, tasks == 0);
      }
    }
  }
}

// Which thread runs which task changes from call to call; the results must not: five calls with
// more threads than cores (so that the threads' shares vary most), causal with grouped heads and a
// learned mask, equal bit for bit, and equal to float64 math.
TEST(Tiled, ResultsDoNotDependOnWhichThreadRanATask) {
  const qkv_test::ThreadCount thread_count(4);
  torch::manual_seed(5);
  const int64_t B = 2, H = 4, Hkv = 2, N = 200, S = 300, D = 16;
  const auto q = torch::randn({B, H, N, D}, torch::kDouble), k = torch::randn({B, Hkv, S, D}, torch::kDouble);
  const auto v = torch::randn({B, Hkv, S, D}, torch::kDouble), upstream = torch::randn({B, H, N, D}, torch::kDouble);
  const auto bias = torch::randn({H, N, S}, torch::kDouble);
  const auto options = qkv::ScaledDotProductAttentionOptions().causal(true).enable_gqa(true);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto [first, first_bias_grad] =
        run_with_learned_mask(q, k, v, upstream, options, bias.to(torch::kFloat), AttentionBackend::Tiled, dtype);
    for (int call = 0; call < 4; ++call) {
      const auto [again, again_bias_grad] =
          run_with_learned_mask(q, k, v, upstream, options, bias.to(torch::kFloat), AttentionBackend::Tiled, dtype);
      EXPECT_TRUE(torch::equal(again.output, first.output)) << "call " << call;
      EXPECT_TRUE(torch::equal(again.grad_q, first.grad_q)) << "call " << call;
      EXPECT_TRUE(torch::equal(again.grad_k, first.grad_k)) << "call " << call;
      EXPECT_TRUE(torch::equal(again.grad_v, first.grad_v)) << "call " << call;
      EXPECT_TRUE(torch::equal(again_bias_grad, first_bias_grad)) << "call " << call;
    }
    const auto [math, math_bias_grad] =
        run_with_learned_mask(q, k, v, upstream, options, bias, AttentionBackend::Math, torch::kDouble);
    const double tolerance = qkv_test::tolerance_for(dtype, S);
    expect_same(first, math, tolerance, "against float64 math");
    EXPECT_TRUE(qkv_test::tensors_close(first_bias_grad.to(torch::kDouble), math_bias_grad, tolerance));
  }
}

// A mask that only pads keys (the same for every head and query, keeping the first L_b keys of each
// batch row: true then false, or 0 then -inf or the dtype's lowest value) reaches the kernel as key
// lengths (operands.cpp), skipped instead of masked key by key; any other mask stays a mask. Both
// against the math path in float64, with every gradient: lengths of 0, 1, part and all of S, over
// one and two key blocks, with causal rows, a window, grouped heads, given key_lengths (the least of
// the two counts), and masks seen through a strided view or broadcast from (S,). A row of no key
// under a finite lowest value weighs every key the same in the math path: such a mask stays a mask,
// as does a learned one.
TEST(Tiled, PaddingMasksBecomeKeyLengthsAndMatchTheMathPath) {
  const int64_t B = 4, Hkv = 2, N = 70;
  for (const int64_t S : {int64_t{90}, int64_t{300}}) {
    const auto lengths = torch::tensor({S, S - 3, int64_t{0}, int64_t{1}}, torch::kLong);
    const auto padding = torch::arange(S).unsqueeze(0).lt(lengths.unsqueeze(1));  // (B, S)
    // The same mask read through every second column of a wider one.
    auto wide = torch::zeros({B, 2 * S}, torch::kBool);
    wide.slice(1, 0, 2 * S, 2).copy_(padding);
    auto not_padding = padding.clone();
    not_padding[0][S / 2] = false;  // a hole: keys allowed after a masked one
    auto per_head = padding.view({B, 1, 1, S}).expand({B, Hkv, 1, S}).clone();
    per_head[0][1][0].slice(0, S - 5).fill_(false);  // a padding of its own in one head
    // Additive padding: 0 for the kept keys, -inf or the lowest float64 after them.
    const double lowest = std::numeric_limits<double>::lowest(), inf = std::numeric_limits<double>::infinity();
    const auto additive = [&](const torch::Tensor& allowed, double removed) {
      return torch::zeros(allowed.sizes(), torch::kDouble).masked_fill(allowed.logical_not(), removed);
    };
    const auto no_empty_row = torch::tensor({S, S - 3, int64_t{2}, int64_t{1}}, torch::kLong);
    const auto padding_no_empty_row = torch::arange(S).unsqueeze(0).lt(no_empty_row.unsqueeze(1));
    struct Variant {
      std::string name;
      torch::Tensor mask, given_lengths;
      bool causal = false, grouped = false;
      c10::optional<int64_t> window;
      torch::Tensor expected_lengths;  // undefined: the mask must stay a mask
      bool third_row_empty = true;      // batch row 2 attends to no key
    };
    const std::vector<Variant> variants{
        {"padding (B, 1, 1, S)", padding.view({B, 1, 1, S}), {}, false, false, {}, lengths},
        {"strided view", wide.slice(1, 0, 2 * S, 2).view({B, 1, 1, S}), {}, false, false, {}, lengths},
        {"causal, grouped heads", padding.view({B, 1, 1, S}), {}, true, true, {}, lengths},
        {"causal window 17", padding.view({B, 1, 1, S}), {}, true, false, 17, lengths},
        {"with key_lengths", padding.view({B, 1, 1, S}), torch::tensor({int64_t{5}, S, S, S}), false, false, {},
         torch::tensor({int64_t{5}, S - 3, int64_t{0}, int64_t{1}})},
        {"(S,) broadcast", padding[1], {}, false, false, {}, torch::full({B}, S - 3, torch::kLong)},
        {"a hole: not padding", not_padding.view({B, 1, 1, S}), {}, false, false, {}, {}},
        {"per head: not padding", per_head, {}, false, false, {}, {}},
        {"0 / -inf", additive(padding, -inf).view({B, 1, 1, S}), {}, true, false, {}, lengths},
        {"0 / lowest", additive(padding_no_empty_row, lowest).view({B, 1, 1, S}), {}, false, false, {}, no_empty_row,
         false},
        {"0 / lowest, a row of none: not padding", additive(padding, lowest).view({B, 1, 1, S}), {}, false, false, {},
         {}, false},
        {"0 / -1e4: not padding", additive(padding_no_empty_row, -1e4).view({B, 1, 1, S}), {}, false, false, {}, {},
         false},
        {"0 / -inf, learned: not padding", additive(padding, -inf).view({B, 1, 1, S}).requires_grad_(true), {}, false,
         false, {}, {}},
    };
    for (const auto& variant : variants) {
      const std::string what = variant.name + " S=" + std::to_string(S);
      const int64_t H = variant.grouped ? 2 * Hkv : Hkv;
      torch::manual_seed(S);
      const auto q = torch::randn({B, H, N, 16}, torch::kDouble), k = torch::randn({B, Hkv, S, 16}, torch::kDouble),
                 v = torch::randn({B, Hkv, S, 16}, torch::kDouble), upstream = torch::randn({B, H, N, 16}, torch::kDouble);
      auto options = qkv::ScaledDotProductAttentionOptions()
                         .mask(variant.mask)
                         .causal(variant.causal)
                         .window(variant.window)
                         .enable_gqa(variant.grouped);
      if (variant.given_lengths.defined()) options.key_lengths(variant.given_lengths);
      const auto [kernel_mask, kernel_lengths] = qkv::kernels::tiled::kernel_conditions(q, k, options, variant.grouped);
      if (variant.expected_lengths.defined()) {
        EXPECT_EQ(kernel_mask.numel(), 0) << what;
        EXPECT_TRUE(kernel_lengths.equal(variant.expected_lengths)) << what << ": " << kernel_lengths;
      } else {
        EXPECT_EQ(kernel_mask.dim(), 4) << what;
        EXPECT_EQ(kernel_lengths.numel(), variant.given_lengths.defined() ? B : 0) << what;
      }
      const auto expected = run(q, k, v, upstream, options, AttentionBackend::Math);
      const auto actual = run(q, k, v, upstream, options, AttentionBackend::Tiled);
      expect_same(actual, expected, 1e-10, what);
      // The batch row of length 0 attends to nothing: zero output and zero gradients.
      if (variant.third_row_empty && variant.mask.dim() == 4) {
        EXPECT_EQ(qkv_test::max_abs(actual.output[2]), 0.0) << what;
        EXPECT_EQ(qkv_test::max_abs(actual.grad_k[2]), 0.0) << what;
      }
    }
  }
}

TEST(Tiled, RefusesWhatItCannotDo) {
  const auto q = torch::randn({1, 1, 4, 8});
  EXPECT_THAT(
      [&] {
        qkv::scaled_dot_product_attention(
            q, q, q, qkv::ScaledDotProductAttentionOptions().backend(AttentionBackend::Tiled).need_weights(true));
      },
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("tiled backend cannot return the attention weights")));
  EXPECT_THAT(
      [&] {
        // Off the CPU (the meta device: shapes without storage, on any build).
        const auto elsewhere = torch::empty({1, 1, 4, 8}, torch::device(torch::kMeta));
        qkv::scaled_dot_product_attention(elsewhere, elsewhere, elsewhere,
                                          qkv::ScaledDotProductAttentionOptions().backend(AttentionBackend::Tiled));
      },
      ::testing::ThrowsMessage<c10::Error>(
          ::testing::HasSubstr("runs on the CPU in float32, float64, bfloat16 or float16, got Float on meta")));
}

}  // namespace
