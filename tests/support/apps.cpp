#include "support/apps.h"

#include <qkv/qkv.h>

#include <gtest/gtest.h>

#include <unistd.h>

#include <fstream>
#include <sstream>

namespace qkv_test {

ProcessResult train(const std::string& arguments, bool merge_stderr) {
  return run_command(std::string(QKV_TRAIN_PATH) + " " + arguments, merge_stderr);
}

fs::path fresh_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("qkv_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir;
}

std::string read_file(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

std::vector<std::vector<std::string>> read_csv(const fs::path& path) {
  std::vector<std::vector<std::string>> rows;
  std::ifstream file(path);
  std::string line;
  while (std::getline(file, line)) {
    std::vector<std::string> cells;
    std::stringstream stream(line);
    std::string cell;
    while (std::getline(stream, cell, ',')) cells.push_back(cell);
    if (!line.empty() && line.back() == ',') cells.emplace_back();
    rows.push_back(cells);
  }
  return rows;
}

std::map<int64_t, std::string> losses_by_step(const fs::path& metrics) {
  std::map<int64_t, std::string> losses;
  auto rows = read_csv(metrics);
  for (size_t i = 1; i < rows.size(); ++i) {
    if (!rows[i][1].empty()) losses[std::stoll(rows[i][0])] = rows[i][1];
  }
  return losses;
}

std::map<int64_t, double> column_by_step(const std::vector<std::vector<std::string>>& rows, const std::string& name) {
  std::map<int64_t, double> values;
  if (rows.empty()) return values;
  const auto at = std::find(rows[0].begin(), rows[0].end(), name);
  if (at == rows[0].end()) return values;
  const auto index = static_cast<size_t>(at - rows[0].begin());
  for (size_t i = 1; i < rows.size(); ++i) {
    if (index < rows[i].size() && !rows[i][index].empty()) values[std::stoll(rows[i][0])] = std::stod(rows[i][index]);
  }
  return values;
}

bool is_png(const fs::path& path) {
  const auto bytes = read_file(path);
  return bytes.size() > 1000 && bytes.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0;
}

double max_weight_difference(const fs::path& a, const fs::path& b) {
  const auto left = qkv::read_tensor_dict(a.string()), right = qkv::read_tensor_dict(b.string());
  EXPECT_EQ(left.size(), right.size());
  double difference = 0;
  for (const auto& [key, tensor] : left) {
    difference = std::max(difference, (tensor - right.at(key)).abs().max().item<double>());
  }
  return difference;
}

}  // namespace qkv_test
