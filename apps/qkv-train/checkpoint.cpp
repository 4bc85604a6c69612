#include "checkpoint.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>

namespace qkv_train {
namespace fs = std::filesystem;

void save_checkpoint(const std::string& dir, qkv::SelfAttention& model, torch::optim::Optimizer& optimizer,
                     const CheckpointState& state) {
  const auto final_path = fs::path(dir) / kCheckpointFile;
  const auto temporary = fs::path(dir) / (std::string(kCheckpointFile) + ".tmp");
  try {
    torch::serialize::OutputArchive archive;
    torch::serialize::OutputArchive model_archive, optimizer_archive;
    model->save(model_archive);
    optimizer.save(optimizer_archive);
    archive.write("model", model_archive);
    archive.write("optimizer", optimizer_archive);
    archive.write("step", torch::tensor(state.step, torch::kLong));
    archive.write("initial_loss", torch::tensor(state.initial_loss, torch::kDouble));
    archive.write("last_loss", torch::tensor(state.last_loss, torch::kDouble));
    archive.write("options", c10::IValue(state.options.dump()));
    archive.write("cpu_rng_state", at::detail::getDefaultCPUGenerator().get_state());
    archive.save_to(temporary.string());
  } catch (const c10::Error& e) {
    throw std::runtime_error("cannot write checkpoint " + temporary.string() + ": " + e.what_without_backtrace());
  }
  std::error_code error;
  fs::rename(temporary, final_path, error);
  if (error) throw std::runtime_error("cannot rename " + temporary.string() + " to " + final_path.string() + ": " +
                                      error.message());
}

namespace {

torch::serialize::InputArchive open_archive(const std::string& dir) {
  const auto path = (fs::path(dir) / kCheckpointFile).string();
  if (!fs::exists(path)) throw std::runtime_error("--resume: no checkpoint at " + path);
  std::ifstream file(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (!file.good() && !file.eof()) throw std::runtime_error("--resume: cannot read " + path);
  torch::serialize::InputArchive archive;
  try {
    qkv::verify_torch_archive(bytes.data(), bytes.size(), path);
    archive.load_from(bytes.data(), bytes.size());
  } catch (const c10::Error& e) {
    throw std::runtime_error("--resume: " + path + " is not a readable checkpoint: " + e.what_without_backtrace());
  } catch (const std::exception& e) {  // TorchScript's ErrorReport, for damage inside compressed entries
    throw std::runtime_error("--resume: " + path + " is not a readable checkpoint: " + e.what());
  }
  return archive;
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

CheckpointState load_checkpoint(const std::string& dir, qkv::SelfAttention& model,
                                 torch::optim::Optimizer& optimizer) {
  auto archive = open_archive(dir);
  try {
    torch::serialize::InputArchive model_archive, optimizer_archive;
    archive.read("model", model_archive);
    archive.read("optimizer", optimizer_archive);
    model->load(model_archive);
    optimizer.load(optimizer_archive);
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
