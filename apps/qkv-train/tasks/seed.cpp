#include "tasks/tasks.h"

#include "run_precision.h"

#include <qkv/qkv.h>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>

namespace qkv_train {
namespace {

// Python prints a shape as torch.Size([4, 8]).
std::string python_size(c10::IntArrayRef sizes) {
  std::string text = "torch.Size([";
  for (size_t i = 0; i < sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(sizes[i]);
  return text + "])";
}

}  // namespace

nlohmann::json run_seed_task(const RunConfig& config, const torch::Device& device) {
  // The same draws from the CPU generator, in the same order, as the Python example: input,
  // then the three Linear layers' initial weights, then the target. So on CPU the loss equals
  // Python's, and on CUDA it starts from the same numbers.
  torch::manual_seed(config.seed);
  auto x = torch::randn({config.seq_len, config.d_model});  // (N, E)
  qkv::SelfAttention attention(config.d_model);
  if (!config.init_weights.empty()) qkv::load_state_dict(attention, config.init_weights);
  auto target = torch::randn({config.seq_len, config.d_model});
  x = x.to(device);
  target = target.to(device);
  attention->to(device);

  torch::optim::Adam optimizer(attention->parameters(), torch::optim::AdamOptions(config.lr));
  // --precision: the weights stay float32; under bf16-mixed / fp16-mixed the projections and the
  // attention compute in the half type (autocast), and the loss is taken in float32.
  RunPrecision precision(config, device);
  auto& scaler = precision.scaler();  // fp16-mixed: the loss scaled, a step with inf/NaN gradients skipped
  std::vector<double> losses;
  torch::Tensor output;
  for (int64_t step = 1; step <= config.steps; ++step) {
    // Forward pass
    optimizer.zero_grad();
    {
      const auto autocast = precision.autocast();
      output = attention(x);  // (N, E)
    }
    auto loss = torch::mse_loss(output.to(torch::kFloat), target);
    // Backward pass
    scaler.scale(loss).backward();
    losses.push_back(loss.item<double>());
    if (step > 1 || config.steps > 1) spdlog::info("step {}/{} loss {:.6f}", step, config.steps, losses.back());
    // Apply gradients (the documents' single step stops at backward)
    if (step < config.steps) {
      scaler.step(optimizer);
      scaler.update();
    }
  }

  if (!config.json) {
    std::printf("Input shape: %s\n", python_size(x.sizes()).c_str());
    std::printf("Output shape: %s\n", python_size(output.sizes()).c_str());
    if (precision.name() != "fp32") std::printf("Precision: %s\n", precision.name().c_str());
    std::printf("Loss: %s\n", fmt::format("{}", losses.front()).c_str());
    if (config.steps > 1)
      std::printf("Loss after %lld steps: %s\n", static_cast<long long>(config.steps),
                  fmt::format("{}", losses.back()).c_str());
    std::fflush(stdout);
  }
  return {
      {"task", "seed"},
      {"steps", config.steps},
      {"initial_loss", losses.front()},
      {"final_loss", losses.back()},
      {"device", device.str()},
      {"dtype", "float32"},
      {"precision", precision.name()},
      {"output_dtype", c10::toString(output.scalar_type())},
      {"loss_scale", scaler.get_scale()},
      {"d_model", config.d_model},
      {"seq_len", config.seq_len},
      {"seed", config.seed},
      {"lr", config.lr},
      {"backend", qkv::to_string(attention->backend_for(x))},
      {"input_shape", x.sizes().vec()},
      {"output_shape", output.sizes().vec()},
  };
}

}  // namespace qkv_train
