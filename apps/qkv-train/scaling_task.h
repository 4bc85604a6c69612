// --task scaling: the documents' argument for dividing by sqrt(d_k), measured.
//   1. Var(q·k) = d_k for q, k of independent unit-variance components;
//   2. without the 1/sqrt(d_k) factor softmax saturates as d_k grows (one weight near 1);
//   3. saturated softmax passes almost no gradient back to Q and K, so training stalls.
// Writes scaling.csv, scaling_training.csv and scaling.png into --out.
#pragma once

#include "run_config.h"

#include <nlohmann/json.hpp>

namespace qkv_train {

nlohmann::json run_scaling_task(const RunConfig& config, const torch::Device& device);

}  // namespace qkv_train
