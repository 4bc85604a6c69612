// Durable replacement of a file: every writer of qkv (weights, checkpoints, summaries) uses it.
// Private to qkv's build (library and apps).
#pragma once

#include <cstddef>
#include <string>

namespace qkv::detail {

/// Replaces `path` with `size` bytes so that, whatever happens (an error, a crash, a power loss),
/// `path` afterwards holds either its previous content or all of the new one: writes PATH.tmp,
/// fsyncs it, renames it over `path`, then fsyncs the folder so that the rename itself is on disk.
/// Throws c10::Error naming the path and the system's reason; the temporary file is removed.
void write_file_atomically(const std::string& path, const void* data, size_t size);

inline void write_file_atomically(const std::string& path, const std::string& text) {
  write_file_atomically(path, text.data(), text.size());
}

}  // namespace qkv::detail
