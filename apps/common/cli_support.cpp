#include "common/cli_support.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

namespace qkv_cli {

int usage_error(const std::string& program, const std::string& message) {
  std::string line = message;
  std::replace(line.begin(), line.end(), '\n', ' ');
  std::fprintf(stderr, "%s: error: %s (see --help)\n", program.c_str(), line.c_str());
  return 2;
}

std::optional<int> parse(CLI::App& app, int argc, const char* const* argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return usage_error(app.get_name(), e.what());
  }
  return std::nullopt;
}

const std::vector<std::string>& dtype_names() {
  static const std::vector<std::string> names{"float32", "float64", "bfloat16", "float16"};
  return names;
}

torch::ScalarType dtype_from_name(const std::string& name) {
  if (name == "float32") return torch::kFloat;
  if (name == "float64") return torch::kDouble;
  if (name == "bfloat16") return torch::kBFloat16;
  if (name == "float16") return torch::kHalf;
  throw std::invalid_argument("unknown dtype " + name + " (float32, float64, bfloat16 or float16)");
}

}  // namespace qkv_cli
