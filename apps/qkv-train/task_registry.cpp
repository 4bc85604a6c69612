// The table of qkv-train's tasks. Each row: name, description, defaults, the options it reads,
// its checks, and its entry point in tasks/.
#include "task_registry.h"

#include "tasks/tasks.h"

#include <algorithm>
#include <stdexcept>

namespace qkv_train {
namespace {

// The options of every trained task: checkpoints, resume, initial weights, data parallelism.
const std::vector<std::string> kTrainedFlags{"--batch",        "--steps",        "--lr",    "--dtype", "--precision",
                                             "--log-every",    "--eval-every",   "--out",   "--checkpoint-every",
                                             "--resume",       "--init-weights", "--nproc", "--dist-backend",
                                             "--dist-timeout", "--save-replicas"};

std::vector<std::string> with_trained_flags(std::vector<std::string> flags) {
  flags.insert(flags.end(), kTrainedFlags.begin(), kTrainedFlags.end());
  return flags;
}

std::string divisible_heads(const RunConfig& c) {
  if (c.d_model % c.heads != 0) {
    return "--d-model " + std::to_string(c.d_model) + " is not divisible by --heads " + std::to_string(c.heads);
  }
  if (c.kv_heads && (*c.kv_heads < 1 || c.heads % *c.kv_heads != 0)) {
    return "--kv-heads " + std::to_string(*c.kv_heads) + " must divide --heads " + std::to_string(c.heads);
  }
  return "";
}

std::vector<TaskSpec> make_registry() {
  std::vector<TaskSpec> tasks;

  TaskSpec seed;
  seed.name = "seed";
  seed.description = "the documents' example: SelfAttention(8) on torch.randn(4, 8), MSE loss, backward";
  seed.defaults = {/*d_model=*/8, /*heads=*/1, /*seq_len=*/4, /*batch=*/1, /*steps=*/1, /*lr=*/0.01, 1, 1};
  seed.flags = {"--d-model", "--seq-len", "--steps", "--lr", "--init-weights", "--precision"};
  seed.check = [](const RunConfig&) { return std::string(); };
  seed.run = run_seed_task;
  tasks.push_back(seed);

  TaskSpec reverse;
  reverse.name = "reverse";
  reverse.description = "output position i copies input position N-1-i (attention learns the anti-diagonal)";
  reverse.defaults = {48, 1, 16, 64, 800, 0.01, 50, 100};
  reverse.flags =
      with_trained_flags({"--d-model", "--heads", "--kv-heads", "--seq-len", "--optimizer", "--momentum", "--causal",
                          "--scale"});
  reverse.check = [](const RunConfig& c) -> std::string {
    if (c.d_model <= c.seq_len) {
      return "--task reverse needs --d-model > --seq-len (each token is content plus a one-hot position), got "
             "d_model " +
             std::to_string(c.d_model) + " and seq_len " + std::to_string(c.seq_len);
    }
    return divisible_heads(c);
  };
  reverse.make = make_toy_task;
  tasks.push_back(reverse);

  TaskSpec lookup = reverse;
  lookup.name = "lookup";
  lookup.description = "recall the value stored under the query's key (attention by content)";
  lookup.defaults = {33, 1, 17, 64, 2000, 0.003, 100, 200};
  lookup.check = [](const RunConfig& c) -> std::string {
    if (c.d_model < 3 || c.seq_len < 2) {
      return "--task lookup needs --d-model >= 3 (key, value, query flag) and --seq-len >= 2 (an item and the query)";
    }
    return divisible_heads(c);
  };
  tasks.push_back(lookup);

  TaskSpec scaling;
  scaling.name = "scaling";
  scaling.description = "the documents' experiment for 1/sqrt(d_k): Var(q.k), saturation, gradients, training";
  scaling.defaults = {256, 1, 16, 32, 300, 0.01, 50, 50};
  scaling.flags = {"--d-model", "--heads", "--seq-len", "--batch", "--steps", "--lr", "--dtype", "--precision", "--out"};
  scaling.check = [](const RunConfig& c) -> std::string {
    if (c.d_model <= c.seq_len) return "--task scaling trains reverse and needs --d-model > --seq-len";
    return divisible_heads(c);
  };
  scaling.run = run_scaling_task;
  tasks.push_back(scaling);

  TaskSpec lm;
  lm.name = "lm";
  lm.description = "a character-level GPT of TransformerBlocks on a text (--data), then sampled (--generate)";
  // Sized to finish within 10 minutes on the 2-core development machine (README, "Training demo").
  lm.defaults = {/*d_model=*/128, /*heads=*/4, /*seq_len=*/256, /*batch=*/16, /*steps=*/1200, /*lr=*/2e-3,
                 /*log_every=*/50, /*eval_every=*/200};
  lm.defaults.layers = 4;
  lm.defaults.warmup_steps = 100;
  lm.defaults.dropout = 0.1;
  lm.defaults.all_cores = true;  // its matrix products gain 1.6x from the second core here
  lm.defaults.causal = true;     // a decoder
  lm.defaults.optimizer = "adamw";
  lm.flags = with_trained_flags({"--data", "--d-model", "--heads", "--kv-heads", "--layers", "--seq-len", "--dropout",
                                 "--weight-decay", "--warmup-steps", "--grad-clip", "--tie-weights", "--window",
                                 "--checkpoint-activations", "--generate",
                                 "--prompt", "--max-new-tokens", "--temperature", "--top-k", "--no-kv-cache"});
  lm.check = [](const RunConfig& c) -> std::string {
    if (const auto problem = divisible_heads(c); !problem.empty()) return problem;
    if ((c.d_model / c.heads) % 2 != 0) {
      return "--task lm uses rotary positions, which need an even head width --d-model / --heads, got " +
             std::to_string(c.d_model / c.heads);
    }
    if (c.generate && c.resume_dir.empty() && c.init_weights.empty()) {
      return "--generate needs a trained model: --resume DIR (a qkv-train --task lm --out folder) or --init-weights "
             "FILE";
    }
    if (c.generate && c.nproc > 1) return "--generate runs in one process; leave out --nproc";
    return "";
  };
  lm.make = make_lm_task;
  tasks.push_back(lm);
  return tasks;
}

}  // namespace

bool TaskSpec::reads(const std::string& flag) const {
  const auto& common = common_flags();
  return std::find(common.begin(), common.end(), flag) != common.end() ||
         std::find(flags.begin(), flags.end(), flag) != flags.end();
}

const std::vector<TaskSpec>& task_registry() {
  static const std::vector<TaskSpec> tasks = make_registry();
  return tasks;
}

const TaskSpec& find_task(const std::string& name) {
  for (const auto& task : task_registry()) {
    if (task.name == name) return task;
  }
  std::string known;
  for (const auto& task : task_registry()) known += (known.empty() ? "" : ", ") + task.name;
  throw std::invalid_argument("no task named " + name + " (tasks: " + known + ")");
}

const std::vector<std::string>& common_flags() {
  static const std::vector<std::string> flags{"--task", "--device", "--seed",     "--threads",
                                              "--json", "--quiet",  "--log-level"};
  return flags;
}

void apply_task_defaults(RunConfig& config) {
  const auto& d = find_task(config.task).defaults;
  if (config.d_model == 0) config.d_model = d.d_model;
  if (config.heads == 0) config.heads = d.heads;
  if (config.seq_len == 0) config.seq_len = d.seq_len;
  if (config.batch == 0) config.batch = d.batch;
  if (config.steps == 0) config.steps = d.steps;
  if (config.lr == 0.0) config.lr = d.lr;
  if (config.log_every == 0) config.log_every = d.log_every;
  if (config.eval_every == 0) config.eval_every = d.eval_every;
  if (config.layers == 0) config.layers = d.layers;
  if (config.warmup_steps < 0) config.warmup_steps = d.warmup_steps;
  if (config.dropout < 0) config.dropout = d.dropout;
  if (d.causal) config.causal = *d.causal;
  if (!d.optimizer.empty()) config.optimizer = d.optimizer;
}

}  // namespace qkv_train
