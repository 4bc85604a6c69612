// bfloat16 ⇄ float32 on the bits, written so that loops over them vectorize. Private to qkv.
#pragma once

#include <cstdint>
#include <cstring>

namespace qkv::kernels {

/// The float32 a bfloat16 stands for (exact: bfloat16 is float32's upper half).
inline float bfloat16_bits_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof value);
  return value;
}

/// `value` rounded to bfloat16, to nearest, ties to even, a NaN made the quiet NaN 0x7FC0: the same
/// bits as c10::BFloat16's conversion. Adding 0x7FFF plus the lowest kept bit carries into the kept
/// half exactly when the dropped half is above the midpoint, or at it with an odd kept half.
inline uint16_t float_to_bfloat16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return nan ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

}  // namespace qkv::kernels
