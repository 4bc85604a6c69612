// Entry points of qkv-train's tasks, for the table in task_registry.cpp.
#pragma once

#include "checkpoint.h"
#include "run_config.h"
#include "trainable_task.h"

#include <torch/types.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <optional>

namespace qkv_train {

/// seed: the documents' complete example (forward, MSE loss, backward; more steps with Adam).
nlohmann::json run_seed_task(const RunConfig& config, const torch::Device& device);

/// scaling: the documents' argument for 1/sqrt(d_k), measured (scaling.csv, scaling.png).
nlohmann::json run_scaling_task(const RunConfig& config, const torch::Device& device);

/// reverse and lookup: qkv::SelfAttention trained on batches whose answer is an attention pattern.
std::unique_ptr<TrainableTask> make_toy_task(const RunConfig& config, const torch::Device& device);

/// lm: a character-level GPT of qkv::TransformerBlocks on a text.
std::unique_ptr<TrainableTask> make_lm_task(const RunConfig& config, const torch::Device& device);
/// lm --generate: text from a trained model (--resume DIR, `resume` when parse_command_line read
/// it, or --init-weights FILE) on stdout.
nlohmann::json run_lm_generation(const RunConfig& config, const torch::Device& device,
                                 std::optional<CheckpointFile> resume = std::nullopt);

}  // namespace qkv_train
