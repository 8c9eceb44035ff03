// The quantized block formats of Quire's CPU kernels (GGUF's, and Quire's INT8), decoded with AVX-512, AVX2
// or portable C++; quant_linear.cpp computes with them.
//
// A weight [N out, K in] is N rows of bytes, each row its blocks one after the other, as in the GGUF file:
//
//   Q8_0  34 B per 32:  | d f16 | q int8 x32 |                                        w = d*q
//   Q4_0  18 B per 32:  | d f16 | qs 16 B |  qs[j] = elem j (low nibble), j+16 (high) w = d*(q-8)
//   Q4_1  20 B per 32:  | d f16 | m f16 | qs 16 B (as Q4_0) |                         w = d*q + m
//   Q4_K 144 B per 256: | d f16 | dmin f16 | scales 12 B | qs 128 B |
//                       qs[32g+j] = elem 64g+j (low nibble), 64g+32+j (high);
//                       w = d*sc[s]*q - dmin*mn[s], s = elem/32, (sc, mn) 6-bit pairs packed in `scales`
//   Q6_K 210 B per 256: | ql 128 B | qh 64 B | scales int8 x16 | d f16 |
//                       elem 128h+e: low 4 bits in ql[64h + e%64] (nibble e/64), high 2 in
//                       qh[32h + e%32] (bits 2*(e/32)); w = d*scales[elem/16]*(q-32)
//   INT8  int8 [N, K] and a float32 scale per row:                                    w = q*scale[n]
//
// NOTE: every product above is exact in float32 (an fp16 significand times integers of at most 13 bits),
// so with FMA the decoded values are those of gguf-py's (and ggml's) dequantization, bit for bit.
//
// Vector paths are compiled for their instruction set whatever the build's -march: the generic code is
// written over a vector type V (Avx2, Avx512) and inlined into entry points that carry
// __attribute__((target(...), flatten)); helpers with intrinsics carry the target themselves.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define QUIRE_QUANT_X86 1
#define QUIRE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define QUIRE_AVX2 __attribute__((target("avx2,fma,f16c")))
// vector arguments of the generic templates before they are inlined into the ISA's entry points
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace quire::quant {

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return bits;
}

inline float half_to_float(const uint8_t* p) { return c10::detail::fp16_ieee_to_fp32_value(load_u16(p)); }

// ---- vector types: what the decoders and the tiles need from an instruction set ----

struct Scalar {
  using F = float;
  static constexpr int L = 1, kMaxRows = 4, kTileCols = 2;
  static F zero() { return 0.f; }
  static F load(const float* p) { return *p; }
  static F add(F a, F b) { return a + b; }
  static F fmadd(F a, F b, F c) { return a * b + c; }
  static float hsum(F v) { return v; }
};

#ifdef QUIRE_QUANT_X86
struct Avx2 {
  using F = __m256;
  static constexpr int L = 8, kMaxRows = 4, kTileCols = 2;
  QUIRE_AVX2 static F zero() { return _mm256_setzero_ps(); }
  QUIRE_AVX2 static F set1(float v) { return _mm256_set1_ps(v); }
  QUIRE_AVX2 static F load(const float* p) { return _mm256_loadu_ps(p); }
  QUIRE_AVX2 static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  QUIRE_AVX2 static F add(F a, F b) { return _mm256_add_ps(a, b); }
  QUIRE_AVX2 static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  QUIRE_AVX2 static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  QUIRE_AVX2 static F fmsub(F a, F b, F c) { return _mm256_fmsub_ps(a, b, c); }
  QUIRE_AVX2 static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  QUIRE_AVX2 static float half(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }
  // 16 int8 values as floats, in 16 / L vectors
  QUIRE_AVX2 static void widen16(__m128i bytes, F* out) {
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes)));
  }
};

struct Avx512 {
  using F = __m512;
  static constexpr int L = 16, kMaxRows = 8, kTileCols = 3;
  QUIRE_AVX512 static F zero() { return _mm512_setzero_ps(); }
  QUIRE_AVX512 static F set1(float v) { return _mm512_set1_ps(v); }
  QUIRE_AVX512 static F load(const float* p) { return _mm512_loadu_ps(p); }
  QUIRE_AVX512 static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  QUIRE_AVX512 static F add(F a, F b) { return _mm512_add_ps(a, b); }
  QUIRE_AVX512 static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  QUIRE_AVX512 static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  QUIRE_AVX512 static F fmsub(F a, F b, F c) { return _mm512_fmsub_ps(a, b, c); }
  QUIRE_AVX512 static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  QUIRE_AVX512 static float half(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }
  QUIRE_AVX512 static void widen16(__m128i bytes, F* out) { out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)); }
};

// Byte arithmetic shared by both vector paths (AVX2 instructions, which AVX-512 CPUs have).
QUIRE_AVX2 inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
QUIRE_AVX2 inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// (byte >> shift) & mask, for each byte
template <int kShift, int kMask>
QUIRE_AVX2 inline __m128i bits16(__m128i v) {
  return _mm_and_si128(kShift == 0 ? v : _mm_srli_epi16(v, kShift), _mm_set1_epi8(kMask));
}
template <int kShift, int kMask>
QUIRE_AVX2 inline __m256i bits32(__m256i v) {
  return _mm256_and_si256(kShift == 0 ? v : _mm256_srli_epi16(v, kShift), _mm256_set1_epi8(kMask));
}

// fn(std::integral_constant<int, I>) for I = 0 .. N-1, unrolled: element offsets in the decoders below are
// compile-time constants, so that a sink can keep per-offset accumulators in registers.
template <class Fn, int... I>
inline void static_for_impl(const Fn& fn, std::integer_sequence<int, I...>) {
  (fn(std::integral_constant<int, I>{}), ...);
}
template <int N, class Fn>
inline void static_for(const Fn& fn) {
  static_for_impl(fn, std::make_integer_sequence<int, N>{});
}

// Hands op(float(q)) for 16 (or 32) int8 values q, elements [E, E + 16) of a block, to the sink.
template <class V, int E, class Sink, class Op>
QUIRE_AVX2 inline void emit16(__m128i q, Sink& sink, const Op& op) {
  typename V::F f[16 / V::L];
  V::widen16(q, f);
  static_for<16 / V::L>([&](auto i) { sink.template put<E + decltype(i)::value * V::L>(op(f[decltype(i)::value])); });
}
template <class V, int E, class Sink, class Op>
QUIRE_AVX2 inline void emit32(__m256i q, Sink& sink, const Op& op) {
  emit16<V, E>(_mm256_castsi256_si128(q), sink, op);
  emit16<V, E + 16>(_mm256_extracti128_si256(q, 1), sink, op);
}
#endif

// ---- block decoders: decode<V>() hands a block's values, V::L at a time, to a sink (which stores them or
// multiplies them with x); decode_scalar() writes the first `count` of them with portable code (the scalar
// path, and INT8's last K % 64) ----

struct Q8_0 {
  static constexpr int kElements = 32, kBytes = 34;
  static void decode_scalar(const uint8_t* block, float, float* out, int count) {
    const float d = half_to_float(block);
    for (int e = 0; e < count; ++e) out[e] = d * static_cast<float>(static_cast<int8_t>(block[2 + e]));
  }
#ifdef QUIRE_QUANT_X86
  template <class V, class Sink>
  QUIRE_AVX2 static void decode(const uint8_t* block, float, Sink& sink) {
    const auto d = V::set1(V::half(block));
    emit32<V, 0>(load32(block + 2), sink, [&](typename V::F q) { return V::mul(q, d); });
  }
#endif
};

struct Q4_0 {
  static constexpr int kElements = 32, kBytes = 18;
  static void decode_scalar(const uint8_t* block, float, float* out, int count) {
    const float d = half_to_float(block);
    for (int e = 0; e < count; ++e) out[e] = d * static_cast<float>(((block[2 + e % 16] >> (e / 16 * 4)) & 15) - 8);
  }
#ifdef QUIRE_QUANT_X86
  template <class V, class Sink>
  QUIRE_AVX2 static void decode(const uint8_t* block, float, Sink& sink) {
    const auto d = V::set1(V::half(block));
    const auto op = [&](typename V::F q) { return V::mul(q, d); };
    const __m128i qs = load16(block + 2), eight = _mm_set1_epi8(8);
    emit16<V, 0>(_mm_sub_epi8(bits16<0, 15>(qs), eight), sink, op);
    emit16<V, 16>(_mm_sub_epi8(bits16<4, 15>(qs), eight), sink, op);
  }
#endif
};

struct Q4_1 {
  static constexpr int kElements = 32, kBytes = 20;
  static void decode_scalar(const uint8_t* block, float, float* out, int count) {
    const float d = half_to_float(block), m = half_to_float(block + 2);
    for (int e = 0; e < count; ++e) out[e] = d * static_cast<float>((block[4 + e % 16] >> (e / 16 * 4)) & 15) + m;
  }
#ifdef QUIRE_QUANT_X86
  template <class V, class Sink>
  QUIRE_AVX2 static void decode(const uint8_t* block, float, Sink& sink) {
    const auto d = V::set1(V::half(block)), m = V::set1(V::half(block + 2));
    const auto op = [&](typename V::F q) { return V::fmadd(q, d, m); };  // d*q is exact: one rounding
    const __m128i qs = load16(block + 4);
    emit16<V, 0>(bits16<0, 15>(qs), sink, op);
    emit16<V, 16>(bits16<4, 15>(qs), sink, op);
  }
#endif
};

struct Q4_K {
  static constexpr int kElements = 256, kBytes = 144;
  // d*sc and dmin*mn of the 8 sub-blocks of 32 (6-bit values packed in 12 bytes)
  static void scales(const uint8_t* block, float d, float dmin, float scale[8], float min[8]) {
    const uint8_t* s = block + 4;
    for (int j = 0; j < 4; ++j) {
      scale[j] = d * static_cast<float>(s[j] & 63);
      min[j] = dmin * static_cast<float>(s[j + 4] & 63);
      scale[j + 4] = d * static_cast<float>((s[j + 8] & 15) | ((s[j] >> 6) << 4));
      min[j + 4] = dmin * static_cast<float>((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
  }
  static void decode_scalar(const uint8_t* block, float, float* out, int count) {
    float scale[8], min[8];
    scales(block, half_to_float(block), half_to_float(block + 2), scale, min);
    for (int e = 0; e < count; ++e) {
      const int sub = e / 32, q = (block[16 + sub / 2 * 32 + e % 32] >> (sub % 2 * 4)) & 15;
      out[e] = scale[sub] * static_cast<float>(q) - min[sub];
    }
  }
#ifdef QUIRE_QUANT_X86
  template <class V, class Sink>
  QUIRE_AVX2 static void decode(const uint8_t* block, float, Sink& sink) {
    float scale[8], min[8];
    scales(block, V::half(block), V::half(block + 2), scale, min);
    static_for<4>([&](auto g) {  // 32 bytes: the low nibbles are sub-block 2g, the high ones 2g + 1
      constexpr int G = decltype(g)::value;
      const __m256i qs = load32(block + 16 + 32 * G);
      static_for<2>([&](auto h) {
        constexpr int H = decltype(h)::value;
        const auto sc = V::set1(scale[2 * G + H]), mn = V::set1(min[2 * G + H]);
        emit32<V, 64 * G + 32 * H>(bits32<4 * H, 15>(qs), sink,
                                    [&](typename V::F q) { return V::fmsub(q, sc, mn); });  // sc*q exact
      });
    });
  }
#endif
};

struct Q6_K {
  static constexpr int kElements = 256, kBytes = 210;
  static void decode_scalar(const uint8_t* block, float, float* out, int count) {
    const float d = half_to_float(block + 208);
    for (int e = 0; e < count; ++e) {
      const int half = e / 128, eh = e % 128;
      const int low = (block[64 * half + eh % 64] >> (eh / 64 * 4)) & 15;
      const int high = (block[128 + 32 * half + eh % 32] >> (eh / 32 * 2)) & 3;
      const float scale = d * static_cast<float>(static_cast<int8_t>(block[192 + e / 16]));
      out[e] = scale * static_cast<float>((low | high << 4) - 32);
    }
  }
#ifdef QUIRE_QUANT_X86
  template <class V, class Sink>
  QUIRE_AVX2 static void decode(const uint8_t* block, float, Sink& sink) {
    const float d = V::half(block + 208);
    const __m256i thirty_two = _mm256_set1_epi8(32);
    static_for<2>([&](auto half) {
      constexpr int Half = decltype(half)::value;
      const __m256i ql0 = load32(block + 64 * Half), ql1 = load32(block + 64 * Half + 32);
      const __m256i qh = load32(block + 128 + 32 * Half);
      // the 4 runs of 32 elements of this half: low 4 bits from ql0 / ql1 (low, then high nibbles), high 2
      // bits from bits 0-1, 2-3, 4-5, 6-7 of qh
      static_for<4>([&](auto run) {
        constexpr int Run = decltype(run)::value;
        const __m256i low = bits32<Run / 2 * 4, 15>(Run % 2 == 0 ? ql0 : ql1);
        const __m256i q = _mm256_or_si256(low, _mm256_slli_epi16(bits32<2 * Run, 3>(qh), 4));
        const __m256i centered = _mm256_sub_epi8(q, thirty_two);
        static_for<2>([&](auto part) {  // a scale per 16 elements
          constexpr int E = 128 * Half + 32 * Run + 16 * decltype(part)::value;
          const auto scale = V::set1(d * static_cast<float>(static_cast<int8_t>(block[192 + E / 16])));
          const __m128i bytes = E % 32 == 0 ? _mm256_castsi256_si128(centered) : _mm256_extracti128_si256(centered, 1);
          emit16<V, E>(bytes, sink, [&](typename V::F v) { return V::mul(v, scale); });
        });
      });
    });
  }
#endif
};

// Quire's INT8: any K; "blocks" of 64 elements for the loops, the last K % 64 decoded by decode_scalar.
struct Int8 {
  static constexpr int kElements = 64, kBytes = 64;
  static void decode_scalar(const uint8_t* block, float row_scale, float* out, int count) {
    for (int e = 0; e < count; ++e) out[e] = static_cast<float>(static_cast<int8_t>(block[e])) * row_scale;
  }
#ifdef QUIRE_QUANT_X86
  template <class V, class Sink>
  QUIRE_AVX2 static void decode(const uint8_t* block, float row_scale, Sink& sink) {
    const auto s = V::set1(row_scale);
    const auto op = [&](typename V::F q) { return V::mul(q, s); };
    emit32<V, 0>(load32(block), sink, op);
    emit32<V, 32>(load32(block + 32), sink, op);
  }
#endif
};

// A sink that stores the decoded values.
template <class V>
struct StoreSink {
  float* out;
  template <int E>
  void put(typename V::F v) { V::store(out + E, v); }
};

// Elements [k0, k1) of a weight row (k0 a multiple of the block size) into out.
template <class V, class Q>
inline void decode_row(const uint8_t* row, float row_scale, int64_t k0, int64_t k1, float* out) {
  const int64_t b0 = k0 / Q::kElements, b1 = k1 / Q::kElements;
  for (int64_t b = b0; b < b1; ++b) {
    float* block_out = out + (b - b0) * Q::kElements;
    if constexpr (std::is_same_v<V, Scalar>) {
      Q::decode_scalar(row + b * Q::kBytes, row_scale, block_out, Q::kElements);
    } else {
      StoreSink<V> sink{block_out};
      Q::template decode<V>(row + b * Q::kBytes, row_scale, sink);
    }
  }
  if (b1 * Q::kElements < k1)
    Q::decode_scalar(row + b1 * Q::kBytes, row_scale, out + (b1 - b0) * Q::kElements,
                     static_cast<int>(k1 - b1 * Q::kElements));
}

}  // namespace quire::quant
