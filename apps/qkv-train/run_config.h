// What one qkv-train run is asked to do: the command line's options, resolved per task, and
// their JSON form (stored in summaries and checkpoints).
#pragma once

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace qkv_train {

struct RunConfig {
  std::string task = "seed";        // seed | reverse | lookup
  std::string device_name = "auto";  // auto | cpu | cuda
  std::string dtype_name = "float32";
  int64_t d_model = 0;  // 0 = the task's default (see task_defaults)
  int64_t heads = 1;
  int64_t seq_len = 0;
  int64_t batch = 0;
  int64_t steps = 0;
  double lr = 0.0;
  std::string optimizer = "adam";  // adam | sgd
  uint64_t seed = 42;
  int threads = 0;  // 0: LibTorch's default
  bool causal = false;
  std::optional<double> scale;  // unset: 1/sqrt(d_head)
  int64_t log_every = 0;
  int64_t eval_every = 0;
  std::string out_dir;
  int64_t checkpoint_every = 0;
  std::string resume_dir;
  std::string init_weights;  // a torch.save'd dict (documents' or nn.MultiheadAttention layout)
  bool json = false;
  bool quiet = false;
  // Data parallelism (see distributed.h): ranks come from torchrun's environment or --nproc.
  int nproc = 1;                   // > 1: start this many ranks on this machine
  std::string dist_backend = "auto";  // auto | gloo | nccl
  double dist_timeout_s = 300.0;   // how long a rank waits for the others before giving up
  bool save_replicas = false;      // every rank writes OUT/replica-RANK.pt

  std::chrono::milliseconds dist_timeout() const {
    return std::chrono::milliseconds(static_cast<int64_t>(dist_timeout_s * 1000));
  }
};

/// Fills the options left at 0 with the task's defaults.
void apply_task_defaults(RunConfig& config);

/// The options that define the model and its training: a checkpoint can only be resumed with
/// the same values.
nlohmann::json model_options(const RunConfig& config);
nlohmann::json to_json(const RunConfig& config);

torch::ScalarType dtype_from_name(const std::string& name);

/// The device `name` asks for; throws std::runtime_error when CUDA is asked for but absent.
torch::Device resolve_device(const std::string& name);

}  // namespace qkv_train
