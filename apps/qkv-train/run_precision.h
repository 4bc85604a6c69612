// The run's --precision, one object for every task's training loop: autocast around the forward
// pass (bf16-mixed, fp16-mixed), loss scaling for fp16-mixed (qkv::GradScaler), and the refusal, up
// front with exit status 2, of a precision LibTorch's autocast cannot compute in on the device.
#pragma once

#include "run_config.h"

#include <qkv/precision.h>

#include <torch/types.h>

#include <memory>
#include <optional>
#include <string>

namespace qkv_train {

class RunPrecision {
 public:
  /// Throws UsageError where LibTorch's autocast has no `config.precision` on `device` (float16
  /// on the CPU of LibTorch 1.13).
  RunPrecision(const RunConfig& config, const torch::Device& device);

  /// Autocast for a forward pass in the run's precision, for as long as the result lives (none for fp32).
  std::unique_ptr<qkv::AutocastGuard> autocast() const;

  /// The loss scaler: enabled for fp16-mixed, a pass-through otherwise.
  qkv::GradScaler& scaler() { return scaler_; }

  /// fp32, bf16-mixed or fp16-mixed, as summaries and metrics name it.
  const std::string& name() const { return name_; }

 private:
  torch::Device device_;
  std::string name_;
  std::optional<torch::ScalarType> dtype_;
  qkv::GradScaler scaler_;
};

}  // namespace qkv_train
