// Rotary position embedding: each pair (x[i], x[i + D/2]) of a head's query or key is rotated by
// an angle proportional to its position, so that q·k depends on the positions' difference only.
#include "rope.h"

#include <torch/torch.h>

namespace qkv::detail {

torch::Tensor apply_rope(const torch::Tensor& x, int64_t offset, double base) {
  const int64_t num_positions = x.size(-2);
  const int64_t half = x.size(-1) / 2;
  const auto f64 = torch::TensorOptions(torch::kDouble).device(x.device());
  const auto frequencies = torch::pow(base, -torch::arange(half, f64) * (2.0 / static_cast<double>(2 * half)));
  const auto positions = torch::arange(offset, offset + num_positions, f64);
  const auto angles = positions.unsqueeze(1) * frequencies.unsqueeze(0);  // (N, D/2)
  const bool half_precision = x.scalar_type() == torch::kHalf || x.scalar_type() == torch::kBFloat16;
  const auto table_dtype = half_precision ? torch::kFloat : x.scalar_type();
  const auto cos = angles.cos().to(table_dtype);  // (N, D/2)
  const auto sin = angles.sin().to(table_dtype);
  const auto input = half_precision ? x.to(torch::kFloat) : x;
  const auto x1 = input.narrow(-1, 0, half);     // (..., N, D/2)
  const auto x2 = input.narrow(-1, half, half);  // (..., N, D/2)
  auto rotated = torch::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, /*dim=*/-1);  // (..., N, D)
  return half_precision ? rotated.to(x.scalar_type()) : rotated;
}

}  // namespace qkv::detail
