// Causal attention of whole prompts over their own keys (no cached prefix): bfloat16 on AMX tiles where the CPU
// has them, float32 on AVX2 FMA elsewhere (the second path is described further down).
//
// PyTorch's CPU flash attention spends most of a short prompt's time outside its matrix products (a
// 128-token prompt of 9 heads: ~100 us a layer for ~40 MFLOP) and reaches ~480 GFLOP/s on a 2,048-token
// one. Here one call takes every whole prompt of a step (one parallel region), and one work item is one
// prompt's query head and 16 query rows; it walks the keys up to the diagonal 32 at a time, everything
// transposed (keys x rows), so that a vector holds one key's score for all 16 rows:
//
//   scores  S^T[32 x 16] = K[32 x D] . Q^T[D x 16]      two tiles; Q^T built per item as bfloat16 pairs
//   online softmax (float32, whole vectors, no sums across lanes): maxima, exp(scale * (S - max)), sums
//   output  O^T[D x 16] += V^T[D x 32] . P^T[32 x 16]   P rounded to bfloat16 (as PyTorch's kernel rounds it)
//
// K and V are first repacked once per call (per prompt and KV head: K rows [Tk][D], V^T per 32-key block
// [D][32], zero past the prompt). Sums are float32 throughout; the output is O / sum rounded to bfloat16 once.
//
// On AVX2 machines PyTorch's kernel runs at 30-80 GFLOP/s (128- to 2,048-token prompts of 9 heads on two Zen 3
// cores), against ~125 for a large float32 matrix product.
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "bf16.h"
#include "kernels.h"
#include "parallel.h"

namespace {

// One prompt of the call: rows start .. start + length of query, key, value and out; its keys and values
// repacked at `packed` (in elements): per KV head, Tk = length rounded up to 32 rows, zero past the prompt
// (AMX: keys [Tk][D] and values [Tk / 32][D][32], each 32-key block transposed; AVX2: keys [Tk / 8][D][8]
// and values [Tk][D]).
struct Prompt {
  int64_t start, length, packed;
};

// What both paths read: bfloat16 rows (heads and dims dense within a row) and the prompts' ranges.
struct Call {
  const uint16_t *query, *key, *value;
  int64_t q_stride, k_stride, v_stride;  // elements from one row to the next
  int64_t Hq, Hk, D;
  float scale;
  uint16_t* out;  // [T][Hq][D]
  std::vector<Prompt> prompts;
  int64_t packed_size;  // elements of one repacked copy of all the prompts' keys (or values)
};

// One task per prompt, query head and `rows` query rows; the longest (the last blocks of the longest prompts)
// first, so that the short ones even out the threads at the end.
std::vector<std::array<int64_t, 3>> work_items(const Call& call, int64_t rows) {
  int64_t max_blocks = 0;
  for (const Prompt& prompt : call.prompts) max_blocks = std::max(max_blocks, (prompt.length + rows - 1) / rows);
  std::vector<std::array<int64_t, 3>> work;  // prompt, head, block
  for (int64_t block = max_blocks - 1; block >= 0; --block)
    for (int64_t p = 0; p < static_cast<int64_t>(call.prompts.size()); ++p)
      if (block * rows < call.prompts[p].length)
        for (int64_t h = 0; h < call.Hq; ++h) work.push_back({p, h, block});
  return work;
}

// The repacking tasks: one prompt, KV head and 32 keys each (~1 us: a few are not worth waking a thread for).
template <typename F>
void repack(const Call& call, const F& pack_block) {
  std::vector<std::array<int64_t, 3>> packing;  // prompt, KV head, first key
  for (int64_t p = 0; p < static_cast<int64_t>(call.prompts.size()); ++p)
    for (int64_t g = 0; g < call.Hk; ++g)
      for (int64_t k0 = 0; k0 < call.prompts[p].length; k0 += 32) packing.push_back({p, g, k0});
  const int64_t tasks = packing.size();
  quire::parallel_chunks(0, tasks, quire::chunk_size(tasks, 16), [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const auto [p, g, k0] = packing[index];
      pack_block(call.prompts[p], g, k0);
    }
  });
}

}  // namespace

#ifdef QUIRE_AMX

namespace {

constexpr int64_t kRows = 16;  // query rows per item
constexpr int64_t kKeys = 32;  // keys per step

// e^x for the lanes of x (scores minus their maximum, so x <= 0): Cody-Waite reduction to |r| <= ln2/2 and a
// degree-6 Taylor polynomial (relative error ~1e-7, below float32's rounding of the scores that feed it; the
// probabilities are rounded to bfloat16 after). Below -87 (and -inf: masked keys) 0; NaN stays NaN.
inline __m512 exp_lanes(__m512 x) {
  const __m512 clamped = _mm512_max_ps(_mm512_set1_ps(-87.f), x);  // NaN in x passes through
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_NLT_UQ);
  return _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(p, n));
}

// r[j] = column j of the 16 x 16 matrix of 32-bit values whose rows r held.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int b = 0; b < 16; b += 4) {
    u[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
    u[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
    u[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
    u[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
  }
  for (int b = 0; b < 16; b += 8) {
    for (int j = 0; j < 4; ++j) {
      t[b + j] = _mm512_shuffle_i32x4(u[b + j], u[b + 4 + j], 0x88);
      t[b + 4 + j] = _mm512_shuffle_i32x4(u[b + j], u[b + 4 + j], 0xDD);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xDD);
  }
}

// One item: query head h, rows r0 .. r0 + 15 (those past T are computed from zero rows and dropped). Everything
// is transposed, keys x queries: a vector then holds one key's score for the 16 rows, so the softmax needs no
// sums across lanes.
void attend_rows(const uint16_t* query, int64_t q_stride, const uint16_t* keys, const uint16_t* values, int64_t T,
                 int64_t D, int64_t r0, float scale, uint16_t* out, int64_t out_stride) {
  alignas(64) uint32_t q_pairs[128 * kRows];      // Q^T as pairs: [D / 2][16 rows]
  alignas(64) float scores[kKeys * kRows];        // S^T: [32 keys][16 rows]
  alignas(64) uint32_t probs[kKeys / 2 * kRows];  // P^T as pairs: [16 key pairs][16 rows]
  alignas(64) float acc[256 * kRows];             // O^T: [D][16 rows]
  const int64_t rows = std::min(kRows, T - r0);
  for (int64_t c = 0; c < D / 32; ++c) {  // 16 pairs of each row, transposed
    __m512i block[16];
    for (int64_t r = 0; r < kRows; ++r)
      block[r] = r < rows ? _mm512_loadu_si512(query + (r0 + r) * q_stride + c * 32) : _mm512_setzero_si512();
    transpose16(block);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(q_pairs + (c * 16 + p) * kRows, block[p]);
  }
  std::fill(acc, acc + D * kRows, 0.f);
  const int64_t last = r0 + rows - 1;  // the last key any row of the item sees
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 maxima = minus_inf, sums = _mm512_setzero_ps();
  // interleaves two keys' 16 bfloat16 probabilities (low and high half) into 16 pairs
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t k0 = 0; k0 <= last; k0 += kKeys) {
    // S^T = K . Q^T for keys k0 .. k0 + 31: tiles 0 and 1 (16 keys each); keys in 2 and 3, queries in 4
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < D / 32; ++c) {
      _tile_loadd(2, keys + k0 * D + c * 32, D * 2);
      _tile_loadd(3, keys + (k0 + 16) * D + c * 32, D * 2);
      _tile_loadd(4, q_pairs + c * 16 * kRows, 64);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 4);
    }
    _tile_stored(0, scores, 64);
    _tile_stored(1, scores + 16 * kRows, 64);
    // online softmax over the rows (lanes): key k0 + j is visible to rows r0 + lane >= k0 + j
    __m512 s[kKeys];
    __m512 step_max = minus_inf;
    for (int64_t j = 0; j < kKeys; ++j) {
      const int64_t hidden = std::clamp<int64_t>(k0 + j - r0, 0, kRows);  // lanes below this do not see key j
      s[j] = _mm512_mask_load_ps(minus_inf, static_cast<__mmask16>(0xFFFFu << hidden), scores + j * kRows);
      step_max = _mm512_max_ps(step_max, s[j]);
    }
    // maxima are of the unscaled scores (scale > 0); weights are exp(scale * (s - max))
    const __m512 new_max = _mm512_max_ps(maxima, step_max);
    // rows that have seen no key yet keep -inf: subtract 0 there, so that their weights come out 0, not NaN
    const __m512 base = _mm512_mask_mov_ps(new_max, _mm512_cmp_ps_mask(new_max, minus_inf, _CMP_EQ_OQ),
                                           _mm512_setzero_ps());
    const __m512 scaled_base = _mm512_mul_ps(base, scale_v);
    const __m512 alpha = exp_lanes(_mm512_fmsub_ps(maxima, scale_v, scaled_base));
    maxima = new_max;
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < kKeys; j += 2) {
      const __m512 p0 = exp_lanes(_mm512_fmsub_ps(s[j], scale_v, scaled_base));
      const __m512 p1 = exp_lanes(_mm512_fmsub_ps(s[j + 1], scale_v, scaled_base));
      total = _mm512_add_ps(total, _mm512_add_ps(p0, p1));
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // p0's 16 low, p1's 16 high
      _mm512_store_si512(probs + (j / 2) * kRows, _mm512_permutexvar_epi16(interleave, both));
    }
    sums = _mm512_fmadd_ps(sums, alpha, total);
    if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ) != 0) {
      for (int64_t d = 0; d < D; ++d)
        _mm512_store_ps(acc + d * kRows, _mm512_mul_ps(alpha, _mm512_load_ps(acc + d * kRows)));
    }
    // O^T += V^T . P^T: P^T in tile 4; four 16-row slices of O^T at a time in tiles 0-3, V^T slices in 5-7 and 2
    _tile_loadd(4, probs, 64);
    const uint16_t* v_block = values + (k0 / kKeys) * D * kKeys;
    for (int64_t e = 0; e < D / 16; e += 4) {
      float* o = acc + e * 16 * kRows;
      const uint16_t* v = v_block + e * 16 * kKeys;
      const int64_t slices = std::min<int64_t>(4, D / 16 - e);
      _tile_loadd(0, o, 64);
      _tile_loadd(5, v, 64);
      _tile_dpbf16ps(0, 5, 4);
      if (slices > 1) { _tile_loadd(1, o + 256, 64); _tile_loadd(6, v + 16 * kKeys, 64); _tile_dpbf16ps(1, 6, 4); }
      if (slices > 2) { _tile_loadd(2, o + 512, 64); _tile_loadd(7, v + 32 * kKeys, 64); _tile_dpbf16ps(2, 7, 4); }
      if (slices > 3) { _tile_loadd(3, o + 768, 64); _tile_loadd(5, v + 48 * kKeys, 64); _tile_dpbf16ps(3, 5, 4); }
      _tile_stored(0, o, 64);
      if (slices > 1) _tile_stored(1, o + 256, 64);
      if (slices > 2) _tile_stored(2, o + 512, 64);
      if (slices > 3) _tile_stored(3, o + 768, 64);
    }
  }
  alignas(64) float inverse[kRows];
  _mm512_store_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.f), sums));
  for (int64_t d0 = 0; d0 < D; d0 += 16) {  // O^T's 16 x 16 blocks back to rows
    __m512i block[16];
    for (int i = 0; i < 16; ++i) block[i] = _mm512_load_si512(acc + (d0 + i) * kRows);
    transpose16(block);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 row = _mm512_mul_ps(_mm512_castsi512_ps(block[r]), _mm512_set1_ps(inverse[r]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r0 + r) * out_stride + d0),
                          (__m256i)_mm512_cvtneps_pbh(row));
    }
  }
}

}  // namespace
#endif  // QUIRE_AMX

#if defined(__AVX2__) && defined(__FMA__)
#define QUIRE_AVX2_ATTENTION 1
#include <immintrin.h>

// The same attention for CPUs without AMX (or where Linux withholds it), in float32 on AVX2 FMA: keys and values
// widened to float32 once per call (exact), rows of scores with keys along the lanes. One item is 12 query rows,
// two tiles of 6; each tile walks its keys up to its last row in blocks of 512:
//
//   scores  S[6 x 16] = Q[6 x D] . K^T[D x 16]   per 16 keys; 12 accumulators, K^T packed [keys / 8][D][8]
//   softmax per row (float32): S * scale, masked, the maximum over the block and the blocks before it,
//           exp(S * scale - max), sums; P rounded to bfloat16 precision
//   output  O[6 x 16] = alpha O + P[6 x keys] . V[keys x 16]   for each 16 of D; V as float32 rows [keys][D]
//
// This is the order of PyTorch's own CPU kernel (blocks of 512 keys, the maximum of the scaled scores, P in
// bfloat16, O times 1 / sum), so that the two agree as closely as float32 sums in another order allow: models
// whose greedy choices sit on near-ties in bfloat16 then pick what transformers picks as often as before.
namespace {
namespace avx2 {

constexpr int64_t kTile = 6;           // query rows per register tile
constexpr int64_t kRows = 2 * kTile;   // query rows per item
constexpr int64_t kKeys = 32;          // keys per repacking task (prompts' keys padded to a multiple)
constexpr int64_t kBlock = 512;        // keys per softmax block, as PyTorch's kernel takes them
constexpr int64_t kMaxDim = 256;

inline int64_t round_up16(int64_t n) { return (n + 15) / 16 * 16; }

// e^x for the lanes of x (x <= 0 but for NaN): as exp_lanes above, 2^n built in the exponent bits.
inline __m256 exp_lanes(__m256 x) {
  const __m256 floor = _mm256_set1_ps(-87.f);
  const __m256 clamped = _mm256_max_ps(floor, x);  // NaN in x passes through
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 kept = _mm256_cmp_ps(x, floor, _CMP_NLT_UQ);
  return _mm256_and_ps(kept, _mm256_mul_ps(p, _mm256_castsi256_ps(exponent)));
}

// x rounded to the nearest bfloat16, ties to even, kept as float32 (NaN stays NaN)
inline __m256i bf16_rounded_bits(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
}

inline __m256 round_to_bf16(__m256 x) {
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_rounded_bits(x), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

using quire::load_bf16x8;

// r[j] = column j of the 8 x 8 matrix whose rows r held
inline void transpose8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

// `count` (<= 8) key rows of D bfloat16 into one [D][8] group of K^T, float32 (zero for the missing rows)
inline void pack_key_group(const uint16_t* first, int64_t stride, int64_t count, int64_t D, float* group) {
  for (int64_t d0 = 0; d0 < D; d0 += 8) {
    __m256 r[8];
    for (int64_t i = 0; i < 8; ++i) r[i] = i < count ? load_bf16x8(first + i * stride + d0) : _mm256_setzero_ps();
    transpose8(r);
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(group + (d0 + i) * 8, r[i]);
  }
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// S[6][16] = Q[6 rows, stride kMaxDim] . K^T for 16 keys (two groups of 8 of the packed K^T, [D][8] each)
inline void score_tile(const float* q, const float* k_group, int64_t D, float* s, int64_t s_stride) {
  __m256 a[kTile][2];
  for (int r = 0; r < kTile; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  const float* k_next = k_group + D * 8;
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(k_group + d * 8), k1 = _mm256_loadu_ps(k_next + d * 8);
    for (int r = 0; r < kTile; ++r) {
      const __m256 qv = _mm256_broadcast_ss(q + r * kMaxDim + d);
      a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
    }
  }
  for (int r = 0; r < kTile; ++r) {
    _mm256_store_ps(s + r * s_stride, a[r][0]);
    _mm256_store_ps(s + r * s_stride + 8, a[r][1]);
  }
}

// O[6][D] = alpha[r] * O + P[6][keys] . V[keys][D], 16 of D at a time (P rows kBlock apart)
inline void output_tile(const float* p, const float* alpha, const float* v, int64_t keys, int64_t D, float* o) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m256 a[kTile][2];
    for (int r = 0; r < kTile; ++r) {
      const __m256 scale = _mm256_broadcast_ss(alpha + r);
      a[r][0] = _mm256_mul_ps(scale, _mm256_load_ps(o + r * kMaxDim + d0));
      a[r][1] = _mm256_mul_ps(scale, _mm256_load_ps(o + r * kMaxDim + d0 + 8));
    }
    for (int64_t j = 0; j < keys; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v + j * D + d0), v1 = _mm256_loadu_ps(v + j * D + d0 + 8);
      for (int r = 0; r < kTile; ++r) {
        const __m256 pv = _mm256_broadcast_ss(p + r * kBlock + j);
        a[r][0] = _mm256_fmadd_ps(pv, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(pv, v1, a[r][1]);
      }
    }
    for (int r = 0; r < kTile; ++r) {
      _mm256_store_ps(o + r * kMaxDim + d0, a[r][0]);
      _mm256_store_ps(o + r * kMaxDim + d0 + 8, a[r][1]);
    }
  }
}

// One item: query head rows r0 .. r0 + 11 of a prompt of T rows (those past T computed from zero rows and
// dropped); keys as K^T groups [Tk / 8][D][8] and values as rows [Tk][D], float32, zero past T.
void attend_rows(const uint16_t* query, int64_t q_stride, const float* keys_t, const float* values, int64_t T,
                 int64_t D, int64_t r0, float scale, uint16_t* out, int64_t out_stride) {
  alignas(32) float q[kRows * kMaxDim];
  alignas(32) float acc[kRows * kMaxDim];
  alignas(32) float scores[kTile * kBlock];  // scaled scores, then probabilities rounded to bfloat16
  float maxima[kRows], sums[kRows], alpha[kTile];
  const int64_t rows = std::min(kRows, T - r0);
  for (int64_t r = 0; r < kRows; ++r) {
    float* row = q + r * kMaxDim;
    if (r >= rows) {
      std::fill(row, row + D, 0.f);
      continue;
    }
    const uint16_t* src = query + (r0 + r) * q_stride;
    for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(row + d, load_bf16x8(src + d));
  }
  std::fill(acc, acc + kRows * kMaxDim, 0.f);
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  std::fill(maxima, maxima + kRows, kMinusInf);
  std::fill(sums, sums + kRows, 0.f);
  const __m256 minus_inf = _mm256_set1_ps(kMinusInf);
  const __m256 scale_v = _mm256_set1_ps(scale);
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t t0 = 0; t0 < rows; t0 += kTile) {
    const int64_t last = r0 + std::min(t0 + kTile, rows) - 1;  // the tile's last row in the prompt
    const float* qt = q + t0 * kMaxDim;
    for (int64_t k0 = 0; k0 <= last; k0 += kBlock) {
      const int64_t keys = std::min(kBlock, last - k0 + 1);  // scored 16 at a time: within the packed keys
      for (int64_t j = 0; j < keys; j += 16) score_tile(qt, keys_t + (k0 + j) * D, D, scores + j, kBlock);
      for (int64_t r = 0; r < kTile; ++r) {
        float* row = scores + r * kBlock;
        // keys k0 .. k0 + seen - 1 are visible to row r0 + t0 + r (rows past the prompt: those scored)
        const int64_t seen = std::clamp<int64_t>(r0 + t0 + r - k0 + 1, 0, keys);
        __m256 m = minus_inf, nan = _mm256_setzero_ps();
        for (int64_t j = 0; j < keys; j += 8) {
          const __m256 hidden = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(static_cast<float>(j))),
                                              _mm256_set1_ps(static_cast<float>(seen)), _CMP_GE_OQ);
          const __m256 scaled = _mm256_blendv_ps(_mm256_mul_ps(_mm256_load_ps(row + j), scale_v), minus_inf, hidden);
          _mm256_store_ps(row + j, scaled);
          m = _mm256_max_ps(m, scaled);
          nan = _mm256_or_ps(nan, _mm256_cmp_ps(scaled, scaled, _CMP_UNORD_Q));
        }
        // a NaN score makes the maximum NaN (max_ps alone may drop it), and a NaN maximum stays
        const float block_max = _mm256_movemask_ps(nan) ? std::numeric_limits<float>::quiet_NaN() : hmax(m);
        const float old_max = maxima[t0 + r];
        const float new_max = old_max > block_max ? old_max : block_max;
        if (new_max == kMinusInf) {  // nothing visible yet: weights 0 (not exp(-inf - -inf), NaN)
          std::fill(row, row + round_up16(keys), 0.f);
          alpha[r] = 1.f;
          continue;
        }
        const __m256 max_v = _mm256_set1_ps(new_max);
        __m256 total = _mm256_setzero_ps();
        for (int64_t j = 0; j < keys; j += 8) {
          const __m256 p = exp_lanes(_mm256_sub_ps(_mm256_load_ps(row + j), max_v));
          total = _mm256_add_ps(total, p);
          _mm256_store_ps(row + j, round_to_bf16(p));
        }
        alpha[r] = std::exp(old_max - new_max);
        sums[t0 + r] = hsum(total) + alpha[r] * sums[t0 + r];
        maxima[t0 + r] = new_max;
      }
      output_tile(scores, alpha, values + k0 * D, keys, D, acc + t0 * kMaxDim);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 inverse = _mm256_set1_ps(1.f / (sums[r] == 0.f ? 1.f : sums[r]));
    uint16_t* dst = out + (r0 + r) * out_stride;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256 lo = _mm256_mul_ps(_mm256_load_ps(acc + r * kMaxDim + d), inverse);
      const __m256 hi = _mm256_mul_ps(_mm256_load_ps(acc + r * kMaxDim + d + 8), inverse);
      // packs within 128-bit lanes (lo 0-3, hi 0-3, lo 4-7, hi 4-7): put the quarters back in order
      const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(bf16_rounded_bits(lo), 16),
                                                 _mm256_srli_epi32(bf16_rounded_bits(hi), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), _mm256_permute4x64_epi64(packed, 0xD8));
    }
  }
}

}  // namespace avx2
}  // namespace
#endif  // __AVX2__ && __FMA__

#ifdef QUIRE_AMX
namespace {

void attend_amx(const Call& call) {
  const int64_t D = call.D, group = call.Hq / call.Hk;
  std::vector<uint16_t> packed_keys(call.packed_size, 0), packed_values(call.packed_size, 0);
  repack(call, [&](const Prompt& prompt, int64_t g, int64_t k0) {
    const int64_t Tk = quire::round_up(prompt.length, kKeys);
    uint16_t* kdst = packed_keys.data() + prompt.packed + g * Tk * D;
    uint16_t* vdst = packed_values.data() + prompt.packed + g * Tk * D + k0 * D;  // this block's [D][32]
    for (int64_t t = k0; t < std::min(prompt.length, k0 + kKeys); ++t) {
      const int64_t row = prompt.start + t;
      std::memcpy(kdst + t * D, call.key + row * call.k_stride + g * D, D * 2);
      const uint16_t* vrow = call.value + row * call.v_stride + g * D;
      for (int64_t d = 0; d < D; ++d) vdst[d * kKeys + (t - k0)] = vrow[d];
    }
  });
  const auto work = work_items(call, kRows);
  quire::parallel_chunks(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(&quire::full_tile_config());
    for (int64_t index = begin; index < end; ++index) {
      const auto [p, h, block] = work[index];
      const Prompt& prompt = call.prompts[p];
      const int64_t kv_offset = prompt.packed + (h / group) * quire::round_up(prompt.length, kKeys) * D;
      attend_rows(call.query + prompt.start * call.q_stride + h * D, call.q_stride, packed_keys.data() + kv_offset,
                  packed_values.data() + kv_offset, prompt.length, D, block * kRows, call.scale,
                  call.out + prompt.start * call.Hq * D + h * D, call.Hq * D);
    }
    _tile_release();
  });
}

}  // namespace
#endif  // QUIRE_AMX

#ifdef QUIRE_AVX2_ATTENTION
namespace {

void attend_avx2(const Call& call) {
  const int64_t D = call.D, group = call.Hq / call.Hk;
  std::vector<float> keys_t(call.packed_size, 0.f), values(call.packed_size, 0.f);
  repack(call, [&](const Prompt& prompt, int64_t g, int64_t k0) {
    const int64_t Tk = quire::round_up(prompt.length, avx2::kKeys);
    float* kdst = keys_t.data() + prompt.packed + g * Tk * D;
    float* vdst = values.data() + prompt.packed + g * Tk * D;
    const int64_t end = std::min(prompt.length, k0 + avx2::kKeys);
    for (int64_t t = k0; t < end; t += 8)  // key t's group of 8: [D][8] at t * D
      avx2::pack_key_group(call.key + (prompt.start + t) * call.k_stride + g * D, call.k_stride,
                           std::min<int64_t>(8, end - t), D, kdst + t * D);
    for (int64_t t = k0; t < end; ++t) {
      const uint16_t* vrow = call.value + (prompt.start + t) * call.v_stride + g * D;
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(vdst + t * D + d, quire::load_bf16x8(vrow + d));
    }
  });
  const auto work = work_items(call, avx2::kRows);
  quire::parallel_chunks(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const auto [p, h, block] = work[index];
      const Prompt& prompt = call.prompts[p];
      const int64_t kv_offset = prompt.packed + (h / group) * quire::round_up(prompt.length, avx2::kKeys) * D;
      avx2::attend_rows(call.query + prompt.start * call.q_stride + h * D, call.q_stride, keys_t.data() + kv_offset,
                        values.data() + kv_offset, prompt.length, D, block * avx2::kRows, call.scale,
                        call.out + prompt.start * call.Hq * D + h * D, call.Hq * D);
    }
  });
}

}  // namespace
#endif  // QUIRE_AVX2_ATTENTION

namespace {

bool amx_runs(int64_t head_dim) {
#ifdef QUIRE_AMX
  return quire::amx_permitted() && head_dim % 32 == 0 && head_dim <= 256;
#else
  (void)head_dim;
  return false;
#endif
}

bool avx2_runs(int64_t head_dim) {
#ifdef QUIRE_AVX2_ATTENTION
  return head_dim > 0 && head_dim % 16 == 0 && head_dim <= avx2::kMaxDim;
#else
  (void)head_dim;
  return false;
#endif
}

}  // namespace

bool prefill_attention_runs(int64_t head_dim) { return amx_runs(head_dim) || avx2_runs(head_dim); }

// The AVX2 tiles agree with PyTorch's SDPA as closely as float32 sums in another order allow (~90% of bfloat16
// outputs equal). On a CPU with AVX-512 BF16 (AMD Zen 4, Intel since Cooper Lake) PyTorch's and oneDNN's bfloat16
// kernels take other paths, and there that difference was enough for three test models' bfloat16 greedy ids to
// leave transformers' where its margins are clear (an AVX2 Zen 3 keeps them): there whole prompts take AMX, or
// the kernel in PyTorch's own order where it gives PyTorch's bits on this machine (prefill_sdpa_order.cpp), or
// else keep SDPA.
std::string prefill_attention_path(int64_t head_dim) {
  if (amx_runs(head_dim)) return "amx";
  if (quire::sdpa_order_verified(head_dim)) return "pytorch order";
#ifndef __AVX512BF16__
  if (avx2_runs(head_dim)) return "avx2";
#endif
  return "";
}

bool prefill_attention_available(int64_t head_dim) { return !prefill_attention_path(head_dim).empty(); }

namespace {

// The checked arguments of a call, and its prompts (none where every range is empty); the tensors whose rows it
// reads are kept in `rows`.
Call checked_call(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value, double scale,
                  const torch::Tensor& ranges, const torch::Tensor& out, bool runs, std::vector<torch::Tensor>& rows) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3,
              "prefill_attention: [T, heads, head_dim] expected");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                  value.scalar_type() == at::kBFloat16, "prefill_attention: bfloat16 only");
  const int64_t T = query.size(0), Hq = query.size(1), D = query.size(2), Hk = key.size(1);
  TORCH_CHECK(key.size(0) == T && value.size(0) == T && value.size(1) == Hk && key.size(2) == D && value.size(2) == D,
              "prefill_attention: query, key and value disagree on tokens or head size");
  TORCH_CHECK(Hk > 0 && Hq % Hk == 0, "prefill_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(scale > 0, "prefill_attention: the scale must be positive (row maxima are taken before it)");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == at::kBFloat16 && out.is_contiguous(),
              "prefill_attention: out must be a contiguous bfloat16 tensor shaped like query");
  TORCH_CHECK(ranges.dim() == 2 && ranges.size(1) == 2 && ranges.scalar_type() == torch::kInt64 && ranges.is_cpu(),
              "prefill_attention: ranges must be an int64 [prompts, 2] tensor of (start, end) rows");
  TORCH_CHECK(runs, "prefill_attention: not available for head_dim ", D, " in this build");
  // rows may be strided (views into a fused projection); within a row, heads and dims must be dense
  auto dense_rows = [](const torch::Tensor& t) {
    return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
  };
  rows = {dense_rows(query), dense_rows(key), dense_rows(value), ranges.contiguous()};
  const auto &q = rows[0], &k = rows[1], &v = rows[2];
  const int64_t* bound = rows[3].data_ptr<int64_t>();
  Call call{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
            reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
            reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()),
            q.stride(0), k.stride(0), v.stride(0), Hq, Hk, D, static_cast<float>(scale),
            reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), {}, 0};
  for (int64_t i = 0; i < ranges.size(0); ++i) {
    const int64_t start = bound[2 * i], end = bound[2 * i + 1];
    TORCH_CHECK(0 <= start && start <= end && end <= T, "prefill_attention: range ", i, " (", start, ", ", end,
                ") is outside the ", T, " rows");
    if (end == start) continue;
    call.prompts.push_back({start, end - start, call.packed_size});
    call.packed_size += Hk * quire::round_up(end - start, 32) * D;
  }
  return call;
}

void attend_pytorch_order(const Call& call) {
  quire::SdpaOrderCall same{call.query, call.key, call.value, call.q_stride, call.k_stride, call.v_stride,
                            call.Hq, call.Hk, call.D, call.scale, call.out, call.Hq * call.D, {}};
  for (const Prompt& prompt : call.prompts) same.prompts.emplace_back(prompt.start, prompt.length);
  quire::sdpa_order_attention(same);
}

}  // namespace

void prefill_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, double scale, torch::Tensor ranges,
                       torch::Tensor out) {
  std::vector<torch::Tensor> rows;
  const int64_t D = query.dim() == 3 ? query.size(2) : 0;
  const Call call = checked_call(query, key, value, scale, ranges, out, prefill_attention_runs(D), rows);
  if (call.prompts.empty()) return;
#ifdef QUIRE_AMX
  if (amx_runs(D)) return attend_amx(call);
#endif
  if (quire::sdpa_order_verified(D)) return attend_pytorch_order(call);
#ifdef QUIRE_AVX2_ATTENTION
  attend_avx2(call);
#endif
}

void prefill_attention_pytorch_order(torch::Tensor query, torch::Tensor key, torch::Tensor value, double scale,
                                     torch::Tensor ranges, torch::Tensor out) {
  std::vector<torch::Tensor> rows;
  const int64_t D = query.dim() == 3 ? query.size(2) : 0;
  const Call call = checked_call(query, key, value, scale, ranges, out, quire::sdpa_order_runs(D), rows);
  if (!call.prompts.empty()) attend_pytorch_order(call);
}
