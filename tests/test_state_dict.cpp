// Weights from and to PyTorch: files written by torch.save in Python (tests/data/interop_*.pt, made
// by scripts/gen_reference.py) load into qkv and give PyTorch's outputs; bad files are refused
// with the keys named, leaving the module unchanged.
#include "support/fixtures.h"

#include <gmock/gmock.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// Inputs and PyTorch's outputs for a weights file.
qkv_test::Fixture io(const std::string& name) { return qkv_test::Fixture("interop_" + name + "_io.pt"); }

std::vector<torch::Tensor> snapshot(const qkv::SelfAttention& module) {
  std::vector<torch::Tensor> copies;
  for (const auto& p : module->parameters()) copies.push_back(p.detach().clone());
  return copies;
}

void expect_unchanged(const qkv::SelfAttention& module, const std::vector<torch::Tensor>& before) {
  const auto after = module->parameters();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(after[i], before[i])) << "parameter " << i;
}

TEST(StateDict, DocumentsModuleFromPython) {
  qkv::SelfAttention module(8);
  qkv::load_state_dict(module, qkv_test::data_path("interop_documents_weights.pt"));
  const auto data = io("documents");
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(qkv_test::tensors_close(module(data.tensor("query")), data.tensor("output"), 1e-6));
}

TEST(StateDict, MultiheadAttentionFromPythonBatchFirstAndSequenceFirst) {
  qkv::SelfAttention module(qkv::SelfAttentionOptions(16).num_heads(4).out_proj(true));
  qkv::load_state_dict(module, qkv_test::data_path("interop_mha_weights.pt"));
  const auto data = io("mha");
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(qkv_test::tensors_close(module(data.tensor("query")), data.tensor("output_batch_first"), 1e-6));
  // Sequence-first (N, B, E) is PyTorch's default layout; qkv is batch-first.
  auto seq_first = module(data.tensor("query_seq_first").transpose(0, 1)).transpose(0, 1);
  EXPECT_TRUE(qkv_test::tensors_close(seq_first, data.tensor("output_seq_first"), 1e-6));
}

TEST(StateDict, OrderedDictFromStateDictIsReadOrExplained) {
  qkv::SelfAttention module(8);
  const auto path = qkv_test::data_path("interop_documents_ordereddict.pt");
  try {
    qkv::load_state_dict(module, path);  // LibTorch >= 2 reads OrderedDicts
    const auto data = io("documents");
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(qkv_test::tensors_close(module(data.tensor("query")), data.tensor("output"), 1e-6));
  } catch (const c10::Error& error) {
    EXPECT_THAT(error.what_without_backtrace(),
                AllOf(HasSubstr(path), HasSubstr("OrderedDict"), HasSubstr("torch.save(dict(model.state_dict())")));
  }
}

TEST(StateDict, SavedFileReadsBackWithTheDocumentsKeys) {
  torch::manual_seed(3);
  qkv::SelfAttention module(qkv::SelfAttentionOptions(8).num_heads(2).out_proj(true));
  const auto path = (std::filesystem::temp_directory_path() / "qkv_state_dict_test.pt").string();
  qkv::save_state_dict(module, path);
  const auto tensors = qkv::read_tensor_dict(path);
  std::remove(path.c_str());
  std::vector<std::string> keys;
  for (const auto& item : tensors) keys.push_back(item.first);
  EXPECT_THAT(keys, ::testing::UnorderedElementsAre("W_q.weight", "W_q.bias", "W_k.weight", "W_k.bias", "W_v.weight",
                                                    "W_v.bias", "W_o.weight", "W_o.bias"));
  for (const auto& item : module->named_parameters()) {
    EXPECT_TRUE(torch::equal(tensors.at(item.key()), item.value())) << item.key();
  }
}

TEST(StateDict, FailedSaveLeavesNoFileAndNamesThePath) {
  const auto dir = std::filesystem::temp_directory_path() / "qkv_no_such_dir_for_save";
  std::filesystem::remove_all(dir);
  const auto path = (dir / "out.pt").string();
  try {
    qkv::save_tensor_dict({{"output", torch::ones({2, 2})}}, path);
    FAIL() << "saving into a missing folder succeeded";
  } catch (const c10::Error& error) {
    EXPECT_THAT(error.what_without_backtrace(), HasSubstr("cannot create " + path + ".tmp-"));
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(dir));
}

TEST(StateDict, WrongKeysAreListedAndNothingIsLoaded) {
  torch::manual_seed(4);
  qkv::SelfAttention module(qkv::SelfAttentionOptions(16).num_heads(4));  // no out_proj
  const auto before = snapshot(module);
  // nn.MultiheadAttention weights carry out_proj.*, which this module lacks.
  EXPECT_THAT([&] { qkv::load_state_dict(module, qkv_test::data_path("interop_mha_weights.pt")); },
              ThrowsMessage<c10::Error>(AllOf(HasSubstr("Unexpected: W_o.bias, W_o.weight"),
                                              HasSubstr("nothing was loaded"), HasSubstr("out_proj(true)"))));
  expect_unchanged(module, before);

  std::map<std::string, torch::Tensor> tensors;
  for (const auto& item : module->named_parameters()) tensors[item.key()] = item.value().detach() + 1;
  tensors.erase("W_k.bias");
  tensors["W_v.weight"] = torch::zeros({16, 8});
  tensors["extra.weight"] = torch::zeros({1});
  tensors["W_q.bias"] = torch::zeros({16}, torch::kLong);
  EXPECT_THAT([&] { qkv::load_state_dict(module, tensors, "my weights"); },
              ThrowsMessage<c10::Error>(AllOf(HasSubstr("my weights"), HasSubstr("Missing: W_k.bias"),
                                              HasSubstr("Unexpected: extra.weight"),
                                              HasSubstr("W_v.weight is [16, 8], the module's is [16, 16]"),
                                              HasSubstr("Not floating-point: W_q.bias (Long)"))));
  expect_unchanged(module, before);
}

TEST(StateDict, UnreadableFilesAreRefusedNamingTheFile) {
  qkv::SelfAttention module(8);
  const auto before = snapshot(module);
  const auto dir = std::filesystem::temp_directory_path();
  const auto empty = (dir / "qkv_empty.pt").string();
  const auto garbage = (dir / "qkv_garbage.pt").string();
  std::ofstream(empty).close();
  std::ofstream(garbage) << "this is not a torch.save file";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {(dir / "qkv_no_such_file.pt").string(), "cannot read"},
      {empty, "is empty"},
      {garbage, "not written by torch.save"},
      {qkv_test::data_path("interop_documents_io.pt"), "entries that are not tensors: generated_by"},
  };
  for (const auto& [path, message] : cases) {
    EXPECT_THAT([&] { qkv::load_state_dict(module, path); },
                ThrowsMessage<c10::Error>(AllOf(HasSubstr(path), HasSubstr(message))))
        << path;
  }
  std::remove(empty.c_str());
  std::remove(garbage.c_str());
  expect_unchanged(module, before);
}

}  // namespace
