// Generation from the language model: the sampling loop with its sliding context, and
// qkv-train --generate, which rebuilds a trained model from its run folder alone.
//
// P = prompt tokens, C = the model's context, V = vocabulary.
#include "tasks/lm/sample.h"

#include "checkpoint.h"
#include "eval_mode.h"
#include "resources.h"
#include "tasks/tasks.h"
#include "torch_compat.h"

#include <qkv/qkv.h>

#include <spdlog/spdlog.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>

namespace qkv_train {
namespace lm {
namespace {

// The next token from the logits (V,) of the last position.
int64_t pick(const torch::Tensor& logits, const Sampling& sampling, at::Generator& generator) {
  if (sampling.temperature <= 0.0) return logits.argmax().item<int64_t>();
  auto scaled = logits.to(torch::kDouble) / sampling.temperature;  // (V,)
  if (sampling.top_k && *sampling.top_k < scaled.size(0)) {
    const auto threshold = std::get<0>(scaled.topk(*sampling.top_k)).min();
    scaled = scaled.masked_fill(scaled < threshold, -std::numeric_limits<double>::infinity());
  }
  const auto probabilities = torch::softmax(scaled, /*dim=*/0).to(torch::kCPU);
  return at::multinomial(probabilities, /*num_samples=*/1, /*replacement=*/false, generator).item<int64_t>();
}

}  // namespace

torch::Tensor generate(Gpt& model, const torch::Tensor& prompt, int64_t new_tokens, const Sampling& sampling,
                       at::Generator generator) {
  TORCH_CHECK(prompt.dim() == 1 && prompt.numel() >= 1, "generate: expected a non-empty prompt of token ids");
  TORCH_CHECK(new_tokens >= 0, "generate: expected new_tokens >= 0, got ", new_tokens);
  // Inference mode, not only no-grad: a cached step is ~150 small operations, and skipping autograd's
  // bookkeeping (version counters, views' metadata) is a measurable part of each one.
  const qkv::compat::InferenceModeGuard inference;
  const EvalModeGuard eval_mode(*model);
  // A model with a sliding window never slides a context: its caches roll, and without them the
  // whole sequence is recomputed (the window bounds what each position sees, at any length).
  const bool windowed = model->options.window().has_value();
  const int64_t context = windowed ? std::numeric_limits<int64_t>::max() : model->options.context();
  const int64_t kept_on_slide = std::max<int64_t>(1, model->options.context() / 2);
  const auto device = model->token_embedding->weight.device();
  auto sequence = prompt.to(device, torch::kLong).unsqueeze(0);  // (1, P + i)
  int64_t window_start = std::max<int64_t>(0, sequence.size(1) - context);
  std::vector<int64_t> produced;
  std::vector<qkv::KVCache> caches;
  if (sampling.use_cache) caches = model->make_caches(/*batch=*/1);
  int64_t cached = 0;  // tokens of the window the caches hold
  for (int64_t i = 0; i < new_tokens; ++i) {
    const int64_t length = sequence.size(1);
    if (length - window_start > context) {  // the window slides: restart it from the newest tokens
      window_start = length - kept_on_slide;
      for (auto& cache : caches) cache.reset();
      cached = 0;
    }
    torch::Tensor logits;  // (1, T, V)
    if (sampling.use_cache) {
      logits = model->forward_with_cache(sequence.narrow(1, window_start + cached, length - window_start - cached),
                                         caches);
      cached = length - window_start;
    } else {
      logits = model->forward(sequence.narrow(1, window_start, length - window_start));
    }
    const int64_t token = pick(logits[0][-1], sampling, generator);
    produced.push_back(token);
    sequence = torch::cat({sequence, torch::full({1, 1}, token, sequence.options())}, /*dim=*/1);
  }
  return torch::tensor(produced, torch::kLong);
}

Gpt make_model(const RunConfig& config, int64_t vocabulary, const torch::Device& device) {
  torch::manual_seed(config.seed);
  Gpt model(GptOptions(vocabulary, config.d_model, config.heads, config.layers, config.seq_len)
                .kv_heads(config.kv_heads ? c10::optional<int64_t>(*config.kv_heads) : c10::nullopt)
                .dropout(config.dropout)
                .tie_weights(config.tie_weights)
                .window(config.window ? c10::optional<int64_t>(*config.window) : c10::nullopt)
                .checkpoint(config.checkpoint_activations));
  model->to(device, config.dtype());
  return model;
}

nlohmann::json model_metadata(const CharTokenizer& tokenizer, const std::u32string& default_prompt) {
  return {{"vocabulary", encode_utf8(tokenizer.characters())}, {"default_prompt", encode_utf8(default_prompt)}};
}

namespace {

namespace fs = std::filesystem;

// A trained model and what it needs to read and write text.
struct TrainedModel {
  Gpt model{nullptr};
  std::optional<CharTokenizer> tokenizer;
  std::string default_prompt;
  std::string weights;  // where the weights came from
};

nlohmann::json read_json(const fs::path& path, const std::string& what) {
  std::ifstream file(path);
  if (!file) throw UsageError(what + ": expected " + path.string() + " (qkv-train --task lm writes it)");
  try {
    return nlohmann::json::parse(file);
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(what + ": " + path.string() + " is not valid JSON: " + e.what());
  }
}

// The vocabulary and default prompt of `metadata` (a checkpoint's task state or vocab.json).
void take_metadata(TrainedModel& trained, const nlohmann::json& metadata, const std::string& source) {
  if (!metadata.contains("vocabulary") || !metadata.at("vocabulary").is_string()) {
    throw UsageError(source + " holds no vocabulary");
  }
  const auto characters = decode_utf8(metadata.at("vocabulary").get<std::string>(), source + "'s vocabulary");
  trained.tokenizer.emplace(characters);
  trained.default_prompt = metadata.value("default_prompt", std::string("\n"));
}

// --resume DIR: weights, options and vocabulary all from DIR/checkpoint.pt (one file written at
// once, so they belong together; the options are already in `config`, see cli.cpp). A checkpoint
// of an older qkv-train has no vocabulary in it: then DIR/vocab.json gives it.
TrainedModel from_checkpoint(const RunConfig& config, CheckpointFile checkpoint, const torch::Device& device) {
  TrainedModel trained;
  const auto& state = checkpoint.state();
  if (state.task_state.contains("vocabulary")) {
    take_metadata(trained, state.task_state, checkpoint.path());
  } else {
    const auto vocab = fs::path(config.resume_dir) / "vocab.json";
    take_metadata(trained, read_json(vocab, "--generate --resume"), vocab.string());
  }
  trained.model = make_model(config, trained.tokenizer->size(), device);
  trained.weights = checkpoint.path();
  load_checkpoint_model(std::move(checkpoint), *trained.model);
  return trained;
}

// --init-weights FILE: the weights of FILE, the options and vocabulary of the vocab.json beside it.
TrainedModel from_weights_file(RunConfig config, const torch::Device& device) {
  TrainedModel trained;
  const auto vocab = fs::path(config.init_weights).parent_path() / "vocab.json";
  const auto metadata = read_json(vocab, "--generate --init-weights " + config.init_weights);
  take_metadata(trained, metadata, vocab.string());
  if (metadata.contains("model")) take_unset_options(config, metadata.at("model"), [](const char*) { return false; });
  trained.model = make_model(config, trained.tokenizer->size(), device);
  qkv::load_state_dict(*trained.model, qkv::read_tensor_dict(config.init_weights), config.init_weights);
  trained.weights = config.init_weights;
  return trained;
}

}  // namespace
}  // namespace lm

nlohmann::json run_lm_generation(const RunConfig& config, const torch::Device& device,
                                 std::optional<CheckpointFile> resume) {
  if (!config.resume_dir.empty() && !resume) resume.emplace(config.resume_dir);
  auto trained =
      resume ? lm::from_checkpoint(config, std::move(*resume), device) : lm::from_weights_file(config, device);
  const auto prompt_text = config.prompt.empty() ? trained.default_prompt : config.prompt;
  torch::Tensor prompt;
  try {
    prompt = trained.tokenizer->encode(lm::decode_utf8(prompt_text, "--prompt"), "--prompt");
  } catch (const lm::DataError& e) {
    throw UsageError(e.what());
  }
  lm::Sampling sampling;
  sampling.temperature = config.temperature;
  sampling.top_k = config.top_k > 0 ? std::optional<int64_t>(config.top_k) : std::nullopt;
  sampling.use_cache = !config.no_kv_cache;
  const auto start = std::chrono::steady_clock::now();
  const auto ids = lm::generate(trained.model, prompt, config.max_new_tokens, sampling,
                                at::make_generator<at::CPUGeneratorImpl>(config.seed));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto text = trained.tokenizer->decode(ids);
  spdlog::info("generated {} characters in {:.3f} s ({:.0f} tokens/s, {})", ids.numel(), seconds,
               static_cast<double>(ids.numel()) / seconds, sampling.use_cache ? "KV cache" : "no cache");
  if (!config.json) std::cout << prompt_text << text << std::endl;
  return {{"task", "lm"},
          {"mode", "generate"},
          {"weights", trained.weights},
          {"prompt", prompt_text},
          {"text", text},
          {"new_tokens", ids.numel()},
          {"seconds", seconds},
          {"tokens_per_s", static_cast<double>(ids.numel()) / std::max(seconds, 1e-9)},
          {"kv_cache", sampling.use_cache},
          {"context", trained.model->options.context()},
          {"window", trained.model->options.window() ? nlohmann::json(*trained.model->options.window()) : nlohmann::json()},
          {"peak_rss_mb", peak_resident_megabytes()},
          {"temperature", config.temperature},
          {"seed", config.seed}};
}

}  // namespace qkv_train
