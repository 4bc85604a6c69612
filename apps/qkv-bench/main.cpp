// qkv-bench: qkv's speed on the cases of apps/qkv-bench/cases.json, timed by Google Benchmark.
// scripts/bench_pytorch.py times the same cases in PyTorch; scripts/bench.sh runs both and
// prints them side by side.
//
//   qkv-bench [--device cpu|cuda] [--threads N] [--list] [--smoke] [Google Benchmark flags]
//   e.g. qkv-bench --benchmark_filter='^toy_train_step$' --benchmark_format=json
//
// Each case reports per-iteration time, FLOP/s (counted as FlashAttention's papers do, see
// flop_count) and peak memory (CUDA: the caching allocator's peak of allocated bytes; CPU: the
// process's peak resident set, which includes LibTorch itself).
#include "bench_cases.h"
#include "common/cli_support.h"

#include <qkv/qkv.h>

#include <benchmark/benchmark.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#if defined(QKV_BENCH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Case {
  std::string name, device, kind, impl, dtype;
  int64_t batch = 0, seq_len = 0, d_model = 0, heads = 1, head_dim = 0, kv_heads = 0;
  int64_t key_len = 0;   // core cases: keys and values S (cross-attention); unset: seq_len
  bool causal = false;
  int64_t window = 0;    // core cases: sliding window (causal); 0: none
  std::string mask;      // core_mask's or module_mask's names; "": none
  double dropout = 0.0;  // core cases: attention dropout while training
  int64_t warmup = 3;    // iterations before timing (1 for the very long cases)
  std::string autocast;  // module cases: "bfloat16" runs the float32 model under autocast (bf16-mixed)
};

bool is_core(const Case& c) { return c.kind.rfind("core_", 0) == 0; }

Case parse_case(const nlohmann::json& j) {
  Case c;
  c.name = j.at("name");
  c.device = j.at("device");
  c.kind = j.at("kind");
  c.impl = j.value("impl", "");
  c.dtype = j.at("dtype");
  c.batch = j.at("batch");
  c.seq_len = j.at("seq_len");
  c.key_len = j.value("key_len", c.seq_len);
  c.d_model = j.value("d_model", int64_t{0});
  c.heads = j.value("heads", int64_t{1});
  c.head_dim = j.value("head_dim", c.heads > 0 && c.d_model > 0 ? c.d_model / c.heads : int64_t{0});
  c.causal = j.value("causal", false);
  c.window = j.value("window", int64_t{0});
  c.mask = j.value("mask", "");
  c.kv_heads = j.value("kv_heads", c.heads);
  c.dropout = j.value("dropout", 0.0);
  c.warmup = j.value("warmup", int64_t{3});
  c.autocast = j.value("autocast", "");
  // Both sides build the causal and window structure for N = S only, and only core cases have keys
  // of their own.
  if (c.key_len != c.seq_len && (!is_core(c) || c.causal || c.window > 0)) {
    throw std::invalid_argument("case " + c.name + ": key_len is for core cases without causal or window");
  }
  return c;
}

qkv::AttentionBackend backend_of(const std::string& impl) {
  if (impl == "fused") return qkv::AttentionBackend::Fused;
  if (impl == "tiled") return qkv::AttentionBackend::Tiled;
  if (impl == "auto") return qkv::AttentionBackend::Auto;
  return qkv::AttentionBackend::Math;
}

bool has_backward(const Case& c) {
  return c.kind != "module_forward" && c.kind != "core_forward" && c.kind != "decode_step" && c.kind != "prefill" &&
         c.kind != "sgemm";
}

// FLOPs of one iteration, as FlashAttention's papers count them: attention forward 4·B·H·N·S·D
// (halved when causal), backward 2.5× forward; each projection 2·tokens·E_in·E_out forward and
// twice that backward (the input's and the weight's gradients). Adam and the loss are not counted.
double flop_count(const Case& c) {
  if (c.kind == "sgemm") return 2.0 * static_cast<double>(c.seq_len) * c.seq_len * c.seq_len;
  if (c.kind == "decode_step" || c.kind == "prefill") return 0.0;  // reported as time per token
  const double batch = static_cast<double>(std::max<int64_t>(c.batch, 1));
  const double n = static_cast<double>(c.seq_len), s = static_cast<double>(c.key_len),
               h = static_cast<double>(c.heads), d = static_cast<double>(c.head_dim);
  // A sliding window of W keys: about N·W score pairs instead of N·S (or N²/2 causal).
  double attention = c.window > 0 ? 4.0 * batch * h * n * std::min(s, static_cast<double>(c.window)) * d
                                  : 4.0 * batch * h * n * s * d * (c.causal ? 0.5 : 1.0);
  double projections = is_core(c) ? 0.0 : 3.0 * 2.0 * batch * n * static_cast<double>(c.d_model * c.d_model);
  if (has_backward(c)) {
    attention *= 1.0 + 2.5;
    projections *= 1.0 + 2.0;
  }
  return attention + projections;
}

// Decoding with the KV cache: one qkv::TransformerBlock (causal, RoPE, grouped-query heads), the
// cache filled to seq_len positions; an iteration decodes one more position and forgets it again
// (decode_step), or fills an empty cache with a prompt of seq_len positions (prefill).
std::function<void()> make_decoding(const Case& c, const torch::Device& device, const torch::TensorOptions& options) {
  auto block = qkv::TransformerBlock(
      qkv::TransformerBlockOptions(c.d_model, c.heads).num_kv_heads(c.kv_heads).rope(true).causal(true));
  block->to(device, options.dtype().toScalarType());
  block->eval();
  const int64_t batch = std::max<int64_t>(c.batch, 1);
  auto cache = std::make_shared<qkv::KVCache>(block->make_cache(batch, c.seq_len + 1));
  const auto prompt = torch::randn({batch, c.seq_len, c.d_model}, options);
  const auto token = torch::randn({batch, 1, c.d_model}, options);
  if (c.kind == "prefill") {
    return [=]() mutable {
      torch::NoGradGuard no_grad;
      cache->reset();
      block->forward_with_cache(prompt, *cache);
    };
  }
  {
    torch::NoGradGuard no_grad;
    block->forward_with_cache(prompt, *cache);
  }
  return [=]() mutable {
    torch::NoGradGuard no_grad;
    block->forward_with_cache(token, *cache);
    cache->truncate(c.seq_len);
  };
}

// A padded batch's key mask, bool (B, S), true = a real key: every other batch row has its last
// quarter of keys padded (the padded batches of a data loader). Both kinds of case pad so.
torch::Tensor padded_batch(int64_t batch, int64_t s, const torch::TensorOptions& options) {
  auto lengths = torch::full({batch}, s, options.dtype(torch::kLong));
  lengths.index_put_({torch::indexing::Slice(1, torch::indexing::None, 2)}, s - s / 4);
  return qkv::key_mask_from_lengths(lengths, s);
}

// A core case's mask, as scripts/bench_pytorch.py builds it:
// - "key_padding": bool (B, 1, 1, S), padded_batch's;
// - "learned_bias": float (1, H, N, S) added to the scores and trained (its gradient taken), as a
//   learned relative-position bias is; "fixed_bias": the same, not trained (ALiBi's).
torch::Tensor core_mask(const Case& c, const torch::TensorOptions& options, bool backward) {
  const int64_t batch = std::max<int64_t>(c.batch, 1), n = c.seq_len, s = c.key_len;
  if (c.mask == "key_padding") return padded_batch(batch, s, options).view({batch, 1, 1, s});
  if (c.mask == "learned_bias" || c.mask == "fixed_bias") {
    return (0.1 * torch::randn({1, c.heads, n, s}, options)).requires_grad_(backward && c.mask == "learned_bias");
  }
  if (!c.mask.empty()) throw std::invalid_argument("case " + c.name + ": unknown mask \"" + c.mask + "\"");
  return {};
}

// A module case's masks, as scripts/bench_pytorch.py builds them: `c.mask` names one or both of
// "key_padding" (key_mask (B, S), padded_batch's) and "learned_bias" (attn_mask (1, H, N, S), a
// per-head bias trained with the model, its gradient taken in backward cases), joined by "+".
qkv::AttentionMask module_mask(const Case& c, const torch::TensorOptions& options, bool backward) {
  qkv::AttentionMask mask;
  if (c.mask.empty()) return mask;
  if (c.batch == 0) throw std::invalid_argument("case " + c.name + ": a module case's masks need a batch");
  const int64_t n = c.seq_len;
  std::stringstream parts(c.mask);
  for (std::string part; std::getline(parts, part, '+');) {
    if (part == "key_padding") {
      mask.key_mask = padded_batch(c.batch, n, options);
    } else if (part == "learned_bias") {
      mask.attn_mask = (0.1 * torch::randn({1, c.heads, n, n}, options)).requires_grad_(backward);
    } else {
      throw std::invalid_argument("case " + c.name + ": unknown module mask \"" + part + "\"");
    }
  }
  return mask;
}

// One iteration of `c`, with everything it needs built once.
std::function<void()> make_iteration(const Case& c, const torch::Device& device) {
  torch::manual_seed(0);
  const auto options = torch::TensorOptions().device(device).dtype(qkv_cli::dtype_from_name(c.dtype));
  if (c.kind == "sgemm") {  // the machine's matrix-product rate, through LibTorch's BLAS
    const auto a = torch::randn({c.seq_len, c.seq_len}, options), b = torch::randn({c.seq_len, c.seq_len}, options);
    return [=]() { torch::mm(a, b); };
  }
  if (c.kind == "decode_step" || c.kind == "prefill") return make_decoding(c, device, options);
  if (is_core(c)) {
    // q, k, v: (B, H, N, D), as the attention core sees them inside the module.
    const std::vector<int64_t> shape{std::max<int64_t>(c.batch, 1), c.heads, c.seq_len, c.head_dim};
    const std::vector<int64_t> kv_shape{std::max<int64_t>(c.batch, 1), c.kv_heads, c.key_len, c.head_dim};
    const bool backward = has_backward(c);
    auto q = torch::randn(shape, options).requires_grad_(backward);
    auto k = torch::randn(kv_shape, options).requires_grad_(backward);
    auto v = torch::randn(kv_shape, options).requires_grad_(backward);
    auto grad_output = torch::randn(shape, options);
    auto mask = core_mask(c, options, backward);
    const auto core_options = qkv::ScaledDotProductAttentionOptions()
                                  .mask(mask)
                                  .causal(c.causal)
                                  .window(c.window > 0 ? c10::optional<int64_t>(c.window) : c10::nullopt)
                                  .enable_gqa(c.kv_heads != c.heads)
                                  .dropout(c.dropout)
                                  .training(c.dropout > 0)
                                  .backend(backend_of(c.impl));
    return [=]() mutable {
      auto out = qkv::scaled_dot_product_attention(q, k, v, core_options).output;
      if (backward) {
        q.mutable_grad() = torch::Tensor(), k.mutable_grad() = torch::Tensor(), v.mutable_grad() = torch::Tensor();
        if (mask.requires_grad()) mask.mutable_grad() = torch::Tensor();
        out.backward(grad_output);
      }
    };
  }
  auto model = qkv::SelfAttention(qkv::SelfAttentionOptions(c.d_model).num_heads(c.heads).causal(c.causal));
  model->to(device, qkv_cli::dtype_from_name(c.dtype));
  const auto input_shape =
      c.batch > 0 ? std::vector<int64_t>{c.batch, c.seq_len, c.d_model} : std::vector<int64_t>{c.seq_len, c.d_model};
  auto x = torch::randn(input_shape, options);
  auto target = torch::randn(input_shape, options);
  const auto mask = module_mask(c, options, has_backward(c));
  if (c.kind == "module_forward") {
    return [=]() mutable {
      torch::NoGradGuard no_grad;
      model->forward(x, {}, mask);
    };
  }
  if (c.kind == "module_forward_backward") {
    return [=]() mutable {
      model->zero_grad();
      if (mask.attn_mask.requires_grad()) mask.attn_mask.mutable_grad() = torch::Tensor();
      torch::mse_loss(model->forward(x, {}, mask), target).backward();
    };
  }
  if (!mask.empty()) {
    throw std::invalid_argument("case " + c.name + ": masks are for core and module_forward(_backward) cases");
  }
  auto optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3));
  const bool mixed = !c.autocast.empty();
  const auto autocast_dtype = mixed ? qkv_cli::dtype_from_name(c.autocast) : torch::kFloat;
  return [=]() mutable {  // train_step: the documents' step plus the optimizer
    optimizer->zero_grad();
    torch::Tensor output;
    {
      // Mixed precision as qkv-train's --precision bf16-mixed: float32 weights and optimizer,
      // the forward's products in the autocast dtype, the loss in float32.
      const qkv::AutocastGuard autocast(device, autocast_dtype, mixed);
      output = model->forward(x);
    }
    auto loss = torch::mse_loss(output.to(torch::kFloat), target.to(torch::kFloat));  // a bfloat16 model's too
    loss.backward();
    optimizer->step();
  };
}

// The case at a size that runs in milliseconds, its structure kept (kind, dtype, heads and
// grouped heads, causal, window, mask, dropout, autocast): what --smoke runs. The same shrinking as
// scripts/bench_pytorch.py --smoke's for the PyTorch side.
Case shrunk(Case c) {
  c.batch = std::min<int64_t>(c.batch, 2);
  c.seq_len = std::min<int64_t>(c.seq_len, 16);
  c.key_len = std::min<int64_t>(c.key_len, 24);  // still unlike seq_len where the case's is
  if (c.d_model > 0) c.d_model = 8 * c.heads;
  c.head_dim = 8;
  if (c.window > 0) c.window = 4;
  c.warmup = 0;
  return c;
}

// --smoke: every case of every device, shrunk, one iteration on `device`. A case this build
// cannot run by design (the fused backend before LibTorch 2.0) is named as skipped; any other
// error fails. Returns the exit status: 0 when every case ran, 1 otherwise.
int run_smoke(const nlohmann::json& cases, const torch::Device& device) {
  int ran = 0, skipped = 0;
  std::vector<std::string> failed;
  for (const auto& entry : cases) {
    const auto c = shrunk(parse_case(entry));
    if (c.impl == "fused" && !qkv::fused_backend_available()) {
      std::printf("skipped %s: the fused backend needs LibTorch >= 2.0 (this is %s)\n", c.name.c_str(), TORCH_VERSION);
      ++skipped;
      continue;
    }
    try {
      make_iteration(c, device)();
      if (device.is_cuda()) torch::cuda::synchronize();
      std::printf("ran %s\n", c.name.c_str());
      ++ran;
    } catch (const std::exception& e) {
      std::string what = e.what();
      what = what.substr(0, what.find('\n'));  // LibTorch appends its stack trace after the first line
      std::printf("FAILED %s: %s\n", c.name.c_str(), what.c_str());
      failed.push_back(c.name);
    }
  }
  std::printf("qkv-bench --smoke on %s: %d ran, %d skipped, %zu failed\n", device.str().c_str(), ran, skipped,
              failed.size());
  return failed.empty() ? 0 : 1;
}

double peak_resident_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024.0;  // Linux: kilobytes
}

void run_case(benchmark::State& state, const Case& c, const torch::Device& device) {
  std::function<void()> iteration;
  const double baseline = peak_resident_bytes();  // LibTorch loaded, nothing of the case allocated
  try {
    iteration = make_iteration(c, device);
    for (int64_t i = 0; i < c.warmup; ++i) iteration();  // warm-up: allocator, kernels' first-call costs
    if (device.is_cuda()) torch::cuda::synchronize();
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
#if defined(QKV_BENCH_CUDA)
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
  for (auto _ : state) {
    if (device.is_cuda()) {
      // Device work is asynchronous: time to the end of it, with the launch included.
      const auto start = std::chrono::steady_clock::now();
      iteration();
      torch::cuda::synchronize();
      state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    } else {
      iteration();
    }
  }
  state.counters["FLOPS"] = benchmark::Counter(flop_count(c), benchmark::Counter::kIsIterationInvariantRate);
  double peak = peak_resident_bytes();
#if defined(QKV_BENCH_CUDA)
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    peak = static_cast<double>(stats.allocated_bytes[0].peak);
  }
#endif
  state.counters["peak_memory_bytes"] = peak;
  if (!device.is_cuda()) state.counters["peak_above_baseline_bytes"] = peak - baseline;
  state.SetLabel(c.device + " " + c.dtype);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);  // takes the --benchmark_* flags out of argv
  CLI::App app{
      "qkv-bench: qkv's speed on the cases of apps/qkv-bench/cases.json (Google Benchmark; its "
      "--benchmark_* flags work too)",
      "qkv-bench"};
  app.option_defaults()->always_capture_default();
  std::string device_name = "cpu";
  int threads = 0;
  bool list = false, list_all = false, blas_advice = false, smoke = false;
  app.add_option("--device", device_name, "Run the cases of this device")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--threads", threads, "CPU threads for LibTorch (0 = its default)")->check(CLI::Range(0, 1024));
  app.add_flag("--list", list, "Print the cases of --device, one per line, and exit");
  app.add_flag("--all", list_all, "With --list: the optional cases too (long memory probes)");
  app.add_flag("--smoke", smoke,
               "Run every case of every device once, shrunk to a few tokens, on --device, and exit: "
               "a check that each case's code runs (0: all ran; 1: names those that failed)");
  app.add_flag("--blas-advice", blas_advice,
               "Print what OpenBLAS's choice of kernels for this CPU needs (an OPENBLAS_CORETYPE, or nothing) and exit");
  if (const auto exit_code = qkv_cli::parse(app, argc, argv)) return *exit_code;
  if (blas_advice) {
    if (const auto advice = qkv::blas_core_advice(); !advice.empty()) std::printf("%s\n", advice.c_str());
    return 0;
  }
  if (device_name == "cuda" && !torch::cuda::is_available()) {
    std::fprintf(stderr, "qkv-bench: --device cuda: no CUDA device is available to this LibTorch (%s)\n",
                 TORCH_VERSION);
    return 1;
  }
  if (threads > 0) torch::set_num_threads(threads);
  const torch::Device device = device_name == "cuda" ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);

  // The kernels' and linear layers' routes as the environment set them: a value qkv refuses ends
  // a run before any case.
  const auto routes_are_valid = [] {
    const auto problem = qkv_cli::route_setting_problem();
    if (!problem.empty()) std::fprintf(stderr, "qkv-bench: %s\n", problem.c_str());
    return problem.empty();
  };
  const auto all = nlohmann::json::parse(qkv_bench::kCasesJson)["cases"];
  if (smoke) return routes_are_valid() ? run_smoke(all, device) : 2;
  for (const auto& entry : all) {
    const auto c = parse_case(entry);
    if (c.device != device_name) continue;
    if (list) {
      if (entry.value("optional", false) && !list_all) continue;
      std::printf("%s\n", c.name.c_str());
      continue;
    }
    auto* registered = benchmark::RegisterBenchmark(
        c.name.c_str(), [c, device](benchmark::State& state) { run_case(state, c, device); });
    registered->Unit(benchmark::kMillisecond);
    if (device.is_cuda()) {
      registered->UseManualTime();
    } else {
      registered->UseRealTime();
    }
  }
  if (list) return 0;
  if (!routes_are_valid()) return 2;
  benchmark::AddCustomContext("torch_version", TORCH_VERSION);
  benchmark::AddCustomContext("torch_threads", std::to_string(torch::get_num_threads()));
  benchmark::AddCustomContext("device", device.str());
  benchmark::AddCustomContext("tiled_isa", qkv::tiled_instruction_set());
  benchmark::AddCustomContext("blas_core", qkv::blas_core());
  benchmark::AddCustomContext("linear_products", qkv::linear_products());
  if (const auto advice = qkv::blas_core_advice(); !advice.empty()) std::fprintf(stderr, "qkv-bench: %s\n", advice.c_str());
  const size_t ran = benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (ran == 0) {  // Google Benchmark said why (no match, or a regex it cannot compile) and returned 0
    std::fprintf(stderr, "qkv-bench: error: --benchmark_filter matched no case of --device %s (--list names them)\n",
                 device_name.c_str());
    return 2;
  }
  return 0;
}
