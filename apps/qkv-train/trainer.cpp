// The training loop, as labelled steps: set up, resume, then per step forward / backward /
// all-reduce / clip / apply gradients, record, evaluate, checkpoint; finally report.
#include "trainer.h"

#include "checkpoint.h"
#include "progress.h"
#include "resources.h"
#include "run_precision.h"
#include "stop_signals.h"
#include "task_registry.h"

#include "atomic_file.h"

#include <qkv/functional.h>
#include <qkv/precision.h>
#include <qkv/version.h>

#include <spdlog/spdlog.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

namespace qkv_train {
namespace fs = std::filesystem;

std::vector<std::pair<double, double>> MetricsHistory::series(const std::string& column) const {
  std::vector<std::pair<double, double>> points;
  const auto at = std::find(columns.begin(), columns.end(), column);
  if (at == columns.end()) return points;
  const auto index = static_cast<size_t>(at - columns.begin());
  // A cell that is not a number (a resumed run's metrics.csv edited or damaged) is no point.
  const auto number = [](const std::string& cell) -> std::optional<double> {
    char* end = nullptr;
    const double value = std::strtod(cell.c_str(), &end);
    if (cell.empty() || end != cell.c_str() + cell.size()) return std::nullopt;
    return value;
  };
  for (const auto& row : rows) {
    if (index >= row.size()) continue;
    const auto step = number(row[0]), value = number(row[index]);
    if (step && value) points.emplace_back(*step, *value);
  }
  return points;
}

namespace {

// Every digit a double needs to read back exactly: losses are compared with other runs and with
// PyTorch to 1e-8.
std::string number_cell(double value) {
  std::ostringstream text;
  text.precision(std::numeric_limits<double>::max_digits10);
  text << value;
  return text.str();
}

std::vector<std::string> split_cells(const std::string& line) {
  std::vector<std::string> cells;
  std::stringstream stream(line);
  std::string cell;
  while (std::getline(stream, cell, ',')) cells.push_back(cell);
  if (!line.empty() && line.back() == ',') cells.emplace_back();
  return cells;
}

std::string join_cells(const std::vector<std::string>& cells) {
  std::string line;
  for (size_t i = 0; i < cells.size(); ++i) line += (i ? "," : "") + cells[i];
  return line;
}

double global_grad_norm(const std::vector<torch::Tensor>& parameters) {
  double sum = 0;
  for (const auto& p : parameters) {
    if (p.grad().defined()) sum += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
  }
  return std::sqrt(sum);
}

class Trainer {
 public:
  Trainer(const RunConfig& config, const torch::Device& device, DataParallel* parallel,
          std::optional<CheckpointFile> resume)
      : config_(config),
        device_(device),
        parallel_(parallel),
        is_main_(parallel == nullptr || parallel->is_main()),
        precision_(config, device),  // refuses a precision autocast cannot run here, before the task loads its data
        out_(is_main_ ? fs::path(config.out_dir) : fs::path()),  // ranks other than 0 write nothing
        task_(find_task(config.task).make(config, device)),
        optimizer_(task_->make_optimizer(config.lr)),
        masters_(task_->model(), *optimizer_),  // --dtype bfloat16: the optimizer steps on float32 copies
        stepped_parameters_(masters_.stepped(task_->model().parameters())),
        parameters_(task_->model().parameters()),
        shard_(parallel != nullptr ? shard_of(config.batch, parallel->rank(), parallel->world_size())
                                   : Shard{0, config.batch}),
        resume_(std::move(resume)) {}

  TrainingResult run() {
    create_output_folder();
    start_or_resume();
    open_metrics();
    if (step_ == 0 && metrics_.is_open()) record_row(/*trained=*/false, /*loss=*/std::nullopt, /*gradients=*/{});
    auto progress = make_progress();
    spdlog::info("task {} on {} ({}): {} steps of batch {}, lr {}", config_.task, device_.str(), config_.dtype_name,
                 config_.steps, config_.batch, config_.lr);
    int exit_code = 0;
    while (step_ < config_.steps) {
      ++step_;
      const int stop = train_step(*progress);
      if (config_.checkpoint_every > 0 && step_ % config_.checkpoint_every == 0) save_checkpoint();
      if (stop != 0) {
        progress->finish();
        if (is_main_) {
          spdlog::warn("stopped by signal {} after step {}{}", stop, step_,
                       out_.empty() ? " (no --out: nothing saved)" : ", checkpoint written");
        }
        save_checkpoint();
        exit_code = 128 + stop;
        break;
      }
    }
    if (exit_code == 0) progress->finish();
    return report(exit_code, *progress);
  }

 private:
  void create_output_folder() {
    if (out_.empty()) return;
    std::error_code error;
    fs::create_directories(out_, error);
    if (error) throw std::runtime_error("cannot create output folder " + out_.string() + ": " + error.message());
  }

  // Where training starts: --init-weights, or the checkpoint of --resume (model, optimizer, RNG,
  // step and the metrics so far). Replicas then take rank 0's weights, whatever their files said.
  void start_or_resume() {
    if (!config_.init_weights.empty() && config_.resume_dir.empty()) {
      task_->load_weights(config_.init_weights);
      spdlog::info("initial weights from {}", config_.init_weights);
    }
    if (!config_.resume_dir.empty()) {
      if (!resume_) resume_.emplace(config_.resume_dir);
      // Consumed: its bytes go with the load.
      const auto state =
          load_checkpoint(std::move(*resume_), task_->model(), *optimizer_, precision_.scaler(), &masters_);
      step_ = state.step;
      initial_loss_ = state.initial_loss;
      last_loss_ = state.last_loss;
      read_metrics_history(fs::path(config_.resume_dir) / "metrics.csv");
      spdlog::info("resumed from {} at step {}", (fs::path(config_.resume_dir) / kCheckpointFile).string(), step_);
    }
    if (parallel_ != nullptr) parallel_->broadcast_from_main(parameters_);
    if (config_.resume_dir.empty()) masters_.copy_from_model();  // a resumed run's come from its checkpoint
    // Where a fresh run starts, so that a reference implementation can start from the same point
    // (scripts/lm_pytorch.py does).
    if (step_ == 0 && !out_.empty()) task_->save_weights((out_ / "model_init.pt").string());
    first_step_ = step_;
  }

  std::vector<std::string> columns() const {
    std::vector<std::string> columns{"step", "loss"};
    for (const auto& c : task_->evaluation_columns()) columns.push_back(c);
    columns.push_back("grad_norm");
    for (const auto& c : task_->gradient_columns()) columns.push_back(c);
    for (const char* c : {"lr", "tokens_per_s", "elapsed_s", "loss_scale", "precision"}) columns.emplace_back(c);
    return columns;
  }

  // The rows of a resumed run's metrics.csv up to its checkpoint's step. A run killed mid-write
  // can leave a partial last line: only whole rows are kept.
  void read_metrics_history(const fs::path& path) {
    history_.columns = columns();
    std::ifstream file(path);
    std::string line;
    std::getline(file, line);  // header
    while (std::getline(file, line)) {
      auto cells = split_cells(line);
      if (cells.size() != history_.columns.size()) continue;
      try {
        if (std::stoll(cells[0]) <= step_) history_.rows.push_back(std::move(cells));
      } catch (const std::exception&) {
      }
    }
  }

  // The header and the rows a resumed run keeps are written as a new file, atomically (a crash
  // now cannot lose the rows already recorded, as rewriting it in place could); the steps to come
  // are appended to it.
  void open_metrics() {
    history_.columns = columns();
    if (out_.empty()) return;
    const auto path = out_ / "metrics.csv";
    std::string text = join_cells(history_.columns) + '\n';
    for (const auto& row : history_.rows) text += join_cells(row) + '\n';
    qkv::detail::write_file_atomically(path.string(), text);
    metrics_.open(path, std::ios::app);
    if (!metrics_) throw std::runtime_error("cannot write " + path.string());
  }

  std::unique_ptr<Progress> make_progress() const {
    Progress::Mode mode = Progress::Mode::LogLines;
    std::FILE* terminal = config_.json ? stderr : stdout;
    if (config_.quiet || !is_main_) {
      mode = Progress::Mode::Quiet;
    } else if (isatty(fileno(terminal))) {
      mode = Progress::Mode::Terminal;
    }
    // Throughput counts the whole batch, over all replicas.
    return std::make_unique<Progress>(mode, first_step_, config_.steps, task_->tokens_per_step(), config_.log_every,
                                      terminal);
  }

  // One optimizer step; returns the stop signal the ranks agreed on (0: go on).
  int train_step(Progress& progress) {
    const double lr = task_->learning_rate(step_, config_.lr);
    for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
    // Forward pass (in the run's precision: autocast for bf16-mixed / fp16-mixed)
    optimizer_->zero_grad();
    torch::Tensor loss;
    {
      const auto precision = precision_.autocast();
      loss = task_->training_loss(step_, shard_);
    }
    // Backward pass (of the scaled loss with fp16-mixed, so that small gradients stay representable)
    precision_.scaler().scale(loss).backward();
    last_loss_ = loss.item<double>();
    int stop = stop_signal_received();
    if (parallel_ != nullptr) {
      // Mean gradient of the whole batch; every replica learns the batch's loss and whether any was told to stop.
      const auto agreed = parallel_->average_gradients(parameters_, last_loss_, stop);
      last_loss_ = agreed.mean_loss;
      if (agreed.stop_signal != 0 && stop == 0)
        spdlog::warn("another rank received signal {}: stopping with it", agreed.stop_signal);
      stop = agreed.stop_signal;
    }
    if (!std::isfinite(last_loss_)) {
      progress.finish();
      throw TrainingDiverged(fmt::format("step {}: the loss is {}; {} (--lr is {})", step_, last_loss_,
                                         task_->divergence_hint(), config_.lr));
    }
    if (!initial_loss_) initial_loss_ = last_loss_;
    masters_.gradients_to_masters();  // from here on the optimizer's gradients (the model's are released)
    // True gradients from here on (fp16-mixed: divided by the loss scale, inf/NaN recorded).
    precision_.scaler().unscale_(*optimizer_);
    const bool log_now = step_ % config_.log_every == 0 || step_ == config_.steps;
    std::vector<double> gradients;  // the logged figures: the global norm before clipping, then the task's
    if (log_now && is_main_) {
      gradients.push_back(0.0);
      for (double figure : task_->gradient_figures(masters_)) gradients.push_back(figure);
    }
    // Clipping computes the global norm anyway: a logged step takes it from there rather than
    // walking every gradient once more (a step of the lm logged every step was 1-3% slower).
    const bool clipping = task_->max_grad_norm() > 0;
    const double norm = clipping ? torch::nn::utils::clip_grad_norm_(stepped_parameters_, task_->max_grad_norm())
                        : !gradients.empty() ? global_grad_norm(stepped_parameters_)
                                             : 0.0;
    if (!gradients.empty()) gradients[0] = norm;
    // Apply gradients (fp16-mixed: skipped when a gradient overflowed, and the scale backs off)
    if (!precision_.scaler().step(*optimizer_)) {
      spdlog::debug("step {}: gradients hold inf/NaN at loss scale {}: step skipped", step_,
                    precision_.scaler().get_scale());
    }
    precision_.scaler().update();
    masters_.masters_to_model();
    progress.update(step_, last_loss_);
    if (log_now && is_main_) {
      tokens_per_s_ = progress.tokens_per_second(), elapsed_s_ = progress.elapsed_seconds(), lr_ = lr;
      record_row(/*trained=*/true, last_loss_, gradients, &progress);
    }
    return stop;
  }

  // The task's evaluation of the model at this step (computed once per step), its time left out
  // of the training's pace.
  const std::vector<double>& evaluation(Progress* progress) {
    if (!last_evaluation_ || last_evaluation_->first != step_) {
      const auto start = std::chrono::steady_clock::now();
      const auto precision = precision_.autocast();  // evaluated in the precision it trains in
      last_evaluation_.emplace(step_, task_->evaluate());
      if (progress != nullptr) {
        progress->exclude(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
    }
    return last_evaluation_->second;
  }

  // A metrics.csv row: the step's loss and gradients, and an evaluation on evaluation steps.
  void record_row(bool trained, std::optional<double> loss, const std::vector<double>& gradients,
                  Progress* progress = nullptr) {
    if (!is_main_) return;
    std::vector<std::string> row{std::to_string(step_), loss ? number_cell(*loss) : ""};
    const auto evaluation_names = task_->evaluation_columns();
    if (!trained || step_ % config_.eval_every == 0 || step_ == config_.steps) {
      for (double figure : evaluation(progress)) row.push_back(number_cell(figure));
    } else {
      row.insert(row.end(), evaluation_names.size(), "");
    }
    const size_t gradient_count = 1 + task_->gradient_columns().size();
    for (size_t i = 0; i < gradient_count; ++i) row.push_back(i < gradients.size() ? number_cell(gradients[i]) : "0");
    row.push_back(number_cell(trained ? lr_ : config_.lr));
    row.push_back(number_cell(trained ? tokens_per_s_ : 0.0));
    row.push_back(number_cell(trained ? elapsed_s_ : 0.0));
    row.push_back(number_cell(precision_.scaler().get_scale()));
    row.push_back(config_.precision);
    history_.rows.push_back(row);
    if (metrics_.is_open()) {
      metrics_ << join_cells(row) << '\n';
      metrics_.flush();
    }
  }

  void save_checkpoint() {
    if (out_.empty()) return;
    qkv_train::save_checkpoint(out_.string(), task_->model(), *optimizer_, precision_.scaler(),
                               {step_, initial_loss_.value_or(0.0), last_loss_, to_json(config_),
                                task_->checkpoint_state()},
                               &masters_);
  }

  // The end of a run: rank 0 evaluates, writes the summary, the weights for Python and the
  // pictures; every rank writes its replica when asked.
  TrainingResult report(int exit_code, const Progress& progress) {
    if (parallel_ != nullptr && config_.save_replicas && !config_.out_dir.empty()) {
      std::error_code error;
      fs::create_directories(config_.out_dir, error);
      task_->save_weights(
          (fs::path(config_.out_dir) / ("replica-" + std::to_string(parallel_->rank()) + ".pt")).string());
    }
    if (!is_main_) return {nlohmann::json::object(), exit_code};  // the replicas are identical to rank 0's

    // The training's pace, before the final evaluation adds its own time. A resume that trains no
    // step (--steps at the checkpoint's: it reports the finished run) has no pace of its own; it
    // reports the one metrics.csv recorded at that step, by the process that trained it.
    double wall_time = progress.elapsed_seconds(), steps_per_s = progress.steps_per_second();
    double tokens_per_s = progress.tokens_per_second();
    const auto recorded = step_ == first_step_ ? recorded_pace() : std::nullopt;
    if (recorded) {
      tokens_per_s = recorded->first, wall_time = recorded->second;
      steps_per_s = tokens_per_s / static_cast<double>(task_->tokens_per_step());
    }
    const auto figures = evaluation(nullptr);  // the last step's, when it was an evaluation step
    nlohmann::json evaluation = nlohmann::json::object();
    const auto keys = task_->evaluation_keys();
    for (size_t i = 0; i < keys.size() && i < figures.size(); ++i) evaluation[keys[i]] = figures[i];
    nlohmann::json summary = {
        {"task", config_.task},
        {"options", to_json(config_)},
        {"device", device_.str()},
        {"dtype", config_.dtype_name},
        {"precision", config_.precision},
        // float32 where the model is half precision (--dtype bfloat16) and the optimizer steps on copies
        {"master_weights", masters_.active() ? "float32" : "none"},
        {"loss_scale", precision_.scaler().get_scale()},
        {"torch_version", TORCH_VERSION},
        {"qkv_version", QKV_VERSION_STRING},
        {"backend", qkv::to_string(task_->backend())},
        {"linear_products", device_.is_cpu() ? qkv::linear_products() : "LibTorch's"},
        // What the attention's and (under bfloat16 autocast) the linear layers' products ran on:
        // amx_bf16, avx512_bf16, avx512, avx2 or portable (the CPU's, capped by QKV_TILED_ISA).
        {"instruction_set", device_.is_cpu() ? qkv::tiled_instruction_set() : device_.str()},
        {"steps", step_},
        {"initial_loss", initial_loss_.value_or(last_loss_)},
        {"final_loss", last_loss_},
        {"eval", evaluation},
        {"wall_time_s", wall_time},
        {"steps_per_s", steps_per_s},
        {"tokens_per_s", tokens_per_s},
        {"peak_rss_mb", peak_resident_megabytes()},
    };
    if (recorded) summary["pace_recorded_at_step"] = step_;  // in metrics.csv, by an earlier run
    summary.update(task_->summary_extras());
    if (exit_code != 0) summary["stopped_by_signal"] = exit_code - 128;
    if (parallel_ != nullptr) {
      summary["distributed"] = {{"world_size", parallel_->world_size()},
                                {"backend", parallel_->backend()},
                                {"examples_per_rank", shard_.size}};
    }
    if (!out_.empty()) {
      if (exit_code == 0) save_checkpoint();
      std::vector<std::string> files{"metrics.csv", "summary.json", "checkpoint.pt", "model.pt"};
      // The trained weights in PyTorch's format, e.g. SelfAttention(d).load_state_dict(torch.load(path)).
      task_->save_weights((out_ / "model.pt").string());
      for (const auto& file : task_->write_artifacts(out_)) files.push_back(file);
      for (const auto& file : task_->write_pictures(out_, history_)) files.push_back(file);
      summary["files"] = files;
      qkv::detail::write_file_atomically((out_ / "summary.json").string(), summary.dump(2) + "\n");
    }
    return {summary, exit_code};
  }

  // The tokens/s and elapsed seconds metrics.csv holds for this step, when a process trained it.
  std::optional<std::pair<double, double>> recorded_pace() const {
    const auto at_this_step = [this](const char* column) -> std::optional<double> {
      for (const auto& [step, value] : history_.series(column)) {
        if (static_cast<int64_t>(step) == step_ && value > 0) return value;
      }
      return std::nullopt;
    };
    const auto tokens_per_s = at_this_step("tokens_per_s"), elapsed_s = at_this_step("elapsed_s");
    if (!tokens_per_s || !elapsed_s) return std::nullopt;
    return std::make_pair(*tokens_per_s, *elapsed_s);
  }

  const RunConfig& config_;
  const torch::Device device_;
  DataParallel* parallel_;
  const bool is_main_;
  RunPrecision precision_;  // autocast and, for fp16-mixed, the loss scale (saved in checkpoints)
  const fs::path out_;
  std::unique_ptr<TrainableTask> task_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  qkv::MasterWeights masters_;
  std::vector<torch::Tensor> stepped_parameters_;  // the model's, each taken over by masters_ as its copy
  std::vector<torch::Tensor> parameters_;          // the model's
  const Shard shard_;
  std::optional<CheckpointFile> resume_;  // --resume's checkpoint, until start_or_resume loads (consumes) it

  int64_t step_ = 0, first_step_ = 0;
  std::optional<double> initial_loss_;
  double last_loss_ = 0.0;
  double lr_ = 0.0, tokens_per_s_ = 0.0, elapsed_s_ = 0.0;  // of the last logged step
  MetricsHistory history_;
  std::ofstream metrics_;
  std::optional<std::pair<int64_t, std::vector<double>>> last_evaluation_;  // (step, figures)
};

}  // namespace

TrainingResult train(const RunConfig& config, const torch::Device& device, DataParallel* parallel,
                     std::optional<CheckpointFile> resume) {
  return Trainer(config, device, parallel, std::move(resume)).run();
}

}  // namespace qkv_train
