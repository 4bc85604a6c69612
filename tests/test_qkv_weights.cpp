// qkv-weights run as a user runs it.
#include "support/apps.h"
#include "support/fixtures.h"

#include <gmock/gmock.h>

#include <unistd.h>

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

// What a user does with nn.MultiheadAttention weights of other key and value widths (written by
// PyTorch, scripts/gen_reference.py): inspect them, run them on PyTorch's inputs (PyTorch's output
// to 1e-6), and convert them to qkv's layout, which loads into the module and gives the same output.
TEST(WeightsApp, InspectsRunsAndConvertsMultiheadAttentionWeights) {
  const std::string tool = QKV_WEIGHTS_PATH;
  const std::string weights = qkv_test::data_path("interop_mha_cross_weights.pt");
  const std::string inputs = qkv_test::data_path("interop_mha_cross_io.pt");
  const auto dir = std::filesystem::temp_directory_path() / ("qkv_weights_app_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);

  auto inspect = qkv_test::run_command(tool + " inspect " + weights, /*merge_stderr=*/true);
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_THAT(inspect.output, HasSubstr("nn.MultiheadAttention layout, 6 tensors"));
  EXPECT_THAT(inspect.output, ::testing::ContainsRegex("k_proj_weight +\\[16, 8\\] +Float"));
  EXPECT_THAT(inspect.output, ::testing::ContainsRegex("in_proj_bias +\\[48\\] +Float"));

  const qkv_test::Fixture data("interop_mha_cross_io.pt");
  const auto expected = data.tensor("output");
  const auto output = (dir / "output.pt").string(), converted = (dir / "converted.pt").string();
  auto forward = qkv_test::run_command(tool + " forward " + weights + " " + inputs + " " + output + " --heads 4",
                                       /*merge_stderr=*/true);
  ASSERT_EQ(forward.exit_code, 0) << forward.output;
  EXPECT_TRUE(qkv_test::tensors_close(qkv::read_tensor_dict(output).at("output"), expected, 1e-6));

  auto convert = qkv_test::run_command(tool + " convert " + weights + " " + converted + " --heads 4",
                                       /*merge_stderr=*/true);
  ASSERT_EQ(convert.exit_code, 0) << convert.output;
  const auto tensors = qkv::read_tensor_dict(converted);
  EXPECT_EQ(qkv::detect_layout(tensors), qkv::StateDictLayout::Documents);
  qkv::SelfAttention module(qkv::SelfAttentionOptions(16).num_heads(4).out_proj(true).kdim(8).vdim(8));
  qkv::load_state_dict(module, tensors, converted);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(qkv_test::tensors_close(module(data.tensor("query"), data.tensor("context")), expected, 1e-6));
  std::filesystem::remove_all(dir);
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
