// Causal attention of whole bfloat16 prompts with PyTorch's own bits, on AVX-512 CPUs without AMX tiles.
//
// Where whole prompts cannot take the AMX tiles of prefill_attention.cpp, Quire hands them to PyTorch's
// scaled_dot_product_attention: its CPU flash kernel is what transformers runs, and another float32 order
// (prefill_attention's AVX2 tiles) moved bfloat16 greedy ids of test models off transformers' on AMD Zen 4
// (docs/performance.md, tenth sitting). That kernel spends most of its time outside arithmetic: on Zen 4 its
// bfloat16 products go through MKL's generic path (converted to float32 and packed for every 64-row block of
// queries, the full 512-key block computed above the diagonal too), ~55 GFLOP/s on a 512-token prompt.
//
// Here the same arithmetic runs in the same order, so the outputs are the same bits (checked against
// at::scaled_dot_product_attention once per head size and process before it is used: `sdpa_order_verified`):
//
//   per query row, the keys in blocks of 512 (PyTorch's kv split); per block:
//   scores   q . k summed in float32 one dim after another (fused multiply-adds), times the scale
//   softmax  the block's maximum with the running one; exp(s - max) by ATen's own fexp_u20 over whole vectors of
//            16 keys, summed into three vector accumulators (keys 32i.., 32i+16.., the last odd vector) that are
//            added and reduced across lanes the way PyTorch's kernel does; the keys past the last whole vector
//            through the C library's double exp, one by one; each exp rounded to bfloat16 as P; the running sum
//            fma(exp(old max - max), sum, block sum), the output so far times exp(old max - max)
//   output   + P . V over the block's keys, as MKL's sgemm sums a product of K terms here: K <= 192 terms one
//            after another; up to 384 in two halves of an even count (the odd last term fused in after); more in
//            panels of 192, 192 and the rest; each panel's sum added to the output in turn
//   at the end the output times 1 / sum, rounded to bfloat16.
//
// The keys above the diagonal, which PyTorch computes and masks to -inf, contribute exact zeros to every sum, so
// they are skipped (whole vectors of them; a vector the diagonal crosses is masked lane by lane). The work is
// a tile of 6 query rows: scores 6 rows x 64 keys and outputs 6 rows x 64 dims in 24 float32 accumulators,
// keys converted to float32 once per call (K^T in groups of 16 keys, V by rows). SmolLM2-135M's 9 query heads
// over 3 KV heads, two Zen 4 cores: 512 tokens 5.5 -> 2.1 ms a layer, 2,048 tokens 44 -> 28 ms (float32 FMA
// peak on these cores is ~185 GFLOP/s; the causal half is ~170 GFLOP/s here).
//
// ATen's vector header is compiled here for AVX-512 (its CPU_CAPABILITY, as PyTorch's own AVX-512 kernels are), so
// this file defines it before any ATen header.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define QUIRE_SDPA_ORDER 1
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#endif

#include "bf16.h"
#include "kernels.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "parallel.h"

#ifdef QUIRE_SDPA_ORDER
namespace {

using quire::bf16_to_float;
using quire::float_to_bf16_as_torch;

constexpr int64_t kRows = 6;       // query rows per tile
constexpr int64_t kSplit = 512;    // keys per softmax block (PyTorch's kv split)
constexpr int64_t kChunk = 64;     // keys per score tile
constexpr int64_t kMaxDim = 128;   // head sizes up to this (the ones swept here; past 192 MKL would split the scores)

inline float bf16_rounded(float f) { return bf16_to_float(float_to_bf16_as_torch(f)); }

// lanes rounded to bfloat16 (nearest even) and kept as float32 (P is finite and >= 0 here)
inline __m512 bf16_rounded(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// How MKL's sgemm sums K products here (found by comparing its results with each candidate order): the panels'
// [cut[i], cut[i + 1]) and whether term K - 1 is fused in after them.
struct Panels {
  int64_t cut[4];
  int count;
  bool odd_last;
};

inline Panels panels_of(int64_t K) {
  if (K <= 192) return {{0, K, 0, 0}, 1, false};
  if (K <= 384) {
    const int64_t even = K - K % 2;
    return {{0, even / 2, even, 0}, 2, K % 2 != 0};
  }
  return {{0, 192, 384, K}, 3, false};
}

// S[r][0 .. 63] = Q[r] . K[j] for the tile's rows and 64 keys (K^T groups of 16 keys [D][16], one after another)
inline void score_chunk(const float* q, const float* keys_t, int64_t D, float* s) {
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 k[4];
    for (int c = 0; c < 4; ++c) k[c] = _mm512_loadu_ps(keys_t + c * D * 16 + d * 16);
    for (int r = 0; r < kRows; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * D + d]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(k[c], qv, acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kSplit + 16 * c, acc[r][c]);
}

// out[r][d0 .. d0 + 16 NV) of the block: the output so far (unless this is the first block) plus P . V over the
// keys [0, seen) in MKL's panels for K = block keys (P is zero past each row's last key)
template <int NV>
void output_block(const float* p, const float* v, int64_t D, int64_t d0, int64_t block_keys, int64_t seen,
                  bool first_block, float* out) {
  const Panels panels = panels_of(block_keys);
  __m512 total[kRows][NV];
  for (int i = 0; i < panels.count; ++i) {
    __m512 acc[kRows][NV];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = panels.cut[i]; j < std::min(panels.cut[i + 1], seen); ++j) {
      __m512 vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = _mm512_loadu_ps(v + j * D + d0 + 16 * c);
      for (int r = 0; r < kRows; ++r) {
        const __m512 pv = _mm512_set1_ps(p[r * kSplit + j]);
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(vv[c], pv, acc[r][c]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      for (int c = 0; c < NV; ++c) {
        if (i == 0 && first_block) {
          total[r][c] = acc[r][c];
        } else {
          const __m512 before = i == 0 ? _mm512_loadu_ps(out + r * D + d0 + 16 * c) : total[r][c];
          total[r][c] = _mm512_add_ps(before, acc[r][c]);
        }
      }
    }
  }
  if (panels.odd_last && block_keys - 1 < seen) {
    const int64_t j = block_keys - 1;
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < NV; ++c)
        total[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(v + j * D + d0 + 16 * c), _mm512_set1_ps(p[r * kSplit + j]),
                                      total[r][c]);
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + r * D + d0 + 16 * c, total[r][c]);
}

// PyTorch's kernel takes a prompt's query rows in blocks of 32 (under 192 rows), 64 (under 768) or 256. Where its
// last block has fewer than 12 rows and T is not a multiple of 4, MKL's sgemm runs the last T % 4 rows through an
// edge kernel whose sums over more than 192 keys, or into an output so far, are in an order not reproduced here
// (found on Zen 4: rare one-step differences in those rows); such prompts longer than 192 rows go to PyTorch.
inline bool takes_edge_kernel(int64_t T) {
  const int64_t q_split = T >= 768 ? 256 : T >= 192 ? 64 : 32;
  return T > 192 && T % 4 != 0 && T - (T - 1) / q_split * q_split < 12;
}

// PyTorch's fexp_u20 (ATen/cpu/vec/vec512/vec512_float.h), which its flash kernel's softmax uses for whole vectors,
// called through ATen's header so that it is the same function.
inline __m512 exp_vector(__m512 x) { return at::vec::Vectorized<float>(x).fexp_u20(); }

struct Scratch {
  std::vector<float> scores, probs, query, out;  // [kRows][kSplit] twice, [kRows][D] twice
};

// One tile: query head rows r0 .. r0 + 5 of a prompt of T rows (rows past T are zero and dropped); keys_t are the
// head's keys as K^T groups of 16 ([Tp / 16][D][16], zero past T), values its rows [T][D], float32.
void attend_tile(const uint16_t* query, int64_t q_stride, const float* keys_t, const float* values, int64_t T,
                 int64_t D, int64_t r0, float scale, uint16_t* out, int64_t out_stride, Scratch& w) {
  const int64_t rows = std::min(kRows, T - r0);
  float* S = w.scores.data();
  float* P = w.probs.data();
  float* Q = w.query.data();
  float* O = w.out.data();
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t d = 0; d < D; ++d) Q[r * D + d] = r < rows ? bf16_to_float(query[(r0 + r) * q_stride + d]) : 0.f;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  float maxima[kRows], sums[kRows];
  std::fill(maxima, maxima + kRows, minus_inf);
  std::fill(sums, sums + kRows, 0.f);
  const int64_t last = r0 + rows - 1;
  const __m512 scale_v = _mm512_set1_ps(scale), masked = _mm512_set1_ps(minus_inf);
  for (int64_t n = 0; n <= last; n += kSplit) {
    const int64_t block_keys = std::min(kSplit, T - n);
    const int64_t seen = std::min(block_keys, last - n + 1);  // keys of the block the tile's last row sees
    for (int64_t j0 = 0; j0 < seen; j0 += kChunk) score_chunk(Q, keys_t + (n + j0) * D, D, S + j0);
    const int64_t vector_end = block_keys / 16 * 16, pair_end = block_keys / 32 * 32;
    for (int64_t r = 0; r < kRows; ++r) {
      float* s = S + r * kSplit;
      float* p = P + r * kSplit;
      const int64_t visible = r < rows ? std::min(block_keys, r0 + r - n + 1) : 0;
      if (visible <= 0) {  // a row before the block: PyTorch never visits it, and the update would be exact no-ops
        std::fill(p, p + seen, 0.f);
        continue;
      }
      // scaled scores (masked to -inf past the row) and the block's maximum
      const int64_t in_vectors = std::min(visible, vector_end);
      // (PyTorch's vector maximum keeps a NaN, its scalar std::max over the keys past the vectors drops one)
      __m512 block_max = masked;
      __mmask16 nan = 0;
      for (int64_t j = 0; j < in_vectors; j += 16) {
        const __mmask16 keep = visible - j >= 16 ? static_cast<__mmask16>(0xFFFF)
                                                 : static_cast<__mmask16>((1u << (visible - j)) - 1);
        const __m512 x = _mm512_mask_mul_ps(masked, keep, _mm512_loadu_ps(s + j), scale_v);
        _mm512_storeu_ps(s + j, x);
        block_max = _mm512_max_ps(block_max, x);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      }
      float top = nan != 0 ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(block_max);
      for (int64_t j = vector_end; j < visible; ++j) {
        s[j] *= scale;
        top = std::max(top, s[j]);
      }
      const float new_max = maxima[r] > top ? maxima[r] : top;
      const __m512 max_v = _mm512_set1_ps(new_max);
      // exp in whole vectors: keys 32i .. 32i + 15 into acc0, 32i + 16 .. into acc1, a last odd vector into acc2
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
      const int64_t vector_stop = std::min((visible + 15) / 16 * 16, vector_end);
      const int64_t pair_stop = std::min(pair_end, vector_stop);
      int64_t j = 0;
      for (; j + 32 <= pair_stop; j += 32) {
        const __m512 e0 = exp_vector(_mm512_sub_ps(_mm512_loadu_ps(s + j), max_v));
        const __m512 e1 = exp_vector(_mm512_sub_ps(_mm512_loadu_ps(s + j + 16), max_v));
        acc0 = _mm512_add_ps(acc0, e0);
        acc1 = _mm512_add_ps(acc1, e1);
        _mm512_storeu_ps(p + j, bf16_rounded(e0));
        _mm512_storeu_ps(p + j + 16, bf16_rounded(e1));
      }
      if (j < pair_stop) {  // a pair's first vector, its second wholly masked
        const __m512 e0 = exp_vector(_mm512_sub_ps(_mm512_loadu_ps(s + j), max_v));
        acc0 = _mm512_add_ps(acc0, e0);
        _mm512_storeu_ps(p + j, bf16_rounded(e0));
      }
      for (j = pair_end; j < vector_stop; j += 16) {
        const __m512 e = exp_vector(_mm512_sub_ps(_mm512_loadu_ps(s + j), max_v));
        acc2 = _mm512_add_ps(acc2, e);
        _mm512_storeu_ps(p + j, bf16_rounded(e));
      }
      __m512 t = _mm512_add_ps(_mm512_add_ps(acc0, acc2), acc1);
      t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0x4e));
      t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0xb1));
      t = _mm512_add_ps(_mm512_permute_ps(t, 0x4e), t);
      t = _mm512_add_ps(_mm512_permute_ps(t, 0xb1), t);
      float block_sum = _mm512_cvtss_f32(t);
      for (int64_t i = vector_end; i < visible; ++i) {  // past the last whole vector: one key at a time
        const float e = static_cast<float>(std::exp(static_cast<double>(s[i] - new_max)));
        block_sum += e;
        p[i] = bf16_rounded(e);
      }
      for (int64_t i = std::max(vector_stop, visible); i < seen; ++i) p[i] = 0.f;
      const float rescale = std::exp(maxima[r] - new_max);
      sums[r] = std::fma(rescale, sums[r], block_sum);
      maxima[r] = new_max;
      if (n > 0) {
        const __m512 f = _mm512_set1_ps(rescale);
        for (int64_t d = 0; d < D; d += 16)
          _mm512_storeu_ps(O + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(O + r * D + d), f));
      }
    }
    const float* v = values + n * D;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      switch (std::min<int64_t>(4, (D - d0) / 16)) {
        case 1: output_block<1>(P, v, D, d0, block_keys, seen, n == 0, O); break;
        case 2: output_block<2>(P, v, D, d0, block_keys, seen, n == 0, O); break;
        case 3: output_block<3>(P, v, D, d0, block_keys, seen, n == 0, O); break;
        default: output_block<4>(P, v, D, d0, block_keys, seen, n == 0, O); break;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inverse = 1 / (sums[r] == 0.f ? 1.f : sums[r]);
    for (int64_t d = 0; d < D; ++d) out[(r0 + r) * out_stride + d] = float_to_bf16_as_torch(O[r * D + d] * inverse);
  }
}

}  // namespace
#endif  // QUIRE_SDPA_ORDER

namespace quire {

bool sdpa_order_runs(int64_t head_dim) {
#ifdef QUIRE_SDPA_ORDER
  return head_dim > 0 && head_dim % 16 == 0 && head_dim <= kMaxDim;
#else
  (void)head_dim;
  return false;
#endif
}

#ifdef QUIRE_SDPA_ORDER
namespace {

// One prompt through at::scaled_dot_product_attention, as Quire's Python path calls it (rows viewed as [1, heads,
// T, D], causal, grouped KV heads), into its rows of out.
void pytorch_prompt(const SdpaOrderCall& call, int64_t start, int64_t length) {
  const auto options = torch::TensorOptions().dtype(torch::kBFloat16);
  auto rows = [&](const uint16_t* data, int64_t stride, int64_t heads) {
    return torch::from_blob(const_cast<uint16_t*>(data) + start * stride, {length, heads, call.D},
                            {stride, call.D, 1}, options)
        .transpose(0, 1)
        .unsqueeze(0);
  };
  const auto result = at::scaled_dot_product_attention(rows(call.query, call.q_stride, call.Hq),
                                                       rows(call.key, call.k_stride, call.Hk),
                                                       rows(call.value, call.v_stride, call.Hk), {}, 0.0, true,
                                                       static_cast<double>(call.scale), true);
  rows(call.out, call.out_stride, call.Hq).copy_(result);
}

}  // namespace
#endif

void sdpa_order_attention(const SdpaOrderCall& all) {
#ifdef QUIRE_SDPA_ORDER
  TORCH_CHECK(sdpa_order_runs(all.D), "sdpa_order_attention: not available for head_dim ", all.D);
  SdpaOrderCall call = all;
  call.prompts.clear();
  for (const auto& [start, length] : all.prompts) {
    if (takes_edge_kernel(length)) {
      pytorch_prompt(all, start, length);
    } else {
      call.prompts.emplace_back(start, length);
    }
  }
  if (call.prompts.empty()) return;
  const int64_t D = call.D, Hk = call.Hk, Hq = call.Hq, group = Hq / Hk;
  // per prompt and KV head: K^T groups of 16 keys ([Tp / 16][D][16], Tp = length rounded up to 64, zero past it)
  // and V rows [length][D], float32
  std::vector<int64_t> key_offset, value_offset;
  int64_t key_size = 0, value_size = 0;
  for (const auto& [start, length] : call.prompts) {
    key_offset.push_back(key_size);
    value_offset.push_back(value_size);
    key_size += Hk * round_up(length, kChunk) * D;
    value_size += Hk * length * D;
  }
  std::vector<float> keys_t(key_size, 0.f), values(value_size);
  std::vector<std::array<int64_t, 3>> packing;  // prompt, KV head, first key of 16
  for (int64_t i = 0; i < static_cast<int64_t>(call.prompts.size()); ++i)
    for (int64_t g = 0; g < Hk; ++g)
      for (int64_t t = 0; t < call.prompts[i].second; t += 16) packing.push_back({i, g, t});
  const int64_t tasks = packing.size();
  // PyTorch multiplies every value of a 512-key block by each row's probability, zero for the keys it does not
  // see: a value that is not finite (0 x inf, 0 x NaN) then reaches rows before it. A prompt with one goes to
  // PyTorch.
  std::unique_ptr<std::atomic<bool>[]> not_finite(new std::atomic<bool>[call.prompts.size()]());
  parallel_chunks(0, tasks, chunk_size(tasks, 8), [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const auto [i, g, t0] = packing[index];
      const auto [start, length] = call.prompts[i];
      const int64_t Tp = round_up(length, kChunk);
      float* k_dst = keys_t.data() + key_offset[i] + g * Tp * D + t0 * D;
      uint16_t exponents = 0;  // of the values whose exponent is all ones (inf, NaN)
      for (int64_t t = t0; t < std::min(length, t0 + 16); ++t) {
        const uint16_t* k_row = call.key + (start + t) * call.k_stride + g * D;
        const uint16_t* v_row = call.value + (start + t) * call.v_stride + g * D;
        float* v_dst = values.data() + value_offset[i] + (g * length + t) * D;
        for (int64_t d = 0; d < D; ++d) {
          k_dst[d * 16 + (t - t0)] = bf16_to_float(k_row[d]);
          v_dst[d] = bf16_to_float(v_row[d]);
          exponents |= (v_row[d] & 0x7F80) == 0x7F80;
        }
      }
      if (exponents != 0) not_finite[i] = true;
    }
  });
  for (int64_t i = 0; i < static_cast<int64_t>(call.prompts.size()); ++i)
    if (not_finite[i]) pytorch_prompt(call, call.prompts[i].first, call.prompts[i].second);
  // tiles of every prompt and head, the last tiles of the longest prompts (the most keys) first
  std::vector<std::array<int64_t, 3>> work;  // prompt, head, tile
  int64_t max_tiles = 0;
  for (const auto& [start, length] : call.prompts) max_tiles = std::max(max_tiles, (length + kRows - 1) / kRows);
  for (int64_t tile = max_tiles - 1; tile >= 0; --tile)
    for (int64_t i = 0; i < static_cast<int64_t>(call.prompts.size()); ++i)
      if (tile * kRows < call.prompts[i].second && !not_finite[i])
        for (int64_t h = 0; h < Hq; ++h) work.push_back({i, h, tile});
  parallel_chunks(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch w;
    w.scores.resize(kRows * kSplit);
    w.probs.resize(kRows * kSplit);
    w.query.resize(kRows * D);
    w.out.resize(kRows * D);
    for (int64_t index = begin; index < end; ++index) {
      const auto [i, h, tile] = work[index];
      const auto [start, length] = call.prompts[i];
      const int64_t g = h / group, Tp = round_up(length, kChunk);
      attend_tile(call.query + start * call.q_stride + h * D, call.q_stride,
                  keys_t.data() + key_offset[i] + g * Tp * D, values.data() + value_offset[i] + g * length * D,
                  length, D, tile * kRows, call.scale, call.out + start * call.out_stride + h * D, call.out_stride,
                  w);
    }
  });
#else
  (void)all;
  TORCH_CHECK(false, "sdpa_order_attention: this build has no AVX-512");
#endif
}

namespace {

// Whether sdpa_order_attention gives at::scaled_dot_product_attention's bits for this head size on this machine
// (its CPU kernel, MKL's sgemm and ATen's vector code as built and dispatched here): prompts of lengths that take
// every branch above (the per-key tail, the odd vector, one to three panels, an odd panel split, two and three
// blocks, a short last block of query rows with and without the edge kernel), with grouped query heads, on
// pseudo-random values.
bool equals_pytorch(int64_t D) {
  uint32_t state = 12345u + static_cast<uint32_t>(D);
  auto next = [&state]() {
    state = state * 1664525u + 1013904223u;
    return (static_cast<float>(state >> 8) / 16777216.f - 0.5f) * 6.f;
  };
  for (const int64_t T : {1, 21, 37, 45, 194, 200, 301, 533, 769, 772, 962, 1030}) {
    const int64_t Hq = T <= 533 ? 4 : 2, Hk = T <= 533 ? 2 : 1;
    auto qkv = torch::empty({T, (Hq + 2 * Hk) * D}, torch::kFloat32);
    float* values = qkv.data_ptr<float>();
    for (int64_t i = 0; i < qkv.numel(); ++i) values[i] = next();
    qkv = qkv.to(torch::kBFloat16);
    const auto q = qkv.narrow(1, 0, Hq * D).view({T, Hq, D});
    const auto k = qkv.narrow(1, Hq * D, Hk * D).view({T, Hk, D});
    const auto v = qkv.narrow(1, (Hq + Hk) * D, Hk * D).view({T, Hk, D});
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    const auto expected = at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                                           v.transpose(0, 1).unsqueeze(0), {}, 0.0, true, scale, true)
                              .squeeze(0)
                              .transpose(0, 1)
                              .contiguous();
    auto out = torch::empty({T, Hq, D}, torch::kBFloat16);
    SdpaOrderCall call{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
                       reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
                       reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()),
                       q.stride(0), k.stride(0), v.stride(0), Hq, Hk, D, static_cast<float>(scale),
                       reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), Hq * D, {{0, T}}};
    sdpa_order_attention(call);
    if (!torch::equal(out.view(torch::kInt16), expected.view(torch::kInt16))) return false;
  }
  return true;
}

}  // namespace

bool sdpa_order_verified(int64_t head_dim) {
  if (!sdpa_order_runs(head_dim)) return false;
  static std::mutex lock;
  static std::map<int64_t, bool> verified;
  std::lock_guard<std::mutex> guard(lock);
  const auto found = verified.find(head_dim);
  if (found != verified.end()) return found->second;
  const bool equal = equals_pytorch(head_dim);
  verified[head_dim] = equal;
  return equal;
}

}  // namespace quire
