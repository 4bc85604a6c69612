// qkv-train's command line.
#pragma once

#include "run_config.h"

#include <optional>
#include <string>

namespace qkv_train {

class CheckpointFile;  // checkpoint.h

/// Parses and checks the command line into `config` (task defaults applied; with --resume, the
/// checkpoint's options merged in) and sets spdlog's level. Returns -1 when the run should go on,
/// else the exit status: 0 after --help, 2 for a bad command line (one line on stderr; a --resume
/// folder without a checkpoint included), 1 when the checkpoint named by --resume cannot be read.
/// With `resume_checkpoint`, a run that goes on gets --resume's checkpoint there, to load the
/// weights from the bytes whose options were checked (see CheckpointFile).
int parse_command_line(int argc, const char* const* argv, RunConfig& config,
                       std::optional<CheckpointFile>* resume_checkpoint = nullptr);

/// Why `config` cannot train on `world_size` data-parallel processes ("" when it can).
std::string distributed_option_problem(const RunConfig& config, int world_size);

}  // namespace qkv_train
