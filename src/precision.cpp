// AutocastGuard and GradScaler (include/qkv/precision.h).
#include <qkv/precision.h>

#include "torch_compat.h"

#include <torch/torch.h>

#include <cmath>
#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

namespace qkv {

namespace {

// Whether autocast casts a linear layer's product to `dtype` on `type` here: tried once per
// pair. LibTorch 1.13's CPU autocast takes bfloat16 only (float16 fails at the first operation:
// "AutocastCPU only support Bfloat16"); 2.x takes both.
bool autocast_casts_to(torch::DeviceType type, torch::ScalarType dtype) {
  if (type == torch::kCUDA) return dtype == torch::kHalf || dtype == torch::kBFloat16;
  if (type != torch::kCPU || (dtype != torch::kHalf && dtype != torch::kBFloat16)) return false;
  if (dtype == torch::kBFloat16) return true;
  static std::once_flag once;
  static bool half_works = false;
  std::call_once(once, [] {
    const bool was_enabled = compat::autocast_enabled(torch::kCPU);
    const auto was_dtype = compat::autocast_dtype(torch::kCPU);
    try {
      compat::set_autocast_dtype(torch::kCPU, torch::kHalf);  // 1.13 refuses here already
      compat::set_autocast_enabled(torch::kCPU, true);
      torch::NoGradGuard no_grad;
      half_works = torch::linear(torch::ones({1, 2}), torch::ones({2, 2})).scalar_type() == torch::kHalf;
    } catch (const c10::Error&) {
      half_works = false;
    }
    at::autocast::clear_cache();
    compat::set_autocast_enabled(torch::kCPU, was_enabled);
    compat::set_autocast_dtype(torch::kCPU, was_dtype);
  });
  return half_works;
}

// Whether LibTorch's fused unscale-and-check (at::_amp_foreach_non_finite_check_and_unscale_,
// what torch.amp.GradScaler calls) takes these gradients (non-empty, one device and dtype): dense
// ones on CUDA, or on the CPU from LibTorch 2.6 (whose CPU kernel the suite runs on Debian 13 and
// unstable; 1.13 has none).
bool fused_unscale_takes(const std::vector<torch::Tensor>& grads) {
  if (std::any_of(grads.begin(), grads.end(), [](const torch::Tensor& g) { return g.is_sparse(); })) {
    return false;
  }
  const auto device = grads.front().device();
  if (device.is_cuda()) return true;
#if QKV_TORCH_AT_LEAST(2, 6)
  return device.is_cpu();
#else
  return false;
#endif
}

}  // namespace

bool AutocastGuard::supports(const torch::Device& device, torch::ScalarType dtype) {
  return autocast_casts_to(device.type(), dtype);
}

AutocastGuard::AutocastGuard(const torch::Device& device, torch::ScalarType dtype, bool enabled)
    : device_type_(device.type()) {
  TORCH_CHECK(device_type_ == torch::kCPU || device_type_ == torch::kCUDA,
              "AutocastGuard: expected a CPU or CUDA device, got ", device);
  TORCH_CHECK(!enabled || supports(device, dtype), "AutocastGuard: LibTorch ", TORCH_VERSION, "'s autocast on ",
              c10::DeviceTypeName(device_type_), " does not take ", dtype,
              device_type_ == torch::kCPU ? " (its CPU autocast takes bfloat16; float16 needs LibTorch 2.x)" : "");
  previous_enabled_ = compat::autocast_enabled(device_type_);
  previous_dtype_ = compat::autocast_dtype(device_type_);
  compat::set_autocast_enabled(device_type_, enabled);
  if (enabled) compat::set_autocast_dtype(device_type_, dtype);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  // As torch.autocast's __exit__: the cached casts of the weights live until the outermost scope ends.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  compat::set_autocast_enabled(device_type_, previous_enabled_);
  compat::set_autocast_dtype(device_type_, previous_dtype_);
}

GradScaler::GradScaler(const GradScalerOptions& options) : options_(options), scale_(options.init_scale()) {
  TORCH_CHECK(options.init_scale() > 0 && std::isfinite(options.init_scale()),
              "GradScaler: expected a positive finite init_scale, got ", options.init_scale());
  // Finite, as load_state_dict requires: an infinite factor makes the scale inf after its first
  // growth, and every later step is then skipped (inf backs off to inf).
  TORCH_CHECK(options.growth_factor() > 1.0 && std::isfinite(options.growth_factor()),
              "GradScaler: expected a finite growth_factor > 1, got ", options.growth_factor());
  TORCH_CHECK(options.backoff_factor() > 0.0 && options.backoff_factor() < 1.0,
              "GradScaler: expected backoff_factor in (0, 1), got ", options.backoff_factor());
  TORCH_CHECK(options.growth_interval() >= 1, "GradScaler: expected growth_interval >= 1, got ",
              options.growth_interval());
}

double GradScaler::get_scale() const { return is_enabled() ? scale_ : 1.0; }

torch::Tensor GradScaler::scale(const torch::Tensor& loss) {
  if (!is_enabled()) return loss;
  // In float32 (or wider): a float16 loss times 65536 would itself overflow.
  const auto wide = loss.scalar_type() == torch::kDouble ? loss : loss.to(torch::kFloat);
  return wide * scale_;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!is_enabled()) return;
  auto& record = records_[&optimizer];
  TORCH_CHECK(record.stage == Stage::Ready,
              "GradScaler::unscale_: already called for this optimizer since the last update()");
  torch::NoGradGuard no_grad;
  // The gradients by device and dtype, as torch.amp.GradScaler groups them for LibTorch's fused
  // unscale-and-check, one call per group; then one read of the verdicts per device (a read per
  // gradient would wait for a CUDA device once per parameter).
  std::vector<std::vector<torch::Tensor>> groups;  // each non-empty, one device and dtype
  for (auto& group : optimizer.param_groups()) {
    for (auto& parameter : group.params()) {
      const auto& grad = parameter.grad();
      if (!grad.defined()) continue;
      auto same = std::find_if(groups.begin(), groups.end(), [&](const std::vector<torch::Tensor>& g) {
        return g.front().device() == grad.device() && g.front().scalar_type() == grad.scalar_type();
      });
      if (same == groups.end()) same = groups.insert(groups.end(), std::vector<torch::Tensor>{});
      same->push_back(grad);
    }
  }
  // inv_scale in float32, as torch.amp's (1/scale is a power of two while the scale is one).
  const float inverse = static_cast<float>(1.0 / scale_);
  std::vector<std::pair<torch::Device, std::vector<torch::Tensor>>> non_finite_by_device;
  for (auto& grads : groups) {
    const auto device = grads.front().device();
    torch::Tensor non_finite;  // (1,) bool
    if (fused_unscale_takes(grads)) {
      const auto float_options = torch::TensorOptions().device(device).dtype(torch::kFloat);
      auto found_inf = torch::zeros({1}, float_options);
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch::full({1}, inverse, float_options));
      non_finite = found_inf.gt(0);
    } else {
      // The same arithmetic op by op: LibTorch 1.13 has the fused operation for CUDA only.
      std::vector<torch::Tensor> finite;
      for (auto& grad : grads) {
        finite.push_back((grad.is_sparse() ? grad.coalesce().values() : grad).isfinite().all());
        grad.mul_(inverse);
      }
      non_finite = torch::stack(finite).all().logical_not().reshape({1});
    }
    auto on_device = std::find_if(non_finite_by_device.begin(), non_finite_by_device.end(),
                                  [&](const auto& entry) { return entry.first == device; });
    if (on_device == non_finite_by_device.end()) {
      on_device = non_finite_by_device.insert(non_finite_by_device.end(), {device, {}});
    }
    on_device->second.push_back(non_finite);
  }
  bool found_inf = false;
  for (const auto& [device, verdicts] : non_finite_by_device) {
    found_inf = found_inf || torch::cat(verdicts).any().item<bool>();
  }
  record.found_inf = found_inf;
  record.stage = Stage::Unscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!is_enabled()) {
    optimizer.step();
    return true;
  }
  auto& record = records_[&optimizer];
  TORCH_CHECK(record.stage != Stage::Stepped, "GradScaler::step: already called for this optimizer since update()");
  if (record.stage == Stage::Ready) unscale_(optimizer);
  auto& unscaled = records_[&optimizer];
  unscaled.stage = Stage::Stepped;
  if (unscaled.found_inf) return false;
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (!is_enabled()) return;
  bool found_inf = false;
  for (const auto& [optimizer, record] : records_) found_inf = found_inf || record.found_inf;
  TORCH_CHECK(!records_.empty(), "GradScaler::update: no step() or unscale_() since the last update()");
  if (found_inf) {
    scale_ *= options_.backoff_factor();
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval()) {
    scale_ *= options_.growth_factor();
    growth_tracker_ = 0;
  }
  last_skipped_ = found_inf;
  records_.clear();
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!is_enabled()) return {};
  return {{"scale", scale_},
          {"growth_factor", options_.growth_factor()},
          {"backoff_factor", options_.backoff_factor()},
          {"growth_interval", static_cast<double>(options_.growth_interval())},
          {"_growth_tracker", static_cast<double>(growth_tracker_)}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  TORCH_CHECK(is_enabled() || state.empty(), "GradScaler::load_state_dict: a disabled scaler takes no state");
  if (state.empty()) return;
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
    TORCH_CHECK(state.count(key) == 1, "GradScaler::load_state_dict: expected the key ", key, " in the state");
  }
  // The constructor's conditions, and counts that are whole numbers an int64_t holds: the state
  // may come from a damaged or crafted checkpoint, and casting 1e300 or NaN to int64_t is undefined.
  const double scale = state.at("scale"), growth = state.at("growth_factor"), backoff = state.at("backoff_factor"),
               interval = state.at("growth_interval"), tracker = state.at("_growth_tracker");
  TORCH_CHECK(scale > 0 && std::isfinite(scale), "GradScaler::load_state_dict: expected a positive finite scale, got ",
              scale);
  TORCH_CHECK(growth > 1.0 && std::isfinite(growth), "GradScaler::load_state_dict: expected a finite growth_factor > 1, got ",
              growth);
  TORCH_CHECK(backoff > 0.0 && backoff < 1.0, "GradScaler::load_state_dict: expected backoff_factor in (0, 1), got ",
              backoff);
  constexpr double kLargestCount = 9007199254740992.0;  // 2^53: every whole number up to it is a double
  TORCH_CHECK(interval >= 1 && interval <= kLargestCount && interval == std::floor(interval),
              "GradScaler::load_state_dict: expected a whole growth_interval in [1, 2^53], got ", interval);
  TORCH_CHECK(tracker >= 0 && tracker < interval && tracker == std::floor(tracker),
              "GradScaler::load_state_dict: expected a whole _growth_tracker in [0, growth_interval), got ", tracker);
  scale_ = scale;
  options_.growth_factor(growth);
  options_.backoff_factor(backoff);
  options_.growth_interval(static_cast<int64_t>(interval));
  growth_tracker_ = static_cast<int64_t>(tracker);
  records_.clear();
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  for (const auto& [key, value] : state_dict()) archive.write(key, torch::tensor(value, torch::kDouble));
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  if (!is_enabled()) return;
  std::map<std::string, double> state;
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
    torch::Tensor value;
    archive.read(key, value);
    state[key] = value.item<double>();
  }
  load_state_dict(state);
}

}  // namespace qkv
