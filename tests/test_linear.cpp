// Linear layers on oneDNN's GEMM (src/linear.h, src/kernels/linear/onednn_gemm.h) against a
// float64 at::linear of the same values: the output and the gradients of the input, the weight and
// the bias, for inputs and weights as views with every layout the route accepts or normalises
// (contiguous, transposed, sliced, broadcast), odd sizes, with and without bias; second-order
// gradients; the bfloat16 route under CPU autocast against float64 of the bfloat16-rounded
// operands, and its rounding against c10::BFloat16's; and what stays on LibTorch's route (float64,
// a 1-D input, small products).
#include "kernels/linear/bfloat16_products.h"
#include "kernels/linear/onednn_gemm.h"
#include "linear.h"

#include "support/compare.h"

#include <qkv/precision.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <link.h>

#include <cstring>
#include <string>

namespace {

using qkv::kernels::linear::OneDnnGemm;
using qkv_test::relative_error;
using qkv_test::tolerance_for;

// Written here apart from onednn_gemm.cpp's own lookup, so that the test does not check that code with itself.
bool onednn_loaded() {
  bool found = false;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        const char* name = info->dlpi_name ? info->dlpi_name : "";
        if (std::strstr(name, "libdnnl.so")) *static_cast<bool*>(out) = true;
        return 0;
      },
      &found);
  return found;
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
enum class OperandLayout { Contiguous, Transposed, Sliced, Expanded };

const char* operand_layout_name(OperandLayout layout) {
  switch (layout) {
    case OperandLayout::Contiguous: return "contiguous";
    case OperandLayout::Transposed: return "transposed";
    case OperandLayout::Sliced: return "sliced";
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
  // Debian's LibTorch links libdnnl: the route must find it there (and say which one ran).
  const auto& gemm = OneDnnGemm::instance();
  if (!onednn_loaded()) GTEST_SKIP() << "this LibTorch loads no libdnnl: " << gemm.description();
  EXPECT_TRUE(gemm.available()) << gemm.description();
  EXPECT_EQ(gemm.description().rfind("oneDNN ", 0), 0u) << gemm.description();
}

TEST(Linear, MatchesFloat64OverLayoutsAndSizes) {
  torch::manual_seed(11);
  const bool routed = OneDnnGemm::instance().available();
  struct Shape {
    int64_t batch, rows, in, out;
  };
  // Small products stay on LibTorch's route (kOneDnnFromMultiplyAdds); the others are oneDNN's.
  for (const auto& s : {Shape{2, 5, 3, 7}, Shape{1, 1, 1, 1}, Shape{3, 33, 17, 65}, Shape{2, 64, 128, 384},
                        Shape{1, 130, 257, 31}, Shape{2, 40, 96, 161}, Shape{1, 4, 512, 256}}) {
    for (auto x_layout : {OperandLayout::Contiguous, OperandLayout::Transposed, OperandLayout::Sliced, OperandLayout::Expanded}) {
      for (auto w_layout : {OperandLayout::Contiguous, OperandLayout::Transposed, OperandLayout::Sliced}) {
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
          const auto b = bias ? linear_operand_as(b_values, OperandLayout::Contiguous) : torch::Tensor();
          const auto got = run(qkv::detail::linear, x, w, b, probe, expanded);

          const auto x64 = x_values.to(torch::kDouble).requires_grad_(true);
          const auto w64 = w_values.to(torch::kDouble).requires_grad_(true);
          const auto b64 = bias ? b_values.to(torch::kDouble).requires_grad_(true) : torch::Tensor();
          const auto want = run([](auto&&... a) { return torch::linear(a...); }, x64, w64, b64,
                                probe.to(torch::kDouble), expanded);

          // Each result is a sum over K = in (y, grad_x... over out), the weight's over the rows.
          const auto tolerance = tolerance_for(torch::kFloat, std::max({s.in, s.out, s.batch * s.rows * 3}));
          EXPECT_LT(relative_error(got.y, want.y), tolerance);
          EXPECT_LT(relative_error(got.grad_x, want.grad_x), tolerance);
          EXPECT_LT(relative_error(got.grad_w, want.grad_w), tolerance);
          if (bias) {
            EXPECT_LT(relative_error(got.grad_b, want.grad_b), tolerance);
          }

          // The route the rule names ran (either would pass the checks above).
          const int64_t rows = (expanded ? 3 : s.batch) * s.rows;
          const bool large = rows >= qkv::detail::kOneDnnFromRows &&
                             rows * s.in * s.out >= qkv::detail::kOneDnnFromMultiplyAdds;
          const auto y = qkv::detail::linear(x, w, b);
          EXPECT_EQ(graph_has(y, "OneDnnLinear"), routed && large) << linear_grad_fn_name(y);
        }
      }
    }
  }
}

TEST(Linear, SecondOrderGradientsMatchFloat64) {
  // create_graph: the backward runs on LibTorch's differentiable ops, so a gradient penalty works.
  torch::manual_seed(12);
  // 128 rows, 64 -> 96: large enough for oneDNN's route (kOneDnnFromMultiplyAdds).
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
  if (OneDnnGemm::instance().available()) {
    EXPECT_TRUE(graph_has(qkv::detail::linear(x, w, b), "OneDnnLinear"));
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
  EXPECT_FALSE(graph_has(qkv::detail::linear(x64, w.to(torch::kDouble), b.to(torch::kDouble)), "OneDnn"));
  // Under CPU autocast LibTorch's at::linear casts to bfloat16 (and so must the route).
  {
    qkv::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
    const auto y = qkv::detail::linear(torch::randn({2, 3, 6}), w, b);
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    EXPECT_FALSE(graph_has(y, "OneDnn")) << linear_grad_fn_name(y);
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
    c10::InferenceMode inference;
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
}

TEST(Linear, Bfloat16AutocastMatchesFloat64OfRoundedOperands) {
  // Under CPU autocast to bfloat16 a linear layer multiplies its operands rounded to bfloat16 and
  // returns bfloat16: the reference is float64 on the same rounded operands. Where oneDNN's
  // bfloat16 GEMM takes the product (bfloat16_products_on_onednn) its gradients are float32 for
  // float32 inputs; on LibTorch's route (other CPUs) the same checks hold within bfloat16's
  // rounding.
  torch::manual_seed(16);
  const bool routed = OneDnnGemm::instance().available() && qkv::detail::bfloat16_products_on_onednn();
  struct Shape {
    int64_t batch, rows, in, out;
  };
  // 300 rows: one block of 256 and a tail; 4 rows × 512 × 256: the smallest product routed.
  for (const auto& s : {Shape{2, 64, 128, 384}, Shape{1, 300, 96, 161}, Shape{1, 4, 512, 256}}) {
    for (auto x_layout : {OperandLayout::Contiguous, OperandLayout::Transposed, OperandLayout::Sliced}) {
      for (auto w_layout : {OperandLayout::Contiguous, OperandLayout::Transposed}) {
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
            const auto b = bias ? linear_operand_as(b_values, OperandLayout::Contiguous) : torch::Tensor();
            torch::Tensor y;
            {
              qkv::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
              y = qkv::detail::linear(x, w, b);
            }
            EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
            EXPECT_EQ(graph_has(y, "OneDnnLinear"), routed) << linear_grad_fn_name(y);
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
  EXPECT_EQ(graph_has(y, "OneDnnLinear"),
            OneDnnGemm::instance().available() && qkv::detail::bfloat16_products_on_onednn());
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
