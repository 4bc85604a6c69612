#include "checkpoint.h"

#include "atomic_file.h"
#include "half_precision.h"
#include "torch_compat.h"
#include "torch_file.h"

#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

namespace qkv_train {
namespace fs = std::filesystem;

void save_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     const qkv::GradScaler& scaler, const CheckpointState& state, const qkv::MasterWeights* masters) {
  const auto path = (fs::path(dir) / kCheckpointFile).string();
  try {
    torch::serialize::OutputArchive archive;
    torch::serialize::OutputArchive model_archive, optimizer_archive;
    model.save(model_archive);
    optimizer.save(optimizer_archive);
    archive.write("model", model_archive);
    archive.write("optimizer", optimizer_archive);
    if (scaler.is_enabled()) {
      torch::serialize::OutputArchive scaler_archive;
      scaler.save(scaler_archive);
      archive.write("grad_scaler", scaler_archive);
    }
    if (masters != nullptr && masters->active()) {
      torch::serialize::OutputArchive masters_archive;
      masters->save(masters_archive);
      archive.write("master_weights", masters_archive);
    }
    archive.write("step", torch::tensor(state.step, torch::kLong));
    archive.write("initial_loss", torch::tensor(state.initial_loss, torch::kDouble));
    archive.write("last_loss", torch::tensor(state.last_loss, torch::kDouble));
    archive.write("options", c10::IValue(state.options.dump()));
    archive.write("task_state", c10::IValue(state.task_state.dump()));
    archive.write("cpu_rng_state", at::detail::getDefaultCPUGenerator().get_state());
    const auto bytes = qkv::detail::archive_bytes(archive);
    qkv::detail::write_file_atomically(path, bytes.data(), bytes.size());
  } catch (const c10::Error& e) {
    throw std::runtime_error("cannot write checkpoint " + path + ": " + e.what_without_backtrace());
  }
}

namespace {

// A parameter's optimizer state is saved under its TensorImpl's address as text, and its param
// group lists those names in order: LibTorch 1.x writes them in hex ("0x55d0c4a0b2f0"), 2.x in
// decimal, and 2.x reads them with std::stoull, which takes "0x55..." for 0. So on 2.x every state of
// a 1.x checkpoint fell under one key and every parameter but the first was left a null state (a
// crash at the next step). Decimal names read the same on both (1.x compares them as text).
std::string decimal_name(const std::string& name) {
  if (name.size() < 3 || name.size() > 18 || name.rfind("0x", 0) != 0) return name;
  if (name.find_first_not_of("0123456789abcdefABCDEF", 2) != std::string::npos) return name;
  return std::to_string(std::stoull(name, nullptr, 16));  // at most 16 hex digits: fits
}

void use_decimal_state_names(qkv::detail::ArchiveObject& root) {
  for (auto& top : root.attributes) {
    if (top.name != "optimizer" || !top.object) continue;
    for (auto& part : top.object->attributes) {
      if (!part.object) continue;
      if (part.name == "state") {
        for (auto& state : part.object->attributes) state.name = decimal_name(state.name);
      } else if (part.name == "param_groups") {
        for (auto& group : part.object->attributes) {
          if (!group.object) continue;
          for (auto& entry : group.object->attributes) {
            if (entry.name.rfind("params/", 0) == 0 && entry.value.isString()) {
              entry.value = decimal_name(entry.value.toStringRef());
            }
          }
        }
      }
    }
  }
}

// What a tensor must keep when a checkpoint loads into it: its shape, dtype and device.
struct TensorSlot {
  explicit TensorSlot(const torch::Tensor& t) : sizes(t.sizes().vec()), dtype(t.dtype()), device(t.device()) {}
  bool operator!=(const TensorSlot& other) const {
    return sizes != other.sizes || dtype != other.dtype || device != other.device;
  }
  std::string text() const {
    std::ostringstream out;
    out << c10::IntArrayRef(sizes) << " " << dtype << " on " << device;
    return out.str();
  }

  std::vector<int64_t> sizes;
  caffe2::TypeMeta dtype;
  torch::Device device;
};

std::vector<std::pair<std::string, TensorSlot>> slots_of(torch::nn::Module& model) {
  std::vector<std::pair<std::string, TensorSlot>> slots;
  for (const auto& item : model.named_parameters()) slots.emplace_back(item.key(), TensorSlot(item.value()));
  for (const auto& item : model.named_buffers()) slots.emplace_back(item.key(), TensorSlot(item.value()));
  return slots;
}

// Module::load sets each tensor to what the file holds (Tensor::set_, or set_data across devices),
// whatever its shape, dtype and device: a checkpoint of another model would leave this one reshaped.
// A checkpoint of this model keeps them.
void check_model_kept(const std::vector<std::pair<std::string, TensorSlot>>& before, torch::nn::Module& model) {
  const auto after = slots_of(model);
  for (size_t i = 0; i < before.size() && i < after.size(); ++i) {
    const auto& [name, slot] = before[i];
    if (after[i].second != slot) {
      throw std::runtime_error("its " + name + " is " + after[i].second.text() + ", where the model's is " +
                               slot.text());
    }
  }
}

// Calls visit(name, tensor) on each tensor of Adam's or AdamW's state (two classes of the same
// fields) and puts what it returns in the tensor's place; returns the state's step.
template <typename AdamState, typename Visit>
int64_t visit_adam_state(AdamState& state, Visit& visit) {
  state.exp_avg(visit("exp_avg", state.exp_avg()));
  state.exp_avg_sq(visit("exp_avg_sq", state.exp_avg_sq()));
  state.max_exp_avg_sq(visit("max_exp_avg_sq", state.max_exp_avg_sq()));
  return state.step();
}

// The same for a parameter's Adam, AdamW or SGD state (whose step is 0: SGD keeps none).
template <typename Visit>
int64_t visit_state_tensors(torch::optim::OptimizerParamState& state, Visit visit) {
  if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(&state)) return visit_adam_state(*adam, visit);
  if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(&state)) return visit_adam_state(*adamw, visit);
  if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(&state)) {
    sgd->momentum_buffer(visit("momentum_buffer", sgd->momentum_buffer()));
  }
  return 0;
}

// Optimizer::load gives each parameter the state saved under its key: a key two parameters share
// leaves the second a null state (a crash at the next step), and the state's tensors are whatever the
// file holds. Each must be a tensor of its parameter's shape, dtype and device, its step not negative.
void check_optimizer_state(torch::optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& parameter : group.params()) {
      const auto found = qkv::compat::find_optimizer_state(optimizer.state(), parameter);
      if (found == optimizer.state().end()) continue;  // no step yet
      if (found->second == nullptr) throw std::runtime_error("its optimizer state names one parameter's state twice");
      const TensorSlot expected(parameter);
      const int64_t step =
          visit_state_tensors(*found->second, [&](const std::string& name, const torch::Tensor& tensor) {
            if (tensor.defined() && TensorSlot(tensor) != expected) {
              throw std::runtime_error("its optimizer state's " + name + " is " + TensorSlot(tensor).text() +
                                       ", where its parameter is " + expected.text());
            }
            return tensor;
          });
      if (step < 0) throw std::runtime_error("its optimizer state has step " + std::to_string(step));
    }
  }
}

// Loads the masters save_checkpoint wrote (MasterWeights::load checks every one before it sets any). A
// checkpoint written before master weights has none: the masters take its (bfloat16) weights, and
// its optimizer state, of the model's half dtype, is widened to float32 (exactly).
void load_masters(torch::serialize::InputArchive& archive, torch::optim::Optimizer& optimizer,
                  qkv::MasterWeights& masters) {
  torch::serialize::InputArchive masters_archive;
  if (!archive.try_read("master_weights", masters_archive)) {
    masters.copy_from_model();
    for (const auto& m : masters.masters()) {
      const auto found = qkv::compat::find_optimizer_state(optimizer.state(), m.master);
      if (found == optimizer.state().end() || found->second == nullptr) continue;
      visit_state_tensors(*found->second, [](const std::string&, const torch::Tensor& tensor) {
        const bool half = tensor.defined() && qkv::detail::half_precision(tensor.scalar_type());
        return half ? tensor.to(torch::kFloat) : tensor;
      });
    }
    return;
  }
  masters.load(masters_archive);
}

// Where `model`'s tensors are (qkv-train's models are on one device).
torch::Device device_of(torch::nn::Module& model) {
  for (const auto& parameter : model.parameters()) return parameter.device();
  for (const auto& buffer : model.buffers()) return buffer.device();
  return torch::kCPU;
}

CheckpointState read_state(torch::serialize::InputArchive& archive) {
  CheckpointState state;
  torch::Tensor step, initial_loss, last_loss;
  c10::IValue options;
  archive.read("step", step);
  archive.read("initial_loss", initial_loss);
  archive.read("last_loss", last_loss);
  archive.read("options", options);
  state.step = step.item<int64_t>();
  state.initial_loss = initial_loss.item<double>();
  state.last_loss = last_loss.item<double>();
  state.options = nlohmann::json::parse(options.toStringRef());
  c10::IValue task_state;
  if (archive.try_read("task_state", task_state)) state.task_state = nlohmann::json::parse(task_state.toStringRef());
  return state;
}

// The archive of `bytes`, its tensors on `device`. LibTorch's Module::load moves a tensor of the
// model to the device of the tensor it reads (Tensor::set_data), so a checkpoint is read onto the
// model's device: without that a model on CUDA ended on the CPU, and was refused as not kept.
torch::serialize::InputArchive open_archive(const std::vector<char>& bytes, const std::string& path,
                                            const torch::Device& device) {
  try {
    // Read by qkv, not by LibTorch's importer, which compiles the file's code (torch_file.h).
    return qkv::detail::read_serialize_archive(bytes, path, use_decimal_state_names, device);
  } catch (const c10::Error& e) {
    throw std::runtime_error("--resume: " + path + " is not a readable checkpoint: " + e.what_without_backtrace());
  } catch (const std::exception& e) {  // e.g. std::bad_alloc
    throw std::runtime_error("--resume: " + path + " is not a readable checkpoint: " + e.what());
  }
}

}  // namespace

CheckpointFile::CheckpointFile(const std::string& dir) : path_((fs::path(dir) / kCheckpointFile).string()) {
  if (!fs::exists(path_)) throw UsageError("--resume: no checkpoint at " + path_);
  bytes_ = qkv::detail::read_file_bytes(path_, "--resume");
  cpu_archive_ = std::make_unique<torch::serialize::InputArchive>(open_archive(bytes_, path_, torch::kCPU));
  try {
    state_ = read_state(*cpu_archive_);
  } catch (const std::exception& e) {
    throw std::runtime_error("--resume: " + path_ + " is not a qkv-train checkpoint: " + e.what());
  }
}

torch::serialize::InputArchive CheckpointFile::take_archive(const torch::Device& device) {
  if (!cpu_archive_) throw std::logic_error("--resume: " + path_ + " was loaded once already");
  const auto cpu = std::move(cpu_archive_);
  return device.is_cpu() ? std::move(*cpu) : open_archive(bytes_, path_, device);
}

void load_checkpoint_model(CheckpointFile checkpoint, torch::nn::Module& model) {
  auto archive = checkpoint.take_archive(device_of(model));
  try {
    torch::serialize::InputArchive model_archive;
    archive.read("model", model_archive);
    const auto slots = slots_of(model);
    model.load(model_archive);
    check_model_kept(slots, model);
  } catch (const std::exception& e) {
    throw std::runtime_error("--resume: cannot load the model of " + checkpoint.path() + ": " + e.what());
  }
}

CheckpointState load_checkpoint(CheckpointFile checkpoint, torch::nn::Module& model,
                                torch::optim::Optimizer& optimizer, qkv::GradScaler& scaler,
                                qkv::MasterWeights* masters) {
  auto archive = checkpoint.take_archive(device_of(model));
  try {
    torch::serialize::InputArchive model_archive, optimizer_archive;
    archive.read("model", model_archive);
    archive.read("optimizer", optimizer_archive);
    const auto slots = slots_of(model);
    model.load(model_archive);
    check_model_kept(slots, model);
    optimizer.load(optimizer_archive);
    if (masters != nullptr && masters->active()) load_masters(archive, optimizer, *masters);
    check_optimizer_state(optimizer);
    torch::serialize::InputArchive scaler_archive;
    if (scaler.is_enabled() && archive.try_read("grad_scaler", scaler_archive)) scaler.load(scaler_archive);
    torch::Tensor rng_state;
    archive.read("cpu_rng_state", rng_state);
    auto generator = at::detail::getDefaultCPUGenerator();  // a handle; the state it sets is shared
    generator.set_state(rng_state.cpu());  // read onto the model's device with the rest
    return checkpoint.state();
  } catch (const c10::Error& e) {
    throw std::runtime_error("--resume: cannot load " + checkpoint.path() + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw std::runtime_error("--resume: cannot load " + checkpoint.path() + ": " + e.what());
  }
}

}  // namespace qkv_train
