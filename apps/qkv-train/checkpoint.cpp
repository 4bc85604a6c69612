#include "checkpoint.h"

#include "atomic_file.h"
#include "torch_file.h"

#include <filesystem>
#include <stdexcept>

namespace qkv_train {
namespace fs = std::filesystem;

void save_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     const qkv::GradScaler& scaler, const CheckpointState& state) {
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
    archive.write("step", torch::tensor(state.step, torch::kLong));
    archive.write("initial_loss", torch::tensor(state.initial_loss, torch::kDouble));
    archive.write("last_loss", torch::tensor(state.last_loss, torch::kDouble));
    archive.write("options", c10::IValue(state.options.dump()));
    archive.write("task_state", c10::IValue(state.task_state.dump()));
    archive.write("cpu_rng_state", at::detail::getDefaultCPUGenerator().get_state());
    std::vector<char> bytes;
    archive.save_to([&](const void* data, size_t size) -> size_t {
      bytes.insert(bytes.end(), static_cast<const char*>(data), static_cast<const char*>(data) + size);
      return size;
    });
    qkv::detail::write_file_atomically(path, bytes.data(), bytes.size());
  } catch (const c10::Error& e) {
    throw std::runtime_error("cannot write checkpoint " + path + ": " + e.what_without_backtrace());
  }
}

namespace {

torch::serialize::InputArchive open_archive(const std::string& dir) {
  const auto path = (fs::path(dir) / kCheckpointFile).string();
  if (!fs::exists(path)) throw std::runtime_error("--resume: no checkpoint at " + path);
  try {
    // Read by qkv, not by LibTorch's importer, which compiles the file's code (torch_file.h).
    return qkv::detail::read_serialize_archive(qkv::detail::read_file_bytes(path, "--resume"), path);
  } catch (const c10::Error& e) {
    throw std::runtime_error("--resume: " + path + " is not a readable checkpoint: " + e.what_without_backtrace());
  } catch (const std::exception& e) {  // e.g. std::bad_alloc
    throw std::runtime_error("--resume: " + path + " is not a readable checkpoint: " + e.what());
  }
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

}  // namespace

CheckpointState read_checkpoint_state(const std::string& dir) {
  auto archive = open_archive(dir);
  try {
    return read_state(archive);
  } catch (const std::exception& e) {
    throw std::runtime_error("--resume: " + (fs::path(dir) / kCheckpointFile).string() +
                             " is not a qkv-train checkpoint: " + e.what());
  }
}

CheckpointState load_checkpoint_model(const std::string& dir, torch::nn::Module& model) {
  auto archive = open_archive(dir);
  try {
    torch::serialize::InputArchive model_archive;
    archive.read("model", model_archive);
    model.load(model_archive);
    return read_state(archive);
  } catch (const std::exception& e) {
    throw std::runtime_error("--resume: cannot load the model of " + (fs::path(dir) / kCheckpointFile).string() +
                             ": " + e.what());
  }
}

CheckpointState load_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                qkv::GradScaler& scaler) {
  auto archive = open_archive(dir);
  try {
    torch::serialize::InputArchive model_archive, optimizer_archive;
    archive.read("model", model_archive);
    archive.read("optimizer", optimizer_archive);
    model.load(model_archive);
    optimizer.load(optimizer_archive);
    torch::serialize::InputArchive scaler_archive;
    if (scaler.is_enabled() && archive.try_read("grad_scaler", scaler_archive)) scaler.load(scaler_archive);
    torch::Tensor rng_state;
    archive.read("cpu_rng_state", rng_state);
    auto generator = at::detail::getDefaultCPUGenerator();  // a handle; the state it sets is shared
    generator.set_state(rng_state);
    return read_state(archive);
  } catch (const c10::Error& e) {
    throw std::runtime_error("--resume: cannot load " + (fs::path(dir) / kCheckpointFile).string() + ": " +
                             e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw std::runtime_error("--resume: cannot load " + (fs::path(dir) / kCheckpointFile).string() + ": " + e.what());
  }
}

}  // namespace qkv_train
