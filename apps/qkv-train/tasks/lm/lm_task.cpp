// --task lm: a character-level GPT trained on a text with AdamW (warmup, cosine decay, clipping),
// evaluated on the held-out last 10% against the character-bigram baseline, and sampled with the
// KV cache at each evaluation (sampling and --generate: sample.cpp).
//
// B = batch, N = context, V = vocabulary, L = layers, H = heads.
#include "common/plot.h"
#include "run_config.h"
#include "eval_mode.h"
#include "tasks/lm/gpt.h"
#include "tasks/lm/sample.h"
#include "tasks/lm/text_data.h"
#include "tasks/tasks.h"
#include "tasks/toy_data.h"

#include "archive_integrity.h"
#include "atomic_file.h"
#include "torch_file.h"

#include <qkv/qkv.h>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <cmath>
#include <set>
#include <sstream>

namespace qkv_train {
namespace {

using lm::Gpt;
using lm::GptOptions;
using lm::TextData;

constexpr int64_t kMaxValidationWindows = 64;  // of --seq-len characters each
constexpr int64_t kSampleLength = 200;         // characters of the sample at each evaluation

std::string data_path(const RunConfig& config) {
  return config.data_path.empty() ? lm::kDefaultText : config.data_path;
}

// The prompt's ids: --prompt, or the text's default prompt (default_prompt in text_data.h).
torch::Tensor prompt_ids(const RunConfig& config, const TextData& data) {
  const auto text = config.prompt.empty() ? lm::default_prompt(data.text) : lm::decode_utf8(config.prompt, "--prompt");
  return data.tokenizer.encode(text, "--prompt");
}

// The share of the sample's space-separated words that occur as words of the training text.
double known_word_fraction(const std::string& sample, const std::set<std::string>& vocabulary_words) {
  std::stringstream words(sample);
  std::string word;
  int64_t total = 0, known = 0;
  while (words >> word) {
    ++total;
    known += vocabulary_words.count(word);
  }
  return total == 0 ? 0.0 : static_cast<double>(known) / static_cast<double>(total);
}

class LanguageModelTask : public TrainableTask {
 public:
  LanguageModelTask(const RunConfig& config, const torch::Device& device)
      : config_(config),
        device_(device),
        data_(TextData::load(data_path(config), config.seq_len)),
        model_(lm::make_model(config, data_.tokenizer.size(), device)) {
    std::tie(validation_inputs_, validation_targets_) = data_.validation_windows(config.seq_len, kMaxValidationWindows);
    validation_inputs_ = validation_inputs_.to(device);
    validation_targets_ = validation_targets_.to(device);
    bigram_loss_ = lm::bigram_loss(data_, validation_inputs_.cpu(), validation_targets_.cpu());
    std::stringstream words(
        lm::encode_utf8(std::u32string(data_.text.begin(), data_.text.begin() + data_.train.numel())));
    for (std::string word; words >> word;) training_words_.insert(word);
    prompt_ = prompt_ids(config, data_);
    int64_t parameters = 0;
    for (const auto& p : model_->parameters()) parameters += p.numel();
    spdlog::info(
        "lm: {} ({} characters, vocabulary {}; {} train / {} validation), {} parameters; the bigram "
        "baseline's validation loss is {:.4f} nats ({:.3f} bits) per character",
        data_.source, data_.text.size(), data_.tokenizer.size(), data_.train.numel(), data_.validation.numel(),
        parameters, bigram_loss_, bigram_loss_ / std::log(2.0));
    parameter_count_ = parameters;
  }

  torch::nn::Module& model() override { return *model_; }

  void load_weights(const std::string& path) override {
    qkv::load_state_dict(*model_, qkv::read_tensor_dict(path), path);
  }
  void save_weights(const std::string& path) override { qkv::save_state_dict(*model_, path); }

  // AdamW as nanoGPT: weight decay on matrices and embeddings, none on biases and norms.
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(double lr) override {
    std::vector<torch::Tensor> decayed, plain;
    for (const auto& p : model_->parameters()) (p.dim() >= 2 ? decayed : plain).push_back(p);
    auto options = [&](double decay) {
      return std::make_unique<torch::optim::AdamWOptions>(
          torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(decay));
    };
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decayed, options(config_.weight_decay));
    groups.emplace_back(plain, options(0.0));
    return std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(lr));
  }

  // Linear warmup to `lr`, then cosine decay to lr / 10 at the last step.
  double learning_rate(int64_t step, double lr) const override {
    const int64_t warmup = config_.warmup_steps;
    if (step <= warmup) return lr * static_cast<double>(step) / static_cast<double>(std::max<int64_t>(warmup, 1));
    const double progress =
        static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(config_.steps - warmup, 1));
    const double min_lr = lr / 10.0;
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * std::min(progress, 1.0)));
  }

  double max_grad_norm() const override { return config_.grad_clip; }

  torch::Tensor training_loss(int64_t step, const Shard& shard) override {
    auto [inputs, targets] = data_.training_batch(config_.seed, step, config_.batch, config_.seq_len);  // (B, N)
    inputs = inputs.narrow(0, shard.begin, shard.size).to(device_);
    targets = targets.narrow(0, shard.begin, shard.size).to(device_);
    return loss(model_(inputs), targets);
  }

  int64_t tokens_per_step() const override { return config_.batch * config_.seq_len; }

  qkv::AttentionBackend backend() const override {
    return model_->backend_for(torch::empty({config_.batch, config_.seq_len}, torch::kLong));
  }

  std::vector<std::string> evaluation_columns() const override { return {"val_loss", "val_bpc", "bigram_val_loss"}; }

  // Validation loss over the held-out windows, and a sample (logged, and kept for the summary).
  std::vector<double> evaluate() override {
    double validation_loss = 0.0;
    {
      torch::NoGradGuard no_grad;
      const EvalModeGuard eval_mode(*model_);
      const int64_t chunk = std::max<int64_t>(1, config_.batch);
      double total = 0.0;
      for (int64_t begin = 0; begin < validation_inputs_.size(0); begin += chunk) {
        const auto count = std::min(chunk, validation_inputs_.size(0) - begin);
        total += loss(model_(validation_inputs_.narrow(0, begin, count)), validation_targets_.narrow(0, begin, count))
                     .item<double>() *
                 static_cast<double>(count);
      }
      validation_loss = total / static_cast<double>(validation_inputs_.size(0));
    }
    sample_ = sample(kSampleLength);
    words_known_ = known_word_fraction(sample_, training_words_);
    spdlog::info("validation loss {:.4f} nats/char ({:.3f} bits; bigram {:.4f}); sample: {}", validation_loss,
                 validation_loss / std::log(2.0), bigram_loss_, nlohmann::json(sample_).dump());
    return {validation_loss, validation_loss / std::log(2.0), bigram_loss_};
  }

  nlohmann::json summary_extras() override {
    return {{"data",
             {{"source", data_.source},
              {"characters", data_.text.size()},
              {"vocabulary", data_.tokenizer.size()},
              {"train_characters", data_.train.numel()},
              {"validation_characters", data_.validation.numel()},
              {"tokenization", "character (Unicode code point)"}}},
            {"parameters", parameter_count_},
            {"sample",
             {{"prompt", config_.prompt.empty() ? lm::encode_utf8(lm::default_prompt(data_.text)) : config_.prompt},
              {"text", sample_},
              {"known_word_fraction", words_known_}}}};
  }

  std::vector<std::string> write_pictures(const std::filesystem::path& out, const MetricsHistory& history) override {
    write_loss_plot(out / "loss.png", history);
    write_attention_grid(out / "attention.png");
    return {"loss.png", "attention.png"};
  }

  // What --generate needs besides the weights, kept in every checkpoint with them.
  nlohmann::json checkpoint_state() const override {
    return lm::model_metadata(data_.tokenizer, lm::default_prompt(data_.text));
  }

  std::vector<std::string> write_artifacts(const std::filesystem::path& out) override {
    // What a reader of model.pt needs besides the weights: the vocabulary and the model's shape
    // (qkv-train --generate --init-weights model.pt reads them from here).
    auto meta = lm::model_metadata(data_.tokenizer, lm::default_prompt(data_.text));
    meta.update({{"data", data_.source}, {"model", model_options(config_)}, {"dropout", config_.dropout}});
    qkv::detail::write_file_atomically((out / "vocab.json").string(), meta.dump(2) + "\n");
    return {"vocab.json"};
  }

 private:
  // Mean over the B·N predictions; in float32 for half types, else in the model's dtype.
  static torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) {
    const auto flat = logits.reshape({-1, logits.size(-1)});
    return torch::nn::functional::cross_entropy(flat.scalar_type() == torch::kDouble ? flat : flat.to(torch::kFloat),
                                                targets.reshape({-1}));
  }

  // A sample of the current model from the prompt, drawn from its own generator so that
  // evaluation never shifts the training's random stream.
  std::string sample(int64_t length) {
    const int64_t room = config_.seq_len - prompt_.numel();
    if (room <= 0) return "";
    lm::Sampling sampling;
    sampling.temperature = config_.temperature;
    sampling.top_k = config_.top_k > 0 ? std::optional<int64_t>(config_.top_k) : std::nullopt;
    const auto ids =
        lm::generate(model_, prompt_, std::min(length, room), sampling, batch_generator(config_.seed, /*step=*/-2));
    return data_.tokenizer.decode(ids);
  }

  void write_loss_plot(const std::filesystem::path& path, const MetricsHistory& history) const {
    auto series = [&](const std::string& column, const std::string& name, int color) {
      qkv_plot::Series s{name, {}, {}, qkv_plot::series_color(color)};
      for (const auto& [x, y] : history.series(column)) s.x.push_back(x), s.y.push_back(y);
      return s;
    };
    qkv_plot::LinePlot losses{"qkv-train --task lm: cross-entropy",
                              "step",
                              "nats per character",
                              {series("loss", "training", 0), series("val_loss", "validation", 1),
                               series("bigram_val_loss", "bigram baseline (validation)", 2)},
                              false,
                              false,
                              {},
                              {}};
    qkv_plot::write_line_plots(path.string(), {losses});
  }

  // Every head of every layer on the start of the validation text, one grid (rows: layers).
  void write_attention_grid(const std::filesystem::path& path) {
    const int64_t length = std::min<int64_t>(config_.seq_len, 32);  // characters stay legible as tick labels
    const auto snippet = data_.validation.narrow(0, 0, length).unsqueeze(0).to(device_);  // (1, n)
    const auto weights = model_->attention_weights(snippet);                              // L × (1, H, n, n)
    std::vector<std::string> labels;
    for (int64_t i = 0; i < length; ++i) labels.emplace_back(1, data_.tokenizer.label(snippet[0][i].item<int64_t>()));
    std::vector<qkv_plot::Heatmap> panels;
    for (size_t layer = 0; layer < weights.size(); ++layer) {
      const auto w = weights[layer][0].to(torch::kCPU, torch::kFloat).contiguous();  // (H, n, n)
      for (int64_t h = 0; h < w.size(0); ++h) {
        const auto head = w[h].contiguous();
        qkv_plot::Heatmap panel{"layer " + std::to_string(layer) + " head " + std::to_string(h),
                                static_cast<int>(length), static_cast<int>(length),
                                std::vector<float>(head.data_ptr<float>(), head.data_ptr<float>() + head.numel())};
        panel.row_labels = labels;
        panel.col_labels = labels;
        panels.push_back(std::move(panel));
      }
    }
    qkv_plot::write_heatmaps(path.string(),
                             "attention of every head (rows: layers) on the validation text's first characters", panels,
                             "query character", "key character", /*columns=*/static_cast<int>(config_.heads));
  }

  const RunConfig& config_;
  torch::Device device_;
  TextData data_;
  Gpt model_;
  torch::Tensor validation_inputs_, validation_targets_;  // (W, N)
  double bigram_loss_ = 0.0;
  std::set<std::string> training_words_;
  torch::Tensor prompt_;
  std::string sample_;
  double words_known_ = 0.0;
  int64_t parameter_count_ = 0;
};

}  // namespace

std::unique_ptr<TrainableTask> make_lm_task(const RunConfig& config, const torch::Device& device) {
  try {
    return std::make_unique<LanguageModelTask>(config, device);
  } catch (const lm::DataError& e) {
    throw UsageError(e.what());
  }
}

}  // namespace qkv_train
