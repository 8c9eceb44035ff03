// Paged decode attention for CPUs: one query per request, keys and values read in place from the
// paged cache (no gathered copy), float32 accumulation, a two-pass softmax.
//
//   query        [B, Hq, D]                      float32 or bfloat16
//   key_cache    [num_blocks, block_size, Hk, D] same dtype (one half of a layer's KV cache)
//   value_cache  [num_blocks, block_size, Hk, D]
//   block_tables [B, max_blocks]                 int64
//   seq_lens     [B]                             int64, each >= 1
//   -> output    [B, Hq, D]                      query's dtype
//
// Work is split over requests (and over KV heads when there are too few requests for the threads); each
// cache row is read once for all the query heads that share it. The running maximum starts at -FLT_MAX, not
// -inf; a NaN or +inf score makes the head's output NaN, as PyTorch's float32 softmax does.
//
// NOTE: with bfloat16 the arithmetic follows PyTorch's CPU flash attention (the reference, and what
// transformers runs): scores are (q . k) * scale in float32, probabilities are rounded to bfloat16 before
// they weight the values, and the float32 sum of the unrounded ones divides at the end. Greedy outputs
// then agree with transformers wherever its own margins are clear.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "bf16.h"
#include "kernels.h"
#include "parallel.h"
#include "vector_math.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float v) { return v; }
inline float to_float(uint16_t bf16_bits) { return quire::bf16_to_float(bf16_bits); }

// The weight a probability gets when it meets a value: itself in float32, rounded (to nearest even)
// to bfloat16 when the cache is bfloat16.
inline float probability_weight(float p, float) { return p; }
inline float probability_weight(float p, uint16_t) { return quire::bf16_to_float(quire::float_to_bf16(p)); }

// The sum of sixteen floats, added pairwise.
inline float sum_lanes(const float* lanes) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(_mm512_loadu_ps(lanes));
#elif defined(__AVX__)
  const __m256 eight = _mm256_add_ps(_mm256_loadu_ps(lanes), _mm256_loadu_ps(lanes + 8));
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
#else
  float pairs[8];
  for (int j = 0; j < 8; ++j) pairs[j] = lanes[j] + lanes[j + 8];
  return ((pairs[0] + pairs[4]) + (pairs[2] + pairs[6])) + ((pairs[1] + pairs[5]) + (pairs[3] + pairs[7]));
#endif
}

// q . key in float32 over n elements, in sixteen partial sums (one per vector lane) added pairwise at the
// end. NOTE: not an `omp simd` reduction: without -ffast-math GCC adds the lanes of one in order, a chain
// of sixteen dependent scalar adds per score, which made float32 decode 1.5 times slower.
template <typename T>
inline float dot_product(const float* q, const T* key, int64_t n) {
  constexpr int64_t kLanes = 16;
  float lanes[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += q[d + j] * to_float(key[d + j]);
  }
  float tail = 0.f;
  for (; d < n; ++d) tail += q[d] * to_float(key[d]);
  return sum_lanes(lanes) + tail;
}

// The largest of n scores, at least -FLT_MAX. NOTE: GCC does not vectorize a float max reduction without
// -ffast-math (with a NaN its result depends on the order; here a NaN score makes the head's output NaN
// whichever order finds the maximum), so the vector max is written out.
inline float max_score(const float* scores, int64_t n) {
  float maximum = -FLT_MAX;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 lanes = _mm512_set1_ps(-FLT_MAX);
  for (; t + 16 <= n; t += 16) lanes = _mm512_max_ps(lanes, _mm512_loadu_ps(scores + t));
  maximum = _mm512_reduce_max_ps(lanes);
#elif defined(__AVX__)
  __m256 lanes = _mm256_set1_ps(-FLT_MAX);
  for (; t + 8 <= n; t += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(scores + t));
  alignas(32) float eight[8];
  _mm256_store_ps(eight, lanes);
  maximum = *std::max_element(eight, eight + 8);
#endif
  for (; t < n; ++t) maximum = std::max(maximum, scores[t]);
  return maximum;
}

// Scores to softmax weights in place (exp(s - max), as probability_weight stores them for T's cache);
// returns the float32 sum of the unrounded exponentials, which divides the weighted values at the end.
template <typename T>
inline float softmax_weights(float* s, int64_t length) {
  const float maximum = max_score(s, length);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < length; ++t) {
    const float p = std::exp(s[t] - maximum);
    total += p;
    s[t] = probability_weight(p, T{});
  }
  return total;
}

// Blocks sit anywhere in the cache: ask for the next block's row while this block's is being used, so
// that a jump between blocks does not stall on memory latency.
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 1);
}

#if defined(__AVX2__) && defined(__FMA__)
#define QUIRE_AVX2_DECODE 1
// AVX2 tiles for decode_heads (head_dim a multiple of 8): scores for up to 3 query heads of one KV head and 4
// tokens at a time (12 accumulators; each key vector loaded once for the heads that share it, four dot
// products summed across lanes together), then the weighted values for up to 3 heads and 32 of head_dim per
// pass over the tokens, held in registers instead of read and written back for every token.
namespace avx2 {

constexpr int kHeads = 3, kTokens = 4, kWidth = 32;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return quire::load_bf16x8(p); }

// the lane sums of a, b, c and d
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

// scores[r][j] = (q_r . key_j) * scale for R query heads (rows head_dim apart) and `count` <= 4 keys
template <typename T, int R>
inline void score_tokens(const float* q, const T* const keys[kTokens], int64_t head_dim, float scale, int count,
                         float* scores, int64_t length) {
  __m256 acc[R][kTokens];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kTokens; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    __m256 k[kTokens];
    for (int j = 0; j < kTokens; ++j) k[j] = load8(keys[j] + d);
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * head_dim + d);
      for (int j = 0; j < kTokens; ++j) acc[r][j] = _mm256_fmadd_ps(qv, k[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float four[kTokens];
    _mm_store_ps(four, _mm_mul_ps(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), _mm_set1_ps(scale)));
    for (int j = 0; j < count; ++j) scores[r * length + j] = four[j];
  }
}

// out[r][0 : 8V] = sum over tokens t of weights[r][t] * values[t][0 : 8V], for R query heads
template <typename T, int R, int V>
inline void weigh_values(const float* weights, int64_t length, const T* const* values, int64_t offset,
                         float* out, int64_t head_dim) {
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < length; ++t) {
    if (t + 8 < length) __builtin_prefetch(values[t + 8] + offset, 0, 1);
    __m256 v[V];
    for (int c = 0; c < V; ++c) v[c] = load8(values[t] + offset + 8 * c);
    for (int r = 0; r < R; ++r) {
      const __m256 p = _mm256_broadcast_ss(weights + r * length + t);
      for (int c = 0; c < V; ++c) acc[r][c] = _mm256_fmadd_ps(p, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) _mm256_storeu_ps(out + r * head_dim + 8 * c, acc[r][c]);
}

template <typename T, int R>
void heads_of_kv(const float* q, const T* const* key_rows, const T* const* value_rows, int64_t length, int64_t kv,
                 int64_t head_dim, float scale, float* scores, float* totals, float* accumulator) {
  const int64_t offset = kv * head_dim;
  for (int64_t t = 0; t < length; t += kTokens) {
    const int count = static_cast<int>(std::min<int64_t>(kTokens, length - t));
    const T* keys[kTokens];
    for (int j = 0; j < kTokens; ++j) keys[j] = key_rows[t + (j < count ? j : 0)] + offset;
    if (t + 2 * kTokens < length)
      for (int j = 0; j < kTokens && t + 2 * kTokens + j < length; ++j)
        prefetch_row(key_rows[t + 2 * kTokens + j] + offset, head_dim * sizeof(T));
    score_tokens<T, R>(q, keys, head_dim, scale, count, scores + t, length);
  }
  for (int r = 0; r < R; ++r) totals[r] = softmax_weights<T>(scores + r * length, length);
  int64_t d0 = 0;
  for (; d0 + kWidth <= head_dim; d0 += kWidth)
    weigh_values<T, R, kWidth / 8>(scores, length, value_rows, offset + d0, accumulator + d0, head_dim);
  for (; d0 < head_dim; d0 += 8)
    weigh_values<T, R, 1>(scores, length, value_rows, offset + d0, accumulator + d0, head_dim);
}

}  // namespace avx2
#endif

// One request's KV heads [first_kv, last_kv) with the `group` query heads of each (`query`: those rows,
// float32, [rows, head_dim]); `out` gets their float32 outputs. Noinline: the kernel-by-kernel path below and
// the decoder stack's one-region path (decode_stack.cpp) compute with the same machine code, so the same bits.
template <typename T>
__attribute__((noinline)) void decode_heads(const float* q_base, const T* key_cache, const T* value_cache,
                                            const int64_t* blocks, int64_t length, int64_t first_kv, int64_t last_kv,
                                            int64_t group, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                            float scale, float* out) {
  thread_local std::vector<float> scores, totals, query_f, accumulator;  // reused across calls
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  const int64_t rows = (last_kv - first_kv) * group;  // query heads handled here
  const int64_t row_bytes = (last_kv - first_kv) * head_dim * sizeof(T);
  query_f.assign(q_base, q_base + rows * head_dim);
  scores.resize(rows * length);
  totals.assign(rows, 0.f);
#ifdef QUIRE_AVX2_DECODE
  if (head_dim % 8 == 0) {
    thread_local std::vector<const T*> key_rows, value_rows;  // each token's cache row (all KV heads)
    key_rows.resize(length);
    value_rows.resize(length);
    for (int64_t t = 0; t < length; ++t) {
      const int64_t at = blocks[t / block_size] * block_stride + (t % block_size) * token_stride;
      key_rows[t] = key_cache + at;
      value_rows[t] = value_cache + at;
    }
    accumulator.resize(rows * head_dim);
    for (int64_t kv = first_kv; kv < last_kv; ++kv) {
      for (int64_t r0 = 0; r0 < group; r0 += avx2::kHeads) {
        const int64_t r = (kv - first_kv) * group + r0;  // this tile's first row
        const float* q = &query_f[r * head_dim];
        float* s = &scores[r * length];
        float* acc = &accumulator[r * head_dim];
        switch (std::min<int64_t>(avx2::kHeads, group - r0)) {
          case 1: avx2::heads_of_kv<T, 1>(q, key_rows.data(), value_rows.data(), length, kv, head_dim, scale, s,
                                          &totals[r], acc); break;
          case 2: avx2::heads_of_kv<T, 2>(q, key_rows.data(), value_rows.data(), length, kv, head_dim, scale, s,
                                          &totals[r], acc); break;
          default: avx2::heads_of_kv<T, 3>(q, key_rows.data(), value_rows.data(), length, kv, head_dim, scale, s,
                                           &totals[r], acc);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float inverse = 1.f / totals[r];
      for (int64_t d = 0; d < head_dim; ++d) out[r * head_dim + d] = accumulator[r * head_dim + d] * inverse;
    }
    return;
  }
#endif
  // pass 1: scores, block by block, reading each token's row once for all heads handled here
  for (int64_t t0 = 0; t0 < length; t0 += block_size) {
    const T* block = key_cache + blocks[t0 / block_size] * block_stride;
    const T* next = t0 + block_size < length ? key_cache + blocks[t0 / block_size + 1] * block_stride : nullptr;
    const int64_t count = std::min(block_size, length - t0);
    for (int64_t i = 0; i < count; ++i) {
      const T* row = block + i * token_stride;
      if (next != nullptr) prefetch_row(next + i * token_stride + first_kv * head_dim, row_bytes);
      for (int64_t r = 0; r < rows; ++r) {
        const T* key = row + (first_kv + r / group) * head_dim;
        const float* q = &query_f[r * head_dim];
        scores[r * length + t0 + i] = dot_product(q, key, head_dim) * scale;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) totals[r] = softmax_weights<T>(&scores[r * length], length);
  // pass 2: the weighted sum of values
  accumulator.assign(rows * head_dim, 0.f);
  for (int64_t t0 = 0; t0 < length; t0 += block_size) {
    const T* block = value_cache + blocks[t0 / block_size] * block_stride;
    const T* next = t0 + block_size < length ? value_cache + blocks[t0 / block_size + 1] * block_stride : nullptr;
    const int64_t count = std::min(block_size, length - t0);
    for (int64_t i = 0; i < count; ++i) {
      const T* row = block + i * token_stride;
      if (next != nullptr) prefetch_row(next + i * token_stride + first_kv * head_dim, row_bytes);
      for (int64_t r = 0; r < rows; ++r) {
        const T* value = row + (first_kv + r / group) * head_dim;
        float* acc = &accumulator[r * head_dim];
        const float p = scores[r * length + t0 + i];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * to_float(value[d]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inverse = 1.f / totals[r];
    for (int64_t d = 0; d < head_dim; ++d) out[r * head_dim + d] = accumulator[r * head_dim + d] * inverse;
  }
}

template <typename T>
void decode(const float* query, const T* key_cache, const T* value_cache, const int64_t* block_tables,
            const int64_t* seq_lens, float* output, int64_t num_requests, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  // A work item is one request and a range of its KV heads: all of them when there are enough requests
  // to keep every thread busy (reading whole cache rows), fewer when there are not (batch 1).
  const int64_t threads = at::get_num_threads();
  const int64_t head_splits = std::min<int64_t>(num_kv_heads, std::max<int64_t>(1, 4 * threads / num_requests));
  const int64_t heads_per_item = (num_kv_heads + head_splits - 1) / head_splits;
  quire::parallel_chunks(0, num_requests * head_splits, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t request = item / head_splits;
      const int64_t first_kv = (item % head_splits) * heads_per_item;
      const int64_t last_kv = std::min(num_kv_heads, first_kv + heads_per_item);
      const int64_t offset = (request * num_heads + first_kv * group) * head_dim;
      decode_heads(query + offset, key_cache, value_cache, block_tables + request * max_blocks, seq_lens[request],
                   first_kv, last_kv, group, num_kv_heads, head_dim, block_size, scale, output + offset);
    }
  });
}


#if defined(__AVX512F__) && defined(__AVX512BF16__)

// The AVX-512 bfloat16 path (head_dim a multiple of 32): one work item is one request and one KV head,
// with the `group` query heads that share it. Scores come from `vdpbf16ps` (exact products, float32
// sums), eight tokens against up to three query heads at a time; values are accumulated in registers for up to
// eight query heads.
constexpr int kTile = 16;

// out[j] = sum of the lanes of v[j], for eight vectors, each as ((s0 + t0) + (s1 + t1)) + ((s2 + t2) + (s3 + t3))
// where s_k sums lanes 4k and 4k + 2 and t_k lanes 4k + 1 and 4k + 3 (the order of the sixteen-vector
// reduction this replaced: the same bits).
inline __m256 sum_lanes8(const __m512 v[8]) {
  __m512 pairs[4], quads[2];
  for (int i = 0; i < 4; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // 128-bit lanes: vectors 0-3's lane sums 0 + 1 and 2 + 3, then vectors 4-7's
  const __m512 half = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                    _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  return _mm512_castps512_ps256(_mm512_add_ps(_mm512_shuffle_f32x4(half, half, 0x88),
                                              _mm512_shuffle_f32x4(half, half, 0xDD)));
}

// Scores of G query heads (head_dim apart; C chunks of 32 bfloat16, or `chunks` where C is 0) against eight
// tokens (keys[j]), times scale, to out[g * stride + j]: each token's sum over the chunks in order, then across
// lanes (sum_lanes8). Each key chunk is read once for the G heads (G x 8 sums in registers).
// (Against one head and sixteen tokens a call: 32 rows of 128-255 tokens, cache hot, 10.4 -> 10.1 ns a token and KV
// head a thread; a 32-row decode step, whose attention waits mostly on memory, within 1%.)
template <int G, int C>
inline __attribute__((always_inline)) void score_heads8(const uint16_t* q, int64_t head_dim,
                                                        const uint16_t* const* keys, int64_t chunks, float scale,
                                                        float* out, int64_t stride) {
  const int64_t n = C > 0 ? C : chunks;
  __m512 partial[G][8];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 8; ++j) partial[g][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; ++c) {
    __m512bh qc[G];
    for (int g = 0; g < G; ++g) qc[g] = (__m512bh)_mm512_loadu_si512(q + g * head_dim + 32 * c);
    for (int j = 0; j < 8; ++j) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(keys[j] + 32 * c);
      for (int g = 0; g < G; ++g) partial[g][j] = _mm512_dpbf16_ps(partial[g][j], qc[g], k);
    }
  }
  for (int g = 0; g < G; ++g)
    _mm256_storeu_ps(out + g * stride, _mm256_mul_ps(sum_lanes8(partial[g]), _mm256_set1_ps(scale)));
}

// Scores of the `group` query heads of one KV head against all `length` tokens (key_rows padded to whole tiles
// with the last row), to probs (a head's row `stride` apart), three heads at a time eight tokens at a time; the
// next tile's keys and this tile's values asked for ahead.
template <int C>
void score_rows(const uint16_t* q, int64_t group, int64_t head_dim, const uint16_t* const* key_rows,
                const uint16_t* const* value_rows, int64_t length, int64_t chunks, float scale, float* probs,
                int64_t stride) {
  for (int64_t t0 = 0; t0 < length; t0 += kTile) {
    const int64_t count = std::min<int64_t>(kTile, length - t0);
    if (t0 + kTile < length) {
      const int64_t next = std::min<int64_t>(kTile, length - t0 - kTile);
      for (int64_t j = 0; j < next; ++j) prefetch_row(key_rows[t0 + kTile + j], head_dim * 2);
    }
    // the values are read after every score: ask for them now, while the scores are computed
    for (int64_t j = 0; j < count; ++j) prefetch_row(value_rows[t0 + j], head_dim * 2);
    for (int64_t t = t0; t < t0 + count; t += 8) {
      for (int64_t r = 0; r < group; r += 3) {
        const uint16_t* qr = q + r * head_dim;
        float* out = probs + r * stride + t;
        switch (std::min<int64_t>(3, group - r)) {
          case 1: score_heads8<1, C>(qr, head_dim, &key_rows[t], chunks, scale, out, stride); break;
          case 2: score_heads8<2, C>(qr, head_dim, &key_rows[t], chunks, scale, out, stride); break;
          default: score_heads8<3, C>(qr, head_dim, &key_rows[t], chunks, scale, out, stride); break;
        }
      }
    }
  }
}

// acc[r] += p[r][t] * value[t] over one 32-wide slice of head_dim for R query heads, two tokens a vdpbf16ps:
// `pairs` holds each head's probabilities (bfloat16) two tokens a dword, token t + 1 in the low half and t in
// the high one, which vdpbf16ps takes first (so the sums run over the tokens in order, each product exact and
// each addition rounded, as with one float32 fma a token, except that vdpbf16ps reads subnormal inputs and
// writes subnormal sums as zero); `rows` has an even count (a zero row after an odd one). The lanes come out with dims interleaved by 128-bit lane (unpack), put back in order at the end.
template <int R>
void accumulate_value_pairs(const uint32_t* pairs, int64_t count, const uint16_t* const* rows, int64_t slice,
                            float* out, int64_t head_dim) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; ++i) {
    const __m512i first = _mm512_loadu_si512(rows[2 * i] + slice);
    const __m512i second = _mm512_loadu_si512(rows[2 * i + 1] + slice);
    // dword 4L + k of lo_pair: (second, first) at dim 8L + k; of hi_pair at dim 8L + 4 + k
    const __m512bh lo_pair = (__m512bh)_mm512_unpacklo_epi16(second, first);
    const __m512bh hi_pair = (__m512bh)_mm512_unpackhi_epi16(second, first);
    for (int r = 0; r < R; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r * count + i]));
      lo[r] = _mm512_dpbf16_ps(lo[r], p, lo_pair);
      hi[r] = _mm512_dpbf16_ps(hi[r], p, hi_pair);
    }
  }
  // dims 0-15: lo 0-3, hi 0-3, lo 4-7, hi 4-7; dims 16-31: lo 8-11, hi 8-11, lo 12-15, hi 12-15
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * head_dim + slice, _mm512_permutex2var_ps(lo[r], first_half, hi[r]));
    _mm512_storeu_ps(out + r * head_dim + slice + 16, _mm512_permutex2var_ps(lo[r], second_half, hi[r]));
  }
}

using AccumulateFn = void (*)(const uint32_t*, int64_t, const uint16_t* const*, int64_t, float*, int64_t);
constexpr AccumulateFn kAccumulate[8] = {accumulate_value_pairs<1>, accumulate_value_pairs<2>,
                                         accumulate_value_pairs<3>, accumulate_value_pairs<4>,
                                         accumulate_value_pairs<5>, accumulate_value_pairs<6>,
                                         accumulate_value_pairs<7>, accumulate_value_pairs<8>};

// One request and KV head: the `group` query heads (rotated, [group, head_dim]) that share it.
__attribute__((noinline)) void decode_bf16_item(const uint16_t* q, const uint16_t* key_cache,
                                                const uint16_t* value_cache, const int64_t* blocks, int64_t length,
                                                int64_t kv, int64_t group, int64_t num_kv_heads, int64_t head_dim,
                                                int64_t block_size, float scale, float* out,
                                                quire::AttentionScratch& scratch) {
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  const int64_t chunks = head_dim / 32;  // 32 bfloat16 per vdpbf16ps operand
  const int64_t tiles = (length + kTile - 1) / kTile, pair_count = (length + 1) / 2;
  auto& key_rows = scratch.key_rows;
  auto& value_rows = scratch.value_rows;
  auto& probs = scratch.probs;
  auto& totals = scratch.totals;
  auto& pairs = scratch.pairs;
  // the key rows padded to whole tiles with the last, the value rows to whole pairs with a zero row
  key_rows.resize(tiles * kTile);
  value_rows.resize(2 * pair_count);
  for (int64_t t0 = 0, b = 0; t0 < length; t0 += block_size, ++b) {
    const int64_t base = blocks[b] * block_stride + kv * head_dim;
    const int64_t count = std::min(block_size, length - t0);
    for (int64_t i = 0; i < count; ++i) {
      key_rows[t0 + i] = key_cache + base + i * token_stride;
      value_rows[t0 + i] = value_cache + base + i * token_stride;
    }
  }
  for (int64_t t = length; t < tiles * kTile; ++t) key_rows[t] = key_rows[length - 1];
  if (length % 2 != 0) {
    scratch.zeros.assign(head_dim, 0);
    value_rows[length] = scratch.zeros.data();
  }
  probs.resize(group * tiles * kTile);
  totals.resize(group);
  const int64_t stride = tiles * kTile;  // probs of one query head
  // scores, three query heads and eight tokens at a time
  if (chunks == 2) {
    score_rows<2>(q, group, head_dim, key_rows.data(), value_rows.data(), length, chunks, scale, probs.data(), stride);
  } else if (chunks == 4) {
    score_rows<4>(q, group, head_dim, key_rows.data(), value_rows.data(), length, chunks, scale, probs.data(), stride);
  } else {
    score_rows<0>(q, group, head_dim, key_rows.data(), value_rows.data(), length, chunks, scale, probs.data(), stride);
  }
  // softmax weights, rounded to bfloat16 (exact in the float32 probs), two tokens a dword for the values
  pairs.resize(group * pair_count);
  for (int64_t r = 0; r < group; ++r) {
    float* p = &probs[r * stride];
    totals[r] = softmax_weights<uint16_t>(p, length);
    uint32_t* pr = &pairs[r * pair_count];
    for (int64_t i = 0; i < pair_count; i += 16) {  // 32 tokens: 16 dwords
      const int64_t n = std::min<int64_t>(32, length - 2 * i);
      const __mmask16 low = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
      const __mmask16 high = n >= 32 ? __mmask16(0xFFFF) : n > 16 ? __mmask16((1u << (n - 16)) - 1) : __mmask16(0);
      const __m512 first = _mm512_maskz_loadu_ps(low, p + 2 * i), second = _mm512_maskz_loadu_ps(high, p + 2 * i + 16);
      // each dword (t, t + 1) turned to (t + 1, t)
      const __m512i packed = _mm512_ror_epi32((__m512i)_mm512_cvtne2ps_pbh(second, first), 16);
      const int64_t dwords = std::min<int64_t>(16, pair_count - i);
      _mm512_mask_storeu_epi32(pr + i, dwords >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << dwords) - 1), packed);
    }
  }
  for (int64_t r0 = 0; r0 < group; r0 += 8) {
    const int64_t rows = std::min<int64_t>(8, group - r0);
    for (int64_t slice = 0; slice < head_dim; slice += 32)
      kAccumulate[rows - 1](&pairs[r0 * pair_count], pair_count, value_rows.data(), slice, out + r0 * head_dim,
                            head_dim);
  }
  for (int64_t r = 0; r < group; ++r) {
    const float inverse = 1.f / totals[r];
    for (int64_t d = 0; d < head_dim; ++d) out[r * head_dim + d] *= inverse;
  }
}

void decode_bf16_avx512(const uint16_t* query, const uint16_t* key_cache, const uint16_t* value_cache,
                        const int64_t* block_tables, const int64_t* seq_lens, float* output, int64_t num_requests,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  // A thread takes all the KV heads of a request together when there are requests enough to go round: the
  // heads of a token share its cache lines, which then come from memory once for all of them.
  const int64_t chunk = num_requests >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  quire::parallel_chunks(0, num_requests * num_kv_heads, chunk, [&](int64_t begin, int64_t end) {
    thread_local quire::AttentionScratch scratch;  // reused across chunks
    for (int64_t item = begin; item < end; ++item) {
      const int64_t request = item / num_kv_heads, kv = item % num_kv_heads;
      const int64_t offset = (request * num_heads + kv * group) * head_dim;
      decode_bf16_item(query + offset, key_cache, value_cache, block_tables + request * max_blocks,
                       seq_lens[request], kv, group, num_kv_heads, head_dim, block_size, scale, output + offset,
                       scratch);
    }
  });
}
#define QUIRE_HAVE_AVX512_BF16 1
#endif

}  // namespace

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [B, H, D] and caches [N, B, H, D] expected");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lengths = seq_lens.to(torch::kInt64).contiguous();
  auto output = torch::empty(query.sizes(), query.options().dtype(torch::kFloat32));
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t block_size = key_cache.size(1), Hk = key_cache.size(2), max_blocks = tables.size(1);
#ifdef QUIRE_HAVE_AVX512_BF16
  if (key_cache.scalar_type() == torch::kBFloat16 && query.scalar_type() == torch::kBFloat16 && D % 32 == 0) {
    auto query_bf16 = query.contiguous();
    decode_bf16_avx512(reinterpret_cast<const uint16_t*>(query_bf16.data_ptr<at::BFloat16>()),
                       reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>()),
                       reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>()),
                       tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), output.data_ptr<float>(), B, H, Hk,
                       D, block_size, max_blocks, static_cast<float>(scale));
    return output.to(query.scalar_type());
  }
#endif
  auto query_f = query.to(torch::kFloat32).contiguous();
  if (key_cache.scalar_type() == torch::kBFloat16) {
    decode(query_f.data_ptr<float>(), reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>()),
           reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>()), tables.data_ptr<int64_t>(),
           lengths.data_ptr<int64_t>(), output.data_ptr<float>(), B, H, Hk, D, block_size, max_blocks,
           static_cast<float>(scale));
  } else {
    TORCH_CHECK(key_cache.scalar_type() == torch::kFloat32, "paged_decode supports float32 and bfloat16");
    decode(query_f.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
           tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), output.data_ptr<float>(), B, H, Hk, D,
           block_size, max_blocks, static_cast<float>(scale));
  }
  return output.to(query.scalar_type());
}



namespace quire {

void paged_decode_heads_bf16(const float* query, const uint16_t* key_cache, const uint16_t* value_cache,
                             const int64_t* blocks, int64_t length, int64_t first_kv, int64_t last_kv, int64_t group,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float* out) {
  decode_heads(query, key_cache, value_cache, blocks, length, first_kv, last_kv, group, num_kv_heads, head_dim,
               block_size, scale, out);
}

bool paged_decode_item_available(int64_t head_dim) {
#ifdef QUIRE_HAVE_AVX512_BF16
  return head_dim % 32 == 0;
#else
  (void)head_dim;
  return false;
#endif
}

void paged_decode_bf16_item(const uint16_t* query, const uint16_t* key_cache, const uint16_t* value_cache,
                            const int64_t* blocks, int64_t length, int64_t kv, int64_t group, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, float* out, AttentionScratch& scratch) {
#ifdef QUIRE_HAVE_AVX512_BF16
  decode_bf16_item(query, key_cache, value_cache, blocks, length, kv, group, num_kv_heads, head_dim, block_size, scale,
                   out, scratch);
#else
  (void)query, (void)key_cache, (void)value_cache, (void)blocks, (void)length, (void)kv, (void)group,
      (void)num_kv_heads, (void)head_dim, (void)block_size, (void)scale, (void)out, (void)scratch;
  TORCH_CHECK(false, "paged_decode_bf16_item: this build has no AVX-512 BF16");
#endif
}

}  // namespace quire
