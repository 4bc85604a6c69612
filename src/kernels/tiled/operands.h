// The tiled kernel's one entry: its input contract, checked and met in one place. Whatever the
// kernel reads has been normalised here: 4-D, unit stride along each row, rows that do not
// overlap, the mask as a broadcast view in the accumulation type. The autograd function
// (autograd.cpp) brings q, k and v to that form inside its forward, so that reshaping them adds no
// autograd node (at the documents' sizes each such node cost more than the kernel); the mask, whose
// gradient must be summed back over its broadcast, before it. Private to qkv.
//
// B = batch, H = query heads, Hkv = key/value heads, N = queries, S = keys, D = head width, Dv = value width.
#pragma once

#include <qkv/options.h>

#include <torch/types.h>

#include <utility>

namespace qkv::kernels::tiled {

/// Whether the kernel can read `t` (B, H, rows, width) in place: unit stride along the width and
/// rows at least a width apart (no overlap; BLAS's leading dimension), dimensions of size 1
/// exempt, and an empty tensor (nothing is read). Views such as transpose(1, 2) (the module's head
/// split) and slices of rows qualify; unfold (overlapping rows), expand along positions (stride 0)
/// and transposes of the last two dimensions do not, and are copied once by kernel_operand.
bool kernel_readable(const torch::Tensor& t);

/// An empty (B, H, rows, width) result in the layout of `like` (B, H, rows, ·), the operand it
/// belongs to: where like's heads sit side by side within each position (a (B, N, H, D) tensor
/// seen through transpose(1, 2), as the module's head split makes them), the same (B, rows, H,
/// width) storage seen the same way, so that joining the heads (or a gradient's way back through
/// the split) needs no copy; else contiguous. The kernel's output and gradients and RoPE's
/// rotation use it.
torch::Tensor empty_in_layout_of(const torch::Tensor& like, int64_t width, const torch::TensorOptions& options);

/// The kernel's operands: q (B, H, N, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), each kernel_readable;
/// mask a (B or 1, H or 1, N, S) broadcast view (size 1 where the caller's mask broadcasts over
/// the batch or the heads, stride 0 where it does over rows or keys), bool or floating in the
/// accumulation type (float32 for bfloat16), or an empty tensor; key_lengths int64 (B,) contiguous or empty. Empty, not
/// undefined: autograd::Function takes no undefined tensor arguments.
struct Operands {
  torch::Tensor q, k, v, mask, key_lengths;
};

/// q, k, v or a result of their rank (..., rows, width) as the kernel reads it: (B, H, rows, width),
/// with grouped heads (enable_gqa) a rank-3 tensor's first dimension holding the heads; a view,
/// or a copy where the tensor is not kernel_readable. Differentiable when grad mode is on.
torch::Tensor kernel_operand(const torch::Tensor& t, bool grouped);

/// Whether q, k (..., H or Hkv, rows, width) are grouped heads: enable_gqa with more query heads
/// than key/value heads.
bool grouped_heads(const torch::Tensor& q, const torch::Tensor& k, const ScaledDotProductAttentionOptions& options);

/// The mask and key lengths of `options` in the kernel's form (Operands::mask, Operands::key_lengths),
/// for q (..., N, D) and k (..., S, D), `grouped` as grouped_heads says. A mask that only pads keys
/// (boolean, or additive with -inf and no gradient; operands.cpp says which) becomes key lengths,
/// which the kernel skips past. The mask's steps are differentiable: its gradient reaches the
/// caller's tensor.
std::pair<torch::Tensor, torch::Tensor> kernel_conditions(const torch::Tensor& q, const torch::Tensor& k,
                                                          const ScaledDotProductAttentionOptions& options,
                                                          bool grouped);

}  // namespace qkv::kernels::tiled
