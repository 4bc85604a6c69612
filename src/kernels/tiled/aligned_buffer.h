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
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace qkv::kernels::tiled {

/// Bytes of a cache line, of an AMX tile row and of an AVX-512 register.
constexpr std::size_t kCacheLineBytes = 64;

/// std::allocator with storage on kCacheLineBytes boundaries (C++17 aligned operator new).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor): allocator rebinding
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kCacheLineBytes}));
  }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{kCacheLineBytes}); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept {
    return true;
  }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const noexcept {
    return false;
  }
};

/// A std::vector whose data() starts on a cache line.
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace qkv::kernels::tiled
