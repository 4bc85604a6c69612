// qkv-train's command line: CLI11 options, their checks, --resume's merge with the checkpoint's
// options, and the task defaults.
#include "cli.h"

#include "checkpoint.h"
#include "tasks.h"

#include <qkv/version.h>

#include <CLI/CLI.hpp>
#include <spdlog/cfg/env.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>

namespace qkv_train {

namespace {

// Bad command lines: one line on stderr, exit status 2.
int usage_error(const std::string& message) {
  std::string line = message;
  std::replace(line.begin(), line.end(), '\n', ' ');
  std::fprintf(stderr, "qkv-train: error: %s (see --help)\n", line.c_str());
  return 2;
}

// With --resume, options the command line leaves out come from the checkpoint. Options it sets
// must agree with the checkpoint's where they define the model; others (batch, lr, seed, steps)
// may change, with a warning where the run then differs from one that never stopped.
// Returns a problem, or "".
std::string merge_resumed_options(const CLI::App& app, qkv_train::RunConfig& config) {
  const auto saved = qkv_train::read_checkpoint_state(config.resume_dir).options;
  const auto current = qkv_train::to_json(config);
  const std::pair<const char*, const char*> model_flags[] = {
      {"task", "--task"},   {"d_model", "--d-model"}, {"heads", "--heads"},         {"seq_len", "--seq-len"},
      {"causal", "--causal"}, {"dtype", "--dtype"},   {"optimizer", "--optimizer"}, {"scale", "--scale"}};
  for (const auto& [key, flag] : model_flags) {
    if (app.count(flag) > 0 && current.at(key) != saved.at(key)) {
      return std::string("--resume: the checkpoint in ") + config.resume_dir + " was trained with " + flag + " " +
             saved.at(key).dump() + ", the command line asks for " + current.at(key).dump();
    }
  }
  const std::pair<const char*, const char*> run_flags[] = {{"batch", "--batch"}, {"lr", "--lr"}, {"seed", "--seed"}};
  for (const auto& [key, flag] : run_flags) {
    if (app.count(flag) > 0 && current.at(key) != saved.at(key)) {
      spdlog::warn("--resume with {} {} (the checkpoint's run used {}): the losses will differ from an uninterrupted "
                   "run", flag, current.at(key).dump(), saved.at(key).dump());
    }
  }
  auto take = [&](const char* key, const char* flag, auto& field) {
    if (app.count(flag) == 0) field = saved.at(key).get<std::decay_t<decltype(field)>>();
  };
  take("task", "--task", config.task);
  take("d_model", "--d-model", config.d_model);
  take("heads", "--heads", config.heads);
  take("seq_len", "--seq-len", config.seq_len);
  take("causal", "--causal", config.causal);
  take("dtype", "--dtype", config.dtype_name);
  take("optimizer", "--optimizer", config.optimizer);
  take("batch", "--batch", config.batch);
  take("lr", "--lr", config.lr);
  take("seed", "--seed", config.seed);
  take("steps", "--steps", config.steps);
  take("log_every", "--log-every", config.log_every);
  take("eval_every", "--eval-every", config.eval_every);
  take("checkpoint_every", "--checkpoint-every", config.checkpoint_every);
  if (app.count("--scale") == 0) {
    config.scale = saved.at("scale").is_null() ? std::nullopt : std::optional<double>(saved.at("scale").get<double>());
  }
  return "";
}

}  // namespace

std::string distributed_option_problem(const RunConfig& config, int world_size) {
  if (config.task == "seed" || config.task == "scaling") {
    return "--task " + config.task + " runs in one process; data-parallel training needs --task reverse or lookup";
  }
  if (config.batch % world_size != 0) {
    return "--batch " + std::to_string(config.batch) + " is the total batch and must divide evenly over the " +
           std::to_string(world_size) + " processes";
  }
  return "";
}

int parse_command_line(int argc, const char* const* argv, RunConfig& config) {
  std::string log_level = "info";
  double scale = 0.0;

  CLI::App app{"qkv-train: train qkv::SelfAttention on toy tasks and watch attention learn (qkv " QKV_VERSION_STRING
               ").\nTasks: seed = the documents' example; reverse = output position i copies input position "
               "N-1-i; lookup = recall the value stored under a query key; scaling = the documents' experiment for "
               "sqrt(d_k).",
               "qkv-train"};
  app.option_defaults()->always_capture_default();
  const char* task_default = " (by task: seed / reverse / lookup = ";
  app.add_option("--task", config.task, "Task")->check(CLI::IsMember({"seed", "reverse", "lookup", "scaling"}));
  app.add_option("--device", config.device_name, "Device; auto picks CUDA when present")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--dtype", config.dtype_name, "Parameter and input dtype")
      ->check(CLI::IsMember({"float32", "float64", "bfloat16"}));
  app.add_option("--d-model", config.d_model, std::string("Model width E") + task_default + "8 / 48 / 33; scaling 256)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16))
      ->default_str("by task");
  app.add_option("--heads", config.heads, "Attention heads H (d_model must be divisible by it)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 12));
  app.add_option("--seq-len", config.seq_len, std::string("Sequence length N") + task_default + "4 / 16 / 17)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->default_str("by task");
  app.add_option("--batch", config.batch, std::string("Batch size B") + task_default + "1 / 64 / 64)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->default_str("by task");
  app.add_option("--steps", config.steps, std::string("Training steps") + task_default + "1 / 800 / 2000; scaling 300)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
      ->default_str("by task");
  app.add_option("--lr", config.lr, std::string("Learning rate") + task_default + "0.01 / 0.01 / 0.003)")
      ->check(CLI::PositiveNumber)
      ->default_str("by task");
  app.add_option("--optimizer", config.optimizer, "Optimizer")->check(CLI::IsMember({"adam", "sgd"}));
  app.add_option("--seed", config.seed, "Random seed (42 = the documents' example)");
  app.add_option("--threads", config.threads, "CPU threads for LibTorch (0 = its default)")->check(CLI::Range(0, 1024));
  app.add_flag("--causal", config.causal, "Causal mask: position i attends only to positions <= i");
  app.add_option("--scale", scale, "Multiplier of QKᵀ (1.0 = unscaled, the documents' warning)")
      ->check(CLI::PositiveNumber)
      ->default_str("1/sqrt(d_model/heads)");
  app.add_option("--log-every", config.log_every, "Log line and metrics.csv row every N steps")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
      ->default_str("by task");
  app.add_option("--eval-every", config.eval_every, "Evaluate (and draw) every N steps")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
      ->default_str("by task");
  app.add_option("--out", config.out_dir, "Folder for metrics.csv, summary.json, loss.png, attention.png, checkpoint.pt, model.pt");
  app.add_option("--checkpoint-every", config.checkpoint_every, "Write a checkpoint every N steps (0 = only at the end)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--resume", config.resume_dir, "Continue from the checkpoint in this folder")
      ->check(CLI::ExistingDirectory);
  app.add_option("--init-weights", config.init_weights,
                 "Start from these weights: a file of Python's torch.save(dict(model.state_dict()), path), in the "
                 "documents' or nn.MultiheadAttention's layout")
      ->check(CLI::ExistingFile);
  app.add_option("--nproc", config.nproc,
                 "Data-parallel training on N processes of this machine (as torchrun --nproc_per_node N does); "
                 "--batch is the total over them")
      ->check(CLI::Range(1, 1024));
  app.add_option("--dist-backend", config.dist_backend,
                 "c10d process group of a distributed run (auto: nccl for CUDA when built with it, else gloo)")
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}));
  app.add_option("--dist-timeout", config.dist_timeout_s,
                 "Seconds a rank waits for the others (rendezvous, each collective) before it stops with an error")
      ->check(CLI::Range(0.1, 86400.0));
  app.add_flag("--save-replicas", config.save_replicas,
               "Distributed runs: every rank writes its final weights to OUT/replica-RANK.pt (to check that the "
               "replicas agree)");
  app.add_flag("--json", config.json, "Print the summary as one JSON object on stdout");
  app.add_flag("--quiet", config.quiet, "No progress display");
  app.add_option("--log-level", log_level, "Log level (the SPDLOG_LEVEL environment variable also works)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}));

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return usage_error(e.what());
  }
  if (scale > 0.0) config.scale = scale;

  spdlog::set_level(spdlog::level::from_str(log_level));
  spdlog::cfg::load_env_levels();
  if (config.quiet && app.count("--log-level") == 0) spdlog::set_level(spdlog::level::warn);

  try {
    if (!config.resume_dir.empty()) {
      if (const auto problem = merge_resumed_options(app, config); !problem.empty()) return usage_error(problem);
      if (config.out_dir.empty()) config.out_dir = config.resume_dir;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkv-train: %s\n", e.what());
    return 1;
  }
  if ((config.task == "seed" || config.task == "scaling") &&
      (!config.resume_dir.empty() || config.checkpoint_every > 0)) {
    return usage_error("--task " + config.task + " has no checkpoints; --resume and --checkpoint-every need --task "
                       "reverse or lookup");
  }
  qkv_train::apply_task_defaults(config);
  if (config.nproc > 1) {
    if (const auto problem = distributed_option_problem(config, config.nproc); !problem.empty()) {
      return usage_error("--nproc " + std::to_string(config.nproc) + ": " + problem);
    }
  }
  if (config.task != "seed") {
    if (config.task == "scaling" && config.d_model <= config.seq_len) {
      return usage_error("--task scaling trains reverse and needs --d-model > --seq-len");
    }
    if (const auto problem = qkv_train::task_option_problem(config); !problem.empty()) return usage_error(problem);
  }

  return -1;
}

}  // namespace qkv_train
