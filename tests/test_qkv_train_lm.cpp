// qkv-train --task lm: the character-level language model, run as a user runs it, and its text
// handling. The training losses against PyTorch are checked by scripts/lm_pytorch.py (ctest
// lm.pytorch_parity).
#include "support/apps.h"
#include "support/fixtures.h"

#include "tasks/lm/gpt.h"
#include "tasks/lm/text_data.h"

#include <gmock/gmock.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace {

using ::testing::HasSubstr;
using namespace qkv_test;

const std::string kExcerpt = qkv_test::data_path("devil_excerpt.txt");
// A model small enough for tests: two blocks, grouped-query heads.
const std::string kSmallLm = "--task lm --device cpu --data " + kExcerpt +
                             " --d-model 32 --heads 4 --kv-heads 2 --layers 2 --seq-len 32 --batch 8 --quiet ";

void write(const fs::path& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

TEST(LanguageModelText, EveryUtf8TextRoundTripsThroughTheTokenizer) {
  const std::string text =
      "The Devil's Dictionary — Ambrose Bierce, 1906.\nÆsop: «ça» 漢字 𝄞 emoji 🙂\ttab\r\n";
  const auto characters = qkv_train::lm::decode_utf8(text, "test");
  EXPECT_EQ(characters.size(), 76u);  // code points, not bytes
  EXPECT_EQ(qkv_train::lm::encode_utf8(characters), text);
  const qkv_train::lm::CharTokenizer tokenizer(characters);
  const auto ids = tokenizer.encode(characters, "test");
  EXPECT_EQ(ids.numel(), static_cast<int64_t>(characters.size()));
  EXPECT_EQ(tokenizer.decode(ids), text);
  // The committed excerpt, whole.
  const auto excerpt = read_file(kExcerpt);
  const auto excerpt_characters = qkv_train::lm::decode_utf8(excerpt, "excerpt");
  const qkv_train::lm::CharTokenizer excerpt_tokenizer(excerpt_characters);
  EXPECT_EQ(excerpt_tokenizer.decode(excerpt_tokenizer.encode(excerpt_characters, "excerpt")), excerpt);
}

TEST(LanguageModelText, InvalidUtf8IsRefusedWithItsOffset) {
  for (const auto& [bytes, why] :
       std::vector<std::pair<std::string, std::string>>{{std::string("ab\xff", 3), "invalid leading byte at byte 2"},
                                                        {std::string("ab\xc3", 3), "truncated sequence at byte 2"},
                                                        {std::string("a\xc0\xaf", 3), "overlong sequence at byte 1"},
                                                        {std::string("a\0b", 3), "NUL byte"},
                                                        {std::string("\xed\xa0\x80", 3), "outside Unicode"}}) {
    EXPECT_THAT([&] { qkv_train::lm::decode_utf8(bytes, "input"); },
                ::testing::ThrowsMessage<qkv_train::lm::DataError>(HasSubstr(why)));
  }
}

// A dictd index number of more digits than int64 holds is refused by name (it overflowed first,
// then passed or failed the bounds check by chance).
TEST(LanguageModelText, ADictdIndexNumberTooLargeForInt64IsRefused) {
  const auto dir = fresh_dir("lm_dictd");
  fs::create_directories(dir);
  write(dir / "words.dict", "ABASEMENT, n. A decent and customary mental attitude.\n");
  ASSERT_EQ(std::system(("gzip -f " + (dir / "words.dict").string()).c_str()), 0);
  fs::rename(dir / "words.dict.gz", dir / "words.dict.dz");
  write(dir / "words.index", "abasement\t//////////////\tB\n");  // 64^14 - 1 > 2^63 - 1
  EXPECT_THAT([&] { qkv_train::lm::read_text((dir / "words.dict.dz").string()); },
              ::testing::ThrowsMessage<qkv_train::lm::DataError>(HasSubstr("is too large")));
  write(dir / "words.index", "abasement\tA\tB\n");  // a sane index: its one entry
  EXPECT_EQ(qkv_train::lm::read_text((dir / "words.dict.dz").string()), "A");
  fs::remove_all(dir);
}

TEST(LanguageModelText, TheDefaultTextIsTheDevilsDictionaryWithoutItsDatabaseHeaders) {
  if (!fs::exists(qkv_train::lm::kDefaultText)) GTEST_SKIP() << "dict-devil is not installed (scripts/setup.sh)";
  const auto text = qkv_train::lm::read_text(qkv_train::lm::kDefaultText);
  EXPECT_GT(text.size(), 300000u);
  EXPECT_EQ(text.rfind("ABASEMENT, n.", 0), 0u) << text.substr(0, 80);  // the first entry
  EXPECT_EQ(text.find("00-database"), std::string::npos);
  EXPECT_EQ(read_file(kExcerpt), text.substr(0, read_file(kExcerpt).size())) << "the excerpt is its beginning";
}

TEST(LanguageModel, WritesItsFilesAndIsDeterministic) {
  const auto a = fresh_dir("lm_a"), b = fresh_dir("lm_b");
  for (const auto& dir : {a, b}) {
    auto run = train(kSmallLm + "--steps 12 --log-every 1 --eval-every 6 --json --out " + dir.string());
    ASSERT_EQ(run.exit_code, 0) << run.output;
  }
  EXPECT_EQ(losses_by_step(a / "metrics.csv"), losses_by_step(b / "metrics.csv"));
  EXPECT_EQ(losses_by_step(a / "metrics.csv").size(), 12u);
  const auto summary = nlohmann::json::parse(read_file(a / "summary.json"));
  for (const char* key : {"val_loss", "val_bpc", "bigram_val_loss"}) EXPECT_TRUE(summary["eval"].contains(key)) << key;
  EXPECT_NEAR(summary["eval"]["val_bpc"].get<double>(), summary["eval"]["val_loss"].get<double>() / std::log(2.0),
              1e-9);
  EXPECT_EQ(summary["data"]["tokenization"], "character (Unicode code point)");
  EXPECT_TRUE(summary["sample"]["text"].is_string());
  for (const char* file : {"loss.png", "attention.png"}) EXPECT_TRUE(is_png(a / file)) << file;
  for (const char* file : {"checkpoint.pt", "model.pt", "model_init.pt", "vocab.json", "metrics.csv"}) {
    EXPECT_TRUE(fs::exists(a / file)) << file;
  }
  fs::remove_all(a), fs::remove_all(b);
}

TEST(LanguageModel, ResumedRunEqualsUninterruptedRun) {
  const auto whole = fresh_dir("lm_whole"), split = fresh_dir("lm_split");
  // Dropout on: the resumed run must also continue the random stream exactly.
  const std::string args = kSmallLm + "--dropout 0.1 --log-every 1 --eval-every 5 ";
  ASSERT_EQ(train(args + "--steps 10 --out " + whole.string()).exit_code, 0);
  ASSERT_EQ(train(args + "--steps 5 --out " + split.string()).exit_code, 0);
  auto resumed = train("--resume " + split.string() + " --steps 10 --quiet", /*merge_stderr=*/true);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(losses_by_step(split / "metrics.csv"), losses_by_step(whole / "metrics.csv"));
  fs::remove_all(whole), fs::remove_all(split);
}

// The same machinery as the toy tasks: two Gloo ranks on halves of each batch equal one process on
// the whole batch (float64, no dropout: the comparison measures the algorithm, not rounding).
TEST(LanguageModel, TwoDataParallelRanksEqualOneProcess) {
  const auto job = fresh_dir("lm_ddp"), single = fresh_dir("lm_single");
  const std::string args = kSmallLm + "--dtype float64 --dropout 0 --steps 6 --log-every 1 --eval-every 6 ";
  auto run = qkv_test::run_command("env -u RANK -u WORLD_SIZE " + std::string(QKV_TRAIN_PATH) + " " + args +
                                       "--nproc 2 --save-replicas --out " + job.string(),
                                   /*merge_stderr=*/true);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_EQ(train(args + "--threads 1 --out " + single.string()).exit_code, 0);
  EXPECT_EQ(max_weight_difference(job / "replica-0.pt", job / "replica-1.pt"), 0.0) << "replicas differ";
  EXPECT_LE(max_weight_difference(job / "model.pt", single / "model.pt"), 1e-6);
  const auto ddp = losses_by_step(job / "metrics.csv"), one = losses_by_step(single / "metrics.csv");
  ASSERT_EQ(ddp.size(), 6u);
  for (const auto& [step, loss] : one) EXPECT_NEAR(std::stod(ddp.at(step)), std::stod(loss), 1e-9) << step;
  fs::remove_all(job), fs::remove_all(single);
}

TEST(LanguageModel, GreedyGenerationWithTheCacheEqualsRecomputingThePrefix) {
  const auto out = fresh_dir("lm_generate");
  ASSERT_EQ(train(kSmallLm + "--steps 30 --out " + out.string()).exit_code, 0);
  const std::string generate = "--generate --resume " + out.string() + " --prompt 'THE ' --max-new-tokens 24 ";
  auto cached = train(generate + "--temperature 0 --json");
  auto recomputed = train(generate + "--temperature 0 --no-kv-cache --json");
  ASSERT_EQ(cached.exit_code, 0) << cached.output;
  ASSERT_EQ(recomputed.exit_code, 0) << recomputed.output;
  const auto with_cache = nlohmann::json::parse(cached.output),
             without_cache = nlohmann::json::parse(recomputed.output);
  EXPECT_EQ(with_cache["text"], without_cache["text"]);
  EXPECT_EQ(with_cache["new_tokens"], 24);
  EXPECT_TRUE(with_cache["kv_cache"].get<bool>());
  EXPECT_FALSE(without_cache["kv_cache"].get<bool>());
  // Sampling is seeded: the same seed gives the same text, and the plain output is prompt + text.
  auto sampled = train(generate + "--temperature 0.8 --top-k 5 --seed 3");
  auto again = train(generate + "--temperature 0.8 --top-k 5 --seed 3");
  ASSERT_EQ(sampled.exit_code, 0) << sampled.output;
  EXPECT_EQ(sampled.output, again.output);
  EXPECT_EQ(sampled.output.rfind("THE ", 0), 0u) << sampled.output;
  fs::remove_all(out);
}

// More new tokens than the context (32): the context slides (re-filled caches), and the cached
// generation still equals recomputing the same window for every token.
TEST(LanguageModel, GenerationPastTheContextSlidesAndTheCacheStillAgrees) {
  const auto out = fresh_dir("lm_long_generate");
  ASSERT_EQ(train(kSmallLm + "--steps 10 --out " + out.string()).exit_code, 0);
  const std::string generate = "--generate --resume " + out.string() + " --max-new-tokens 100 --temperature 0 --json ";
  auto cached = train(generate), recomputed = train(generate + "--no-kv-cache");
  ASSERT_EQ(cached.exit_code, 0) << cached.output;
  ASSERT_EQ(recomputed.exit_code, 0) << recomputed.output;
  const auto with_cache = nlohmann::json::parse(cached.output), without = nlohmann::json::parse(recomputed.output);
  EXPECT_EQ(with_cache["new_tokens"], 100);
  EXPECT_EQ(with_cache["context"], 32);
  EXPECT_EQ(with_cache["text"], without["text"]);
  fs::remove_all(out);
}

// A model trained with --window generates past its context with rolling caches (constant
// memory), and that equals recomputing the whole sequence for every token.
TEST(LanguageModel, AWindowedModelGeneratesPastItsContextWithRollingCaches) {
  const auto out = fresh_dir("lm_window");
  ASSERT_EQ(train(kSmallLm + "--window 8 --steps 10 --out " + out.string()).exit_code, 0);
  const std::string generate = "--generate --resume " + out.string() + " --max-new-tokens 80 --temperature 0 --json ";
  auto cached = train(generate), recomputed = train(generate + "--no-kv-cache");
  ASSERT_EQ(cached.exit_code, 0) << cached.output;
  ASSERT_EQ(recomputed.exit_code, 0) << recomputed.output;
  EXPECT_EQ(nlohmann::json::parse(cached.output)["text"], nlohmann::json::parse(recomputed.output)["text"]);
  EXPECT_EQ(nlohmann::json::parse(cached.output)["new_tokens"], 80);
  fs::remove_all(out);
}

// bf16-mixed trains the language model (its evaluation samples with caches made under autocast)
// and ends near the float32 run's loss.
TEST(LanguageModel, Bf16MixedPrecisionTrainsNearTheFloat32Run) {
  const std::string args = kSmallLm + "--steps 30 --eval-every 30 --dropout 0 --json ";
  auto fp32 = train(args), mixed = train(args + "--precision bf16-mixed");
  ASSERT_EQ(fp32.exit_code, 0) << fp32.output;
  ASSERT_EQ(mixed.exit_code, 0) << mixed.output;
  const auto expected = nlohmann::json::parse(fp32.output), actual = nlohmann::json::parse(mixed.output);
  EXPECT_NEAR(actual["eval"]["val_loss"].get<double>(), expected["eval"]["val_loss"].get<double>(), 0.05);
  EXPECT_EQ(actual["precision"], "bf16-mixed");
}

// A half-precision model's token embedding (--dtype bfloat16) gathers its rows exactly and sums
// each token's gradient rows as float64 does, within one rounding: a default step's 4096 ids over
// a character vocabulary put hundreds of rows on the common tokens, which LibTorch's own CPU
// backward adds one rounding at a time.
TEST(LanguageModel, ItsEmbeddingGradientIsRoundedOnceInHalfPrecision) {
  torch::manual_seed(0);
  const int64_t V = 65, E = 32;
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const double unit_roundoff = dtype == torch::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    const auto what = c10::toString(dtype);
    // Skewed ids, as a text's characters are: the first tokens take most of the 4096.
    const auto ids = (torch::rand({16, 256}).pow(3) * V).to(torch::kLong);  // (B, N)
    const auto table = torch::randn({V, E}).to(dtype).requires_grad_();
    const auto upstream = torch::randn({16, 256, E}).to(dtype);

    const auto rows = qkv_train::lm::embed(table, ids);  // (B, N, E)
    rows.backward(upstream);
    ASSERT_EQ(rows.scalar_type(), dtype) << what;
    EXPECT_TRUE(torch::equal(rows, table.detach().index_select(0, ids.flatten()).view({16, 256, E}))) << what;
    const auto expected = torch::zeros({V, E}, torch::kDouble)
                              .index_add_(0, ids.flatten(), upstream.to(torch::kDouble).view({-1, E}));
    EXPECT_TRUE(within_one_rounding(table.grad(), expected, unit_roundoff)) << what;
  }
}

// A bfloat16 model (--dtype bfloat16) trains every weight: AdamW steps on float32 master copies,
// where on the bfloat16 weights themselves its steps (at most the learning rate) were under half
// the spacing of LayerNorm's gains near 1 (2^-7) and never moved them. The masters go into the
// checkpoint, so a resumed run ends on the same bfloat16 weights as an uninterrupted one.
TEST(LanguageModel, ABFloat16ModelTrainsEveryWeightAndResumesExactly) {
  const auto whole = fresh_dir("lm_bf16_whole"), split = fresh_dir("lm_bf16_split");
  // The first 10 of 100 warmup steps (as resuming needs: the rate does not depend on --steps
  // there), rising to 2e-3 at the tenth.
  const std::string args = kSmallLm + "--dtype bfloat16 --dropout 0 --lr 0.02 --log-every 1 --eval-every 5 ";
  auto run = train(args + "--steps 10 --json --out " + whole.string());
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(nlohmann::json::parse(run.output)["master_weights"], "float32");
  const auto trained = qkv::read_tensor_dict((whole / "model.pt").string());
  const auto initial = qkv::read_tensor_dict((whole / "model_init.pt").string());
  ASSERT_EQ(trained.size(), initial.size());
  for (const auto& [name, weight] : trained) {
    EXPECT_EQ(weight.scalar_type(), torch::kBFloat16) << name;
    EXPECT_FALSE(torch::equal(weight, initial.at(name))) << name << " never moved";
  }
  ASSERT_EQ(train(args + "--steps 5 --out " + split.string()).exit_code, 0);
  auto resumed = train("--resume " + split.string() + " --steps 10 --quiet", /*merge_stderr=*/true);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(losses_by_step(split / "metrics.csv"), losses_by_step(whole / "metrics.csv"));
  EXPECT_EQ(max_weight_difference(split / "model.pt", whole / "model.pt"), 0.0);
  fs::remove_all(whole), fs::remove_all(split);
}

// --checkpoint-activations trains exactly as without (float64, dropout on: the recomputation
// replays the dropout masks), step for step.
TEST(LanguageModel, CheckpointedActivationsTrainExactlyAsThePlainModel) {
  const auto plain = fresh_dir("lm_plain"), checkpointed = fresh_dir("lm_checkpointed");
  const std::string args = kSmallLm + "--dtype float64 --dropout 0.1 --steps 5 --log-every 1 --eval-every 5 ";
  ASSERT_EQ(train(args + "--out " + plain.string()).exit_code, 0);
  ASSERT_EQ(train(args + "--checkpoint-activations --out " + checkpointed.string()).exit_code, 0);
  const auto expected = losses_by_step(plain / "metrics.csv"), actual = losses_by_step(checkpointed / "metrics.csv");
  ASSERT_EQ(actual.size(), 5u);
  EXPECT_EQ(actual, expected);
  EXPECT_EQ(max_weight_difference(plain / "model.pt", checkpointed / "model.pt"), 0.0);
  fs::remove_all(plain), fs::remove_all(checkpointed);
}

// SIGINT and SIGTERM reach qkv-train on one thread of its own (apps/qkv-train/stop_signals.h): every
// other thread, the products' included, blocks both, so no handler ever runs on a thread in the
// middle of a product (oneDNN issue #4845 corrupted the heap that way). The kernel's view of each
// thread's mask (SigBlk in /proc/PID/task/TID/status) while the model trains on 2 threads: one
// thread takes them (sigwait unblocks them while it waits), the rest block them. (`env
// --default-signal=INT`: a background job of a non-interactive shell starts with SIGINT ignored.)
TEST(LanguageModel, OnlyTheSignalThreadTakesStopSignals) {
  const auto out = fresh_dir("lm_signal_thread");
  const std::string command =
      "env --default-signal=INT " + std::string(QKV_TRAIN_PATH) + " " + kSmallLm +
      "--threads 2 --steps 100000000 --out " + out.string() +
      " 2> /dev/null & pid=$!; for i in $(seq 600); do [ -s " + (out / "metrics.csv").string() +
      " ] && break; sleep 0.1; done; sleep 0.5; for t in /proc/$pid/task/*; do "
      "echo \"mask $(awk '/^SigBlk/ { print $2 }' $t/status)\"; done; kill -INT $pid; wait $pid; echo exit=$?";
  const auto run = qkv_test::run_command(command);
  constexpr unsigned long long kStopSignals = (1ULL << (SIGINT - 1)) | (1ULL << (SIGTERM - 1));
  int blocking = 0, taking = 0, threads = 0;
  std::istringstream lines(run.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("mask ", 0) != 0) continue;
    const auto mask = std::stoull(line.substr(5), nullptr, 16);
    ++threads;
    blocking += (mask & kStopSignals) == kStopSignals;
    taking += (mask & kStopSignals) == 0;
  }
  EXPECT_GE(threads, 3) << "expected the main thread, the signal thread and a worker:\n" << run.output;
  EXPECT_EQ(taking, 1) << run.output;
  EXPECT_EQ(blocking, threads - 1) << run.output;
  // The signal still stops the run as a handler did: the step finishes, a checkpoint, exit 130.
  EXPECT_THAT(run.output, HasSubstr("exit=130"));
  EXPECT_TRUE(fs::exists(out / "checkpoint.pt"));
  fs::remove_all(out);
}

// Checkpointed activations and bf16-mixed precision with two data-parallel ranks: the replicas
// stay identical.
TEST(LanguageModel, CheckpointingAndMixedPrecisionWithDataParallelRanks) {
  const auto job = fresh_dir("lm_ddp_checkpoint");
  auto run = qkv_test::run_command("env -u RANK -u WORLD_SIZE " + std::string(QKV_TRAIN_PATH) + " " + kSmallLm +
                                       "--steps 4 --window 8 --checkpoint-activations --precision bf16-mixed --nproc 2 "
                                       "--save-replicas --out " + job.string(),
                                   /*merge_stderr=*/true);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(max_weight_difference(job / "replica-0.pt", job / "replica-1.pt"), 0.0) << "replicas differ";
  fs::remove_all(job);
}

// --generate --resume DIR needs DIR only: the text it was trained on may be gone, and a model.pt
// left there by another run is not paired with the checkpoint's options (the checkpoint's own
// weights, options and vocabulary are used).
TEST(LanguageModel, GenerationNeedsOnlyTheRunFolder) {
  const auto dir = fresh_dir("lm_folder_only"), out = dir / "run", other = dir / "other";
  fs::create_directories(dir);
  const auto text = dir / "text.txt";
  write(text, read_file(kExcerpt));
  const std::string model = " --device cpu --d-model 32 --heads 4 --layers 1 --seq-len 32 --batch 8 --quiet ";
  ASSERT_EQ(train("--task lm --data " + text.string() + model + "--steps 8 --out " + out.string()).exit_code, 0);
  const std::string generate = "--generate --resume " + out.string() + " --max-new-tokens 20 --temperature 0 --json";
  const auto before = train(generate);
  ASSERT_EQ(before.exit_code, 0) << before.output;
  // The run's model.pt (its final weights, as the checkpoint's) with the vocab.json beside it, and
  // no --task: --generate is lm's.
  const auto from_weights =
      train("--generate --init-weights " + (out / "model.pt").string() + " --max-new-tokens 20 --temperature 0 --json");
  ASSERT_EQ(from_weights.exit_code, 0) << from_weights.output;
  EXPECT_EQ(nlohmann::json::parse(from_weights.output)["text"], nlohmann::json::parse(before.output)["text"]);
  EXPECT_EQ(nlohmann::json::parse(from_weights.output)["weights"], (out / "model.pt").string());
  fs::remove(text);  // the training text is gone
  // Another run's model.pt (another shape) in the folder: a stale file, not the checkpoint's weights.
  ASSERT_EQ(train("--task lm --data " + kExcerpt + " --device cpu --d-model 16 --heads 2 --layers 1 --seq-len 16 "
                  "--batch 4 --quiet --steps 2 --out " + other.string())
                .exit_code,
            0);
  fs::copy_file(other / "model.pt", out / "model.pt", fs::copy_options::overwrite_existing);
  const auto after = train(generate);
  ASSERT_EQ(after.exit_code, 0) << after.output;
  EXPECT_EQ(nlohmann::json::parse(after.output)["text"], nlohmann::json::parse(before.output)["text"]);
  EXPECT_EQ(nlohmann::json::parse(after.output)["weights"], (out / "checkpoint.pt").string());
  fs::remove_all(dir);
}

// A text without a newline trains and samples (its default prompt is its first character), and
// summary.json says what ran: a causal model trained with AdamW.
TEST(LanguageModel, ATextWithoutNewlinesTrainsAndTheSummarySaysWhatRan) {
  const auto dir = fresh_dir("lm_one_line");
  fs::create_directories(dir);
  std::string line = read_file(kExcerpt);
  std::replace(line.begin(), line.end(), '\n', ' ');
  write(dir / "line.txt", line);
  auto run = train("--task lm --data " + (dir / "line.txt").string() +
                       " --device cpu --d-model 32 --heads 4 --layers 1 --seq-len 32 --batch 8 --steps 4 --quiet --json "
                       "--out " + (dir / "out").string(),
                   /*merge_stderr=*/false);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto summary = nlohmann::json::parse(run.output);
  EXPECT_EQ(summary["sample"]["prompt"], line.substr(0, 1));
  EXPECT_TRUE(summary["options"]["causal"].get<bool>());
  EXPECT_EQ(summary["options"]["optimizer"], "adamw");
  auto generated = train("--generate --resume " + (dir / "out").string() + " --max-new-tokens 10 --json");
  ASSERT_EQ(generated.exit_code, 0) << generated.output;
  EXPECT_EQ(nlohmann::json::parse(generated.output)["prompt"], line.substr(0, 1));
  fs::remove_all(dir);
}

TEST(LanguageModel, AOneMinuteRunOnTheExcerptBeatsTheBigramBaseline) {
  const auto out = fresh_dir("lm_learns");
  auto run = train("--task lm --device cpu --data " + kExcerpt +
                       " --d-model 64 --heads 4 --layers 2 --seq-len 64 --batch 16 --steps 300 --lr 3e-3 "
                       "--warmup-steps 30 --dropout 0 --eval-every 300 --quiet --json --out " +
                       out.string(),
                   /*merge_stderr=*/false);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto summary = nlohmann::json::parse(run.output);
  EXPECT_LT(summary["eval"]["val_loss"].get<double>(), summary["eval"]["bigram_val_loss"].get<double>())
      << summary.dump(2);
  EXPECT_LT(summary["wall_time_s"].get<double>(), 600.0) << "not a timing test; just a bound on runaway runs";
  fs::remove_all(out);
}

TEST(LanguageModel, BadInputsAreClearErrorsWithStatus2) {
  const auto dir = fresh_dir("lm_bad");
  fs::create_directories(dir);
  write(dir / "empty.txt", "");
  write(dir / "binary.bin", std::string("\x7f"
                                        "ELF\x02\x01\x01\0\0\0",
                                        10));
  write(dir / "short.txt", "too short");
  const auto model = fresh_dir("lm_bad_model");
  ASSERT_EQ(train(kSmallLm + "--steps 2 --out " + model.string()).exit_code, 0);
  const std::string generate = "--generate --resume " + model.string() + " ";
  // Weights whose vocab.json is missing, not JSON, or without a vocabulary.
  for (const char* folder : {"lonely", "not_json", "no_vocabulary"}) {
    fs::create_directories(dir / folder);
    fs::copy_file(model / "model.pt", dir / folder / "model.pt");
  }
  write(dir / "not_json" / "vocab.json", "{");
  write(dir / "no_vocabulary" / "vocab.json", "{\"model\": {}}");
  const auto from_weights = [&](const char* folder) {
    return "--generate --init-weights " + (dir / folder / "model.pt").string();
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--task lm --data " + (dir / "missing.txt").string(), "--data"},
      {"--task lm --data " + (dir / "empty.txt").string(), "the file is empty"},
      {"--task lm --data " + (dir / "binary.bin").string(), "is not UTF-8 text"},
      {"--task lm --data " + (dir / "short.txt").string(), "too few for --seq-len"},
      {generate + "--prompt 'zebra ~~ \xe2\x82\xac'", "characters outside the model's vocabulary"},
      {generate + "--top-k 0", "--top-k"},
      {"--task lm --generate", "--generate needs a trained model"},
      {from_weights("lonely"), "expected " + (dir / "lonely" / "vocab.json").string()},
      {from_weights("not_json"), "vocab.json is not valid JSON"},
      {from_weights("no_vocabulary"), "vocab.json holds no vocabulary"},
      {"--task lm --causal", "--causal is not an option of --task lm"},
  };
  for (const auto& [arguments, message] : cases) {
    auto run = train(arguments + " --device cpu", /*merge_stderr=*/true);
    EXPECT_EQ(run.exit_code, 2) << arguments << ": " << run.output;
    EXPECT_THAT(run.output, HasSubstr(message)) << arguments;
    EXPECT_THAT(run.output, HasSubstr("qkv-train: error:")) << arguments;
  }
  fs::remove_all(dir), fs::remove_all(model);
}

}  // namespace
