// Random cases of the attention core for the differential test (tests/test_backends_agree.cpp) and
// the libFuzzer target (fuzz/fuzz_backends.cpp): shapes, grouped-query heads, causal with N != S,
// every mask kind and broadcast shape, eight memory layouts of q, k, v and the mask, three dtypes.
// A case is drawn from a Chooser (a seeded generator in the test, the fuzzer's bytes in the
// fuzzer), printed whole by describe(), and run by every backend against the math path on the
// same leaf tensors, comparing the output and the gradient of every input, the mask's included.
//
// B = batch, H = query heads, Hkv = key/value heads, N = queries, S = keys, D = head width, Dv = value width.
#pragma once

#include <qkv/functional.h>

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace qkv_test {

/// Where a case's choices come from: pick(n) returns a number in [0, n).
class Chooser {
 public:
  virtual ~Chooser() = default;
  virtual int64_t pick(int64_t n) = 0;
  template <typename T>
  T one_of(const std::vector<T>& values) {
    return values[static_cast<size_t>(pick(static_cast<int64_t>(values.size())))];
  }
  bool chance(int64_t one_in) { return pick(one_in) == 0; }
};

/// Choices from a seeded std::mt19937 (the differential test).
class RandomChooser : public Chooser {
 public:
  explicit RandomChooser(uint32_t seed) : random_(seed) {}
  int64_t pick(int64_t n) override { return std::uniform_int_distribution<int64_t>(0, n - 1)(random_); }

 private:
  std::mt19937 random_;
};

/// Choices read from bytes (the fuzzer); 0 once they run out.
class ByteChooser : public Chooser {
 public:
  ByteChooser(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  int64_t pick(int64_t n) override {
    if (n <= 1 || position_ >= size_) return 0;
    return data_[position_++] % n;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t position_ = 0;
};

/// How a tensor of a given logical shape sits in memory: each gives a view whose strides the
/// kernels must read correctly (or normalise), with the gradient landing on the leaf behind it.
enum class Layout {
  Contiguous,
  HeadsTransposed,    // stored (B, N, H, D), viewed (B, H, N, D): the module's split_heads
  LastTransposed,     // stored (..., D, N), viewed (..., N, D): stride(-1) != 1
  SlicedWithStep,     // every second row and column of a larger tensor
  Unfolded,           // unfold(positions): overlapping rows, stride(-2) = 1 < D
  ExpandedPositions,  // one row expanded along positions: stride(-2) = 0
  ExpandedLeading,    // expanded along batch and heads: stride 0 in front
  OddUnitStrides,     // as_strided with odd strides on every size-1 dimension
};
const char* to_string(Layout layout);

enum class MaskKind {
  None,
  KeyLengths,     // options.key_lengths
  BoolKeys,       // bool (B, 1, 1, S); for odd seeds a padding mask (a prefix of each row's keys)
  BoolPairs,      // bool (B, H, N, S), some rows fully masked
  BoolBroadcast,  // bool (N, S)
  FloatInf,       // float (N, S) with -inf entries
  FloatGrad,      // float (B|1, H|1, N, S) requiring grad: a learned bias (ALiBi, T5, Swin)
  FloatGradInf,   // the same with -inf entries and a fully masked row
};
const char* to_string(MaskKind kind);

struct AttentionCase {
  int64_t B = 1, H = 1, Hkv = 1, N = 1, S = 1, D = 1, Dv = 1;
  bool causal = false;
  c10::optional<int64_t> window;  // sliding window (causal cases only)
  bool unbatched = false;  // q, k, v of rank 3 (H, N, D): no batch dimension
  MaskKind mask = MaskKind::None;
  std::vector<int64_t> mask_shape;  // of the float/bool mask
  int64_t mask_shape_choice = 0;    // which of the mask kind's shapes (draw_mask_shape)
  Layout q_layout = Layout::Contiguous, k_layout = Layout::Contiguous, v_layout = Layout::Contiguous;
  Layout mask_layout = Layout::Contiguous;
  torch::ScalarType dtype = torch::kFloat;
  c10::optional<double> scale;
  uint64_t seed = 0;  // of the tensors' values

  std::string describe() const;
};

/// Draws a case. `max_positions` bounds N and S (the fuzzer keeps cases small). `shape_rule`, if
/// given, may change the drawn sizes (B, H, Hkv, N, S, D, Dv) before the mask, layouts and dtype
/// are drawn for them (a test of one family of shapes).
AttentionCase draw_case(Chooser& chooser, int64_t max_positions = 160,
                        const std::function<void(AttentionCase&)>& shape_rule = {});

/// The case's leaf tensors and the views the backends see.
struct CaseTensors {
  torch::Tensor q_leaf, k_leaf, v_leaf, mask_leaf;  // what gradients are compared on
  torch::Tensor q, k, v;                            // views in the case's layouts
  qkv::ScaledDotProductAttentionOptions options;    // mask (a view of mask_leaf), key_lengths, causal, ...
  torch::Tensor upstream;                           // the gradient fed to the output
};

/// Builds the case's tensors in `dtype` (the case's own unless given), from the case's seed, so that
/// two calls give equal values: the reference (float64) and the tested dtype see the same numbers.
CaseTensors make_tensors(const AttentionCase& c, c10::optional<torch::ScalarType> dtype = c10::nullopt);

/// What one backend gave: output and the gradients of the leaves (undefined where none).
struct CaseOutcome {
  torch::Tensor output, grad_q, grad_k, grad_v, grad_mask;
  qkv::AttentionBackend backend = qkv::AttentionBackend::Math;
};

/// How a case is run: forward and backward, or the forward alone with gradients off (inference: a
/// decoded token), where a backend may take another path (the tiled kernel's rows by dot products).
enum class Passes { ForwardBackward, ForwardOnly };

/// How the fuzzer runs a case it has drawn: one in four forward only. Drawn after the case, and
/// with no byte left it is forward and backward, so the inputs saved before it decode as they did.
inline Passes draw_passes(Chooser& chooser) {
  return chooser.pick(4) == 3 ? Passes::ForwardOnly : Passes::ForwardBackward;
}

/// One in four of the fuzzer's forward-only cases of at most 8 query rows (decoded tokens) given
/// 1024 to 2623 keys, where the tiled kernel splits the keys of few heads into ranges
/// (src/kernels/tiled/forward.cpp); the mask's shape follows. Drawn after the passes, and with no
/// byte left nothing changes, so the inputs saved before it decode as they did.
void draw_long_keys(Chooser& chooser, AttentionCase& c, Passes passes);

/// Runs the case through `backend` (forward, then backward of sum(output * upstream); or, with
/// Passes::ForwardOnly, the forward under torch::NoGradGuard, no gradient in the outcome).
CaseOutcome run_case(const AttentionCase& c, qkv::AttentionBackend backend,
                     c10::optional<torch::ScalarType> dtype = c10::nullopt, Passes passes = Passes::ForwardBackward);

/// The size of the terms behind each result of the case, in float64: the forward and backward
/// sums taken over |q|, |k|, |v|, |upstream| and the weights P, with dS = P ∘ (dP − rowsum(P ∘ dP))
/// as P ∘ (|dP| + rowsum(P ∘ |dP|)), carried to the leaves as their gradients are. Rounding error
/// in a sum is bounded by the size of its terms, not of its result: where a gradient cancels to
/// almost nothing (a query expanded over 80 positions, its 6400 terms summing to 1e-5 of their
/// size, found by the fuzzer), float32 cannot give it to 1e-4 of itself, in any backend.
CaseOutcome term_magnitudes(const AttentionCase& c);

/// Compares `actual` with the float64 math path's outcome `reference`; returns "" when they agree,
/// else what differs and by how much. Tolerances: float64 1e-10, else tolerance_for the longest sum
/// behind a result, at least 1e-5, relative to the largest of: the result's own largest value (for
/// gradients: the largest gradient) and its largest term magnitude (term_magnitudes).
std::string compare_outcomes(const AttentionCase& c, const CaseOutcome& actual, const CaseOutcome& reference,
                             const CaseOutcome& magnitudes);

/// The backends a case is checked on in this build: Auto, Tiled, and Fused where LibTorch has it.
std::vector<qkv::AttentionBackend> backends_to_check();

/// Runs `c` through every backend of backends_to_check() and compares each with float64 Math.
/// Returns "" when all agree or refuse with a c10::Error naming what they do not support (only an
/// explicitly chosen backend may refuse; Auto must not), else every disagreement, with the case.
/// Passes::ForwardOnly compares the outputs of forwards run without gradients.
std::string check_case(const AttentionCase& c, Passes passes = Passes::ForwardBackward);

}  // namespace qkv_test
