#include "run_precision.h"

#include <torch/version.h>

namespace qkv_train {

RunPrecision::RunPrecision(const RunConfig& config, const torch::Device& device)
    : device_(device),
      name_(config.precision),
      dtype_(config.autocast_dtype()),
      scaler_(qkv::GradScalerOptions().enabled(config.precision == "fp16-mixed")) {
  // Refused here rather than at the first product, where LibTorch 1.13's CPU autocast would fail.
  if (dtype_ && !qkv::AutocastGuard::supports(device_, *dtype_)) {
    throw UsageError("--precision " + name_ + " on " + device_.str() + ": LibTorch " + TORCH_VERSION +
                     "'s autocast does not compute in " + c10::toString(*dtype_) + " there" +
                     (device_.is_cpu() ? " (its CPU autocast takes bfloat16 only; use bf16-mixed, or LibTorch 2.x)"
                                       : ""));
  }
}

std::unique_ptr<qkv::AutocastGuard> RunPrecision::autocast() const {
  return dtype_ ? std::make_unique<qkv::AutocastGuard>(device_, *dtype_) : nullptr;
}

}  // namespace qkv_train
