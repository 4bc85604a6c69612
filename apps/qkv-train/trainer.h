// The training loop every trained task of qkv-train shares (reverse, lookup, lm): optimizer steps
// with the task's learning-rate schedule and gradient clipping, data parallelism, progress,
// evaluation, metrics.csv, summary.json, pictures, checkpoints and resume, NaN stop, signals.
#pragma once

#include "checkpoint.h"
#include "distributed.h"
#include "run_config.h"

#include <nlohmann/json.hpp>

#include <optional>
#include <stdexcept>

namespace qkv_train {

/// A loss that became NaN or infinite; the message names the step and what to try.
class TrainingDiverged : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct TrainingResult {
  nlohmann::json summary;  // empty on data-parallel ranks other than 0, which report nothing
  int exit_code = 0;       // 0, or 128 + signal when SIGINT / SIGTERM stopped the run
};

/// Trains `config`'s task on `device`. With `parallel`, this process is one data-parallel replica:
/// it trains on its share of each batch, gradients are averaged over the replicas, and only
/// rank 0 logs progress and writes into --out. With --resume, training goes on from `resume`, the
/// checkpoint parse_command_line read (read here when not given); it is released once loaded.
TrainingResult train(const RunConfig& config, const torch::Device& device, DataParallel* parallel = nullptr,
                     std::optional<CheckpointFile> resume = std::nullopt);

}  // namespace qkv_train
