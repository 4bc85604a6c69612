// A libFuzzer mutation for torch.save and TorchScript archives (fuzz targets only).
//
// libFuzzer's own mutations change the file's bytes, and a changed byte inside an entry fails that
// entry's CRC-32, so the reader behind the zip records (the pickle, the tensors, TorchScript's
// code) is seldom reached. This one reads the archive, mutates one entry's contents and writes the
// archive again with LibTorch's writer, CRCs and offsets right: what a crafted file, or a writer
// with a bug, hands the readers behind the archive check.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace qkv_fuzz {

/// Half the time libFuzzer's own mutation of the bytes; else, when `data` is a sound archive, one
/// entry rewritten: three times in four one of the entries `preferred` names (chosen at random), else
/// any. Returns the new size (at most `max_size`), as LLVMFuzzerCustomMutator does.
size_t mutate_archive(uint8_t* data, size_t size, size_t max_size, unsigned int seed,
                      const std::function<bool(const std::string& name)>& preferred);

/// Whether `name` ends with `suffix`.
bool ends_with(const std::string& name, const std::string& suffix);

}  // namespace qkv_fuzz
