// Scratch storage that starts on a cache line, for the tiled kernel's blocks and packed operands.
// Private to qkv.
//
// Why: an AMX tile row is 64 bytes and an AVX-512 vector 64 bytes; one that starts off a line
// touches two. std::vector's storage is only 16-byte aligned (glibc's malloc; its large blocks
// come from mmap at a page + 16 bytes), so every tile row of a block straddled two lines. Measured
// on an Intel Xeon with AMX (family 6 model 167, 2026-12-02, one pinned thread, a 2 × 2 block of
// TDPBF16PS with its four tile loads per pass): 5.6 ns per product from 64-byte-aligned operands,
// 16-27 ns from operands 16 or 32 bytes off. The rows of a buffer stay aligned when their stride is
// a multiple of 64 bytes (kScoresStride, the packed panels' 1 KiB tiles, padded_rows).
//
// How: a std::vector one cache line longer than asked, its elements starting at the first line
// boundary inside it. Not C++17's aligned operator new: glibc serves that by memalign, whose
// blocks of the kernel's sizes (tens of KiB, allocated and freed by every call) went back to the
// operating system and came back as fresh pages each time: with it the bf16-mixed language model
// trained 14% fewer tokens per second, its kernel time in page faults (2026-12-02, same machine).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace qkv::kernels::tiled {

/// Bytes of a cache line, of an AMX tile row and of an AVX-512 register.
constexpr std::size_t kCacheLineBytes = 64;

/// A resizable array of trivially copyable values whose data() starts on a cache line: the part
/// of std::vector's interface the kernel uses (new elements are value-initialised, as there).
template <typename T>
class AlignedVector {
  static_assert(std::is_trivially_copyable_v<T> && kCacheLineBytes % sizeof(T) == 0,
                "AlignedVector holds plain values that tile a cache line");
  static constexpr std::size_t kSlack = kCacheLineBytes / sizeof(T);  // elements of room to align in

 public:
  AlignedVector() = default;
  explicit AlignedVector(std::size_t n) { resize(n); }
  AlignedVector(const AlignedVector& other) { *this = other; }
  AlignedVector& operator=(const AlignedVector& other) {
    if (this != &other) assign(other.begin(), other.end());
    return *this;
  }
  // A moved std::vector keeps its heap block, so the offset stays right.
  AlignedVector(AlignedVector&& other) noexcept
      : storage_(std::move(other.storage_)), offset_(std::exchange(other.offset_, 0)),
        size_(std::exchange(other.size_, 0)) {}
  AlignedVector& operator=(AlignedVector&& other) noexcept {
    storage_ = std::move(other.storage_);
    offset_ = std::exchange(other.offset_, 0);
    size_ = std::exchange(other.size_, 0);
    return *this;
  }

  T* data() { return storage_.data() + offset_; }
  const T* data() const { return storage_.data() + offset_; }
  std::size_t size() const { return size_; }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }
  T& operator[](std::size_t i) { return data()[i]; }
  const T& operator[](std::size_t i) const { return data()[i]; }

  /// n elements: those kept keep their values, new ones are T().
  void resize(std::size_t n) {
    if (storage_.size() < kSlack || n > storage_.size() - kSlack) {  // a new block, aligned afresh
      std::vector<T> grown(std::max(n + kSlack, storage_.size() * 3 / 2));
      const std::size_t offset = offset_in(grown.data());
      std::copy(begin(), begin() + std::min(size_, n), grown.data() + offset);
      storage_ = std::move(grown);
      offset_ = offset;
    } else if (n > size_) {
      std::fill_n(storage_.begin() + static_cast<std::ptrdiff_t>(offset_ + size_), n - size_, T());
    }
    size_ = n;
  }
  void assign(std::size_t n, const T& value) {
    resize(n);
    std::fill(begin(), end(), value);
  }

 private:
  template <typename It>
  void assign(It first, It last) {
    resize(static_cast<std::size_t>(last - first));
    std::copy(first, last, begin());
  }
  // Elements from p to the next cache line (p is at least sizeof(T)-aligned).
  static std::size_t offset_in(const T* p) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    return ((kCacheLineBytes - address % kCacheLineBytes) % kCacheLineBytes) / sizeof(T);
  }

  std::vector<T> storage_;
  std::size_t offset_ = 0, size_ = 0;
};

}  // namespace qkv::kernels::tiled
