// Integer dot products for the quantized linear layers at batch 1 (quant_linear.cpp), on AVX-512 and AVX2: x
// is rounded to int16 per group of 32 elements, the weights are widened from their bytes to int16, and each
// group's dot product is one multiply-add of int16 pairs into int32 (vpmaddwd), converted to float and
// scaled once per group. Q4_0 and Q4_1 on AVX-512 VNNI go further (PairedX below).
//
// Why: widening every weight to float32 costs more instructions than reading its bytes. One Zen 4 core
// (cache-resident weights) went from 8.4 to 12-14 GB/s on Q4_1, 17 to 25 GB/s on Q8_0, 7-9 to 9-11 on the
// K-quants. Batches of 2 and more stay on float32: there the per-row work of this path (a conversion and a
// scaling per group and row) costs more than the float32 FMAs it replaces (0.8x at 4 rows).
//
// Error: x's group g is stored as round(x / s_g) with s_g = max|x in g| / 32639, so each element moves by at
// most s_g / 2 = max|x in g| / 65278 (and a float32 rounding); the weights and the integer sums are exact,
// the conversion of a sum to float32 and the scaling round once each. For x of even magnitudes that is below
// the error of float32 accumulation; elements much smaller than their group's largest move by more, relative
// to themselves. tests/kernels/test_quant_linear.py checks the sum of both bounds, with outliers in x.
// (int8 x, as llama.cpp rounds it, would move each element by up to 2^-8 of its group's largest.) An x
// holding an infinity or a NaN takes the float32 path, which gives PyTorch's results for it.
#pragma once

#include "quant_blocks.h"

#include <type_traits>

#ifdef QUIRE_QUANT_X86
namespace quire::quant {

// The largest |x| / s_g: 127 * 256 + 127, so that a value splits into two signed bytes (PairedX).
constexpr float kXMax = 32639.f;

// x [1, K] rounded per group of 32 elements (elements past the last group stay float).
struct QuantizedX {
  const int16_t* values;  // [groups * 32]
  const float* scale;     // [groups]: s_g
  const float* sum;       // [groups]: the float32 sum of the group's elements (for the weights' offsets)
};

// Rounds rows [0, M) of x into the buffers (sized as QuantizedX describes); false when x holds an infinity or
// a NaN (the buffers are then partly written).
QUIRE_AVX512 inline bool quantize_x_avx512(const float* x, int64_t M, int64_t K, int16_t* values, float* scale,
                                           float* sum) {
  const int64_t groups = K / 32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* in = x + m * K + g * 32;
      const __m512 a = _mm512_loadu_ps(in), b = _mm512_loadu_ps(in + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      // NOTE: max_ps returns its second operand when either is NaN, so a NaN would be dropped from amax
      if (!(amax <= 3.4028235e38f) || _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) != 0) return false;
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? kXMax / amax : 0.f);
      int16_t* out = values + (m * groups + g) * 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv))));
      scale[m * groups + g] = amax / kXMax;
      sum[m * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
  }
  return true;
}

QUIRE_AVX2 inline bool quantize_x_avx2(const float* x, int64_t M, int64_t K, int16_t* values, float* scale,
                                       float* sum) {
  const int64_t groups = K / 32;
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* in = x + m * K + g * 32;
      __m256 v[4], vmax = _mm256_setzero_ps(), vsum = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(in + 8 * i);
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v[i]));
        vsum = _mm256_add_ps(vsum, v[i]);
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
      // NOTE: as on AVX-512, a NaN is checked separately
      __m256 nan = _mm256_cmp_ps(v[0], v[1], _CMP_UNORD_Q);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[2], v[3], _CMP_UNORD_Q));
      if (!(amax <= 3.4028235e38f) || _mm256_movemask_ps(nan) != 0) return false;
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? kXMax / amax : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      // packs interleave the 128-bit lanes: 0-3 8-11 4-7 12-15; the permute puts them back in order
      int16_t* out = values + (m * groups + g) * 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      scale[m * groups + g] = amax / kXMax;
      sum[m * groups + g] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    }
  }
  return true;
}

// ---- a group of 32 weights as int16, and its dot product with 32 int16 x values (as float), per ISA ----

template <class V>
struct Int16Ops;

template <>
struct Int16Ops<Avx512> {
  using W = __m512i;
  QUIRE_AVX512 static W widen(__m256i bytes) { return _mm512_cvtepi8_epi16(bytes); }
  // elements 0-15 times m0, 16-31 times m1
  QUIRE_AVX512 static W scale_halves(W w, int16_t m0, int16_t m1) {
    return _mm512_mullo_epi16(w, _mm512_inserti64x4(_mm512_set1_epi16(m0), _mm256_set1_epi16(m1), 1));
  }
  QUIRE_AVX512 static __m512 dot(W w, const int16_t* x) {
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(x)));
  }
};

template <>
struct Int16Ops<Avx2> {
  struct W {
    __m256i lo, hi;
  };
  QUIRE_AVX2 static W widen(__m256i bytes) {
    return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(bytes)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(bytes, 1))};
  }
  QUIRE_AVX2 static W scale_halves(W w, int16_t m0, int16_t m1) {
    return {_mm256_mullo_epi16(w.lo, _mm256_set1_epi16(m0)), _mm256_mullo_epi16(w.hi, _mm256_set1_epi16(m1))};
  }
  QUIRE_AVX2 static __m256 dot(W w, const int16_t* x) {
    const __m256i lo = _mm256_madd_epi16(w.lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    const __m256i hi = _mm256_madd_epi16(w.hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
  }
};

// ---- the blocks as groups of 32 signed bytes: IntGroups<Q>::decode hands each group G of a block to the sink
// as sink.group<G>(bytes, scale) (weights = scale * bytes), sink.group_offset<G>(bytes, scale, offset)
// (scale * bytes + offset) or, for Q6_K, sink.group_scaled<G>(bytes, m0, m1, scale) (scale * bytes * m, m0
// for the first 16 and m1 for the last) ----

template <class Q>
struct IntGroups;

template <>
struct IntGroups<Q8_0> {
  template <class Sink>
  QUIRE_AVX2 static void decode(const uint8_t* block, float, Sink& sink) {
    sink.template group<0>(load32(block + 2), _cvtsh_ss(load_u16(block)));
  }
};

template <>
struct IntGroups<Q4_0> {
  template <class Sink>
  QUIRE_AVX2 static void decode(const uint8_t* block, float, Sink& sink) {
    const __m128i qs = load16(block + 2);
    const __m256i q = _mm256_set_m128i(bits16<4, 15>(qs), bits16<0, 15>(qs));
    sink.template group<0>(_mm256_sub_epi8(q, _mm256_set1_epi8(8)), _cvtsh_ss(load_u16(block)));
  }
};

template <>
struct IntGroups<Q4_1> {
  template <class Sink>
  QUIRE_AVX2 static void decode(const uint8_t* block, float, Sink& sink) {
    const __m128i qs = load16(block + 4);
    uint32_t dm;  // d and m, converted together
    std::memcpy(&dm, block, sizeof(dm));
    const __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));
    sink.template group_offset<0>(_mm256_set_m128i(bits16<4, 15>(qs), bits16<0, 15>(qs)), _mm_cvtss_f32(scales),
                                  _mm_cvtss_f32(_mm_movehdup_ps(scales)));
  }
};

template <>
struct IntGroups<Q4_K> {
  template <class Sink>
  QUIRE_AVX2 static void decode(const uint8_t* block, float, Sink& sink) {
    float scale[8], min[8];
    Q4_K::scales(block, _cvtsh_ss(load_u16(block)), _cvtsh_ss(load_u16(block + 2)), scale, min);
    static_for<4>([&](auto g) {  // 32 bytes: the low nibbles are sub-block 2g, the high ones 2g + 1
      constexpr int G = decltype(g)::value;
      const __m256i qs = load32(block + 16 + 32 * G);
      sink.template group_offset<2 * G>(bits32<0, 15>(qs), scale[2 * G], -min[2 * G]);
      sink.template group_offset<2 * G + 1>(bits32<4, 15>(qs), scale[2 * G + 1], -min[2 * G + 1]);
    });
  }
};

template <>
struct IntGroups<Q6_K> {
  template <class Sink>
  QUIRE_AVX2 static void decode(const uint8_t* block, float, Sink& sink) {
    const float d = _cvtsh_ss(load_u16(block + 208));
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    static_for<2>([&](auto half) {  // the bit layout as in Q6_K::decode
      constexpr int Half = decltype(half)::value;
      const __m256i ql0 = load32(block + 64 * Half), ql1 = load32(block + 64 * Half + 32);
      const __m256i qh = load32(block + 128 + 32 * Half);
      static_for<4>([&](auto run) {
        constexpr int Run = decltype(run)::value, G = 4 * Half + Run;
        const __m256i low = bits32<Run / 2 * 4, 15>(Run % 2 == 0 ? ql0 : ql1);
        const __m256i q = _mm256_or_si256(low, _mm256_slli_epi16(bits32<2 * Run, 3>(qh), 4));
        sink.template group_scaled<G>(_mm256_sub_epi8(q, _mm256_set1_epi8(32)), scales[2 * G], scales[2 * G + 1], d);
      });
    });
  }
};

template <>
struct IntGroups<Int8> {
  template <class Sink>
  QUIRE_AVX2 static void decode(const uint8_t* block, float row_scale, Sink& sink) {
    sink.template group<0>(load32(block), row_scale);
    sink.template group<1>(load32(block + 32), row_scale);
  }
};

// Multiplies the groups of one weight row with the one row of quantized x (at the current block: groups from
// `first`): acc += dot * scale * s_g in a vector, offset += offset * sum_g in a float. (x's pointers are
// copied in: through a reference the compiler reloads them after every store.)
template <class V>
struct IntDotSink {
  using Ops = Int16Ops<V>;
  const int16_t* values;
  const float* scale;
  const float* sum;
  int64_t first = 0;
  typename V::F acc = V::zero();
  float offset = 0.f;

  explicit IntDotSink(const QuantizedX& x) : values(x.values), scale(x.scale), sum(x.sum) {}
  template <int G>
  void group(__m256i bytes, float group_scale) {
    add<G>(Ops::widen(bytes), group_scale);
  }
  template <int G>
  void group_offset(__m256i bytes, float group_scale, float group_offset) {
    add<G>(Ops::widen(bytes), group_scale);
    offset += group_offset * sum[first + G];
  }
  template <int G>
  void group_scaled(__m256i bytes, int16_t m0, int16_t m1, float group_scale) {
    add<G>(Ops::scale_halves(Ops::widen(bytes), m0, m1), group_scale);
  }
  template <int G>
  void add(typename Ops::W w, float group_scale) {
    const int64_t g = first + G;
    acc = V::fmadd(Ops::dot(w, values + g * 32), V::set1(group_scale * scale[g]), acc);
  }
};

// ---- Q4_0 and Q4_1 on AVX-512 VNNI: two blocks at a time, with vpdpbusd (unsigned bytes times signed
// bytes, four products to an int32 lane) on the weights' nibbles as they are, and x's int16 values split
// into two signed bytes (value = 256 * high + low): two instructions for 64 products, against vpmovsxbw and
// vpmaddwd for each 32 on the int16 path ----

#define QUIRE_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

// QuantizedX's values for pairs of groups (blocks A, B) as bytes in the order of the weights' nibbles:
// A 0-15, B 0-15 (the low nibbles), A 16-31, B 16-31 (the high ones).
struct PairedX {
  const int8_t* high;  // [pairs * 64]
  const int8_t* low;
  int64_t pairs;
};

QUIRE_AVX512 inline void pair_x_avx512(const int16_t* values, int64_t pairs, int8_t* high, int8_t* low) {
  const auto split = [](__m512i v, __m256i& h, __m256i& l) {
    const __m512i lo16 = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);  // the low byte, signed
    h = _mm512_cvtepi16_epi8(_mm512_srai_epi16(_mm512_sub_epi16(v, lo16), 8));
    l = _mm512_cvtepi16_epi8(lo16);
  };
  const auto order = [](__m256i a, __m256i b) {  // 128-bit lanes a0 a1 b0 b1 -> a0 b0 a1 b1
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
  };
  for (int64_t p = 0; p < pairs; ++p) {
    __m256i ah, al, bh, bl;
    split(_mm512_loadu_si512(values + 64 * p), ah, al);
    split(_mm512_loadu_si512(values + 64 * p + 32), bh, bl);
    _mm512_storeu_si512(high + 64 * p, order(ah, bh));
    _mm512_storeu_si512(low + 64 * p, order(al, bl));
  }
}

// One weight row (Q4_0 or Q4_1) against x: acc += the products of each pair of blocks, scaled per block;
// offset (lanes 0, 1) += the blocks' offsets times the groups' sums.
template <class Q>
QUIRE_AVX512_VNNI inline void dot_pairs(const uint8_t* row, const PairedX& px, const QuantizedX& x, __m512& acc0,
                                        __m512& acc1, __m128& offset) {
  static_assert(std::is_same_v<Q, Q4_0> || std::is_same_v<Q, Q4_1>);
  constexpr int kQs = std::is_same_v<Q, Q4_1> ? 4 : 2;  // where the nibbles start in a block
  // the lane of each int32 product sum: lanes 0-3 and 8-11 are block A's, 4-7 and 12-15 block B's
  const __m512i lane_block = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m256i nibble = _mm256_set1_epi8(15);
  const auto step = [&](int64_t p, __m512& acc) {
    const uint8_t* a = row + 2 * p * Q::kBytes;
    const uint8_t* b = a + Q::kBytes;
    const __m256i qs = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(a + kQs)), load16(b + kQs), 1);
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(qs, nibble)),
                                         _mm256_and_si256(_mm256_srli_epi16(qs, 4), nibble), 1);
    const __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(px.high + 64 * p));
    const __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(px.low + 64 * p));
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 8), l));
    // [d_A, d_B] and the offsets [m_A, m_B] (Q4_1), [-8 d_A, -8 d_B] (Q4_0: its nibbles are q + 8)
    __m128 d, m;
    if constexpr (std::is_same_v<Q, Q4_1>) {
      uint32_t dm_a, dm_b;
      std::memcpy(&dm_a, a, 4);
      std::memcpy(&dm_b, b, 4);
      const __m128 f = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(static_cast<int>(dm_a)), dm_b, 1));
      d = _mm_shuffle_ps(f, f, _MM_SHUFFLE(3, 1, 2, 0));  // d_A d_B m_A m_B
      m = _mm_movehl_ps(d, d);
    } else {
      d = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u16(a) | uint32_t{load_u16(b)} << 16)));
      m = _mm_mul_ps(d, _mm_set1_ps(-8.f));
    }
    const __m128 sx = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x.scale + 2 * p)));
    const __m128 sums = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x.sum + 2 * p)));
    acc = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(_mm_mul_ps(d, sx))), acc);
    offset = _mm_fmadd_ps(m, sums, offset);  // lanes 2, 3 of sums are zero
  };
  int64_t p = 0;
  for (; p + 1 < px.pairs; p += 2) {
    step(p, acc0);
    step(p + 1, acc1);
  }
  if (p < px.pairs) step(p, acc0);
}

}  // namespace quire::quant
#endif
