// Reading and writing torch.save's format with LibTorch's own pickler and zip writer.
#include "torch_file.h"

#include "archive_integrity.h"
#include "pickle_reader.h"

#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <unordered_map>

namespace qkv::detail {

std::vector<char> read_file_bytes(const std::string& path, const char* caller) {
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file.good(), caller, ": cannot read ", path, ": ", std::strerror(errno));
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  TORCH_CHECK(!file.bad(), caller, ": cannot read ", path, ": ", std::strerror(errno));
  return bytes;
}

namespace {

// An archive that verify_torch_archive passed, open in LibTorch's reader, which names entries
// relative to the archive's folder (the first entry's). Its refusals name the file.
class CheckedArchive {
 public:
  CheckedArchive(const std::vector<char>& bytes, std::string path) : path_(std::move(path)) {
    const auto entries = verify_torch_archive(bytes.data(), bytes.size(), path_);
    TORCH_CHECK(!entries.empty(), path_, ": the archive holds nothing; expected a file written by torch.save");
    const auto& first = entries.front().name;
    const auto folder = first.substr(0, first.find('/') + 1);
    for (const auto& entry : entries) {
      if (entry.name.rfind(folder, 0) == 0) sizes_.emplace(entry.name.substr(folder.size()), entry.size);
    }
    named([&] {
      reader_ = std::make_unique<caffe2::serialize::PyTorchStreamReader>(
          std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(), static_cast<off_t>(bytes.size())));
    });
  }

  bool has(const std::string& name) const { return sizes_.count(name) > 0; }
  std::pair<at::DataPtr, size_t> record(const std::string& name) {
    std::pair<at::DataPtr, size_t> r;
    named([&] {
      auto [data, size] = reader_->getRecord(name);
      r = {std::move(data), size};
    });
    return r;
  }
  StorageEntries storages() {
    return {[this](const std::string& name) -> c10::optional<uint64_t> {
              const auto found = sizes_.find(name);
              return found == sizes_.end() ? c10::nullopt : c10::optional<uint64_t>(found->second);
            },
            [this](const std::string& name) { return record(name).first; }};
  }

 private:
  template <typename F>
  void named(F&& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, path_, ": LibTorch's archive reader refused it: ", e.what_without_backtrace());
    }
  }

  std::string path_;
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader_;
  std::unordered_map<std::string, uint64_t> sizes_;  // by name within the folder
};

}  // namespace

namespace {

// The archive's pickle, data.pkl, of a little-endian file (Python writes the byte order since
// PyTorch 2.1); `writer` names what should have written it, for the refusal.
std::pair<at::DataPtr, size_t> data_pickle(CheckedArchive& archive, const std::string& name, const char* writer) {
  TORCH_CHECK(archive.has("data.pkl"), name, " holds no data.pkl, so it was not written by ", writer);
  if (archive.has("byteorder")) {
    const auto [order, order_size] = archive.record("byteorder");
    TORCH_CHECK(std::string(static_cast<const char*>(order.get()), order_size) == "little", name,
                " was written on a big-endian machine, whose tensors qkv does not read");
  }
  return archive.record("data.pkl");
}

void write_object(const ArchiveObject& object, torch::serialize::OutputArchive& archive) {
  for (const auto& attribute : object.attributes) {
    if (attribute.object) {
      torch::serialize::OutputArchive child;
      write_object(*attribute.object, child);
      archive.write(attribute.name, child);
    } else {
      archive.write(attribute.name, attribute.value);
    }
  }
}

}  // namespace

std::vector<char> archive_bytes(torch::serialize::OutputArchive& archive) {
  std::vector<char> bytes;
  archive.save_to([&](const void* data, size_t size) -> size_t {
    bytes.insert(bytes.end(), static_cast<const char*>(data), static_cast<const char*>(data) + size);
    return size;
  });
  return bytes;
}

torch::serialize::InputArchive read_serialize_archive(const std::vector<char>& bytes, const std::string& path,
                                                      const std::function<void(ArchiveObject& root)>& adjust,
                                                      const c10::optional<torch::Device>& device) {
  TORCH_CHECK(!bytes.empty(), path, " is empty; expected a checkpoint written by LibTorch's OutputArchive");
  std::shared_ptr<ArchiveObject> root;
  {
    CheckedArchive archive(bytes, path);
    const auto [pickle, pickle_size] = data_pickle(archive, path, "LibTorch's OutputArchive");
    root = read_archive_pickle(static_cast<const char*>(pickle.get()), pickle_size, "data/", archive.storages(),
                               path + ": data.pkl");
  }
  if (adjust) adjust(*root);
  // The objects as LibTorch writes them: its importer compiles the class definitions written
  // here, from the attributes read above, and nothing of the file's code/.
  torch::serialize::InputArchive result;
  try {
    torch::serialize::OutputArchive archive;
    write_object(*root, archive);
    const auto rewritten = archive_bytes(archive);
    result.load_from(rewritten.data(), rewritten.size(), device);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, ": LibTorch could not take its objects: ", e.what_without_backtrace());
  } catch (const std::exception& e) {  // TorchScript's ErrorReport
    TORCH_CHECK(false, path, ": LibTorch could not take its objects: ", e.what());
  }
  return result;
}

c10::IValue read_torch_file(const std::vector<char>& bytes, const std::string& name, const char* caller) {
  TORCH_CHECK(!bytes.empty(), caller, ": ", name, " is empty; expected a file written by torch.save");
  try {
    CheckedArchive archive(bytes, name);
    const auto [pickle, pickle_size] = data_pickle(
        archive, name, "torch.save (a TorchScript module from torch.jit.save, or a zip file of something else?)");
    return read_weights_pickle(static_cast<const char*>(pickle.get()), pickle_size, "data/", archive.storages(),
                               name + ": data.pkl");
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, caller, ": ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    // Allocation failures and the like: the same refusal, naming the file.
    TORCH_CHECK(false, caller, ": ", name, " could not be read: ", e.what());
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
