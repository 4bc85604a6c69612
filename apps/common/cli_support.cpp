#include "common/cli_support.h"

#include <qkv/functional.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace qkv_cli {

std::string route_setting_problem() {
  try {
    (void)qkv::tiled_instruction_set();  // reads QKV_TILED_ISA
    (void)qkv::linear_products();        // reads QKV_LINEAR_GEMM
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

CLI::Validator real_in(double lower, double upper, bool lower_open) {
  char expected[96], interval[64];
  std::snprintf(expected, sizeof expected, "a finite number %s %g and <= %g", lower_open ? ">" : ">=", lower, upper);
  std::snprintf(interval, sizeof interval, "%s%g - %g]", lower_open ? "(" : "[", lower, upper);  // as CLI11's Range
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        double value = 0.0;
        const bool number = CLI::detail::lexical_cast(text, value);
        const bool inside = number && std::isfinite(value) && (lower_open ? value > lower : value >= lower) &&
                            value <= upper;
        return inside ? std::string() : std::string("expected ") + expected + ", got " + text;
      },
      std::string("FLOAT in ") + interval);
}

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

bool keep_freed_memory_for_reuse() {
#if defined(__GLIBC__)
  // The thresholds as the environment may set them; other malloc tunables (glibc.malloc.hugetlb,
  // say) leave them to this.
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr || std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr ||
      (tunables != nullptr && (std::strstr(tunables, "glibc.malloc.mmap_threshold") != nullptr ||
                               std::strstr(tunables, "glibc.malloc.trim_threshold") != nullptr))) {
    return false;
  }
  constexpr int kMmapThreshold = 32 << 20;  // glibc's largest dynamic threshold on 64-bit
  constexpr int kTrimThreshold = 256 << 20;
  return mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 && mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1;
#else
  return false;
#endif
}

}  // namespace qkv_cli
