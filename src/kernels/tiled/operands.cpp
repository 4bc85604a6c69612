#include "kernels/tiled/operands.h"

#include "kernels/kernels.h"
#include "mask_algebra.h"

#include <torch/torch.h>

namespace qkv::kernels::tiled {

bool kernel_readable(const torch::Tensor& t) {
  // An empty tensor's strides can be anything (an expanded gradient of an empty output: all 0),
  // and contiguous() leaves them so.
  if (t.numel() == 0) return true;
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

// B of as_four_dims(t, grouped), without forming it.
int64_t batch_of(const torch::Tensor& t, bool grouped) {
  if (t.dim() <= 2 || (t.dim() == 3 && grouped)) return 1;
  int64_t batch = 1;
  for (int64_t d = 0; d < t.dim() - 3 + (t.dim() == 3 ? 1 : 0); ++d) batch *= t.size(d);
  return batch;
}

// The key lengths (B,) of a (B or 1, H or 1, N, S) mask view that only pads keys: the same for
// every head and query row (stride 0 there), each batch row a padding row as detail::padding_lengths
// says; undefined for any other mask, and for a learned one (its gradient is wanted everywhere).
torch::Tensor padding_lengths(const torch::Tensor& mask, int64_t B) {
  const auto broadcast = [&](int64_t dim) { return mask.size(dim) == 1 || mask.stride(dim) == 0; };
  if (mask.numel() == 0 || !broadcast(1) || !broadcast(2) || mask.requires_grad()) return {};
  return qkv::detail::padding_lengths(mask.select(2, 0).select(1, 0), B);  // its rows (B or 1, S)
}

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
    auto shape = q.sizes().vec();  // the scores' (..., N, S)
    shape.back() = k.size(-2);
    const auto rank = static_cast<int64_t>(shape.size());
    if (rank <= 4) {
      // (B, H, N, S) with stride 0 where it broadcasts, except that the batch and the heads keep
      // size 1 where the mask has it: the backward then sums a learned mask's gradient over them
      // itself (backward.cpp), instead of writing one per batch element and head for autograd to sum.
      for (int64_t d = 0; d < rank - 2; ++d) {
        const int64_t mask_dim = d - (rank - kernel_mask.dim());
        if (mask_dim < 0 || kernel_mask.size(mask_dim) == 1) shape[d] = 1;
      }
    }
    kernel_mask = as_four_dims(kernel_mask.expand(shape), grouped);
  }
  const auto& lengths = options.key_lengths();
  if (lengths.defined()) kernel_lengths = lengths.to(torch::kCPU, torch::kLong).contiguous();
  if (kernel_mask.defined()) {
    // Padding as key lengths (the least of the two where both are given).
    if (const auto padding = padding_lengths(kernel_mask, batch_of(q, grouped)); padding.defined()) {
      kernel_lengths = kernel_lengths.defined() ? torch::minimum(kernel_lengths, padding) : padding;
      kernel_mask = torch::Tensor();
    }
  }
  if (!kernel_mask.defined()) kernel_mask = torch::empty({0}, torch::kBool);
  if (!kernel_lengths.defined()) kernel_lengths = torch::empty({0}, torch::kLong);
  return {kernel_mask, kernel_lengths};
}

}  // namespace qkv::kernels::tiled
