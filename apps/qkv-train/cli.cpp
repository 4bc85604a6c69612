// qkv-train's command line: CLI11 options, their checks, --resume's merge with the checkpoint's
// options, and the task defaults. What each task reads comes from task_registry.
#include "cli.h"

#include "checkpoint.h"
#include "common/cli_support.h"
#include "task_registry.h"

#include <qkv/version.h>

#include <spdlog/cfg/env.h>
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <system_error>

namespace qkv_train {

namespace {

int usage_error(const std::string& message) { return qkv_cli::usage_error("qkv-train", message); }

std::string program_description() {
  std::string text =
      "qkv-train: train qkv's attention on tasks and watch it learn (qkv " QKV_VERSION_STRING ").\nTasks:";
  for (const auto& task : task_registry()) text += "\n  " + task.name + ": " + task.description;
  return text;
}

// "--task X" followed by the task's default: " (by task: seed 8, reverse 48, ...)".
std::string by_task(const std::function<std::string(const TaskDefaults&)>& value) {
  std::string text = " (by task:";
  for (const auto& task : task_registry()) {
    const auto shown = value(task.defaults);
    if (!shown.empty()) text += " " + task.name + " " + shown + ",";
  }
  text.back() = ')';
  return text;
}

std::string integer(int64_t value) { return std::to_string(value); }

std::string real(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

// The flags the command line gave that the task does not read.
std::vector<std::string> unread_flags(const CLI::App& app, const TaskSpec& task) {
  std::vector<std::string> unread;
  for (const auto* option : app.get_options()) {
    const auto names = option->get_lnames();
    if (names.empty() || option->count() == 0) continue;
    const auto flag = "--" + names.front();
    if (flag != "--help" && !task.reads(flag)) unread.push_back(flag);
  }
  return unread;
}

// --seed as torch.manual_seed takes it: a whole number from -2^63 to 2^64 - 1, a negative one
// standing for 2^64 + seed (what PyTorch 1.13 and 2.14 seed their generator with), written here as
// that number. CLI11's own conversion to uint64_t took every number past 2^64 - 1 for 2^64 - 1 (so
// different seeds gave the same run) and, depending on its version, wrapped a negative one or
// refused it.
CLI::Validator torch_seed() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const char *first = text.data(), *last = text.data() + text.size();
        std::from_chars_result parsed{};
        uint64_t seed = 0;
        if (!text.empty() && text.front() == '-') {
          int64_t negative = 0;
          parsed = std::from_chars(first, last, negative);
          seed = static_cast<uint64_t>(negative);  // 2^64 + negative
        } else {
          parsed = std::from_chars(first, last, seed);
        }
        if (text.empty() || parsed.ec != std::errc{} || parsed.ptr != last) {
          return "expected a whole number from -9223372036854775808 to 18446744073709551615 (as torch.manual_seed), "
                 "got " + text;
        }
        text = std::to_string(seed);
        return "";
      },
      "INT in [-2^63 - 2^64-1]");
}

// --out: a folder, made when missing. A file of that name is refused here, as a bad command line,
// where it used to stop the run after the task had loaded its data.
CLI::Validator output_folder() {
  return CLI::Validator(
      [](const std::string& path) -> std::string {
        std::error_code error;
        const auto status = std::filesystem::status(path, error);
        if (std::filesystem::exists(status) && !std::filesystem::is_directory(status)) {
          return "expected a folder (made when missing), got the file " + path;
        }
        return "";
      },
      "DIR");
}

std::string joined(const std::vector<std::string>& items) {
  std::string text;
  for (const auto& item : items) text += (text.empty() ? "" : " ") + item;
  return text;
}

// The task --generate belongs to: the one task that reads it (lm), so that `--generate
// --init-weights FILE` needs no --task (with --resume the checkpoint names its task).
std::string task_that_generates() {
  for (const auto& task : task_registry()) {
    if (std::find(task.flags.begin(), task.flags.end(), "--generate") != task.flags.end()) return task.name;
  }
  throw UsageError("--generate: no task samples text");
}

}  // namespace

std::string distributed_option_problem(const RunConfig& config, int world_size) {
  const auto& task = find_task(config.task);
  if (!task.trained()) {
    return "--task " + config.task + " runs in one process; data-parallel training needs a trained task";
  }
  if (config.generate) return "--generate runs in one process";
  if (config.batch % world_size != 0) {
    return "--batch " + std::to_string(config.batch) + " is the total batch and must divide evenly over the " +
           std::to_string(world_size) + " processes";
  }
  return "";
}

int parse_command_line(int argc, const char* const* argv, RunConfig& config,
                       std::optional<CheckpointFile>* resume_checkpoint) {
  std::string log_level = "info";
  double scale = 0.0;
  int64_t kv_heads = 0;
  int64_t window = 0;  // 0: unset (full attention)
  std::vector<std::string> task_names;
  for (const auto& task : task_registry()) task_names.push_back(task.name);

  CLI::App app{program_description(), "qkv-train"};
  app.option_defaults()->always_capture_default();
  app.add_option("--task", config.task, "Task")->check(CLI::IsMember(task_names));
  app.add_option("--device", config.device_name, "Device; auto picks CUDA when present")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--dtype", config.dtype_name,
                 "Parameter and input dtype (bfloat16: the optimizer steps on float32 master weights)")
      ->check(CLI::IsMember({"float32", "float64", "bfloat16"}));
  app.add_option("--precision", config.precision,
                 "fp32, or mixed precision: float32 weights and optimizer state, products and attention in bfloat16 "
                 "(bf16-mixed) or float16 with loss scaling (fp16-mixed), softmax statistics, LayerNorm and loss in "
                 "float32")
      ->check(CLI::IsMember({"fp32", "bf16-mixed", "fp16-mixed"}));
  app.add_option("--d-model", config.d_model, "Model width E" + by_task([](auto& d) { return integer(d.d_model); }))
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16))
      ->default_str("by task");
  app.add_option("--heads", config.heads, "Attention heads H (d_model must be divisible by it)" + by_task([](auto& d) {
                                            return d.heads > 1 ? integer(d.heads) : std::string();
                                          }) + "; else 1")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 12))
      ->default_str("by task");
  app.add_option("--kv-heads", kv_heads, "Key/value heads (grouped-query attention; must divide --heads)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 12))
      ->default_str("--heads");
  app.add_option("--layers", config.layers, "Transformer blocks of the language model")
      ->check(CLI::Range(int64_t{1}, int64_t{256}))
      ->default_str(by_task([](auto& d) { return d.layers > 0 ? integer(d.layers) : std::string(); }).substr(1));
  app.add_option("--seq-len", config.seq_len, "Sequence length N" + by_task([](auto& d) { return integer(d.seq_len); }))
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->default_str("by task");
  app.add_option("--batch", config.batch, "Batch size B" + by_task([](auto& d) { return integer(d.batch); }))
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->default_str("by task");
  app.add_option("--steps", config.steps, "Training steps" + by_task([](auto& d) { return integer(d.steps); }))
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
      ->default_str("by task");
  app.add_option("--lr", config.lr,
                 "Learning rate (the peak of lm's schedule)" + by_task([](auto& d) { return real(d.lr); }))
      ->check(qkv_cli::real_in(0.0, 1e38, /*lower_open=*/true))  // float32 holds it
      ->default_str("by task");
  app.add_option("--optimizer", config.optimizer, "Optimizer of the toy tasks (lm uses AdamW)")
      ->check(CLI::IsMember({"adam", "sgd"}));
  app.add_option("--momentum", config.momentum, "Momentum of --optimizer sgd (0 = plain SGD; below 1)")
      ->check(qkv_cli::real_in(0.0, 0.999));
  app.add_option("--seed", config.seed,
                 "Random seed (42 = the documents' example; a negative one as torch.manual_seed takes it)")
      ->transform(torch_seed());
  app.add_option("--threads", config.threads, "CPU threads for LibTorch (0 = its default; lm: every core)")
      ->check(CLI::Range(0, 1024));
  app.add_flag("--causal", config.causal, "Causal mask: position i attends only to positions <= i");
  app.add_option("--scale", scale, "Multiplier of QKᵀ (1.0 = unscaled, the documents' warning)")
      ->check(qkv_cli::real_in(0.0, 1e38, /*lower_open=*/true))  // float32 holds it
      ->default_str("1/sqrt(d_model/heads)");
  app.add_option("--log-every", config.log_every,
                 "Log line and metrics.csv row every N steps" + by_task([](auto& d) { return integer(d.log_every); }))
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
      ->default_str("by task");
  app.add_option("--eval-every", config.eval_every,
                 "Evaluate every N steps" + by_task([](auto& d) { return integer(d.eval_every); }))
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
      ->default_str("by task");
  app.add_option("--out", config.out_dir, "Folder for metrics.csv, summary.json, pictures, checkpoint.pt, model.pt")
      ->check(output_folder());
  app.add_option("--checkpoint-every", config.checkpoint_every,
                 "Write a checkpoint every N steps (0 = only at the end)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--resume", config.resume_dir, "Continue from the checkpoint in this folder (lm: or generate from it)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--init-weights", config.init_weights,
                 "Start from these weights: a file of Python's torch.save(dict(model.state_dict()), path) (toy tasks: "
                 "the documents' or nn.MultiheadAttention's layout)")
      ->check(CLI::ExistingFile);
  // The language model.
  app.add_option("--data", config.data_path,
                 "lm: a UTF-8 text file to train on (character-level); default: The Devil's Dictionary from Debian's "
                 "dict-devil")
      ->check(CLI::ExistingFile)
      ->default_str("/usr/share/dictd/devil.dict.dz");
  app.add_option("--dropout", config.dropout, "lm: dropout on attention weights and residual branches")
      ->check(qkv_cli::real_in(0.0, 0.95))
      ->default_str(by_task([](auto& d) { return d.layers > 0 ? real(d.dropout) : std::string(); }).substr(1));
  app.add_option("--weight-decay", config.weight_decay, "lm: AdamW's weight decay (matrices and embeddings only)")
      ->check(qkv_cli::real_in(0.0, 10.0));
  app.add_option("--warmup-steps", config.warmup_steps, "lm: linear warmup steps before the cosine decay")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40))
      ->default_str(by_task([](auto& d) { return d.layers > 0 ? integer(d.warmup_steps) : std::string(); }).substr(1));
  app.add_option("--grad-clip", config.grad_clip, "lm: largest global gradient norm (0 = no clipping)")
      ->check(qkv_cli::real_in(0.0, 1e9));
  app.add_flag("--tie-weights", config.tie_weights, "lm: the output layer shares the token embedding's weights");
  app.add_option("--window", window,
                 "lm: sliding-window attention: each position attends to the last W positions only (cost N·W; "
                 "generation then uses a rolling KV cache of W positions and never stops)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_flag("--checkpoint-activations", config.checkpoint_activations,
               "lm: each block keeps only its input for the backward and recomputes its forward there (less memory, "
               "about a third more time)");
  app.add_flag("--generate", config.generate,
               "lm: print text sampled from a trained model (--resume DIR or --init-weights FILE) instead of training");
  app.add_option("--prompt", config.prompt,
                 "lm: text the samples continue (every character must be in the vocabulary)");
  app.add_option("--max-new-tokens", config.max_new_tokens, "lm: characters to generate")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--temperature", config.temperature, "lm: sampling temperature (0 = greedy)")
      ->check(qkv_cli::real_in(0.0, 100.0));
  app.add_option("--top-k", config.top_k, "lm: sample among the k most likely characters only")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->default_str("all");
  app.add_flag("--no-kv-cache", config.no_kv_cache,
               "lm: generate by recomputing the whole prefix for every token (to compare with the KV cache)");
  // Data parallelism.
  app.add_option("--nproc", config.nproc,
                 "Data-parallel training on N processes of this machine (as torchrun --nproc_per_node N does); "
                 "--batch is the total over them")
      ->check(CLI::Range(1, 1024));
  app.add_option("--dist-backend", config.dist_backend,
                 "c10d process group of a distributed run (auto: nccl for CUDA when built with it, else gloo)")
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}));
  app.add_option("--dist-timeout", config.dist_timeout_s,
                 "Seconds a rank waits for the others (rendezvous, each collective) before it stops with an error")
      ->check(qkv_cli::real_in(0.1, 86400.0));
  app.add_flag("--save-replicas", config.save_replicas,
               "Distributed runs: every rank writes its final weights to OUT/replica-RANK.pt (to check that the "
               "replicas agree)");
  app.add_flag("--json", config.json, "Print the summary as one JSON object on stdout");
  app.add_flag("--quiet", config.quiet, "No progress display");
  app.add_option("--log-level", log_level, "Log level (the SPDLOG_LEVEL environment variable also works)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}));

  if (const auto exit_code = qkv_cli::parse(app, argc, argv)) return *exit_code;
  if (scale > 0.0) config.scale = scale;
  if (kv_heads > 0) config.kv_heads = kv_heads;
  if (window > 0) config.window = window;

  spdlog::set_level(spdlog::level::from_str(log_level));
  spdlog::cfg::load_env_levels();
  if (config.quiet && app.count("--log-level") == 0) spdlog::set_level(spdlog::level::warn);

  nlohmann::json saved;  // the options of --resume's checkpoint
  std::optional<CheckpointFile> checkpoint;
  try {
    if (!config.resume_dir.empty()) {
      checkpoint.emplace(config.resume_dir);
      saved = checkpoint->state().options;
      if (app.count("--task") == 0 && saved.contains("task")) config.task = saved.at("task").get<std::string>();
    } else if (app.count("--task") == 0 && config.generate) {
      config.task = task_that_generates();  // --generate --init-weights FILE: the one task that samples
    }
  } catch (const UsageError& e) {
    return usage_error(e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkv-train: %s\n", e.what());
    return 1;
  }
  const auto& task = find_task(config.task);

  // Every option typed is used: one the task does not read is an error, not silently dropped.
  if (const auto unread = unread_flags(app, task); !unread.empty()) {
    std::string readable;
    for (const auto& flag : task.flags) readable += " " + flag;
    return usage_error(joined(unread) + (unread.size() == 1 ? " is not an option of" : " are not options of") +
                       " --task " + config.task + " (it reads" + readable + " besides the common ones)");
  }
  if (!config.resume_dir.empty()) {
    const auto current = model_options(config);
    for (const auto& [key, flag] : model_option_flags()) {
      if (app.count(flag) > 0 && saved.contains(key) && current.at(key) != saved.at(key)) {
        return usage_error("--resume: the checkpoint in " + config.resume_dir + " was trained with " + flag + " " +
                           saved.at(key).dump() + ", the command line asks for " + current.at(key).dump());
      }
    }
    take_unset_options(config, saved, [&](const char* flag) { return app.count(flag) > 0; });
    if (config.out_dir.empty() && !config.generate) config.out_dir = config.resume_dir;
  }
  apply_task_defaults(config);
  // --steps is the run's total, counted from its start. Below the checkpoint's step nothing would be
  // trained, and the run's files would be rewritten with a summary whose steps are not --steps.
  if (checkpoint && !config.generate && config.steps < checkpoint->state().step) {
    const auto at = std::to_string(checkpoint->state().step);
    return usage_error("--steps " + std::to_string(config.steps) + ": the checkpoint in " + config.resume_dir +
                       " is at step " + at + ", and --steps counts from the run's start: give more than " + at +
                       " to train on from it (" + at + " reports it)");
  }
  if (config.nproc > 1) {
    if (const auto problem = distributed_option_problem(config, config.nproc); !problem.empty()) {
      return usage_error("--nproc " + std::to_string(config.nproc) + ": " + problem);
    }
  }
  if (config.precision != "fp32" && config.dtype_name != "float32") {
    return usage_error("--precision " + config.precision + " keeps float32 weights and optimizer state and computes "
                       "in lower precision under autocast; it needs --dtype float32, got --dtype " + config.dtype_name);
  }
  if (config.momentum > 0.0 && config.optimizer != "sgd") {
    return usage_error("--momentum is SGD's: it needs --optimizer sgd, got --optimizer " + config.optimizer +
                       " (Adam keeps moments of its own)");
  }
  if (const auto problem = task.check(config); !problem.empty()) return usage_error(problem);
  if (resume_checkpoint != nullptr) *resume_checkpoint = std::move(checkpoint);
  return -1;
}

}  // namespace qkv_train
