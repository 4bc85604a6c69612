// Building and checking SelfAttention's masks (polarity: true = may attend; see masks.h).
#include <qkv/masks.h>

#include "mask_algebra.h"

#include <ATen/Dispatch.h>
#include <torch/torch.h>

#include <limits>

namespace qkv {

torch::Tensor key_mask_from_lengths(const torch::Tensor& lengths, int64_t max_len) {
  TORCH_CHECK(
      lengths.defined() && lengths.dim() == 1 && !lengths.is_floating_point() && lengths.scalar_type() != torch::kBool,
      "key_mask_from_lengths: expected integer lengths of shape (B,), got ",
      lengths.defined() ? c10::toString(lengths.scalar_type()) : "undefined", " ",
      lengths.defined() ? lengths.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(max_len >= 0, "key_mask_from_lengths: expected max_len >= 0, got ", max_len);
  auto positions = torch::arange(max_len, lengths.options().dtype(torch::kLong));  // (S,)
  return positions.unsqueeze(0) < lengths.to(torch::kLong).unsqueeze(1);           // (B, S)
}

torch::Tensor causal_mask(int64_t num_queries, int64_t num_keys, const torch::Device& device) {
  auto options = torch::TensorOptions().dtype(torch::kLong).device(device);
  auto query_positions = torch::arange(num_queries, options).unsqueeze(1);  // (N, 1)
  auto key_positions = torch::arange(num_keys, options).unsqueeze(0);       // (1, S)
  return key_positions <= query_positions;                                  // (N, S)
}

torch::Tensor sliding_window_mask(int64_t num_queries, int64_t num_keys, int64_t window, const torch::Device& device) {
  TORCH_CHECK(window >= 1, "sliding_window_mask: expected window >= 1, got ", window);
  auto options = torch::TensorOptions().dtype(torch::kLong).device(device);
  auto query_positions = torch::arange(num_queries, options).unsqueeze(1);  // (N, 1)
  auto key_positions = torch::arange(num_keys, options).unsqueeze(0);       // (1, S)
  return (key_positions <= query_positions).logical_and(key_positions > query_positions - window);  // (N, S)
}

namespace detail {

torch::Tensor restrict_mask(const torch::Tensor& mask, const torch::Tensor& allowed) {
  if (!mask.defined()) return allowed;
  if (mask.scalar_type() == torch::kBool) return mask.logical_and(allowed);
  return mask.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
}

void check_key_length_values(const torch::Tensor& lengths, int64_t num_keys, const char* caller) {
  if (lengths.numel() == 0) return;
  const auto [low, high] = torch::aminmax(lengths);  // one pass (and one wait, off the CPU) for both
  const auto shortest = low.item<int64_t>(), longest = high.item<int64_t>();
  TORCH_CHECK(shortest >= 0 && longest <= num_keys, caller, ": expected key_lengths in [0, S] = [0, ", num_keys,
              "], got values from ", shortest, " to ", longest);
}

torch::Tensor checked_key_lengths(const AttentionMask& mask, const MaskTarget& target) {
  const bool batched = target.batched;
  const int64_t batch = target.batch, num_keys = target.num_keys;
  const auto& device = target.device;
  const auto& lengths = mask.key_lengths;
  const bool shape_ok = batched ? (lengths.dim() == 1 && lengths.size(0) == batch) : lengths.numel() == 1;
  TORCH_CHECK(shape_ok, "SelfAttention: expected key_lengths of shape ", batched ? "(B,) = (" : "() = (",
              batched ? std::to_string(batch) : std::string(), batched ? ",)" : ")", ", got ", lengths.sizes());
  TORCH_CHECK(!lengths.is_floating_point() && lengths.scalar_type() != torch::kBool,
              "SelfAttention: expected integer key_lengths, got ", lengths.scalar_type());
  TORCH_CHECK(lengths.device() == device, "SelfAttention: expected key_lengths on ", device, ", got ",
              lengths.device());
  check_key_length_values(lengths, num_keys, "SelfAttention");
  return lengths.reshape({batch}).to(torch::kLong);
}

namespace {

void check_key_mask(const torch::Tensor& key_mask, const MaskTarget& target) {
  const bool batched = target.batched;
  const int64_t batch = target.batch, num_keys = target.num_keys;
  const bool shape_ok = batched ? (key_mask.dim() == 2 && key_mask.size(0) == batch && key_mask.size(1) == num_keys)
                                : (key_mask.dim() == 1 && key_mask.size(0) == num_keys);
  TORCH_CHECK(shape_ok, "SelfAttention: expected key_mask of shape (", batched ? "B, " : "", "S) with ",
              batched ? "B = " + std::to_string(batch) + ", " : std::string(), "S = ", num_keys, ", got ",
              key_mask.sizes());
  TORCH_CHECK(key_mask.scalar_type() == torch::kBool,
              "SelfAttention: expected a bool key_mask (true = real key, false = padding), got ",
              key_mask.scalar_type());
  TORCH_CHECK(key_mask.device() == target.device, "SelfAttention: expected key_mask on ", target.device, ", got ",
              key_mask.device());
}

// How far below every score an additive mask's value must lie to remove its key exactly, as -inf
// does: the lowest values of float32 and bfloat16 (Hugging Face's padding masks) are; exp(score +
// value - row maximum) is then 0 in float32 and float64 for any score of magnitude below 1e29.
constexpr double kRemovesKey = -1e30;

// The number of keys a padding row keeps: `keeps` its first keys and `removes` every one after
// them; -1 where the row is not such a row.
template <typename T, typename Keeps, typename Removes>
int64_t kept_prefix(const T* row, int64_t S, int64_t stride, Keeps keeps, Removes removes) {
  int64_t j = 0;
  while (j < S && keeps(row[j * stride])) ++j;
  const int64_t length = j;
  for (; j < S; ++j) {
    if (!removes(row[j * stride])) return -1;  // a key kept after a removed one: not padding
  }
  return length;
}

}  // namespace

torch::Tensor padding_lengths(const torch::Tensor& keys, int64_t B) {
  const int64_t S = keys.size(1), stride_b = keys.size(0) == 1 ? 0 : keys.stride(0), stride_key = keys.stride(1);
  auto lengths = torch::empty({B}, torch::kLong);
  int64_t* length = lengths.data_ptr<int64_t>();
  const auto rows = [&](const auto* values, auto keeps, auto removes, auto removes_all) {
    for (int64_t b = 0; b < B; ++b) {
      const auto* row = values + b * stride_b;
      length[b] = kept_prefix(row, S, stride_key, keeps, removes);
      if (length[b] < 0 || (length[b] == 0 && S > 0 && kept_prefix(row, S, stride_key, keeps, removes_all) != 0)) {
        return false;
      }
    }
    return true;
  };
  bool padding = false;
  if (keys.scalar_type() == torch::kBool) {
    const auto keeps = [](bool allowed) { return allowed; };
    const auto removes = [](bool allowed) { return !allowed; };
    padding = rows(keys.data_ptr<bool>(), keeps, removes, removes);
  } else {
    AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "qkv_padding_lengths", [&] {
      const auto keeps = [](scalar_t value) { return value == scalar_t(0); };
      const auto removes = [](scalar_t value) { return static_cast<double>(value) <= kRemovesKey; };
      const auto removes_all = [](scalar_t value) { return value == -std::numeric_limits<scalar_t>::infinity(); };
      padding = rows(keys.data_ptr<scalar_t>(), keeps, removes, removes_all);
    });
  }
  return padding ? lengths : torch::Tensor();
}

torch::Tensor key_mask_as_lengths(const torch::Tensor& key_mask, const MaskTarget& target) {
  check_key_mask(key_mask, target);
  if (!key_mask.device().is_cpu()) return {};
  return padding_lengths(key_mask.reshape({target.batch, target.num_keys}), target.batch);
}

torch::Tensor merge_attention_mask(const AttentionMask& mask, const MaskTarget& target) {
  const bool batched = target.batched;
  const int64_t batch = target.batch, heads = target.heads;
  const int64_t num_queries = target.num_queries, num_keys = target.num_keys;
  const auto& device = target.device;
  torch::Tensor keys;  // bool (B, 1, 1, S): false for padding keys

  if (mask.key_lengths.defined()) {
    keys = key_mask_from_lengths(checked_key_lengths(mask, target), num_keys);  // (B, S)
  }
  if (mask.key_mask.defined()) {
    const auto& key_mask = mask.key_mask;
    check_key_mask(key_mask, target);
    // Explicit sizes: with S = 0 (an empty context) a -1 would be ambiguous.
    auto as_batch = key_mask.reshape({batch, num_keys});  // (B, S)
    keys = keys.defined() ? keys.logical_and(as_batch) : as_batch;
  }
  if (keys.defined()) keys = keys.view({batch, 1, 1, num_keys});  // (B, 1, 1, S)

  torch::Tensor pairs;  // (B|1, H|1, N, S)
  if (mask.attn_mask.defined()) {
    const auto& attn_mask = mask.attn_mask;
    const auto sizes = attn_mask.sizes();
    const auto dims = attn_mask.dim();
    const bool pair_dims_ok = dims >= 2 && sizes[dims - 2] == num_queries && sizes[dims - 1] == num_keys;
    bool shape_ok = pair_dims_ok && dims <= 4;
    if (shape_ok && batched && dims == 3) shape_ok = sizes[0] == batch;
    if (shape_ok && !batched && dims == 3) shape_ok = sizes[0] == heads;
    // (1, H, N, S): one bias per head for the whole batch (T5's, Swin's); (B, 1, N, S) as (B, N, S).
    if (shape_ok && dims == 4) {
      shape_ok = batched && (sizes[0] == batch || sizes[0] == 1) && (sizes[1] == heads || sizes[1] == 1);
    }
    TORCH_CHECK(shape_ok, "SelfAttention: expected attn_mask of shape (N, S), ",
                batched ? "(B, N, S) or (B or 1, H or 1, N, S)" : "or (H, N, S)", " with ",
                batched ? "B = " + std::to_string(batch) + ", " : std::string(), "H = ", heads, ", N = ", num_queries,
                ", S = ", num_keys, ", got ", sizes);
    TORCH_CHECK(attn_mask.scalar_type() == torch::kBool || attn_mask.is_floating_point(),
                "SelfAttention: expected a bool attn_mask (true = attend) or a floating one (added to the scores), "
                "got ",
                attn_mask.scalar_type());
    TORCH_CHECK(attn_mask.device() == device, "SelfAttention: expected attn_mask on ", device, ", got ",
                attn_mask.device());
    if (dims == 2) {
      pairs = attn_mask.view({1, 1, num_queries, num_keys});
    } else if (dims == 3) {
      pairs = batched ? attn_mask.unsqueeze(1) : attn_mask.unsqueeze(0);
    } else {
      pairs = attn_mask;
    }
    if (pairs.is_floating_point()) pairs = pairs.to(target.dtype);
  }

  if (!keys.defined()) return pairs;
  return restrict_mask(pairs, keys);
}

}  // namespace detail
}  // namespace qkv
