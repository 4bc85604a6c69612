// --task seed: the documents' complete example (../shared/seeds/002_*.txt, "完整代码").
#pragma once

#include "run_config.h"

#include <nlohmann/json.hpp>

namespace qkv_train {

/// Runs the documents' example: seed, x = randn(seq_len, d_model), SelfAttention(d_model), MSE
/// to randn_like(output), backward; then steps - 1 Adam steps on the same batch. Prints the
/// shapes and loss as the Python example does (unless config.json) and returns the summary.
nlohmann::json run_seed_task(const RunConfig& config, const torch::Device& device);

}  // namespace qkv_train
