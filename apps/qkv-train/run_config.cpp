#include "run_config.h"

#include "common/cli_support.h"

#include <spdlog/spdlog.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <functional>
#include <stdexcept>

namespace qkv_train {
namespace {

// One row per option that a checkpoint records: its JSON key, its flag, and whether it defines
// the model (a resumed run must keep it) or only the run (it may change; some with a warning).
enum class Role { Model, RunWarn, Run };

struct OptionField {
  std::string key;
  std::string flag;
  Role role;
  std::function<nlohmann::json(const RunConfig&)> get;
  std::function<void(RunConfig&, const nlohmann::json&)> set;
};

template <typename T>
OptionField field(const char* key, const char* flag, Role role, T RunConfig::*member) {
  return {key, flag, role, [member](const RunConfig& c) { return nlohmann::json(c.*member); },
          [member](RunConfig& c, const nlohmann::json& j) { c.*member = j.get<T>(); }};
}

template <typename T>
OptionField field(const char* key, const char* flag, Role role, std::optional<T> RunConfig::*member) {
  return {key, flag, role,
          [member](const RunConfig& c) { return (c.*member) ? nlohmann::json(*(c.*member)) : nlohmann::json(nullptr); },
          [member](RunConfig& c, const nlohmann::json& j) {
            c.*member = j.is_null() ? std::nullopt : std::optional<T>(j.get<T>());
          }};
}

const std::vector<OptionField>& fields() {
  static const std::vector<OptionField> table{
      field("task", "--task", Role::Model, &RunConfig::task),
      field("d_model", "--d-model", Role::Model, &RunConfig::d_model),
      field("heads", "--heads", Role::Model, &RunConfig::heads),
      field("kv_heads", "--kv-heads", Role::Model, &RunConfig::kv_heads),
      field("layers", "--layers", Role::Model, &RunConfig::layers),
      field("seq_len", "--seq-len", Role::Model, &RunConfig::seq_len),
      field("causal", "--causal", Role::Model, &RunConfig::causal),
      field("dtype", "--dtype", Role::Model, &RunConfig::dtype_name),
      field("precision", "--precision", Role::RunWarn, &RunConfig::precision),
      field("optimizer", "--optimizer", Role::Model, &RunConfig::optimizer),
      field("scale", "--scale", Role::Model, &RunConfig::scale),
      field("tie_weights", "--tie-weights", Role::Model, &RunConfig::tie_weights),
      field("window", "--window", Role::Model, &RunConfig::window),
      field("data", "--data", Role::Model, &RunConfig::data_path),
      field("batch", "--batch", Role::RunWarn, &RunConfig::batch),
      field("lr", "--lr", Role::RunWarn, &RunConfig::lr),
      field("momentum", "--momentum", Role::RunWarn, &RunConfig::momentum),
      field("seed", "--seed", Role::RunWarn, &RunConfig::seed),
      field("dropout", "--dropout", Role::RunWarn, &RunConfig::dropout),
      field("weight_decay", "--weight-decay", Role::RunWarn, &RunConfig::weight_decay),
      field("warmup_steps", "--warmup-steps", Role::RunWarn, &RunConfig::warmup_steps),
      field("grad_clip", "--grad-clip", Role::RunWarn, &RunConfig::grad_clip),
      field("steps", "--steps", Role::Run, &RunConfig::steps),
      field("log_every", "--log-every", Role::Run, &RunConfig::log_every),
      field("eval_every", "--eval-every", Role::Run, &RunConfig::eval_every),
      field("checkpoint_every", "--checkpoint-every", Role::Run, &RunConfig::checkpoint_every),
      field("checkpoint_activations", "--checkpoint-activations", Role::Run, &RunConfig::checkpoint_activations),
  };
  return table;
}

}  // namespace

torch::ScalarType RunConfig::dtype() const { return qkv_cli::dtype_from_name(dtype_name); }

std::optional<torch::ScalarType> RunConfig::autocast_dtype() const {
  if (precision == "bf16-mixed") return torch::kBFloat16;
  if (precision == "fp16-mixed") return torch::kHalf;
  return std::nullopt;
}

const std::vector<std::pair<std::string, std::string>>& model_option_flags() {
  static const auto flags = [] {
    std::vector<std::pair<std::string, std::string>> list;
    for (const auto& f : fields()) {
      if (f.role == Role::Model) list.emplace_back(f.key, f.flag);
    }
    return list;
  }();
  return flags;
}

nlohmann::json model_options(const RunConfig& config) {
  nlohmann::json json = nlohmann::json::object();
  for (const auto& f : fields()) {
    if (f.role == Role::Model) json[f.key] = f.get(config);
  }
  return json;
}

nlohmann::json to_json(const RunConfig& config) {
  nlohmann::json json = nlohmann::json::object();
  for (const auto& f : fields()) json[f.key] = f.get(config);
  json.update({{"device", config.device_name},
               {"threads", config.threads},
               {"init_weights", config.init_weights},
               {"dist_backend", config.dist_backend},
               {"dist_timeout_s", config.dist_timeout_s}});
  return json;
}

void take_unset_options(RunConfig& config, const nlohmann::json& saved, const std::function<bool(const char*)>& given) {
  const auto current = to_json(config);
  for (const auto& f : fields()) {
    if (!saved.contains(f.key)) continue;  // a checkpoint of an older qkv-train: keep the default
    if (!given(f.flag.c_str())) {
      f.set(config, saved.at(f.key));
    } else if (f.role == Role::RunWarn && current.at(f.key) != saved.at(f.key)) {
      spdlog::warn(
          "--resume with {} {} (the checkpoint's run used {}): the losses will differ from an uninterrupted "
          "run",
          f.flag, current.at(f.key).dump(), saved.at(f.key).dump());
    }
  }
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
