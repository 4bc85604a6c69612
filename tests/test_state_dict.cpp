// Weights from and to PyTorch: files written by torch.save in Python (tests/data/interop_*.pt, made
// by scripts/gen_reference.py) load into qkv and give PyTorch's outputs; bad files are refused
// with the keys named, leaving the module unchanged.
#include "support/fixtures.h"
#include "torch_file.h"

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

// nn.MultiheadAttention with kdim or vdim other than embed_dim saves q_proj_weight, k_proj_weight and
// v_proj_weight (and in_proj_bias stacked, where it has biases) instead of one in_proj_weight.
TEST(StateDict, MultiheadAttentionWithOtherKeyAndValueWidthsFromPython) {
  torch::NoGradGuard no_grad;
  {
    qkv::SelfAttention cross(qkv::SelfAttentionOptions(16).num_heads(4).out_proj(true).kdim(8).vdim(8));
    qkv::load_state_dict(cross, qkv_test::data_path("interop_mha_cross_weights.pt"));
    const auto data = io("mha_cross");
    EXPECT_TRUE(
        qkv_test::tensors_close(cross(data.tensor("query"), data.tensor("context")), data.tensor("output"), 1e-6));
  }
  // kdim != vdim, no biases, and PyTorch's key_padding_mask (true = padding), the opposite of
  // qkv's key_mask (true = a real key).
  qkv::SelfAttention widths(qkv::SelfAttentionOptions(16).num_heads(4).out_proj(true).kdim(8).vdim(12).bias(false));
  qkv::load_state_dict(widths, qkv_test::data_path("interop_mha_widths_weights.pt"));
  const auto data = io("mha_widths");
  const auto result =
      widths->attend(data.tensor("query"), data.tensor("key"), data.tensor("value"),
                     qkv::AttentionMask::from_key_mask(data.tensor("key_padding_mask").logical_not()), true);
  EXPECT_TRUE(qkv_test::tensors_close(result.output, data.tensor("output"), 1e-6));
  EXPECT_TRUE(qkv_test::tensors_close(result.weights, data.tensor("weights"), 1e-6));
}

TEST(StateDict, MultiheadAttentionWeightsThatDoNotFitSayWhichOptionsToSet) {
  torch::manual_seed(5);
  // The cross-attention weights into a module built for self-attention: W_k and W_v are too wide.
  qkv::SelfAttention self_attention(qkv::SelfAttentionOptions(16).num_heads(4).out_proj(true));
  const auto before = snapshot(self_attention);
  EXPECT_THAT(
      [&] { qkv::load_state_dict(self_attention, qkv_test::data_path("interop_mha_cross_weights.pt")); },
      ThrowsMessage<c10::Error>(AllOf(HasSubstr("W_k.weight is [16, 8], the module's is [16, 16]"),
                                      HasSubstr("W_v.weight is [16, 8], the module's is [16, 16]"),
                                      HasSubstr("nothing was loaded"), HasSubstr("kdim and vdim"))));
  expect_unchanged(self_attention, before);
  // add_bias_kv=True: bias_k and bias_v have no place in qkv's module.
  EXPECT_THAT([&] { qkv::load_state_dict(self_attention, qkv_test::data_path("interop_mha_bias_kv_weights.pt")); },
              ThrowsMessage<c10::Error>(AllOf(HasSubstr("Unexpected: bias_k, bias_v"),
                                              HasSubstr("add_bias_kv=True, which qkv does not support"))));
  expect_unchanged(self_attention, before);
}

// torch.save(model.state_dict()): an OrderedDict with _metadata, which no LibTorch reads; qkv's
// own reader of the pickle (src/pickle_reader.cpp) does.
TEST(StateDict, OrderedDictFromStateDictIsRead) {
  qkv::SelfAttention module(8);
  qkv::load_state_dict(module, qkv_test::data_path("interop_documents_ordereddict.pt"));
  const auto data = io("documents");
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(qkv_test::tensors_close(module(data.tensor("query")), data.tensor("output"), 1e-6));
}

// A dict of one entry is pickled with SETITEM rather than SETITEMS, which LibTorch's unpickler
// (1.13) did not read.
TEST(StateDict, ADictOfOneEntryIsRead) {
  const auto tensors = qkv::read_tensor_dict(qkv_test::data_path("interop_one_entry.pt"));
  ASSERT_EQ(tensors.size(), 1u);
  EXPECT_TRUE(torch::equal(tensors.at("W"), torch::arange(4, torch::kFloat)));
}

// What torch.save writes beyond contiguous float32 tensors in a plain dict
// (scripts/gen_reference.py pickle_variants_case), by PyTorch 1.13 (also with pickle_protocol=4)
// and by PyTorch 2.14 (which adds the entries byteorder and .data/serialization_id): views into a larger storage, two
// tensors over one storage, stride 0, no dimensions, no elements, five more dtypes, an
// nn.Parameter, nested containers of one item, and plain values. Every tensor there is made from
// torch.arange, so the expected values are computed here, independently of the file.
class WeightsFromPython : public ::testing::TestWithParam<const char*> {};

TEST_P(WeightsFromPython, EveryKindOfValueTorchSaveWritesReadsAsPythonWroteIt) {
  const auto path = qkv_test::data_path(GetParam());
  const auto dict =
      qkv::detail::read_torch_file(qkv::detail::read_file_bytes(path, "test"), path, "test").toGenericDict();
  const auto arange = [](int64_t n, torch::Dtype dtype = torch::kFloat) { return torch::arange(n).to(dtype); };
  const auto tensor = [&](const char* key) { return dict.at(key).toTensor(); };
  const auto same = [](const torch::Tensor& got, const torch::Tensor& expected) {
    return got.dtype() == expected.dtype() && got.sizes() == expected.sizes() && torch::equal(got, expected);
  };
  EXPECT_TRUE(same(tensor("transposed"), arange(24).reshape({4, 6}).t()));
  EXPECT_EQ(tensor("transposed").strides(), (std::vector<int64_t>{1, 6}));  // the view, as saved
  EXPECT_TRUE(same(tensor("sliced"), arange(24).slice(0, 5, 17, 3)));
  EXPECT_TRUE(same(tensor("shared_head"), arange(5)));
  EXPECT_TRUE(same(tensor("shared_tail"), arange(10).slice(0, 5)));
  EXPECT_TRUE(tensor("shared_head").storage().is_alias_of(tensor("shared_tail").storage()));
  EXPECT_TRUE(same(tensor("expanded"), arange(3).expand({2, 3})));
  EXPECT_TRUE(same(tensor("scalar"), torch::tensor(3.5f)));
  EXPECT_TRUE(same(tensor("empty"), torch::zeros({0, 3})));
  EXPECT_TRUE(same(tensor("bfloat16"), arange(8, torch::kBFloat16)));
  EXPECT_TRUE(same(tensor("float16"), arange(8, torch::kHalf)));
  EXPECT_TRUE(same(tensor("float64"), arange(8, torch::kDouble)));
  EXPECT_TRUE(same(tensor("int64"), arange(8, torch::kLong)));
  EXPECT_TRUE(same(tensor("bool"), arange(8).remainder(3) == 0));
  EXPECT_TRUE(same(tensor("parameter"), arange(4)));
  EXPECT_TRUE(same(dict.at("one_entry").toGenericDict().at("only").toTensor(), arange(2)));
  const auto one_item = dict.at("one_item").toList();
  ASSERT_EQ(one_item.size(), 1u);
  EXPECT_TRUE(same(one_item.get(0).toTensor(), arange(2)));
  const auto plain = dict.at("plain").toList();
  ASSERT_EQ(plain.size(), 10u);
  EXPECT_EQ(plain.get(0).toInt(), 1);
  EXPECT_EQ(plain.get(1).toInt(), -2);
  EXPECT_EQ(plain.get(2).toInt(), 70000);
  EXPECT_EQ(plain.get(3).toInt(), -(int64_t(1) << 40));  // LONG1 of 6 bytes
  EXPECT_EQ(plain.get(4).toDouble(), 2.5);
  EXPECT_EQ(plain.get(5).toStringRef(), "text");
  EXPECT_TRUE(plain.get(6).toBool());
  EXPECT_FALSE(plain.get(7).toBool());
  EXPECT_TRUE(plain.get(8).isNone());
  const auto pair = plain.get(9).toTuple();
  ASSERT_EQ(pair->elements().size(), 2u);
  EXPECT_EQ(pair->elements()[1].toInt(), 2);
  // The OrderedDict's entries in their order; its _metadata (given by BUILD) is not an entry.
  std::vector<std::string> keys;
  for (const auto& item : dict) keys.push_back(item.key().toStringRef());
  EXPECT_EQ(keys.front(), "transposed");
  EXPECT_EQ(keys.back(), "plain");
  EXPECT_EQ(keys.size(), 16u);
}

std::string writer_name(const ::testing::TestParamInfo<const char*>& info) {
  static const char* const names[] = {"PyTorch1_13", "PyTorch2_14", "PyTorch1_13PickleProtocol4"};
  return names[info.index];
}

INSTANTIATE_TEST_SUITE_P(TorchSave, WeightsFromPython,
                         ::testing::Values("interop_pickle_variants.pt", "interop_pickle_variants_torch2.pt",
                                           "interop_pickle_variants_protocol4.pt"),
                         writer_name);

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
