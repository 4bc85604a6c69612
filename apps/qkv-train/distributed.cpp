#include "distributed.h"

#include "torch_compat.h"

#include <spdlog/spdlog.h>

#if defined(QKV_WITH_C10D)
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif
#if defined(QKV_WITH_GLOO)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if defined(QKV_WITH_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <limits>

namespace qkv_train {

namespace {

// c10::Error's what() carries a C++ backtrace after the first line; error messages keep the reason only.
std::string first_line(const char* text) {
  const std::string all = text;
  return all.substr(0, all.find('\n'));
}

// Reads one integer variable. Unset: `fallback` when given, else an error naming the variable.
int env_int(const EnvLookup& lookup, const char* name, int min, int max, std::optional<int> fallback = {}) {
  const char* text = lookup(name);
  if (text == nullptr || *text == '\0') {
    if (fallback) return *fallback;
    throw DistributedConfigError(
        fmt::format("the distributed environment lacks {} (torchrun sets RANK, WORLD_SIZE, "
                    "MASTER_ADDR and MASTER_PORT; see README, \"Training on several "
                    "processes or machines\")",
                    name));
  }
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || value < min || value > max) {
    throw DistributedConfigError(fmt::format("{}='{}': expected a whole number from {} to {}", name, text, min, max));
  }
  return static_cast<int>(value);
}

}  // namespace

std::optional<DistributedEnv> read_distributed_env(const EnvLookup& lookup) {
  const auto is_set = [&](const char* name) {
    const char* text = lookup(name);
    return text != nullptr && *text != '\0';
  };
  if (!is_set("RANK") && !is_set("WORLD_SIZE")) return std::nullopt;
  if (is_set("RANK") != is_set("WORLD_SIZE")) {
    throw DistributedConfigError(is_set("RANK") ? "RANK is set but WORLD_SIZE is not: a distributed run needs both"
                                                : "WORLD_SIZE is set but RANK is not: a distributed run needs both");
  }
  constexpr int kMaxRanks = 1 << 20;
  DistributedEnv env;
  env.world_size = env_int(lookup, "WORLD_SIZE", 1, kMaxRanks);
  env.rank = env_int(lookup, "RANK", 0, kMaxRanks);
  if (env.rank >= env.world_size) {
    throw DistributedConfigError(fmt::format("RANK={} with WORLD_SIZE={}: expected a rank from 0 to {}", env.rank,
                                             env.world_size, env.world_size - 1));
  }
  // Without torchrun's per-machine variables, assume one machine.
  env.local_world_size = env_int(lookup, "LOCAL_WORLD_SIZE", 1, env.world_size, env.world_size);
  env.local_rank = env_int(lookup, "LOCAL_RANK", 0, kMaxRanks, env.rank % env.local_world_size);
  if (env.local_rank >= env.local_world_size) {
    throw DistributedConfigError(
        fmt::format("LOCAL_RANK={} with LOCAL_WORLD_SIZE={}: expected a local rank from 0 to {}", env.local_rank,
                    env.local_world_size, env.local_world_size - 1));
  }
  const char* addr = lookup("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0') {
    throw DistributedConfigError(
        "the distributed environment lacks MASTER_ADDR (the host of rank 0, e.g. 127.0.0.1 "
        "on one machine)");
  }
  env.master_addr = addr;
  env.master_port = env_int(lookup, "MASTER_PORT", 1, 65535);
  return env;
}

std::optional<DistributedEnv> read_distributed_env() {
  return read_distributed_env([](const char* name) { return std::getenv(name); });
}

bool has_distributed_backend(const std::string& backend) {
#if defined(QKV_WITH_GLOO)
  if (backend == "gloo") return true;
#endif
#if defined(QKV_WITH_NCCL)
  if (backend == "nccl") return true;
#endif
  return false;
}

Shard shard_of(int64_t batch_size, int rank, int world_size) {
  const int64_t size = batch_size / world_size;
  return {rank * size, size};
}

#if defined(QKV_WITH_C10D)

// The class that implements the collectives (see torch_compat.h); both have the same calls.
#if QKV_TORCH_C10D_BACKEND_CLASS
using Collectives = c10d::Backend;
#else
using Collectives = c10d::ProcessGroup;
#endif

struct DataParallel::Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<Collectives> collectives;
};

namespace {

std::string seconds(std::chrono::milliseconds timeout) { return fmt::format("{:g} s", timeout.count() / 1000.0); }

// The same flat buffer layout for broadcast and all-reduce: parameters (or gradients) one after
// the other, in a dtype at least as precise as float32 so that sums of bf16 gradients stay exact enough.
torch::ScalarType buffer_dtype(const std::vector<torch::Tensor>& tensors) {
  return tensors.empty() ? torch::kFloat : torch::promote_types(tensors.front().scalar_type(), torch::kFloat);
}

}  // namespace

DataParallel::DataParallel(const DistributedEnv& env, const std::string& backend, std::chrono::milliseconds timeout)
    : env_(env), backend_(backend), timeout_(timeout), group_(std::make_unique<Group>()) {
  if (!has_distributed_backend(backend)) {
    throw DistributedConfigError("--dist-backend " + backend + ": this build of qkv-train has no " + backend +
                                 " process group (gloo needs gloo's headers at build time, nccl a CUDA LibTorch)");
  }
  const auto where = fmt::format("rank {} of {}", env.rank, env.world_size);
  try {
    // As torch.distributed's env:// rendezvous: under torchrun the launcher already hosts a store
    // at MASTER_ADDR:MASTER_PORT, which the ranks share under a per-attempt prefix; otherwise
    // rank 0 hosts it.
    const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    const bool use_agent_store = agent_store != nullptr && std::string(agent_store) == "True";
    c10d::TCPStoreOptions options;
    options.port = static_cast<std::uint16_t>(env.master_port);
    options.isServer = env.rank == 0 && !use_agent_store;
    options.numWorkers = static_cast<std::size_t>(env.world_size);
    options.waitWorkers = !use_agent_store;
    options.timeout = timeout;
    qkv::compat::use_classic_tcp_store(options);
    auto store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
    if (use_agent_store) {
      const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
      group_->store = c10::make_intrusive<c10d::PrefixStore>(
          std::string("/worker/attempt_") + (restart != nullptr ? restart : "0"), store);
    } else {
      group_->store = store;
    }
  } catch (const std::exception& e) {
    // LibTorch 2.x's store waits for every rank at construction; 1.13's fails later, in the
    // process group: both say what to check.
    throw DistributedError(
        fmt::format("{}: the rendezvous at {}:{} failed within --dist-timeout {}: {} (were all "
                    "{} ranks started, with the same MASTER_ADDR and MASTER_PORT?)",
                    where, env.master_addr, env.master_port, seconds(timeout), first_line(e.what()), env.world_size));
  }
  try {
#if defined(QKV_WITH_GLOO)
    if (backend == "gloo") {
      auto options = c10d::ProcessGroupGloo::Options::create(timeout);
      // As torch.distributed: GLOO_SOCKET_IFNAME picks the network interface, else the address
      // this machine's hostname resolves to (loopback when it resolves to none).
      const char* interface = std::getenv("GLOO_SOCKET_IFNAME");
      options->devices.push_back(interface != nullptr && *interface != '\0'
                                     ? c10d::ProcessGroupGloo::createDeviceForInterface(interface)
                                     : c10d::ProcessGroupGloo::createDefaultDevice());
      group_->collectives =
          c10::make_intrusive<c10d::ProcessGroupGloo>(group_->store, env.rank, env.world_size, options);
    }
#endif
#if defined(QKV_WITH_NCCL)
    if (backend == "nccl") {
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = timeout;
      group_->collectives =
          c10::make_intrusive<c10d::ProcessGroupNCCL>(group_->store, env.rank, env.world_size, options);
    }
#endif
  } catch (const std::exception& e) {
    throw DistributedError(
        fmt::format("{}: cannot form the {} process group within --dist-timeout {}: {} (were all "
                    "{} ranks started, with the same MASTER_ADDR and MASTER_PORT?)",
                    where, backend, seconds(timeout), first_line(e.what()), env.world_size));
  }
  spdlog::debug("{}: joined the {} process group at {}:{}", where, backend, env.master_addr, env.master_port);
}

DataParallel::~DataParallel() = default;

namespace {

// Runs one collective and waits for it; turns every failure into a DistributedError that says
// which collective of which rank failed and the likely reason.
template <typename Launch>
void run_collective(const DistributedEnv& env, std::chrono::milliseconds timeout, int64_t index, const char* what,
                    Launch&& launch) {
  try {
    auto work = launch();
    work->wait(timeout);
  } catch (const std::exception& e) {
    throw DistributedError(
        fmt::format("rank {} of {}: the {} (collective #{}) failed: {}; another rank stopped, died or is more than "
                    "--dist-timeout {} behind",
                    env.rank, env.world_size, what, index, first_line(e.what()), seconds(timeout)));
  }
}

}  // namespace

void DataParallel::broadcast_from_main(const std::vector<torch::Tensor>& tensors) {
  torch::NoGradGuard no_grad;
  const auto dtype = buffer_dtype(tensors);
  std::vector<torch::Tensor> pieces;
  for (const auto& t : tensors) pieces.push_back(t.detach().reshape(-1).to(dtype));
  std::vector<torch::Tensor> buffer{torch::cat(pieces)};
  c10d::BroadcastOptions options;
  options.rootRank = 0;
  run_collective(env_, timeout_, ++collectives_, "broadcast of the parameters",
                 [&] { return group_->collectives->broadcast(buffer, options); });
  int64_t offset = 0;
  for (const auto& t : tensors) {
    t.copy_(buffer[0].narrow(0, offset, t.numel()).view_as(t));
    offset += t.numel();
  }
}

DataParallel::StepReduction DataParallel::average_gradients(const std::vector<torch::Tensor>& parameters,
                                                            double local_loss, int local_stop_signal) {
  torch::NoGradGuard no_grad;
  const auto dtype = buffer_dtype(parameters);
  const auto device = parameters.empty() ? torch::Device(torch::kCPU) : parameters.front().device();
  std::vector<torch::Tensor> pieces;
  for (const auto& p : parameters) {
    pieces.push_back(p.grad().defined() ? p.grad().detach().reshape(-1).to(dtype)
                                        : torch::zeros({p.numel()}, p.options().dtype(dtype)));
  }
  // Riding along: the loss, and whether this rank was asked to stop (by SIGINT, by SIGTERM).
  pieces.push_back(
      torch::tensor({local_loss, local_stop_signal == SIGINT ? 1.0 : 0.0, local_stop_signal == SIGTERM ? 1.0 : 0.0},
                    torch::TensorOptions().dtype(torch::kDouble))
          .to(device, dtype));
  std::vector<torch::Tensor> buffer{torch::cat(pieces)};
  run_collective(env_, timeout_, ++collectives_, "all-reduce of the gradients",
                 [&] { return group_->collectives->allreduce(buffer, c10d::AllreduceOptions()); });
  auto& flat = buffer[0];
  flat.div_(env_.world_size);
  int64_t offset = 0;
  for (const auto& p : parameters) {
    auto mean = flat.narrow(0, offset, p.numel()).view_as(p).to(p.scalar_type());
    if (p.grad().defined()) {
      p.mutable_grad().copy_(mean);
    } else {
      p.mutable_grad() = mean.clone();
    }
    offset += p.numel();
  }
  const auto extras = flat.narrow(0, offset, 3).to(torch::kCPU, torch::kDouble);
  StepReduction reduction;
  reduction.mean_loss = extras[0].item<double>();
  if (extras[1].item<double>() > 0) {
    reduction.stop_signal = SIGINT;
  } else if (extras[2].item<double>() > 0) {
    reduction.stop_signal = SIGTERM;
  }
  return reduction;
}

void DataParallel::barrier() {
  run_collective(env_, timeout_, ++collectives_, "barrier",
                 [&] { return group_->collectives->barrier(c10d::BarrierOptions()); });
}

#else  // no c10d headers in this build

struct DataParallel::Group {};

DataParallel::DataParallel(const DistributedEnv& env, const std::string& backend, std::chrono::milliseconds timeout)
    : env_(env), backend_(backend), timeout_(timeout) {
  throw DistributedConfigError(
      "this build of qkv-train has no distributed support (c10d's headers were not found "
      "when it was built)");
}
DataParallel::~DataParallel() = default;
void DataParallel::broadcast_from_main(const std::vector<torch::Tensor>&) {}
DataParallel::StepReduction DataParallel::average_gradients(const std::vector<torch::Tensor>&, double local_loss, int) {
  return {local_loss, 0};
}
void DataParallel::barrier() {}

#endif

}  // namespace qkv_train
