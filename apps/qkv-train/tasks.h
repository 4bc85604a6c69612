// The learnable toy tasks of qkv-train. Each makes its batches from (seed, step) alone, so a run
// is reproducible and a resumed run sees the same data as one that never stopped.
#pragma once

#include "run_config.h"

#include <torch/torch.h>

#include <memory>
#include <string>

namespace qkv_train {

struct Batch {
  torch::Tensor input;   // (B, N, E)
  torch::Tensor target;  // the task's target; see each task
  torch::Tensor answer;  // int64: for each query row, the key position attention should pick
};

class Task {
 public:
  virtual ~Task() = default;
  /// The batch for `step` (step < 0: evaluation batches) of `size` examples.
  virtual Batch sample(int64_t size, int64_t step) const = 0;
  /// The training loss (MSE) of `output` (B, N, E) for `batch`, in float32.
  virtual torch::Tensor loss(const torch::Tensor& output, const Batch& batch) const = 0;
  /// The mean attention weight (over heads and examples) on the key each query should pick.
  virtual torch::Tensor answer_weight(const torch::Tensor& weights, const Batch& batch) const = 0;
  /// Name of answer_weight in metrics and summaries.
  virtual std::string metric_name() const = 0;
};

/// reverse: the target at position i is the content at position N-1-i. Each token carries
/// its content and, beside it, its position as a one-hot code: attention by itself does not
/// know order, and the position code is what lets it learn to look at the mirrored position.
/// Needs d_model > seq_len.
/// lookup: N-1 (key, value) items and a query token carrying one of the keys; the target is
/// that key's value, read out at the query position, so the query must attend by content.
std::unique_ptr<Task> make_task(const RunConfig& config, const torch::Device& device);

/// Why the task cannot run with these options ("" when it can).
std::string task_option_problem(const RunConfig& config);

}  // namespace qkv_train
