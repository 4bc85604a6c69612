// Crafted pickles inside sound archives (every CRC right): what a damaged writer or an attacker
// could hand qkv's reader of torch.save files (src/pickle_reader.cpp). Each is refused with a
// c10::Error that names the file and the condition, before any tensor is made. Before that reader,
// LibTorch's unpickler read them: some crashed it (a TUPLE3 on a short stack wrote through a wild
// pointer, found by fuzz/fuzz_weights_loader) and some loaded silently, a storage larger than its
// entry handing the heap beyond it to the weights. The pickles are written here opcode by opcode,
// from Python's definitions of them (Lib/pickle.py), and one baseline loads, so that each case
// differs from a good file by its one fault.
#include "support/fixtures.h"
#include "torch_file.h"

#include <caffe2/serialize/inline_container.h>
#include <gmock/gmock.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace pickle_reader_test {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// Pickle protocol 2, one opcode at a time.
struct Pickle {
  std::string bytes = std::string("\x80\x02", 2);  // PROTO 2

  Pickle& op(char opcode) { return raw(std::string(1, opcode)); }
  Pickle& raw(const std::string& b) {
    bytes += b;
    return *this;
  }
  Pickle& little_endian(uint64_t value, int n) {
    for (int i = 0; i < n; ++i) bytes += static_cast<char>((value >> (8 * i)) & 0xFF);
    return *this;
  }
  Pickle& integer(int64_t value) {  // BININT1, BININT or LONG1 (of 8 bytes; Python's pickler writes fewer)
    if (value >= 0 && value < 256) return op('K').little_endian(uint64_t(value), 1);
    if (value >= INT32_MIN && value <= INT32_MAX) return op('J').little_endian(uint64_t(uint32_t(int32_t(value))), 4);
    return op('\x8a').little_endian(8, 1).little_endian(uint64_t(value), 8);
  }
  Pickle& string(const std::string& s) { return op('X').little_endian(s.size(), 4).raw(s); }
  Pickle& global(const std::string& module, const std::string& name) { return op('c').raw(module + "\n" + name + "\n"); }
  Pickle& put(uint64_t id) { return op('q').little_endian(id, 1); }
  Pickle& get(uint64_t id) { return op('h').little_endian(id, 1); }
  Pickle& tuple(const std::vector<int64_t>& values) {
    op('(');
    for (const auto v : values) integer(v);
    return op('t');
  }
  Pickle& stop() { return op('.'); }
};

// How the baseline's one tensor is written; each case changes one thing.
struct TensorSpec {
  std::string storage_type = "FloatStorage";
  std::string key = "0";
  std::string location = "cpu";
  int64_t elements = 16;
  int64_t offset = 0;
  std::vector<int64_t> sizes{4, 4}, strides{4, 1};
};

// _rebuild_tensor_v2(<storage>, offset, sizes, strides, False, OrderedDict()), as torch.save
// writes it.
Pickle& tensor(Pickle& p, const TensorSpec& t) {
  p.global("torch._utils", "_rebuild_tensor_v2");
  p.op('(');
  p.op('(').string("storage").global("torch", t.storage_type).string(t.key).string(t.location).integer(t.elements).op('t');
  p.op('Q');  // BINPERSID
  p.integer(t.offset).tuple(t.sizes).tuple(t.strides).op('\x89');
  p.global("collections", "OrderedDict").op(')').op('R');
  return p.op('t').op('R');
}

// {'w': <the tensor>}
Pickle tensor_dict(const TensorSpec& t) {
  Pickle p;
  p.op('}').op('(').string("w");
  tensor(p, t);
  p.op('u').stop();
  return p;
}

// A sound archive (LibTorch's own writer: CRCs and offsets right) holding `pickle` as data.pkl and
// 64 bytes, the floats 0 … 15, as the storage data/0 (and data/1 when `second_storage`).
std::vector<char> archive(const std::string& pickle, bool second_storage = false) {
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) -> size_t {
    out.insert(out.end(), static_cast<const char*>(data), static_cast<const char*>(data) + size);
    return size;
  });
  writer.writeRecord("data.pkl", pickle.data(), pickle.size());
  const auto floats = torch::arange(16, torch::kFloat);
  writer.writeRecord("data/0", floats.data_ptr(), 64);
  if (second_storage) writer.writeRecord("data/1", floats.data_ptr(), 64);
  writer.writeEndOfFile();
  return out;
}

std::map<std::string, torch::Tensor> read(const Pickle& p) { return qkv::read_tensor_dict(archive(p.bytes), "crafted.pt"); }

TEST(CraftedPickles, TheBaselineLoads) {
  const auto tensors = read(tensor_dict({}));
  ASSERT_EQ(tensors.count("w"), 1u);
  EXPECT_TRUE(torch::equal(tensors.at("w"), torch::arange(16, torch::kFloat).reshape({4, 4})));
  // The largest view the storage allows loads too: the check is not off by one.
  TensorSpec last_row;
  last_row.offset = 12;
  last_row.sizes = {1, 4};
  EXPECT_TRUE(torch::equal(read(tensor_dict(last_row)).at("w"), torch::arange(12, 16, torch::kFloat).reshape({1, 4})));
}

struct Crafted {
  const char* name;
  std::function<Pickle()> pickle;
  const char* condition;  // what the refusal must say
};

TEST(CraftedPickles, AreRefusedNamingTheFileAndTheCondition) {
  const auto with = [](const std::function<void(TensorSpec&)>& change) {
    return [change] {
      TensorSpec t;
      change(t);
      return tensor_dict(t);
    };
  };
  const std::vector<Crafted> cases = {
      // Tensors and storages: LibTorch sizes a storage by the pickle and never by its entry.
      {"a storage larger than its entry", with([](TensorSpec& t) { t.elements = 17; }),
       "gives storage data/0 17 elements of 4 bytes, but its entry holds 64 bytes"},
      {"a bfloat16 storage larger than its entry", with([](TensorSpec& t) {
         t.storage_type = "BFloat16Storage";
         t.elements = 33;
       }),
       "33 elements of 2 bytes, but its entry holds 64 bytes"},
      {"a view past its storage's end", with([](TensorSpec& t) { t.offset = 1; }),
       "reaches element 16 of a storage of 16"},
      {"strides past the storage's end", with([](TensorSpec& t) { t.strides = {5, 1}; }),
       "reaches element 18 of a storage of 16"},
      {"a negative stride", with([](TensorSpec& t) { t.strides = {4, -1}; }), "negative size or stride"},
      {"sizes whose extent overflows", with([](TensorSpec& t) {
         t.sizes = {int64_t(1) << 40, int64_t(1) << 40};
         t.strides = {int64_t(1) << 40, 1};
       }),
       "reaches past element 2^63 of a storage of 16"},
      {"a storage the archive does not hold", with([](TensorSpec& t) { t.key = "7"; }),
       "names storage data/7, which the archive does not hold"},
      {"a storage type that is not one", with([](TensorSpec& t) { t.storage_type = "Storage"; }),
       "names torch.Storage, which a weights file does not hold"},
      {"a persistent id of another form",
       [] {
         Pickle p;
         return p.op('(').string("storage").integer(6).string("0").string("cpu").integer(16).op('t').op('Q').stop();
       },
       "persistent id other than ('storage', torch.<type>Storage, key, location, elements)"},
      // The stack, marks and memo.
      {"TUPLE3 on a stack of one (crashed LibTorch 1.13)", [] { return Pickle().integer(1).op('\x87').stop(); },
       "TUPLE3 needs 3 values on the stack, and there is 1"},
      {"TUPLE2 reaching below its MARK",
       [] { return Pickle().integer(1).op('(').integer(2).op('\x86').op('t').stop(); },
       "TUPLE2 needs 2 values above its MARK, and there is 1"},
      {"TUPLE with no MARK", [] { return Pickle().integer(1).op('t').stop(); }, "TUPLE closes a MARK where none is open"},
      {"a DICT of an odd count",
       [] { return Pickle().op('(').string("k").integer(1).string("j").op('d').stop(); },
       "DICT gives a key without a value"},
      {"SETITEMS of an odd count",
       [] { return Pickle().op('}').op('(').string("k").op('u').stop(); }, "SETITEMS gives a key without a value"},
      {"a GET with no PUT", [] { return Pickle().get(9).stop(); }, "GET names memo entry 9, which no PUT made"},
      {"a PUT of entry 2^32 - 1 (LibTorch would size its memo for it)",
       [] { return Pickle().integer(1).op('r').little_endian(0xFFFFFFFFu, 4).stop(); },
       "PUT names memo entry 4294967295"},
      {"a PUT on an empty stack", [] { return Pickle().put(0).integer(1).stop(); }, "PUT finds nothing on the stack"},
      // Containers: deep nesting (destroying it recurses), cycles, and changes after placement.
      {"tuples nested 300 deep",
       [] {
         Pickle p;
         p.integer(1);
         for (int i = 0; i < 300; ++i) p.op('\x85');
         return p.stop();
       },
       "nests containers more than 200 deep"},
      {"a list inside itself", [] { return Pickle().op(']').put(0).get(0).op('a').stop(); },
       "APPEND puts a container inside itself"},
      {"a dict changed after it was placed in another",
       [] {
         return Pickle().op('}').string("a").op('}').put(1).op('s').get(1).string("b").op('N').op('s').stop();
       },
       "SETITEM changes a container already inside another"},
      {"items added to a number", [] { return Pickle().integer(1).op('(').integer(2).op('e').stop(); },
       "APPENDS adds items to something that is not a list or dict"},
      {"a list as a dict key", [] { return Pickle().op('}').op(']').integer(1).op('s').stop(); },
       "is refused by LibTorch (Can't hash"},  // LibTorch's own refusal, placed in the file
      // Globals and calls.
      {"a global that is not plain data", [] { return Pickle().global("os", "system").stop(); },
       "names os.system, which a weights file does not hold"},
      {"a storage type called as a function",
       [] { return Pickle().global("torch", "FloatStorage").op(')').op('R').stop(); },
       "REDUCE calls something that is not a function"},
      {"an OrderedDict built from arguments",
       [] { return Pickle().global("collections", "OrderedDict").op('(').integer(1).op('\x85').op('t').op('R').stop(); },
       "builds an OrderedDict from arguments"},
      {"BUILD on a plain dict", [] { return Pickle().op('}').op('}').op('b').stop(); },
       "BUILD gives attributes to something other than an OrderedDict"},
      {"NEWOBJ", [] { return Pickle().global("collections", "OrderedDict").op(')').op('\x81').stop(); },
       "NEWOBJ makes an object"},
      // The pickle as a whole.
      {"no STOP", [] { return Pickle().integer(1); }, "runs past the end of the pickle"},
      {"a string past the end", [] { return Pickle().op('X').little_endian(1000, 4).raw("abc"); },
       "runs past the end of the pickle"},
      {"two values at STOP", [] { return Pickle().integer(1).integer(2).stop(); }, "ends with 2 values where one belongs"},
      {"a MARK open at STOP", [] { return Pickle().integer(1).op('(').stop(); }, "ends with a MARK still open"},
      {"an opcode torch.save does not write", [] { return Pickle().op('S').raw("'a'\n").stop(); }, "opcode 0x53"},
      {"pickle protocol 6", [] { return Pickle{std::string("\x80\x06", 2)}.integer(1).stop(); },
       "is pickle protocol 6; expected 2 to 5"},
      {"STACK_GLOBAL of a number", [] { return Pickle().string("os").integer(1).raw("\x93").stop(); },
       "STACK_GLOBAL names a global with something other than two strings"},
      {"STACK_GLOBAL of a global that is not plain data",
       [] { return Pickle().string("os").string("system").raw("\x93").stop(); },
       "names os.system, which a weights file does not hold"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_THAT([&] { read(c.pickle()); },
                ThrowsMessage<c10::Error>(AllOf(HasSubstr("crafted.pt: data.pkl"), HasSubstr(c.condition))));
  }
}

// Two directory entries of one name: what LibTorch reads and what was checked could differ.
TEST(CraftedPickles, AnArchiveWithTwoEntriesOfOneNameIsRefused) {
  auto bytes = archive(tensor_dict({}).bytes, /*second_storage=*/true);
  // data/1 renamed data/0 in its local header and the directory: the same length, so offsets
  // stay right, and CRCs cover contents, not names.
  const std::string from = "/data/1", to = "/data/0";
  int renamed = 0;
  for (size_t at = 0; at + from.size() <= bytes.size(); ++at) {
    if (std::memcmp(bytes.data() + at, from.data(), from.size()) == 0) {
      std::memcpy(bytes.data() + at, to.data(), to.size());
      ++renamed;
    }
  }
  ASSERT_EQ(renamed, 2);
  EXPECT_THAT([&] { qkv::read_tensor_dict(bytes, "twice.pt"); },
              ThrowsMessage<c10::Error>(AllOf(HasSubstr("twice.pt: entry "), HasSubstr("/data/0 appears twice"))));
}

// ---- qkv-train's checkpoints: LibTorch's torch::serialize::OutputArchive ----
//
// An archive's pickle holds TorchScript objects (GLOBAL __torch__.<class>, an empty tuple,
// NEWOBJ, then BUILD with a dict of attributes) beside the same values and tensors. qkv reads
// them itself (read_archive_pickle) and has LibTorch write them again, so that LibTorch's importer
// never compiles the archive's own code/ (a one-word change there crashed LibTorch 1.13's
// compiler; fuzz/fuzz_checkpoint_loader found it).

// An object of class __torch__<suffix>.Module: `attributes` writes key, value pairs.
Pickle& object(Pickle& p, const std::string& suffix, const std::function<void(Pickle&)>& attributes) {
  p.global("__torch__" + suffix, "Module").op(')').op('\x81').op('}').op('(');
  attributes(p);
  return p.op('u').op('b');
}

// {w: tensor, step: 3, lr: 0.5, kind: "adam", betas: (1, 2), child: {x: tensor of row 3}}, the
// root's attributes beside `extra`.
Pickle archive_pickle(const std::function<void(Pickle&)>& extra = [](Pickle&) {}) {
  Pickle p;
  object(p, "", [&](Pickle& q) {
    q.string("w");
    tensor(q, {});
    q.string("step").integer(3);
    q.string("lr").op('G').raw(std::string("\x3f\xe0\0\0\0\0\0\0", 8));  // BINFLOAT 0.5, big-endian
    q.string("kind").string("adam");
    q.string("betas").integer(1).integer(2).op('\x86');
    q.string("child");
    object(q, ".___torch_mangle_0", [](Pickle& r) {
      TensorSpec row;
      row.offset = 12;
      row.sizes = {4};
      row.strides = {1};
      r.string("x");
      tensor(r, row);
    });
    extra(q);
  });
  return p.stop();
}

torch::serialize::InputArchive read_archive(const Pickle& p) {
  return qkv::detail::read_serialize_archive(archive(p.bytes), "checkpoint.pt");
}

TEST(CraftedArchives, TheBaselineReadsEveryValueAndObject) {
  auto in = read_archive(archive_pickle());
  torch::Tensor w, x;
  c10::IValue step, lr, kind, betas;
  in.read("w", w);
  in.read("step", step);
  in.read("lr", lr);
  in.read("kind", kind);
  in.read("betas", betas);
  torch::serialize::InputArchive child;
  in.read("child", child);
  child.read("x", x);
  EXPECT_TRUE(torch::equal(w, torch::arange(16, torch::kFloat).reshape({4, 4})));
  EXPECT_TRUE(torch::equal(x, torch::arange(12, 16, torch::kFloat)));
  EXPECT_EQ(step.toInt(), 3);
  EXPECT_EQ(lr.toDouble(), 0.5);
  EXPECT_EQ(kind.toStringRef(), "adam");
  ASSERT_TRUE(betas.isTuple());
  EXPECT_EQ(betas.toTupleRef().elements().at(1).toInt(), 2);
}

// An archive as LibTorch writes it, code/ included, read back; then the same archive with every
// code/ entry and debug pickle replaced (the CRCs right), which reads the same, because the class
// definitions there are never compiled.
TEST(CraftedArchives, LibTorchsArchiveReadsTheSameWhateverItsCodeSays) {
  torch::serialize::OutputArchive out, nested, deeper;
  const auto weight = torch::randn({3, 5}), rng = torch::randint(0, 255, {40}, torch::kByte);
  deeper.write("exp_avg", c10::IValue(torch::ones({2}, torch::kDouble)));
  deeper.write("step", c10::IValue(int64_t(7)));
  nested.write("0x55d0c4a0b2f0", deeper);
  nested.write("betas", c10::IValue(std::make_tuple(0.9, 0.999)));
  out.write("W_q", weight);
  out.write("state", nested);
  out.write("options", c10::IValue(std::string("{\"task\": \"reverse\"}")));
  out.write("cpu_rng_state", rng);
  const auto bytes = qkv::detail::archive_bytes(out);

  // Every entry again, code/ and its debug pickles replaced.
  int replaced = 0;
  const auto rewritten =
      qkv_test::rewrite_archive(std::string(bytes.begin(), bytes.end()), [&](const std::string& name, std::string& contents) {
        if (name.rfind("code/", 0) == 0) {
          // The fuzzer's change: an unknown class constant (SIGSEGV in LibTorch 1.13's compiler).
          contents = "class Module(Module):\n  __parameterlibpythons__ = []\n";
          ++replaced;
        }
      });
  const std::vector<char> damaged(rewritten.begin(), rewritten.end());
  ASSERT_GE(replaced, 4) << "expected the archive's class definitions and their debug pickles under code/";

  for (const auto* file : {&bytes, &damaged}) {
    SCOPED_TRACE(file == &bytes ? "as written" : "code/ replaced");
    auto in = qkv::detail::read_serialize_archive(*file, "checkpoint.pt");
    torch::Tensor w, r, exp_avg;
    c10::IValue options, step, betas;
    in.read("W_q", w);
    in.read("cpu_rng_state", r);
    in.read("options", options);
    torch::serialize::InputArchive state, inner;
    in.read("state", state);
    state.read("betas", betas);
    state.read("0x55d0c4a0b2f0", inner);
    inner.read("exp_avg", exp_avg);
    inner.read("step", step);
    EXPECT_TRUE(torch::equal(w, weight));
    EXPECT_TRUE(torch::equal(r, rng));
    EXPECT_TRUE(torch::equal(exp_avg, torch::ones({2}, torch::kDouble)));
    EXPECT_EQ(step.toInt(), 7);
    EXPECT_EQ(options.toStringRef(), "{\"task\": \"reverse\"}");
    EXPECT_EQ(betas.toTupleRef().elements().at(0).toDouble(), 0.9);
  }
}

// A checkpoint's tensors go back to the device they were saved from (a CUDA run's to the GPU), as
// LibTorch's reader put them; a weights file's load to the CPU. "meta" stands in for CUDA here.
TEST(CraftedArchives, TensorsGoBackToTheDeviceTheyWereSavedFrom) {
  TensorSpec on_meta;
  on_meta.location = "meta";
  auto in = read_archive(archive_pickle([&](Pickle& q) {
    q.string("elsewhere");
    tensor(q, on_meta);
  }));
  torch::Tensor w, elsewhere;
  in.read("w", w);
  in.read("elsewhere", elsewhere);
  EXPECT_EQ(w.device(), torch::Device(torch::kCPU));
  EXPECT_EQ(elsewhere.device().type(), torch::kMeta);
  EXPECT_EQ(elsewhere.sizes(), torch::IntArrayRef({4, 4}));
  EXPECT_EQ(read(tensor_dict(on_meta)).at("w").device(), torch::Device(torch::kCPU));
}

TEST(CraftedArchives, AreRefusedNamingTheFileAndTheCondition) {
  const auto with = [](std::function<void(Pickle&)> extra) { return [extra] { return archive_pickle(extra); }; };
  const std::vector<Crafted> cases = {
      {"an object made with arguments",
       [] { return Pickle().global("__torch__", "Module").integer(1).op('\x85').op('\x81').stop(); },
       "NEWOBJ gives an archive's object arguments"},
      {"NEWOBJ of a function", [] { return Pickle().global("torch._utils", "_rebuild_tensor_v2").op(')').op('\x81').stop(); },
       "NEWOBJ makes something other than an archive's object"},
      {"a class outside __torch__", [] { return Pickle().global("os", "Module").op(')').op('\x81').stop(); },
       "names os.Module, which an archive does not hold"},
      {"a class whose module is not a dotted name",
       [] { return Pickle().global("__torch__.a b", "Module").op(')').op('\x81').stop(); },
       "names __torch__.a b.Module, which an archive does not hold"},
      {"an object built twice",
       [] {
         Pickle p;
         object(p, "", [](Pickle& q) { q.string("a").integer(1); });
         return p.op('}').op('b').stop();
       },
       "BUILD gives an object attributes a second time"},
      {"an object built from a list",
       [] { return Pickle().global("__torch__", "Module").op(')').op('\x81').op(']').op('b').stop(); },
       "BUILD gives an object attributes other than a dict"},
      {"an attribute named by a number",
       [] {
         Pickle p;
         return object(p, "", [](Pickle& q) { q.integer(1).integer(2); }).stop();
       },
       "BUILD names an attribute with something other than a string"},
      {"an attribute name that would end a line of the class definition",
       with([](Pickle& q) { q.string("a\"]\n  import os").integer(1); }),
       "names an attribute \"a\"]\\x0a  import os\"; expected letters, digits, '_' and '/'"},
      {"an attribute name TorchScript reads itself", with([](Pickle& q) { q.string("__parameters__").integer(1); }),
       "names an attribute \"__parameters__\""},
      {"a Python keyword as an attribute", with([](Pickle& q) { q.string("class").integer(1); }),
       "names an attribute \"class\""},
      {"a keyword of TorchScript's as an attribute (LibTorch 1.13's importer failed an internal assert)",
       with([](Pickle& q) { q.string("NoneType").integer(1); }), "names an attribute \"NoneType\""},
      {"an attribute given twice", with([](Pickle& q) { q.string("step").integer(4); }),
       "gives an object the attribute step twice"},
      {"a list as an attribute", with([](Pickle& q) { q.string("list").op(']'); }),
       "gives attribute list a value an archive does not hold"},
      {"a dict as an attribute", with([](Pickle& q) { q.string("dict").op('}'); }),
       "gives attribute dict a value an archive does not hold"},
      {"a tuple holding a tensor",
       with([](Pickle& q) {
         q.string("pair").integer(1);
         tensor(q, {});
         q.op('\x86');
       }),
       "gives attribute pair a value an archive does not hold"},
      {"an object not yet built as an attribute",
       with([](Pickle& q) { q.string("child2").global("__torch__", "Module").op(')').op('\x81'); }),
       "gives attribute child2 an object that BUILD has not finished"},
      {"an object inside its own attributes",
       [] {
         Pickle p;
         p.global("__torch__", "Module").op(')').op('\x81').put(0).op('}').op('(').string("me").get(0).op('u').op('b');
         return p.stop();
       },
       "gives attribute me an object that BUILD has not finished"},
      {"a dict at the top", [] { return tensor_dict({}); }, "holds something other than an archive's object"},
      {"a global that is not plain data", with([](Pickle& q) { q.string("f").global("os", "system"); }),
       "names os.system, which an archive does not hold"},
      {"a storage larger than its entry",
       with([](Pickle& q) {
         TensorSpec big;
         big.elements = 17;
         q.string("big");
         tensor(q, big);
       }),
       "gives storage data/0 17 elements of 4 bytes, but its entry holds 64 bytes"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_THAT([&] { read_archive(c.pickle()); },
                ThrowsMessage<c10::Error>(AllOf(HasSubstr("checkpoint.pt: data.pkl"), HasSubstr(c.condition),
                                                HasSubstr("not written by LibTorch's torch::serialize::OutputArchive"))));
  }
}

}  // namespace pickle_reader_test
