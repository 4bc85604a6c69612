// Durable replacement of a file: every writer of qkv (weights, checkpoints, summaries) uses it.
// Private to qkv's build (library and apps).
#pragma once

#include <cstddef>
#include <string>

namespace qkv::detail {

/// Replaces `path` with `size` bytes so that, whatever happens (an error, a crash, a power loss),
/// `path` afterwards holds either its previous content or all of the new one: writes a temporary
/// of its own beside it (PATH.tmp-PID-N, created exclusively, never through a symlink), fsyncs it,
/// renames it over `path`, then fsyncs the folder so that the rename itself is on disk. A new file
/// gets the mode a plain create gives (0666 less the umask); a replaced one keeps its own.
/// Concurrent writers of one path each write a whole file; the last rename wins.
/// Throws c10::Error naming the path and the system's reason, with the temporary removed, when the
/// file could not be replaced; once it is replaced it does not throw (a folder that cannot be
/// flushed afterwards is a warning).
void write_file_atomically(const std::string& path, const void* data, size_t size);

inline void write_file_atomically(const std::string& path, const std::string& text) {
  write_file_atomically(path, text.data(), text.size());
}

}  // namespace qkv::detail
