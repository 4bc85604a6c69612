// What the trainer needs from a task it trains (reverse, lookup, lm): the model, a loss for each
// step's batch, evaluation figures and pictures. The trainer supplies everything else once for
// every task: the loop, optimizer steps, data parallelism, progress, metrics.csv, summary.json,
// checkpoints, resume and signals.
#pragma once

#include "distributed.h"
#include "run_config.h"

#include <qkv/functional.h>
#include <qkv/precision.h>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace qkv_train {

/// metrics.csv, as the trainer has written it so far: the header's columns and the rows' cells.
struct MetricsHistory {
  std::vector<std::string> columns;
  std::vector<std::vector<std::string>> rows;

  /// The (step, value) pairs of the rows where `column` is set.
  std::vector<std::pair<double, double>> series(const std::string& column) const;
};

class TrainableTask {
 public:
  virtual ~TrainableTask() = default;

  /// The module trained: its parameters are optimized, all-reduced and checkpointed.
  virtual torch::nn::Module& model() = 0;
  /// --init-weights: a torch.save'd dict in the layout the task's Python counterpart writes.
  virtual void load_weights(const std::string& path) = 0;
  /// model.pt: the trained weights for Python (torch.load reads them).
  virtual void save_weights(const std::string& path) = 0;

  /// The optimizer, over model()'s parameters, with `lr` as its initial learning rate.
  virtual std::unique_ptr<torch::optim::Optimizer> make_optimizer(double lr) = 0;
  /// The learning rate of `step` (1-based), given the configured peak `lr`: constant unless the
  /// task schedules it.
  virtual double learning_rate(int64_t step, double lr) const { return lr; }

  /// The largest global gradient norm a step may apply (larger gradients are scaled down); 0: no clipping.
  virtual double max_grad_norm() const { return 0.0; }
  /// What to try when the loss becomes NaN or infinite.
  virtual std::string divergence_hint() const { return "lower --lr"; }

  /// Forward pass of the batch of `step` (1-based; a batch depends on the seed and the step only),
  /// restricted to its rows [shard.begin, shard.begin + shard.size): the loss to backpropagate,
  /// a scalar averaged over the shard.
  virtual torch::Tensor training_loss(int64_t step, const Shard& shard) = 0;
  /// Tokens (positions) in one whole batch, for throughput figures.
  virtual int64_t tokens_per_step() const = 0;
  /// The attention backend the training steps run on.
  virtual qkv::AttentionBackend backend() const = 0;

  /// Names of the evaluation figures as metrics.csv columns.
  virtual std::vector<std::string> evaluation_columns() const = 0;
  /// Their names as keys of summary.json's "eval" (the same unless the task says otherwise).
  virtual std::vector<std::string> evaluation_keys() const { return evaluation_columns(); }
  /// The figures, in that order; in eval mode and without gradients.
  virtual std::vector<double> evaluate() = 0;
  /// Names of figures about a step's gradients, beside grad_norm (e.g. grad_norm_qk).
  virtual std::vector<std::string> gradient_columns() const { return {}; }
  /// Those figures, after the backward pass of a step, in that order: of the gradients the optimizer
  /// applies, `masters.stepped(parameters)`'s (with --dtype bfloat16 the model's own are released).
  virtual std::vector<double> gradient_figures(const qkv::MasterWeights& /*masters*/) { return {}; }

  /// Task-specific entries for summary.json (beside the trainer's own).
  virtual nlohmann::json summary_extras() { return nlohmann::json::object(); }
  /// Pictures in `out` from the run's history and the final model (loss.png, attention.png, ...);
  /// returns the files' names.
  virtual std::vector<std::string> write_pictures(const std::filesystem::path& out, const MetricsHistory& history) = 0;
  /// What the checkpoint keeps beside the weights for using the model without the training data
  /// (lm: the vocabulary and the default prompt).
  virtual nlohmann::json checkpoint_state() const { return nlohmann::json::object(); }
  /// Files beside model.pt that a later --generate or Python needs (e.g. the vocabulary); names.
  virtual std::vector<std::string> write_artifacts(const std::filesystem::path& out) { return {}; }
};

}  // namespace qkv_train
