// Linear layers on oneDNN's GEMM (src/linear.h, src/kernels/linear/onednn_gemm.h) against a
// float64 at::linear of the same values: the output and the gradients of the input, the weight and
// the bias, for inputs and weights as views with every layout the route accepts or normalises
// (contiguous, transposed, sliced, of no unit stride, broadcast), odd sizes, with and without bias; second-order
// gradients; the bfloat16 route under CPU autocast against float64 of the bfloat16-rounded
// operands, and its rounding against c10::BFloat16's; and what stays on LibTorch's route (float64,
// a 1-D input, small products). Also the MLP's GELU on bfloat16 (src/activation.h).
#include "activation.h"
#include "kernels/linear/products.h"
#include "kernels/linear/onednn_gemm.h"
#include "kernels/tiled/cpu_features.h"
#include "linear.h"
#include "torch_compat.h"

#include "support/compare.h"
#include "support/fixtures.h"

#include <qkv/functional.h>
#include <qkv/precision.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

using qkv::kernels::linear::LinearGemmChoice;
using qkv::kernels::linear::OneDnnGemm;
using qkv_test::max_abs;
using qkv_test::relative_error;
using qkv_test::tolerance_for;

// Written here apart from onednn_gemm.cpp's own lookup, so that the test does not check that code with itself.
std::string loaded_onednn() {
  std::string found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        const char* name = info->dlpi_name ? info->dlpi_name : "";
        if (std::strstr(name, "libdnnl.so")) *static_cast<std::string*>(out) = name;
        return 0;
      },
      &found);
  return found;
}
bool onednn_loaded() { return !loaded_onednn().empty(); }

// The loaded oneDNN's version as dnnl_version() gives it ({-1, -1, -1} where it cannot be read).
std::array<int, 3> loaded_onednn_version() {
  struct Version {
    int major, minor, patch;
    const char* hash;
  };
  void* handle = dlopen(loaded_onednn().c_str(), RTLD_LAZY | RTLD_NOLOAD);
  void* symbol = handle ? dlsym(handle, "dnnl_version") : nullptr;
  const auto* version = symbol ? reinterpret_cast<const Version* (*)()>(symbol)() : nullptr;
  return version ? std::array<int, 3>{version->major, version->minor, version->patch} : std::array<int, 3>{-1, -1, -1};
}

std::string linear_grad_fn_name(const torch::Tensor& t) { return t.grad_fn() ? t.grad_fn()->name() : "(none)"; }

// Whether y's autograd graph, within its first few nodes, has one named like `name`.
bool graph_has(const torch::Tensor& y, const std::string& name) {
  // Raw pointers: grad_fn() is a shared_ptr before LibTorch 2.10, an intrusive_ptr after.
  std::vector<torch::autograd::Node*> nodes{y.grad_fn().get()};
  for (int depth = 0; depth < 3 && !nodes.empty(); ++depth) {
    std::vector<torch::autograd::Node*> next;
    for (const auto& node : nodes) {
      if (!node) continue;
      if (node->name().find(name) != std::string::npos) return true;
      for (const auto& edge : node->next_edges()) next.push_back(edge.function.get());
    }
    nodes = std::move(next);
  }
  return false;
}

// The layouts an operand can come in: the same values, stored differently.
enum class OperandLayout { Contiguous, Transposed, Sliced, Strided, Expanded };

const char* operand_layout_name(OperandLayout layout) {
  switch (layout) {
    case OperandLayout::Contiguous: return "contiguous";
    case OperandLayout::Transposed: return "transposed";
    case OperandLayout::Sliced: return "sliced";
    case OperandLayout::Strided: return "every other column";
    case OperandLayout::Expanded: return "expanded";
  }
  return "?";
}

// A leaf holding `values` (rows × cols, or B × rows × cols) stored as `layout`, requiring grad.
torch::Tensor linear_operand_as(const torch::Tensor& values, OperandLayout layout) {
  torch::Tensor leaf;
  switch (layout) {
    case OperandLayout::Contiguous: leaf = values.clone(); break;
    case OperandLayout::Transposed: leaf = values.transpose(-1, -2).contiguous().transpose(-1, -2); break;
    case OperandLayout::Sliced: {
      auto sizes = values.sizes().vec();
      sizes.back() += 5;
      auto wide = torch::zeros(sizes, values.options());
      wide.narrow(-1, 2, values.size(-1)).copy_(values);
      leaf = wide.narrow(-1, 2, values.size(-1));
      break;
    }
    case OperandLayout::Strided: {  // no unit stride in either dimension
      auto sizes = values.sizes().vec();
      sizes.back() *= 2;
      auto wide = torch::zeros(sizes, values.options());
      leaf = wide.slice(-1, 1, sizes.back(), 2);
      leaf.copy_(values);
      break;
    }
    case OperandLayout::Expanded: leaf = values.clone(); break;
  }
  return leaf.detach().requires_grad_(true);
}

struct LinearResult {
  torch::Tensor y, grad_x, grad_w, grad_b;
};

// y = linear(x, w, b) and the gradients of sum(y · probe), with linear given as `f`.
template <typename F>
LinearResult run(F f, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, const torch::Tensor& probe,
           bool expanded_input) {
  const auto input = expanded_input ? x.expand({3, x.size(-2), x.size(-1)}) : x;  // a broadcast view: stride 0
  const auto y = f(input, w, b);
  (y * probe).sum().backward();
  return {y.detach(), x.grad().clone(), w.grad().clone(), b.defined() ? b.grad().clone() : torch::Tensor()};
}

TEST(Linear, FindsTheOneDnnLibTorchLoaded) {
  // Debian's LibTorch links libdnnl: the route must find it there and say which one it is, and take
  // its float32 GEMM only from a oneDNN with the fix for issue #4845 (3.11.2, 3.12.0 and later, by
  // oneDNN's release notes: Debian unstable's 3.12.1; not Debian 12's 2.6.3 or 13's 3.7.2), unless
  // QKV_LINEAR_GEMM (ctest's routes.* runs) asks it not to look.
  const auto& gemm = OneDnnGemm::instance();
  if (!onednn_loaded()) GTEST_SKIP() << "this LibTorch loads no libdnnl: " << gemm.float32_unavailable_because();
  if (qkv::kernels::linear::linear_gemm_choice() != LinearGemmChoice::Fastest) {
    EXPECT_FALSE(gemm.available());
    EXPECT_EQ(gemm.name(), "");
    EXPECT_EQ(gemm.float32_unavailable_because().rfind("QKV_LINEAR_GEMM=", 0), 0u) << gemm.float32_unavailable_because();
    return;
  }
  const auto [major, minor, patch] = loaded_onednn_version();
  ASSERT_GE(major, 0) << loaded_onednn() << " has no dnnl_version";
  EXPECT_EQ(gemm.name(), "oneDNN " + std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch));
  const bool fixed = major > 3 || (major == 3 && (minor > 11 || (minor == 11 && patch >= 2)));
  EXPECT_EQ(gemm.available(), fixed) << gemm.name();
  if (!fixed) {
    EXPECT_NE(gemm.float32_unavailable_because().find("corrupts the heap (oneDNN issue #4845, fixed in 3.11.2)"),
              std::string::npos)
        << gemm.float32_unavailable_because();
  }
}

TEST(Linear, TakesOneDnnsFloat32GemmFromVersionsWithTheSignalFix) {
  // oneDNN's release notes: "Fixed a potential heap corruption in f32 GEMM kernels on x64 CPUs"
  // in v3.11.2 (2026-03-30); v3.12 was branched after the fix (6191181) reached main.
  using qkv::kernels::linear::onednn_float32_gemm_is_signal_safe;
  for (const auto& [major, minor, patch, safe] :
       std::vector<std::tuple<int, int, int, bool>>{{1, 8, 0, false},
                                                    {2, 6, 3, false},   // Debian 12
                                                    {3, 6, 2, false},
                                                    {3, 7, 2, false},   // Debian 13
                                                    {3, 10, 9, false},
                                                    {3, 11, 0, false},
                                                    {3, 11, 1, false},
                                                    {3, 11, 2, true},
                                                    {3, 11, 4, true},
                                                    {3, 12, 0, true},
                                                    {3, 12, 1, true},   // Debian unstable
                                                    {3, 13, 0, true},
                                                    {4, 0, 0, true}}) {
    EXPECT_EQ(onednn_float32_gemm_is_signal_safe(major, minor, patch), safe) << major << "." << minor << "." << patch;
  }
}

TEST(Linear, Float32RouteTakesASignalSafeGemm) {
  // Float32 linear layers: oneDNN's GEMM where it is there and signal-safe, else qkv's float32
  // micro-kernels where they are vectors (QKV_TILED_ISA avx2 and up), else LibTorch's; LibTorch's
  // with QKV_LINEAR_GEMM=libtorch. linear_products() names the library first.
  using qkv::detail::Float32Products;
  const auto& gemm = OneDnnGemm::instance();
  const auto route = qkv::detail::float32_products();
  const auto products = qkv::linear_products();
  const bool vector_kernels =
      qkv::kernels::tiled::at_least(qkv::kernels::tiled::active_isa(), qkv::kernels::tiled::ProductIsa::Avx2);
  SCOPED_TRACE(testing::Message() << qkv::tiled_instruction_set() << ": " << products);
  if (qkv::kernels::linear::linear_gemm_choice() == LinearGemmChoice::LibTorch) {
    EXPECT_EQ(route, Float32Products::LibTorch);
  } else if (gemm.available()) {
    EXPECT_EQ(route, Float32Products::OneDnn);
    EXPECT_EQ(products.rfind(gemm.name(), 0), 0u);
  } else if (vector_kernels) {
    EXPECT_EQ(route, Float32Products::MicroKernels);
    EXPECT_EQ(products.rfind("qkv's float32 micro-kernels (" + gemm.float32_unavailable_because() + ")", 0), 0u);
  } else {
    EXPECT_EQ(route, Float32Products::LibTorch);
    EXPECT_EQ(products.rfind("LibTorch's (" + gemm.float32_unavailable_because(), 0), 0u);
  }
}

// Signals for SignalsDuringProductsLeaveResultsAndHeapIntact: a handler that only counts.
std::atomic<long> signals_handled{0};
void count_signal(int) { signals_handled.fetch_add(1, std::memory_order_relaxed); }

TEST(Linear, SignalsDuringProductsLeaveResultsAndHeapIntact) {
  // A signal handled while a product runs (qkv-train's SIGINT / SIGTERM handlers, a profiler's
  // SIGPROF) must not touch the product: oneDNN's float32 GEMM before 3.11.2 pointed rsp into its
  // heap workspace, so the signal's frame landed in the heap (glibc then aborts with "corrupted
  // size vs. prev_size", or results change). A stream of SIGUSR1 at this thread while the float32
  // and bfloat16 routes run a linear layer's forward and backward at shapes whose products took
  // that path (a 512-row weight gradient: 48 × 48 × 512): every result as without signals, and a
  // large allocation afterwards (glibc checks the heap as it consolidates).
  struct sigaction counting {}, previous {};
  counting.sa_handler = count_signal;
  sigemptyset(&counting.sa_mask);
  ASSERT_EQ(sigaction(SIGUSR1, &counting, &previous), 0);
  torch::manual_seed(23);
  struct Shape {
    int64_t rows, in, out;
  };
  for (bool bfloat16 : {false, true}) {
    for (const auto& s : {Shape{512, 48, 48}, Shape{1024, 128, 384}}) {
      SCOPED_TRACE(testing::Message() << (bfloat16 ? "bfloat16 autocast" : "float32") << ", " << s.rows << " rows, "
                                      << s.in << " -> " << s.out << ", " << qkv::linear_products());
      const auto x_values = torch::randn({s.rows, s.in}), w_values = torch::randn({s.out, s.in}) / 8,
                 b_values = torch::randn({s.out}), probe = torch::randn({s.rows, s.out});
      const auto step = [&] {
        const auto x = x_values.clone().requires_grad_(true), w = w_values.clone().requires_grad_(true),
                   b = b_values.clone().requires_grad_(true);
        torch::Tensor y;
        {
          std::optional<qkv::AutocastGuard> autocast;
          if (bfloat16) autocast.emplace(torch::kCPU, torch::kBFloat16);
          y = qkv::detail::linear(x, w, b);
        }
        (y.to(torch::kFloat) * probe).sum().backward();
        return std::vector<torch::Tensor>{y.detach().to(torch::kFloat), x.grad(), w.grad(), b.grad()};
      };
      const auto quiet = step();  // without signals
      const pthread_t target = pthread_self();
      std::atomic<bool> done{false};
      std::thread sender([&] {
        while (!done.load()) {
          pthread_kill(target, SIGUSR1);
          std::this_thread::sleep_for(std::chrono::microseconds(5));
        }
      });
      const long before = signals_handled.load();
      int steps = 0, differing = 0;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(700);
      while (std::chrono::steady_clock::now() < deadline || steps < 20) {
        const auto loud = step();
        for (size_t i = 0; i < loud.size(); ++i) differing += !torch::equal(loud[i], quiet[i]);
        std::free(std::malloc(1 << 20));
        ++steps;
      }
      done.store(true);
      sender.join();
      EXPECT_GT(signals_handled.load() - before, 100) << "the signals did not arrive during the products";
      EXPECT_EQ(differing, 0) << "of " << steps << " steps' results";
    }
  }
  sigaction(SIGUSR1, &previous, nullptr);
}

TEST(Linear, MatchesFloat64OverLayoutsAndSizes) {
  torch::manual_seed(11);
  const bool routed = qkv::detail::float32_products() != qkv::detail::Float32Products::LibTorch;
  struct Shape {
    int64_t batch, rows, in, out;
  };
  // Small products stay on LibTorch's route (kGemmRouteFromMultiplyAdds); the others take the GEMM route.
  for (const auto& s : {Shape{2, 5, 3, 7}, Shape{1, 1, 1, 1}, Shape{3, 33, 17, 65}, Shape{2, 64, 128, 384},
                        Shape{1, 130, 257, 31}, Shape{2, 40, 96, 161}, Shape{1, 4, 512, 256}}) {
    for (auto x_layout : {OperandLayout::Contiguous, OperandLayout::Transposed, OperandLayout::Sliced, OperandLayout::Expanded}) {
      for (auto w_layout :
           {OperandLayout::Contiguous, OperandLayout::Transposed, OperandLayout::Sliced, OperandLayout::Strided}) {
        for (bool bias : {true, false}) {
          SCOPED_TRACE(testing::Message() << "x (" << s.batch << ", " << s.rows << ", " << s.in << ") "
                                          << operand_layout_name(x_layout) << ", W (" << s.out << ", " << s.in << ") "
                                          << operand_layout_name(w_layout) << (bias ? ", bias" : ", no bias"));
          const bool expanded = x_layout == OperandLayout::Expanded;
          const auto x_values = torch::randn({expanded ? 1 : s.batch, s.rows, s.in});
          const auto w_values = torch::randn({s.out, s.in}) / std::sqrt(static_cast<double>(s.in));
          const auto b_values = torch::randn({s.out});
          const auto probe = torch::randn({expanded ? 3 : s.batch, s.rows, s.out});

          const auto x = linear_operand_as(x_values, x_layout), w = linear_operand_as(w_values, w_layout);
          // A bias of stride 2 beside the weight of no unit stride.
          const auto b_layout = w_layout == OperandLayout::Strided ? OperandLayout::Strided : OperandLayout::Contiguous;
          const auto b = bias ? linear_operand_as(b_values, b_layout) : torch::Tensor();
          const auto got = run(qkv::detail::linear, x, w, b, probe, expanded);

          const auto x64 = x_values.to(torch::kDouble).requires_grad_(true);
          const auto w64 = w_values.to(torch::kDouble).requires_grad_(true);
          const auto b64 = bias ? b_values.to(torch::kDouble).requires_grad_(true) : torch::Tensor();
          const auto linear64 = [](auto&&... a) { return torch::linear(a...); };
          const auto want = run(linear64, x64, w64, b64, probe.to(torch::kDouble), expanded);
          // The same sums of the terms' magnitudes: a sum's rounding error is bounded by its terms'
          // size, not its own (Higham, ch. 3), which cancellation can make as small as it likes (a
          // gradient of one element summed over three broadcast copies).
          const auto magnitude = [](const torch::Tensor& t) {
            return t.defined() ? t.abs().to(torch::kDouble).requires_grad_(true) : torch::Tensor();
          };
          const auto terms = run(linear64, magnitude(x_values), magnitude(w_values),
                                 bias ? magnitude(b_values) : torch::Tensor(), probe.abs().to(torch::kDouble), expanded);

          // Each result is a sum over K = in (y, grad_x... over out), the weight's over the rows.
          const auto tolerance = tolerance_for(torch::kFloat, std::max({s.in, s.out, s.batch * s.rows * 3}));
          EXPECT_LT(relative_error(got.y, want.y, max_abs(terms.y)), tolerance);
          EXPECT_LT(relative_error(got.grad_x, want.grad_x, max_abs(terms.grad_x)), tolerance);
          EXPECT_LT(relative_error(got.grad_w, want.grad_w, max_abs(terms.grad_w)), tolerance);
          if (bias) {
            EXPECT_LT(relative_error(got.grad_b, want.grad_b, max_abs(terms.grad_b)), tolerance);
          }

          // The route the rule names ran (either would pass the checks above).
          const int64_t rows = (expanded ? 3 : s.batch) * s.rows;
          const bool large = rows >= qkv::detail::kGemmRouteFromRows &&
                             rows * s.in * s.out >= qkv::detail::kGemmRouteFromMultiplyAdds;
          const auto y = qkv::detail::linear(x, w, b);
          EXPECT_EQ(graph_has(y, "GemmLinear"), routed && large) << linear_grad_fn_name(y);
        }
      }
    }
  }
}

TEST(Linear, SecondOrderGradientsMatchFloat64) {
  // create_graph: the backward runs on LibTorch's differentiable ops, so a gradient penalty works.
  torch::manual_seed(12);
  // 128 rows, 64 -> 96: large enough for the GEMM route (kGemmRouteFromMultiplyAdds).
  const auto x_values = torch::randn({2, 64, 64}), w_values = torch::randn({96, 64}) / 8.0,
             b_values = torch::randn({96});
  auto penalty = [](auto linear, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
    const auto y = linear(x, w, b);
    const auto grad_x = torch::autograd::grad({y.pow(2).sum()}, {x}, {}, /*retain_graph=*/true,
                                              /*create_graph=*/true)[0];
    grad_x.pow(2).sum().backward();
    return std::make_pair(w.grad().clone(), b.grad().clone());
  };
  const auto x = x_values.clone().requires_grad_(true), w = w_values.clone().requires_grad_(true),
             b = b_values.clone().requires_grad_(true);
  if (qkv::detail::float32_products() != qkv::detail::Float32Products::LibTorch) {
    EXPECT_TRUE(graph_has(qkv::detail::linear(x, w, b), "GemmLinear"));
  }
  const auto got = penalty(qkv::detail::linear, x, w, b);
  const auto x64 = x_values.to(torch::kDouble).requires_grad_(true),
             w64 = w_values.to(torch::kDouble).requires_grad_(true),
             b64 = b_values.to(torch::kDouble).requires_grad_(true);
  const auto want = penalty([](auto&&... a) { return torch::linear(a...); }, x64, w64, b64);
  const auto tolerance = tolerance_for(torch::kFloat, 128);
  EXPECT_LT(relative_error(got.first, want.first), tolerance);
  EXPECT_LT(relative_error(got.second, want.second, /*scale=*/qkv_test::max_abs(want.first)), tolerance);
}

TEST(Linear, LeavesOtherInputsToLibTorch) {
  torch::manual_seed(13);
  const auto w = torch::randn({4, 6}, torch::requires_grad()), b = torch::randn({4}, torch::requires_grad());
  // A 1-D input and float64: LibTorch's own route, the same values as at::linear.
  const auto vector = torch::randn({6});
  EXPECT_TRUE(torch::equal(qkv::detail::linear(vector, w, b), torch::linear(vector, w, b)));
  const auto x64 = torch::randn({3, 6}, torch::kDouble);
  EXPECT_FALSE(graph_has(qkv::detail::linear(x64, w.to(torch::kDouble), b.to(torch::kDouble)), "GemmLinear"));
  // Under CPU autocast LibTorch's at::linear casts to bfloat16 (and so must the route); a product
  // this small stays on LibTorch's, except where that is its own loops (the float32 route).
  {
    qkv::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
    const auto y = qkv::detail::linear(torch::randn({2, 3, 6}), w, b);
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    EXPECT_EQ(graph_has(y, "GemmLinear"), qkv::detail::bfloat16_products() == qkv::detail::Bfloat16Products::Float32)
        << linear_grad_fn_name(y);
  }
  // Empty inputs keep their shape.
  EXPECT_EQ(qkv::detail::linear(torch::randn({2, 0, 6}), w, b).sizes(), (std::vector<int64_t>{2, 0, 4}));
  // Mismatched sizes get LibTorch's error, not a product of the wrong sizes.
  EXPECT_THROW(qkv::detail::linear(torch::randn({3, 5}), w, b), c10::Error);
}

}  // namespace

namespace {

TEST(Linear, RunsUnderInferenceModeAndNoGrad) {
  // Generation runs the model without autograd: the route must give the same values there.
  torch::manual_seed(14);
  const auto x = torch::randn({2, 64, 64}), w = torch::randn({96, 64}) / 8.0, b = torch::randn({96});
  const auto want = torch::linear(x.to(torch::kDouble), w.to(torch::kDouble), b.to(torch::kDouble));
  const auto tolerance = tolerance_for(torch::kFloat, 64);
  {
    const qkv::compat::InferenceModeGuard inference;
    EXPECT_LT(relative_error(qkv::detail::linear(x, w, b), want), tolerance);
  }
  {
    torch::NoGradGuard no_grad;
    const auto leaf = w.clone().requires_grad_(true);
    const auto y = qkv::detail::linear(x, leaf, b);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_LT(relative_error(y, want), tolerance);
  }
}

}  // namespace

namespace {

TEST(Linear, RoundsToBfloat16AsLibTorchDoes) {
  // The route's own rounding against c10::BFloat16's (LibTorch's Tensor::to): random values over
  // many magnitudes, ties (the dropped half exactly 0x8000, kept half odd and even), the largest
  // values, infinities, NaN, subnormals and zeros.
  torch::manual_seed(15);
  std::vector<uint32_t> bits{0x3F808000u, 0x3F818000u, 0x3F80FFFFu, 0x3F807FFFu, 0x7F7FFFFFu, 0xFF7FFFFFu,
                             0x7F800000u, 0xFF800000u, 0x7FC00001u, 0xFF800001u, 0x00000001u, 0x80008000u,
                             0x00018000u, 0x00000000u, 0x80000000u, 0x7F7F8000u};
  const auto random = (torch::randn({100000}) * torch::exp(torch::randn({100000}) * 20)).contiguous();
  auto values = torch::empty({static_cast<int64_t>(bits.size())}, torch::kFloat);
  std::memcpy(values.data_ptr<float>(), bits.data(), bits.size() * sizeof(uint32_t));
  const auto all = torch::cat({values, random});
  const auto got = qkv::kernels::linear::round_to_bfloat16(all);
  const auto want = all.to(torch::kBFloat16);
  ASSERT_EQ(got.scalar_type(), torch::kBFloat16);
  const auto got_bits = got.view(torch::kShort), want_bits = want.view(torch::kShort);
  const auto nan = torch::isnan(all);
  // NaN: any quiet NaN will do (payloads differ between LibTorch versions); everything else bit for bit.
  EXPECT_TRUE(torch::isnan(got.to(torch::kFloat)).equal(nan));
  EXPECT_TRUE(got_bits.masked_select(~nan).equal(want_bits.masked_select(~nan)));

  // The same values widened back to float32 (the float32 GEMM's operands and the GELU's on CPUs
  // without bfloat16 instructions), from qkv's rounding and from LibTorch's.
  const auto want_values = want.to(torch::kFloat);
  for (const auto& [from, whose] : {std::pair{got, "qkv's rounding"}, std::pair{want, "LibTorch's rounding"}}) {
    SCOPED_TRACE(testing::Message() << "widen_values of " << whose);
    auto values = torch::empty({from.numel()}, torch::kFloat);
    qkv::kernels::linear::widen_values(reinterpret_cast<const uint16_t*>(from.data_ptr<at::BFloat16>()),
                                       values.data_ptr<float>(), from.numel());
    EXPECT_TRUE(torch::isnan(values).equal(nan));
    EXPECT_TRUE(values.view(torch::kInt).masked_select(~nan).equal(want_values.view(torch::kInt).masked_select(~nan)));
  }
}

TEST(Linear, Bfloat16RouteFollowsTheCpusInstructions) {
  // Under bfloat16 autocast the products go where the CPU (as QKV_TILED_ISA makes it look; ctest
  // reruns this file with avx2, avx512 and portable, and without oneDNN) multiplies them fastest:
  // with no bfloat16 instructions LibTorch 1.13's bfloat16 matmul is its own scalar loops, so qkv's
  // float32 micro-kernels take the rounded operands (with or without oneDNN in the process; plain
  // C++ micro-kernels only with oneDNN's float32 GEMM behind them); AVX512_BF16 without AMX by
  // default (AMD): oneDNN's bfloat16 GEMM. QKV_LINEAR_GEMM=libtorch keeps LibTorch's.
  using qkv::detail::Bfloat16Products;
  using qkv::kernels::tiled::ProductIsa;
  const auto& gemm = OneDnnGemm::instance();
  const auto usable = qkv::kernels::tiled::usable_isa();
  const auto route = qkv::detail::bfloat16_products();
  const auto products = qkv::linear_products();
  SCOPED_TRACE(testing::Message() << "usable " << qkv::kernels::tiled::isa_name(usable) << ", active "
                                  << qkv::tiled_instruction_set() << ", " << products);
  if (qkv::kernels::linear::linear_gemm_choice() == LinearGemmChoice::LibTorch) {
    EXPECT_EQ(route, Bfloat16Products::LibTorch);
    EXPECT_EQ(products, "LibTorch's (QKV_LINEAR_GEMM=libtorch)");
  } else if (!qkv::kernels::tiled::at_least(usable, ProductIsa::Avx512Bf16)) {
    const bool vector_kernels = qkv::kernels::tiled::at_least(qkv::kernels::tiled::active_isa(), ProductIsa::Avx2);
    if (vector_kernels || gemm.available()) {
      EXPECT_EQ(route, Bfloat16Products::Float32);
      EXPECT_NE(products.find("on qkv's float32 micro-kernels"), std::string::npos);
      // The float32 products' library comes first (Linear.Float32RouteTakesASignalSafeGemm).
      EXPECT_NE(products.find(gemm.available() ? " (bfloat16 autocast too, on qkv's float32 micro-kernels"
                                               : "; bfloat16 autocast on qkv's float32 micro-kernels"),
                std::string::npos);
    } else {
      EXPECT_EQ(route, Bfloat16Products::LibTorch);
      EXPECT_EQ(products.find("bfloat16 autocast"), std::string::npos);
    }
  } else if (usable == ProductIsa::AmxBf16) {
    EXPECT_EQ(route, Bfloat16Products::LibTorch);
  } else if (qkv::kernels::tiled::active_isa() == ProductIsa::Avx512Bf16 &&
             OneDnnGemm::instance().bfloat16_available()) {
    EXPECT_EQ(route, Bfloat16Products::OneDnnBfloat16);
    EXPECT_NE(products.find(gemm.available() ? " (bfloat16 autocast too)"
                                             : "; bfloat16 autocast on " + gemm.name() + "'s bfloat16 GEMM"),
              std::string::npos);
  } else {
    EXPECT_EQ(route, Bfloat16Products::LibTorch);
  }
}

TEST(Linear, Bfloat16AutocastMatchesFloat64OfRoundedOperands) {
  // Under CPU autocast to bfloat16 a linear layer multiplies its operands rounded to bfloat16 and
  // returns bfloat16: the reference is float64 on the same rounded operands. Where oneDNN's
  // or float32 GEMM takes the product (bfloat16_products()) its gradients are float32 for float32
  // inputs; on LibTorch's route (CPUs with AMX) the same checks hold within bfloat16's rounding.
  torch::manual_seed(16);
  const bool routed = qkv::detail::bfloat16_products() != qkv::detail::Bfloat16Products::LibTorch;
  struct Shape {
    int64_t batch, rows, in, out;
  };
  // 300 rows: one block of 256 and a tail; 4 rows × 512 × 256: the smallest product routed; one
  // row × 128 × 384 (a decoded token's), routed only where the float32 GEMM takes the products;
  // 1100 rows: the weight's gradient, a sum over the rows, split among tasks (float32 GEMM route).
  const bool float32_route = qkv::detail::bfloat16_products() == qkv::detail::Bfloat16Products::Float32;
  for (const auto& s : {Shape{2, 64, 128, 384}, Shape{1, 300, 96, 161}, Shape{1, 4, 512, 256}, Shape{1, 1, 128, 384},
                        Shape{1, 1100, 40, 48}}) {
    const bool large = s.batch * s.rows * s.in * s.out >= qkv::detail::kGemmRouteFromMultiplyAdds;
    for (auto x_layout : {OperandLayout::Contiguous, OperandLayout::Transposed, OperandLayout::Sliced}) {
      for (auto w_layout : {OperandLayout::Contiguous, OperandLayout::Transposed, OperandLayout::Strided}) {
        for (auto x_dtype : {torch::kFloat, torch::kBFloat16}) {
          for (bool bias : {true, false}) {
            SCOPED_TRACE(testing::Message() << "x (" << s.batch << ", " << s.rows << ", " << s.in << ") "
                                            << operand_layout_name(x_layout) << " " << x_dtype << ", W (" << s.out
                                            << ", " << s.in << ") " << operand_layout_name(w_layout)
                                            << (bias ? ", bias" : ", no bias"));
            const auto x_values = torch::randn({s.batch, s.rows, s.in}).to(x_dtype).to(torch::kFloat);
            const auto w_values = torch::randn({s.out, s.in}) / std::sqrt(static_cast<double>(s.in));
            const auto b_values = torch::randn({s.out});
            const auto probe = torch::randn({s.batch, s.rows, s.out});
            const auto x = linear_operand_as(x_values.to(x_dtype), x_layout);
            const auto w = linear_operand_as(w_values, w_layout);
            // A bias of stride 2 beside the weight of no unit stride.
            const auto b_layout =
                w_layout == OperandLayout::Strided ? OperandLayout::Strided : OperandLayout::Contiguous;
            const auto b = bias ? linear_operand_as(b_values, b_layout) : torch::Tensor();
            torch::Tensor y;
            {
              qkv::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
              y = qkv::detail::linear(x, w, b);
            }
            EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
            EXPECT_EQ(graph_has(y, "GemmLinear"), routed && (large || float32_route)) << linear_grad_fn_name(y);
            (y.to(torch::kFloat) * probe).sum().backward();
            EXPECT_EQ(x.grad().scalar_type(), x_dtype);
            EXPECT_EQ(w.grad().scalar_type(), torch::kFloat);

            // float64 of what the product saw: the operands and the output's gradient in bfloat16.
            const auto rounded = [](const torch::Tensor& t) { return t.to(torch::kBFloat16).to(torch::kDouble); };
            const auto x64 = rounded(x_values), w64 = rounded(w_values), probe64 = rounded(probe);
            const auto want_y = torch::linear(x64, w64, bias ? b_values.to(torch::kDouble) : torch::Tensor());
            const auto rows64 = probe64.reshape({-1, s.out});
            const auto want_grad_x = probe64.matmul(w64);
            const auto want_grad_w = rows64.t().mm(x64.reshape({-1, s.in}));
            // bfloat16's rounding of the output (and of the bias and the gradient on LibTorch's route)
            // dominates; the sums run over K = in, out or the rows.
            const auto tolerance = tolerance_for(torch::kBFloat16, std::max({s.in, s.out, s.batch * s.rows}));
            EXPECT_LT(relative_error(y, want_y), tolerance);
            EXPECT_LT(relative_error(x.grad(), want_grad_x), tolerance);
            EXPECT_LT(relative_error(w.grad(), want_grad_w), tolerance);
            if (bias) {
              EXPECT_LT(relative_error(b.grad(), rows64.sum(0)), tolerance);
            }
          }
        }
      }
    }
  }
}

}  // namespace

namespace {

TEST(Linear, Bfloat16ProductsIgnoreWhatTheirScratchHeld) {
  // The bfloat16 products take float32 scratch that is not zeroed (kept per thread between calls
  // up to 4 MiB, fresh above) and ask the GEMM for C = A · B with beta 0 (kernels/linear/products.cpp):
  // a call whose operands held NaN and infinities leaves them there, and the next call must not
  // see them (0 · NaN is NaN). Each product against float64 of the same bfloat16 operands, on both
  // GEMMs where this process has them, in the layouts of a forward (rows split among the threads)
  // and of a weight's gradient (a long sum in groups), at sizes under the kept scratch and over it
  // (the second shape's widened weight and partial sums).
  using qkv::kernels::linear::Bfloat16Gemm;
  std::vector<Bfloat16Gemm> gemms;
  // The float32 products need oneDNN only where the micro-kernels are plain C++.
  if (qkv::kernels::linear::float32_products_on_micro_kernels() || OneDnnGemm::instance().available()) {
    gemms.push_back(Bfloat16Gemm::Float32);
  }
  if (OneDnnGemm::instance().bfloat16_available()) gemms.push_back(Bfloat16Gemm::OneDnn);
  if (gemms.empty()) GTEST_SKIP() << "plain C++ micro-kernels and no oneDNN float32 GEMM: "
                  << OneDnnGemm::instance().float32_unavailable_because();
  torch::manual_seed(21);
  // Two threads at least, whatever LibTorch's default (one on some machines): the products split
  // among them.
  const qkv_test::ThreadCount thread_count(std::max(at::get_num_threads(), 2));
  const auto bits = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
  struct Shape {
    int64_t m, k, n;
  };
  // 9 row blocks; sums over k in 3 or 5 chunks and over m in 3 groups; a k so long that a row
  // block's widened rows (float32) would pass the scratch a thread keeps, so the micro-kernels
  // widen and multiply it in two passes; 200 rows, split by columns among the threads
  for (const auto shape :
       {Shape{2100, 600, 40}, Shape{2100, 1100, 1000}, Shape{300, 5000, 24}, Shape{200, 300, 200}}) {
    const int64_t m = shape.m, k = shape.k, n = shape.n;
    const auto a = torch::randn({m, k}).to(torch::kBFloat16), b = torch::randn({k, n}).to(torch::kBFloat16);
    auto poisoned_a = a.clone(), poisoned_b = b.clone();
    poisoned_a.index_put_({torch::indexing::Slice(), 0}, std::numeric_limits<float>::quiet_NaN());
    poisoned_b.index_put_({0, torch::indexing::Slice()}, std::numeric_limits<float>::infinity());
    const auto rows = torch::randn({m, n}).to(torch::kBFloat16);
    auto poisoned_rows = rows.clone();
    poisoned_rows.index_put_({0, 0}, std::numeric_limits<float>::quiet_NaN());
    const auto want = torch::matmul(a.to(torch::kDouble), b.to(torch::kDouble));
    const auto want_gradient = torch::matmul(a.to(torch::kDouble).t(), rows.to(torch::kDouble));
    for (const auto gemm : gemms) {
      SCOPED_TRACE(testing::Message() << (gemm == Bfloat16Gemm::OneDnn ? "oneDNN's bfloat16 GEMM" : "float32 micro-kernels")
                                      << ", m " << m << ", k " << k << ", n " << n);
      // bfloat16_product: C (m × n) = A · B, rounded
      const auto poisoned =
          qkv::kernels::linear::bfloat16_product(gemm, m, n, k, {poisoned_a, false, k}, {poisoned_b, false, n}, {});
      ASSERT_FALSE(torch::isfinite(poisoned.to(torch::kFloat)).all().item<bool>());  // the scratch now holds them
      const auto got = qkv::kernels::linear::bfloat16_product(gemm, m, n, k, {a, false, k}, {b, false, n}, {});
      // bfloat16's rounding of the output (2^-8 of it) and float32's of a k-long sum
      EXPECT_LT(relative_error(got.to(torch::kDouble), want), 8e-3);
      // with a bias, added in float32 before the rounding
      const auto bias = torch::randn({n});
      const auto got_biased = qkv::kernels::linear::bfloat16_product(gemm, m, n, k, {a, false, k}, {b, false, n}, bias);
      EXPECT_LT(relative_error(got_biased.to(torch::kDouble), want + bias.to(torch::kDouble)), 8e-3);
      // multiply_bfloat16 as a weight's gradient: C (k × n) = Aᵀ (k × m) · rows (m × n), a sum over m
      auto c = torch::full({k, n}, std::numeric_limits<float>::quiet_NaN());
      qkv::kernels::linear::multiply_bfloat16(gemm, true, false, k, n, m, bits(poisoned_a), k, bits(poisoned_rows),
                                              n, 0.0f, c.data_ptr<float>(), n);
      c.fill_(std::numeric_limits<float>::quiet_NaN());  // beta 0: C is written, not read
      qkv::kernels::linear::multiply_bfloat16(gemm, true, false, k, n, m, bits(a), k, bits(rows), n, 0.0f,
                                              c.data_ptr<float>(), n);
      ASSERT_TRUE(torch::isfinite(c).all().item<bool>());
      EXPECT_LT(relative_error(c.to(torch::kDouble), want_gradient), 1e-5);
    }
  }
}

TEST(Linear, Float32ProductsOnMicroKernelsMatchFloat64) {
  // multiply_float32 (the float32 linear layers' products where oneDNN's GEMM is not taken): each
  // transpose of A and B, stored inside wider matrices (row stride > columns), over a block of rows
  // split among tasks, a few rows split by columns, and a long sum split in groups, beta 0 into a C
  // full of NaN (never read) and beta 1 (accumulated), against float64, on 1, 2 and 3 threads; the
  // result is the same to the bit on each (every value summed in the same order whatever the
  // tasks). Correct on every instruction set (plain C++ too).
  struct Shape {
    int64_t m, k, n;
  };
  const qkv_test::ThreadCount restore_thread_count(at::get_num_threads());  // the loop sets its own
  std::map<std::string, torch::Tensor> on_one_thread;
  for (const int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    // 600 rows: blocks of rows; 200 rows and a sum of 300: blocks of columns (128 + 72 on 2 threads,
    // 3 × 96 on 3); k = 2100: 3 groups of the sum (2 · 1024 + 52), 9 chunks of 256
    for (const auto shape : {Shape{600, 300, 40}, Shape{200, 300, 200}, Shape{48, 2100, 48}, Shape{5, 7, 3}}) {
      const int64_t m = shape.m, k = shape.k, n = shape.n;
      for (bool transpose_a : {false, true}) {
        for (bool transpose_b : {false, true}) {
          for (float beta : {0.0f, 1.0f}) {
            const std::string name = (testing::Message() << "m " << m << ", k " << k << ", n " << n
                                                         << (transpose_a ? ", Aᵀ" : "") << (transpose_b ? ", Bᵀ" : "")
                                                         << ", beta " << beta)
                                         .GetString();
            SCOPED_TRACE(name + ", " + std::to_string(threads) + " threads");
            torch::manual_seed(m * 7 + k * 5 + n * 3 + transpose_a * 2 + transpose_b);  // the same operands each time
            // op(A) (m × k) and op(B) (k × n) stored as the transpose says, 3 columns to spare per row
            const auto a_stored =
                torch::randn(transpose_a ? std::vector<int64_t>{k, m + 3} : std::vector<int64_t>{m, k + 3});
            const auto b_stored =
                torch::randn(transpose_b ? std::vector<int64_t>{n, k + 3} : std::vector<int64_t>{k, n + 3});
            const auto a = transpose_a ? a_stored.narrow(1, 0, m).t() : a_stored.narrow(1, 0, k);
            const auto b = transpose_b ? b_stored.narrow(1, 0, k).t() : b_stored.narrow(1, 0, n);
            const auto c_before = torch::randn({m, n + 2});
            auto c =
                beta == 0.0f ? torch::full({m, n + 2}, std::numeric_limits<float>::quiet_NaN()) : c_before.clone();
            qkv::kernels::linear::multiply_float32(transpose_a, transpose_b, m, n, k, a_stored.data_ptr<float>(),
                                                   a_stored.size(1), b_stored.data_ptr<float>(), b_stored.size(1),
                                                   beta, c.data_ptr<float>(), c.size(1));
            auto want = a.to(torch::kDouble).mm(b.to(torch::kDouble));
            if (beta != 0.0f) want += c_before.narrow(1, 0, n).to(torch::kDouble);
            const auto got = c.narrow(1, 0, n);
            ASSERT_TRUE(torch::isfinite(got).all().item<bool>());
            EXPECT_LT(relative_error(got.to(torch::kDouble), want), tolerance_for(torch::kFloat, k));
            // The columns past n are not C's: left as they were.
            const auto spare = c.narrow(1, n, 2);
            EXPECT_TRUE(beta == 0.0f ? torch::isnan(spare).all().item<bool>()
                                     : torch::equal(spare, c_before.narrow(1, n, 2)));
            if (threads == 1) {
              on_one_thread[name] = got.clone();
            } else {
              EXPECT_TRUE(torch::equal(got, on_one_thread.at(name))) << "differs from the result on one thread";
            }
          }
        }
      }
    }
  }
}

TEST(Linear, Bfloat16GradientsInOnePassMatchFloat64) {
  // The float32 route's backward in one pass (linear_gradients_widened): each block of grad
  // widened once for dx = grad · W, dW = gradᵀ · x and db = its column sums, over 3 groups of rows
  // (the last cut: 2100 = 2 · 1024 + 52), or, in one group, as three products; every subset of the
  // gradients asked for, W stored either way, dx in float32 or rounded; each against float64 of
  // the same bfloat16 values, after a call that left NaN in every scratch (beta 0 must not read
  // them). Then through the layer, where only some inputs require grad.
  using qkv::kernels::linear::linear_gradients_widened;
  if (!qkv::kernels::linear::float32_products_on_micro_kernels() && !OneDnnGemm::instance().available()) {
    GTEST_SKIP() << "plain C++ micro-kernels and no oneDNN float32 GEMM: "
                  << OneDnnGemm::instance().float32_unavailable_because();
  }
  torch::manual_seed(22);
  const qkv_test::ThreadCount thread_count(std::max(at::get_num_threads(), 2));  // the one-group products split among them
  const int64_t N = 384, K = 128;
  // 2100 rows: three groups of the sum, one pass; 700 and 200: one group, each gradient a product
  // of its own split among the threads (dx by rows at 700, by columns at 200)
  for (const int64_t M : {2100, 700, 200}) {
    SCOPED_TRACE(testing::Message() << M << " rows");
    const auto grad = torch::randn({M, N}).to(torch::kBFloat16), x = torch::randn({M, K}).to(torch::kBFloat16);
    const auto w = (torch::randn({N, K}) / 8).to(torch::kBFloat16);
    const auto w_columns = w.t().contiguous().t();  // the same W stored as Wᵀ's rows
    const auto grad64 = grad.to(torch::kDouble), x64 = x.to(torch::kDouble), w64 = w.to(torch::kDouble);
    const auto want_x = grad64.mm(w64), want_w = grad64.t().mm(x64), want_b = grad64.sum(0);
    auto poisoned_grad = grad.clone(), poisoned_x = x.clone();
    poisoned_grad.index_put_({torch::indexing::Slice(), 0}, std::numeric_limits<float>::quiet_NaN());
    poisoned_x.index_put_({0, torch::indexing::Slice()}, std::numeric_limits<float>::infinity());
    for (bool transposed : {false, true}) {
      const auto& weight = transposed ? w_columns : w;
      const int64_t ld = transposed ? weight.stride(1) : weight.stride(0);
      for (int asked = 1; asked < 8; ++asked) {
        const bool dx = asked & 1, dw = asked & 2, db = asked & 4;
        for (bool round_x : {false, true}) {
          SCOPED_TRACE(testing::Message() << "W stored " << (transposed ? "as Wᵀ" : "as rows") << (dx ? ", dx" : "")
                                          << (round_x ? " rounded" : "") << (dw ? ", dW" : "") << (db ? ", db" : ""));
          const auto poisoned = linear_gradients_widened(poisoned_grad, poisoned_x, {weight, transposed, ld}, true,
                                                         round_x, true, true);
          ASSERT_FALSE(torch::isfinite(poisoned.grad_weight).all().item<bool>());
          const auto got = linear_gradients_widened(grad, x, {weight, transposed, ld}, dx, round_x, dw, db);
          ASSERT_EQ(got.grad_x.defined(), dx);
          ASSERT_EQ(got.grad_weight.defined(), dw);
          ASSERT_EQ(got.grad_bias.defined(), db);
          if (dx) {
            EXPECT_EQ(got.grad_x.scalar_type(), round_x ? torch::kBFloat16 : torch::kFloat);
            // float32 sums of N terms, and bfloat16's rounding (2^-9 relative) where rounded
            EXPECT_LT(relative_error(got.grad_x.to(torch::kDouble), want_x), round_x ? 5e-3 : 1e-5);
          }
          if (dw) {
            EXPECT_LT(relative_error(got.grad_weight.to(torch::kDouble), want_w), 1e-5);
          }
          if (db) {
            EXPECT_LT(relative_error(got.grad_bias.to(torch::kDouble), want_b), 1e-5);
          }
        }
      }
    }
    EXPECT_THROW(linear_gradients_widened(grad, x.narrow(0, 0, M - 1), {w, false, K}, true, false, true, false),
                 c10::Error);
  }

  // Through the layer under autocast: an input that requires no grad, a frozen weight.
  if (qkv::detail::bfloat16_products() != qkv::detail::Bfloat16Products::Float32) return;
  const int64_t M = 2100;
  const auto x_values = torch::randn({M, K}), w_values = torch::randn({N, K}) / 8, b_values = torch::randn({N});
  const auto probe = torch::randn({M, N});
  const auto rounded = [](const torch::Tensor& t) { return t.to(torch::kBFloat16).to(torch::kDouble); };
  const auto probe64 = rounded(probe);
  for (bool frozen_weight : {false, true}) {
    SCOPED_TRACE(frozen_weight ? "frozen weight, input requires grad" : "input requires no grad");
    const auto input = frozen_weight ? x_values.clone().requires_grad_(true) : x_values;
    const auto weight = frozen_weight ? w_values : w_values.clone().requires_grad_(true);
    const auto bias = b_values.clone().requires_grad_(true);
    torch::Tensor y;
    {
      qkv::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      y = qkv::detail::linear(input, weight, bias);
    }
    (y.to(torch::kFloat) * probe).sum().backward();
    EXPECT_LT(relative_error(bias.grad().to(torch::kDouble), probe64.sum(0)), 1e-5);
    if (frozen_weight) {
      EXPECT_FALSE(weight.grad().defined());
      EXPECT_LT(relative_error(input.grad().to(torch::kDouble), probe64.mm(rounded(w_values))), 1e-5);
    } else {
      EXPECT_LT(relative_error(weight.grad().to(torch::kDouble), probe64.t().mm(rounded(x_values))), 1e-5);
    }
  }
}

TEST(Linear, Bfloat16SecondOrderGradientsReachTheInputs) {
  // A gradient penalty under bfloat16 autocast: the create_graph backward must carry the weight's
  // and the bias's second-order terms (the route's bfloat16 operands are copies made inside the
  // function, so its backward works on the inputs themselves). Against float64 on the rounded
  // operands, within bfloat16's rounding.
  torch::manual_seed(17);
  const auto x_values = torch::randn({2, 64, 64}).to(torch::kBFloat16).to(torch::kFloat);
  const auto w_values = (torch::randn({96, 64}) / 8.0).to(torch::kBFloat16).to(torch::kFloat);
  const auto b_values = torch::randn({96});
  const auto x = x_values.clone().requires_grad_(true), w = w_values.clone().requires_grad_(true),
             b = b_values.clone().requires_grad_(true);
  torch::Tensor y;
  {
    qkv::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
    y = qkv::detail::linear(x, w, b);
  }
  EXPECT_EQ(graph_has(y, "GemmLinear"), qkv::detail::bfloat16_products() != qkv::detail::Bfloat16Products::LibTorch);
  const auto grad_x = torch::autograd::grad({y.to(torch::kFloat).pow(2).sum()}, {x}, {}, /*retain_graph=*/true,
                                            /*create_graph=*/true)[0];
  grad_x.pow(2).sum().backward();

  const auto x64 = x_values.to(torch::kDouble).requires_grad_(true),
             w64 = w_values.to(torch::kDouble).requires_grad_(true),
             b64 = b_values.to(torch::kDouble).requires_grad_(true);
  const auto y64 = torch::linear(x64, w64, b64);
  const auto grad_x64 = torch::autograd::grad({y64.pow(2).sum()}, {x64}, {}, true, true)[0];
  grad_x64.pow(2).sum().backward();
  // The penalty's gradients pass through y's and grad_x's bfloat16 roundings (and LibTorch's
  // bfloat16 products in the create_graph backward): bfloat16's tolerance over K = 96 sums.
  const auto tolerance = tolerance_for(torch::kBFloat16, 128);
  EXPECT_LT(relative_error(w.grad(), w64.grad()), tolerance);
  EXPECT_LT(relative_error(b.grad(), b64.grad(), /*scale=*/qkv_test::max_abs(w64.grad())), tolerance);
  EXPECT_GT(qkv_test::max_abs(w.grad()), 0.0);
}

}  // namespace

namespace {

// |actual - expected| ≤ relative · |expected| + absolute, element by element (a value rounded once to
// bfloat16 is within 2^-8 of itself, relatively; `absolute` is a tensor of the same shape or a
// scalar one).
void expect_elementwise_close(const torch::Tensor& actual, const torch::Tensor& expected, double relative,
                              const torch::Tensor& absolute) {
  const auto a = actual.to(torch::kDouble), e = expected.to(torch::kDouble);
  const auto excess = (a - e).abs() - (e.abs() * relative + absolute.to(torch::kDouble));
  const auto worst = excess.argmax().item<int64_t>();
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << "at " << worst << ": got " << a.flatten()[worst].item<double>() << ", expected "
      << e.flatten()[worst].item<double>();
}

TEST(Activation, GeluOfBfloat16MatchesFloat64) {
  // qkv's GELU (the MLP's) on bfloat16 against float64 GELU of the same bfloat16 values: each output
  // and each input gradient rounded once to bfloat16, on the route the CPU takes (through float32
  // where it has no AVX-512, which ctest's linear.isa_avx2 rerun makes it look like; LibTorch's
  // bfloat16 GELU otherwise), contiguous and as a transposed view; and second-order gradients.
  torch::manual_seed(18);
  const auto values = torch::cat({torch::randn({4096}) * 3, torch::randn({64}) * 30,
                                  torch::tensor({0.0f, -0.0f, 1e-30f, -1e-30f, -5.0f, -9.0f, 12.0f, 1e30f}),
                                  torch::randn({270000}) * 2})  // the float32 route's chunks: 2 whole, 1 cut
                          .to(torch::kBFloat16);
  const auto probe = torch::randn({values.size(0)}).to(torch::kBFloat16);
  const auto x64 = values.to(torch::kDouble).requires_grad_(true);
  const auto y64 = torch::gelu(x64);
  const auto grad64 = torch::autograd::grad({y64}, {x64}, {probe.to(torch::kDouble)}, true, true)[0];
  // Before the rounding, float32's GELU is x (1 + erf(x/√2)) / 2 (and its derivative alike): in the
  // negative tail 1 + erf cancels, leaving an absolute error of a few float32 ulps of |x|, which
  // bfloat16's relative rounding does not cover (LibTorch's own GELU has it too).
  const double bf16_rounding = std::ldexp(1.0, -8), float32_ulp = std::ldexp(1.0, -23);
  const auto tail = (values.to(torch::kDouble).abs() + 1) * (4 * float32_ulp);
  for (bool transposed : {false, true}) {
    SCOPED_TRACE(transposed ? "transposed view" : "contiguous");
    const auto leaf = (transposed ? values.view({-1, 2}).t().contiguous() : values).clone().requires_grad_(true);
    const auto x = transposed ? leaf.t() : leaf;  // the same values in the same order as `values`
    const auto y = qkv::detail::gelu(x.reshape({-1}));
    ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
    if (!transposed) {
      EXPECT_EQ(graph_has(y, "GeluThroughFloat32"), qkv::detail::gelu_through_float32()) << linear_grad_fn_name(y);
    }
    expect_elementwise_close(y, y64, bf16_rounding, tail);
    y.backward(probe);
    const auto grad = transposed ? leaf.grad().t().reshape({-1}) : leaf.grad();
    // the gradient: GELU'(x) (float32) times the probe, rounded once to bfloat16
    expect_elementwise_close(grad, grad64, bf16_rounding, tail * probe.to(torch::kDouble).abs());
  }
  {
    // create_graph: d/dx of Σ (GELU'(x) · probe)², against float64, within bfloat16's roundings,
    // over the normal values (GELU'' at 1e30 overflows float32 on every route: x² · φ(x)).
    const auto normal = values.slice(0, 0, 4096), normal_probe = probe.slice(0, 0, 4096);
    const auto leaf = normal.clone().requires_grad_(true);
    const auto y = qkv::detail::gelu(leaf);
    const auto g = torch::autograd::grad({y}, {leaf}, {normal_probe}, true, true)[0];
    g.to(torch::kFloat).pow(2).sum().backward();
    const auto normal64 = normal.to(torch::kDouble).requires_grad_(true);
    const auto g64 = torch::autograd::grad({torch::gelu(normal64)}, {normal64}, {normal_probe.to(torch::kDouble)},
                                           true, true)[0];
    const auto want = torch::autograd::grad({g64.pow(2).sum()}, {normal64})[0];
    EXPECT_LT(relative_error(leaf.grad(), want), tolerance_for(torch::kBFloat16, 1));
  }
}

}  // namespace
