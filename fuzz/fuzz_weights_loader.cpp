// libFuzzer target: arbitrary bytes as a weights file. Reading and loading them must either work
// or throw c10::Error; a crash, a hang or a sanitizer report is a bug (turn it into a test).
//
// Two kinds of mutation, half the time each. libFuzzer's own, on the file's bytes, found the faults
// in the zip records (src/archive_integrity.cpp). But a mutated byte inside an entry fails that
// entry's CRC-32 and stops there, so the pickle and the tensors behind it were seldom reached
// (once in 1.3 million runs). The other mutation therefore reads the archive, mutates one entry's
// contents (most often the pickle) and writes the archive again with LibTorch's writer, CRCs and
// offsets right: what a crafted file, or a writer with a bug, would hand the pickle's reader and
// load_state_dict's checks. Within seconds it found LibTorch 1.13's unpickler writing through a
// wild pointer (tests/data/fuzz_regressions/weights_pickle_tuple3_on_a_short_stack.pt), which led
// to qkv reading the pickle itself (src/pickle_reader.cpp).
#include "archive_integrity.h"

#include <qkv/qkv.h>

#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

namespace {

// The archive's entries (name, contents) when `data` is a sound archive, else nothing.
std::vector<std::pair<std::string, std::vector<uint8_t>>> read_entries(const uint8_t* data, size_t size) {
  std::vector<std::pair<std::string, std::vector<uint8_t>>> entries;
  try {
    // LibTorch's reader trusts the zip records; only a sound archive is handed to it.
    qkv::detail::verify_torch_archive(reinterpret_cast<const char*>(data), size, "mutator input");
    caffe2::serialize::PyTorchStreamReader reader(
        std::make_shared<caffe2::serialize::MemoryReadAdapter>(data, static_cast<off_t>(size)));
    for (const auto& name : reader.getAllRecords()) {
      const auto [record, record_size] = reader.getRecord(name);
      const auto* bytes = static_cast<const uint8_t*>(record.get());
      entries.emplace_back(name, std::vector<uint8_t>(bytes, bytes + record_size));
    }
  } catch (const std::exception&) {
    entries.clear();
  }
  return entries;
}

}  // namespace

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  std::minstd_rand random(seed);
  if (random() % 2 == 0) return LLVMFuzzerMutate(data, size, max_size);
  auto entries = read_entries(data, size);
  if (entries.empty()) return LLVMFuzzerMutate(data, size, max_size);

  // The pickle three times in four, else any entry (a tensor's bytes, the version).
  size_t chosen = random() % entries.size();
  if (random() % 4 != 0) {
    for (size_t i = 0; i < entries.size(); ++i) {
      if (entries[i].first.size() >= 4 && entries[i].first.compare(entries[i].first.size() - 4, 4, ".pkl") == 0) {
        chosen = i;
      }
    }
  }
  auto& contents = entries[chosen].second;
  const size_t old_size = contents.size();
  contents.resize(old_size + 64);
  contents.resize(LLVMFuzzerMutate(contents.data(), old_size, contents.size()));

  std::vector<uint8_t> archive;
  try {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) -> size_t {
      const auto* b = static_cast<const uint8_t*>(bytes);
      archive.insert(archive.end(), b, b + n);
      return n;
    });
    for (const auto& [name, bytes] : entries) {
      if (name == "version" || name == ".data/version") continue;  // the writer writes its own
      writer.writeRecord(name, bytes.data(), bytes.size());
    }
    writer.writeEndOfFile();
  } catch (const std::exception&) {
    return LLVMFuzzerMutate(data, size, max_size);
  }
  if (archive.size() > max_size) return LLVMFuzzerMutate(data, size, max_size);
  std::memcpy(data, archive.data(), archive.size());
  return archive.size();
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static qkv::SelfAttention module(qkv::SelfAttentionOptions(8).num_heads(2).out_proj(true));
  const std::vector<char> bytes(reinterpret_cast<const char*>(data), reinterpret_cast<const char*>(data) + size);
  try {
    const auto tensors = qkv::read_tensor_dict(bytes, "fuzz input");
    qkv::load_state_dict(module, tensors, "fuzz input");
  } catch (const c10::Error&) {
    // refused with a message: the expected outcome for damaged input
  }
  return 0;
}
