// reverse and lookup as trained tasks: qkv::SelfAttention on ToyData, MSE loss, and what
// attention learned (the weight on the right key, peakedness, softmax's Jacobian, pictures).
#include "common/plot.h"
#include "eval_mode.h"
#include "tasks/tasks.h"
#include "tasks/toy_data.h"

#include <qkv/qkv.h>

#include <torch/torch.h>

#include <cmath>

namespace qkv_train {
namespace {

class ToyTask : public TrainableTask {
 public:
  ToyTask(const RunConfig& config, const torch::Device& device) : config_(config) {
    const auto dtype = config.dtype();
    data_ = config.task == "reverse" ? make_reverse_data(config.seed, config.seq_len, config.d_model, device, dtype)
                                     : make_lookup_data(config.seed, config.seq_len, config.d_model, device, dtype);
    torch::manual_seed(config.seed);
    model_ =
        qkv::SelfAttention(qkv::SelfAttentionOptions(config.d_model)
                               .num_heads(config.heads)
                               .num_kv_heads(config.kv_heads ? c10::optional<int64_t>(*config.kv_heads) : c10::nullopt)
                               .causal(config.causal)
                               .scale(config.scale ? c10::optional<double>(*config.scale) : c10::nullopt));
    model_->to(device, dtype);
    query_key_parameters_ = model_->W_q->parameters();
    for (const auto& p : model_->W_k->parameters()) query_key_parameters_.push_back(p);
    evaluation_batch_ = data_->sample(std::max<int64_t>(256, config.batch), /*step=*/-1);
  }

  torch::nn::Module& model() override { return *model_; }
  void load_weights(const std::string& path) override { qkv::load_state_dict(model_, path); }
  void save_weights(const std::string& path) override { qkv::save_state_dict(model_, path); }

  std::unique_ptr<torch::optim::Optimizer> make_optimizer(double lr) override {
    if (config_.optimizer == "sgd") {
      return std::make_unique<torch::optim::SGD>(model_->parameters(),
                                                 torch::optim::SGDOptions(lr).momentum(config_.momentum));
    }
    return std::make_unique<torch::optim::Adam>(model_->parameters(), torch::optim::AdamOptions(lr));
  }

  std::string divergence_hint() const override {
    return "lower --lr, or keep the default scale (--scale 1.0 lets scores grow with d_model)";
  }

  torch::Tensor training_loss(int64_t step, const Shard& shard) override {
    auto batch = data_->sample(config_.batch, step);
    if (shard.size != config_.batch) {
      batch.input = batch.input.narrow(0, shard.begin, shard.size);
      batch.target = batch.target.narrow(0, shard.begin, shard.size);
    }
    return data_->loss(model_(batch.input), batch);  // (B, N, E) -> scalar
  }

  int64_t tokens_per_step() const override { return config_.batch * config_.seq_len; }

  qkv::AttentionBackend backend() const override { return model_->backend_for(evaluation_batch_.input); }

  std::vector<std::string> evaluation_columns() const override {
    return {"eval_loss", "eval_answer_weight", "attn_max_weight", "attn_entropy", "softmax_jacobian"};
  }

  std::vector<std::string> evaluation_keys() const override {
    return {"loss", data_->metric_name(), "attn_max_weight", "attn_entropy", "softmax_jacobian"};
  }

  std::vector<double> evaluate() override {
    torch::NoGradGuard no_grad;
    const auto result = [&] {
      const EvalModeGuard eval_mode(*model_);
      return model_->forward_with_weights(evaluation_batch_.input);
    }();
    auto weights = result.weights.to(torch::kFloat);  // (B, H, N, S)
    const double loss = data_->loss(result.output, evaluation_batch_).item<double>();
    const double answer = data_->answer_weight(weights, evaluation_batch_).item<double>();
    const double max_weight = std::get<0>(weights.max(-1)).mean().item<double>();
    const double entropy = -(weights * weights.clamp_min(1e-30).log()).sum(-1).mean().item<double>();
    // Mean Frobenius norm of softmax's Jacobian diag(p) - p pᵀ over the rows: how much gradient
    // passes from the weights back to the scores. Near 0 when softmax saturates (one-hot rows).
    // ||diag(p) - p pᵀ||²_F = Σ p² - 2 Σ p³ + (Σ p²)², row by row.
    const auto p2 = weights.pow(2).sum(-1), p3 = weights.pow(3).sum(-1);
    const double jacobian = (p2 - 2 * p3 + p2.pow(2)).clamp_min(0).sqrt().mean().item<double>();
    example_weights_ = weights[0].cpu();  // (H, N, S)
    return {loss, answer, max_weight, entropy, jacobian};
  }

  std::vector<std::string> gradient_columns() const override { return {"grad_norm_qk"}; }

  std::vector<double> gradient_figures(const qkv::MasterWeights& masters) override {
    double sum = 0;
    for (const auto& p : masters.stepped(query_key_parameters_)) {
      if (p.grad().defined()) sum += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
    }
    return {std::sqrt(sum)};
  }

  std::vector<std::string> write_pictures(const std::filesystem::path& out, const MetricsHistory& history) override {
    auto series = [&](const std::string& column, const std::string& name, int color) {
      qkv_plot::Series s{name, {}, {}, qkv_plot::series_color(color)};
      for (const auto& [x, y] : history.series(column)) s.x.push_back(x), s.y.push_back(y);
      return s;
    };
    const auto metric = data_->metric_name();
    qkv_plot::LinePlot losses{"qkv-train --task " + config_.task + ": loss",
                              "step",
                              "MSE loss (log scale)",
                              {series("loss", "training loss", 0), series("eval_loss", "evaluation loss", 1)},
                              false,
                              true,
                              {},
                              {}};
    qkv_plot::LinePlot attention{"attention on the right key",
                                 "step",
                                 metric,
                                 {series("eval_answer_weight", metric, 2)},
                                 false,
                                 false,
                                 0.0,
                                 1.0};
    qkv_plot::write_line_plots((out / "loss.png").string(), {losses, attention});

    std::vector<qkv_plot::Heatmap> panels;
    const auto& w = example_weights_;  // (H, N, S)
    for (int64_t h = 0; h < w.size(0); ++h) {
      auto head = w[h].contiguous();
      panels.push_back({"head " + std::to_string(h), static_cast<int>(head.size(0)), static_cast<int>(head.size(1)),
                        std::vector<float>(head.data_ptr<float>(), head.data_ptr<float>() + head.numel())});
    }
    qkv_plot::write_heatmaps((out / "attention.png").string(),
                             "attention weights, task " + config_.task + " (one evaluation example)", panels,
                             "query position", "key position");
    return {"loss.png", "attention.png"};
  }

 private:
  RunConfig config_;
  std::unique_ptr<ToyData> data_;
  qkv::SelfAttention model_{nullptr};
  std::vector<torch::Tensor> query_key_parameters_;
  ToyBatch evaluation_batch_;
  torch::Tensor example_weights_;  // (H, N, S) of the last evaluation's first example
};

}  // namespace

std::unique_ptr<TrainableTask> make_toy_task(const RunConfig& config, const torch::Device& device) {
  return std::make_unique<ToyTask>(config, device);
}

}  // namespace qkv_train
