// qkv-train: trains qkv::SelfAttention on toy tasks. Exit status: 0 done, 1 runtime failure,
// 2 bad command line.
#include "run_config.h"
#include "seed_task.h"

#include <qkv/qkv.h>

#include <CLI/CLI.hpp>
#include <spdlog/cfg/env.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cstdio>
#include <iostream>

namespace qkv_train {

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

int main(int argc, char** argv) {
  qkv_train::RunConfig config;
  std::string log_level = "info";

  CLI::App app{"qkv-train: train qkv::SelfAttention on toy tasks (qkv " QKV_VERSION_STRING ")", "qkv-train"};
  app.option_defaults()->always_capture_default();
  app.add_option("--task", config.task, "Task to train")->check(CLI::IsMember({"seed"}));
  app.add_option("--device", config.device_name, "Device: auto picks CUDA when present")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--d-model", config.d_model, "Model width d_model")->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  app.add_option("--seq-len", config.seq_len, "Sequence length N")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--steps", config.steps, "Training steps (1 = the documents' single backward pass)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--lr", config.lr, "Adam learning rate")->check(CLI::PositiveNumber);
  app.add_option("--seed", config.seed, "Random seed (42 = the documents' example)");
  app.add_option("--threads", config.threads, "CPU threads for LibTorch (0 = its default)")
      ->check(CLI::Range(0, 1024));
  app.add_flag("--json", config.json, "Print one JSON summary on stdout instead of text");
  app.add_option("--log-level", log_level, "Log level (the SPDLOG_LEVEL environment variable also works)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}));

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    std::fprintf(stderr, "qkv-train: error: %s (see --help)\n", what.c_str());
    return 2;
  }

  // Logs go to stderr so that stdout carries only the run's results (and --json stays parseable).
  spdlog::set_default_logger(spdlog::stderr_color_mt("qkv-train"));
  spdlog::set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
  spdlog::set_level(spdlog::level::from_str(log_level));
  spdlog::cfg::load_env_levels();

  try {
    if (config.threads > 0) torch::set_num_threads(config.threads);
    const auto device = qkv_train::resolve_device(config.device_name);
    spdlog::debug("task {} on {} (LibTorch {}, {} threads)", config.task, device.str(), TORCH_VERSION,
                  torch::get_num_threads());
    nlohmann::json summary = qkv_train::run_seed_task(config, device);
    if (config.json) std::cout << summary.dump() << std::endl;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "qkv-train: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkv-train: %s\n", e.what());
    return 1;
  }
  return 0;
}
