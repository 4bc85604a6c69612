#include "trainer.h"

#include "checkpoint.h"
#include "common/plot.h"
#include "progress.h"
#include "tasks.h"

#include <qkv/qkv.h>

#include <spdlog/spdlog.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace qkv_train {
namespace fs = std::filesystem;

namespace {

std::atomic<int> stop_signal{0};

void on_stop_signal(int signal) { stop_signal.store(signal); }

constexpr const char* kMetricsHeader =
    "step,loss,eval_loss,eval_answer_weight,attn_max_weight,attn_entropy,softmax_jacobian,grad_norm,grad_norm_qk,lr,"
    "tokens_per_s,elapsed_s";

struct MetricsRow {
  int64_t step = 0;
  std::optional<double> loss;  // unset for the evaluation before the first step
  std::optional<double> eval_loss, answer_weight, attn_max, attn_entropy, softmax_jacobian;
  double grad_norm = 0, grad_norm_qk = 0, lr = 0, tokens_per_s = 0, elapsed_s = 0;
};

std::string optional_cell(const std::optional<double>& value) {
  if (!value) return "";
  std::ostringstream text;
  text.precision(8);
  text << *value;
  return text.str();
}

std::string csv_line(const MetricsRow& r) {
  std::ostringstream line;
  line.precision(8);
  line << r.step << ',' << optional_cell(r.loss) << ',' << optional_cell(r.eval_loss) << ',' << optional_cell(r.answer_weight) << ','
       << optional_cell(r.attn_max) << ',' << optional_cell(r.attn_entropy) << ',' << optional_cell(r.softmax_jacobian)
       << ',' << r.grad_norm << ','
       << r.grad_norm_qk << ',' << r.lr << ',' << r.tokens_per_s << ',' << r.elapsed_s;
  return line.str();
}

// Reads back the (step, loss) pairs of an existing metrics.csv up to `last_step`, so that a
// resumed run keeps the history of the run it continues.
std::vector<std::string> read_metrics_lines(const fs::path& path, int64_t last_step) {
  std::vector<std::string> lines;
  std::ifstream file(path);
  std::string line;
  const std::string header = kMetricsHeader;
  std::getline(file, line);  // header
  while (std::getline(file, line)) {
    // A run killed mid-write can leave a partial last line: keep only whole rows up to the checkpoint.
    if (std::count(line.begin(), line.end(), ',') != std::count(header.begin(), header.end(), ',')) continue;
    try {
      if (std::stoll(line.substr(0, line.find(','))) <= last_step) lines.push_back(line);
    } catch (const std::exception&) {
    }
  }
  return lines;
}

double grad_norm(const std::vector<torch::Tensor>& parameters) {
  double sum = 0;
  for (const auto& p : parameters) {
    if (p.grad().defined()) sum += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
  }
  return std::sqrt(sum);
}

struct Evaluation {
  double loss = 0, answer_weight = 0, attn_max = 0, attn_entropy = 0;
  // Mean Frobenius norm of softmax's Jacobian diag(p) - p pᵀ over the rows: how much gradient
  // passes from the weights back to the scores. Near 0 when softmax saturates (one-hot rows).
  double softmax_jacobian = 0;
  torch::Tensor example_weights;  // (H, N, S) of the first example
};

Evaluation evaluate(qkv::SelfAttention& model, const Task& task, const Batch& batch) {
  torch::NoGradGuard no_grad;
  model->eval();
  auto result = model->forward_with_weights(batch.input);
  model->train();
  auto weights = result.weights.to(torch::kFloat);  // (B, H, N, S)
  Evaluation evaluation;
  evaluation.loss = task.loss(result.output, batch).item<double>();
  evaluation.answer_weight = task.answer_weight(weights, batch).item<double>();
  evaluation.attn_max = std::get<0>(weights.max(-1)).mean().item<double>();
  evaluation.attn_entropy = -(weights * weights.clamp_min(1e-30).log()).sum(-1).mean().item<double>();
  // ||diag(p) - p pᵀ||²_F = Σ p² - 2 Σ p³ + (Σ p²)², row by row.
  const auto p2 = weights.pow(2).sum(-1), p3 = weights.pow(3).sum(-1);
  evaluation.softmax_jacobian = (p2 - 2 * p3 + p2.pow(2)).clamp_min(0).sqrt().mean().item<double>();
  evaluation.example_weights = weights[0].cpu();
  return evaluation;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const RunConfig& config, qkv::SelfAttention& model) {
  if (config.optimizer == "sgd") {
    return std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(config.lr));
  }
  return std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(config.lr));
}

void write_text_file(const fs::path& path, const std::string& text) {
  const auto temporary = path.string() + ".tmp";
  {
    std::ofstream file(temporary, std::ios::trunc);
    file << text;
    if (!file) throw std::runtime_error("cannot write " + temporary);
  }
  fs::rename(temporary, path);
}

void write_pictures(const fs::path& out, const RunConfig& config, const std::vector<std::string>& metric_lines,
                    const Evaluation& evaluation, const std::string& metric_name) {
  qkv_plot::Series train{"training loss", {}, {}, qkv_plot::series_color(0)};
  qkv_plot::Series eval{"evaluation loss", {}, {}, qkv_plot::series_color(1)};
  qkv_plot::Series answer{metric_name, {}, {}, qkv_plot::series_color(2)};
  for (const auto& line : metric_lines) {
    std::vector<std::string> cells;
    std::stringstream stream(line);
    std::string cell;
    while (std::getline(stream, cell, ',')) cells.push_back(cell);
    if (cells.size() < 4) continue;
    const double step = std::stod(cells[0]);
    if (!cells[1].empty()) train.x.push_back(step), train.y.push_back(std::stod(cells[1]));
    if (!cells[2].empty()) eval.x.push_back(step), eval.y.push_back(std::stod(cells[2]));
    if (!cells[3].empty()) answer.x.push_back(step), answer.y.push_back(std::stod(cells[3]));
  }
  qkv_plot::LinePlot losses{"qkv-train --task " + config.task + ": loss", "step", "MSE loss (log scale)",
                            {train, eval}, false, true, {}, {}};
  qkv_plot::LinePlot attention{"attention on the right key", "step", metric_name, {answer}, false, false, 0.0, 1.0};
  qkv_plot::write_line_plots((out / "loss.png").string(), {losses, attention});

  std::vector<qkv_plot::Heatmap> panels;
  const auto& w = evaluation.example_weights;  // (H, N, S)
  for (int64_t h = 0; h < w.size(0); ++h) {
    auto head = w[h].contiguous();
    qkv_plot::Heatmap panel{"head " + std::to_string(h), static_cast<int>(head.size(0)),
                            static_cast<int>(head.size(1)),
                            std::vector<float>(head.data_ptr<float>(), head.data_ptr<float>() + head.numel())};
    panels.push_back(std::move(panel));
  }
  qkv_plot::write_heatmaps((out / "attention.png").string(),
                           "attention weights, task " + config.task + " (one evaluation example)", panels,
                           "query position", "key position");
}

}  // namespace

void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

TrainingResult train(const RunConfig& config, const torch::Device& device, DataParallel* parallel) {
  const bool is_main = parallel == nullptr || parallel->is_main();
  const auto task = make_task(config, device);
  const auto dtype = dtype_from_name(config.dtype_name);
  torch::manual_seed(config.seed);
  qkv::SelfAttention model(qkv::SelfAttentionOptions(config.d_model)
                               .num_heads(config.heads)
                               .causal(config.causal)
                               .scale(config.scale ? c10::optional<double>(*config.scale) : c10::nullopt));
  model->to(device, dtype);
  if (!config.init_weights.empty() && config.resume_dir.empty()) {
    qkv::load_state_dict(model, config.init_weights);
    spdlog::info("initial weights from {}", config.init_weights);
  }
  auto optimizer = make_optimizer(config, model);
  const auto parameters = model->parameters();
  std::vector<torch::Tensor> query_key_parameters = model->W_q->parameters();
  for (const auto& p : model->W_k->parameters()) query_key_parameters.push_back(p);

  const fs::path out = is_main ? fs::path(config.out_dir) : fs::path();  // ranks other than 0 write nothing
  if (!out.empty()) {
    std::error_code error;
    fs::create_directories(out, error);
    if (error) throw std::runtime_error("cannot create output folder " + out.string() + ": " + error.message());
  }

  int64_t step = 0;
  std::optional<double> initial_loss;
  double last_loss = 0.0;
  std::vector<std::string> metric_lines;
  if (!config.resume_dir.empty()) {
    auto state = load_checkpoint(config.resume_dir, model, *optimizer);
    step = state.step;
    initial_loss = state.initial_loss;
    last_loss = state.last_loss;
    metric_lines = read_metrics_lines(fs::path(config.resume_dir) / "metrics.csv", step);
    spdlog::info("resumed from {} at step {}", (fs::path(config.resume_dir) / kCheckpointFile).string(), step);
  }
  if (parallel != nullptr) {
    // Replicas start from rank 0's weights, whatever their seeds or files said.
    parallel->broadcast_from_main(parameters);
  }
  std::ofstream metrics;
  if (!out.empty()) {
    metrics.open(out / "metrics.csv", std::ios::trunc);
    if (!metrics) throw std::runtime_error("cannot write " + (out / "metrics.csv").string());
    metrics << kMetricsHeader << '\n';
    for (const auto& line : metric_lines) metrics << line << '\n';
    metrics.flush();
  }

  const auto eval_batch = task->sample(std::max<int64_t>(256, config.batch), /*step=*/-1);
  const auto first_step = step;
  Progress::Mode mode = Progress::Mode::LogLines;
  std::FILE* terminal = config.json ? stderr : stdout;
  if (config.quiet) {
    mode = Progress::Mode::Quiet;
  } else if (isatty(fileno(terminal))) {
    mode = Progress::Mode::Terminal;
  }
  // Throughput counts the whole batch, over all replicas.
  Progress progress(mode, first_step, config.steps, config.batch * config.seq_len, config.log_every, terminal);
  spdlog::info("task {} on {} ({}): d_model {}, heads {}, seq_len {}, batch {}, steps {}, {} lr {}", config.task,
               device.str(), config.dtype_name, config.d_model, config.heads, config.seq_len, config.batch,
               config.steps, config.optimizer, config.lr);
  const auto shard = parallel != nullptr ? shard_of(config.batch, parallel->rank(), parallel->world_size())
                                         : Shard{0, config.batch};

  auto save = [&]() {
    if (!out.empty()) {
      save_checkpoint(out.string(), model, *optimizer, {step, initial_loss.value_or(0.0), last_loss, to_json(config)});
    }
  };

  if (step == 0 && metrics.is_open()) {
    // Where training starts from: attention spread over all keys.
    const auto evaluation = evaluate(model, *task, eval_batch);
    MetricsRow row;
    row.eval_loss = evaluation.loss, row.answer_weight = evaluation.answer_weight;
    row.attn_max = evaluation.attn_max, row.attn_entropy = evaluation.attn_entropy, row.lr = config.lr;
    row.softmax_jacobian = evaluation.softmax_jacobian;
    metric_lines.push_back(csv_line(row));
    metrics << metric_lines.back() << '\n';
  }
  int exit_code = 0;
  while (step < config.steps) {
    ++step;
    // Every replica draws the same batch and trains on its own share of it, so that N replicas
    // compute what one process would on the whole batch.
    auto batch = task->sample(config.batch, step);
    if (shard.size != config.batch) {
      batch.input = batch.input.narrow(0, shard.begin, shard.size);
      batch.target = batch.target.narrow(0, shard.begin, shard.size);
      batch.answer = torch::Tensor();  // evaluation only
    }
    // Forward pass
    optimizer->zero_grad();
    auto output = model(batch.input);  // (B, N, E)
    auto loss = task->loss(output, batch);
    // Backward pass
    loss.backward();
    last_loss = loss.item<double>();
    int stop = stop_signal.load();
    if (parallel != nullptr) {
      // Mean gradient of the whole batch; every replica learns the batch's loss and whether any was told to stop.
      const auto agreed = parallel->average_gradients(parameters, last_loss, stop);
      last_loss = agreed.mean_loss;
      if (agreed.stop_signal != 0 && stop == 0) {
        spdlog::warn("another rank received signal {}: stopping with it", agreed.stop_signal);
      }
      stop = agreed.stop_signal;
    }
    if (!std::isfinite(last_loss)) {
      progress.finish();
      throw TrainingDiverged(fmt::format("step {}: the loss is {}; lower --lr (now {}) or keep the default scale "
                                         "(--scale 1.0 lets scores grow with d_model)",
                                         step, last_loss, config.lr));
    }
    if (!initial_loss) initial_loss = last_loss;
    const bool log_now = step % config.log_every == 0 || step == config.steps;
    MetricsRow row;
    if (log_now && metrics.is_open()) {
      row.grad_norm = grad_norm(parameters);
      row.grad_norm_qk = grad_norm(query_key_parameters);
    }
    // Apply gradients
    optimizer->step();
    progress.update(step, last_loss);

    if (log_now && metrics.is_open()) {
      row.step = step, row.loss = last_loss, row.lr = config.lr;
      row.tokens_per_s = progress.tokens_per_second(), row.elapsed_s = progress.elapsed_seconds();
      if (step % config.eval_every == 0 || step == config.steps) {
        const auto evaluation = evaluate(model, *task, eval_batch);
        row.eval_loss = evaluation.loss, row.answer_weight = evaluation.answer_weight;
        row.attn_max = evaluation.attn_max, row.attn_entropy = evaluation.attn_entropy;
        row.softmax_jacobian = evaluation.softmax_jacobian;
      }
      metric_lines.push_back(csv_line(row));
      metrics << metric_lines.back() << '\n';
      metrics.flush();
    }
    if (config.checkpoint_every > 0 && step % config.checkpoint_every == 0) save();
    if (stop != 0) {
      progress.finish();
      if (is_main) {
        spdlog::warn("stopped by signal {} after step {}{}", stop, step,
                     out.empty() ? " (no --out: nothing saved)" : ", checkpoint written");
      }
      save();
      exit_code = 128 + stop;
      break;
    }
  }
  if (exit_code == 0) progress.finish();
  if (parallel != nullptr && config.save_replicas && !config.out_dir.empty()) {
    std::error_code error;
    fs::create_directories(config.out_dir, error);
    qkv::save_state_dict(model, (fs::path(config.out_dir) / ("replica-" + std::to_string(parallel->rank()) + ".pt")).string());
  }
  // The final evaluation and the summary are rank 0's to report; the other replicas are identical.
  if (!is_main) return {nlohmann::json::object(), exit_code};

  const auto evaluation = evaluate(model, *task, eval_batch);
  nlohmann::json summary = {
      {"task", config.task},
      {"options", to_json(config)},
      {"device", device.str()},
      {"dtype", config.dtype_name},
      {"torch_version", TORCH_VERSION},
      {"qkv_version", QKV_VERSION_STRING},
      {"backend", qkv::to_string(model->last_backend())},
      {"steps", step},
      {"initial_loss", initial_loss.value_or(last_loss)},
      {"final_loss", last_loss},
      {"eval", {{"loss", evaluation.loss}, {task->metric_name(), evaluation.answer_weight},
                {"attn_max_weight", evaluation.attn_max}, {"attn_entropy", evaluation.attn_entropy},
                {"softmax_jacobian", evaluation.softmax_jacobian}}},
      {"wall_time_s", progress.elapsed_seconds()},
      {"steps_per_s", progress.steps_per_second()},
      {"tokens_per_s", progress.tokens_per_second()},
  };
  if (exit_code != 0) summary["stopped_by_signal"] = exit_code - 128;
  if (parallel != nullptr) {
    summary["distributed"] = {{"world_size", parallel->world_size()}, {"backend", parallel->backend()},
                              {"examples_per_rank", shard.size}};
  }
  if (!out.empty()) {
    if (exit_code == 0) save();
    // The trained weights in PyTorch's format: SelfAttention(d).load_state_dict(torch.load(path)).
    qkv::save_state_dict(model, (out / "model.pt").string());
    write_text_file(out / "summary.json", summary.dump(2) + "\n");
    write_pictures(out, config, metric_lines, evaluation, task->metric_name());
  }
  return {summary, exit_code};
}

}  // namespace qkv_train
