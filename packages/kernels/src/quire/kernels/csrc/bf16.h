// bfloat16 <-> float32 bit conversions shared by Quire's CPU kernels (bfloat16 travels as uint16_t bits).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// As PyTorch's Tensor.to() stores a float as bfloat16: nearest even, NaN as its canonical quiet NaN.
inline uint16_t float_to_bf16_as_torch(float v) { return v != v ? uint16_t{0x7FC0} : float_to_bf16(v); }

#if defined(__AVX512F__)
// Sixteen bfloat16 (bits) to float32, exactly.
inline __m512 bf16_to_float(__m256i bf16_bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits), 16));
}
#endif

#if defined(__AVX2__)
// Eight bfloat16 (bits, unaligned) to float32, exactly.
inline __m256 load_bf16x8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

}  // namespace quire
