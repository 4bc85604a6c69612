#include "support/compare.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace qkv_test {

double tolerance_for(torch::ScalarType dtype, int64_t reduction_length) {
  const bool half = dtype == torch::kBFloat16 || dtype == torch::kHalf;
  auto epsilon = [](torch::ScalarType t) {
    switch (t) {
      case torch::kDouble:
        return std::numeric_limits<double>::epsilon();
      case torch::kBFloat16:
        return 0.0078125;  // 2^-7: 8 significant bits
      case torch::kHalf:
        return 0.0009765625;  // 2^-10: 11 significant bits
      default:
        return static_cast<double>(std::numeric_limits<float>::epsilon());
    }
  };
  const double storage_epsilon = epsilon(dtype);
  const double accumulation_epsilon = half ? epsilon(torch::kFloat) : epsilon(dtype);
  const double length = static_cast<double>(std::max<int64_t>(reduction_length, 1));
  return 8.0 * (storage_epsilon + std::sqrt(length) * accumulation_epsilon);
}

double max_abs(const torch::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return 0.0;
  return t.detach().abs().max().to(torch::kCPU, torch::kDouble).item<double>();
}

double relative_error(const torch::Tensor& actual, const torch::Tensor& expected, double scale) {
  auto a = actual.detach().to(torch::kCPU, torch::kDouble);
  auto b = expected.detach().to(torch::kCPU, torch::kDouble);
  if (b.numel() == 0) return 0.0;
  const double difference = (a - b).abs().max().item<double>();
  const double denominator = std::max(max_abs(b), scale);
  if (denominator == 0.0) return difference == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return difference / denominator;
}

}  // namespace qkv_test
