#include "common/plot.h"
#include "tasks/tasks.h"
#include "tasks/toy_data.h"

#include "run_precision.h"

#include "atomic_file.h"

#include <qkv/qkv.h>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace qkv_train {
namespace fs = std::filesystem;

namespace {

constexpr int64_t kVarianceSamples = 20000;  // q·k pairs per d_k
constexpr int64_t kRows = 512;               // softmax rows per d_k
constexpr int64_t kKeys = 16;                // keys per row

struct DkFigures {
  int64_t d_k = 0;
  double variance = 0, variance_sigma = 0;  // measured Var(q·k) and its standard error
  double max_weight[2] = {0, 0};            // [scaled, unscaled]
  double entropy[2] = {0, 0};
  // Per softmax row, for a fixed random upstream gradient: the norm of the gradient at the
  // scores (softmax's input) and the norm of the gradient reaching q and k. Medians describe the
  // typical row; the mean of the Q/K norm is kept too, since a few unsaturated rows (two nearly
  // equal top scores) get very large gradients when unscaled and dominate it.
  double grad_scores_median[2] = {0, 0};
  double grad_qk_median[2] = {0, 0};
  double grad_qk_mean[2] = {0, 0};
};

// Var(q·k) over kVarianceSamples pairs, and the standard error of that estimate: for Gaussian
// components E[(q·k)^4] = 3 d_k² + 6 d_k, so Var(sample variance) ≈ (2 d_k² + 6 d_k) / M.
void measure_variance(DkFigures& f) {
  auto q = torch::randn({kVarianceSamples, f.d_k}, torch::kDouble);
  auto k = torch::randn({kVarianceSamples, f.d_k}, torch::kDouble);
  auto dots = (q * k).sum(-1);  // (M,)
  f.variance = dots.var().item<double>();
  const double d = static_cast<double>(f.d_k);
  f.variance_sigma = std::sqrt((2 * d * d + 6 * d) / kVarianceSamples);
}

// Softmax over kKeys keys per row, with and without the 1/sqrt(d_k) factor: how peaked the weights
// are, and how much gradient flows back to q and k for a fixed random upstream gradient.
void measure_softmax(DkFigures& f) {
  auto q0 = torch::randn({kRows, 1, f.d_k}, torch::kDouble);
  auto k0 = torch::randn({kRows, kKeys, f.d_k}, torch::kDouble);
  auto v = torch::randn({kRows, kKeys, 8}, torch::kDouble);
  auto upstream = torch::randn({kRows, 1, 8}, torch::kDouble);
  for (int variant = 0; variant < 2; ++variant) {
    auto q = q0.clone().requires_grad_(true);
    auto k = k0.clone().requires_grad_(true);
    auto result = qkv::scaled_dot_product_attention(q, k, v,
                                                    qkv::ScaledDotProductAttentionOptions()
                                                        .scale(variant == 0 ? c10::nullopt : c10::optional<double>(1.0))
                                                        .need_weights(true));
    auto weights = result.weights.detach();  // (rows, 1, keys)
    f.max_weight[variant] = std::get<0>(weights.max(-1)).mean().item<double>();
    f.entropy[variant] = -(weights * weights.clamp_min(1e-300).log()).sum(-1).mean().item<double>();
    (result.output * upstream).sum().backward();
    const auto qk_norm = (q.grad().pow(2).sum({1, 2}) + k.grad().pow(2).sum({1, 2})).sqrt();  // (rows,)
    f.grad_qk_median[variant] = qk_norm.median().item<double>();
    f.grad_qk_mean[variant] = qk_norm.mean().item<double>();
    // Softmax's backward: dL/ds = p ⊙ (g - Σ p g), with g = dL/dp = upstream · vᵀ.
    const auto g = torch::matmul(upstream, v.transpose(1, 2));                        // (rows, 1, keys)
    const auto score_grad = weights * (g - (weights * g).sum(-1, /*keepdim=*/true));  // (rows, 1, keys)
    f.grad_scores_median[variant] = score_grad.norm(2, {1, 2}).median().item<double>();
  }
}

// A short run of the reverse task with each variant; returns the loss of every step.
std::vector<double> train_reverse(const RunConfig& config, const torch::Device& device, bool scaled) {
  const auto data = make_reverse_data(config.seed, config.seq_len, config.d_model, device, config.dtype());
  torch::manual_seed(config.seed);
  qkv::SelfAttention model(qkv::SelfAttentionOptions(config.d_model)
                               .num_heads(config.heads)
                               .scale(scaled ? c10::nullopt : c10::optional<double>(1.0)));
  model->to(device, config.dtype());
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(config.lr));
  qkv::MasterWeights masters(*model, optimizer);  // --dtype bfloat16: the optimizer steps on float32 copies
  // --precision: autocast around the forward pass (the loss in float32), fp16-mixed's loss scale.
  RunPrecision precision(config, device);
  std::vector<double> losses;
  for (int64_t step = 1; step <= config.steps; ++step) {
    const auto batch = data->sample(config.batch, step);
    optimizer.zero_grad();
    torch::Tensor output;
    {
      const auto autocast = precision.autocast();
      output = model(batch.input);
    }
    auto loss = data->loss(output.to(config.dtype()), batch);
    precision.scaler().scale(loss).backward();
    masters.gradients_to_masters();
    precision.scaler().step(optimizer);
    precision.scaler().update();
    masters.masters_to_model();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

std::string softmax_text(const std::vector<double>& scores) {
  auto q = torch::ones({1, 1}, torch::kDouble);
  auto k = torch::tensor(scores, torch::kDouble).unsqueeze(1);  // q·k_j = scores[j]
  auto weights =
      qkv::scaled_dot_product_attention(q, k, torch::eye(3, torch::kDouble),
                                        qkv::ScaledDotProductAttentionOptions().scale(1.0).need_weights(true))
          .weights[0];
  char text[128];
  std::snprintf(text, sizeof(text), "[%.5f, %.5f, %.5f]", weights[0].item<double>(), weights[1].item<double>(),
                weights[2].item<double>());
  return text;
}

}  // namespace

nlohmann::json run_scaling_task(const RunConfig& config, const torch::Device& device) {
  const auto start = std::chrono::steady_clock::now();
  // A --precision that autocast cannot run here is refused before the measurements, not after them.
  [[maybe_unused]] const RunPrecision checked_precision(config, device);
  torch::manual_seed(config.seed);
  std::vector<DkFigures> figures;
  for (int64_t d_k = 4; d_k <= 1024; d_k *= 2) {
    DkFigures f;
    f.d_k = d_k;
    measure_variance(f);
    measure_softmax(f);
    figures.push_back(f);
  }
  spdlog::info("measured d_k = 4 ... 1024; training reverse at d_model {} with and without scaling", config.d_model);
  const auto scaled_losses = train_reverse(config, device, /*scaled=*/true);
  const auto unscaled_losses = train_reverse(config, device, /*scaled=*/false);

  // The documents' small numbers, recomputed.
  const auto find = [&](int64_t d_k) {
    return *std::find_if(figures.begin(), figures.end(), [&](auto& f) { return f.d_k == d_k; });
  };
  std::printf("The documents' numbers, recomputed by qkv:\n");
  std::printf("  softmax([20, 10, 0]) = %s   (documents: [0.9999, 0.0001, 0.0000])\n",
              softmax_text({20, 10, 0}).c_str());
  std::printf("  softmax([2, 1, 0])   = %s   (documents: [0.67, 0.24, 0.09])\n", softmax_text({2, 1, 0}).c_str());
  std::printf("  d_k = 64:  std of q·k = %.2f measured over %lld pairs (documents: sqrt(64) = 8)\n",
              std::sqrt(find(64).variance), static_cast<long long>(kVarianceSamples));
  std::printf("  d_k = 512: std of q·k = %.2f measured (documents: sqrt(512) ≈ 22.6)\n", std::sqrt(find(512).variance));
  std::printf(
      "\nsc = scaled by 1/sqrt(d_k), unsc = unscaled; z = (Var - d_k) / standard error; gradients are "
      "medians over %lld rows of %lld keys\n",
      static_cast<long long>(kRows), static_cast<long long>(kKeys));
  std::printf("%6s %10s %6s | %15s | %15s | %19s | %19s\n", "d_k", "Var(q·k)", "z", "max weight sc/unsc",
              "entropy sc/unsc", "|dL/dscores| sc/unsc", "|dL/dq,dk| sc/unsc");
  for (const auto& f : figures) {
    std::printf("%6lld %10.2f %6.2f | %7.3f %7.3f | %7.3f %7.3f | %9.3g %9.3g | %9.3g %9.3g\n",
                static_cast<long long>(f.d_k), f.variance, (f.variance - f.d_k) / f.variance_sigma, f.max_weight[0],
                f.max_weight[1], f.entropy[0], f.entropy[1], f.grad_scores_median[0], f.grad_scores_median[1],
                f.grad_qk_median[0], f.grad_qk_median[1]);
  }
  auto tail_mean = [](const std::vector<double>& losses) {
    const size_t n = std::max<size_t>(1, losses.size() / 10);
    double sum = 0;
    for (size_t i = losses.size() - n; i < losses.size(); ++i) sum += losses[i];
    return sum / static_cast<double>(n);
  };
  std::printf("\nreverse, d_model %lld, %lld steps%s: final loss (mean of the last 10%%) scaled %.4f, unscaled %.4f\n",
              static_cast<long long>(config.d_model), static_cast<long long>(config.steps),
              config.precision == "fp32" ? "" : (", " + config.precision).c_str(), tail_mean(scaled_losses),
              tail_mean(unscaled_losses));
  std::fflush(stdout);
  spdlog::info("scaling experiment done in {:.1f} s",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());

  if (!config.out_dir.empty()) {
    const fs::path out = config.out_dir;
    fs::create_directories(out);
    std::ostringstream csv;
    csv << "d_k,samples,var_qk,var_qk_stderr,max_weight_scaled,max_weight_unscaled,entropy_scaled,entropy_unscaled,"
           "grad_scores_median_scaled,grad_scores_median_unscaled,grad_qk_median_scaled,grad_qk_median_unscaled,"
           "grad_qk_mean_scaled,grad_qk_mean_unscaled\n";
    csv.precision(8);
    for (const auto& f : figures) {
      csv << f.d_k << ',' << kVarianceSamples << ',' << f.variance << ',' << f.variance_sigma << ',' << f.max_weight[0]
          << ',' << f.max_weight[1] << ',' << f.entropy[0] << ',' << f.entropy[1] << ',' << f.grad_scores_median[0]
          << ',' << f.grad_scores_median[1] << ',' << f.grad_qk_median[0] << ',' << f.grad_qk_median[1] << ','
          << f.grad_qk_mean[0] << ',' << f.grad_qk_mean[1] << '\n';
    }
    qkv::detail::write_file_atomically((out / "scaling.csv").string(), csv.str());
    std::ostringstream training;
    training << "step,loss_scaled,loss_unscaled\n";
    training.precision(8);
    for (size_t i = 0; i < scaled_losses.size(); ++i) {
      training << i + 1 << ',' << scaled_losses[i] << ',' << unscaled_losses[i] << '\n';
    }
    qkv::detail::write_file_atomically((out / "scaling_training.csv").string(), training.str());

    using qkv_plot::Series;
    const auto scaled_color = qkv_plot::series_color(0), unscaled_color = qkv_plot::series_color(1);
    Series measured{"measured Var(q.k)", {}, {}, scaled_color},
        theory{"theory: d_k (hidden under it)", {}, {}, qkv_plot::series_color(5)};
    Series max_s{"scaled 1/sqrt(d_k)", {}, {}, scaled_color}, max_u{"unscaled", {}, {}, unscaled_color};
    Series grad_s = max_s, grad_u = max_u;
    for (const auto& f : figures) {
      const double d = static_cast<double>(f.d_k);
      measured.x.push_back(d), measured.y.push_back(f.variance);
      theory.x.push_back(d), theory.y.push_back(d);
      max_s.x.push_back(d), max_s.y.push_back(f.max_weight[0]);
      max_u.x.push_back(d), max_u.y.push_back(f.max_weight[1]);
      grad_s.x.push_back(d), grad_s.y.push_back(f.grad_qk_median[0]);
      grad_u.x.push_back(d), grad_u.y.push_back(f.grad_qk_median[1]);
    }
    Series loss_s{"scaled", {}, {}, scaled_color}, loss_u{"unscaled (--scale 1.0)", {}, {}, unscaled_color};
    for (size_t i = 0; i < scaled_losses.size(); ++i) {
      loss_s.x.push_back(static_cast<double>(i + 1)), loss_s.y.push_back(scaled_losses[i]);
      loss_u.x.push_back(static_cast<double>(i + 1)), loss_u.y.push_back(unscaled_losses[i]);
    }
    qkv_plot::LinePlot variance{
        "1. Var(q.k) grows like d_k", "d_k", "Var(q.k)", {theory, measured}, true, true, {}, {}};
    qkv_plot::LinePlot saturation{
        "2. softmax saturates unscaled", "d_k", "mean largest weight (16 keys)", {max_s, max_u}, true, false, 0.0, 1.0};
    qkv_plot::LinePlot gradient{"3. gradient reaching Q, K through softmax",
                                "d_k",
                                "median |dL/dq, dL/dk| per row",
                                {grad_s, grad_u},
                                true,
                                true,
                                {},
                                {}};
    qkv_plot::LinePlot training_plot{"reverse task, d_model " + std::to_string(config.d_model),
                                     "step",
                                     "training loss (log scale)",
                                     {loss_s, loss_u},
                                     false,
                                     true,
                                     {},
                                     {}};
    qkv_plot::write_line_plots((out / "scaling.png").string(), {variance, saturation, gradient, training_plot},
                               /*panel_width=*/520, /*panel_height=*/400, /*columns=*/2);
  }

  nlohmann::json d_k_rows = nlohmann::json::array();
  for (const auto& f : figures) {
    d_k_rows.push_back({{"d_k", f.d_k},
                        {"var_qk", f.variance},
                        {"var_qk_stderr", f.variance_sigma},
                        {"max_weight_scaled", f.max_weight[0]},
                        {"max_weight_unscaled", f.max_weight[1]},
                        {"grad_scores_median_scaled", f.grad_scores_median[0]},
                        {"grad_scores_median_unscaled", f.grad_scores_median[1]},
                        {"grad_qk_median_scaled", f.grad_qk_median[0]},
                        {"grad_qk_median_unscaled", f.grad_qk_median[1]}});
  }
  return {{"task", "scaling"},
          {"device", device.str()},
          {"precision", config.precision},
          {"d_k", d_k_rows},
          {"reverse",
           {{"d_model", config.d_model},
            {"steps", config.steps},
            {"final_loss_scaled", tail_mean(scaled_losses)},
            {"final_loss_unscaled", tail_mean(unscaled_losses)}}},
          {"wall_time_s", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()}};
}

}  // namespace qkv_train
