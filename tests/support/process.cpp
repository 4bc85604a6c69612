#include "support/process.h"

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <stdexcept>

namespace qkv_test {

ProcessResult run_command(const std::string& command, bool merge_stderr) {
  const std::string full = command + (merge_stderr ? " 2>&1" : " 2>/dev/null");
  FILE* pipe = popen(full.c_str(), "r");
  if (!pipe) throw std::runtime_error("cannot run " + command);
  ProcessResult result;
  std::array<char, 4096> buffer{};
  size_t count = 0;
  while ((count = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), count);
  const int status = pclose(pipe);
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.exit_code = 128 + WTERMSIG(status);
  return result;
}

}  // namespace qkv_test
