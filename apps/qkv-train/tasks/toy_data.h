// The data of qkv-train's toy tasks (reverse, lookup): batches whose answer is an attention
// pattern. Each batch comes from (seed, step) alone, so a run is reproducible and a resumed run
// sees the same data as one that never stopped.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

namespace qkv_train {

struct ToyBatch {
  torch::Tensor input;   // (B, N, E)
  torch::Tensor target;  // the task's target; see each task
  torch::Tensor answer;  // int64: for each query row, the key position attention should pick
};

class ToyData {
 public:
  virtual ~ToyData() = default;
  /// The batch for `step` (step < 0: evaluation batches) of `size` examples.
  virtual ToyBatch sample(int64_t size, int64_t step) const = 0;
  /// The training loss (MSE) of `output` (B, N, E) for `batch`, in float32.
  virtual torch::Tensor loss(const torch::Tensor& output, const ToyBatch& batch) const = 0;
  /// The mean attention weight (over heads and examples) on the key each query should pick.
  virtual torch::Tensor answer_weight(const torch::Tensor& weights, const ToyBatch& batch) const = 0;
  /// Name of answer_weight in metrics and summaries.
  virtual std::string metric_name() const = 0;
};

/// reverse: the target at position i is the content at position N-1-i. Each token carries its
/// content and, beside it, its position as a one-hot code: attention by itself does not know
/// order, and the position code is what lets it learn to look at the mirrored position. Needs
/// d_model > seq_len.
std::unique_ptr<ToyData> make_reverse_data(uint64_t seed, int64_t seq_len, int64_t d_model, const torch::Device& device,
                                           torch::ScalarType dtype);

/// lookup: N-1 (key, value) items and a query token carrying one of the keys; the target is that
/// key's value, read out at the query position, so the query must attend by content. Needs
/// d_model >= 3 and seq_len >= 2.
std::unique_ptr<ToyData> make_lookup_data(uint64_t seed, int64_t seq_len, int64_t d_model, const torch::Device& device,
                                          torch::ScalarType dtype);

/// The generator of the batch of (seed, step): shared by every task, and by scripts/lm_pytorch.py,
/// which mixes the two numbers the same way.
at::Generator batch_generator(uint64_t seed, int64_t step);

}  // namespace qkv_train
