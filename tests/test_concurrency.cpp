// Several threads of one program using qkv at once: a server answering requests from a thread
// pool with one model, or a program training several models side by side. LibTorch keeps grad
// mode and autocast per thread, and qkv's kernels keep their scratch per thread (thread_local);
// nothing else may be shared between calls. Every thread's results must equal, bit for bit, what
// the same calls give one after another on the main thread (the kernels' results do not depend on
// which thread runs which of their tasks: Tiled.ResultsDoNotDependOnWhichThreadRanATask), and
// those must match the module copied to float64, so that the comparison is not only of qkv with
// itself.
#include "support/compare.h"

#include <qkv/precision.h>
#include <qkv/qkv.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <exception>
#include <string>
#include <thread>
#include <vector>

namespace concurrency {

constexpr int kThreads = 4;

// body(t) for t < kThreads, on kThreads threads that start it together; the first exception
// thrown on any of them is thrown here, after all have ended.
template <typename Body>
void on_threads_at_once(const Body& body) {
  std::vector<std::exception_ptr> errors(kThreads);
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      try {
        body(t);
      } catch (...) {
        errors[static_cast<size_t>(t)] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (const auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

enum class Precision { Float32, Bfloat16Autocast };
const char* name_of(Precision precision) { return precision == Precision::Float32 ? "float32" : "bf16 autocast"; }

// A block and a self-attention module in eval mode on one input, under the precision asked for,
// without autograd: what a server thread runs.
struct Served {
  qkv::TransformerBlock block;
  qkv::SelfAttention attention;

  std::pair<torch::Tensor, torch::Tensor> answer(const torch::Tensor& x, const torch::Tensor& key_lengths,
                                                 Precision precision) {
    torch::NoGradGuard no_grad;
    c10::optional<qkv::AutocastGuard> autocast;
    if (precision == Precision::Bfloat16Autocast) autocast.emplace(torch::kCPU, torch::kBFloat16);
    return {block(x), attention->forward(x, torch::Tensor(), qkv::AttentionMask::from_lengths(key_lengths))};
  }
};

Served make_served() {
  // Grouped heads, RoPE and causal attention in the block; an output map and key lengths (a
  // padded batch) in the plain module; 300 positions: more than one key block of the tiled kernel,
  // and linear layers on the GEMM route (600 rows).
  Served served{qkv::TransformerBlock(qkv::TransformerBlockOptions(64, 4).num_kv_heads(2).rope(true).causal(true)),
                qkv::SelfAttention(qkv::SelfAttentionOptions(64).num_heads(4).out_proj(true))};
  served.block->eval();
  served.attention->eval();
  return served;
}

TEST(Concurrency, OneModuleAnswersSeveralThreadsAtOnce) {
  torch::manual_seed(61);
  Served served = make_served();
  std::vector<torch::Tensor> inputs, key_lengths;
  for (int t = 0; t < kThreads; ++t) {
    inputs.push_back(torch::randn({2, 300, 64}));
    key_lengths.push_back(torch::tensor({int64_t{300} - 7 * t, int64_t{150} + t}, torch::kLong));
  }
  const std::vector<Precision> precisions{Precision::Float32, Precision::Bfloat16Autocast};

  // One after another on this thread, checked against float64 copies of the modules.
  Served float64{std::dynamic_pointer_cast<qkv::TransformerBlockImpl>(served.block->clone()),
                 std::dynamic_pointer_cast<qkv::SelfAttentionImpl>(served.attention->clone())};
  float64.block->to(torch::kDouble);
  float64.attention->to(torch::kDouble);
  std::vector<std::vector<std::pair<torch::Tensor, torch::Tensor>>> alone(precisions.size());
  for (size_t p = 0; p < precisions.size(); ++p) {
    for (int t = 0; t < kThreads; ++t) {
      alone[p].push_back(served.answer(inputs[t], key_lengths[t], precisions[p]));
      const auto reference = float64.answer(inputs[t].to(torch::kDouble), key_lengths[t], Precision::Float32);
      // The tolerance of the longest sum: the MLP's 256 hidden features, the 300 keys.
      const double tolerance =
          qkv_test::tolerance_for(precisions[p] == Precision::Float32 ? torch::kFloat : torch::kBFloat16, 300);
      EXPECT_LT(qkv_test::relative_error(alone[p][t].first.to(torch::kDouble), reference.first), tolerance)
          << name_of(precisions[p]) << ", input " << t << ": the block against float64";
      EXPECT_LT(qkv_test::relative_error(alone[p][t].second.to(torch::kDouble), reference.second), tolerance)
          << name_of(precisions[p]) << ", input " << t << ": the attention against float64";
    }
  }

  // Now every thread at once, each going through every input and both precisions in its own
  // order, three times.
  constexpr int kRepetitions = 3;
  std::vector<std::vector<std::vector<std::pair<torch::Tensor, torch::Tensor>>>> at_once(
      kThreads, std::vector<std::vector<std::pair<torch::Tensor, torch::Tensor>>>(
                    precisions.size(), std::vector<std::pair<torch::Tensor, torch::Tensor>>(kThreads)));
  on_threads_at_once([&](int thread) {
    for (int repetition = 0; repetition < kRepetitions; ++repetition) {
      for (int i = 0; i < kThreads; ++i) {
        const int input = (thread + i) % kThreads;
        for (size_t q = 0; q < precisions.size(); ++q) {
          const size_t p = (q + static_cast<size_t>(thread + repetition)) % precisions.size();
          auto answer = served.answer(inputs[input], key_lengths[input], precisions[p]);
          auto& kept = at_once[thread][p][input];
          if (repetition == 0) {
            kept = answer;
          } else if (!torch::equal(kept.first, answer.first) || !torch::equal(kept.second, answer.second)) {
            throw std::runtime_error("thread " + std::to_string(thread) + ": repetition " + std::to_string(repetition) +
                                     " of input " + std::to_string(input) + " differs");
          }
        }
      }
    }
  });
  for (int thread = 0; thread < kThreads; ++thread) {
    for (size_t p = 0; p < precisions.size(); ++p) {
      for (int t = 0; t < kThreads; ++t) {
        EXPECT_TRUE(torch::equal(at_once[thread][p][t].first, alone[p][t].first))
            << "thread " << thread << ", " << name_of(precisions[p]) << ", input " << t << ": the block";
        EXPECT_TRUE(torch::equal(at_once[thread][p][t].second, alone[p][t].second))
            << "thread " << thread << ", " << name_of(precisions[p]) << ", input " << t << ": the attention";
      }
    }
  }
}

TEST(Concurrency, EachThreadDecodesWithItsOwnCache) {
  // One causal block, one KV cache per thread (one per conversation), decoding a 40-position
  // prompt and then 30 tokens one at a time; each thread's outputs equal the sequential decoding
  // of the same sequence and the block's one forward over it.
  torch::manual_seed(62);
  qkv::TransformerBlock block(qkv::TransformerBlockOptions(64, 4).num_kv_heads(2).rope(true).causal(true));
  block->eval();
  constexpr int64_t kPrompt = 40, kLength = 70;
  std::vector<torch::Tensor> sequences;
  for (int t = 0; t < kThreads; ++t) sequences.push_back(torch::randn({1, kLength, 64}));
  const auto decode = [&](const torch::Tensor& sequence) {
    torch::NoGradGuard no_grad;
    auto cache = block->make_cache(1, kLength);
    std::vector<torch::Tensor> pieces{block->forward_with_cache(sequence.narrow(1, 0, kPrompt), cache)};
    for (int64_t position = kPrompt; position < kLength; ++position) {
      pieces.push_back(block->forward_with_cache(sequence.narrow(1, position, 1), cache));
    }
    return torch::cat(pieces, 1);
  };
  std::vector<torch::Tensor> alone;
  for (int t = 0; t < kThreads; ++t) {
    alone.push_back(decode(sequences[t]));
    torch::NoGradGuard no_grad;
    EXPECT_LT(qkv_test::relative_error(alone[t], block(sequences[t])), qkv_test::tolerance_for(torch::kFloat, 256))
        << "sequence " << t << ": decoding against the block's forward";
  }
  std::vector<torch::Tensor> at_once(kThreads);
  on_threads_at_once([&](int thread) { at_once[thread] = decode(sequences[thread]); });
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_TRUE(torch::equal(at_once[t], alone[t])) << "thread " << t << ": decoded alongside the others";
  }
}

TEST(Concurrency, SeparateModulesTrainOnSeveralThreadsAtOnce) {
  // Each thread trains its own copy of one block (the same initial weights) on its own data: 3
  // steps of SGD with momentum, in float32 on even threads and under bfloat16 autocast on odd ones
  // (SGD rather than Adam: its steps are in proportion to the gradients, so the float32 training
  // stays within float32's rounding of the float64 one, where Adam's first steps turn a gradient's
  // rounding noise into a step of the full learning rate wherever the gradient is near 0). Without
  // dropout: its draws come from LibTorch's one default generator, whose sequence threads would
  // share in whatever order they ran. Each copy ends with the parameters the same training gives
  // on this thread alone, and the float32 trainings end near a float64 one.
  torch::manual_seed(63);
  const qkv::TransformerBlock initial(qkv::TransformerBlockOptions(64, 4).rope(true).causal(true));
  std::vector<torch::Tensor> inputs, targets;
  for (int t = 0; t < kThreads; ++t) {
    inputs.push_back(torch::randn({2, 150, 64}));
    targets.push_back(torch::randn({2, 150, 64}));
  }
  const auto train = [&](int t, torch::ScalarType dtype) {
    auto block = std::dynamic_pointer_cast<qkv::TransformerBlockImpl>(initial->clone());
    block->to(dtype);
    torch::optim::SGD optimizer(block->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 3; ++step) {
      optimizer.zero_grad();
      torch::Tensor loss;
      {
        c10::optional<qkv::AutocastGuard> autocast;
        if (t % 2 == 1 && dtype == torch::kFloat) autocast.emplace(torch::kCPU, torch::kBFloat16);
        loss = torch::mse_loss(block->forward(inputs[t].to(dtype)).to(dtype), targets[t].to(dtype));
      }
      loss.backward();
      optimizer.step();
    }
    return torch::nn::utils::parameters_to_vector(block->parameters()).detach();
  };
  std::vector<torch::Tensor> alone;
  for (int t = 0; t < kThreads; ++t) alone.push_back(train(t, torch::kFloat));
  for (int t = 0; t < kThreads; t += 2) {
    const auto reference = train(t, torch::kDouble);
    EXPECT_LT(qkv_test::relative_error(alone[t].to(torch::kDouble), reference), 1e-5)
        << "thread " << t << "'s float32 training against float64";
  }
  std::vector<torch::Tensor> at_once(kThreads);
  on_threads_at_once([&](int thread) { at_once[thread] = train(thread, torch::kFloat); });
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(at_once[t].sizes(), alone[t].sizes());
    EXPECT_TRUE(torch::equal(at_once[t], alone[t]))
        << "thread " << t << " (" << (t % 2 == 1 ? "bf16 autocast" : "float32") << "): trained alongside the others";
  }
}

}  // namespace concurrency
