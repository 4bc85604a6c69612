// Loading the PyTorch parity fixtures written by scripts/gen_reference.py, and comparing tensors
// with messages that say how far off they are.
#pragma once

#include <qkv/qkv.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

namespace qkv_test {

/// Path of a file in tests/data.
std::string data_path(const std::string& name);

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

  /// The module the fixture describes, with the fixture's weights, in the fixture's dtype.
  qkv::SelfAttention make_module() const;
  /// The inputs' masks as qkv::AttentionMask (key_lengths, attn_mask).
  qkv::AttentionMask mask() const;

 private:
  std::string name_;
  c10::impl::GenericDict dict_;
};

/// max |a - b| / max(1, max |b|): a relative error that does not blow up near zero.
double relative_error(const torch::Tensor& actual, const torch::Tensor& expected);

/// gtest assertion: same shape and relative_error <= tolerance.
::testing::AssertionResult tensors_close(const torch::Tensor& actual, const torch::Tensor& expected,
                                         double tolerance);

}  // namespace qkv_test
