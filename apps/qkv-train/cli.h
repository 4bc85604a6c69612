// qkv-train's command line.
#pragma once

#include "run_config.h"

#include <string>

namespace qkv_train {

/// Parses and checks the command line into `config` (task defaults applied; with --resume, the
/// checkpoint's options merged in) and sets spdlog's level. Returns -1 when the run should go on,
/// else the exit status: 0 after --help, 2 for a bad command line (one line on stderr), 1 when a
/// checkpoint named by --resume cannot be read.
int parse_command_line(int argc, const char* const* argv, RunConfig& config);

/// Why `config` cannot train on `world_size` data-parallel processes ("" when it can).
std::string distributed_option_problem(const RunConfig& config, int world_size);

}  // namespace qkv_train
