// Training checkpoints: model, optimizer state, step, options and RNG state in one LibTorch
// archive, written to a temporary name and renamed so that a crash mid-write never leaves a
// broken latest checkpoint.
#pragma once

#include <qkv/qkv.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <string>

namespace qkv_train {

constexpr const char* kCheckpointFile = "checkpoint.pt";

struct CheckpointState {
  int64_t step = 0;
  double initial_loss = 0.0;
  double last_loss = 0.0;  // the loss of `step`, so a finished run resumed reports it
  nlohmann::json options;  // to_json() of the run's options
};

/// Writes DIR/checkpoint.pt atomically. Throws std::runtime_error naming the path on failure.
void save_checkpoint(const std::string& dir, qkv::SelfAttention& model, torch::optim::Optimizer& optimizer,
                     const CheckpointState& state);

/// Reads only the options and step of DIR/checkpoint.pt (to check a resume before building the model).
CheckpointState read_checkpoint_state(const std::string& dir);

/// Loads DIR/checkpoint.pt into `model` and `optimizer` and restores the CPU RNG state.
CheckpointState load_checkpoint(const std::string& dir, qkv::SelfAttention& model, torch::optim::Optimizer& optimizer);

}  // namespace qkv_train
