// The one table of qkv-train's tasks: name, description, defaults, the options each reads, their
// checks, and how it runs. The command line, its help text and main() read it; adding a task
// means adding a row here and its source file under tasks/.
#pragma once

#include "run_config.h"
#include "trainable_task.h"

#include <torch/types.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace qkv_train {

/// Defaults of the options a task leaves to itself (0 in RunConfig).
struct TaskDefaults {
  int64_t d_model = 0, heads = 1, seq_len = 0, batch = 0, steps = 0;
  double lr = 0.0;
  int64_t log_every = 0, eval_every = 0;
  // The language model's.
  int64_t layers = 0, warmup_steps = 0;
  double dropout = 0.0;
  /// Use every core unless --threads says otherwise (LibTorch's own default here is one thread
  /// per physical core as it counts them, which on the development machine was 1 of 2).
  bool all_cores = false;
  /// What a task that does not read --causal / --optimizer always uses, so that summary.json and
  /// checkpoints record what ran (the language model: causal, AdamW). Unset: the option's value.
  std::optional<bool> causal = std::nullopt;
  std::string optimizer = "";
};

struct TaskSpec {
  std::string name;
  std::string description;  // one line, for --help
  TaskDefaults defaults;
  /// Options (flags) the task reads beyond the ones every task reads (see common_flags()); any
  /// other option given on the command line is refused, naming it and the task.
  std::vector<std::string> flags;
  /// Why `config` (defaults applied) cannot run, or "".
  std::function<std::string(const RunConfig&)> check;
  /// Trained tasks: the task, built for `config` on `device` (checkpoints, resume, --nproc).
  std::function<std::unique_ptr<TrainableTask>(const RunConfig&, const torch::Device&)> make;
  /// Single-process experiments (seed, scaling): run it and return the summary.
  std::function<nlohmann::json(const RunConfig&, const torch::Device&)> run;

  bool trained() const { return static_cast<bool>(make); }
  bool reads(const std::string& flag) const;
};

/// Every task, in the order --help lists them.
const std::vector<TaskSpec>& task_registry();
/// The task called `name`; throws std::invalid_argument naming the known ones.
const TaskSpec& find_task(const std::string& name);
/// The options every task reads (device, seed, threads, output, logging...).
const std::vector<std::string>& common_flags();

/// Fills the options left unset (0 or negative) with the task's defaults.
void apply_task_defaults(RunConfig& config);

}  // namespace qkv_train
