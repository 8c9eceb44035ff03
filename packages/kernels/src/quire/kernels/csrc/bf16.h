// bfloat16 <-> float32 bit conversions shared by Quire's CPU kernels (bfloat16 travels as uint16_t bits).
#pragma once

#include <cstdint>
#include <cstring>

namespace quire {

// Exact: a bfloat16 is the top half of a float32.
inline float bf16_to_float(uint16_t bf16_bits) {
  const uint32_t bits = static_cast<uint32_t>(bf16_bits) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// Rounded to nearest, ties to even (what PyTorch does when it stores a bfloat16).
inline uint16_t float_to_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace quire
