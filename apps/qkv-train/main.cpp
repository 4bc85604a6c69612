// qkv-train: trains qkv's attention on tasks and shows what it learned (the tasks: task_registry.cpp).
// Exit status: 0 done, 1 runtime failure, 2 bad command line or distributed environment,
// 130 / 143 stopped by SIGINT / SIGTERM.
#include "cli.h"
#include "common/cli_support.h"
#include "distributed.h"
#include "launcher.h"
#include "run_config.h"
#include "stop_signals.h"
#include "task_registry.h"
#include "tasks/tasks.h"
#include "trainer.h"

#include <qkv/qkv.h>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <thread>

namespace {

void print_summary(const qkv_train::RunConfig& config, const nlohmann::json& s) {
  std::printf("%s: loss %.5g -> %.5g in %lld steps (%.1f s, %.0f tokens/s on %s)\n", config.task.c_str(),
              s["initial_loss"].get<double>(), s["final_loss"].get<double>(),
              static_cast<long long>(s["steps"].get<int64_t>()), s["wall_time_s"].get<double>(),
              s["tokens_per_s"].get<double>(), s["device"].get<std::string>().c_str());
  for (const auto& [key, value] : s["eval"].items()) std::printf("  eval %s: %.4f\n", key.c_str(), value.get<double>());
  if (s.contains("files")) {
    std::string files;
    for (const auto& file : s["files"]) files += (files.empty() ? "" : ",") + file.get<std::string>();
    std::printf("  wrote %s/{%s}\n", config.out_dir.c_str(), files.c_str());
  }
}

// In a distributed run each process trains on a share of the batch: LibTorch's default (a thread
// per physical core as it counts them) in every process would oversubscribe the machine.
void set_threads(const qkv_train::RunConfig& config, const std::optional<qkv_train::DistributedEnv>& env) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (config.threads > 0) {
    torch::set_num_threads(config.threads);
  } else if (env && env->local_world_size > 1) {
    torch::set_num_threads(std::max(1, cores / env->local_world_size));
  } else if (qkv_train::find_task(config.task).defaults.all_cores) {
    torch::set_num_threads(cores);
  }
}

// The process group of a distributed run: NCCL needs one GPU per process, Gloo does not.
std::string pick_backend(const qkv_train::RunConfig& config, const torch::Device& device,
                         const qkv_train::DistributedEnv& env) {
  const int gpus = device.is_cuda() ? static_cast<int>(torch::cuda::device_count()) : 0;
  if (config.dist_backend == "nccl") {
    if (!device.is_cuda()) throw qkv_train::DistributedConfigError("--dist-backend nccl needs --device cuda");
    if (env.local_world_size > gpus) {
      throw qkv_train::DistributedConfigError("--dist-backend nccl needs a GPU per process: this machine has " +
                                              std::to_string(gpus) + " for " + std::to_string(env.local_world_size) +
                                              " processes (--dist-backend gloo can share one)");
    }
  }
  if (config.dist_backend != "auto") return config.dist_backend;
  return device.is_cuda() && env.local_world_size <= gpus && qkv_train::has_distributed_backend("nccl") ? "nccl"
                                                                                                        : "gloo";
}

// Each process of a machine takes its own GPU, LOCAL_RANK; with more processes than GPUs (Gloo only) they share.
torch::Device rank_device(const std::string& name, const std::optional<qkv_train::DistributedEnv>& env) {
  auto device = qkv_train::resolve_device(name);
  if (device.is_cuda() && env) {
    const auto gpus = static_cast<int>(torch::cuda::device_count());
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env->local_rank % gpus));
  }
  return device;
}

}  // namespace

int main(int argc, char** argv) {
  // Before any thread starts (LibTorch's, OpenMP's, Gloo's): they inherit SIGINT and SIGTERM
  // blocked, and one thread of qkv-train's own takes them (stop_signals.h says why).
  try {
    qkv_train::take_stop_signals_on_own_thread();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkv-train: %s\n", e.what());
    return 1;
  }
  // Logs go to stderr so that stdout carries only the run's results (and --json stays parseable).
  spdlog::set_default_logger(spdlog::stderr_color_mt("qkv-train"));
  spdlog::set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
  // Before LibTorch allocates: a step's tensors reuse the heap instead of faulting in fresh pages.
  const bool reusing_freed_memory = qkv_cli::keep_freed_memory_for_reuse();

  // 1. The command line and the distributed environment.
  qkv_train::RunConfig config;
  std::optional<qkv_train::CheckpointFile> resume;  // --resume's, read once (checkpoint.h)
  if (const int exit_code = qkv_train::parse_command_line(argc, argv, config, &resume); exit_code >= 0) {
    return exit_code;
  }
  std::optional<qkv_train::DistributedEnv> env;
  try {
    env = qkv_train::read_distributed_env();
  } catch (const qkv_train::DistributedConfigError& e) {
    std::fprintf(stderr, "qkv-train: error: %s\n", e.what());
    return 2;
  }

  // The kernels' and linear layers' routes as the environment chose them (QKV_TILED_ISA,
  // QKV_LINEAR_GEMM): a value qkv refuses is an error of the command, found before anything runs
  // or is written (later it would end the run as a runtime error, with exit status 1).
  if (const auto problem = qkv_cli::route_setting_problem(); !problem.empty()) {
    std::fprintf(stderr, "qkv-train: error: %s\n", problem.c_str());
    return 2;
  }

  // 2. --nproc: this process only launches the ranks and waits for them.
  if (config.nproc > 1) {
    if (env) {
      std::fprintf(stderr,
                   "qkv-train: error: --nproc starts its own processes, but RANK and WORLD_SIZE are already "
                   "set (torchrun?); use one or the other\n");
      return 2;
    }
    resume.reset();  // each rank reads it
    try {
      return qkv_train::launch_local_job(config.nproc, qkv_train::arguments_without_nproc(argc, argv),
                                         config.dist_timeout());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "qkv-train: %s\n", e.what());
      return 1;
    }
  }

  // 3. A rank of a data-parallel job: check the options, and let rank 0 speak for the job.
  const bool distributed = env && env->world_size > 1;
  std::string program = "qkv-train";
  if (distributed) {
    if (const auto problem = qkv_train::distributed_option_problem(config, env->world_size); !problem.empty()) {
      std::fprintf(stderr, "qkv-train: error: WORLD_SIZE=%d: %s\n", env->world_size, problem.c_str());
      return 2;
    }
    program += " [rank " + std::to_string(env->rank) + "]";
    spdlog::set_pattern("[%H:%M:%S.%e] [%^%l%$] [rank " + std::to_string(env->rank) + "] %v");
    if (env->rank != 0) {
      config.quiet = true;
      config.json = false;
      if (spdlog::get_level() == spdlog::level::info) spdlog::set_level(spdlog::level::warn);
    }
  }

  // 4. Run the task.
  try {
    set_threads(config, env);
    const auto device = rank_device(config.device_name, env);
    if (config.device_name == "auto") spdlog::info("--device auto: using {}", device.str());
    spdlog::debug("LibTorch {}, {} threads, OpenBLAS core {}, linear layers on {}, freed memory {}", TORCH_VERSION,
                  torch::get_num_threads(), qkv::blas_core(), qkv::linear_products(),
                  reusing_freed_memory ? "kept in the heap (mmap threshold 32 MiB)" : "as the C library decides");
    if (const auto advice = qkv::blas_core_advice(); !advice.empty() && device.is_cpu()) spdlog::warn("{}", advice);
    const auto& task = qkv_train::find_task(config.task);
    if (!task.trained() || config.generate) {
      const auto summary =
          config.generate ? qkv_train::run_lm_generation(config, device, std::move(resume)) : task.run(config, device);
      if (config.json) std::cout << summary.dump() << std::endl;
      return 0;
    }
    std::unique_ptr<qkv_train::DataParallel> parallel;
    if (distributed) {
      const auto backend = pick_backend(config, device, *env);
      parallel = std::make_unique<qkv_train::DataParallel>(*env, backend, config.dist_timeout());
      spdlog::info("data parallel: {} processes, {} process group, {} examples each, {} threads per process",
                   env->world_size, backend, config.batch / env->world_size, torch::get_num_threads());
    }
    qkv_train::catch_stop_signals();  // only around training: elsewhere Ctrl-C stops at once
    auto result = qkv_train::train(config, device, parallel.get(), std::move(resume));
    if (config.json) {
      std::cout << result.summary.dump() << std::endl;
    } else if (!distributed || env->rank == 0) {
      print_summary(config, result.summary);
    }
    return result.exit_code;
  } catch (const qkv_train::DistributedConfigError& e) {
    std::fprintf(stderr, "%s: error: %s\n", program.c_str(), e.what());
    return 2;
  } catch (const qkv_train::UsageError& e) {
    std::fprintf(stderr, "%s: error: %s\n", program.c_str(), e.what());
    return 2;
  } catch (const qkv_train::TrainingDiverged& e) {
    std::fprintf(stderr, "%s: %s\n", program.c_str(), e.what());
    return 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: %s\n", program.c_str(), e.what_without_backtrace());
    spdlog::debug("{}", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program.c_str(), e.what());
    return 1;
  }
}
