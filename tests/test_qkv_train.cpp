// qkv-train run as a user runs it: the documents' example, the toy tasks (files, determinism,
// resume, failures), the sqrt(d_k) experiment and data-parallel training. The language model is
// tested in test_qkv_train_lm.cpp; failure cases that need killing processes are ctest scripts.
#include "common/cli_support.h"
#include "qkv-train/checkpoint.h"
#include "torch_compat.h"
#include "qkv-train/cli.h"
#include "qkv-train/task_registry.h"
#include "support/apps.h"
#include "support/fixtures.h"

#include <gmock/gmock.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <tuple>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace {

using ::testing::HasSubstr;
using namespace qkv_test;

nlohmann::json python_seed_example() {
  std::ifstream file(qkv_test::data_path("seed_example.json"));
  return nlohmann::json::parse(file);
}

// qkv-train's allocator setting (apps/common/cli_support.h): from glibc's own first threshold
// (128 KiB, fixed here so that earlier tests' frees do not raise it), a 16 MiB block is served
// from the heap, not by a fresh mapping (mallinfo2's hblks counts mapped blocks), and stays in the
// heap once freed; with a threshold in the environment (a variable or a tunable) it leaves malloc
// alone, and with another malloc tunable only (huge pages) it does not.
TEST(TrainApp, FreedMemoryStaysInTheHeapForTheNextStep) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 33)
  if (std::getenv("GLIBC_TUNABLES") != nullptr || std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
      std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) {
    GTEST_SKIP() << "malloc's thresholds are set by the environment";
  }
  ASSERT_EQ(setenv("MALLOC_MMAP_THRESHOLD_", "131072", 1), 0);
  EXPECT_FALSE(qkv_cli::keep_freed_memory_for_reuse());
  ASSERT_EQ(unsetenv("MALLOC_MMAP_THRESHOLD_"), 0);
  for (const char* threshold :
       {"glibc.malloc.mmap_threshold=131072", "glibc.malloc.hugetlb=1:glibc.malloc.trim_threshold=0"}) {
    ASSERT_EQ(setenv("GLIBC_TUNABLES", threshold, 1), 0);
    EXPECT_FALSE(qkv_cli::keep_freed_memory_for_reuse()) << threshold;
  }
  ASSERT_EQ(unsetenv("GLIBC_TUNABLES"), 0);

  // AddressSanitizer's malloc takes no options (its mallopt returns 0): nothing to check there.
  if (mallopt(M_MMAP_THRESHOLD, 128 << 10) != 1) GTEST_SKIP() << "malloc is not glibc's (a sanitizer's?)";
  // Read at the process's start, so setting it here changes only what keep_freed_memory_for_reuse reads.
  ASSERT_EQ(setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1", 1), 0);
  const bool with_huge_pages_only = qkv_cli::keep_freed_memory_for_reuse();
  ASSERT_EQ(unsetenv("GLIBC_TUNABLES"), 0);
  EXPECT_TRUE(with_huge_pages_only) << "a huge-page tunable alone turned the thresholds off";
  ASSERT_EQ(mallopt(M_MMAP_THRESHOLD, 128 << 10), 1);
  ASSERT_TRUE(qkv_cli::keep_freed_memory_for_reuse());
  constexpr size_t kBlock = 16 << 20;
  const auto before = mallinfo2();
  auto* block = static_cast<char*>(std::malloc(kBlock));
  ASSERT_NE(block, nullptr);
  std::memset(block, 1, kBlock);
  const auto during = mallinfo2();
  EXPECT_EQ(during.hblks, before.hblks) << "the 16 MiB block was mapped on its own";
  std::free(block);
  const auto after = mallinfo2();
  EXPECT_GE(after.arena, kBlock) << "the heap gave the freed block back";
#else
  GTEST_SKIP() << "not glibc >= 2.33: qkv-train leaves malloc as it is";
#endif
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

// The last line of a run's output that is a JSON object (the summary of --json; logs may precede it).
nlohmann::json last_json_line(const std::string& output) {
  std::istringstream lines(output);
  nlohmann::json found;
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty() && line.front() == '{') found = nlohmann::json::parse(line);
  }
  return found;
}

// --precision on the documents' example: the weights stay float32, the forward computes in the
// half type (its output is bfloat16 / float16), the loss is taken in float32 and is the float32
// run's within that type's tolerance; fp16-mixed runs where LibTorch's CPU autocast has float16
// (2.x), with the loss scale, and is refused with status 2 on 1.13. Trained, the loss falls as in float32.
TEST(TrainApp, SeedTaskInMixedPrecision) {
  auto fp32 = train("--task seed --device cpu --json --steps 20");
  ASSERT_EQ(fp32.exit_code, 0) << fp32.output;
  const auto reference = last_json_line(fp32.output);
  const double reference_loss = reference["initial_loss"].get<double>();
  EXPECT_EQ(reference["precision"], "fp32");
  EXPECT_EQ(reference["output_dtype"], "Float");
  const std::vector<std::tuple<std::string, torch::ScalarType, std::string>> precisions{
      {"bf16-mixed", torch::kBFloat16, "BFloat16"}, {"fp16-mixed", torch::kHalf, "Half"}};
  for (const auto& [precision, dtype, type_name] : precisions) {
    auto run = train("--task seed --device cpu --json --steps 20 --precision " + precision, /*merge_stderr=*/true);
    if (!qkv::AutocastGuard::supports(torch::kCPU, dtype)) {
      EXPECT_EQ(run.exit_code, 2) << run.output;
      EXPECT_THAT(run.output, HasSubstr("CPU autocast takes bfloat16 only"));
      continue;
    }
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const auto summary = last_json_line(run.output);
    EXPECT_EQ(summary["precision"], precision);
    EXPECT_EQ(summary["dtype"], "float32") << "the weights";
    EXPECT_EQ(summary["output_dtype"], type_name);
    const double loss = summary["initial_loss"].get<double>();
    EXPECT_NE(loss, reference_loss) << precision << ": float32's loss to the bit, so autocast took no product";
    EXPECT_NEAR(loss, reference_loss, qkv_test::tolerance_for(dtype, 8) * reference_loss) << precision;
    EXPECT_LT(summary["final_loss"].get<double>(), 0.5 * loss) << precision;
    EXPECT_EQ(summary["loss_scale"].get<double>(), dtype == torch::kHalf ? 65536.0 : 1.0) << precision;
  }
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

// Options a task does not read are refused, naming them and the task (they used to be dropped:
// `--task seed --heads 3 --causal` ran the one-head, non-causal documents' example and exited 0).
TEST(TrainApp, OptionsTheTaskDoesNotReadAreRefused) {
  for (const auto& [arguments, flags] : std::vector<std::pair<std::string, std::string>>{
           {"--task seed --heads 3 --causal", "--heads --causal are not options of --task seed"},
           {"--task scaling --causal", "--causal is not an option of --task scaling"},
           {"--task reverse --layers 2", "--layers is not an option of --task reverse"},
           {"--task lookup --prompt hi", "--prompt is not an option of --task lookup"},
           {"--task lm --momentum 0.9", "--momentum is not an option of --task lm"}}) {
    auto run = train(arguments, /*merge_stderr=*/true);
    EXPECT_EQ(run.exit_code, 2) << arguments << ": " << run.output;
    EXPECT_THAT(run.output, HasSubstr(flags)) << arguments;
    EXPECT_EQ(std::count(run.output.begin(), run.output.end(), '\n'), 1) << run.output;
  }
}

TEST(TrainApp, HelpListsOptionsWithDefaults) {
  auto run = train("--help");
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_THAT(run.output, HasSubstr("--steps"));
  EXPECT_THAT(run.output, HasSubstr("42"));  // the default seed is shown
}

// ---- The learnable tasks: files, determinism, resume, failures. ----

const std::string kSmallReverse = "--task reverse --device cpu --seq-len 6 --d-model 16 --batch 8 --quiet ";

TEST(TrainTasks, WritesMetricsSummaryPicturesAndCheckpoint) {
  const auto out = fresh_dir("files");
  auto run = train(kSmallReverse + "--steps 40 --log-every 10 --eval-every 20 --json --out " + out.string());
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto rows = read_csv(out / "metrics.csv");
  ASSERT_EQ(rows.size(), 1u + 1u + 4u) << "header, the evaluation before training, steps 10..40";
  EXPECT_EQ(rows[0], (std::vector<std::string>{"step", "loss", "eval_loss", "eval_answer_weight", "attn_max_weight",
                                               "attn_entropy", "softmax_jacobian", "grad_norm", "grad_norm_qk", "lr",
                                               "tokens_per_s", "elapsed_s", "loss_scale", "precision"}));
  for (size_t i = 1; i < rows.size(); ++i) EXPECT_EQ(rows[i].size(), rows[0].size()) << "row " << i;
  EXPECT_EQ(rows[1][0], "0");
  EXPECT_EQ(rows[3][0], "20");
  EXPECT_FALSE(rows[3][2].empty()) << "step 20 is an evaluation step";
  EXPECT_TRUE(rows[2][2].empty()) << "step 10 is not";

  const auto summary = nlohmann::json::parse(read_file(out / "summary.json"));
  EXPECT_EQ(summary, nlohmann::json::parse(run.output)) << "--json prints the summary";
  for (const char* key : {"task", "options", "device", "dtype", "torch_version", "backend", "initial_loss",
                          "final_loss", "eval", "wall_time_s"}) {
    EXPECT_TRUE(summary.contains(key)) << key;
  }
  EXPECT_TRUE(summary["eval"].contains("mirror_weight"));
  // The backend of the training steps (not of the final evaluation, which asks for the weights
  // and so always runs the math path): fused where LibTorch has it.
  EXPECT_EQ(summary["backend"], qkv::to_string(qkv_test::default_cpu_backend()));
  EXPECT_TRUE(is_png(out / "loss.png"));
  EXPECT_TRUE(is_png(out / "attention.png"));
  EXPECT_TRUE(fs::exists(out / "checkpoint.pt"));
  for (const auto& entry : fs::directory_iterator(out)) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp-"), std::string::npos) << "left behind: " << entry.path();
  }
  fs::remove_all(out);
}

TEST(TrainTasks, SameSeedSameRun) {
  const auto a = fresh_dir("det_a"), b = fresh_dir("det_b");
  for (const auto& out : {a, b}) {
    auto run = train(kSmallReverse + "--steps 30 --log-every 1 --out " + out.string());
    ASSERT_EQ(run.exit_code, 0) << run.output;
  }
  EXPECT_EQ(losses_by_step(a / "metrics.csv"), losses_by_step(b / "metrics.csv"));
  auto other = fresh_dir("det_c");
  ASSERT_EQ(train(kSmallReverse + "--steps 30 --log-every 1 --seed 7 --out " + other.string()).exit_code, 0);
  EXPECT_NE(losses_by_step(a / "metrics.csv"), losses_by_step(other / "metrics.csv"));
  for (const auto& out : {a, b, other}) fs::remove_all(out);
}

// For both tasks in float32 and in bf16-mixed (the checkpoint carries the precision: the resume
// names none), 20 + 20 steps equal 40 to the bit. (fp16-mixed: Fp16MixedPrecisionOnTheCpu.)
TEST(TrainTasks, ResumedRunEqualsUninterruptedRunStepForStep) {
  for (const std::string task : {"reverse", "lookup"}) {
    for (const std::string precision : {"fp32", "bf16-mixed"}) {
      const std::string name = task + " " + precision;
      const auto whole = fresh_dir("whole"), split = fresh_dir("split");
      const std::string args = "--task " + task + " --precision " + precision +
                               " --device cpu --seq-len 6 --d-model 16 --batch 8 --quiet --log-every 1 ";
      ASSERT_EQ(train(args + "--steps 40 --out " + whole.string()).exit_code, 0) << name;
      ASSERT_EQ(train(args + "--steps 20 --out " + split.string()).exit_code, 0) << name;
      auto resumed = train("--resume " + split.string() + " --steps 40 --log-every 1 --quiet --json");
      ASSERT_EQ(resumed.exit_code, 0) << name << ": " << resumed.output;
      EXPECT_EQ(nlohmann::json::parse(resumed.output)["precision"], precision) << name;
      const auto expected = losses_by_step(whole / "metrics.csv");
      const auto got = losses_by_step(split / "metrics.csv");
      ASSERT_EQ(expected.size(), 40u) << name;
      EXPECT_EQ(got, expected) << name;
      fs::remove_all(whole), fs::remove_all(split);
    }
  }
}

// SGD with momentum keeps a buffer a parameter, which the checkpoint carries (with --dtype
// bfloat16, the float32 master weights' buffers): 15 + 15 steps equal 30 to the bit, and the
// momentum takes effect: a step's loss is taken before its update, and SGD's first update is the
// same with momentum or without (the velocity starts as the gradient), so the runs agree on the
// losses of steps 1 and 2 and part from step 3 on.
TEST(TrainTasks, SgdWithMomentumResumesExactly) {
  for (const std::string dtype : {"float32", "bfloat16"}) {
    const auto whole = fresh_dir("sgd_whole"), split = fresh_dir("sgd_split"), plain = fresh_dir("sgd_plain");
    const std::string args = kSmallReverse + "--optimizer sgd --lr 0.05 --log-every 1 --dtype " + dtype + " ";
    ASSERT_EQ(train(args + "--momentum 0.9 --steps 30 --out " + whole.string()).exit_code, 0) << dtype;
    ASSERT_EQ(train(args + "--momentum 0.9 --steps 15 --out " + split.string()).exit_code, 0) << dtype;
    auto resumed = train("--resume " + split.string() + " --steps 30 --log-every 1 --quiet --json");
    ASSERT_EQ(resumed.exit_code, 0) << dtype << ": " << resumed.output;
    EXPECT_DOUBLE_EQ(nlohmann::json::parse(resumed.output)["options"]["momentum"].get<double>(), 0.9) << dtype;
    ASSERT_EQ(train(args + "--steps 30 --out " + plain.string()).exit_code, 0) << dtype;
    const auto expected = losses_by_step(whole / "metrics.csv");
    ASSERT_EQ(expected.size(), 30u) << dtype;
    EXPECT_EQ(losses_by_step(split / "metrics.csv"), expected) << dtype;
    const auto without = losses_by_step(plain / "metrics.csv");
    EXPECT_EQ(without.at(1), expected.at(1)) << dtype;
    EXPECT_EQ(without.at(2), expected.at(2)) << dtype;
    EXPECT_NE(without.at(3), expected.at(3)) << dtype;
    for (const auto& out : {whole, split, plain}) fs::remove_all(out);
  }
}

TEST(TrainTasks, IncompatibleResumeIsRefusedNamingTheOption) {
  const auto out = fresh_dir("refuse");
  ASSERT_EQ(train(kSmallReverse + "--steps 5 --out " + out.string()).exit_code, 0);
  auto run = train("--resume " + out.string() + " --d-model 32 --steps 10", /*merge_stderr=*/true);
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("--d-model 16"));
  EXPECT_THAT(run.output, HasSubstr("asks for 32"));
  auto missing = train("--resume " + (out / "nowhere").string(), /*merge_stderr=*/true);
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  fs::remove(out / "checkpoint.pt");
  auto no_checkpoint = train("--resume " + out.string(), /*merge_stderr=*/true);
  EXPECT_EQ(no_checkpoint.exit_code, 2) << no_checkpoint.output;  // a folder without one: a bad argument
  EXPECT_THAT(no_checkpoint.output, HasSubstr("qkv-train: error: --resume: no checkpoint at"));
  std::ofstream(out / "checkpoint.pt") << "not an archive";
  auto damaged = train("--resume " + out.string(), /*merge_stderr=*/true);
  EXPECT_EQ(damaged.exit_code, 1) << damaged.output;  // one that cannot be read: a runtime failure
  EXPECT_THAT(damaged.output, HasSubstr("is not a readable checkpoint"));
  fs::remove_all(out);
}

// A resume with --steps at the checkpoint's step trains nothing and reports the finished run. Its
// summary gives the pace metrics.csv recorded at that step, by the run that trained it, not this
// process's 0 tokens/s (until 2026-12-06 the report replaced the run's figures with zeros), and
// leaves metrics.csv's rows as they were. A damaged cell there is no figure: the pace is then 0,
// and the loss curve leaves the step out (a loss cell that did not start with a number ended the
// report with std::stod's invalid_argument, exit 1).
TEST(TrainTasks, AResumeThatTrainsNoStepReportsTheRecordedPace) {
  const auto out = fresh_dir("report_only");
  ASSERT_EQ(train(kSmallReverse + "--steps 20 --log-every 10 --out " + out.string()).exit_code, 0);
  const auto rows = read_csv(out / "metrics.csv");
  const auto tokens_per_s = column_by_step(rows, "tokens_per_s"), elapsed_s = column_by_step(rows, "elapsed_s");
  ASSERT_EQ(tokens_per_s.count(20), 1u);
  ASSERT_GT(tokens_per_s.at(20), 0.0);

  auto report = train("--resume " + out.string() + " --steps 20 --quiet --json");
  ASSERT_EQ(report.exit_code, 0) << report.output;
  const auto summary = nlohmann::json::parse(report.output);
  EXPECT_EQ(summary["steps"], 20);
  EXPECT_EQ(summary["tokens_per_s"].get<double>(), tokens_per_s.at(20));
  EXPECT_EQ(summary["wall_time_s"].get<double>(), elapsed_s.at(20));
  EXPECT_DOUBLE_EQ(summary["steps_per_s"].get<double>(), tokens_per_s.at(20) / (8.0 * 6.0));  // B * N tokens a step
  EXPECT_EQ(summary["pace_recorded_at_step"], 20);
  EXPECT_EQ(read_csv(out / "metrics.csv"), rows);

  // The step's tokens/s cell and step 10's loss damaged: no recorded pace, and the report completes.
  auto damaged = rows;
  const auto column = [&](const std::string& name) {
    return static_cast<size_t>(std::find(rows[0].begin(), rows[0].end(), name) - rows[0].begin());
  };
  ASSERT_EQ(damaged[2][0], "10");
  damaged[2][column("loss")] = "lost";
  damaged.back()[column("tokens_per_s")] = "fast";
  {
    std::ofstream metrics(out / "metrics.csv", std::ios::trunc);
    for (const auto& row : damaged) {
      for (size_t i = 0; i < row.size(); ++i) metrics << (i ? "," : "") << row[i];
      metrics << "\n";
    }
  }
  auto again = train("--resume " + out.string() + " --steps 20 --quiet --json");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  const auto plain = nlohmann::json::parse(again.output);
  EXPECT_EQ(plain["tokens_per_s"].get<double>(), 0.0);
  EXPECT_FALSE(plain.contains("pace_recorded_at_step"));
  fs::remove_all(out);
}

TEST(TrainTasks, DivergingLossStopsWithStepAndHint) {
  auto run = train(kSmallReverse + "--optimizer sgd --lr 1e12 --steps 50", /*merge_stderr=*/true);
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, ::testing::ContainsRegex("step [0-9]+: the loss is -?(nan|inf)"));
  EXPECT_THAT(run.output, HasSubstr("lower --lr"));
}

// Outside training Ctrl-C ends qkv-train at once, as it ends any program: the scaling experiment
// (several seconds of training runs, its files written at the end), sent SIGINT once its main has
// blocked the signal for its signal thread (apps/qkv-train/stop_signals.h), is ended by it (the
// shell's 130) and leaves no files, where a caught signal would let it finish. `env
// --default-signal=INT`: a background job of a non-interactive shell starts with SIGINT ignored.
TEST(TrainTasks, CtrlCOutsideTrainingEndsTheProgramAtOnce) {
  const auto out = fresh_dir("sigint_untrained");
  const std::string command =
      "env --default-signal=INT " + std::string(QKV_TRAIN_PATH) + " --task scaling --device cpu --quiet --out " +
      out.string() +
      " & pid=$!; for i in $(seq 600); do mask=$(awk '/^SigBlk/ { print $2 }' /proc/$pid/status); "
      "[ $(( 0x${mask:-0} & 2 )) -ne 0 ] && echo blocked && break; sleep 0.1; done; "
      // What the process was when the signal went, for a failure's message (it once ran to its end
      // under load, 2026-12-05, Debian 13, not reproduced since).
      "grep -E '^(State|SigPnd|ShdPnd|SigBlk|SigIgn|SigCgt|Threads)' /proc/$pid/status | tr '\\n' ' '; echo; "
      "kill -INT $pid; wait $pid; echo exit=$?";
  auto run = qkv_test::run_command(command);
  ASSERT_THAT(run.output, HasSubstr("blocked")) << "qkv-train never blocked SIGINT for its signal thread";
  EXPECT_THAT(run.output, HasSubstr("exit=130"));
  EXPECT_FALSE(fs::exists(out / "scaling.csv"));
  fs::remove_all(out);
}

// A SIGINT qkv-train was started with ignored (a background job of a script, nohup) stays ignored,
// during training too: the run goes on until the SIGTERM that follows stops it (143, not 130).
TEST(TrainTasks, AnIgnoredSigintStaysIgnored) {
  const auto out = fresh_dir("sigint_ignored");
  const std::string command =
      "env --ignore-signal=INT " + std::string(QKV_TRAIN_PATH) + " " + kSmallReverse + "--steps 100000000 --out " +
      out.string() + " & pid=$!; for i in $(seq 300); do [ -s " + (out / "metrics.csv").string() +
      " ] && break; sleep 0.1; done; kill -INT $pid; sleep 1; kill -0 $pid && echo running; kill -TERM $pid; "
      "wait $pid; echo exit=$?";
  auto run = qkv_test::run_command(command);
  EXPECT_THAT(run.output, HasSubstr("running"));
  EXPECT_THAT(run.output, HasSubstr("exit=143"));
  fs::remove_all(out);
}

TEST(TrainTasks, SigtermWritesACheckpointAndExits143) {
  const auto out = fresh_dir("sigterm");
  const std::string command = std::string(QKV_TRAIN_PATH) + " " + kSmallReverse + "--steps 100000000 --out " +
                              out.string() + " & pid=$!; for i in $(seq 300); do [ -s " +
                              (out / "metrics.csv").string() +
                              " ] && break; sleep 0.1; done; sleep 0.5; kill -TERM $pid; wait $pid; echo exit=$?";
  auto run = qkv_test::run_command(command);
  EXPECT_THAT(run.output, HasSubstr("exit=143"));
  EXPECT_TRUE(fs::exists(out / "checkpoint.pt"));
  EXPECT_TRUE(fs::exists(out / "summary.json"));
  // The checkpoint resumes, and trains one step more.
  std::ifstream summary_file(out / "summary.json");
  const int64_t stopped_at = nlohmann::json::parse(summary_file)["steps"].get<int64_t>();
  auto resumed =
      train("--resume " + out.string() + " --steps " + std::to_string(stopped_at + 1) + " --json", /*merge_stderr=*/true);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("\"steps\":" + std::to_string(stopped_at + 1)));
  // Fewer steps than the checkpoint's is refused before anything is rewritten.
  const auto summary_before = read_file(out / "summary.json");
  auto fewer = train("--resume " + out.string() + " --steps 1", /*merge_stderr=*/true);
  EXPECT_EQ(fewer.exit_code, 2) << fewer.output;
  EXPECT_THAT(fewer.output, HasSubstr("--steps 1: the checkpoint in " + out.string() + " is at step " +
                                      std::to_string(stopped_at + 1)));
  EXPECT_EQ(read_file(out / "summary.json"), summary_before);
  fs::remove_all(out);
}

TEST(TrainTasks, BadTaskOptionsExitWith2) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--task reverse --d-model 8 --seq-len 8", "--d-model > --seq-len"},
      {"--task reverse --d-model 30 --heads 4", "not divisible by --heads"},
      {"--task lookup --seq-len 1", "--seq-len >= 2"},
      {"--task seed --checkpoint-every 5", "--task seed"},
      {"--dtype float16", "--dtype"},
      {"--optimizer rmsprop", "--optimizer"},
      {"--task reverse --momentum 0.9", "--momentum is SGD's: it needs --optimizer sgd, got --optimizer adam"},
      {"--task reverse --optimizer sgd --momentum 1", "--momentum: expected a finite number >= 0 and <= 0.999, got 1"},
      {"--scale -1", "--scale"},
      {"--lr 0 --task reverse", "--lr"},
      // Real values: nan, and what float32 cannot hold, are refused saying what was expected (until
      // 2026-12-06 --scale nan and --grad-clip nan were ignored, and --lr nan or 1e39 failed at the
      // optimizer with LibTorch's message and exit status 1).
      {"--lr nan --task reverse", "--lr: expected a finite number > 0 and <= 1e+38, got nan"},
      {"--lr 1e39 --task reverse", "--lr: expected a finite number > 0 and <= 1e+38, got 1e39"},
      {"--scale nan --task reverse", "--scale: expected a finite number > 0 and <= 1e+38, got nan"},
      {"--task lm --dropout nan", "--dropout: expected a finite number >= 0 and <= 0.95, got nan"},
      {"--task lm --grad-clip nan", "--grad-clip: expected a finite number >= 0 and <= 1e+09, got nan"},
      {"--task lm --weight-decay inf", "--weight-decay: expected a finite number >= 0 and <= 10, got inf"},
      {"--task lm --dist-timeout nan", "--dist-timeout: expected a finite number >= 0.1 and <= 86400, got nan"},
      // Past 2^64 - 1 (CLI11 took every such seed for 2^64 - 1: different seeds, the same run).
      {"--task reverse --seed 18446744073709551616", "--seed: expected a whole number from -9223372036854775808 to "
                                                     "18446744073709551615 (as torch.manual_seed), got 18446744073709551616"},
      // A file where the output folder goes (it stopped the run after the task had loaded its data, exit 1).
      {"--task reverse --out " + std::string(QKV_TRAIN_PATH),
       "--out: expected a folder (made when missing), got the file " + std::string(QKV_TRAIN_PATH)},
  };
  for (const auto& [arguments, message] : cases) {
    auto run = train(arguments, /*merge_stderr=*/true);
    EXPECT_EQ(run.exit_code, 2) << arguments << ": " << run.output;
    EXPECT_THAT(run.output, HasSubstr(message)) << arguments;
    EXPECT_EQ(std::count(run.output.begin(), run.output.end(), '\n'), 1) << arguments << ": " << run.output;
  }
}

// A negative seed is the generator's seed 2^64 + seed, as torch.manual_seed(-1) makes it (PyTorch
// 1.13 and 2.14: torch.initial_seed() is then 18446744073709551615).
TEST(TrainTasks, ANegativeSeedSeedsAsTorchManualSeed) {
  auto negative = train("--task reverse --steps 2 --json --quiet --seed -1");
  auto wrapped = train("--task reverse --steps 2 --json --quiet --seed 18446744073709551615");
  ASSERT_EQ(negative.exit_code, 0) << negative.output;
  ASSERT_EQ(wrapped.exit_code, 0) << wrapped.output;
  const auto a = nlohmann::json::parse(negative.output), b = nlohmann::json::parse(wrapped.output);
  EXPECT_EQ(a["options"]["seed"].get<uint64_t>(), 18446744073709551615ull);
  EXPECT_EQ(a["final_loss"].get<double>(), b["final_loss"].get<double>());
}

// The demo's promise: with their defaults, both tasks learn to attend to the right key.
TEST(TrainTasks, DefaultRunsLearnTheirAttentionPattern) {
  for (const std::string task : {"reverse", "lookup"}) {
    auto run = train("--task " + task + " --device cpu --json --quiet");
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const auto summary = nlohmann::json::parse(run.output);
    const auto metric = task == "reverse" ? "mirror_weight" : "match_weight";
    EXPECT_GE(summary["eval"][metric].get<double>(), 0.9) << task;
    EXPECT_LT(summary["final_loss"].get<double>(), 0.1 * summary["initial_loss"].get<double>()) << task;
  }
}

// bf16-mixed (float32 weights, autocast bfloat16 products): the default reverse and lookup runs
// reach the float32 run's evaluation figures, within 0.05 of the answer weight, and the summary
// and metrics.csv say which precision ran.
TEST(TrainTasks, Bf16MixedPrecisionReachesTheFloat32Figures) {
  for (const std::string task : {"reverse", "lookup"}) {
    const auto out = fresh_dir("bf16_" + task);
    auto fp32 = train("--task " + task + " --device cpu --json --quiet");
    auto mixed = train("--task " + task + " --device cpu --json --quiet --precision bf16-mixed --out " + out.string());
    ASSERT_EQ(fp32.exit_code, 0) << fp32.output;
    ASSERT_EQ(mixed.exit_code, 0) << mixed.output;
    const auto expected = nlohmann::json::parse(fp32.output), actual = nlohmann::json::parse(mixed.output);
    const auto metric = task == "reverse" ? "mirror_weight" : "match_weight";
    EXPECT_NEAR(actual["eval"][metric].get<double>(), expected["eval"][metric].get<double>(), 0.05) << task;
    EXPECT_GE(actual["eval"][metric].get<double>(), 0.9) << task;
    EXPECT_EQ(actual["precision"], "bf16-mixed");
    // and on which instructions: this process's (ctest's routes.isa_* reruns cap it by QKV_TILED_ISA)
    EXPECT_THAT(actual["instruction_set"].get<std::string>(),
                testing::AnyOf("amx_bf16", "avx512_bf16", "avx512", "avx2", "portable"));
    EXPECT_EQ(actual["instruction_set"], qkv::tiled_instruction_set());
    EXPECT_EQ(actual["loss_scale"], 1.0);
    const auto metrics = read_file(out / "metrics.csv");
    EXPECT_THAT(metrics.substr(0, metrics.find('\n')), HasSubstr("loss_scale,precision"));
    EXPECT_THAT(metrics, HasSubstr(",bf16-mixed\n"));
    fs::remove_all(out);
  }
}

// fp16-mixed needs float16 autocast: on LibTorch 1.13's CPU it is refused with status 2 saying
// why; where LibTorch has it, the run trains with a loss scale, and a resumed run continues with
// the checkpoint's scale and equals the uninterrupted one.
TEST(TrainTasks, Fp16MixedPrecisionOnTheCpu) {
  if (!qkv::AutocastGuard::supports(torch::kCPU, torch::kHalf)) {
    auto refused = train(kSmallReverse + "--steps 2 --precision fp16-mixed", /*merge_stderr=*/true);
    EXPECT_EQ(refused.exit_code, 2) << refused.output;
    EXPECT_THAT(refused.output, HasSubstr("CPU autocast takes bfloat16 only"));
    return;
  }
  const auto whole = fresh_dir("fp16_whole"), split = fresh_dir("fp16_split");
  const std::string args = kSmallReverse + "--precision fp16-mixed --log-every 1 ";
  ASSERT_EQ(train(args + "--steps 30 --out " + whole.string()).exit_code, 0);
  ASSERT_EQ(train(args + "--steps 15 --out " + split.string()).exit_code, 0);
  auto resumed = train("--resume " + split.string() + " --steps 30 --log-every 1 --quiet --json");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(losses_by_step(split / "metrics.csv"), losses_by_step(whole / "metrics.csv"));
  EXPECT_EQ(nlohmann::json::parse(resumed.output)["precision"], "fp16-mixed");
  EXPECT_GT(nlohmann::json::parse(resumed.output)["loss_scale"].get<double>(), 1.0);
  fs::remove_all(whole), fs::remove_all(split);
}

TEST(TrainTasks, MixedPrecisionNeedsFloat32Weights) {
  auto run = train(kSmallReverse + "--steps 2 --precision bf16-mixed --dtype float64", /*merge_stderr=*/true);
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("needs --dtype float32, got --dtype float64"));
}

// ---- --task scaling: the documents' argument for sqrt(d_k), measured. ----

TEST(ScalingExperiment, FiguresAgreeWithTheDocuments) {
  const auto out = fresh_dir("scaling");
  auto run = train("--task scaling --device cpu --log-level warn --out " + out.string());
  ASSERT_EQ(run.exit_code, 0) << run.output;

  // The documents' small numbers, printed by the run.
  auto printed = [&](const std::string& prefix) {
    const auto at = run.output.find(prefix);
    EXPECT_NE(at, std::string::npos) << prefix;
    std::vector<double> values;
    std::stringstream line(run.output.substr(run.output.find('[', at + prefix.size()) + 1));
    for (double v; values.size() < 3 && line >> v; line.ignore(2)) values.push_back(v);
    return values;
  };
  const auto saturated = printed("softmax([20, 10, 0]) =");
  const auto mild = printed("softmax([2, 1, 0])   =");
  ASSERT_EQ(saturated.size(), 3u);
  ASSERT_EQ(mild.size(), 3u);
  const double documents_saturated[] = {0.9999, 0.0001, 0.0}, documents_mild[] = {0.67, 0.24, 0.09};
  for (int i = 0; i < 3; ++i) {
    EXPECT_NEAR(saturated[i], documents_saturated[i], 1e-4) << i;  // the documents print 4 decimals
    EXPECT_NEAR(mild[i], documents_mild[i], 0.005) << i;           // and here 2
  }

  const auto rows = read_csv(out / "scaling.csv");
  ASSERT_EQ(rows.size(), 1u + 9u) << "d_k = 4 ... 1024";
  std::map<std::string, size_t> column;
  for (size_t i = 0; i < rows[0].size(); ++i) column[rows[0][i]] = i;
  auto cell = [&](size_t row, const char* name) { return std::stod(rows[row].at(column.at(name))); };
  for (size_t r = 1; r < rows.size(); ++r) {
    // Var(q·k) = d_k within 5 standard errors; the error of a sample variance of M draws of
    // q·k is sqrt((E[s⁴] - d_k²) / M) with E[s⁴] = 3 d_k² + 6 d_k for Gaussian q, k.
    const double d_k = cell(r, "d_k"), samples = cell(r, "samples");
    const double standard_error = std::sqrt((2 * d_k * d_k + 6 * d_k) / samples);
    EXPECT_NEAR(cell(r, "var_qk"), d_k, 5 * standard_error) << "d_k " << d_k;
    if (r > 1) {
      EXPECT_GT(cell(r, "max_weight_unscaled"), cell(r - 1, "max_weight_unscaled")) << "d_k " << d_k;
    }
    EXPECT_NEAR(cell(r, "max_weight_scaled"), cell(1, "max_weight_scaled"), 0.05) << "scaled stays flat, d_k " << d_k;
    EXPECT_NEAR(cell(r, "grad_qk_median_scaled"), cell(1, "grad_qk_median_scaled"),
                0.25 * cell(1, "grad_qk_median_scaled"))
        << "d_k " << d_k;
  }
  const size_t last = rows.size() - 1;  // d_k = 1024
  EXPECT_GT(cell(last, "max_weight_unscaled"), 0.9);
  EXPECT_LT(cell(last, "grad_qk_median_unscaled"), 0.01 * cell(last, "grad_qk_median_scaled"));
  EXPECT_LT(cell(last, "grad_scores_median_unscaled"), 0.01 * cell(last, "grad_scores_median_scaled"));

  // Training at a large d_model: the unscaled variant is measurably worse.
  const auto training = read_csv(out / "scaling_training.csv");
  ASSERT_GT(training.size(), 100u);
  double scaled = 0, unscaled = 0;
  for (size_t r = training.size() - 30; r < training.size(); ++r) {
    scaled += std::stod(training[r][1]), unscaled += std::stod(training[r][2]);
  }
  EXPECT_LT(scaled * 10, unscaled);
  EXPECT_TRUE(is_png(out / "scaling.png"));
  fs::remove_all(out);
}

// The experiment's conclusion (unscaled scores train far worse at a large d_model) holds with
// the training under bf16 autocast; fp16-mixed where the CPU's autocast lacks it is refused at
// once, before the measurements.
TEST(ScalingExperiment, TheConclusionHoldsInBf16MixedPrecision) {
  auto run = train("--task scaling --device cpu --precision bf16-mixed --json --log-level warn");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto summary = last_json_line(run.output);
  EXPECT_EQ(summary["precision"], "bf16-mixed");
  EXPECT_LT(summary["reverse"]["final_loss_scaled"].get<double>() * 10,
            summary["reverse"]["final_loss_unscaled"].get<double>());
  if (!qkv::AutocastGuard::supports(torch::kCPU, torch::kHalf)) {
    auto refused = train("--task scaling --device cpu --precision fp16-mixed", /*merge_stderr=*/true);
    EXPECT_EQ(refused.exit_code, 2) << refused.output;
    EXPECT_THAT(refused.output, HasSubstr("--precision fp16-mixed on cpu"));
    EXPECT_THAT(refused.output, ::testing::Not(HasSubstr("measured d_k"))) << "refused after the measurements";
  }
}

TEST(TrainTasks, DamagedCheckpointsAreRefusedNamingTheFile) {
  const auto source = fresh_dir("checkpoint_source");
  ASSERT_EQ(train(kSmallReverse + "--steps 5 --out " + source.string()).exit_code, 0);
  const auto good = read_file(source / "checkpoint.pt");
  const auto other = fresh_dir("checkpoint_other");
  ASSERT_EQ(train("--task lookup --device cpu --steps 3 --quiet --out " + other.string()).exit_code, 0);

  std::vector<std::pair<std::string, std::string>> damaged = {
      {"empty", ""},
      {"text", "not a checkpoint\n"},
      {"weights_not_checkpoint", read_file(source / "model.pt")},
      {"another_task", read_file(other / "checkpoint.pt")},
  };
  std::mt19937 random(7);
  for (int i = 0; i < 6; ++i) {
    const size_t cut = std::uniform_int_distribution<size_t>(1, good.size() - 1)(random);
    damaged.emplace_back("truncated_" + std::to_string(cut), good.substr(0, cut));
  }
  for (int i = 0; i < 8; ++i) {
    auto bytes = good;
    const size_t at = std::uniform_int_distribution<size_t>(0, good.size() - 1)(random);
    bytes[at] = static_cast<char>(bytes[at] ^ (1 << (i % 8)));
    damaged.emplace_back("flipped_" + std::to_string(at), bytes);
  }
  for (const auto& [name, bytes] : damaged) {
    const auto dir = fresh_dir("damaged_" + name);
    fs::create_directories(dir);
    std::ofstream(dir / "checkpoint.pt", std::ios::binary) << bytes;
    fs::copy_file(source / "metrics.csv", dir / "metrics.csv");
    // For the other task's checkpoint, the command line names this task: an incompatible resume.
    const std::string task = name == "another_task" ? " --task reverse" : "";
    auto run = train("--resume " + dir.string() + task + " --steps 6 --quiet", /*merge_stderr=*/true);
    EXPECT_LT(run.exit_code, 128) << name << " crashed: " << run.output;
    if (name == "another_task") {
      EXPECT_EQ(run.exit_code, 2) << run.output;  // refused as incompatible: --task
      EXPECT_THAT(run.output, HasSubstr("--task")) << run.output;
    } else if (run.exit_code != 0 || name.rfind("flipped_", 0) != 0) {
      // Only a flip in the archive's slack may leave a loadable checkpoint.
      EXPECT_EQ(run.exit_code, 1) << name << ": " << run.output;
      EXPECT_THAT(run.output, HasSubstr((dir / "checkpoint.pt").string())) << name;
    }
    fs::remove_all(dir);
  }
  fs::remove_all(source), fs::remove_all(other);
}

// A checkpoint's code/ (the TorchScript class definitions LibTorch's OutputArchive writes beside
// the data) is never compiled: qkv reads the objects itself (src/pickle_reader.h). LibTorch's
// importer compiled it before, and a one-word change to one of those files crashed LibTorch 1.13's
// compiler (SIGSEGV; the fuzzer's input is in tests/data/fuzz_regressions_checkpoint/). Whatever
// code/ says, the data resumes exactly.
TEST(TrainTasks, ACheckpointsCodeIsNeverCompiledSoItCannotCrashTheResume) {
  const auto whole = fresh_dir("code_whole"), split = fresh_dir("code_split");
  ASSERT_EQ(train(kSmallReverse + "--steps 12 --log-every 1 --out " + whole.string()).exit_code, 0);
  ASSERT_EQ(train(kSmallReverse + "--steps 6 --log-every 1 --out " + split.string()).exit_code, 0);
  // Every class definition replaced by the fuzzer's (an unknown class constant), CRCs right.
  const auto path = split / "checkpoint.pt";
  int replaced = 0;
  const auto rewritten = rewrite_archive(read_file(path), [&](const std::string& name, std::string& contents) {
    if (name.size() > 3 && name.compare(name.size() - 3, 3, ".py") == 0) {
      contents = "class Module(Module):\n  __parameterlibpythons__ = []\n";
      ++replaced;
    }
  });
  ASSERT_GT(replaced, 3);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << rewritten;

  auto resumed = train("--resume " + split.string() + " --steps 12 --log-every 1 --quiet", /*merge_stderr=*/true);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(losses_by_step(split / "metrics.csv"), losses_by_step(whole / "metrics.csv"));

  // The fuzzer's input itself (its data a run of --d-model 8 --seq-len 4 --batch 2).
  const auto found = fresh_dir("code_found");
  fs::create_directories(found);
  fs::copy_file(data_path("fuzz_regressions_checkpoint/checkpoint_code_with_an_unknown_class_constant.pt"),
                found / "checkpoint.pt");
  auto run = train("--resume " + found.string() + " --steps 3 --quiet", /*merge_stderr=*/true);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  for (const auto& dir : {whole, split, found}) fs::remove_all(dir);
}

// One optimizer step on the sum of every parameter's squares (gradient 2p, in float32), through
// `masters` (qkv-train --dtype bfloat16's float32 copies) where given.
void step_on_squares(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     qkv::MasterWeights* masters = nullptr) {
  optimizer.zero_grad();
  torch::Tensor loss = torch::zeros({});
  for (const auto& p : model.parameters()) loss = loss + p.to(torch::kFloat).square().sum();
  loss.backward();
  if (masters) masters->gradients_to_masters();
  optimizer.step();
  if (masters) masters->masters_to_model();
}

// Module::load and Optimizer::load take whatever a checkpoint holds: Tensor::set_ gave a parameter
// the file's shape, a state saved for another parameter was handed on by position, and a state two
// parameters share left the second a null state (dereferenced at the next step). A checkpoint that
// does not fit the model and optimizer is refused, naming what does not fit.
TEST(Checkpoints, AStateThatDoesNotFitTheModelOrItsOptimizerIsRefused) {
  const auto dir = fresh_dir("checkpoint_fit");
  fs::create_directories(dir);
  torch::manual_seed(3);
  const auto save = [&](torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
    qkv::GradScaler disabled(qkv::GradScalerOptions().enabled(false));
    qkv_train::save_checkpoint(dir.string(), model, optimizer, disabled, qkv_train::CheckpointState{});
  };
  const auto load_error = [&](torch::nn::Module& model, torch::optim::Optimizer& optimizer) -> std::string {
    qkv::GradScaler disabled(qkv::GradScalerOptions().enabled(false));
    try {
      qkv_train::load_checkpoint(qkv_train::CheckpointFile(dir.string()), model, optimizer, disabled);
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    return "loaded";
  };
  torch::nn::Sequential saved(torch::nn::Linear(4, 3), torch::nn::Linear(3, 2));
  torch::optim::Adam saved_adam(saved->parameters(), torch::optim::AdamOptions(0.1));
  step_on_squares(*saved, saved_adam);
  save(*saved, saved_adam);

  {  // The same shapes: loads, and the next step runs.
    torch::nn::Sequential model(torch::nn::Linear(4, 3), torch::nn::Linear(3, 2));
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.1));
    ASSERT_EQ(load_error(*model, adam), "loaded");
    EXPECT_TRUE(torch::equal(model->parameters()[0], saved->parameters()[0]));
    step_on_squares(*model, adam);
  }
  {  // A model of other shapes.
    torch::nn::Sequential model(torch::nn::Linear(5, 3), torch::nn::Linear(3, 2));
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.1));
    EXPECT_THAT(load_error(*model, adam), HasSubstr("its 0.weight is [3, 4] float on cpu, where the model's is [3, 5] float on cpu"));
  }
  {  // An optimizer whose parameters come in another order: each state is another parameter's.
    torch::nn::Sequential model(torch::nn::Linear(4, 3), torch::nn::Linear(3, 2));
    auto parameters = model->parameters();
    std::reverse(parameters.begin(), parameters.end());
    torch::optim::Adam adam(parameters, torch::optim::AdamOptions(0.1));
    EXPECT_THAT(load_error(*model, adam), HasSubstr("its optimizer state's exp_avg is [3, 4] float on cpu, where its "
                                                    "parameter is [2] float on cpu"));
  }
  {  // A state saved for one parameter listed twice, loaded for two.
    torch::nn::Linear twice(2, 2);
    torch::optim::Adam twice_adam(std::vector<torch::Tensor>{twice->weight, twice->weight}, torch::optim::AdamOptions(0.1));
    step_on_squares(*twice, twice_adam);
    save(*twice, twice_adam);
    torch::nn::Linear model(2, 2);
    torch::optim::Adam adam(std::vector<torch::Tensor>{model->weight, model->bias}, torch::optim::AdamOptions(0.1));
    EXPECT_THAT(load_error(*model, adam), HasSubstr("its optimizer state names one parameter's state twice"));
  }
  {  // SGD's momentum buffers (qkv-train --momentum) are checked as Adam's moments are.
    torch::nn::Sequential sgd_saved(torch::nn::Linear(4, 3), torch::nn::Linear(3, 2));
    torch::optim::SGD saved_sgd(sgd_saved->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    step_on_squares(*sgd_saved, saved_sgd);
    save(*sgd_saved, saved_sgd);
    torch::nn::Sequential model(torch::nn::Linear(4, 3), torch::nn::Linear(3, 2));
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    ASSERT_EQ(load_error(*model, sgd), "loaded");
    auto parameters = model->parameters();
    std::reverse(parameters.begin(), parameters.end());
    torch::optim::SGD reversed(parameters, torch::optim::SGDOptions(0.1).momentum(0.9));
    EXPECT_THAT(load_error(*model, reversed), HasSubstr("its optimizer state's momentum_buffer is [3, 4] float on cpu, "
                                                        "where its parameter is [2] float on cpu"));
  }
  fs::remove_all(dir);
}

// The masters go into the checkpoint with the optimizer's state, and load back bit for bit. A
// checkpoint written before master weights (a bfloat16 model stepped by LibTorch's optimizer on its
// own weights) still resumes: the masters take its weights, the optimizer's state is widened to float32.
TEST(MasterWeights, TheyResumeFromACheckpointAndFromOneWrittenBeforeThem) {
  const auto dir = fresh_dir("checkpoint_masters");
  fs::create_directories(dir);
  qkv::GradScaler disabled(qkv::GradScalerOptions().enabled(false));
  const auto make = [] {
    torch::manual_seed(5);
    torch::nn::Sequential model(torch::nn::Linear(4, 3), torch::nn::LayerNorm(torch::nn::LayerNormOptions({3})));
    model->to(torch::kBFloat16);
    return model;
  };
  const auto master_values = [](torch::optim::Optimizer& optimizer) {
    std::vector<torch::Tensor> values;
    for (const auto& p : optimizer.param_groups()[0].params()) values.push_back(p.detach().clone());
    return values;
  };
  {  // Written with masters, read back into a fresh run's.
    auto saved = make();
    torch::optim::Adam adam(saved->parameters(), torch::optim::AdamOptions(1e-3));
    qkv::MasterWeights masters(*saved, adam);
    for (int i = 0; i < 3; ++i) step_on_squares(*saved, adam, &masters);
    qkv_train::save_checkpoint(dir.string(), *saved, adam, disabled, qkv_train::CheckpointState{}, &masters);

    auto model = make();
    torch::optim::Adam resumed_adam(model->parameters(), torch::optim::AdamOptions(1e-3));
    qkv::MasterWeights resumed(*model, resumed_adam);
    qkv_train::load_checkpoint(qkv_train::CheckpointFile(dir.string()), *model, resumed_adam, disabled, &resumed);
    const auto expected = master_values(adam), actual = master_values(resumed_adam);
    ASSERT_EQ(actual.size(), expected.size());
    for (size_t i = 0; i < actual.size(); ++i) {
      EXPECT_EQ(actual[i].scalar_type(), torch::kFloat);
      EXPECT_TRUE(torch::equal(actual[i], expected[i])) << i;  // not the bfloat16 weights widened
    }
    EXPECT_FALSE(torch::equal(expected[0], model->parameters()[0].to(torch::kFloat)));
  }
  {  // Written before master weights: bfloat16 weights and bfloat16 Adam state.
    auto saved = make();
    torch::optim::Adam adam(saved->parameters(), torch::optim::AdamOptions(1e-3));
    step_on_squares(*saved, adam);
    qkv_train::save_checkpoint(dir.string(), *saved, adam, disabled, qkv_train::CheckpointState{});

    auto model = make();
    torch::optim::Adam resumed_adam(model->parameters(), torch::optim::AdamOptions(1e-3));
    qkv::MasterWeights resumed(*model, resumed_adam);
    qkv_train::load_checkpoint(qkv_train::CheckpointFile(dir.string()), *model, resumed_adam, disabled, &resumed);
    const auto masters = master_values(resumed_adam);
    for (size_t i = 0; i < masters.size(); ++i) {
      EXPECT_TRUE(torch::equal(masters[i], saved->parameters()[i].to(torch::kFloat))) << i;
      const auto found = qkv::compat::find_optimizer_state(resumed_adam.state(), resumed_adam.param_groups()[0].params()[i]);
      ASSERT_NE(found, resumed_adam.state().end());
      const auto& state = dynamic_cast<const torch::optim::AdamParamState&>(*found->second);
      EXPECT_EQ(state.exp_avg().scalar_type(), torch::kFloat) << i;
      EXPECT_EQ(state.exp_avg_sq().scalar_type(), torch::kFloat) << i;
    }
    step_on_squares(*model, resumed_adam, &resumed);  // and the next step runs
    EXPECT_EQ(model->parameters()[0].scalar_type(), torch::kBFloat16);
  }
  fs::remove_all(dir);
}

// `qkv-train --resume DIR --quiet` as its command line takes it: the run's options and the checkpoint
// it read (none when the command line was refused).
struct ParsedResume {
  qkv_train::RunConfig config;
  std::optional<qkv_train::CheckpointFile> checkpoint;
};
ParsedResume parse_resume(const std::string& dir) {
  const char* argv[] = {"qkv-train", "--resume", dir.c_str(), "--quiet"};
  ParsedResume parsed;
  if (qkv_train::parse_command_line(4, argv, parsed.config, &parsed.checkpoint) != -1) parsed.checkpoint.reset();
  return parsed;
}

// The checkpoint loaded as the trainer loads it, into a fresh task of the run's options and its optimizer.
struct ResumedTask {
  std::unique_ptr<qkv_train::TrainableTask> task;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  int64_t step = -1;
};
ResumedTask resume_task(ParsedResume& parsed) {
  ResumedTask resumed;
  resumed.task = qkv_train::find_task(parsed.config.task).make(parsed.config, torch::kCPU);
  resumed.optimizer = resumed.task->make_optimizer(parsed.config.lr);
  qkv::GradScaler scaler(qkv::GradScalerOptions().enabled(false));
  resumed.step =
      qkv_train::load_checkpoint(std::move(*parsed.checkpoint), resumed.task->model(), *resumed.optimizer, scaler).step;
  return resumed;
}

// --resume loads the weights from the bytes whose options the command line was checked against: a
// checkpoint.pt replaced after the check (by a run still writing to the folder) does not reach the
// model. (It was read twice, once for the options and once for the weights.)
TEST(Checkpoints, ResumeLoadsTheCheckpointItCheckedNotOneWrittenSince) {
  const auto first = fresh_dir("checked_first"), later = fresh_dir("checked_later");
  ASSERT_EQ(train(kSmallReverse + "--steps 3 --out " + first.string()).exit_code, 0);
  ASSERT_EQ(train(kSmallReverse + "--steps 3 --seed 7 --out " + later.string()).exit_code, 0);
  const std::string resume = first.string();
  auto parsed = parse_resume(resume);
  ASSERT_TRUE(parsed.checkpoint.has_value());
  // The first run's weights, as a fresh read of its file gives them.
  auto reference = qkv_train::find_task(parsed.config.task).make(parsed.config, torch::kCPU);
  qkv_train::load_checkpoint_model(qkv_train::CheckpointFile(resume), reference->model());

  fs::copy_file(later / "checkpoint.pt", first / "checkpoint.pt", fs::copy_options::overwrite_existing);
  const auto resumed = resume_task(parsed);
  EXPECT_EQ(resumed.step, 3);
  const auto loaded = resumed.task->model().parameters(), expected = reference->model().parameters();
  ASSERT_EQ(loaded.size(), expected.size());
  for (size_t i = 0; i < loaded.size(); ++i) EXPECT_TRUE(torch::equal(loaded[i], expected[i])) << i;
  // The file now holds the other run's weights: they differ (else this test could not fail).
  qkv_train::load_checkpoint_model(qkv_train::CheckpointFile(resume), reference->model());
  EXPECT_FALSE(torch::equal(reference->model().parameters()[0], loaded[0]));
  fs::remove_all(first), fs::remove_all(later);
}

// A checkpoint resumes on every LibTorch qkv builds on, whichever wrote it. LibTorch 1.x names each
// parameter's optimizer state by its address in hex, 2.x in decimal, and 2.x parsed the hex names as 0:
// a checkpoint of Debian 12's qkv resumed on Debian 13's left every parameter but the first a null
// Adam state and crashed at the next step. (Files: one Adam step of --task reverse --d-model 8
// --seq-len 4 --batch 2, written by qkv on LibTorch 1.13 and 2.6.)
TEST(Checkpoints, ThoseOfLibTorch1And2ResumeWithAStateForEveryParameter) {
  for (const char* file : {"checkpoints/reverse-libtorch1.13.pt", "checkpoints/reverse-libtorch2.6.pt"}) {
    SCOPED_TRACE(file);
    const auto dir = fresh_dir("checkpoint_version");
    fs::create_directories(dir);
    fs::copy_file(data_path(file), dir / "checkpoint.pt");
    // Loaded as qkv-train loads it: every parameter has its own state of one step. After one Adam
    // step from zero moments, exp_avg = (1 - β1) g and exp_avg_sq = (1 - β2) g², so the two agree
    // elementwise only if they were saved for the same gradient.
    const std::string resume = dir.string();
    auto parsed = parse_resume(resume);
    ASSERT_TRUE(parsed.checkpoint.has_value());
    const auto resumed = resume_task(parsed);
    ASSERT_EQ(resumed.step, 1);
    const auto& optimizer = resumed.optimizer;
    ASSERT_EQ(optimizer->state().size(), resumed.task->model().parameters().size());
    for (const auto& [key, state] : optimizer->state()) {
      ASSERT_NE(state, nullptr);
      const auto& adam = dynamic_cast<const torch::optim::AdamParamState&>(*state);
      EXPECT_EQ(adam.step(), 1);
      const auto expected_sq = adam.exp_avg().square() * ((1 - 0.999) / ((1 - 0.9) * (1 - 0.9)));
      EXPECT_TRUE(torch::allclose(adam.exp_avg_sq(), expected_sq, 1e-4, 1e-12));
    }
    // And the run goes on.
    auto run = train("--resume " + resume + " --steps 3 --quiet", /*merge_stderr=*/true);
    EXPECT_EQ(run.exit_code, 0) << run.output;
    fs::remove_all(dir);
  }
}

// A value of QKV_TILED_ISA or QKV_LINEAR_GEMM that qkv refuses is a usage error: exit 2, one line
// naming the variable, the value and what it takes, and nothing written (it used to surface at the
// first linear layer as a runtime error, exit 1).
TEST(TrainApp, RefusedRouteVariablesExitWith2BeforeWriting) {
  for (const auto& [setting, message] : std::vector<std::pair<std::string, std::string>>{
           {"QKV_TILED_ISA=avx9000", "QKV_TILED_ISA: expected one of portable, avx2, avx512, avx512_bf16, amx_bf16, "
                                     "got 'avx9000'"},
           {"QKV_LINEAR_GEMM=mkl", "QKV_LINEAR_GEMM: expected libtorch or no-onednn (or unset), got 'mkl'"}}) {
    const auto out = fresh_dir("refused_route");
    auto run = qkv_test::run_command("env " + setting + " " + QKV_TRAIN_PATH + " " + kSmallReverse + "--steps 2 --out " +
                                         out.string(),
                                     /*merge_stderr=*/true);
    EXPECT_EQ(run.exit_code, 2) << setting << ": " << run.output;
    EXPECT_THAT(run.output, HasSubstr("qkv-train: error: ")) << setting;
    EXPECT_THAT(run.output, HasSubstr(message)) << setting;
    EXPECT_EQ(std::count(run.output.begin(), run.output.end(), '\n'), 1) << setting << ": " << run.output;
    EXPECT_FALSE(fs::exists(out)) << setting;
  }
}

// ---- Data-parallel training (qkv-train --nproc, torchrun's environment). ----

// Runs qkv-train with `assignments` (VAR=value ...) as its only distributed environment variables.
qkv_test::ProcessResult train_in_env(const std::string& assignments, const std::string& arguments,
                                     bool merge_stderr = false) {
  return qkv_test::run_command(
      "env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR -u "
      "MASTER_PORT " +
          assignments + " " + QKV_TRAIN_PATH + " " + arguments,
      merge_stderr);
}

TEST(TrainDistributed, TwoGlooRanksEqualOneProcessOnTheWholeBatch) {
  // float64: the comparison with one process then measures the algorithm, not float32 rounding
  // (in float32, W_k's bias, whose exact gradient is zero, follows Adam's reading of rounding noise).
  for (const std::string task : {"reverse", "lookup"}) {
    const auto job = fresh_dir("ddp_" + task), single = fresh_dir("single_" + task);
    const std::string args = "--task " + task +
                             " --device cpu --dtype float64 --seq-len 6 --d-model 16 --batch 8 "
                             "--steps 12 --log-every 1 --eval-every 6 --quiet ";
    auto run = train_in_env("", "--nproc 2 --save-replicas --out " + job.string() + " " + args, true);
    ASSERT_EQ(run.exit_code, 0) << run.output;
    ASSERT_EQ(train_in_env("", "--threads 1 --out " + single.string() + " " + args).exit_code, 0);

    EXPECT_EQ(max_weight_difference(job / "replica-0.pt", job / "replica-1.pt"), 0.0) << "replicas differ";
    EXPECT_LE(max_weight_difference(job / "model.pt", single / "model.pt"), 1e-6) << task;
    EXPECT_EQ(max_weight_difference(job / "model.pt", job / "replica-0.pt"), 0.0);
    // Rank 0 logs the loss of the whole batch: the same as one process's, step by step (to the
    // float32 in which the tasks compute their loss).
    const auto ddp_losses = losses_by_step(job / "metrics.csv"), single_losses = losses_by_step(single / "metrics.csv");
    ASSERT_EQ(ddp_losses.size(), 12u);
    ASSERT_EQ(single_losses.size(), 12u);
    for (const auto& [step, loss] : single_losses) {
      EXPECT_NEAR(std::stod(ddp_losses.at(step)), std::stod(loss), 1e-6) << task << " step " << step;
    }
    const auto summary = nlohmann::json::parse(read_file(job / "summary.json"));
    EXPECT_EQ(summary["distributed"]["world_size"], 2);
    EXPECT_EQ(summary["distributed"]["backend"], "gloo");
    EXPECT_EQ(summary["distributed"]["examples_per_rank"], 4);
    EXPECT_FALSE(fs::exists(job / "replica-2.pt"));
    fs::remove_all(job), fs::remove_all(single);
  }
}

TEST(TrainDistributed, Float32ReplicasStayBitIdenticalAndOnlyRankZeroWrites) {
  const auto job = fresh_dir("ddp_f32");
  // Different seeds per process cannot split the replicas: rank 0's weights are broadcast at start
  // and every step applies the same averaged gradient.
  auto run =
      train_in_env("", kSmallReverse + "--steps 30 --nproc 2 --save-replicas --json --out " + job.string(), true);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(max_weight_difference(job / "replica-0.pt", job / "replica-1.pt"), 0.0);
  // One summary on stdout (rank 0's), not one per rank.
  const auto first = run.output.find("\"qkv_version\"");
  ASSERT_NE(first, std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("\"qkv_version\"", first + 1), std::string::npos) << run.output;
  for (const char* file : {"metrics.csv", "summary.json", "loss.png", "attention.png", "checkpoint.pt", "model.pt"}) {
    EXPECT_TRUE(fs::exists(job / file)) << file;
  }
  fs::remove_all(job);
}

TEST(TrainDistributed, ResumedJobEqualsUninterruptedJob) {
  const auto whole = fresh_dir("ddp_whole"), split = fresh_dir("ddp_split");
  ASSERT_EQ(train_in_env("", kSmallReverse + "--nproc 2 --steps 30 --log-every 1 --out " + whole.string()).exit_code,
            0);
  ASSERT_EQ(train_in_env("", kSmallReverse + "--nproc 2 --steps 15 --log-every 1 --out " + split.string()).exit_code,
            0);
  auto resumed = train_in_env("", "--nproc 2 --resume " + split.string() + " --steps 30 --quiet", true);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(losses_by_step(split / "metrics.csv"), losses_by_step(whole / "metrics.csv"));
  fs::remove_all(whole), fs::remove_all(split);
}

TEST(TrainDistributed, MalformedEnvironmentsAreRefusedNamingTheVariable) {
  const std::string ok = "MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 ";
  const std::pair<std::string, std::string> cases[] = {
      {"RANK=0", "RANK is set but WORLD_SIZE is not"},
      {"WORLD_SIZE=2", "WORLD_SIZE is set but RANK is not"},
      {"RANK=0 WORLD_SIZE=two " + ok, "WORLD_SIZE='two': expected a whole number"},
      {"RANK=-1 WORLD_SIZE=2 " + ok, "RANK='-1': expected a whole number from 0"},
      {"RANK=2 WORLD_SIZE=2 " + ok, "RANK=2 with WORLD_SIZE=2: expected a rank from 0 to 1"},
      {"RANK=0 WORLD_SIZE=2 MASTER_PORT=29999", "lacks MASTER_ADDR"},
      {"RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1", "lacks MASTER_PORT"},
      {"RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=70000",
       "MASTER_PORT='70000': expected a whole number from 1 to 65535"},
      {"RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 LOCAL_RANK=2 " + ok, "LOCAL_RANK=2 with LOCAL_WORLD_SIZE=2"},
      {"RANK=0 WORLD_SIZE=3 " + ok, "--batch 8 is the total batch and must divide evenly over the 3 processes"},
  };
  for (const auto& [environment, message] : cases) {
    auto run = train_in_env(environment, kSmallReverse + "--steps 2", true);
    EXPECT_EQ(run.exit_code, 2) << environment << "\n" << run.output;
    EXPECT_THAT(run.output, HasSubstr(message)) << environment;
    EXPECT_EQ(std::count(run.output.begin(), run.output.end(), '\n'), 1) << "one line: " << run.output;
  }
  auto nested = train_in_env("RANK=0 WORLD_SIZE=2 " + ok, kSmallReverse + "--nproc 2", true);
  EXPECT_EQ(nested.exit_code, 2);
  EXPECT_THAT(nested.output, HasSubstr("--nproc starts its own processes, but RANK and WORLD_SIZE are already set"));
  auto seed = train_in_env("", "--task seed --nproc 2", true);
  EXPECT_EQ(seed.exit_code, 2);
  EXPECT_THAT(seed.output, HasSubstr("--nproc is not an option of --task seed"));
  auto uneven = train_in_env("", kSmallReverse + "--nproc 3", true);
  EXPECT_EQ(uneven.exit_code, 2);
  EXPECT_THAT(uneven.output, HasSubstr("--batch 8 is the total batch and must divide evenly over the 3 processes"));
}

}  // namespace
