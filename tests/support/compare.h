// How far a result is from its reference, and how far it may be: the comparisons every test and
// the fuzzers use, without GoogleTest (fixtures.h adds the gtest assertion on top).
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace qkv_test {

/// The tolerance for a result computed in `dtype` compared with an independent reference, as a
/// relative error (see relative_error): 8 · (ε_storage + sqrt(K) · ε_accumulation), where K is the
/// length of the longest sum behind the result (D for scores, S for the weighted sum of values, N
/// for gradients of keys and values). Why this number: the rounding errors of a sum of K terms,
/// independent of one another, grow like sqrt(K)·ε (a random walk; Higham, Accuracy and Stability
/// of Numerical Algorithms, ch. 3), and each stored intermediate adds one rounding of its storage
/// type; half types accumulate in float32 but store in their own precision. The factor 8 covers
/// the handful of chained operations (projection, scores, softmax, weighted sum, and their
/// backward) that each contribute such an error, and the gap between a typical and a worst row.
double tolerance_for(torch::ScalarType dtype, int64_t reduction_length);

/// max |a - b| / max(max |b|, scale): the error relative to the size of the expected tensor, or
/// to `scale` when that is larger (a quantity whose exact value is 0, such as the gradient of a
/// bias that softmax ignores, is judged against the size of the quantities around it). When both
/// are 0 the tensors must be equal (0 if they are, infinity if not).
double relative_error(const torch::Tensor& actual, const torch::Tensor& expected, double scale = 0.0);

/// max |t| (0 for an empty or undefined tensor).
double max_abs(const torch::Tensor& t);

}  // namespace qkv_test
