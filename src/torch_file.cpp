// Reading and writing torch.save's format with LibTorch's own pickler and zip writer.
#include "torch_file.h"

#include "archive_integrity.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/serialize.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

namespace qkv::detail {

std::vector<char> read_file_bytes(const std::string& path, const char* caller) {
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file.good(), caller, ": cannot read ", path, ": ", std::strerror(errno));
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  TORCH_CHECK(!file.bad(), caller, ": cannot read ", path, ": ", std::strerror(errno));
  return bytes;
}

c10::IValue read_torch_file(const std::vector<char>& bytes, const std::string& name, const char* caller) {
  TORCH_CHECK(!bytes.empty(), caller, ": ", name, " is empty; expected a file written by torch.save");
  try {
    verify_torch_archive(bytes.data(), bytes.size(), name);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, caller, ": ", e.what_without_backtrace());
  }
  try {
    return torch::pickle_load(bytes);
  } catch (const c10::Error&) {
    throw;  // the caller names the file (state_dict.cpp) or the kind of damage it knows
  } catch (const std::exception& e) {
    // LibTorch's unpickler reads its memo and stack with bounds-checked accessors, so a damaged
    // pickle inside a sound archive can end in std::out_of_range rather than a c10::Error (found
    // by fuzz/fuzz_weights_loader, 2026-12-05: a memo index of 63 into 31 entries): a c10::Error
    // naming the file, as for every other damage.
    TORCH_CHECK(false, caller, ": ", name, " is damaged or not written by torch.save: LibTorch's reader stopped with ",
                e.what());
  }
}

std::vector<char> torch_save_bytes(const c10::IValue& value) {
  // What torch::pickle_save does, with the pickler's type tags off.
  std::vector<char> pickle;
  torch::jit::Pickler pickler([&](const char* data, size_t size) { pickle.insert(pickle.end(), data, data + size); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();

  std::vector<char> archive;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) -> size_t {
    const auto* bytes = static_cast<const char*>(data);
    archive.insert(archive.end(), bytes, bytes + size);
    return size;
  });
  torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return archive;
}

}  // namespace qkv::detail
