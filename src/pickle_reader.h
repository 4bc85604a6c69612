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
// checked to lie inside its entry. TorchScript archives (qkv-train's checkpoints) hold classes
// that only LibTorch's importer can build; for them the same walk only checks what LibTorch's
// reader would otherwise trust, before it reads them.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Allocator.h>
#include <c10/util/Optional.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace qkv::detail {

/// The entries a pickle's storages live in, by name relative to the archive's folder ("data/0").
struct StorageEntries {
  /// The entry's size in bytes, or nullopt when the archive has no such entry.
  std::function<c10::optional<uint64_t>(const std::string& name)> size;
  /// The entry's bytes (only read_weights_pickle reads them).
  std::function<at::DataPtr(const std::string& name)> read;
};

/// The value a weights file's pickle `data` holds (dicts, OrderedDicts as dicts, lists, tuples,
/// numbers, strings, None, CPU tensors), its storages the entries `storage_folder` + key. A
/// global other than those, a storage or tensor that reaches past its entry, or anything that
/// is not a well-formed pickle is refused: c10::Error "<where> <what> at byte <offset>; ...".
c10::IValue read_weights_pickle(const char* data, size_t size, const std::string& storage_folder,
                                const StorageEntries& entries, const std::string& where);

/// Walks a TorchScript archive's pickle as LibTorch's reader will read it and refuses (as above)
/// what would take that reader outside its input, stack, marks or memo, make it call what is not
/// a function, nest containers deeper than destroying them can recurse, or give a storage or
/// tensor more than its entry holds. Builds nothing.
void verify_torchscript_pickle(const char* data, size_t size, const std::string& storage_folder,
                               const StorageEntries& entries, const std::string& where);

}  // namespace qkv::detail
