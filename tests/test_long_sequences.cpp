// Long sequences: sliding-window attention on every backend against a band mask written out by
// hand, the rolling KV cache against one windowed forward over the whole sequence (across the
// wrap, one token at a time and in chunks, in constant memory), and activation checkpointing
// against the plain block (bit-identical gradients in float64 with dropout on, and what the
// autograd graph keeps).
//
// B = batch, H = query heads, Hkv = key/value heads, N = queries, S = keys, D = head width, W = window.
#include "support/fixtures.h"

#include <gmock/gmock.h>

#include <limits>
#include <set>

namespace {

using qkv::AttentionBackend;
using ::testing::HasSubstr;

// The band by its definition, element by element: key j is visible to query i when i - W < j <= i.
torch::Tensor band_by_hand(int64_t N, int64_t S, int64_t W) {
  auto band = torch::zeros({N, S}, torch::kBool);
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t j = 0; j < S; ++j) band[i][j] = j <= i && j > i - W;
  }
  return band;
}

struct Result {
  torch::Tensor output, grad_q, grad_k, grad_v;
};

Result run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& upstream,
           const qkv::ScaledDotProductAttentionOptions& options) {
  auto q_ = q.clone().requires_grad_(true), k_ = k.clone().requires_grad_(true), v_ = v.clone().requires_grad_(true);
  const auto out = qkv::scaled_dot_product_attention(q_, k_, v_, options).output;
  (out * upstream).sum().backward();
  return {out.detach(), q_.grad(), k_.grad(), v_.grad()};
}

// Outputs and every gradient of window(W) on every backend equal the math path with the band
// mask built by hand, for W = 1, 2, odd, and wider than the sequence (= full causal attention),
// grouped heads and N != S included; float64 within 1e-10, float32 within 1e-5.
TEST(SlidingWindow, EveryBackendEqualsTheBandMaskByHand) {
  struct Shape {
    int64_t B, H, Hkv, N, S, D;
  };
  for (const auto& s : {Shape{2, 4, 2, 70, 70, 16}, Shape{1, 2, 1, 300, 300, 8}, Shape{2, 2, 2, 40, 90, 5},
                        Shape{1, 3, 3, 90, 40, 7}}) {
    for (const int64_t W : {int64_t{1}, int64_t{2}, int64_t{17}, int64_t{65}, s.N + s.S}) {
      for (const auto dtype : {torch::kDouble, torch::kFloat}) {
        torch::manual_seed(W);
        const auto q = torch::randn({s.B, s.H, s.N, s.D}, dtype), k = torch::randn({s.B, s.Hkv, s.S, s.D}, dtype);
        const auto v = torch::randn({s.B, s.Hkv, s.S, s.D}, dtype), upstream = torch::randn({s.B, s.H, s.N, s.D}, dtype);
        const auto by_hand = run(
            q, k, v, upstream,
            qkv::ScaledDotProductAttentionOptions().mask(band_by_hand(s.N, s.S, W)).enable_gqa(true).backend(
                AttentionBackend::Math));
        const double tolerance = dtype == torch::kDouble ? 1e-10 : 1e-5;
        for (const auto backend : {AttentionBackend::Auto, AttentionBackend::Math, AttentionBackend::Tiled,
                                   AttentionBackend::Fused}) {
          if (backend == AttentionBackend::Fused && !qkv::fused_backend_available()) continue;
          const auto windowed = run(
              q, k, v, upstream,
              qkv::ScaledDotProductAttentionOptions().causal(true).window(W).enable_gqa(true).backend(backend));
          const std::string what = "N=" + std::to_string(s.N) + " S=" + std::to_string(s.S) + " W=" +
                                   std::to_string(W) + " " + qkv::to_string(backend) + " " + c10::toString(dtype);
          const double scale = std::max({qkv_test::max_abs(by_hand.grad_q), qkv_test::max_abs(by_hand.grad_k),
                                         qkv_test::max_abs(by_hand.grad_v)});
          EXPECT_TRUE(qkv_test::tensors_close(windowed.output, by_hand.output, tolerance)) << what;
          EXPECT_TRUE(qkv_test::tensors_close(windowed.grad_q, by_hand.grad_q, tolerance, scale)) << what;
          EXPECT_TRUE(qkv_test::tensors_close(windowed.grad_k, by_hand.grad_k, tolerance, scale)) << what;
          EXPECT_TRUE(qkv_test::tensors_close(windowed.grad_v, by_hand.grad_v, tolerance, scale)) << what;
        }
      }
    }
  }
}

TEST(SlidingWindow, AWindowAsWideAsTheSequenceIsFullCausalAttention) {
  torch::manual_seed(3);
  const auto q = torch::randn({2, 2, 50, 8}, torch::kDouble), k = torch::randn({2, 2, 50, 8}, torch::kDouble);
  const auto v = torch::randn({2, 2, 50, 8}, torch::kDouble), upstream = torch::randn({2, 2, 50, 8}, torch::kDouble);
  const auto causal = run(q, k, v, upstream, qkv::ScaledDotProductAttentionOptions().causal(true));
  for (const int64_t W : {50, 51, 1000}) {
    const auto windowed = run(q, k, v, upstream, qkv::ScaledDotProductAttentionOptions().causal(true).window(W));
    EXPECT_TRUE(torch::equal(windowed.output, causal.output)) << W;
    EXPECT_TRUE(torch::equal(windowed.grad_k, causal.grad_k)) << W;
  }
}

// Central differences in float64 through the tiled kernel with a window of 3, grouped heads,
// N != S and a float mask.
TEST(SlidingWindow, TiledGradientsMatchFiniteDifferences) {
  torch::manual_seed(5);
  auto q = torch::randn({1, 4, 9, 3}, torch::kDouble), k = torch::randn({1, 2, 7, 3}, torch::kDouble);
  auto v = torch::randn({1, 2, 7, 3}, torch::kDouble);
  const auto mask = torch::randn({9, 7}, torch::kDouble), upstream = torch::randn({1, 4, 9, 3}, torch::kDouble);
  const auto options = qkv::ScaledDotProductAttentionOptions().causal(true).window(3).mask(mask).enable_gqa(true).backend(
      AttentionBackend::Tiled);
  const auto analytic = run(q, k, v, upstream, options);
  auto loss = [&] { return (qkv::scaled_dot_product_attention(q, k, v, options).output * upstream).sum().item<double>(); };
  double scale = std::max({qkv_test::max_abs(analytic.grad_q), qkv_test::max_abs(analytic.grad_k),
                           qkv_test::max_abs(analytic.grad_v)});
  for (auto [tensor, grad] : {std::pair{&q, analytic.grad_q}, std::pair{&k, analytic.grad_k}, std::pair{&v, analytic.grad_v}}) {
    auto numeric = torch::zeros_like(*tensor);
    auto flat = tensor->view(-1);
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const double original = flat[i].item<double>();
      flat[i] = original + 1e-6;
      const double plus = loss();
      flat[i] = original - 1e-6;
      const double minus = loss();
      flat[i] = original;
      numeric.view(-1)[i] = (plus - minus) / 2e-6;
    }
    EXPECT_TRUE(qkv_test::tensors_close(grad, numeric, 1e-7, scale));
  }
}

TEST(SlidingWindow, MisuseIsRefusedNamingTheCondition) {
  EXPECT_THAT([] { qkv::SelfAttention(qkv::SelfAttentionOptions(16).num_heads(2).window(4)); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("needs causal(true)")));
  EXPECT_THAT([] { qkv::SelfAttention(qkv::SelfAttentionOptions(16).causal(true).window(0)); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("at least 1 position, got 0")));
  const auto q = torch::randn({1, 1, 4, 8});
  EXPECT_THAT([&] { qkv::scaled_dot_product_attention(q, q, q, qkv::ScaledDotProductAttentionOptions().window(2)); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("needs causal(true)")));
}

// ---- The rolling KV cache ----

// What a module gives for the positions of x (B, L, E) fed in pieces of `schedule` through one cache.
torch::Tensor decode(qkv::SelfAttention& module, const torch::Tensor& x, const std::vector<int64_t>& schedule,
                     qkv::KVCache& cache) {
  std::vector<torch::Tensor> pieces;
  int64_t at = 0;
  for (const auto count : schedule) {
    pieces.push_back(module->forward_with_cache(x.narrow(1, at, count), cache));
    at += count;
  }
  return torch::cat(pieces, 1);
}

// 3 × W tokens, one at a time and in chunks (some longer than W), equal one windowed causal
// forward over the whole sequence (float64 within 1e-10), RoPE and grouped heads included; the
// cache keeps W slots in one storage throughout.
TEST(RollingCache, DecodingAcrossTheWrapEqualsOneWindowedForward) {
  const int64_t W = 8, length = 3 * W;
  for (const bool rope : {false, true}) {
    torch::manual_seed(21);
    qkv::SelfAttention module(qkv::SelfAttentionOptions(32).num_heads(4).num_kv_heads(2).rope(rope).causal(true).window(W).out_proj(true));
    module->to(torch::kDouble);
    module->eval();
    torch::NoGradGuard no_grad;
    const auto x = torch::randn({2, length, 32}, torch::kDouble);
    const auto full = module(x);  // one windowed forward over all 24 positions
    for (const auto& schedule : std::vector<std::vector<int64_t>>{std::vector<int64_t>(length, 1),
                                                                   {5, 1, 1, 7, 1, 9},
                                                                   {3, 12, 1, 1, 7},
                                                                   {24}}) {
      auto cache = module->make_cache(/*batch=*/2, /*capacity=*/1000);
      ASSERT_TRUE(cache.rolling());
      EXPECT_EQ(cache.capacity(), W);
      const int64_t bytes = cache.storage_bytes();
      EXPECT_EQ(bytes, 2 * 2 * 2 * W * 8 * 8) << "keys and values: B 2, Hkv 2, W slots, D 8, float64";
      const auto decoded = decode(module, x, schedule, cache);
      EXPECT_TRUE(qkv_test::tensors_close(decoded, full, 1e-10)) << "rope " << rope << ", " << schedule.size() << " calls";
      EXPECT_EQ(cache.length(), length);
      EXPECT_EQ(cache.held(), W);
      EXPECT_EQ(cache.storage_bytes(), bytes) << "the cache grew";
    }
  }
}

TEST(RollingCache, MisuseIsRefusedAndChangesNothing) {
  torch::manual_seed(22);
  qkv::SelfAttention windowed(qkv::SelfAttentionOptions(16).num_heads(2).causal(true).window(4));
  qkv::SelfAttention full(qkv::SelfAttentionOptions(16).num_heads(2).causal(true));
  qkv::SelfAttention other_window(qkv::SelfAttentionOptions(16).num_heads(2).causal(true).window(5));
  torch::NoGradGuard no_grad;
  auto cache = windowed->make_cache(1, 100);
  windowed->forward_with_cache(torch::randn({1, 6, 16}), cache);  // wrapped: 6 positions in 4 slots
  EXPECT_THAT([&] { full->forward_with_cache(torch::randn({1, 1, 16}), cache); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("rolls over a window of 4 positions")));
  EXPECT_THAT([&] { other_window->forward_with_cache(torch::randn({1, 1, 16}), cache); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("this module's window is 5")));
  EXPECT_THAT([&] { cache.truncate(5); }, ::testing::ThrowsMessage<c10::Error>(HasSubstr("are overwritten")));
  EXPECT_EQ(cache.length(), 6);
  qkv::SelfAttention cross(qkv::SelfAttentionOptions(16).causal(true).window(4).kdim(8).vdim(8));
  EXPECT_THAT([&] { cross->forward_with_cache(torch::randn({1, 1, 16}), cache); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("cross-attention")));
  // A capacity within the window needs no rolling: a plain cache.
  EXPECT_FALSE(windowed->make_cache(1, 4).rolling());
}

// ---- Activation checkpointing ----

// Counts the autograd nodes behind `t`: a checkpointed block leaves one node where the plain
// block leaves its whole graph, and with it the tensors those nodes save.
int64_t graph_nodes(const torch::Tensor& t) {
  std::set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack{t.grad_fn().get()};
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    for (const auto& edge : node->next_edges()) stack.push_back(edge.function.get());
  }
  return static_cast<int64_t>(seen.size());
}

// `to` takes `from`'s parameters (two blocks of the same options, checkpointed or not).
void copy_parameters(const qkv::TransformerBlockImpl& from, qkv::TransformerBlockImpl& to) {
  std::map<std::string, torch::Tensor> weights;
  for (const auto& item : from.named_parameters()) weights[item.key()] = item.value().detach();
  qkv::load_state_dict(to, weights, "plain block");
}

// The checkpointed block's gradients are bit-identical to the plain block's in float64 with
// dropout on (the recomputation replays the forward's dropout masks), for the input, every
// parameter and a learned float mask.
TEST(ActivationCheckpointing, GradientsAreBitIdenticalToThePlainBlockWithDropout) {
  // 40 rows: three projection products; 80: one (SelfAttention::project_self), in the forward
  // without autograd and in its recomputation with it alike.
  for (const auto& [window, N] : std::vector<std::pair<bool, int64_t>>{{false, 20}, {true, 20}, {false, 40}}) {
    SCOPED_TRACE("window " + std::to_string(window) + ", N " + std::to_string(N));
    auto options = qkv::TransformerBlockOptions(32, 4).num_kv_heads(2).rope(true).causal(true).dropout(0.2);
    if (window) options.window(5);
    torch::manual_seed(31);
    qkv::TransformerBlock plain(options);
    qkv::TransformerBlock checkpointed(options.checkpoint(true));
    plain->to(torch::kDouble), checkpointed->to(torch::kDouble);
    copy_parameters(*plain, *checkpointed);
    const auto x = torch::randn({2, N, 32}, torch::kDouble), upstream = torch::randn({2, N, 32}, torch::kDouble);
    const auto bias = torch::randn({N, N}, torch::kDouble);
    auto run_block = [&](qkv::TransformerBlock& block, int64_t* nodes) {
      auto input = x.clone().requires_grad_(true), learned = bias.clone().requires_grad_(true);
      torch::manual_seed(7);  // the same dropout stream for both
      auto out = block(input, qkv::AttentionMask::from_attn_mask(learned));
      if (nodes != nullptr) *nodes = graph_nodes(out);
      (out * upstream).sum().backward();
      std::vector<torch::Tensor> grads{out.detach(), input.grad(), learned.grad()};
      for (const auto& p : block->parameters()) grads.push_back(p.grad());
      return grads;
    };
    int64_t plain_nodes = 0, checkpointed_nodes = 0;
    const auto expected = run_block(plain, &plain_nodes);
    const auto actual = run_block(checkpointed, &checkpointed_nodes);
    ASSERT_EQ(actual.size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      ASSERT_TRUE(actual[i].defined()) << i;
      EXPECT_TRUE(torch::equal(actual[i], expected[i])) << "tensor " << i << " (0 output, 1 input, 2 mask, then parameters)";
    }
    // The plain block's graph holds dozens of nodes (each saving its inputs); the checkpointed one
    // holds one node for the block, plus the leaves' accumulators.
    EXPECT_GT(plain_nodes, 40);
    EXPECT_LE(checkpointed_nodes, 2 + static_cast<int64_t>(checkpointed->parameters().size()) + 1);
  }
}

// Under bfloat16 autocast every parameter of the checkpointed block gets the plain block's
// gradient. LibTorch's autocast caches its casts of the weights (Apex's heuristic); a cast made by
// a checkpoint's forward, which runs without autograd, has no history, and the recomputation that
// reused it gave the weights it stood for no gradient at all (W_k's bias at 7 positions; found by
// ModuleAgrees, 2026-12-05). Bit for bit: the tiled kernel's bfloat16 forward gives the same output
// whether a backward follows or not (Tiled.BFloat16ForwardIsTheSameWhetherABackwardFollowsOrNot),
// which the nested checkpoints' recomputation needs, since it feeds the MLP the output of the
// forward that ran without autograd (before that was so, they differed by a bfloat16 ulp or two:
// W_v's bias gradient by 0.125).
TEST(ActivationCheckpointing, UnderAutocastEveryParameterGetsThePlainBlocksGradient) {
  for (const bool bias : {true, false}) {
    for (const int64_t N : {int64_t{7}, int64_t{130}}) {  // LibTorch's products and qkv's GEMM route
      SCOPED_TRACE("bias " + std::to_string(bias) + ", N " + std::to_string(N));
      auto options = qkv::TransformerBlockOptions(16, 2).rope(true).causal(true).mlp_ratio(2).bias(bias);
      torch::manual_seed(33);
      qkv::TransformerBlock plain(options);
      qkv::TransformerBlock checkpointed(options.checkpoint(true));
      copy_parameters(*plain, *checkpointed);
      const auto x = torch::randn({2, N, 16}), upstream = torch::randn({2, N, 16});
      auto run_block = [&](qkv::TransformerBlock& block) {
        auto input = x.clone().requires_grad_(true);
        torch::Tensor out;
        {
          const qkv::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
          out = block(input);
        }
        (out.to(torch::kFloat) * upstream).sum().backward();
        std::map<std::string, torch::Tensor> grads{{"output", out.detach()}, {"input", input.grad()}};
        for (const auto& item : block->named_parameters()) grads[item.key()] = item.value().grad();
        return grads;
      };
      const auto expected = run_block(plain), actual = run_block(checkpointed);
      for (const auto& [name, grad] : expected) {
        ASSERT_TRUE(grad.defined()) << name;
        ASSERT_TRUE(actual.at(name).defined()) << name << ": no gradient";
        EXPECT_TRUE(torch::equal(actual.at(name), grad))
            << name << ": largest difference "
            << (actual.at(name).to(torch::kFloat) - grad.to(torch::kFloat)).abs().max().item<float>();
      }
    }
  }
}

// A weight a checkpointed function reads and the code after it reads again, in one autocast
// region (weights tied, as an embedding and an output layer often are): its gradient has both
// uses, as without the checkpoint.
TEST(ActivationCheckpointing, AWeightUsedAgainAfterTheCheckpointUnderAutocastGetsBothGradients) {
  torch::manual_seed(34);
  torch::nn::Linear shared(8, 8);
  const auto x = torch::randn({4, 8});
  auto run = [&](bool checkpointed) {
    shared->zero_grad();
    torch::Tensor out;
    {
      const qkv::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      auto inner = [&](const std::vector<torch::Tensor>& in) { return torch::relu(shared(in[0])); };
      const auto input = x.clone().requires_grad_(true);
      const auto h = checkpointed ? qkv::checkpoint(inner, {input}, shared->parameters()) : inner({input});
      out = shared(h);  // the same weight again, after the checkpoint
    }
    out.to(torch::kFloat).sum().backward();
    return std::make_pair(shared->weight.grad().clone(), shared->bias.grad().clone());
  };
  const auto plain = run(false), checkpointed = run(true);
  // Within bfloat16's rounding: with the cache, both uses share one cast, whose two gradients are
  // added in bfloat16; without it, each use's cast adds its own in float32.
  const double tolerance = qkv_test::tolerance_for(torch::kBFloat16, 8);
  EXPECT_TRUE(qkv_test::tensors_close(checkpointed.first, plain.first, tolerance)) << "weight";
  EXPECT_TRUE(qkv_test::tensors_close(checkpointed.second, plain.second, tolerance)) << "bias";
}

TEST(ActivationCheckpointing, InferenceAndNoGradRunThePlainForward) {
  torch::manual_seed(32);
  qkv::TransformerBlock block(qkv::TransformerBlockOptions(16, 2).causal(true).checkpoint(true));
  const auto x = torch::randn({1, 5, 16});
  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = block(x);
  }
  EXPECT_FALSE(out.requires_grad());
  block->options.checkpoint(false);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(out, block(x)));
}

}  // namespace
