// What one qkv-train run is asked to do: the command line's options, resolved per task, and
// their JSON form (stored in summaries and checkpoints). The tasks and their defaults are in
// task_registry.cpp.
#pragma once

#include <torch/types.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace qkv_train {

/// A bad input found after the command line was parsed (a --data file that cannot be trained on,
/// a prompt outside the vocabulary): reported like a bad command line, exit status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct RunConfig {
  std::string task = "seed";         // a name in task_registry()
  std::string device_name = "auto";  // auto | cpu | cuda
  std::string dtype_name = "float32";
  std::string precision = "fp32";    // fp32 | bf16-mixed | fp16-mixed (float32 weights, autocast)
  // Sizes and training; 0 = the task's default (see TaskDefaults).
  int64_t d_model = 0;
  int64_t heads = 0;
  int64_t seq_len = 0;
  int64_t batch = 0;
  int64_t steps = 0;
  double lr = 0.0;
  std::optional<int64_t> kv_heads;  // grouped-query attention; unset = heads
  std::string optimizer = "adam";   // adam | sgd (toy tasks)
  double momentum = 0.0;            // SGD's (--optimizer sgd); 0 = none
  uint64_t seed = 42;
  int threads = 0;  // 0: LibTorch's default
  bool causal = false;
  std::optional<double> scale;  // unset: 1/sqrt(d_head)
  int64_t log_every = 0;
  int64_t eval_every = 0;
  std::string out_dir;
  int64_t checkpoint_every = 0;
  std::string resume_dir;
  std::string init_weights;  // a torch.save'd dict of the task's model
  bool json = false;
  bool quiet = false;
  // The language model (--task lm).
  std::string data_path;      // UTF-8 text; empty = The Devil's Dictionary (Debian's dict-devil)
  int64_t layers = 0;         // TransformerBlocks
  double dropout = -1.0;      // < 0: the task's default
  double weight_decay = 0.1;  // AdamW, on matrices only
  int64_t warmup_steps = -1;  // < 0: the task's default
  double grad_clip = 1.0;     // max global gradient norm; 0 = no clipping
  bool tie_weights = false;   // LM head shares the token embedding
  std::optional<int64_t> window;        // sliding-window attention of this many positions; unset = full
  bool checkpoint_activations = false;  // blocks recompute their forward in the backward (less memory)
  bool generate = false;      // sample text from --resume / --init-weights instead of training
  std::string prompt;
  int64_t max_new_tokens = 200;
  double temperature = 0.8;  // 0 = greedy
  int64_t top_k = 0;         // 0 = unset (all tokens); else only the k most likely
  bool no_kv_cache = false;  // generation recomputes the whole prefix each token (for comparison)
  // Data parallelism (see distributed.h): ranks come from torchrun's environment or --nproc.
  int nproc = 1;                      // > 1: start this many ranks on this machine
  std::string dist_backend = "auto";  // auto | gloo | nccl
  double dist_timeout_s = 300.0;      // how long a rank waits for the others before giving up
  bool save_replicas = false;         // every rank writes OUT/replica-RANK.pt

  std::chrono::milliseconds dist_timeout() const {
    return std::chrono::milliseconds(static_cast<int64_t>(dist_timeout_s * 1000));
  }
  torch::ScalarType dtype() const;
  /// The dtype autocast computes in: bfloat16 or float16 for a mixed precision, else unset.
  std::optional<torch::ScalarType> autocast_dtype() const;
};

/// The options that define the model and its training: a checkpoint can only be resumed with
/// the same values. Keys are the options' names without the leading dashes (see resumable_flags).
nlohmann::json model_options(const RunConfig& config);
/// Every option of the run, for summaries and checkpoints.
nlohmann::json to_json(const RunConfig& config);

/// The (json key, command-line flag) pairs of model_options: a resumed run must not change them.
const std::vector<std::pair<std::string, std::string>>& model_option_flags();

/// Sets the options of `config` that the command line did not give from a checkpoint's to_json.
/// `given(flag)` tells whether the command line gave a flag.
void take_unset_options(RunConfig& config, const nlohmann::json& saved, const std::function<bool(const char*)>& given);

/// The device `name` asks for; throws std::runtime_error when CUDA is asked for but absent.
torch::Device resolve_device(const std::string& name);

}  // namespace qkv_train
