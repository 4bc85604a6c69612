// What every attention backend shares: the scale, query grouping and mask preparation.
#include "kernels/kernels.h"

#include <qkv/masks.h>

#include <torch/torch.h>

#include <cmath>
#include <limits>

namespace qkv::kernels {

double resolved_scale(const ScaledDotProductAttentionOptions& options, int64_t head_width) {
  return options.scale() ? *options.scale() : 1.0 / std::sqrt(static_cast<double>(head_width));
}

int64_t query_groups(const torch::Tensor& q, const torch::Tensor& k) {
  return q.dim() >= 3 && k.size(-3) > 0 ? q.size(-3) / k.size(-3) : 1;
}

PreparedMask prepare_mask(const torch::Tensor& user_mask, bool causal, const torch::Tensor& q, int64_t num_keys) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  PreparedMask prepared;
  const int64_t num_queries = q.size(-2);
  torch::Tensor mask = user_mask;
  if (mask.defined() && mask.is_floating_point()) mask = mask.to(q.scalar_type());
  if (causal) {
    auto allowed = causal_mask(num_queries, num_keys, q.device());  // (N, S)
    if (!mask.defined()) {
      mask = allowed;
    } else if (mask.scalar_type() == torch::kBool) {
      mask = mask.logical_and(allowed);
    } else {
      mask = mask.masked_fill(allowed.logical_not(), kNegInf);
    }
  }
  prepared.mask = mask;
  // Causal masks alone never empty a row (query i always sees key 0); other masks can. With S = 0
  // every row is empty, but then the products are empty sums and already give zero.
  if (user_mask.defined() && num_keys > 0) {
    prepared.dead_rows = mask.scalar_type() == torch::kBool ? mask.logical_not().all(/*dim=*/-1, /*keepdim=*/true)
                                                           : (mask == kNegInf).all(/*dim=*/-1, /*keepdim=*/true);
  }
  return prepared;
}

}  // namespace qkv::kernels
