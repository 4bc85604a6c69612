// Running the apps from tests: a command line in, exit status and output out.
#pragma once

#include <string>

namespace qkv_test {

struct ProcessResult {
  int exit_code = -1;   // the program's exit status, or 128 + signal when it was killed
  std::string output;   // stdout (stderr too when merged)
};

/// Runs `command` through /bin/sh; with merge_stderr, stderr is captured after stdout.
ProcessResult run_command(const std::string& command, bool merge_stderr = false);

}  // namespace qkv_test
