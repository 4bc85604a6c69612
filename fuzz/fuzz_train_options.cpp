// libFuzzer target: arbitrary bytes as qkv-train's command line (arguments separated by '\n').
// Parsing must end in a run configuration or an exit status, never a crash.
#include "qkv-train/cli.h"

#include <spdlog/spdlog.h>

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = [] {
    spdlog::set_level(spdlog::level::off);
    return true;
  }();
  (void)quiet;
  std::vector<std::string> arguments{"qkv-train"};
  std::string current;
  for (size_t i = 0; i < size; ++i) {
    const char c = static_cast<char>(data[i]);
    if (c == '\n') {
      arguments.push_back(current);
      current.clear();
    } else if (c != '\0') {
      current += c;
    }
  }
  if (!current.empty()) arguments.push_back(current);
  std::vector<const char*> argv;
  for (const auto& argument : arguments) argv.push_back(argument.c_str());
  if (std::find(arguments.begin(), arguments.end(), "--help") != arguments.end() ||
      std::find(arguments.begin(), arguments.end(), "-h") != arguments.end()) {
    return 0;  // help prints and exits 0: nothing to find there, and it floods the log
  }
  qkv_train::RunConfig config;
  qkv_train::parse_command_line(static_cast<int>(argv.size()), argv.data(), config);
  return 0;
}
