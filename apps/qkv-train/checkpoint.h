// Training checkpoints: model, optimizer state, step, options and RNG state in one LibTorch
// archive, replaced durably (write, fsync, rename, fsync the folder) so that a crash or power
// loss never leaves a broken latest checkpoint. Read back by qkv's own reader of the archive
// (src/torch_file.h: its TorchScript code is never compiled), whichever LibTorch wrote it.
#pragma once

#include "run_config.h"

#include <qkv/precision.h>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

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

/// DIR/checkpoint.pt, read from disk once. --resume checks the command line against these bytes'
/// options and loads the model from the same bytes, so that a checkpoint replaced in between (by a
/// run still writing to DIR) cannot give the model one file's weights and the other's options. The
/// archive opened to read the state is the one a model on the CPU loads from; a model on another
/// device takes one opened again from the bytes, its tensors there. A load consumes the file.
class CheckpointFile {
 public:
  /// Reads DIR/checkpoint.pt and its state. Throws UsageError when DIR has no checkpoint.pt, and
  /// std::runtime_error naming the file when it is not a readable qkv-train checkpoint.
  explicit CheckpointFile(const std::string& dir);

  const std::string& path() const { return path_; }
  /// Its step, losses, options and task state.
  const CheckpointState& state() const { return state_; }
  /// The archive, its tensors on `device`; once.
  torch::serialize::InputArchive take_archive(const torch::Device& device);

 private:
  std::string path_;
  std::vector<char> bytes_;
  // Until taken. Not a std::optional: InputArchive's deleted copy from a non-const reference makes
  // clang refuse std::optional's defaulted copy.
  std::unique_ptr<torch::serialize::InputArchive> cpu_archive_;
  CheckpointState state_;
};

/// Loads only the model's weights of `checkpoint` into `model` (generation from a checkpoint).
void load_checkpoint_model(CheckpointFile checkpoint, torch::nn::Module& model);

/// Loads `checkpoint` into `model`, `optimizer` and `scaler` (when the checkpoint has a
/// scaler's state and `scaler` is enabled) and `masters` (when active: from the checkpoint, or for
/// one written before master weights, from its model, the optimizer state widened), and restores
/// the CPU RNG state. A checkpoint that is damaged, or whose tensors do not fit the model's
/// parameters or the optimizer's state (shape, dtype, device), is refused with a std::runtime_error
/// naming the file.
CheckpointState load_checkpoint(CheckpointFile checkpoint, torch::nn::Module& model,
                                torch::optim::Optimizer& optimizer, qkv::GradScaler& scaler,
                                qkv::MasterWeights* masters = nullptr);

}  // namespace qkv_train
