// Files qkv writes and reads: writes are durable and atomic (a failed write leaves no partial
// file and the previous one intact), and the archive check never reads outside its buffer.
#include "support/fixtures.h"

#include "archive_integrity.h"
#include "atomic_file.h"

#include <gmock/gmock.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

fs::path temporary(const std::string& name) {
  auto path = fs::temp_directory_path() / ("qkv_durable_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(path);
  return path;
}

std::string read(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

TEST(AtomicFile, ReplacesTheFileWhole) {
  const auto path = temporary("replace");
  qkv::detail::write_file_atomically(path.string(), std::string("first"));
  qkv::detail::write_file_atomically(path.string(), std::string("second, longer"));
  EXPECT_EQ(read(path), "second, longer");
  EXPECT_FALSE(fs::exists(path.string() + ".tmp"));
  fs::remove(path);
}

TEST(AtomicFile, AFailedWriteLeavesNoTemporaryAndThePreviousContent) {
  // The folder does not exist: nothing can be created.
  const auto missing = temporary("missing") / "file.pt";
  EXPECT_THAT([&] { qkv::detail::write_file_atomically(missing.string(), std::string("x")); },
              ThrowsMessage<c10::Error>(HasSubstr("cannot create " + missing.string() + ".tmp")));
  // The rename cannot replace the target (a non-empty folder): the temporary is removed and the
  // target keeps what it had.
  const auto target = temporary("target");
  fs::create_directories(target);
  std::ofstream(target / "kept") << "kept";
  EXPECT_THAT([&] { qkv::detail::write_file_atomically(target.string(), std::string("new")); },
              ThrowsMessage<c10::Error>(HasSubstr("cannot rename " + target.string() + ".tmp")));
  EXPECT_FALSE(fs::exists(target.string() + ".tmp"));
  EXPECT_EQ(read(target / "kept"), "kept");
  fs::remove_all(target);
}

// The archive check with the archive right after an inaccessible page: a read before the buffer
// (an offset that wraps around 2^64) faults instead of passing unnoticed.
class GuardedBuffer {
 public:
  explicit GuardedBuffer(const std::string& bytes) {
    const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    size_ = page + ((bytes.size() + page - 1) / page) * page;
    memory_ = static_cast<char*>(::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    EXPECT_NE(memory_, MAP_FAILED);
    ::mprotect(memory_, page, PROT_NONE);
    data_ = memory_ + page;
    std::memcpy(data_, bytes.data(), bytes.size());
  }
  ~GuardedBuffer() { ::munmap(memory_, size_); }
  const char* data() const { return data_; }

 private:
  char* memory_ = nullptr;
  char* data_ = nullptr;
  size_t size_ = 0;
};

TEST(ArchiveIntegrity, Zip64LocatorOffsetsNear2To64AreRefusedWithoutReadingOutside) {
  // A real weights file whose zip64 locator is made to point 16 bytes before the buffer: the
  // offset 2^64 - 16, for which `offset + 56 <= end` wrapped around and passed.
  const auto path = qkv_test::data_path("fuzz_regressions/weights_zip64_locator_wraps_around.pt");
  const auto bytes = read(path);
  ASSERT_GT(bytes.size(), 100u) << path;
  const GuardedBuffer buffer(bytes);
  EXPECT_THAT([&] { qkv::detail::verify_torch_archive(buffer.data(), bytes.size(), "crafted.pt"); },
              ThrowsMessage<c10::Error>(HasSubstr("crafted.pt: the zip64 end record is missing or out of place")));
}

}  // namespace
