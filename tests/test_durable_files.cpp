// Files qkv writes and reads: writes are durable and atomic (a failed write leaves no partial
// file and the previous one intact), and the archive check never reads outside its buffer.
#include "support/fixtures.h"

#include "archive_integrity.h"
#include "atomic_file.h"

#include <gmock/gmock.h>

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

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

// The temporaries write_file_atomically left in `folder` (none, when it works).
std::vector<std::string> temporaries_in(const fs::path& folder) {
  std::vector<std::string> left;
  for (const auto& entry : fs::directory_iterator(folder)) {
    if (entry.path().filename().string().find(".tmp-") != std::string::npos) left.push_back(entry.path());
  }
  return left;
}

TEST(AtomicFile, ReplacesTheFileWhole) {
  const auto folder = temporary("replace");
  fs::create_directories(folder);
  const auto path = folder / "file";
  qkv::detail::write_file_atomically(path.string(), std::string("first"));
  qkv::detail::write_file_atomically(path.string(), std::string("second, longer"));
  EXPECT_EQ(read(path), "second, longer");
  EXPECT_TRUE(temporaries_in(folder).empty());
  fs::remove_all(folder);
}

TEST(AtomicFile, AFailedWriteLeavesNoTemporaryAndThePreviousContent) {
  // The folder does not exist: nothing can be created.
  const auto missing = temporary("missing") / "file.pt";
  EXPECT_THAT([&] { qkv::detail::write_file_atomically(missing.string(), std::string("x")); },
              ThrowsMessage<c10::Error>(HasSubstr("cannot create " + missing.string() + ".tmp-")));
  // The rename cannot replace the target (a non-empty folder): the temporary is removed and the
  // target keeps what it had.
  const auto parent = temporary("target");
  const auto target = parent / "target";
  fs::create_directories(target);
  std::ofstream(target / "kept") << "kept";
  EXPECT_THAT([&] { qkv::detail::write_file_atomically(target.string(), std::string("new")); },
              ThrowsMessage<c10::Error>(HasSubstr("cannot rename " + target.string() + ".tmp-")));
  EXPECT_TRUE(temporaries_in(parent).empty());
  EXPECT_EQ(read(target / "kept"), "kept");
  fs::remove_all(parent);
}

// A symlink planted where the temporary used to be (the fixed name PATH.tmp) is not followed:
// the file it points to is untouched.
TEST(AtomicFile, NeverWritesThroughASymlinkAtTheOldTemporaryName) {
  const auto folder = temporary("symlink");
  fs::create_directories(folder);
  const auto victim = folder / "victim";
  std::ofstream(victim) << "precious";
  fs::create_symlink(victim, folder / "file.tmp");
  qkv::detail::write_file_atomically((folder / "file").string(), std::string("new content"));
  EXPECT_EQ(read(victim), "precious");
  EXPECT_EQ(read(folder / "file"), "new content");
  EXPECT_TRUE(fs::is_symlink(folder / "file.tmp"));
  fs::remove_all(folder);
}

// A new file gets the umask's mode, not a forced 0644; a replaced file keeps its own.
TEST(AtomicFile, ModeFollowsTheUmaskAndAReplacedFileKeepsItsOwn) {
  const auto folder = temporary("mode");
  fs::create_directories(folder);
  const mode_t previous = ::umask(077);
  qkv::detail::write_file_atomically((folder / "private").string(), std::string("x"));
  ::umask(previous);
  EXPECT_EQ(fs::status(folder / "private").permissions(), fs::perms::owner_read | fs::perms::owner_write);
  const auto shared = folder / "shared";
  std::ofstream(shared) << "old";
  fs::permissions(shared, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  qkv::detail::write_file_atomically(shared.string(), std::string("new"));
  EXPECT_EQ(fs::status(shared).permissions(), fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  fs::remove_all(folder);
}

// Writers of one path in parallel: each rename installs a whole file of one writer, and no writer
// fails or finds its temporary replaced by another's (with one fixed PATH.tmp they clobbered each other).
TEST(AtomicFile, ConcurrentWritersEachWriteAWholeFile) {
  const auto folder = temporary("concurrent");
  fs::create_directories(folder);
  const auto path = (folder / "file").string();
  std::vector<std::string> contents;
  for (int writer = 0; writer < 8; ++writer) contents.push_back(std::string(200000 + writer, static_cast<char>('a' + writer)));
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int writer = 0; writer < 8; ++writer) {
    threads.emplace_back([&, writer] {
      for (int round = 0; round < 10; ++round) {
        try {
          qkv::detail::write_file_atomically(path, contents[writer]);
        } catch (const c10::Error&) {
          ++failures;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  const auto final_content = read(path);
  EXPECT_NE(std::find(contents.begin(), contents.end(), final_content), contents.end()) << "a mixed file";
  EXPECT_TRUE(temporaries_in(folder).empty());
  fs::remove_all(folder);
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

// The archive check's CRC-32 (eight bytes a step) against zlib's: the standard check value and
// Python's zlib.crc32 of a fixed buffer at every kind of length (whole steps, tails of 1 to 7
// bytes) and an unaligned start.
TEST(ArchiveIntegrity, Crc32IsZlibs) {
  const std::string check = "123456789";
  EXPECT_EQ(qkv::detail::crc32(reinterpret_cast<const unsigned char*>(check.data()), check.size()), 0xCBF43926u);
  std::vector<unsigned char> buffer(size_t(1) << 20);
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<unsigned char>((i * 31 + 7) % 251);
  const std::vector<std::pair<size_t, uint32_t>> from_start = {
      {0, 0x0u},          {1, 0x4c667a2eu},    {7, 0x3e483922u},    {8, 0xa7560428u},         {9, 0xe07dd56au},
      {15, 0x72ab2a5eu},  {16, 0xa6c1963du},   {17, 0xfdcb529cu},   {1000, 0x711ebe2bu},      {1 << 20, 0x31bd5f80u}};
  for (const auto& [length, expected] : from_start) {
    EXPECT_EQ(qkv::detail::crc32(buffer.data(), length), expected) << length << " bytes";
  }
  const std::vector<std::pair<size_t, uint32_t>> from_byte_3 = {
      {5, 0xfd6bb23cu}, {8, 0xffd14ef0u}, {13, 0xd7d2106fu}, {4096, 0xc246925du}};
  for (const auto& [length, expected] : from_byte_3) {
    EXPECT_EQ(qkv::detail::crc32(buffer.data() + 3, length), expected) << length << " bytes from byte 3";
  }
}

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
