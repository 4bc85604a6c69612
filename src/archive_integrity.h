// Whole-archive checks of torch.save / torch::save files before LibTorch reads them. Private to qkv.
#pragma once

#include <cstddef>
#include <string>

namespace qkv::detail {

/// Checks that an archive written by torch.save / torch::save (a zip file) is whole: its records
/// point inside the file and every stored entry matches its recorded CRC-32. LibTorch 1.13 checks
/// neither (its zip reader reads where a damaged record points, past the buffer too). Throws
/// c10::Error naming `path` and the problem.
void verify_torch_archive(const char* data, size_t size, const std::string& path);

}  // namespace qkv::detail
