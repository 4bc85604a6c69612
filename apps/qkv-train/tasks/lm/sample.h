// Sampling text from the character-level GPT, as nanoGPT's sample.py beside its model.py: the
// generation loop, and what qkv-train --generate needs to rebuild a trained model from its folder
// alone (the checkpoint's weights, options and vocabulary, or vocab.json beside a model.pt).
#pragma once

#include "run_config.h"
#include "tasks/lm/gpt.h"
#include "tasks/lm/text_data.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>

namespace qkv_train::lm {

/// Sampling settings of generate().
struct Sampling {
  double temperature = 0.8;  // 0: greedy (the most likely token)
  std::optional<int64_t> top_k;
  bool use_cache = true;  // false: recompute the visible window for every new token
};

/// Continues `prompt` (P,) by `new_tokens` tokens, any number of them; returns the new ids
/// (new_tokens,). Random draws come from `generator` only.
///
/// The context slides: the model sees at most its context of C positions. A longer prompt is cut
/// to its last C tokens; when the sequence then outgrows C, the window restarts from the newest
/// max(1, C / 2) tokens (RoPE positions count from the window's start). With the KV cache the
/// caches are re-filled with those tokens (one prefill, then one token at a time again); without
/// it the same window is recomputed for every token, so both give the same tokens. A model with a
/// sliding window does not slide: its caches roll (constant memory at any length), and without
/// them the whole sequence is recomputed.
torch::Tensor generate(Gpt& model, const torch::Tensor& prompt, int64_t new_tokens, const Sampling& sampling,
                       at::Generator generator);

/// The language model of these options (--d-model, --heads, ... of `config`) for `vocabulary`
/// characters, freshly initialised from config.seed, on `device` in config's dtype.
Gpt make_model(const RunConfig& config, int64_t vocabulary, const torch::Device& device);

/// What a trained model carries beside its weights (the checkpoint's task state and vocab.json):
/// the vocabulary and the prompt generation starts from by default.
nlohmann::json model_metadata(const CharTokenizer& tokenizer, const std::u32string& default_prompt);

}  // namespace qkv_train::lm
