#include "support/attention_cases.h"

#include "support/compare.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

namespace qkv_test {

using qkv::AttentionBackend;

const char* to_string(Layout layout) {
  switch (layout) {
    case Layout::Contiguous:
      return "contiguous";
    case Layout::HeadsTransposed:
      return "heads-transposed";
    case Layout::LastTransposed:
      return "last-transposed";
    case Layout::SlicedWithStep:
      return "sliced-with-step";
    case Layout::Unfolded:
      return "unfolded";
    case Layout::ExpandedPositions:
      return "expanded-positions";
    case Layout::ExpandedLeading:
      return "expanded-leading";
    case Layout::OddUnitStrides:
      return "odd-unit-strides";
  }
  return "?";
}

const char* to_string(MaskKind kind) {
  switch (kind) {
    case MaskKind::None:
      return "none";
    case MaskKind::KeyLengths:
      return "key-lengths";
    case MaskKind::BoolKeys:
      return "bool-keys";
    case MaskKind::BoolPairs:
      return "bool-pairs";
    case MaskKind::BoolBroadcast:
      return "bool-broadcast";
    case MaskKind::FloatInf:
      return "float-inf";
    case MaskKind::FloatGrad:
      return "float-requires-grad";
    case MaskKind::FloatGradInf:
      return "float-requires-grad-inf";
  }
  return "?";
}

std::string AttentionCase::describe() const {
  std::ostringstream text;
  text << "case{B=" << B << " H=" << H << " Hkv=" << Hkv << " N=" << N << " S=" << S << " D=" << D << " Dv=" << Dv
       << (causal ? " causal" : "") << (window ? " window=" + std::to_string(*window) : "")
       << (unbatched ? " unbatched" : "") << " mask=" << to_string(mask);
  if (!mask_shape.empty()) text << c10::IntArrayRef(mask_shape) << " mask-layout=" << to_string(mask_layout);
  text << " q=" << to_string(q_layout) << " k=" << to_string(k_layout) << " v=" << to_string(v_layout)
       << " dtype=" << dtype;
  if (scale) text << " scale=" << *scale;
  text << " seed=" << seed << "}";
  return text.str();
}

namespace {

constexpr Layout kLayouts[] = {Layout::Contiguous,     Layout::HeadsTransposed,   Layout::LastTransposed,
                               Layout::SlicedWithStep, Layout::Unfolded,          Layout::ExpandedPositions,
                               Layout::ExpandedLeading, Layout::OddUnitStrides};

Layout draw_layout(Chooser& chooser) {
  // Half the tensors contiguous, so that most cases mix layouts rather than change all three.
  if (chooser.chance(2)) return Layout::Contiguous;
  return kLayouts[chooser.pick(std::size(kLayouts))];
}

// The shapes a case's mask kind allows, every one broadcastable to (B, H, N, S).
std::vector<std::vector<int64_t>> mask_shapes(const AttentionCase& c) {
  std::vector<std::vector<int64_t>> shapes;
  switch (c.mask) {
    case MaskKind::BoolKeys:
      shapes = {{c.B, 1, 1, c.S}};
      break;
    case MaskKind::BoolPairs:
      shapes = {{c.B, c.H, c.N, c.S}};
      break;
    case MaskKind::BoolBroadcast:
    case MaskKind::FloatInf:
      shapes = {{c.N, c.S}};
      break;
    case MaskKind::FloatGrad:
    case MaskKind::FloatGradInf:
      // A bias per pair (T5, Swin: (1, H, N, S)), per batch element, per head and key (ALiBi-like),
      // or one table for everything.
      shapes = {{c.N, c.S}, {1, c.H, c.N, c.S}, {c.B, 1, c.N, c.S}, {c.B, c.H, c.N, c.S}, {c.H, 1, c.S}, {1, c.S}};
      break;
    default:
      break;
  }
  return shapes;
}

// The case's mask shape: its kind's shape number mask_shape_choice for its sizes.
std::vector<int64_t> mask_shape_of(const AttentionCase& c) {
  const auto shapes = mask_shapes(c);
  if (shapes.empty()) return {};
  auto shape = shapes.at(static_cast<size_t>(c.mask_shape_choice));
  // Unbatched cases have no B: drop a leading B (or 1) of a rank-4 shape.
  if (c.unbatched && shape.size() == 4) shape.erase(shape.begin());
  return shape;
}

}  // namespace

AttentionCase draw_case(Chooser& chooser, int64_t max_positions, const std::function<void(AttentionCase&)>& shape_rule) {
  AttentionCase c;
  c.unbatched = chooser.chance(8);
  c.B = c.unbatched ? 1 : chooser.one_of<int64_t>({1, 2, 3});
  c.Hkv = chooser.one_of<int64_t>({1, 2, 3});
  c.H = c.Hkv * chooser.one_of<int64_t>({1, 1, 2, 4});
  // Around the tiled kernel's block sizes (64 rows, 256 keys) and below them, odd ones included.
  const std::vector<int64_t> positions{1, 2, 7, 31, 63, 64, 65, 100, 129, 150, 257};
  auto bounded = [&](int64_t n) { return std::max<int64_t>(1, std::min(n, max_positions)); };
  c.N = bounded(chooser.one_of(positions));
  c.S = chooser.chance(3) ? c.N : bounded(chooser.one_of(positions));
  c.D = chooser.one_of<int64_t>({1, 3, 8, 16, 33, 64});
  c.Dv = chooser.chance(4) ? chooser.one_of<int64_t>({1, 5, 16}) : c.D;
  if (shape_rule) shape_rule(c);
  c.causal = chooser.chance(3);
  // A sliding window in half the causal cases: 1 and 2 keys, odd ones, and one wider than S.
  if (c.causal && chooser.chance(2)) c.window = chooser.one_of<int64_t>({1, 2, 5, 17, 64, c.S + c.N});
  const MaskKind kinds[] = {MaskKind::None,          MaskKind::KeyLengths, MaskKind::BoolKeys,
                            MaskKind::BoolPairs,     MaskKind::BoolBroadcast, MaskKind::FloatInf,
                            MaskKind::FloatGrad,     MaskKind::FloatGradInf};
  c.mask = kinds[chooser.pick(std::size(kinds))];
  if (c.unbatched && c.mask == MaskKind::KeyLengths) c.mask = MaskKind::BoolKeys;  // key_lengths need a batch
  if (const auto shapes = mask_shapes(c); !shapes.empty()) {
    c.mask_shape_choice = chooser.pick(static_cast<int64_t>(shapes.size()));
  }
  c.mask_shape = mask_shape_of(c);
  c.q_layout = draw_layout(chooser);
  c.k_layout = draw_layout(chooser);
  c.v_layout = draw_layout(chooser);
  c.mask_layout = c.mask_shape.empty() ? Layout::Contiguous : draw_layout(chooser);
  c.dtype = chooser.one_of<torch::ScalarType>({torch::kFloat, torch::kFloat, torch::kDouble, torch::kBFloat16});
  if (chooser.chance(5)) c.scale = 0.37;
  c.seed = static_cast<uint64_t>(chooser.pick(1 << 20));
  // One case in 12 with nothing along one dimension: no batch, no query, no key, or a head or
  // value width of 0 (valid inputs; the tiled kernel once failed on them). Drawn last, as 11 of
  // 12, so that the inputs saved before it (a fuzzer's bytes run out as 0s) decode as they did.
  if (chooser.pick(12) == 11) {
    switch (chooser.pick(5)) {
      case 0: c.B = c.unbatched ? c.B : 0; break;
      case 1: c.N = 0; break;
      case 2: c.S = 0; break;
      case 3: c.D = 0; break;
      default: c.Dv = 0; break;
    }
    c.mask_shape = mask_shape_of(c);
  }
  return c;
}

void draw_long_keys(Chooser& chooser, AttentionCase& c, Passes passes) {
  if (passes != Passes::ForwardOnly || c.N > 8 || chooser.pick(4) != 3) return;
  c.S = 1024 + chooser.pick(1600);
  c.mask_shape = mask_shape_of(c);
}

namespace {

// A leaf of `leaf_shape` with values drawn in float64 and rounded to `storage` (so that the
// reference and the tested dtype hold the same numbers), then held in `dtype`.
torch::Tensor leaf_values(c10::IntArrayRef leaf_shape, torch::ScalarType storage, torch::ScalarType dtype) {
  return torch::randn(leaf_shape, torch::kDouble).to(storage).to(dtype);
}

// The (leaf, view) pair of a tensor of logical shape `shape` in `layout`. `values(leaf_shape)`
// makes the leaf's values. Layouts that need more dimensions than `shape` has fall back to contiguous.
std::pair<torch::Tensor, std::function<torch::Tensor(const torch::Tensor&)>> laid_out(
    c10::IntArrayRef shape, Layout layout, const std::function<torch::Tensor(c10::IntArrayRef)>& values) {
  const auto rank = static_cast<int64_t>(shape.size());
  std::vector<int64_t> sizes = shape.vec();
  const int64_t rows = sizes[rank - 2], columns = sizes[rank - 1];
  using View = std::function<torch::Tensor(const torch::Tensor&)>;
  const View identity = [](const torch::Tensor& t) { return t; };
  switch (layout) {
    case Layout::HeadsTransposed: {
      if (rank < 3) break;
      auto stored = sizes;
      std::swap(stored[rank - 3], stored[rank - 2]);
      return {values(stored), [](const torch::Tensor& t) { return t.transpose(-3, -2); }};
    }
    case Layout::LastTransposed: {
      auto stored = sizes;
      std::swap(stored[rank - 2], stored[rank - 1]);
      return {values(stored), [](const torch::Tensor& t) { return t.transpose(-2, -1); }};
    }
    case Layout::SlicedWithStep: {
      auto stored = sizes;
      stored[rank - 2] *= 2, stored[rank - 1] *= 2;
      return {values(stored), [rows, columns](const torch::Tensor& t) {
                return t.slice(-2, 0, 2 * rows, 2).slice(-1, 0, 2 * columns, 2);
              }};
    }
    case Layout::Unfolded: {
      // Row r is elements r .. r + C - 1 of one long row: every row overlaps the next.
      if (rows == 0 || columns == 0) break;  // no rows to overlap (unfold takes no window of 0)
      std::vector<int64_t> stored(sizes.begin(), sizes.end() - 2);
      stored.push_back(rows + columns - 1);
      return {values(stored), [columns](const torch::Tensor& t) { return t.unfold(-1, columns, 1); }};
    }
    case Layout::ExpandedPositions: {
      auto stored = sizes;
      stored[rank - 2] = 1;
      return {values(stored), [sizes](const torch::Tensor& t) { return t.expand(sizes); }};
    }
    case Layout::ExpandedLeading: {
      if (rank < 3) break;
      auto stored = sizes;
      for (int64_t d = 0; d < rank - 2; ++d) stored[d] = 1;
      return {values(stored), [sizes](const torch::Tensor& t) { return t.expand(sizes); }};
    }
    case Layout::OddUnitStrides: {
      // Contiguous strides, except 7 on every dimension of size 1 (which a reader must never use).
      std::vector<int64_t> strides(sizes.size());
      int64_t stride = 1, extent = 1;
      for (int64_t d = rank - 1; d >= 0; --d) {
        strides[d] = sizes[d] == 1 ? 7 : stride;
        if (sizes[d] != 1) stride *= sizes[d];
        extent += (sizes[d] - 1) * strides[d];
      }
      return {values({extent}),
              [sizes, strides](const torch::Tensor& t) { return t.as_strided(sizes, strides); }};
    }
    case Layout::Contiguous:
      break;
  }
  return {values(sizes), identity};
}

}  // namespace

CaseTensors make_tensors(const AttentionCase& c, c10::optional<torch::ScalarType> dtype_override) {
  const auto dtype = dtype_override.value_or(c.dtype);
  torch::manual_seed(c.seed);
  CaseTensors t;
  auto shape = [&](int64_t heads, int64_t positions, int64_t width) {
    return c.unbatched ? std::vector<int64_t>{heads, positions, width} : std::vector<int64_t>{c.B, heads, positions, width};
  };
  auto values = [&](c10::IntArrayRef leaf_shape) { return leaf_values(leaf_shape, c.dtype, dtype); };
  auto make = [&](const std::vector<int64_t>& logical, Layout layout, torch::Tensor& leaf) {
    auto [base, view] = laid_out(logical, layout, values);
    leaf = base.detach().requires_grad_(true);
    return view(leaf);
  };
  t.q = make(shape(c.H, c.N, c.D), c.q_layout, t.q_leaf);
  t.k = make(shape(c.Hkv, c.S, c.D), c.k_layout, t.k_leaf);
  t.v = make(shape(c.Hkv, c.S, c.Dv), c.v_layout, t.v_leaf);
  t.upstream = leaf_values(shape(c.H, c.N, c.Dv), c.dtype, dtype);

  auto options = qkv::ScaledDotProductAttentionOptions().causal(c.causal).window(c.window).scale(c.scale).enable_gqa(
      c.H != c.Hkv);
  // A padding mask as stored before its layout's view: true for a prefix of each row's keys, of
  // random length (0 to all). The keys run along the stored tensor's last dimension, or the one
  // before it where a transpose put them there (its last has size 1); every layout's view of such
  // a prefix is a prefix again (of every second key when sliced with a step).
  const auto padding = [](c10::IntArrayRef stored) {
    const auto rank = static_cast<int64_t>(stored.size());
    const int64_t axis = rank >= 2 && stored[rank - 1] == 1 && stored[rank - 2] > 1 ? rank - 2 : rank - 1;
    auto length_shape = stored.vec();
    length_shape[axis] = 1;
    std::vector<int64_t> position_shape(stored.size(), 1);
    position_shape[axis] = stored[axis];
    return torch::arange(stored[axis], torch::kLong).view(position_shape) <
           torch::randint(0, stored[axis] + 1, length_shape, torch::kLong);
  };
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  switch (c.mask) {
    case MaskKind::None:
      break;
    case MaskKind::KeyLengths: {
      options.key_lengths(torch::randint(0, c.S + 1, {c.B}, torch::kLong));
      break;
    }
    case MaskKind::BoolKeys:
    case MaskKind::BoolPairs:
    case MaskKind::BoolBroadcast: {
      auto bools = [&](c10::IntArrayRef leaf_shape) {
        if (c.mask == MaskKind::BoolKeys && c.seed % 2 == 1) return padding(leaf_shape);
        auto allowed = torch::rand(leaf_shape, torch::kDouble) < 0.7;
        // BoolPairs: a row with no key at all (a fully masked query) wherever the leaf has rows.
        if (c.mask == MaskKind::BoolPairs && leaf_shape.size() >= 2 && leaf_shape[leaf_shape.size() - 2] > 1) {
          allowed.select(-2, leaf_shape[leaf_shape.size() - 2] / 2).fill_(false);
        }
        return allowed;
      };
      auto [base, view] = laid_out(c.mask_shape, c.mask_layout, bools);
      t.mask_leaf = base;
      options.mask(view(base));
      break;
    }
    case MaskKind::FloatInf:
    case MaskKind::FloatGrad:
    case MaskKind::FloatGradInf: {
      const bool with_inf = c.mask != MaskKind::FloatGrad;
      auto floats = [&](c10::IntArrayRef leaf_shape) {
        auto bias = torch::randn(leaf_shape, torch::kDouble);
        if (with_inf) {
          bias.masked_fill_(torch::rand(leaf_shape, torch::kDouble) < 0.2, kNegInf);
          if (c.mask == MaskKind::FloatGradInf && leaf_shape.size() >= 2 && leaf_shape[leaf_shape.size() - 2] > 1) {
            bias.select(-2, 0).fill_(kNegInf);  // a fully masked row
          }
        }
        return bias.to(c.dtype).to(dtype);
      };
      auto [base, view] = laid_out(c.mask_shape, c.mask_layout, floats);
      t.mask_leaf = base.detach().requires_grad_(c.mask != MaskKind::FloatInf);
      options.mask(view(t.mask_leaf));
      break;
    }
  }
  t.options = options;
  return t;
}

CaseOutcome run_case(const AttentionCase& c, AttentionBackend backend, c10::optional<torch::ScalarType> dtype,
                     Passes passes) {
  auto t = make_tensors(c, dtype);
  auto options = t.options;
  CaseOutcome outcome;
  if (passes == Passes::ForwardOnly) {
    const torch::NoGradGuard no_gradients;
    const auto result = qkv::scaled_dot_product_attention(t.q, t.k, t.v, options.backend(backend));
    outcome.output = result.output;
    outcome.backend = result.backend;
    return outcome;
  }
  auto result = qkv::scaled_dot_product_attention(t.q, t.k, t.v, options.backend(backend));
  (result.output * t.upstream).sum().backward();
  outcome.output = result.output.detach();
  outcome.grad_q = t.q_leaf.grad(), outcome.grad_k = t.k_leaf.grad(), outcome.grad_v = t.v_leaf.grad();
  if (t.mask_leaf.defined() && t.mask_leaf.requires_grad()) outcome.grad_mask = t.mask_leaf.grad();
  outcome.backend = result.backend;
  return outcome;
}

namespace {

// float64: 1e-10; float32 and bfloat16: tolerance_for the longest sum behind a result. That is
// D, S or N, and longer where a layout folds many positions into one leaf element (an expanded
// tensor's gradient sums over every position and head it was expanded to). In bfloat16 such a
// fold sums `fold` gradients the backend has each rounded to bfloat16 (and PyTorch's fused
// backward rounds partial sums too, e.g. over grouped heads): rounding errors that add up over the
// log2(fold) levels of a pairwise sum, like a random walk, so the storage term grows by
// sqrt(1 + log2(fold)). (Found by the differential test on PyTorch 2.14: a bfloat16 key expanded
// over 160 positions and 4 query heads, dK off by 0.083 against 0.063 for an unfolded one.)
double tolerance_of(const AttentionCase& c) {
  if (c.dtype == torch::kDouble) return 1e-10;
  const int64_t length = std::max({c.N, c.S, c.D, c.Dv});
  int64_t fold = 1;
  for (const auto layout : {c.q_layout, c.k_layout, c.v_layout, c.mask_layout}) {
    if (layout == Layout::ExpandedPositions || layout == Layout::Unfolded) fold *= std::max(c.N, c.S);
    if (layout == Layout::ExpandedLeading) fold *= c.B * c.H;
  }
  double tolerance = tolerance_for(c.dtype, length * fold);
  if (c.dtype == torch::kBFloat16 && fold > 1) {
    const double storage = tolerance_for(c.dtype, 1);  // 8 · ε_storage, near enough (ε_accumulation is 2^-23)
    tolerance += storage * (std::sqrt(1.0 + std::log2(static_cast<double>(fold))) - 1.0);
  }
  return std::max(1e-5, tolerance);
}

}  // namespace

namespace {

// The gradient of `view` (a view of `leaf`) carried back to the leaf: a layout that folds many view
// elements onto one leaf element (expand, unfold) sums them there, as autograd does.
torch::Tensor onto_leaf(const torch::Tensor& view, const torch::Tensor& leaf, const torch::Tensor& grad) {
  return torch::autograd::grad({view}, {leaf}, {grad}, /*retain_graph=*/true)[0];
}

// Key/value tensors (..., Hkv, S, X) repeated to the query's H heads (query head h reads key/value
// head h / (H / Hkv)), and the way back: a sum over each group.
torch::Tensor to_query_heads(const torch::Tensor& t, int64_t groups) {
  return groups == 1 ? t : t.repeat_interleave(groups, -3);
}
torch::Tensor to_kv_heads(const torch::Tensor& t, int64_t groups) {
  if (groups == 1) return t;
  auto sizes = t.sizes().vec();
  const auto rank = static_cast<int64_t>(sizes.size());
  sizes[rank - 3] /= groups;
  sizes.insert(sizes.begin() + (rank - 2), groups);
  return t.reshape(sizes).sum(-3);
}

}  // namespace

CaseOutcome term_magnitudes(const AttentionCase& c) {
  auto t = make_tensors(c, torch::kDouble);
  auto options = t.options;
  const auto p = qkv::scaled_dot_product_attention(t.q, t.k, t.v,
                                                   options.need_weights(true).backend(AttentionBackend::Math))
                     .weights.detach();  // (..., H, N, S), zero where masked
  const int64_t groups = c.H / c.Hkv;
  const double scale = c.scale.value_or(1.0 / std::sqrt(static_cast<double>(c.D)));
  const auto q = t.q.detach().abs(), k = to_query_heads(t.k.detach().abs(), groups);
  const auto v = to_query_heads(t.v.detach().abs(), groups), upstream = t.upstream.abs();
  // The backward's sums, each with |terms| (dS = P ∘ (dP − rowsum(P ∘ dP)), its two parts added).
  const auto dp = torch::matmul(upstream, v.transpose(-2, -1));
  const auto ds = p * (dp + (p * dp).sum(-1, /*keepdim=*/true));
  CaseOutcome m;
  m.output = torch::matmul(p, v);
  m.grad_q = onto_leaf(t.q, t.q_leaf, scale * torch::matmul(ds, k));
  m.grad_k = onto_leaf(t.k, t.k_leaf, to_kv_heads(scale * torch::matmul(ds.transpose(-2, -1), q), groups));
  m.grad_v = onto_leaf(t.v, t.v_leaf, to_kv_heads(torch::matmul(p.transpose(-2, -1), upstream), groups));
  if (t.mask_leaf.defined() && t.mask_leaf.requires_grad()) {
    const auto& mask = t.options.mask();
    m.grad_mask = onto_leaf(mask, t.mask_leaf, at::sum_to(ds, mask.sizes()));
  }
  return m;
}

std::string compare_outcomes(const AttentionCase& c, const CaseOutcome& actual, const CaseOutcome& reference,
                             const CaseOutcome& magnitudes) {
  std::ostringstream problems;
  const double tolerance = tolerance_of(c);
  double largest_gradient = 0;
  for (const auto* grad : {&reference.grad_q, &reference.grad_k, &reference.grad_v, &reference.grad_mask}) {
    largest_gradient = std::max(largest_gradient, max_abs(*grad));
  }
  // Each result is measured against the largest gradient (or its own largest value) and against
  // the size of the terms it sums (`magnitudes`), whichever is larger: a sum that cancels to a small
  // value carries the rounding of its large terms, in every backend and in PyTorch alike.
  auto compare = [&](const char* name, const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& terms,
                     double against) {
    if (a.defined() != b.defined()) {
      problems << " " << name << (a.defined() ? " defined where math has none" : " missing (math returns it)") << ";";
      return;
    }
    if (!a.defined()) return;
    if (a.sizes() != b.sizes()) {
      problems << " " << name << " of shape " << a.sizes() << ", math's " << b.sizes() << ";";
      return;
    }
    // NaN where the reference has NaN (none is expected here) counts as equal; elsewhere it is an error.
    const auto widened = a.to(torch::kDouble);
    const bool nan_match = torch::equal(widened.isnan(), b.isnan());
    const double error = relative_error(widened.nan_to_num(0), b.nan_to_num(0), std::max(against, max_abs(terms)));
    if (!nan_match || !(error <= tolerance)) {
      problems << " " << name << ": relative error " << error << " > " << tolerance
               << (nan_match ? "" : " (NaN where math has none)") << ";";
    }
  };
  compare("output", actual.output, reference.output, magnitudes.output, 0.0);
  compare("dQ", actual.grad_q, reference.grad_q, magnitudes.grad_q, largest_gradient);
  compare("dK", actual.grad_k, reference.grad_k, magnitudes.grad_k, largest_gradient);
  compare("dV", actual.grad_v, reference.grad_v, magnitudes.grad_v, largest_gradient);
  compare("dMask", actual.grad_mask, reference.grad_mask, magnitudes.grad_mask, largest_gradient);
  return problems.str();
}

std::vector<AttentionBackend> backends_to_check() {
  std::vector<AttentionBackend> backends{AttentionBackend::Auto, AttentionBackend::Math, AttentionBackend::Tiled};
  if (qkv::fused_backend_available()) backends.push_back(AttentionBackend::Fused);
  return backends;
}

std::string check_case(const AttentionCase& c, Passes passes) {
  std::ostringstream report;
  const auto reference = run_case(c, AttentionBackend::Math, torch::kDouble, passes);
  const auto magnitudes = term_magnitudes(c);
  for (const auto backend : backends_to_check()) {
    if (backend == AttentionBackend::Math && c.dtype == torch::kDouble) continue;  // the reference itself
    try {
      const auto outcome = run_case(c, backend, c10::nullopt, passes);
      const auto problems = compare_outcomes(c, outcome, reference, magnitudes);
      if (!problems.empty()) report << "\n  " << backend << " (ran " << outcome.backend << "):" << problems;
    } catch (const c10::Error& error) {
      const std::string message = error.what_without_backtrace();
      // An explicitly chosen backend may refuse what it does not support, saying so; Auto may not.
      const bool named_refusal = backend != AttentionBackend::Auto && message.find("backend") != std::string::npos;
      if (!named_refusal) report << "\n  " << backend << " threw: " << message;
    } catch (const std::exception& error) {
      report << "\n  " << backend << " threw an exception that is not a c10::Error: " << error.what();
    }
  }
  const auto text = report.str();
  if (text.empty()) return text;
  return c.describe() + (passes == Passes::ForwardOnly ? " (forward only, no gradients)" : "") + text;
}

}  // namespace qkv_test
