// write_file_atomically: write, fsync, rename, fsync the folder (POSIX).
#include "atomic_file.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

namespace qkv::detail {
namespace {

std::string system_error(const char* what, const std::string& path) {
  return std::string(what) + " " + path + ": " + std::strerror(errno);
}

// Closes a descriptor on every path out of a scope.
struct Descriptor {
  int fd = -1;
  ~Descriptor() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

void write_file_atomically(const std::string& path, const void* data, size_t size) {
  const std::string temporary = path + ".tmp";
  std::string problem;
  {
    Descriptor file;
    file.fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TORCH_CHECK(file.fd >= 0, system_error("cannot create", temporary));
    const auto* bytes = static_cast<const char*>(data);
    size_t written = 0;
    while (written < size && problem.empty()) {
      const ssize_t n = ::write(file.fd, bytes + written, size - written);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) problem = system_error("cannot write", temporary);
      if (n >= 0) written += static_cast<size_t>(n);
    }
    // The data must be on disk before the rename makes it the file's content.
    if (problem.empty() && ::fsync(file.fd) != 0) problem = system_error("cannot flush", temporary);
    if (problem.empty()) {
      const int closed = ::close(file.fd);
      file.fd = -1;
      if (closed != 0) problem = system_error("cannot close", temporary);
    }
  }
  if (problem.empty() && std::rename(temporary.c_str(), path.c_str()) != 0) {
    problem = system_error(("cannot rename " + temporary + " to").c_str(), path);
  }
  if (!problem.empty()) {
    ::unlink(temporary.c_str());
    TORCH_CHECK(false, problem);
  }
  // The rename is an entry of the folder: flush the folder too, or a power loss may undo it.
  auto folder = std::filesystem::path(path).parent_path();
  if (folder.empty()) folder = ".";
  Descriptor directory;
  directory.fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(directory.fd >= 0 && ::fsync(directory.fd) == 0, system_error("cannot flush the folder", folder.string()),
              " after writing ", path);
}

}  // namespace qkv::detail
