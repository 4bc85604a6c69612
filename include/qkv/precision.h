// Mixed precision for LibTorch's C++ API: qkv::AutocastGuard (LibTorch's autocast state for a
// scope), qkv::GradScaler (torch.amp.GradScaler: loss scaling for float16, steps skipped when
// gradients overflow) and qkv::MasterWeights (float32 copies for an optimizer stepping a model held
// in bfloat16 or float16). pytorch/pytorch#46649: "Amp isn't intended for use with the C++ API yet".
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

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

/// float32 master weights for a model held in bfloat16 or float16, as DeepSpeed's and Megatron's
/// bfloat16 optimizers keep them. LibTorch's optimizers update a parameter in its own dtype, so a
/// bfloat16 weight keeps only the updates of at least half its spacing: a LayerNorm gain near 1
/// (spacing 2^-7) never moves under AdamW at a learning rate of 2e-3, and a weight decay that
/// shrinks each weight by 2e-4 a step changes none. With MasterWeights the optimizer steps on
/// float32 copies (its state float32 too) and the model takes each step's result, rounded once;
/// forward and backward stay in the model's dtype:
///
///     model->to(torch::kBFloat16);
///     torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
///     qkv::MasterWeights masters(*model, optimizer);  // before the optimizer's first step
///     for (auto& batch : batches) {
///       optimizer.zero_grad();                        // the masters' gradients
///       compute_loss(model, batch).backward();        // the model's gradients, in bfloat16
///       masters.gradients_to_masters();               // widened and added to the masters'
///       torch::nn::utils::clip_grad_norm_(masters.stepped(model->parameters()), 1.0);
///       optimizer.step();                             // on the float32 masters
///       masters.masters_to_model();                   // the model takes them, rounded once
///     }
///
/// gradients_to_masters() adds to the masters' gradients and releases the model's, so micro-batches
/// (a backward and gradients_to_masters() each) accumulate in float32, and no gradient of the model
/// is left over to be added twice (a backward not to be stepped on: model->zero_grad()). With a
/// GradScaler (a float16 model), scaler.step(optimizer) takes the place of optimizer.step().
/// Parameters already float32 or float64 stay the optimizer's own; a model with no half-precision
/// parameter makes every call a no-op (active() is false).
/// The masters are state a checkpoint must carry (save()/load()): rounding them to the model's
/// dtype loses what they hold.
class MasterWeights {
 public:
  /// A master: the float32 copy the optimizer steps in place of the model's parameter `name`.
  struct Master {
    std::string name;
    torch::Tensor parameter;  // the model's, bfloat16 or float16
    torch::Tensor master;     // float32, on the parameter's device, in the optimizer
  };

  /// Replaces each bfloat16 and float16 parameter of `optimizer` (a parameter of `model`) by a float32
  /// copy of its current value. Throws c10::Error when the optimizer has stepped already (its state
  /// would be the half-precision one) or steps a half-precision tensor that is not `model`'s.
  MasterWeights(torch::nn::Module& model, torch::optim::Optimizer& optimizer);

  bool active() const { return !masters_.empty(); }
  /// In the order the optimizer holds them (the same in a resumed run).
  const std::vector<Master>& masters() const { return masters_; }

  /// The masters take the model's values (after the model was loaded, or broadcast from another rank).
  void copy_from_model();
  /// Adds the model's gradients, widened exactly, to the masters' (sets them where the masters have
  /// none) and releases the model's. Throws c10::Error when a master was changed since the model last
  /// took the masters' values (a step without masters_to_model(): the backward ran on stale weights),
  /// as far as its version counter tells (LibTorch's Adam and AdamW count their steps there, its SGD,
  /// 1.13 to 2.14, does not) and, for masters on the CPU, its first and last values (an SGD step
  /// changes them unless their gradients are 0).
  void gradients_to_masters();
  /// The model's parameters take the masters' values, rounded once.
  void masters_to_model();
  /// `parameters` (the model's), each one taken over replaced by its master: what the optimizer
  /// steps, with the gradients it applies (for clipping them, or their norm), in the given order.
  std::vector<torch::Tensor> stepped(std::vector<torch::Tensor> parameters) const;

  /// The masters by position ("0", "1", ...: the optimizer's order).
  void save(torch::serialize::OutputArchive& archive) const;
  /// Reads what save() wrote. Every master is checked (present, of its shape and float32) before
  /// any is set, so a failed load changes nothing; the values are copied to the masters' device.
  void load(torch::serialize::InputArchive& archive);

 private:
  // The bits of a CPU master's first and last values (not sampled on another device: reading them
  // would wait for it).
  struct EndBits {
    uint32_t first = 0, last = 0;
    bool sampled = false;
  };
  static EndBits end_bits(const torch::Tensor& master);
  void record_synced();

  struct Synced {
    int64_t version;  // the master's _version()
    EndBits ends;
  };
  std::vector<Master> masters_;
  std::vector<Synced> synced_;  // each master's when the model last took its value
};

}  // namespace qkv
