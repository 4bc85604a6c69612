// qkv-train: trains qkv::SelfAttention on toy tasks and shows what attention learned.
// Exit status: 0 done, 1 runtime failure, 2 bad command line, 130 / 143 stopped by SIGINT / SIGTERM.
#include "cli.h"
#include "run_config.h"
#include "scaling_task.h"
#include "seed_task.h"
#include "trainer.h"

#include <qkv/qkv.h>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cstdio>
#include <iostream>

int main(int argc, char** argv) {
  // Logs go to stderr so that stdout carries only the run's results (and --json stays parseable).
  spdlog::set_default_logger(spdlog::stderr_color_mt("qkv-train"));
  spdlog::set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
  qkv_train::RunConfig config;
  if (const int exit_code = qkv_train::parse_command_line(argc, argv, config); exit_code >= 0) return exit_code;

  try {
    if (config.threads > 0) torch::set_num_threads(config.threads);
    const auto device = qkv_train::resolve_device(config.device_name);
    if (config.device_name == "auto") spdlog::info("--device auto: using {}", device.str());
    spdlog::debug("LibTorch {}, {} threads", TORCH_VERSION, torch::get_num_threads());
    if (config.task == "seed") {
      auto summary = qkv_train::run_seed_task(config, device);
      if (config.json) std::cout << summary.dump() << std::endl;
      return 0;
    }
    if (config.task == "scaling") {
      auto summary = qkv_train::run_scaling_task(config, device);
      if (config.json) std::cout << summary.dump() << std::endl;
      return 0;
    }
    qkv_train::install_stop_handlers();  // only around training: elsewhere Ctrl-C stops at once
    auto result = qkv_train::train(config, device);
    if (config.json) {
      std::cout << result.summary.dump() << std::endl;
    } else {
      const auto& s = result.summary;
      std::printf("%s: loss %.5g -> %.5g in %lld steps (%.1f s, %.0f tokens/s on %s)\n", config.task.c_str(),
                  s["initial_loss"].get<double>(), s["final_loss"].get<double>(),
                  static_cast<long long>(s["steps"].get<int64_t>()), s["wall_time_s"].get<double>(),
                  s["tokens_per_s"].get<double>(), s["device"].get<std::string>().c_str());
      for (const auto& [key, value] : s["eval"].items()) std::printf("  eval %s: %.4f\n", key.c_str(), value.get<double>());
      if (!config.out_dir.empty()) {
        std::printf("  wrote %s/{metrics.csv,summary.json,loss.png,attention.png,checkpoint.pt,model.pt}\n",
                    config.out_dir.c_str());
      }
    }
    return result.exit_code;
  } catch (const qkv_train::TrainingDiverged& e) {
    std::fprintf(stderr, "qkv-train: %s\n", e.what());
    return 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "qkv-train: %s\n", e.what_without_backtrace());
    spdlog::debug("{}", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkv-train: %s\n", e.what());
    return 1;
  }
}
