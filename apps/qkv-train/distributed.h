// Data-parallel training for qkv-train on c10d, PyTorch's distributed engine: the rendezvous
// (torchrun's environment, c10d's TCPStore), the process group (Gloo, or NCCL in CUDA builds),
// and the collectives a training step needs. Every difference between LibTorch 1.13 and 2.x's
// c10d API is handled in distributed.cpp and nowhere else.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace qkv_train {

/// A distributed environment that is missing something or malformed. Its message names the
/// variable, what was expected and what came.
class DistributedConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A collective or the rendezvous failed: a rank died, never arrived, or timed out.
class DistributedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Where this process sits in a job, as torchrun describes it in the environment.
struct DistributedEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;
  int master_port = 0;
};

using EnvLookup = std::function<const char*(const char*)>;

/// Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun's
/// names). Returns nullopt when none of RANK / WORLD_SIZE is set (a plain single-process run).
/// Throws DistributedConfigError when some are set but the set is incomplete or malformed.
std::optional<DistributedEnv> read_distributed_env(const EnvLookup& lookup);
std::optional<DistributedEnv> read_distributed_env();  // from the process environment

/// Whether this build of qkv-train has c10d process groups ("gloo", "nccl").
bool has_distributed_backend(const std::string& backend);

/// One replica's view of a data-parallel job. All ranks must call the collectives in the same
/// order. Every failure (a dead or missing rank, a timeout) throws DistributedError naming it.
class DataParallel {
 public:
  /// Joins the job: a TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 hosts it) and a process group
  /// of `backend` ("gloo" or "nccl"). Gives up after `timeout` when a rank does not arrive.
  DataParallel(const DistributedEnv& env, const std::string& backend, std::chrono::milliseconds timeout);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  bool is_main() const { return env_.rank == 0; }
  const std::string& backend() const { return backend_; }

  /// Copies rank 0's values into every rank's `tensors` (one broadcast of a flat buffer).
  void broadcast_from_main(const std::vector<torch::Tensor>& tensors);

  /// What the ranks agreed on in one step's all-reduce.
  struct StepReduction {
    double mean_loss = 0.0;  // the mean of the ranks' losses: the loss of the whole batch
    int stop_signal = 0;     // a stop signal one of the ranks received (SIGINT before SIGTERM), or 0
  };

  /// Replaces each parameter's gradient by its mean over the ranks, in one all-reduce of a flat
  /// buffer that also carries the ranks' losses and stop requests (so every rank logs the same
  /// loss and stops at the same step). Parameters without a gradient count as zero.
  StepReduction average_gradients(const std::vector<torch::Tensor>& parameters, double local_loss,
                                  int local_stop_signal);

  /// Waits until every rank gets here.
  void barrier();

 private:
  struct Group;
  DistributedEnv env_;
  std::string backend_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<Group> group_;
  int64_t collectives_ = 0;  // for error messages: which collective failed
};

/// The slice of `batch_size` examples that `rank` of `world_size` trains on: [begin, begin + size).
struct Shard {
  int64_t begin = 0;
  int64_t size = 0;
};
Shard shard_of(int64_t batch_size, int rank, int world_size);

}  // namespace qkv_train
