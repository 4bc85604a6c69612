// qkv-train run as a user runs it: its output, JSON summary and exit codes.
#include "support/fixtures.h"
#include "support/process.h"

#include <gmock/gmock.h>
#include <nlohmann/json.hpp>

#include <fstream>

namespace {

using ::testing::HasSubstr;

qkv_test::ProcessResult train(const std::string& arguments, bool merge_stderr = false) {
  return qkv_test::run_command(std::string(QKV_TRAIN_PATH) + " " + arguments, merge_stderr);
}

nlohmann::json python_seed_example() {
  std::ifstream file(qkv_test::data_path("seed_example.json"));
  return nlohmann::json::parse(file);
}

TEST(TrainApp, SeedTaskPrintsThePythonExamplesLines) {
  const auto expected = python_seed_example();
  auto run = train("--task seed --device cpu");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("Input shape: torch.Size([4, 8])"));
  EXPECT_THAT(run.output, HasSubstr("Output shape: torch.Size([4, 8])"));
  // Python prints the float's shortest round-trip form; so does qkv-train.
  const double printed = std::stod(run.output.substr(run.output.find("Loss: ") + 6));
  EXPECT_NEAR(printed, expected["loss"].get<double>(), 1e-6) << run.output;
}

TEST(TrainApp, SeedTaskJsonMatchesPythonLoss) {
  const auto expected = python_seed_example();
  auto run = train("--device cpu --json");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto summary = nlohmann::json::parse(run.output);  // stdout is exactly one JSON object
  EXPECT_EQ(summary["task"], "seed");
  EXPECT_EQ(summary["steps"], 1);
  EXPECT_EQ(summary["device"], "cpu");
  EXPECT_NEAR(summary["initial_loss"].get<double>(), expected["loss"].get<double>(), 1e-6);
  EXPECT_EQ(summary["input_shape"], expected["input_shape"]);
  EXPECT_EQ(summary["output_shape"], expected["output_shape"]);
}

TEST(TrainApp, MoreStepsLowerTheLoss) {
  auto run = train("--device cpu --steps 50 --lr 0.05 --json --log-level off");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto summary = nlohmann::json::parse(run.output);
  EXPECT_EQ(summary["steps"], 50);
  EXPECT_LT(summary["final_loss"].get<double>(), 0.8 * summary["initial_loss"].get<double>());
}

TEST(TrainApp, OptionsChangeTheRun) {
  auto run = train("--device cpu --seed 7 --d-model 16 --seq-len 6 --json");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto summary = nlohmann::json::parse(run.output);
  EXPECT_EQ(summary["output_shape"], nlohmann::json::array({6, 16}));
  EXPECT_GT(summary["initial_loss"].get<double>(), 0.0);
}

TEST(TrainApp, BadCommandLinesExitWithStatus2AndOneLine) {
  for (const std::string arguments :
       {"--steps 0", "--task nope", "--device tpu", "--lr -1", "--d-model abc", "--no-such-option", "--seq-len"}) {
    auto run = train(arguments, /*merge_stderr=*/true);
    EXPECT_EQ(run.exit_code, 2) << arguments << ": " << run.output;
    EXPECT_THAT(run.output, HasSubstr("qkv-train: error:")) << arguments;
    EXPECT_EQ(std::count(run.output.begin(), run.output.end(), '\n'), 1) << arguments << ": " << run.output;
  }
}

TEST(TrainApp, MissingCudaIsARuntimeError) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "CUDA is available here";
  auto run = train("--device cuda", /*merge_stderr=*/true);
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("no CUDA device"));
}

TEST(TrainApp, HelpListsOptionsWithDefaults) {
  auto run = train("--help");
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_THAT(run.output, HasSubstr("--steps"));
  EXPECT_THAT(run.output, HasSubstr("42"));  // the default seed is shown
}

}  // namespace
