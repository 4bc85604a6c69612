#include "archive_mutator.h"

#include "archive_integrity.h"

#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <utility>
#include <vector>

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

namespace qkv_fuzz {
namespace {

using Entries = std::vector<std::pair<std::string, std::vector<uint8_t>>>;

// The archive's entries (name, contents) when `data` is a sound archive, else nothing.
Entries read_entries(const uint8_t* data, size_t size) {
  Entries entries;
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

bool ends_with(const std::string& name, const std::string& suffix) {
  return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

size_t mutate_archive(uint8_t* data, size_t size, size_t max_size, unsigned int seed,
                      const std::function<bool(const std::string& name)>& preferred) {
  std::minstd_rand random(seed);
  if (random() % 2 == 0) return LLVMFuzzerMutate(data, size, max_size);
  auto entries = read_entries(data, size);
  if (entries.empty()) return LLVMFuzzerMutate(data, size, max_size);

  size_t chosen = random() % entries.size();
  if (random() % 4 != 0) {
    std::vector<size_t> candidates;
    for (size_t i = 0; i < entries.size(); ++i) {
      if (preferred(entries[i].first)) candidates.push_back(i);
    }
    if (!candidates.empty()) chosen = candidates[random() % candidates.size()];
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

}  // namespace qkv_fuzz
