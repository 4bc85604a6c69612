// LibTorch serialization and cloning of the module: torch::save / torch::load round trips give
// identical outputs; clone() is a deep copy.
#include "support/fixtures.h"

#include <cstdio>
#include <filesystem>

namespace {

TEST(Serialization, SaveLoadRoundTripGivesIdenticalOutputs) {
  torch::manual_seed(7);
  auto options = qkv::SelfAttentionOptions(16).num_heads(4).out_proj(true);
  qkv::SelfAttention saved(options);
  const auto path = (std::filesystem::temp_directory_path() / "qkv_serialization_test.pt").string();
  torch::save(saved, path);

  torch::manual_seed(8);  // different initial weights
  qkv::SelfAttention loaded(options);
  auto x = torch::randn({2, 5, 16});
  ASSERT_FALSE(qkv_test::tensors_close(loaded(x), saved(x), 1e-3)) << "the two modules started equal";
  torch::load(loaded, path);
  std::remove(path.c_str());
  EXPECT_TRUE(qkv_test::tensors_close(loaded(x), saved(x), 0.0));
}

TEST(Serialization, CloneIsADeepCopy) {
  torch::manual_seed(9);
  qkv::SelfAttention original(qkv::SelfAttentionOptions(8).num_heads(2).causal(true));
  auto copy = std::dynamic_pointer_cast<qkv::SelfAttentionImpl>(original->clone());
  ASSERT_TRUE(copy);
  auto x = torch::randn({3, 8});
  EXPECT_TRUE(qkv_test::tensors_close(copy->forward(x), original(x), 0.0));
  {
    torch::NoGradGuard no_grad;
    copy->W_q->weight.add_(1.0);
  }
  EXPECT_FALSE(qkv_test::tensors_close(copy->forward(x), original(x), 1e-3));
  EXPECT_TRUE(copy->options.causal());
}

TEST(Serialization, PrettyPrintNamesTheOptions) {
  std::ostringstream text;
  qkv::SelfAttention module(qkv::SelfAttentionOptions(8).num_heads(2));
  module->pretty_print(text);
  EXPECT_EQ(text.str(),
            "qkv::SelfAttention(d_model=8, num_heads=2, bias=true, causal=false, dropout=0, scale=1/sqrt(4), "
            "out_proj=false, kdim=8, vdim=8, backend=auto)");
}

}  // namespace
