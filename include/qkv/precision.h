// Mixed precision for LibTorch's C++ API: qkv::AutocastGuard (LibTorch's autocast state for a
// scope) and qkv::GradScaler (torch.amp.GradScaler: loss scaling for float16, steps skipped when
// gradients overflow). pytorch/pytorch#46649: "Amp isn't intended for use with the C++ API yet".
#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <map>

namespace qkv {

/// Autocast for the length of a scope, as `with torch.autocast(device_type, dtype)`: on `device`'s
/// type (CPU or CUDA), eligible operations (matrix products, linear layers, attention) run in
/// `dtype` (bfloat16 or float16) while the parameters stay float32; precision-sensitive ones
/// (softmax, LayerNorm, losses) stay float32. The previous state (enabled flag and dtype) is
/// restored at the end of the scope, and autocast's cast cache is cleared when the outermost guard
/// ends, as Python's context manager does. Guards nest.
///
/// Throws c10::Error for a dtype LibTorch's autocast does not support on that device type (float16
/// on the CPU before LibTorch 2.x, which would otherwise disable autocast with only a warning).
class AutocastGuard {
 public:
  AutocastGuard(const torch::Device& device, torch::ScalarType dtype, bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

  /// Whether LibTorch's autocast supports `dtype` on `device`'s type in this build.
  static bool supports(const torch::Device& device, torch::ScalarType dtype);

 private:
  torch::DeviceType device_type_;
  bool previous_enabled_;
  torch::ScalarType previous_dtype_;
};

/// Options of GradScaler, with torch.amp.GradScaler's defaults.
struct GradScalerOptions {
  /// The first scale.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// What the scale is multiplied by after `growth_interval` steps without inf/NaN gradients.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// What the scale is multiplied by after a step whose gradients held inf/NaN.
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// false: every call passes through (scale(loss) is loss, step() steps): one code path for
  /// float32, bfloat16 (which needs no scaling) and float16 training.
  TORCH_ARG(bool, enabled) = true;
};

/// Loss scaling for float16 training, as torch.amp.GradScaler:
///
///     auto loss = compute_loss();
///     scaler.scale(loss).backward();        // gradients of loss · scale: small ones stay representable
///     scaler.unscale_(optimizer);           // optional: true gradients, e.g. before clipping them
///     torch::nn::utils::clip_grad_norm_(parameters, 1.0);
///     scaler.step(optimizer);               // skipped when a gradient is inf or NaN
///     scaler.update();                      // scale / 2 after a skipped step, · 2 after 2000 good ones
///
/// Works on the CPU and CUDA (the checks run on the gradients' device). The scale and the growth
/// counter are its state: state_dict()/load_state_dict() or save()/load() carry them into a
/// checkpoint so that a resumed run continues with the same scale.
class GradScaler {
 public:
  explicit GradScaler(const GradScalerOptions& options = {});

  /// loss · scale (loss itself when disabled).
  torch::Tensor scale(const torch::Tensor& loss);
  /// Divides the gradients of `optimizer`'s parameters by the scale, in place, and records whether
  /// any is inf or NaN. At most once per optimizer between update()s (throws c10::Error otherwise).
  void unscale_(torch::optim::Optimizer& optimizer);
  /// Unscales (unless unscale_ was called) and runs optimizer.step() unless a gradient was inf or
  /// NaN. Returns whether the step ran.
  bool step(torch::optim::Optimizer& optimizer);
  /// The scale for the next iteration: backoff after a skipped step, growth after
  /// growth_interval good ones. Forgets the per-optimizer records of this iteration.
  void update();

  /// The current scale (1 when disabled).
  double get_scale() const;
  bool is_enabled() const { return options_.enabled(); }
  /// Good steps since the last change of the scale.
  int64_t growth_tracker() const { return growth_tracker_; }
  /// Whether the last update() followed a skipped step (gradients with inf/NaN).
  bool last_step_skipped() const { return last_skipped_; }

  /// The scaler's state by name, as torch.amp.GradScaler.state_dict(): scale, growth_factor,
  /// backoff_factor, growth_interval, _growth_tracker.
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct Record {
    Stage stage = Stage::Ready;
    bool found_inf = false;
  };

  GradScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  bool last_skipped_ = false;
  std::map<const torch::optim::Optimizer*, Record> records_;  // this iteration's, per optimizer
};

}  // namespace qkv
