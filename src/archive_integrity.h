// Whole-archive checks of torch.save / torch::save files before LibTorch reads them. Private to qkv.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace qkv::detail {

/// The CRC-32 that zip records for an entry (IEEE 802.3; zlib's crc32).
uint32_t crc32(const unsigned char* data, size_t size);

/// One entry of the archive's directory, as verify_torch_archive found it.
struct ArchiveEntry {
  std::string name;   // the whole name, "<archive>/data/0"
  uint64_t size = 0;  // its contents' size, uncompressed
};

/// Checks that an archive written by torch.save / torch::save (a zip file) is whole: its records
/// point inside the file, no name appears twice, and every stored entry matches its recorded
/// CRC-32. LibTorch 1.13 checks none of this (its zip reader reads where a damaged record points,
/// past the buffer too). Returns the entries in the directory's order. Throws c10::Error naming
/// `path` and the problem.
std::vector<ArchiveEntry> verify_torch_archive(const char* data, size_t size, const std::string& path);

}  // namespace qkv::detail
