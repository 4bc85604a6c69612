// write_file_atomically: write a temporary of its own, fsync, rename, fsync the folder (POSIX).
#include "atomic_file.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>

namespace qkv::detail {
namespace {

std::string system_error(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

// Closes a descriptor on every path out of a scope.
struct Descriptor {
  int fd = -1;
  ~Descriptor() {
    if (fd >= 0) ::close(fd);
  }
};

// A new file beside `path`, PATH.tmp-PID-N, created with O_EXCL | O_NOFOLLOW: never one another
// writer (another thread or process) is using, and never through a symlink planted at its name.
// Its mode is the one a plain create gives (0666 less the umask, applied by the kernel).
std::pair<std::string, int> create_temporary(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0; attempt < 100; ++attempt) {
    const auto ticks = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    const std::string name = path + ".tmp-" + std::to_string(::getpid()) + "-" +
                             std::to_string(counter.fetch_add(1) ^ (ticks & 0xFFFF));
    const int fd = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd >= 0) return {name, fd};
    if (errno != EEXIST) TORCH_CHECK(false, system_error("cannot create", name));
  }
  TORCH_CHECK(false, "cannot create a temporary file beside ", path, ": 100 names were taken");
}

}  // namespace

void write_file_atomically(const std::string& path, const void* data, size_t size) {
  auto [temporary, fd] = create_temporary(path);
  std::string problem;
  {
    Descriptor file;
    file.fd = fd;
    // A replaced file keeps its permissions (a model.pt made private stays private).
    struct stat existing {};
    if (::stat(path.c_str(), &existing) == 0 && S_ISREG(existing.st_mode) &&
        ::fchmod(file.fd, existing.st_mode & 07777) != 0) {
      problem = system_error("cannot set the mode of", temporary);
    }
    const auto* bytes = static_cast<const char*>(data);
    size_t written = 0;
    while (written < size && problem.empty()) {
      const ssize_t n = ::write(file.fd, bytes + written, size - written);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        problem = system_error("cannot write", temporary);
      } else if (n == 0) {  // no progress and no error: give up rather than spin
        problem = "cannot write " + temporary + ": the system accepted 0 of " + std::to_string(size - written) +
                  " bytes";
      } else {
        written += static_cast<size_t>(n);
      }
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
    problem = system_error("cannot rename " + temporary + " to", path);
  }
  if (!problem.empty()) {
    ::unlink(temporary.c_str());
    TORCH_CHECK(false, problem);
  }
  // From here on `path` holds the new content. The rename is an entry of the folder: flush the
  // folder too, or a power loss may undo it. Failing that is a warning, not an error: the file is
  // written, and an exception would report it as not written.
  auto folder = std::filesystem::path(path).parent_path();
  if (folder.empty()) folder = ".";
  Descriptor directory;
  directory.fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (directory.fd < 0 || ::fsync(directory.fd) != 0) {
    TORCH_WARN(system_error("wrote " + path + " but cannot flush its folder", folder.string()),
               " (a power loss now may undo the replacement)");
  }
}

}  // namespace qkv::detail
