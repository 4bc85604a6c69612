// libFuzzer target: arbitrary bytes as qkv-train's checkpoint.pt, resumed into the reverse task's
// model, optimizer and loss scaler as `qkv-train --resume` does, in float32 and in bfloat16 (whose
// optimizer steps on float32 master weights, which the checkpoint carries). Reading must either work or end in
// the std::runtime_error that qkv-train prints ("--resume: ... is not a readable checkpoint: ...");
// a crash, a hang, another exception or a sanitizer report is a bug (turn it into a test).
//
// A checkpoint is a TorchScript archive (torch::serialize::OutputArchive): beside its pickles it
// holds TorchScript source (code/*.py, the archive's class definitions) and their debug pickles,
// which LibTorch's importer compiles and reads. The mutation (fuzz/archive_mutator.h) rewrites
// those entries three times in four, with the CRCs right, so the input reaches past the archive
// check to what the importer trusts.
#include "archive_mutator.h"

#include "qkv-train/checkpoint.h"
#include "qkv-train/cli.h"
#include "qkv-train/task_registry.h"

#include <qkv/precision.h>

#include <spdlog/spdlog.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <vector>

namespace {

namespace fs = std::filesystem;

// The model, optimizer and scaler a resumed run of the seeds' configuration (fuzz/corpus/checkpoints)
// loads into, and a folder of this process's own for the checkpoint file.
struct Resume {
  explicit Resume(const char* dtype) {
    spdlog::set_level(spdlog::level::off);
    const std::vector<const char*> argv{"qkv-train", "--task",  "reverse", "--d-model", "8",     "--seq-len",
                                        "4",         "--batch", "2",       "--steps",   "1",     "--dtype",
                                        dtype};
    if (qkv_train::parse_command_line(static_cast<int>(argv.size()), argv.data(), config) != -1) {
      throw std::logic_error("fuzz_checkpoint_loader: the fixed command line was refused");
    }
    task = qkv_train::find_task(config.task).make(config, torch::kCPU);
    optimizer = task->make_optimizer(config.lr);
    masters = std::make_unique<qkv::MasterWeights>(task->model(), *optimizer);
    const fs::path base = fs::exists("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    dir = base / ("qkv-fuzz-checkpoint-" + std::string(dtype) + "-" + std::to_string(::getpid()));
    fs::create_directories(dir);
  }
  ~Resume() {
    std::error_code ignored;
    fs::remove_all(dir, ignored);
  }

  qkv_train::RunConfig config;
  std::unique_ptr<qkv_train::TrainableTask> task;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<qkv::MasterWeights> masters;  // active in bfloat16
  qkv::GradScaler scaler;  // enabled, so a checkpoint's grad_scaler entry is read
  fs::path dir;
};

bool is_code_or_pickle(const std::string& name) {
  return qkv_fuzz::ends_with(name, ".pkl") || qkv_fuzz::ends_with(name, ".py") ||
         qkv_fuzz::ends_with(name, ".debug_pkl");
}

}  // namespace

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  return qkv_fuzz::mutate_archive(data, size, max_size, seed, is_code_or_pickle);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Resume float32("float32"), bfloat16("bfloat16");
  for (Resume* resume : {&float32, &bfloat16}) {
    {
      std::ofstream file(resume->dir / qkv_train::kCheckpointFile, std::ios::binary | std::ios::trunc);
      file.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    }
    const auto dir = resume->dir.string();
    try {
      qkv_train::CheckpointFile checkpoint(dir);  // read and its state parsed, as the command line does
      qkv_train::load_checkpoint(std::move(checkpoint), resume->task->model(), *resume->optimizer, resume->scaler,
                                 resume->masters.get());
    } catch (const std::runtime_error&) {
      // refused with a message: the expected outcome for damaged input
    }
  }
  return 0;
}
