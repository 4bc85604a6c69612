// qkv-train --nproc N: a one-machine launcher for data-parallel runs, doing what
// `torchrun --nproc_per_node N` does for qkv-train without needing Python.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace qkv_train {

/// The command line with --nproc (as "--nproc N" or "--nproc=N") taken out: what each rank runs.
std::vector<std::string> arguments_without_nproc(int argc, const char* const* argv);

/// Starts `nproc` copies of this program (`arguments`, argv[0] first) as ranks 0..nproc-1 of one
/// job on this machine, with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
/// LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT = a free port). Forwards SIGINT and
/// SIGTERM to the ranks. When a rank fails, the others are sent SIGTERM and, if still running
/// after `grace`, SIGKILL. Returns 0 when every rank succeeded, else the first failure's exit
/// status (128 + signal for a rank killed by a signal). Throws std::runtime_error when a rank
/// cannot be started.
int launch_local_job(int nproc, const std::vector<std::string>& arguments, std::chrono::milliseconds grace);

}  // namespace qkv_train
