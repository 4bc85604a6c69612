// Reading the pickle inside a torch.save archive without trusting it. Private to qkv.
//
// LibTorch's unpickler trusts its input. Inside a sound archive (CRCs right), a crafted or damaged
// pickle made LibTorch 1.13's reader pop an empty stack and write through a wild pointer (found by
// fuzz/fuzz_weights_loader, 2026-12-05); on every LibTorch version a storage that claims more
// elements than its entry holds loads silently, its tensor reading the heap past the entry (the
// weights then hold whatever memory lay there, and qkv-weights convert wrote it out). And no
// LibTorch reads an OrderedDict, which is what Python's model.state_dict() is.
//
// So qkv reads weights files itself: the opcodes of pickle protocol 2 (torch.save's), with
// Python's rules for the stack, marks and memo, building only plain data (dicts, OrderedDicts,
// lists, tuples, numbers, strings, None) and dense tensors over the archive's storages, each
// checked to lie inside its entry.
//
// qkv-train's checkpoints (LibTorch's torch::serialize::OutputArchive, a TorchScript archive) hold
// TorchScript objects besides, and TorchScript source (code/, the objects' class definitions) that
// LibTorch's importer compiles. A one-word change to that source crashed LibTorch 1.13's compiler
// (found by fuzz/fuzz_checkpoint_loader, 2026-12-05). So the same reader reads a checkpoint's
// objects as ArchiveObjects, and never reads its code: the class of an object is what its
// attributes are (src/torch_file.cpp writes the archive again from them for LibTorch's reader).
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Allocator.h>
#include <c10/util/Optional.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace qkv::detail {

/// The entries a pickle's storages live in, by name relative to the archive's folder ("data/0").
struct StorageEntries {
  /// The entry's size in bytes, or nullopt when the archive has no such entry.
  std::function<c10::optional<uint64_t>(const std::string& name)> size;
  /// The entry's bytes.
  std::function<at::DataPtr(const std::string& name)> read;
};

/// The value a weights file's pickle `data` holds (dicts, OrderedDicts as dicts, lists, tuples,
/// numbers, strings, None, CPU tensors), its storages the entries `storage_folder` + key. A
/// global other than those, a storage or tensor that reaches past its entry, or anything that
/// is not a well-formed pickle is refused: c10::Error "<where> <what> at byte <offset>; ...".
c10::IValue read_weights_pickle(const char* data, size_t size, const std::string& storage_folder,
                                const StorageEntries& entries, const std::string& where);

/// An object of a torch::serialize archive: its attributes in the order written, each a nested
/// object (a sub-archive: a module, the optimizer's state) or a value (a tensor, a number, a
/// string, None, or a tuple of the scalars).
struct ArchiveObject {
  struct Attribute {
    std::string name;  // letters, digits, '_' and '/'; not a Python keyword, not starting with __
    c10::IValue value;                            // when `object` is null
    std::shared_ptr<ArchiveObject> object;  // a nested object
  };
  std::vector<Attribute> attributes;
};

/// The object a torch::serialize archive's pickle `data` holds (qkv-train's checkpoint.pt), its
/// storages as for read_weights_pickle. Anything else (a global other than the archive's classes,
/// the storage types and _rebuild_tensor_v2; an object made with arguments or built twice; an
/// attribute that is not one of the values above; what read_weights_pickle refuses) is refused:
/// c10::Error "<where> <what> at byte <offset>; ...".
std::shared_ptr<ArchiveObject> read_archive_pickle(const char* data, size_t size, const std::string& storage_folder,
                                                   const StorageEntries& entries, const std::string& where);

}  // namespace qkv::detail
