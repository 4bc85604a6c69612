// What every attention backend shares: the scale, query grouping and mask preparation.
#include "kernels/kernels.h"

#include <qkv/masks.h>

#include "mask_algebra.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>

namespace qkv::kernels {

double resolved_scale(const ScaledDotProductAttentionOptions& options, int64_t head_width) {
  if (options.scale()) return *options.scale();
  return head_width > 0 ? 1.0 / std::sqrt(static_cast<double>(head_width)) : 1.0;
}

int64_t query_groups(const torch::Tensor& q, const torch::Tensor& k) {
  return q.dim() >= 3 && k.size(-3) > 0 ? q.size(-3) / k.size(-3) : 1;
}

torch::Tensor stack_groups(const torch::Tensor& t, int64_t groups) {
  auto sizes = t.sizes().vec();
  sizes[sizes.size() - 3] /= groups;
  sizes[sizes.size() - 2] *= groups;
  return t.reshape(sizes);
}

torch::Tensor unstack_groups(const torch::Tensor& t, int64_t groups) {
  auto sizes = t.sizes().vec();
  sizes[sizes.size() - 3] *= groups;
  sizes[sizes.size() - 2] /= groups;
  return t.reshape(sizes);
}

PreparedMask prepare_mask(const ScaledDotProductAttentionOptions& options, const torch::Tensor& q, int64_t num_keys) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  PreparedMask prepared;
  const int64_t num_queries = q.size(-2);
  const bool causal = options.causal();
  torch::Tensor user_mask = options.mask();
  if (user_mask.defined() && user_mask.is_floating_point()) user_mask = user_mask.to(q.scalar_type());
  if (options.key_lengths().defined()) {
    // Key lengths as a mask: (B, 1, 1, S), true for the first key_lengths[b] keys.
    const auto keys =
        key_mask_from_lengths(options.key_lengths(), num_keys).view({options.key_lengths().size(0), 1, 1, num_keys});
    user_mask = detail::restrict_mask(user_mask, keys);
  }
  torch::Tensor mask = user_mask;
  if (options.window()) {
    mask = detail::restrict_mask(mask, sliding_window_mask(num_queries, num_keys, *options.window(), q.device()));
  } else if (causal) {
    mask = detail::restrict_mask(mask, causal_mask(num_queries, num_keys, q.device()));  // (N, S)
  }
  prepared.mask = mask;
  // Causal masks alone never empty a row (query i always sees key 0); other masks can, and so can
  // a window when N > S (query i >= S - 1 + W sees no key). With S = 0 every row is empty, but then
  // the products are empty sums and already give zero.
  if ((user_mask.defined() || options.window()) && num_keys > 0) {
    prepared.dead_rows = mask.scalar_type() == torch::kBool ? mask.logical_not().all(/*dim=*/-1, /*keepdim=*/true)
                                                            : (mask == kNegInf).all(/*dim=*/-1, /*keepdim=*/true);
  }
  return prepared;
}

namespace {
thread_local int recomputations_pending = 0;
}  // namespace

RecomputedLater::RecomputedLater() { ++recomputations_pending; }
RecomputedLater::~RecomputedLater() { --recomputations_pending; }
bool recomputed_later() { return recomputations_pending > 0; }

}  // namespace qkv::kernels
