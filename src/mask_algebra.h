// qkv's mask algebra, used by the module and by every backend: restricting a mask to the pairs
// another allows, and turning an AttentionMask into the one mask tensor the attention core takes.
// Private to qkv.
#pragma once

#include <qkv/masks.h>

#include <torch/types.h>

#include <cstdint>

namespace qkv::detail {

/// `mask` restricted to the pairs that `allowed` (bool, true = may attend, broadcastable with
/// `mask`) permits: a logical AND for a bool mask, -inf where not allowed for a floating one (so
/// a learned bias keeps its gradient elsewhere); `allowed` itself when `mask` is undefined.
torch::Tensor restrict_mask(const torch::Tensor& mask, const torch::Tensor& allowed);

/// What a mask is checked against: a batch of `batch` queries (N of them) attending to S keys
/// with H heads. `batched` false means the input had no batch dimension (batch is then 1 and
/// the masks are given without B).
struct MaskTarget {
  bool batched = true;
  int64_t batch = 1, heads = 1, num_queries = 0, num_keys = 0;
  torch::ScalarType dtype = torch::kFloat;  // of the scores: floating masks are converted to it
  torch::Device device = torch::kCPU;
};

/// Checks that integer key lengths lie in [0, S] = [0, num_keys], naming `caller` and the values found.
void check_key_length_values(const torch::Tensor& lengths, int64_t num_keys, const char* caller);

/// Checks `mask.key_lengths` against `target` (shape, integer dtype, device, values in [0, S]) and
/// returns them as int64 (B,).
torch::Tensor checked_key_lengths(const AttentionMask& mask, const MaskTarget& target);

/// The key lengths (B,) of key rows (B or 1, S), CPU, where every row only pads: keeps its first L_b
/// keys and removes the rest. Boolean rows are true then false (key_mask_from_lengths' masks,
/// PyTorch's key_padding_mask inverted); additive rows 0 then -inf or a value so low that its key
/// gets weight 0 exactly (at most -1e30: float32's and bfloat16's lowest, as Hugging Face's masks
/// use), a row of no key -inf throughout (under a finite value the math path weighs every key the
/// same). Undefined where a row is anything else. A row of 1 serves every batch element.
torch::Tensor padding_lengths(const torch::Tensor& keys, int64_t batch);

/// A key_mask (B, S) or (S,) that only pads keys, true for a prefix of each row's keys, as key
/// lengths (B,), which every backend takes; undefined for any other key_mask, and for one off the
/// CPU (reading it there would wait for the device). Checked as merge_attention_mask checks it.
torch::Tensor key_mask_as_lengths(const torch::Tensor& key_mask, const MaskTarget& target);

/// Checks every part of `mask` against `target` and merges them into one tensor broadcastable to
/// (B, H, N, S): bool when every part is bool, else floating in target.dtype (-inf where a bool
/// part forbids). Undefined when the mask is empty.
torch::Tensor merge_attention_mask(const AttentionMask& mask, const MaskTarget& target);

}  // namespace qkv::detail
