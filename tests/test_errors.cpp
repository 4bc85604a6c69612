// Every invalid configuration or input raises c10::Error with a message that names the argument
// and says what was expected and what came.
#include "support/fixtures.h"

#include <gmock/gmock.h>

#include <functional>
#include <limits>

namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

struct ErrorCase {
  std::string name;
  std::function<void()> action;
  std::vector<std::string> message_parts;
};

std::ostream& operator<<(std::ostream& stream, const ErrorCase& c) { return stream << c.name; }

qkv::SelfAttention make(qkv::SelfAttentionOptions options) { return qkv::SelfAttention(options); }

std::vector<ErrorCase> error_cases() {
  using qkv::AttentionMask;
  using qkv::SelfAttentionOptions;
  const auto nan = std::numeric_limits<double>::quiet_NaN();
  return {
      {"d_model_zero", [] { make(SelfAttentionOptions(0)); }, {"d_model > 0", "got 0"}},
      {"d_model_negative", [] { make(SelfAttentionOptions(-4)); }, {"d_model > 0", "got -4"}},
      {"heads_zero", [] { make(SelfAttentionOptions(8).num_heads(0)); }, {"num_heads > 0", "got 0"}},
      {"not_divisible", [] { make(SelfAttentionOptions(10).num_heads(4)); },
       {"divisible by num_heads", "d_model = 10", "num_heads = 4"}},
      {"dropout_one", [] { make(SelfAttentionOptions(8).dropout(1.0)); }, {"dropout in [0, 1)", "got 1"}},
      {"dropout_negative", [] { make(SelfAttentionOptions(8).dropout(-0.1)); }, {"dropout in [0, 1)", "-0.1"}},
      {"scale_nan", [nan] { make(SelfAttentionOptions(8).scale(nan)); }, {"finite scale", "nan"}},
      {"kdim_zero", [] { make(SelfAttentionOptions(8).kdim(0)); }, {"kdim > 0", "got 0"}},
      {"rank_one", [] { make(8)(torch::randn({8})); }, {"query of shape (N, 8) or (B, N, 8)", "[8]"}},
      {"rank_four", [] { make(8)(torch::randn({1, 2, 3, 8})); }, {"(N, 8) or (B, N, 8)", "[1, 2, 3, 8]"}},
      {"wrong_width", [] { make(8)(torch::randn({2, 4, 6})); }, {"last dimension d_model = 8", "[2, 4, 6]"}},
      {"integer_input", [] { make(8)(torch::ones({4, 8}, torch::kLong)); }, {"floating-point query", "Long"}},
      {"dtype_mismatch", [] { make(8)(torch::randn({4, 8}, torch::kDouble)); },
       {"query of dtype Float (the module's parameters)", "got Double"}},
      {"context_rank", [] { make(8)(torch::randn({2, 4, 8}), torch::randn({4, 8})); },
       {"key of shape (B, S, 8)", "[4, 8]"}},
      {"context_batch", [] { make(8)(torch::randn({2, 4, 8}), torch::randn({3, 5, 8})); },
       {"same batch size", "[2, 4, 8]", "[3, 5, 8]"}},
      {"context_width", [] { make(8)(torch::randn({2, 4, 8}), torch::randn({2, 5, 7})); },
       {"key with last dimension 8", "[2, 5, 7]"}},
      {"self_attention_with_kdim", [] { make(SelfAttentionOptions(8).kdim(4).vdim(4))(torch::randn({4, 8})); },
       {"kdim == vdim == d_model", "kdim = 4"}},
      {"context_with_kdim_not_vdim",
       [] { make(SelfAttentionOptions(8).kdim(4).vdim(6))(torch::randn({4, 8}), torch::randn({5, 4})); },
       {"kdim == vdim", "kdim = 4 and vdim = 6", "attend(query, key, value)"}},
      {"key_value_length_mismatch",
       [] {
         make(SelfAttentionOptions(8).kdim(4).vdim(6))->attend(torch::randn({4, 8}), torch::randn({5, 4}),
                                                               torch::randn({6, 6}));
       },
       {"same number of positions S", "[5, 4]", "[6, 6]"}},
      {"lengths_shape", [] { make(8)->forward(torch::randn({2, 4, 8}), {}, AttentionMask::from_lengths(torch::tensor({4}))); },
       {"key_lengths of shape (B,) = (2,)", "[1]"}},
      {"lengths_float",
       [] { make(8)->forward(torch::randn({2, 4, 8}), {}, AttentionMask::from_lengths(torch::tensor({4.0, 2.0}))); },
       {"integer key_lengths", "got Float"}},
      {"lengths_too_long",
       [] { make(8)->forward(torch::randn({2, 4, 8}), {}, AttentionMask::from_lengths(torch::tensor({4, 5}))); },
       {"key_lengths in [0, S] = [0, 4]", "to 5"}},
      {"lengths_negative",
       [] { make(8)->forward(torch::randn({2, 4, 8}), {}, AttentionMask::from_lengths(torch::tensor({-1, 2}))); },
       {"key_lengths in [0, S]", "from -1"}},
      {"key_mask_shape",
       [] { make(8)->forward(torch::randn({2, 4, 8}), {}, AttentionMask::from_key_mask(torch::ones({2, 5}, torch::kBool))); },
       {"key_mask of shape (B, S)", "S = 4", "[2, 5]"}},
      {"key_mask_dtype",
       [] { make(8)->forward(torch::randn({2, 4, 8}), {}, AttentionMask::from_key_mask(torch::ones({2, 4}))); },
       {"bool key_mask", "Float"}},
      {"attn_mask_shape",
       [] { make(8)->forward(torch::randn({2, 4, 8}), {}, AttentionMask::from_attn_mask(torch::ones({4, 3}, torch::kBool))); },
       {"attn_mask of shape (N, S)", "N = 4, S = 4", "[4, 3]"}},
      {"attn_mask_batch",
       [] {
         make(8)->forward(torch::randn({2, 4, 8}), {}, AttentionMask::from_attn_mask(torch::ones({3, 4, 4}, torch::kBool)));
       },
       {"(B, N, S)", "B = 2", "[3, 4, 4]"}},
      {"attn_mask_uint8",
       [] { make(8)->forward(torch::randn({2, 4, 8}), {}, AttentionMask::from_attn_mask(torch::ones({4, 4}, torch::kByte))); },
       {"bool attn_mask (true = attend)", "Byte"}},
      {"sdpa_rank_mismatch",
       [] { qkv::scaled_dot_product_attention(torch::randn({2, 3, 4}), torch::randn({3, 4}), torch::randn({3, 4})); },
       {"same rank >= 2", "[2, 3, 4]", "[3, 4]"}},
      {"sdpa_width_mismatch",
       [] { qkv::scaled_dot_product_attention(torch::randn({3, 4}), torch::randn({3, 5}), torch::randn({3, 5})); },
       {"q and k of the same width D", "[3, 4]", "[3, 5]"}},
      {"sdpa_positions_mismatch",
       [] { qkv::scaled_dot_product_attention(torch::randn({3, 4}), torch::randn({3, 4}), torch::randn({2, 4})); },
       {"same number of positions S", "[2, 4]"}},
      {"sdpa_batch_mismatch",
       [] {
         qkv::scaled_dot_product_attention(torch::randn({2, 3, 4}), torch::randn({3, 3, 4}), torch::randn({3, 3, 4}));
       },
       {"equal leading (batch, head) dimensions", "[2, 3, 4]", "[3, 3, 4]"}},
      {"sdpa_dtype_mismatch",
       [] {
         qkv::scaled_dot_product_attention(torch::randn({3, 4}), torch::randn({3, 4}, torch::kDouble),
                                           torch::randn({3, 4}));
       },
       {"one dtype", "Float", "Double"}},
      {"sdpa_mask_shape",
       [] {
         qkv::scaled_dot_product_attention(
             torch::randn({3, 4}), torch::randn({5, 4}), torch::randn({5, 4}),
             qkv::ScaledDotProductAttentionOptions().mask(torch::ones({3, 4}, torch::kBool)));
       },
       {"broadcastable to the scores' shape [3, 5]", "[3, 4]"}},
      {"sdpa_dropout",
       [] {
         qkv::scaled_dot_product_attention(torch::randn({3, 4}), torch::randn({3, 4}), torch::randn({3, 4}),
                                           qkv::ScaledDotProductAttentionOptions().dropout(1.5));
       },
       {"dropout in [0, 1)", "1.5"}},
      {"sdpa_undefined",
       [] { qkv::scaled_dot_product_attention(torch::randn({3, 4}), {}, torch::randn({3, 4})); },
       {"defined tensors", "k undefined"}},
      {"fused_with_weights",
       [] {
         qkv::scaled_dot_product_attention(
             torch::randn({3, 4}), torch::randn({3, 4}), torch::randn({3, 4}),
             qkv::ScaledDotProductAttentionOptions().backend(qkv::AttentionBackend::Fused).need_weights(true));
       },
       {"fused backend"}},
  };
}

class InvalidUse : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(InvalidUse, RaisesC10ErrorNamingTheProblem) {
  const auto& c = GetParam();
  try {
    c.action();
    FAIL() << c.name << ": no error was raised";
  } catch (const c10::Error& error) {
    const std::string message = error.what_without_backtrace();
    for (const auto& part : c.message_parts) {
      EXPECT_THAT(message, HasSubstr(part)) << c.name;
    }
    // A user error, not an internal assert.
    EXPECT_THAT(message, ::testing::Not(HasSubstr("INTERNAL ASSERT"))) << c.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Api, InvalidUse, ::testing::ValuesIn(error_cases()),
                         [](const ::testing::TestParamInfo<ErrorCase>& info) { return info.param.name; });

TEST(InvalidUse, DeviceMismatchIsReported) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "CUDA not available: no second device to mismatch";
  qkv::SelfAttention module(8);
  EXPECT_THAT([&] { module(torch::randn({4, 8}, torch::kCUDA)); },
              ThrowsMessage<c10::Error>(AllOf(HasSubstr("query on cpu"), HasSubstr("got cuda"))));
}

TEST(InvalidUse, FusedBackendOnOldLibTorchIsRefused) {
  if (qkv::fused_backend_available()) GTEST_SKIP() << "this LibTorch has the fused backend";
  EXPECT_THAT([] { qkv::SelfAttention(qkv::SelfAttentionOptions(8).backend(qkv::AttentionBackend::Fused)); },
              ThrowsMessage<c10::Error>(HasSubstr("fused backend needs LibTorch >= 2.0")));
}

}  // namespace
