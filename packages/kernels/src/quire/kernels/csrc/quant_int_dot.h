// Integer dot products for the quantized linear layers at batch 1 (quant_linear.cpp), on AVX-512 and AVX2: x
// is rounded to int16 per group of 32 elements, the weights are widened from their bytes to int16, and each
// group's dot product is one multiply-add of int16 pairs into int32 (vpmaddwd), converted to float and
// scaled once per group. Q4_0, Q4_1 and Q8_0 on AVX-512 VNNI go further, for batches of 1 to 8 rows (PairedX
// below), with each row's result bit-identical at every batch size.
//
// Why: widening every weight to float32 costs more instructions than reading its bytes. One Zen 4 core
// (cache-resident weights) went from 8.4 to 12-14 GB/s on Q4_1, 17 to 25 GB/s on Q8_0, 7-9 to 9-11 on the
// K-quants. Other batches of 2 and more stay on float32: there the per-row work of the int16 path (a
// conversion and a scaling per group and row) costs more than the float32 FMAs it replaces (0.8x at 4 rows);
// the VNNI path shares that work between two rows (Q4_1, K = 576, 3072 outputs: 5 rows cost about 2x one
// row there, 3x on float32).
//
// Error: x's group g is stored as round(x / s_g) with s_g = max|x in g| / 32639, so each element moves by at
// most s_g / 2 = max|x in g| / 65278 (and a float32 rounding); the weights and the integer sums are exact,
// the conversion of a sum to float32 and the scaling round once each. For x of even magnitudes that is below
// the error of float32 accumulation; elements much smaller than their group's largest move by more, relative
// to themselves. tests/kernels/test_quant_linear.py checks the sum of both bounds, with outliers in x.
// (int8 x, as llama.cpp rounds it, would move each element by up to 2^-8 of its group's largest.) A row of x
// holding an infinity or a NaN takes the float32 path, which gives PyTorch's results for it.
#pragma once

#include "quant_blocks.h"

#include <type_traits>

#ifdef QUIRE_QUANT_X86
namespace quire::quant {

// The largest |x| / s_g: 127 * 256 + 127, below int16's limit (a value would split into two signed bytes).
constexpr float kXMax = 32639.f;

// x [M, K] rounded per group of 32 elements (elements past the last group stay float); row m's groups start
// at group m * (K / 32).
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

// ---- Q4_0, Q4_1 and Q8_0 on AVX-512 VNNI, for batches of 1 to 8 rows: two blocks (A, B) at a time, whose
// nibbles (Q8_0: bytes) are widened to int16 once and multiplied with every row's int16 x by vpdpwssd (pairs
// of int16 products summed into int32 lanes, accumulating). Two rows share each vector, a quarter of a pair of
// blocks at a time:
//
//   weights   [ A 0-7   | B 0-7   | A 0-7   | B 0-7   ]  (then 8-15, 16-23, 24-31)
//   x         [ A 0-7   | B 0-7   | A 0-7   | B 0-7   ]
//               row i                row i + 1
//   int32     [ 4 lanes of A, row i | B, row i | A, row i + 1 | B, row i + 1 ]
//
// so that a row's 64 products take two instructions and its conversion to float, scaling per block and
// accumulation half of one each. An odd last row takes two halves of a pair at a time (weights A 0-7, B 0-7,
// A 8-15, B 8-15 against x in the same order) and adds the upper half of its int32 lanes to the lower: the
// same integer sums in the same lanes as if it had a twin.
// Every row goes through the same lanes in the same order whatever the batch, so a row's result is
// bit-identical alone or with up to 7 others (speculative decoding's greedy output must equal plain
// decoding's) ----

// NOTE: a lambda does not take its enclosing function's target: one that calls intrinsics names it too (else a
// build for a CPU without AVX-512, where this code is compiled but never run, fails to inline them).
#define QUIRE_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")))

// The rows of QuantizedX arranged for dot_pairs, by pairs of groups (blocks A, B) and quarters q of them; the
// quarter q of rows 2j and 2j + 1 (twins) together, so that they load as one vector. An odd last group is
// paired with zeros (scale and sum 0).
//
//   values [pairs][rows * 64] int16:  twins [rows / 2][4 quarters][2 rows][16], then an odd last row [4][16]
//   quarter q of a row:                A 8q .. 8q+7 | B 8q .. 8q+7
//   scale, sum [pairs][rows][2]:       A | B
struct PairedX {
  const int16_t* values;
  const float* scale;
  const float* sum;
  int64_t pairs;
};

// Arranges rows [0, rows) of x (rounded as QuantizedX describes, `groups` groups a row) into the buffers
// (sized as PairedX describes, pairs = (groups + 1) / 2).
inline void pair_x(const QuantizedX& x, int64_t rows, int64_t groups, int16_t* values, float* scale, float* sum) {
  const int64_t pairs = (groups + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const bool has_b = 2 * p + 1 < groups;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t a = r * groups + 2 * p, out = p * rows + r;
      const bool is_lone = r == rows - 1 && rows % 2 == 1;
      int16_t* first = values + p * rows * 64 + (is_lone ? r * 64 : r / 2 * 128 + r % 2 * 16);
      for (int q = 0; q < 4; ++q) {
        int16_t* quarter = first + q * (is_lone ? 16 : 32);
        std::memcpy(quarter, x.values + a * 32 + 8 * q, 16);
        if (has_b) {
          std::memcpy(quarter + 8, x.values + (a + 1) * 32 + 8 * q, 16);
        } else {
          std::memset(quarter + 8, 0, 16);
        }
      }
      scale[2 * out] = x.scale[a];
      scale[2 * out + 1] = has_b ? x.scale[a + 1] : 0.f;
      sum[2 * out] = x.sum[a];
      sum[2 * out + 1] = has_b ? x.sum[a + 1] : 0.f;
    }
  }
}

// The sum of a row's 8 lanes, in one order wherever the row's lanes are.
QUIRE_AVX2 inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One weight row (Q4_0, Q4_1 or Q8_0) against the MR rows of x: out[i] = row i's dot product.
template <class Q, int MR>
QUIRE_AVX512_VNNI inline void dot_pairs(const uint8_t* row, int64_t num_blocks, const PairedX& x, float* out) {
  static_assert(std::is_same_v<Q, Q4_0> || std::is_same_v<Q, Q4_1> || std::is_same_v<Q, Q8_0>);
  constexpr bool kIsQ8 = std::is_same_v<Q, Q8_0>;       // signed bytes, no offset
  constexpr int kQs = std::is_same_v<Q, Q4_1> ? 4 : 2;  // where the nibbles (Q8_0: bytes) start in a block
  constexpr int kTwins = MR / 2;                        // vectors holding two rows
  constexpr bool kHasLone = MR % 2 == 1;                // and the last row alone
  const __mmask16 row_lanes = static_cast<__mmask16>((1u << (2 * MR)) - 1);
  constexpr bool kIsNarrow = MR <= 2;  // the rows' [A, B] scales fit 128 bits
  // the lanes of `scales` (row r's blocks A, B at 2r, 2r + 1) each int32 lane of a twin needs
  const __m512i lane_scale = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i nibble = _mm512_set1_epi16(15);
  __m512 twin[kTwins > 0 ? kTwins : 1], offset = _mm512_setzero_ps();
  __m128 narrow_offset = _mm_setzero_ps();
  __m256 lone = _mm256_setzero_ps();
  static_for<kTwins>([&](auto j) QUIRE_AVX512_VNNI { twin[decltype(j)::value] = _mm512_setzero_ps(); });
  const int16_t* values = x.values;
  const float* x_scale = x.scale;
  const float* x_sum = x.sum;
  for (int64_t p = 0; p < x.pairs; ++p) {
    const uint8_t* a = row + 2 * p * Q::kBytes;
    const uint8_t* b = 2 * p + 1 < num_blocks ? a + Q::kBytes : a;  // an odd last block meets zeros as B
    // w_low: A 0-7, B 0-7, A 8-15, B 8-15 as int16; w_high: the same of elements 16-31
    __m512i w_low, w_high;
    if constexpr (kIsQ8) {
      const __m512i w_a = _mm512_cvtepi8_epi16(load32(a + kQs)), w_b = _mm512_cvtepi8_epi16(load32(b + kQs));
      w_low = _mm512_permutex2var_epi64(w_a, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), w_b);
      w_high = _mm512_permutex2var_epi64(w_a, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), w_b);
    } else {  // the low nibbles are elements 0-15, the high ones 16-31
      const __m256i qs = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(a + kQs)), load16(b + kQs), 1);
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_permute4x64_epi64(qs, _MM_SHUFFLE(3, 1, 2, 0)));
      w_low = _mm512_and_si512(bytes, nibble);
      w_high = _mm512_srli_epi16(bytes, 4);
    }
    // each quarter for two rows
    const __m512i w_twin[4] = {_mm512_shuffle_i64x2(w_low, w_low, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_i64x2(w_low, w_low, _MM_SHUFFLE(3, 2, 3, 2)),
                               _mm512_shuffle_i64x2(w_high, w_high, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_i64x2(w_high, w_high, _MM_SHUFFLE(3, 2, 3, 2))};
    // [d_A, d_B] and the offsets [m_A, m_B] (Q4_1), [-8 d_A, -8 d_B] (Q4_0: its nibbles are q + 8), none (Q8_0)
    __m128 d, m = _mm_setzero_ps();
    if constexpr (std::is_same_v<Q, Q4_1>) {
      uint32_t dm_a, dm_b;
      std::memcpy(&dm_a, a, 4);
      std::memcpy(&dm_b, b, 4);
      const __m128 f = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(static_cast<int>(dm_a)), dm_b, 1));
      d = _mm_shuffle_ps(f, f, _MM_SHUFFLE(3, 1, 2, 0));  // d_A d_B m_A m_B
      m = _mm_movehl_ps(d, d);
    } else {
      d = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u16(a) | uint32_t{load_u16(b)} << 16)));
      if constexpr (!kIsQ8) m = _mm_mul_ps(d, _mm_set1_ps(-8.f));
    }
    // [d_A, d_B] and [m_A, m_B] for every row, times its s_g and its groups' sums (lanes past the rows' are
    // never read)
    __m512 scales;
    if constexpr (kIsNarrow) {
      const __m128 s = MR == 1 ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x_scale + 2 * p)))
                               : _mm_loadu_ps(x_scale + 4 * p);
      const __m128 sums = MR == 1 ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x_sum + 2 * p)))
                                  : _mm_loadu_ps(x_sum + 4 * p);
      scales = _mm512_castps128_ps512(_mm_mul_ps(_mm_movelh_ps(d, d), s));
      if constexpr (!kIsQ8) narrow_offset = _mm_fmadd_ps(_mm_movelh_ps(m, m), sums, narrow_offset);
    } else {
      const __m512 d_rows = _mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_castps_pd(d)));
      const __m512 m_rows = _mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_castps_pd(m)));
      scales = _mm512_mul_ps(d_rows, _mm512_maskz_loadu_ps(row_lanes, x_scale + 2 * MR * p));
      if constexpr (!kIsQ8) {
        offset = _mm512_fmadd_ps(m_rows, _mm512_maskz_loadu_ps(row_lanes, x_sum + 2 * MR * p), offset);
      }
    }
    const int16_t* quarters = values + 64 * MR * p;
    static_for<kTwins>([&](auto j) QUIRE_AVX512_VNNI {
      constexpr int J = decltype(j)::value;
      __m512i sums = _mm512_setzero_si512();
      static_for<4>([&](auto q) QUIRE_AVX512_VNNI {
        constexpr int Q4 = decltype(q)::value;
        sums = _mm512_dpwssd_epi32(sums, w_twin[Q4], _mm512_loadu_si512(quarters + 128 * J + 32 * Q4));
      });
      const __m512 row_scales = _mm512_permutexvar_ps(_mm512_add_epi32(lane_scale, _mm512_set1_epi32(4 * J)), scales);
      twin[J] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), row_scales, twin[J]);
    });
    if constexpr (kHasLone) {
      const int16_t* last = quarters + 128 * kTwins;
      __m512i sums = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w_low, _mm512_loadu_si512(last));
      sums = _mm512_dpwssd_epi32(sums, w_high, _mm512_loadu_si512(last + 32));
      const __m256i folded = _mm256_add_epi32(_mm512_castsi512_si256(sums), _mm512_extracti64x4_epi64(sums, 1));
      const __m512i lanes = _mm512_add_epi32(lane_scale, _mm512_set1_epi32(2 * (MR - 1)));
      __m256 row_scales;
      if constexpr (MR <= 4) {  // its scales are in the lower 256 bits
        row_scales = _mm256_permutexvar_ps(_mm512_castsi512_si256(lanes), _mm512_castps512_ps256(scales));
      } else {
        row_scales = _mm512_castps512_ps256(_mm512_permutexvar_ps(lanes, scales));
      }
      lone = _mm256_fmadd_ps(_mm256_cvtepi32_ps(folded), row_scales, lone);
    }
  }
  alignas(64) float offsets[16];
  _mm512_store_ps(offsets, offset);
  if constexpr (kIsNarrow) _mm_store_ps(offsets, narrow_offset);
  static_for<kTwins>([&](auto j) QUIRE_AVX512_VNNI {
    constexpr int J = decltype(j)::value;
    out[2 * J] = sum_lanes(_mm512_castps512_ps256(twin[J]));
    out[2 * J + 1] = sum_lanes(_mm512_extractf32x8_ps(twin[J], 1));
  });
  if constexpr (kHasLone) out[MR - 1] = sum_lanes(lone);
  if constexpr (!kIsQ8) {
    for (int i = 0; i < MR; ++i) out[i] += offsets[2 * i] + offsets[2 * i + 1];
  }
}

}  // namespace quire::quant
#endif
