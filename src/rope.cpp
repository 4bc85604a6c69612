// Rotary position embedding: each pair (x[i], x[i + D/2]) of a head's query or key is rotated by
// an angle proportional to its position, so that q·k depends on the positions' difference only.
#include "rope.h"

#include <torch/torch.h>

namespace qkv::detail {

namespace {

bool half_precision(torch::ScalarType dtype) { return dtype == torch::kHalf || dtype == torch::kBFloat16; }

}  // namespace

RopeTable rope_table(int64_t offset, int64_t positions, int64_t head_dim, double base, torch::ScalarType dtype,
                     const torch::Device& device) {
  const int64_t half = head_dim / 2;
  const auto f64 = torch::TensorOptions(torch::kDouble).device(device);
  const auto frequencies = torch::pow(base, -torch::arange(half, f64) * (2.0 / static_cast<double>(2 * half)));
  const auto angles =
      torch::arange(offset, offset + positions, f64).unsqueeze(1) * frequencies.unsqueeze(0);  // (P, D/2)
  const auto table_dtype = half_precision(dtype) ? torch::kFloat : dtype;
  return {angles.cos().to(table_dtype), angles.sin().to(table_dtype)};
}

torch::Tensor apply_rope(const torch::Tensor& x, const RopeTable& table) {
  const int64_t half = x.size(-1) / 2;
  const bool reduced = half_precision(x.scalar_type());
  const auto input = reduced ? x.to(torch::kFloat) : x;
  const auto x1 = input.narrow(-1, 0, half);     // (..., N, D/2)
  const auto x2 = input.narrow(-1, half, half);  // (..., N, D/2)
  auto rotated = torch::cat({x1 * table.cos - x2 * table.sin, x2 * table.cos + x1 * table.sin}, /*dim=*/-1);
  return reduced ? rotated.to(x.scalar_type()) : rotated;  // (..., N, D)
}

torch::Tensor apply_rope(const torch::Tensor& x, int64_t offset, double base) {
  return apply_rope(x, rope_table(offset, x.size(-2), x.size(-1), base, x.scalar_type(), x.device()));
}

}  // namespace qkv::detail
