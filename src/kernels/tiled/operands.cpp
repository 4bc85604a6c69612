#include "kernels/tiled/operands.h"

#include "kernels/kernels.h"

#include <torch/torch.h>

namespace qkv::kernels::tiled {

bool kernel_readable(const torch::Tensor& t) {
  const int64_t rows = t.size(-2), width = t.size(-1);
  const bool unit_width_stride = width <= 1 || t.stride(-1) == 1;
  const bool rows_apart = rows <= 1 || t.stride(-2) >= width;
  return unit_width_stride && rows_apart;
}

namespace {

// (..., rows, width) as (B, H, rows, width). Rank 3 is (H, ...) with grouped heads, else (B, ...).
torch::Tensor as_four_dims(const torch::Tensor& t, bool grouped) {
  switch (t.dim()) {
    case 2:
      return t.unsqueeze(0).unsqueeze(0);
    case 3:
      return grouped ? t.unsqueeze(0) : t.unsqueeze(1);
    case 4:
      return t;
    default:
      return t.reshape({-1, t.size(-3), t.size(-2), t.size(-1)});
  }
}

torch::Tensor readable(const torch::Tensor& t) { return kernel_readable(t) ? t : t.contiguous(); }

}  // namespace

torch::Tensor empty_in_layout_of(const torch::Tensor& like, int64_t width, const torch::TensorOptions& options) {
  const int64_t B = like.size(0), H = like.size(1), rows = like.size(2);
  const bool heads_within_positions = H > 1 && rows > 1 && like.stride(1) < like.stride(2);
  if (heads_within_positions) return torch::empty({B, rows, H, width}, options).transpose(1, 2);
  return torch::empty({B, H, rows, width}, options);
}

torch::Tensor kernel_operand(const torch::Tensor& t, bool grouped) {
  // contiguous() may keep odd strides on dimensions of size 1 (it calls a tensor contiguous
  // without looking at them); kernel_readable ignores those too, and the kernel never steps along them.
  return readable(as_four_dims(t, grouped));
}

bool grouped_heads(const torch::Tensor& q, const torch::Tensor& k, const ScaledDotProductAttentionOptions& options) {
  return options.enable_gqa() && query_groups(q, k) > 1;
}

std::pair<torch::Tensor, torch::Tensor> kernel_conditions(const torch::Tensor& q, const torch::Tensor& k,
                                                          const ScaledDotProductAttentionOptions& options,
                                                          bool grouped) {
  torch::Tensor kernel_mask, kernel_lengths;
  const auto& mask = options.mask();
  if (mask.defined()) {
    // Floating masks in the accumulation type (float32 for bfloat16, whose 8 bits of mantissa
    // would round a bias the other backends add exactly).
    kernel_mask = mask;
    if (mask.is_floating_point()) kernel_mask = mask.to(q.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat);
    auto scores_shape = q.sizes().vec();
    scores_shape.back() = k.size(-2);
    // (B, H, N, S), stride 0 where it broadcasts
    kernel_mask = as_four_dims(kernel_mask.expand(scores_shape), grouped);
  } else {
    kernel_mask = torch::empty({0}, torch::kBool);
  }
  const auto& lengths = options.key_lengths();
  kernel_lengths =
      lengths.defined() ? lengths.to(torch::kCPU, torch::kLong).contiguous() : torch::empty({0}, torch::kLong);
  return {kernel_mask, kernel_lengths};
}

}  // namespace qkv::kernels::tiled
