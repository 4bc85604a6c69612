// What qkv's command-line programs share: CLI11 error handling (one line, exit status 2) and the
// names of dtypes.
#pragma once

#include <torch/types.h>
#include <CLI/CLI.hpp>

#include <optional>
#include <string>
#include <vector>

namespace qkv_cli {

/// Parses `argv` with `app`. Returns nullopt when the program should go on, else the exit status:
/// 0 after --help, 2 after a bad command line, reported as one line "<program>: error: ... (see --help)".
std::optional<int> parse(CLI::App& app, int argc, const char* const* argv);

/// Prints "<program>: error: <message> (see --help)" as one line on stderr and returns 2.
int usage_error(const std::string& program, const std::string& message);

/// The dtype names the programs accept, and the dtype each stands for.
const std::vector<std::string>& dtype_names();               // float32, float64, bfloat16, float16
torch::ScalarType dtype_from_name(const std::string& name);  // throws std::invalid_argument for others

}  // namespace qkv_cli
