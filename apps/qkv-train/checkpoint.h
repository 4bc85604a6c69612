// Training checkpoints: model, optimizer state, step, options and RNG state in one LibTorch
// archive, replaced durably (write, fsync, rename, fsync the folder) so that a crash or power
// loss never leaves a broken latest checkpoint. Read back by qkv's own reader of the archive
// (src/torch_file.h: its TorchScript code is never compiled), whichever LibTorch wrote it.
#pragma once

#include <qkv/precision.h>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <string>

namespace qkv_train {

constexpr const char* kCheckpointFile = "checkpoint.pt";

struct CheckpointState {
  int64_t step = 0;
  double initial_loss = 0.0;
  double last_loss = 0.0;  // the loss of `step`, so a finished run resumed reports it
  nlohmann::json options;  // to_json() of the run's options
  /// What the task needs to use the model without its training data (lm: the vocabulary); written
  /// in the same archive as the weights, so the two always belong together. Empty for older checkpoints.
  nlohmann::json task_state = nlohmann::json::object();
};

/// Writes DIR/checkpoint.pt atomically, with the loss scaler's state (mixed precision) and the
/// float32 master weights of a half-precision model (when `masters` is active). Throws
/// std::runtime_error naming the path on failure.
void save_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     const qkv::GradScaler& scaler, const CheckpointState& state,
                     const qkv::MasterWeights* masters = nullptr);

/// Reads only the options and step of DIR/checkpoint.pt (to check a resume before building the model).
CheckpointState read_checkpoint_state(const std::string& dir);

/// Loads only the model's weights of DIR/checkpoint.pt into `model` (generation from a checkpoint).
CheckpointState load_checkpoint_model(const std::string& dir, torch::nn::Module& model);

/// Loads DIR/checkpoint.pt into `model`, `optimizer` and `scaler` (when the checkpoint has a
/// scaler's state and `scaler` is enabled) and `masters` (when active: from the checkpoint, or for
/// one written before master weights, from its model, the optimizer state widened), and restores
/// the CPU RNG state. A checkpoint that is damaged, or whose tensors do not fit the model's
/// parameters or the optimizer's state (shape, dtype, device), is refused with a std::runtime_error
/// naming the file.
CheckpointState load_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                qkv::GradScaler& scaler, qkv::MasterWeights* masters = nullptr);

}  // namespace qkv_train
