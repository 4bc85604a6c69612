// qkv-weights run as a user runs it.
#include "support/apps.h"
#include "support/fixtures.h"

#include <gmock/gmock.h>

#include <algorithm>
#include <filesystem>

namespace {

using ::testing::HasSubstr;

TEST(WeightsApp, BadCommandLinesExitWith2AndRuntimeFailuresWith1) {
  const std::string tool = QKV_WEIGHTS_PATH;
  const std::string weights = qkv_test::data_path("interop_mha_weights.pt");
  const std::vector<std::pair<std::string, int>> cases = {
      {"", 2},                          // no subcommand
      {"frobnicate", 2},                // unknown subcommand
      {"inspect /no/such/file.pt", 2},  // not an existing file
      {"convert " + weights, 2},        // OUT missing
      {"forward " + weights + " " + weights + " out.pt --heads 0", 2},
      {"inspect " + qkv_test::data_path("seed_example.json"), 1},         // a file, but not torch.save's
      {"convert " + weights + " /tmp/qkv_convert_test.pt --heads 3", 1},  // 16 not divisible by 3
  };
  for (const auto& [arguments, expected] : cases) {
    auto run = qkv_test::run_command(tool + " " + arguments, /*merge_stderr=*/true);
    EXPECT_EQ(run.exit_code, expected) << arguments << ": " << run.output;
    EXPECT_THAT(run.output, HasSubstr("qkv-weights:")) << arguments;
  }
}

// The damaged weights files the fuzzers found (tests/data/fuzz_regressions/, where
// FuzzRegressions checks the library's refusal): qkv-weights refuses each with exit status 1 and
// one line naming the file.
TEST(WeightsApp, DamagedFilesTheFuzzersFoundExitWith1NamingTheFile) {
  const std::string tool = QKV_WEIGHTS_PATH;
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(qkv_test::data_path("fuzz_regressions"))) {
    const auto path = entry.path().string();
    auto run = qkv_test::run_command(tool + " inspect " + path, /*merge_stderr=*/true);
    EXPECT_EQ(run.exit_code, 1) << path << ": " << run.output;
    EXPECT_THAT(run.output, HasSubstr("qkv-weights: ")) << path;
    EXPECT_THAT(run.output, HasSubstr(path));
    EXPECT_EQ(std::count(run.output.begin(), run.output.end(), '\n'), 1) << "one line: " << run.output;
    ++count;
  }
  EXPECT_GE(count, 4);
}

}  // namespace
