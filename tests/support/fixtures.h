// Loading the PyTorch parity fixtures written by scripts/gen_reference.py, and comparing tensors
// with messages that say how far off they are.
#pragma once

#include "support/compare.h"

#include <qkv/qkv.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>

namespace qkv_test {

/// Path of a file in tests/data.
std::string data_path(const std::string& name);

/// The zip archive `bytes` (torch.save's, or a checkpoint) written again by LibTorch's writer, CRCs
/// and offsets right, each entry's contents through `change` (its name relative to the archive's
/// folder, "code/__torch__.py"): a file damaged or crafted past the archive check.
std::string rewrite_archive(const std::string& bytes,
                            const std::function<void(const std::string& name, std::string& contents)>& change);

/// One fixture: a flat dict of tensors and config scalars (see scripts/gen_reference.py).
class Fixture {
 public:
  /// tests/data/parity_<case_name>.pt, or tests/data/<case_name> when it ends in .pt.
  explicit Fixture(const std::string& case_name);

  bool has(const std::string& key) const;
  torch::Tensor tensor(const std::string& key) const;
  int64_t integer(const std::string& key) const;
  double real(const std::string& key) const;
  bool flag(const std::string& key, bool fallback) const;
  std::string text(const std::string& key) const;

  /// The module the fixture describes, with the fixture's weights, in the fixture's dtype.
  qkv::SelfAttention make_module() const;
  /// The same for a fixture of a TransformerBlock (config.kind == "block").
  qkv::TransformerBlock make_block() const;
  /// The fixture's "param.*" tensors, under their names without the prefix.
  std::map<std::string, torch::Tensor> parameters() const;
  /// The inputs' masks as qkv::AttentionMask (key_lengths, attn_mask).
  qkv::AttentionMask mask() const;

 private:
  std::string name_;
  c10::impl::GenericDict dict_;
};



/// gtest assertion: same shape and relative_error(actual, expected, scale) <= tolerance.
::testing::AssertionResult tensors_close(const torch::Tensor& actual, const torch::Tensor& expected, double tolerance,
                                         double scale = 0.0);

/// gtest assertion: every element of `actual` (rounded once to a format of unit roundoff
/// `unit_roundoff`, 2^-8 for bfloat16) within one rounding of `reference` (float64):
/// |actual - reference| <= unit_roundoff · |reference| + 1e-4 · max |reference| (the second term
/// for what the float32 arithmetic before the rounding may add). Names the worst element's ratio.
::testing::AssertionResult within_one_rounding(const torch::Tensor& actual, const torch::Tensor& reference,
                                               double unit_roundoff);

/// The seeds first .. last - 1 a randomised test runs: `fallback`, or the environment variable's
/// "first:last" (to explore others) or "N" (seed N alone, e.g. under a debugger).
std::pair<uint32_t, uint32_t> seed_range(const char* variable, std::pair<uint32_t, uint32_t> fallback);

/// LibTorch's intra-op threads set to `count` for a scope and set back after it, a failed
/// assertion's early return included.
class ThreadCount {
 public:
  explicit ThreadCount(int count) : previous_(at::get_num_threads()) { at::set_num_threads(count); }
  ~ThreadCount() { at::set_num_threads(previous_); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int previous_;
};

/// What AttentionBackend::Auto runs on the CPU for float32 inputs without weights, as documented:
/// the tiled kernel (float32 runs on its own micro-kernels, BLAS or not).
qkv::AttentionBackend default_cpu_backend();


/// After the fixture's loss went backward through `module`: the gradient of `input` against the
/// fixture's "grad.query" and of every parameter against "grad.<name>", each judged relative to the
/// largest of all these gradients (a bias whose exact gradient is 0 comes out as rounding noise).
/// `label` names the case in the failure messages.
void expect_gradients_match(const Fixture& fixture, const torch::nn::Module& module, const torch::Tensor& input,
                            double tolerance, const std::string& label);

}  // namespace qkv_test
