// Hardening of the library: valid edge inputs work (empty sequences and batches, non-contiguous
// and expanded tensors), extreme numbers stay finite, and corrupted weight files are refused
// with the file named, never loaded half-way or silently wrong.
#include "support/fixtures.h"

#include <gmock/gmock.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

namespace {

using ::testing::HasSubstr;

qkv::SelfAttention small_module() {
  torch::manual_seed(0);
  return qkv::SelfAttention(qkv::SelfAttentionOptions(8).num_heads(2).out_proj(true));
}

// ---- Valid edge inputs ----

TEST(EdgeInputs, EmptySequencesAndBatchesGiveEmptyOrZeroOutputs) {
  auto module = small_module();
  EXPECT_EQ(module(torch::randn({2, 0, 8})).sizes(), c10::IntArrayRef({2, 0, 8}));  // N = 0
  EXPECT_EQ(module(torch::randn({0, 5, 8})).sizes(), c10::IntArrayRef({0, 5, 8}));  // B = 0
  EXPECT_EQ(module(torch::randn({0, 8})).sizes(), c10::IntArrayRef({0, 8}));        // unbatched N = 0
  // S = 0: no key at all, so every query gets a zero attention output (then W_o's bias).
  auto x = torch::randn({2, 3, 8}, torch::requires_grad());
  auto result = module->forward_with_weights(x, torch::randn({2, 0, 8}));
  EXPECT_EQ(result.weights.sizes(), c10::IntArrayRef({2, 2, 3, 0}));
  EXPECT_TRUE(qkv_test::tensors_close(result.output, module->W_o->bias.expand({2, 3, 8}), 1e-7));
  result.output.sum().backward();
  EXPECT_TRUE(x.grad().isfinite().all().item<bool>());
}

// An empty context with key masks is legal and gives what the unmasked empty context gives (it
// used to reach reshape({-1, 0}) and fail with ATen's "ambiguous" message).
TEST(EdgeInputs, EmptyContextWithKeyMasksGivesTheUnmaskedResult) {
  auto module = small_module();
  const auto x = torch::randn({2, 3, 8});
  const auto empty = torch::randn({2, 0, 8});
  const auto unmasked = module(x, empty);
  qkv::AttentionMask by_mask = qkv::AttentionMask::from_key_mask(torch::ones({2, 0}, torch::kBool));
  qkv::AttentionMask by_lengths = qkv::AttentionMask::from_lengths(torch::zeros({2}, torch::kLong));
  qkv::AttentionMask both = by_mask;
  both.key_lengths = by_lengths.key_lengths;
  for (const auto* mask : {&by_mask, &by_lengths, &both}) {
    EXPECT_TRUE(qkv_test::tensors_close(module(x, empty, *mask), unmasked, 0.0));
    EXPECT_TRUE(qkv_test::tensors_close(module->forward_with_weights(x, empty, *mask).output, unmasked, 0.0));
  }
  // Unbatched too: key_mask (S,) = (0,).
  EXPECT_TRUE(qkv_test::tensors_close(
      module(x[0], empty[0], qkv::AttentionMask::from_key_mask(torch::ones({0}, torch::kBool))), unmasked[0], 0.0));
}

// The core's key_lengths as SelfAttention's: any integer dtype (int32 from a tokenizer) gives what
// int64 gives, on every backend; a length below 0 or past S is refused naming the range (until
// 2026-12-07 the core clamped such lengths silently and refused int32).
TEST(EdgeInputs, KeyLengthsOfAnyIntegerDtypeAndOnlyWithinTheKeys) {
  torch::manual_seed(5);
  const auto q = torch::randn({2, 2, 4, 8}), k = torch::randn({2, 2, 6, 8}), v = torch::randn({2, 2, 6, 8});
  for (const auto backend : {qkv::AttentionBackend::Auto, qkv::AttentionBackend::Math, qkv::AttentionBackend::Tiled}) {
    auto options = qkv::ScaledDotProductAttentionOptions().backend(backend);
    const auto want = qkv::scaled_dot_product_attention(q, k, v, options.key_lengths(torch::tensor({6, 2}))).output;
    for (const auto dtype : {torch::kInt, torch::kShort, torch::kByte}) {
      const auto got =
          qkv::scaled_dot_product_attention(q, k, v, options.key_lengths(torch::tensor({6, 2}, dtype))).output;
      EXPECT_TRUE(qkv_test::tensors_close(got, want, 0.0)) << dtype;
    }
    for (const auto& [lengths, range] : {std::pair{torch::tensor({7, 2}), "got values from 2 to 7"},
                                         std::pair{torch::tensor({-1, 2}), "got values from -1 to 2"}}) {
      EXPECT_THAT([&] { qkv::scaled_dot_product_attention(q, k, v, options.key_lengths(lengths)); },
                  ::testing::ThrowsMessage<c10::Error>(
                      HasSubstr(std::string("expected key_lengths in [0, S] = [0, 6], ") + range)));
    }
    EXPECT_THAT([&] { qkv::scaled_dot_product_attention(q, k, v, options.key_lengths(torch::tensor({6.0, 2.0}))); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr("expected integer key_lengths, got Float")));
  }
}

TEST(EdgeInputs, NonContiguousAndExpandedInputsGiveTheSameResults) {
  auto module = small_module();
  auto x = torch::randn({3, 5, 8});
  auto expected = module(x);
  auto transposed = x.transpose(0, 1).contiguous().transpose(0, 1);  // same values, other strides
  ASSERT_FALSE(transposed.is_contiguous());
  EXPECT_TRUE(qkv_test::tensors_close(module(transposed), expected, 1e-6));
  auto row = torch::randn({1, 5, 8});
  auto expanded = row.expand({3, 5, 8});  // stride 0 on the batch dimension
  auto out = module(expanded);
  EXPECT_TRUE(qkv_test::tensors_close(out[2], module(row)[0], 1e-6));
  auto sliced = torch::randn({3, 10, 8}).slice(1, 0, 10, 2);  // every other position
  EXPECT_TRUE(qkv_test::tensors_close(module(sliced), module(sliced.contiguous()), 1e-6));
}

// ---- Numerics ----

TEST(Numerics, HugeUnscaledScoresStayFinite) {
  torch::manual_seed(1);
  qkv::SelfAttention module(qkv::SelfAttentionOptions(16).num_heads(2).scale(1.0));
  auto x = (100 * torch::randn({2, 6, 16})).requires_grad_(true);
  auto result = module->forward_with_weights(x);
  auto q = module->W_q(x);
  ASSERT_GT(q.abs().max().item<double>() * module->W_k(x).abs().max().item<double>(), 1e4)
      << "the test needs scores of magnitude 1e4";
  EXPECT_TRUE(result.output.isfinite().all().item<bool>());
  EXPECT_TRUE(qkv_test::tensors_close(result.weights.sum(-1), torch::ones({2, 2, 6}), 1e-5));
  result.output.pow(2).mean().backward();
  EXPECT_TRUE(x.grad().isfinite().all().item<bool>());
  for (const auto& p : module->parameters()) EXPECT_TRUE(p.grad().isfinite().all().item<bool>());
}

TEST(Numerics, HalfPrecisionForwardAndBackwardStayFinite) {
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    for (auto device : {torch::Device(torch::kCPU), torch::Device(torch::kCUDA)}) {
      if (device.is_cuda() && !torch::cuda::is_available()) continue;
      auto module = small_module();
      module->options.causal(true);
      module->to(device, dtype);
      auto x = torch::randn({2, 7, 8}, torch::TensorOptions(dtype).device(device)).requires_grad_(true);
      qkv::AttentionMask mask =
          qkv::AttentionMask::from_lengths(torch::tensor({7, 0}, torch::TensorOptions(torch::kLong).device(device)));
      torch::Tensor output;
      try {
        output = module->forward(x, {}, mask);
      } catch (const c10::Error& e) {
        // LibTorch 1.13 has no float16 matrix products on CPU: a clear error, nothing silent.
        EXPECT_THAT(e.what_without_backtrace(), HasSubstr("not implemented for 'Half'"));
        continue;
      }
      EXPECT_TRUE(output.isfinite().all().item<bool>()) << dtype << " on " << device;
      // Batch 1 has no key: its attention output is zero, so the module returns W_o's bias.
      EXPECT_TRUE(qkv_test::tensors_close(output[1], module->W_o->bias.expand_as(output[1]), 1e-2));
      output.to(torch::kFloat).pow(2).mean().backward();
      EXPECT_TRUE(x.grad().isfinite().all().item<bool>()) << dtype << " on " << device;
    }
  }
}

// ---- Corrupted weight files ----

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

TEST(CorruptFiles, EveryDamagedWeightsFileIsRefusedOrLoadsIntact) {
  const auto dir = std::filesystem::temp_directory_path() / ("qkv_corrupt_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto original = small_module();
  const auto good_path = (dir / "good.pt").string();
  qkv::save_state_dict(original, good_path);
  const auto good = read_bytes(good_path);

  // The damaged files: name -> bytes.
  std::vector<std::pair<std::string, std::vector<char>>> files;
  std::mt19937 random(12345);
  files.emplace_back("empty", std::vector<char>());
  for (int i = 0; i < 70; ++i) {
    const size_t cut = std::uniform_int_distribution<size_t>(1, good.size() - 1)(random);
    files.emplace_back("truncated_at_" + std::to_string(cut), std::vector<char>(good.begin(), good.begin() + cut));
  }
  for (int i = 0; i < 110; ++i) {
    auto bytes = good;
    const size_t at = std::uniform_int_distribution<size_t>(0, good.size() - 1)(random);
    const int bit = std::uniform_int_distribution<int>(0, 7)(random);
    bytes[at] = static_cast<char>(bytes[at] ^ (1 << bit));
    files.emplace_back("bit_" + std::to_string(bit) + "_flipped_at_" + std::to_string(at), bytes);
  }
  for (int i = 0; i < 15; ++i) {
    auto bytes = good;
    const size_t at = std::uniform_int_distribution<size_t>(0, good.size() - 17)(random);
    for (int k = 0; k < 16; ++k) bytes[at + k] = static_cast<char>(random());
    files.emplace_back("overwritten_at_" + std::to_string(at), bytes);
  }
  for (int i = 0; i < 5; ++i) {
    std::vector<char> noise(std::uniform_int_distribution<size_t>(1, 4096)(random));
    for (auto& c : noise) c = static_cast<char>(random());
    files.emplace_back("random_bytes_" + std::to_string(i), noise);
  }
  const std::string text = "W_q.weight: [[1, 2], [3, 4]]\n";
  files.emplace_back("text", std::vector<char>(text.begin(), text.end()));
  // Whole, valid files of something else.
  const std::vector<std::pair<std::string, qkv::SelfAttentionOptions>> others = {
      {"another_width", qkv::SelfAttentionOptions(16).num_heads(2).out_proj(true)},
      {"without_output_map", qkv::SelfAttentionOptions(8).num_heads(2)},
      {"without_bias", qkv::SelfAttentionOptions(8).num_heads(2).out_proj(true).bias(false)},
      {"cross_attention_widths", qkv::SelfAttentionOptions(8).num_heads(2).out_proj(true).kdim(4).vdim(4)},
  };
  for (const auto& [name, options] : others) {
    const auto path = (dir / (name + ".pt")).string();
    qkv::save_state_dict(qkv::SelfAttention(options), path);
    files.emplace_back(name, read_bytes(path));
  }
  files.emplace_back("parity_fixture", read_bytes(qkv_test::data_path("parity_multihead.pt")));
  files.emplace_back("inputs_not_weights", read_bytes(qkv_test::data_path("interop_mha_io.pt")));
  ASSERT_GE(files.size(), 200u);

  std::vector<torch::Tensor> before;
  for (const auto& p : original->parameters()) before.push_back(p.detach().clone());
  int refused = 0, intact = 0;
  for (const auto& [name, bytes] : files) {
    const auto path = (dir / (name + ".pt")).string();
    write_bytes(path, bytes);
    auto module = small_module();  // same weights as `original`
    {
      torch::NoGradGuard no_grad;
      for (auto& p : module->parameters()) p.add_(1.0);  // differ from the file, to see what loads
    }
    std::vector<torch::Tensor> own;
    for (const auto& p : module->parameters()) own.push_back(p.detach().clone());
    try {
      qkv::load_state_dict(module, path);
      // Loading succeeded: only acceptable when the damage left every weight intact (a flip in a
      // file name or a padding byte, say).
      const auto loaded = module->parameters();
      for (size_t i = 0; i < before.size(); ++i) {
        EXPECT_TRUE(torch::equal(loaded[i], before[i])) << name << ": loaded silently wrong weights";
      }
      // Only damage inside the archive's slack (names in local headers, alignment padding) can
      // leave the weights intact; a truncated, empty, foreign or random file never can.
      const bool could_be_harmless = name.rfind("bit_", 0) == 0 || name.rfind("overwritten_", 0) == 0;
      EXPECT_TRUE(could_be_harmless) << name << " loaded";
      ++intact;
    } catch (const c10::Error& error) {
      const std::string message = error.what_without_backtrace();
      EXPECT_THAT(message, HasSubstr(path)) << name;
      const auto now = module->parameters();
      for (size_t i = 0; i < own.size(); ++i) EXPECT_TRUE(torch::equal(now[i], own[i])) << name << ": half-loaded";
      ++refused;
    }
  }
  std::filesystem::remove_all(dir);
  RecordProperty("files", static_cast<int>(files.size()));
  RecordProperty("refused", refused);
  std::printf("corrupt files: %zu tried, %d refused with the file named, %d loaded intact\n", files.size(), refused,
              intact);
  EXPECT_EQ(refused + intact, static_cast<int>(files.size()));
}

}  // namespace

// The uncompressed size of an archive entry is what LibTorch's reader copies (stored) or inflates
// into (deflated); it checks only the stored size against the file. A stored tensor whose directory
// entry claims another uncompressed size, larger by one byte or 0xFFFFFFFF (zip64's marker, with
// no zip64 field), is refused naming the file and the entry, and the module keeps its weights.
TEST(CorruptFiles, AnEntryWhoseUncompressedSizeDisagreesIsRefused) {
  const auto dir = std::filesystem::temp_directory_path() / ("qkv_sizes_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto good_path = (dir / "good.pt").string();
  qkv::save_state_dict(small_module(), good_path);
  const auto good = read_bytes(good_path);
  // The central directory entry of the first tensor's data (".../data/0").
  const auto read32 = [&](size_t at) {
    uint32_t value = 0;
    std::memcpy(&value, good.data() + at, 4);
    return value;
  };
  size_t entry = 0;
  for (size_t at = 0; at + 46 <= good.size(); ++at) {
    if (read32(at) != 0x02014b50u) continue;
    uint16_t name_length = 0;
    std::memcpy(&name_length, good.data() + at + 28, 2);
    const std::string name(good.data() + at + 46, name_length);
    if (name.size() >= 7 && name.compare(name.size() - 7, 7, "/data/0") == 0) {
      entry = at;
      break;
    }
  }
  ASSERT_NE(entry, 0u) << "no directory entry for data/0 in " << good_path;
  const uint32_t stored = read32(entry + 20);
  ASSERT_EQ(read32(entry + 24), stored) << "torch.save stores tensors uncompressed";
  for (const uint32_t claimed : {stored + 1, stored - 1, 0xFFFFFFFFu}) {
    SCOPED_TRACE("uncompressed size " + std::to_string(claimed));
    auto damaged = good;
    std::memcpy(damaged.data() + entry + 24, &claimed, 4);
    const auto path = (dir / "damaged.pt").string();
    write_bytes(path, damaged);
    auto module = small_module();
    const auto before = module->W_q->weight.clone();
    EXPECT_THAT([&] { qkv::load_state_dict(module, path); },
                ::testing::ThrowsMessage<c10::Error>(::testing::AllOf(HasSubstr(path), HasSubstr("data/0"))));
    EXPECT_TRUE(torch::equal(module->W_q->weight, before)) << "the module's weights changed";
  }
  std::filesystem::remove_all(dir);
}

namespace {

// Inputs the fuzzers found crashing or misleading LibTorch's readers (its zip reader before qkv
// checked the archive first, its unpickler before qkv read the pickle itself); scripts/fuzz.sh
// saves them, and each is kept here as it was found.
TEST(FuzzRegressions, FoundInputsAreRefusedWithAMessage) {
  const auto dir = std::filesystem::path(qkv_test::data_path("fuzz_regressions"));
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    auto module = small_module();
    EXPECT_THAT([&] { qkv::load_state_dict(module, entry.path().string()); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr(entry.path().string())))
        << entry.path();
    ++count;
  }
  EXPECT_GE(count, 1);
}

}  // namespace
