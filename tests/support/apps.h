// Running qkv's programs from tests, and reading what they write.
#pragma once

#include "support/process.h"

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace qkv_test {

namespace fs = std::filesystem;

/// qkv-train with `arguments`.
ProcessResult train(const std::string& arguments, bool merge_stderr = false);

/// A fresh (removed) folder in the temporary directory, unique to this test process.
fs::path fresh_dir(const std::string& name);

std::string read_file(const fs::path& path);

/// A CSV file as rows of cells, header first.
std::vector<std::vector<std::string>> read_csv(const fs::path& path);

/// step -> training loss as written, from a metrics.csv.
std::map<int64_t, std::string> losses_by_step(const fs::path& metrics);

/// The column of `rows` named `name` in the header, as numbers keyed by step (empty cells left out).
std::map<int64_t, double> column_by_step(const std::vector<std::vector<std::string>>& rows, const std::string& name);

bool is_png(const fs::path& path);

/// max |a - b| over two weight files with the same keys.
double max_weight_difference(const fs::path& a, const fs::path& b);

}  // namespace qkv_test
