#include "run_config.h"

#include <torch/cuda.h>
#include <torch/version.h>

#include <stdexcept>

namespace qkv_train {

void apply_task_defaults(RunConfig& config) {
  struct Defaults {
    int64_t d_model, seq_len, batch, steps;
    double lr;
    int64_t log_every, eval_every;
  };
  // seed: the documents' example. reverse and lookup: sizes that learn their pattern well within
  // a minute on a 2-core CPU (see README, "Training demo").
  Defaults defaults{8, 4, 1, 1, 0.01, 1, 1};
  if (config.task == "reverse") defaults = {48, 16, 64, 800, 0.01, 50, 100};
  if (config.task == "lookup") defaults = {33, 17, 64, 2000, 0.003, 100, 200};
  if (config.task == "scaling") defaults = {256, 16, 32, 300, 0.01, 50, 50};
  if (config.d_model == 0) config.d_model = defaults.d_model;
  if (config.seq_len == 0) config.seq_len = defaults.seq_len;
  if (config.batch == 0) config.batch = defaults.batch;
  if (config.steps == 0) config.steps = defaults.steps;
  if (config.lr == 0.0) config.lr = defaults.lr;
  if (config.log_every == 0) config.log_every = defaults.log_every;
  if (config.eval_every == 0) config.eval_every = defaults.eval_every;
}

nlohmann::json model_options(const RunConfig& config) {
  return {
      {"task", config.task},         {"d_model", config.d_model},     {"heads", config.heads},
      {"seq_len", config.seq_len},   {"causal", config.causal},       {"dtype", config.dtype_name},
      {"optimizer", config.optimizer},
      {"scale", config.scale ? nlohmann::json(*config.scale) : nlohmann::json(nullptr)},
  };
}

nlohmann::json to_json(const RunConfig& config) {
  auto json = model_options(config);
  json.update({{"device", config.device_name}, {"batch", config.batch},           {"steps", config.steps},
               {"lr", config.lr},              {"seed", config.seed},             {"threads", config.threads},
               {"log_every", config.log_every}, {"eval_every", config.eval_every},
               {"checkpoint_every", config.checkpoint_every}, {"init_weights", config.init_weights},
               {"dist_backend", config.dist_backend}, {"dist_timeout_s", config.dist_timeout_s}});
  return json;
}

torch::ScalarType dtype_from_name(const std::string& name) {
  if (name == "float64") return torch::kDouble;
  if (name == "bfloat16") return torch::kBFloat16;
  return torch::kFloat;
}

torch::Device resolve_device(const std::string& name) {
  if (name == "cpu") return torch::kCPU;
  const bool has_cuda = torch::cuda::is_available();
  if (name == "cuda" && !has_cuda) {
    throw std::runtime_error(std::string("--device cuda: no CUDA device is available to this LibTorch (") +
                             TORCH_VERSION + "); use --device cpu or auto");
  }
  return has_cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
}

}  // namespace qkv_train
