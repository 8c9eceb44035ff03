// Causal attention of whole prompts over their own keys (no cached prefix), in bfloat16 on AMX tiles.
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

// One prompt of the call: rows start .. start + length of query, key, value and out; its keys and values
// repacked at `packed` (in elements): per KV head, keys [Tk][D] (Tk = length rounded up to 32, zero past it)
// and values [Tk / 32][D][32] (each 32-key block transposed).
struct Prompt {
  int64_t start, length, packed;
};

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

bool prefill_attention_available(int64_t head_dim) {
#ifdef QUIRE_AMX
  return quire::amx_permitted() && head_dim % 32 == 0 && head_dim <= 256;
#else
  (void)head_dim;
  return false;
#endif
}

void prefill_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, double scale, torch::Tensor ranges,
                       torch::Tensor out) {
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
  TORCH_CHECK(prefill_attention_available(D), "prefill_attention: not available for head_dim ", D, " in this build");
#ifdef QUIRE_AMX
  // rows may be strided (views into a fused projection); within a row, heads and dims must be dense
  auto dense_rows = [](const torch::Tensor& t) {
    return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
  };
  const auto q = dense_rows(query), k = dense_rows(key), v = dense_rows(value);
  const auto bounds = ranges.contiguous();
  const int64_t* bound = bounds.data_ptr<int64_t>();
  std::vector<Prompt> prompts;
  int64_t packed_size = 0, max_blocks = 0;
  for (int64_t i = 0; i < bounds.size(0); ++i) {
    const int64_t start = bound[2 * i], end = bound[2 * i + 1];
    TORCH_CHECK(0 <= start && start <= end && end <= T, "prefill_attention: range ", i, " (", start, ", ", end,
                ") is outside the ", T, " rows");
    if (end == start) continue;
    prompts.push_back({start, end - start, packed_size});
    packed_size += Hk * quire::round_up(end - start, kKeys) * D;
    max_blocks = std::max(max_blocks, quire::round_up(end - start, kRows) / kRows);
  }
  if (prompts.empty()) return;
  const int64_t group = Hq / Hk;
  const auto* qs = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* ks = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vs = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  std::vector<uint16_t> packed_keys(packed_size, 0), packed_values(packed_size, 0);
  // repack, one prompt, KV head and 32 keys per task (~1 us each: a few are not worth waking a thread for)
  std::vector<std::array<int64_t, 3>> packing;  // prompt, KV head, first key
  for (int64_t p = 0; p < static_cast<int64_t>(prompts.size()); ++p)
    for (int64_t g = 0; g < Hk; ++g)
      for (int64_t k0 = 0; k0 < prompts[p].length; k0 += kKeys) packing.push_back({p, g, k0});
  const int64_t tasks = packing.size();
  quire::parallel_chunks(0, tasks, quire::chunk_size(tasks, 16), [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const auto [p, g, k0] = packing[index];
      const Prompt& prompt = prompts[p];
      const int64_t Tk = quire::round_up(prompt.length, kKeys);
      uint16_t* kdst = packed_keys.data() + prompt.packed + g * Tk * D;
      uint16_t* vdst = packed_values.data() + prompt.packed + g * Tk * D + k0 * D;  // this block's [D][32]
      for (int64_t t = k0; t < std::min(prompt.length, k0 + kKeys); ++t) {
        const int64_t row = prompt.start + t;
        std::memcpy(kdst + t * D, ks + row * k.stride(0) + g * D, D * 2);
        const uint16_t* vrow = vs + row * v.stride(0) + g * D;
        for (int64_t d = 0; d < D; ++d) vdst[d * kKeys + (t - k0)] = vrow[d];
      }
    }
  });
  // one task: a prompt, a query head and 16 rows; the longest (the last blocks of the longest prompts) first,
  // so that the short ones even out the threads at the end
  std::vector<std::array<int64_t, 3>> work;  // prompt, head, block
  for (int64_t block = max_blocks - 1; block >= 0; --block)
    for (int64_t p = 0; p < static_cast<int64_t>(prompts.size()); ++p)
      if (block * kRows < prompts[p].length)
        for (int64_t h = 0; h < Hq; ++h) work.push_back({p, h, block});
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float s = static_cast<float>(scale);
  quire::parallel_chunks(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(&quire::full_tile_config());
    for (int64_t index = begin; index < end; ++index) {
      const auto [p, h, block] = work[index];
      const Prompt& prompt = prompts[p];
      const int64_t kv_offset = prompt.packed + (h / group) * quire::round_up(prompt.length, kKeys) * D;
      attend_rows(qs + prompt.start * q.stride(0) + h * D, q.stride(0), packed_keys.data() + kv_offset,
                  packed_values.data() + kv_offset, prompt.length, D, block * kRows, s,
                  os + prompt.start * Hq * D + h * D, Hq * D);
    }
    _tile_release();
  });
#endif
}
