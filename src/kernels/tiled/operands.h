// The tiled kernel's one entry: its input contract, checked and met in one place. Whatever
// operands.cpp hands on (to the autograd function and from there to BLAS) has been normalised:
// 4-D, unit stride along each row, rows that do not overlap, the mask as a broadcast view in the
// accumulation type. Private to qkv.
//
// B = batch, H = query heads, Hkv = key/value heads, N = queries, S = keys, D = head width, Dv = value width.
#pragma once

#include <qkv/options.h>

#include <torch/types.h>

#include <vector>

namespace qkv::kernels::tiled {

/// Whether the kernel can read `t` (B, H, rows, width) in place: unit stride along the width and
/// rows at least a width apart (no overlap; BLAS's leading dimension), dimensions of size 1
/// exempt. Views such as transpose(1, 2) (the module's head split) and slices of rows qualify;
/// unfold (overlapping rows), expand along positions (stride 0) and transposes of the last two
/// dimensions do not, and are copied once by normalise_operands.
bool kernel_readable(const torch::Tensor& t);

/// An empty (B, H, rows, width) result in the layout of `like` (B, H, rows, ·), the operand it
/// belongs to: where like's heads sit side by side within each position (a (B, N, H, D) tensor
/// seen through transpose(1, 2), as the module's head split makes them), the same (B, rows, H,
/// width) storage seen the same way, so that joining the heads (or a gradient's way back through
/// the split) needs no copy; else contiguous. The kernel's output and gradients and RoPE's
/// rotation use it.
torch::Tensor empty_in_layout_of(const torch::Tensor& like, int64_t width, const torch::TensorOptions& options);

/// The kernel's operands: q (B, H, N, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), each kernel_readable;
/// mask a (B, H, N, S) broadcast view, bool or floating in the accumulation type (float32 for
/// bfloat16), or an empty tensor; key_lengths int64 (B,) contiguous or empty. Empty, not
/// undefined: autograd::Function takes no undefined tensor arguments.
struct Operands {
  torch::Tensor q, k, v, mask, key_lengths;
  std::vector<int64_t> output_shape;  // q's shape with Dv last: the caller's view of the (B, H, N, Dv) result
};

/// Reshapes q, k, v of any rank (..., N, D) to 4-D (with enable_gqa, dimension -3 holds the heads),
/// copies what is not kernel_readable, and brings the mask and key lengths to the kernel's form.
/// Every step is differentiable: gradients reach the caller's tensors, the mask's included.
Operands normalise_operands(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const ScaledDotProductAttentionOptions& options);

}  // namespace qkv::kernels::tiled
