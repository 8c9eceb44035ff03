// Decode-sized linear layers (a few rows) on a weight oneDNN has packed, without calling oneDNN.
//
// On AVX-512 BF16 CPUs oneDNN packs a bfloat16 linear weight [N, K] for its kernels as
//
//   packed[n / W][k / 2][n % W][k % 2]      (N padded to a multiple of W, K to a multiple of 32, with zeros)
//
// with W = 32 outputs for its AMX kernels (Intel) and W = 64 for its AVX-512 BF16 ones (AMD Zen 4), which is
// also the operand `vdpbf16ps` wants: a row of 4W bytes holds a k-pair of W outputs. The kernels here work on
// groups of 32 outputs (a block, or half of one: its k-pair rows 4W bytes apart). For a few rows
// of x the multiply only streams the weight from memory, and oneDNN's fixed cost per call (argument checks,
// descriptors, its primitive cache, the output's allocation: ~25 us, most of it while the other threads wait)
// is a quarter of a small layer's time on two cores; here a call costs a parallel loop. The weight is read
// with software prefetch 2 KB ahead: the hardware prefetcher alone stops at every page (SmolLM2-135M's
// layers at batch 1 on two AMX cores: 12.4 ms through oneDNN, 9.6 ms here; not slower than oneDNN up to 8 rows).
//
// The layout is not part of oneDNN's interface, so `onednn_gemv_layout` checks a packed weight against its own
// dense copy (once, when it is packed) and callers fall back to oneDNN for any weight it refuses; the first
// weight it accepts fixes W for the process, and a weight packed with another W is refused.
//
// From 9 to 32 rows (decode steps of a busy server) AMX tiles read the same layout (W = 32): a packed block's
// 128-byte rows hold two tiles' rows (16 outputs each) at a 128-byte stride. Without AMX and with W = 64 (AMD
// Zen 4), 9 to 64 rows go through the same vdpbf16ps kernel: the work is a block by a run of up to 6 rows
// (24 accumulators), so a block's weight comes from memory for its first run and from the cache for the others,
// and while a thread computes those it brings its next block into the L2 cache. There oneDNN's own kernels wait
// on memory for the weight, which at these sizes is most of what a call reads.
//
// Products of bfloat16 values are exact; each output is a float32 sum (in an order of its own, not oneDNN's),
// plus the bias, rounded to bfloat16 once (nearest even). The order is the same for every number of rows on
// the vdpbf16ps kernel (a row's bits do not depend on the batch); AMX tiles sum in an order of their own.
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "amx.h"
#include "bf16.h"
#include "greedy_screen.h"
#include "kernels.h"
#include "parallel.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define QUIRE_ONEDNN_GEMV 1
#endif
#if defined(QUIRE_ONEDNN_GEMV) && defined(QUIRE_AMX)
#define QUIRE_ONEDNN_AMX 1
#endif

namespace at::native {
// Exported by libtorch_cpu (ATen/native/mkldnn/MKLDNNCommon.h, which PyTorch does not install).
TORCH_API void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
TORCH_API int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor);
}  // namespace at::native

namespace {

constexpr int64_t kBlock = 32;           // outputs per group (a packed block or half of one), and K's padding
// How far ahead gemv_block asks for its weight. With oneDNN's 32-wide blocks (Intel) each k-pair row's lines
// come into L1 16 k-pairs (2 KB) ahead. With its 64-wide blocks (AMD Zen 4) they come into L2 48 k-pairs
// (12 KB) ahead instead: SmolLM2-135M's 30 layers, weights streamed from memory, interleaved on two Zen 4
// cores: 1 row 8.05 -> 6.90 ms, 2 rows 8.38 -> 7.41, 6 rows 13.68 -> 7.86, 8 rows 14.36 -> 8.70; 16-64 rows
// (whose runs after the first already bring the next block into L2) and weights in L3 unchanged.
constexpr int64_t kNearPairs = 16;
constexpr int64_t kFarPairs = 48;
constexpr int64_t kGemvRows = 8;         // rows for vdpbf16ps; more go through AMX tiles
#ifdef QUIRE_ONEDNN_AMX
// More rows go to oneDNN's own kernels. SmolLM2-135M's 30 layers' linears, weights from memory, two AMX cores:
// 12.6 ms here against oneDNN's 18.1 at 32 rows, 15.8-17.9 against 19.9-21.9 at 64, 22.2 against 25.0 at 96, 25.4
// against 26.7 at 128 (before prefetch_weight_ahead).
constexpr int64_t kMaxRows = 128;
#else
constexpr int64_t kMaxRows = kGemvRows;
#endif
// With W = 64 (oneDNN's AVX-512 BF16 kernels: AMD Zen 4) up to this many rows go through vdpbf16ps in runs of
// rows; more go to oneDNN's own kernels (SmolLM2-135M's 30 layers' linears, weights streamed from memory, on
// two Zen 4 cores: 13.1 ms against oneDNN's 16.0 at 16 rows, 21.9 against 24.3 at 32, 37.8 against 41.2 at 64).
constexpr int64_t kWideMaxRows = 64;

// oneDNN's block width W on this CPU (32 or 64 outputs), fixed by the first weight onednn_gemv_layout accepts
std::atomic<int64_t> g_width{0};

// oneDNN's block width for the kernels (32 until a weight has been accepted: callers check one first)
inline int64_t block_width() { return std::max<int64_t>(g_width.load(std::memory_order_relaxed), kBlock); }

// Where group j (outputs 32j..32j+31) of a packed weight starts; its k-pair rows are row_stride() apart.
inline const uint16_t* group_data(const uint16_t* w, int64_t j, int64_t P) {
  const int64_t W = block_width(), per_block = W / kBlock;
  return w + (j / per_block) * P * 2 * W + (j % per_block) * 2 * kBlock;
}

inline int64_t row_stride() { return 2 * block_width(); }

#ifdef QUIRE_ONEDNN_GEMV

// sixteen sums (+ bias) to bfloat16, the first `count` stored
inline void store16(uint16_t* out, __m512 sum, const uint16_t* bias, int64_t count) {
  const __mmask16 mask = count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
  if (bias != nullptr) sum = _mm512_add_ps(sum, quire::bf16_to_float(_mm256_maskz_loadu_epi16(mask, bias)));
  _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(sum));
}

// Bytes of another block to bring into the L2 cache while this one is computed: `bytes` from `data`, spread
// over the k-pairs (the next block of a thread that reads each block for several runs of rows: its first run
// then finds the weight in the cache instead of waiting for memory).
struct Ahead {
  const char* data = nullptr;
  int64_t bytes = 0;
  // or, where slabs is set, bytes / 64 lines of the slabs in turn, slab_lines each (data: the next line of the
  // current one, left: its lines still to come)
  const char* const* slabs = nullptr;
  int64_t slab_lines = 0, left = 0;
  // the next line (each call moves on by one)
  const char* next_line() {
    if (slabs != nullptr && left == 0) {
      data = *slabs++;
      left = slab_lines;
    }
    --left;
    const char* line = data;
    data += 64;
    return line;
  }
};

// out[m][0:count] = pairs[m] . G groups side by side (G = 2: a whole block of W = 64, each k-pair row read in one
// run of 256 bytes) for M rows; `pairs` holds each row's k-pairs (P of them, zero past K); the k-pair rows are
// kFar ? 4 * kBlock : 2 * kBlock elements apart (oneDNN's 64- or 32-wide blocks). Each output's sum takes the same
// steps whatever M and G, so the bits are the same; `ahead` is brought into L2 on the way, a few lines with each of
// the first k-pairs, and the loop over the others asks for nothing else.
// NOTE: the look-ahead in the steady loop (a bounded inner loop on every k-pair) and the block width tested on
// every k-pair cost 10-15% of the rate: one Zen 4 core, 32 rows in runs of 6 and 5 over 64-output blocks, K = 576,
// weights streamed from memory: 187-192 -> 207-214 GFLOP/s (16 rows 176 -> 207, 64 rows 209 -> 221); with the
// weight in L2 205-209 -> 231, which is vdpbf16ps at one a cycle.
template <int M, int G, bool kFar>
void gemv_pass(const uint32_t* pairs, int64_t P, const uint16_t* block, uint16_t* out, int64_t out_stride,
               const uint16_t* bias, int64_t count, Ahead ahead) {
  constexpr int V = 2 * G;  // vectors of 16 outputs
  constexpr int64_t stride = kFar ? 4 * kBlock : 2 * kBlock;
  constexpr int64_t distance = (kFar ? kFarPairs : kNearPairs) * stride;
  __m512 acc[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = _mm512_setzero_ps();
  const auto pair = [&](int64_t p) __attribute__((always_inline)) {
    const uint16_t* row = block + p * stride;
    __m512bh w[V];
    for (int v = 0; v < V; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(row + distance + v * 32), kFar ? _MM_HINT_T1 : _MM_HINT_T0);
      w[v] = (__m512bh)_mm512_loadu_si512(row + v * 32);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[m * P + p]));
      for (int v = 0; v < V; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], w[v], x);
    }
  };
  // `ahead`: per_pair lines with each of the first `with` k-pairs, the few left over after them
  const int64_t lines = ahead.bytes / 64, per_pair = (lines + P - 1) / P, with = per_pair > 0 ? lines / per_pair : 0;
  int64_t p = 0;
  for (; p < with; ++p) {
    for (int64_t i = 0; i < per_pair; ++i) _mm_prefetch(ahead.next_line(), _MM_HINT_T1);
    pair(p);
  }
  for (int64_t l = with * per_pair; l < lines; ++l) _mm_prefetch(ahead.next_line(), _MM_HINT_T1);
  for (; p < P; ++p) pair(p);
  for (int m = 0; m < M; ++m) {
    for (int v = 0; v < V && 16 * v < count; ++v) {
      store16(out + m * out_stride + 16 * v, acc[m][v], bias != nullptr ? bias + 16 * v : nullptr,
              std::min<int64_t>(count - 16 * v, 16));
    }
  }
}

// gemv_pass for k-pair rows `stride` elements apart (4 * kBlock: oneDNN's 64-wide blocks, else 32-wide ones)
template <int M, int G>
void gemv_block(const uint32_t* pairs, int64_t P, const uint16_t* block, int64_t stride, uint16_t* out,
                int64_t out_stride, const uint16_t* bias, int64_t count, Ahead ahead) {
  if (stride == 4 * kBlock) {
    gemv_pass<M, G, true>(pairs, P, block, out, out_stride, bias, count, ahead);
  } else {
    gemv_pass<M, G, false>(pairs, P, block, out, out_stride, bias, count, ahead);
  }
}

using GemvFn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, uint16_t*, int64_t, const uint16_t*,
                        int64_t, Ahead);
constexpr GemvFn kGemv[kGemvRows] = {gemv_block<1, 1>, gemv_block<2, 1>, gemv_block<3, 1>, gemv_block<4, 1>,
                                    gemv_block<5, 1>, gemv_block<6, 1>, gemv_block<7, 1>, gemv_block<8, 1>};
// whole 64-output blocks for up to this many rows at a time (6 x 4 accumulators, the 4 weight vectors and the
// broadcast row: 29 of the 32 vector registers)
constexpr int64_t kWideRows = 6;
constexpr GemvFn kGemvWide[kWideRows] = {gemv_block<1, 2>, gemv_block<2, 2>, gemv_block<3, 2>,
                                         gemv_block<4, 2>, gemv_block<5, 2>, gemv_block<6, 2>};

// Whether a call of M rows takes whole 64-output blocks (up to kWideRows rows a pass) rather than 32-output
// halves (up to kGemvRows a pass). 5 to 8 rows keep the halves: one pass of all the rows over each half was
// faster at 8 rows than wide passes of 6 and 2 rows (SmolLM2-135M's LM head: 1.7 against 2.1 ms).
inline bool wide_rows(int64_t M) {
  return g_width.load(std::memory_order_relaxed) == 2 * kBlock && (M <= 4 || M > kGemvRows);
}
inline int64_t rows_per_pass(int64_t M) { return wide_rows(M) ? kWideRows : kGemvRows; }

// M rows of x [M, K] as k-pairs (P per row), zero past K: x itself where K fills whole 32-wide groups and x is
// 4-byte aligned, else a padded copy in `padded`
inline const uint32_t* k_pairs(const uint16_t* xs, int64_t M, int64_t K, int64_t P, std::vector<uint32_t>& padded) {
  if (2 * P == K && reinterpret_cast<uintptr_t>(xs) % alignof(uint32_t) == 0) {
    return reinterpret_cast<const uint32_t*>(xs);
  }
  padded.assign(M * P, 0);
  for (int64_t m = 0; m < M; ++m) std::memcpy(&padded[m * P], xs + m * K, K * 2);
  return padded.data();
}

// out[m][0:count] for M rows, a run of a call of `all_rows` (at most rows_per_pass(all_rows) of them), and
// `count` (<= 64) outputs from group j on: a whole W = 64 block in one pass where the call takes them wide, else
// group by group.
void gemv_groups(const uint32_t* pairs, int64_t M, int64_t P, const uint16_t* w, int64_t j, uint16_t* out,
                 int64_t out_stride, const uint16_t* bias, int64_t count, int64_t all_rows, Ahead ahead = {}) {
  const int64_t stride = row_stride();
  if (count > kBlock && wide_rows(all_rows) && j % 2 == 0) {
    return kGemvWide[M - 1](pairs, P, group_data(w, j, P), stride, out, out_stride, bias, count, ahead);
  }
  for (int64_t g = 0; g * kBlock < count; ++g) {
    kGemv[M - 1](pairs, P, group_data(w, j + g, P), stride, out + g * kBlock, out_stride,
                 bias != nullptr ? bias + g * kBlock : nullptr, std::min(kBlock, count - g * kBlock),
                 g == 0 ? ahead : Ahead{});
  }
}

// Run `run` of `runs` (rows split by quire::row_run) of a call of M rows, over block unit b (a W-output block: groups b
// and b + 1 where W = 64): `count` outputs to out and bias (offset to the unit's output 0 of row 0, bias null or
// offset likewise). Runs after the first bring the next block into the L2 cache, a share each, where `next` (the
// same thread reads it next): its first run then finds the weight there instead of waiting for memory.
inline void gemv_unit(const uint32_t* pairs, int64_t M, int64_t P, const uint16_t* w, int64_t b, int64_t run,
                      int64_t runs, bool next, uint16_t* out, int64_t out_stride, const uint16_t* bias,
                      int64_t count, quire::SlabQueue* queue = nullptr) {
  const auto [r0, rows] = quire::row_run(M, runs, run);
  Ahead ahead;
  if (run == 0 && queue != nullptr && queue->next < queue->count) {
    const int64_t take = std::min(queue->per_unit, queue->count - queue->next);
    ahead.slabs = queue->slabs + queue->next;
    ahead.slab_lines = queue->slab_lines;
    ahead.bytes = take * queue->slab_lines * 64;
    queue->next += take;
  } else if (run > 0 && next) {
    const int64_t block_bytes = P * 2 * block_width() * 2, share = (block_bytes + runs - 2) / (runs - 1);
    const char* later = reinterpret_cast<const char*>(group_data(w, b + block_width() / kBlock, P));
    const int64_t from = (run - 1) * share;
    ahead = {later + from, std::min(share, block_bytes - from)};
  }
  gemv_groups(pairs + r0 * P, rows, P, w, b, out + r0 * out_stride, out_stride, bias, count, M, ahead);
}

#endif  // QUIRE_ONEDNN_GEMV

#ifdef QUIRE_ONEDNN_AMX

// The packed weight `bytes` further on from 8 KB past `rows` (a k-step's share: 2 KB for 32 rows, 4 KB for two
// k-steps of 16), every fourth line, into L2: the hardware brings each line's neighbours, and the tile loads,
// which wait on memory otherwise, find them there. 30 layers' linears from memory, back to back: 3-6% faster at 9
// to 64 rows (e.g. 32 rows 389 -> 366 us a layer), level at 128; in a whole decode step (attention between them)
// 0.5-2% (16-32 rows). Prefetching every line, or into L1, or 12 KB ahead was no better. Past a thread's last
// block (or the weight's end) it asks for lines nobody reads: a prefetch never faults.
inline void prefetch_weight_ahead(const uint16_t* rows, int64_t bytes) {
  const uintptr_t from = reinterpret_cast<uintptr_t>(rows) + 8192;
  for (int64_t offset = 0; offset < bytes; offset += 256) {
    _mm_prefetch(reinterpret_cast<const char*>(from + offset), _MM_HINT_T1);
  }
}

// Tiles (quire::full_tile_config) 0-3: the float32 sums of 32 rows x 32 outputs; 4-5: 16 rows of x (32 k)
// each; 6-7: 16 k-pairs of 16 outputs each, read from the packed block's 128-byte rows.
// sums[32 x 32] (row stride 32) = x rows [32, Kp] (row stride Kp) . one packed block of 32 outputs.
// (W = 32 only: onednn_gemv_max_rows offers more than 8 rows just then.)
inline void amx_block(const uint16_t* x, int64_t Kp, const uint16_t* block, float* sums, bool ahead) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < Kp; k += 32) {
    const uint16_t* rows = block + (k / 2) * 2 * kBlock;  // 16 k-pairs from k on
    if (ahead) prefetch_weight_ahead(rows, 2048);
    _tile_loadd(4, x + k, Kp * 2);
    _tile_loadd(5, x + 16 * Kp + k, Kp * 2);
    _tile_loadd(6, rows, 4 * kBlock);          // outputs 0-15 of each k-pair
    _tile_loadd(7, rows + kBlock, 4 * kBlock);  // outputs 16-31
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, sums, 32 * 4);
  _tile_stored(1, sums + 16, 32 * 4);
  _tile_stored(2, sums + 16 * 32, 32 * 4);
  _tile_stored(3, sums + 16 * 32 + 16, 32 * 4);
}

// The same for 16 rows (9 to 16 rows of x, padded to 16): tiles 0-1 hold the sums of 16 rows x 32 outputs, which
// leaves operand tiles for two k-steps in flight (2: x, 3-4: the k-pairs of outputs 0-15 and 16-31; then 5, 6-7),
// so a k-step's loads need not wait until the step before has read its tiles. 30 layers of SmolLM2-135M's linears
// at 16 rows, weights from memory, two AMX cores: 9.2 ms against 11.0 for the 32-row tiles above (padded from 16),
// 4.7 against 5.9 with the weights in cache; at 32 rows two such passes were no faster than amx_block. Each sum
// takes the k-steps in amx_block's order: the same bits.
inline void amx_block16(const uint16_t* x, int64_t Kp, const uint16_t* block, float* sums, bool ahead) {
  _tile_zero(0);
  _tile_zero(1);
  int64_t k = 0;
  for (; k + 64 <= Kp; k += 64) {
    const uint16_t* rows = block + (k / 2) * 2 * kBlock;  // 16 k-pairs from k on; the next 16 from 32 * kBlock on
    if (ahead) prefetch_weight_ahead(rows, 4096);
    _tile_loadd(2, x + k, Kp * 2);
    _tile_loadd(3, rows, 4 * kBlock);
    _tile_dpbf16ps(0, 2, 3);
    _tile_loadd(4, rows + kBlock, 4 * kBlock);
    _tile_dpbf16ps(1, 2, 4);
    _tile_loadd(5, x + k + 32, Kp * 2);
    _tile_loadd(6, rows + 32 * kBlock, 4 * kBlock);
    _tile_dpbf16ps(0, 5, 6);
    _tile_loadd(7, rows + 33 * kBlock, 4 * kBlock);
    _tile_dpbf16ps(1, 5, 7);
  }
  if (k < Kp) {  // an odd number of 32-wide k-steps: the last one
    const uint16_t* rows = block + (k / 2) * 2 * kBlock;
    _tile_loadd(2, x + k, Kp * 2);
    _tile_loadd(3, rows, 4 * kBlock);
    _tile_dpbf16ps(0, 2, 3);
    _tile_loadd(4, rows + kBlock, 4 * kBlock);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, sums, 32 * 4);
  _tile_stored(1, sums + 16, 32 * 4);
}

// Groups [first, last) of a packed weight (32 outputs each, W = 32) for `whole` rows of x (a multiple of 32, read
// 32 at a time) and then `tail` rows of `tail_x` (read 16 at a time up to 16 rows, else 32: rows past `tail` there
// are zeros); x rows are Kp bfloat16 (zero past K). out[r * out_stride + c] = x[r] . w[32 * first + c] (+ bias[c])
// for the first `count` outputs from group `first` on. The caller has loaded full_tile_config.
void amx_groups(const uint16_t* x, int64_t whole, const uint16_t* tail_x, int64_t tail, int64_t Kp, const uint16_t* w,
                int64_t first, int64_t last, const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t count) {
  const int64_t tail_pass = tail > 16 ? 32 : 16;
  alignas(64) float sums[32 * 32];
  for (int64_t b = first; b < last; ++b) {
    const uint16_t* block = group_data(w, b, Kp / 2);
    const int64_t c0 = (b - first) * kBlock, n = std::min(kBlock, count - c0);
    if (n <= 0) break;
    const uint16_t* block_bias = bias != nullptr ? bias + c0 : nullptr;
    auto store = [&](int64_t r0, int64_t rows) {
      for (int64_t r = 0; r < rows; ++r) {
        uint16_t* dst = out + (r0 + r) * out_stride + c0;
        store16(dst, _mm512_load_ps(sums + r * 32), block_bias, std::min<int64_t>(n, 16));
        if (n > 16) {
          store16(dst + 16, _mm512_load_ps(sums + r * 32 + 16), block_bias != nullptr ? block_bias + 16 : nullptr,
                  n - 16);
        }
      }
    };
    for (int64_t r0 = 0; r0 < whole; r0 += 32) {
      amx_block(x + r0 * Kp, Kp, block, sums, r0 == 0);  // (later passes find the block in cache)
      store(r0, 32);
    }
    for (int64_t r0 = 0; r0 < tail; r0 += tail_pass) {
      if (tail_pass == 16) {
        amx_block16(tail_x + r0 * Kp, Kp, block, sums, whole + r0 == 0);
      } else {
        amx_block(tail_x + r0 * Kp, Kp, block, sums, whole + r0 == 0);
      }
      store(whole + r0, std::min(tail_pass, tail - r0));
    }
  }
}

#endif  // QUIRE_ONEDNN_AMX

#ifdef QUIRE_ONEDNN_AMX
// The rows of x as amx_groups takes them: rows [0, whole) 32 at a time from x itself (its rows fill whole tiles);
// the rest in 16-row passes (up to 16 rows: amx_block16) or 32-row ones, from a zero-padded copy unless they are
// 16 rows of x. (A 48-row call took 16 rows of x as 32 padded ones before: 30 layers' linears from memory 21.0 ->
// 17.4 ms.)
struct AmxRows {
  AmxRows(const torch::Tensor& x, const uint16_t* xs, int64_t M, int64_t K, int64_t Kp)
      : xs(xs), Kp(Kp), whole(Kp != K ? 0 : M - M % 32), tail(M - whole) {
    const int64_t tail_pass = tail > 16 ? 32 : 16;
    const bool tail_in_place = Kp == K && tail == tail_pass;  // 16 rows of x after whole ones
    if (tail > 0 && !tail_in_place) {
      padding = torch::zeros({tail_pass * ((tail + tail_pass - 1) / tail_pass), Kp}, x.options());
      auto* dst = reinterpret_cast<uint16_t*>(padding.data_ptr<at::BFloat16>());
      for (int64_t m = 0; m < tail; ++m) std::memcpy(dst + m * Kp, xs + (whole + m) * K, K * 2);
      copy = dst;
    } else {
      copy = xs + whole * Kp;
    }
  }
  // amx_groups over these rows (the caller has loaded full_tile_config)
  void groups(const uint16_t* w, int64_t first, int64_t last, const uint16_t* bias, uint16_t* out, int64_t out_stride,
              int64_t count) const {
    amx_groups(xs, whole, copy, tail, Kp, w, first, last, bias, out, out_stride, count);
  }
  const uint16_t* xs;
  int64_t Kp, whole, tail;
  torch::Tensor padding;
  const uint16_t* copy = nullptr;
};
#endif

}  // namespace

int64_t onednn_gemv_max_rows() {
#if defined(QUIRE_ONEDNN_AMX)
  if (quire::amx_permitted() && g_width.load() != 2 * kBlock) return kMaxRows;
#endif
#if defined(QUIRE_ONEDNN_GEMV)
  return g_width.load() == 2 * kBlock ? kWideMaxRows : kGemvRows;
#else
  return 0;
#endif
}

bool onednn_gemv_layout(torch::Tensor packed) {
#ifdef QUIRE_ONEDNN_GEMV
  if (!packed.is_mkldnn() || packed.scalar_type() != at::kBFloat16 || packed.dim() != 2) return false;
  const int64_t N = packed.size(0), K = packed.size(1), Kp = quire::round_up(K, kBlock);
  const auto dense = packed.to_dense().contiguous();
  const auto* plain = reinterpret_cast<const uint16_t*>(dense.data_ptr<at::BFloat16>());
  const auto* raw = static_cast<const uint16_t*>(at::native::data_ptr_from_mkldnn(packed));
  const int64_t bytes = at::native::nbytes_from_mkldnn(packed);
  auto laid_out = [&](int64_t W) {
    const int64_t Np = quire::round_up(N, W);
    if (bytes != Np * Kp * 2) return false;
    for (int64_t n = 0; n < Np; ++n) {
      for (int64_t k = 0; k < Kp; ++k) {
        const uint16_t expected = n < N && k < K ? plain[n * K + k] : 0;
        if (raw[((n / W) * (Kp / 2) + k / 2) * 2 * W + (n % W) * 2 + k % 2] != expected) return false;
      }
    }
    return true;
  };
  for (const int64_t W : {kBlock, 2 * kBlock}) {
    if (!laid_out(W)) continue;
    int64_t unset = 0;
    return g_width.compare_exchange_strong(unset, W) || unset == W;  // another W than the process's: refused
  }
  return false;
#else
  (void)packed;
  return false;
#endif
}

namespace quire {

int64_t onednn_gemv_block_groups() {
  return g_width.load(std::memory_order_relaxed) == 2 * kBlock ? 2 : 1;
}

bool onednn_gemv_blocks_available() {
#ifdef QUIRE_ONEDNN_GEMV
  return true;
#else
  return false;
#endif
}

const uint16_t* onednn_packed_data(const torch::Tensor& packed) {
  return static_cast<const uint16_t*>(at::native::data_ptr_from_mkldnn(packed));
}

void onednn_gemv_block(const uint32_t* pairs, int64_t rows, int64_t P, const uint16_t* packed_data, int64_t block,
                       const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t count) {
#ifdef QUIRE_ONEDNN_GEMV
  gemv_groups(pairs, rows, P, packed_data, block, out, out_stride, bias, count, rows);
#else
  (void)pairs, (void)rows, (void)P, (void)packed_data, (void)block, (void)bias, (void)out, (void)out_stride,
      (void)count;
  TORCH_CHECK(false, "onednn_gemv_block: this build has no AVX-512 BF16");
#endif
}

int64_t onednn_amx_max_rows() {
#ifdef QUIRE_ONEDNN_AMX
  return quire::amx_permitted() && g_width.load() == kBlock ? kMaxRows : 0;
#else
  return 0;
#endif
}

int64_t onednn_wide_max_rows() {
#ifdef QUIRE_ONEDNN_GEMV
  return g_width.load() == 2 * kBlock ? kWideMaxRows : 0;
#else
  return 0;
#endif
}

void onednn_wide_groups(const uint32_t* pairs, int64_t rows, int64_t P, const uint16_t* packed_data, int64_t first,
                        int64_t last, const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t count,
                        SlabQueue* queue) {
#ifdef QUIRE_ONEDNN_GEMV
  const int64_t unit = onednn_gemv_block_groups(), per_pass = rows_per_pass(rows);
  const int64_t runs = (rows + per_pass - 1) / per_pass;
  for (int64_t b = first; b < last; b += unit) {
    const int64_t c0 = (b - first) * kBlock;
    if (c0 >= count) break;
    for (int64_t run = 0; run < runs; ++run) {
      gemv_unit(pairs, rows, P, packed_data, b, run, runs, b + unit < last, out + c0, out_stride,
                bias != nullptr ? bias + c0 : nullptr, std::min(unit * kBlock, count - c0), queue);
    }
  }
#else
  (void)pairs, (void)rows, (void)P, (void)packed_data, (void)first, (void)last, (void)bias, (void)out,
      (void)out_stride, (void)count, (void)queue;
  TORCH_CHECK(false, "onednn_wide_groups: this build has no AVX-512 BF16");
#endif
}

void onednn_amx_groups(const uint16_t* x, int64_t rows, int64_t Kp, const uint16_t* packed_data, int64_t first,
                       int64_t last, const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t count) {
#ifdef QUIRE_ONEDNN_AMX
  const int64_t whole = rows - rows % 32;
  _tile_loadconfig(&full_tile_config());
  amx_groups(x, whole, x + whole * Kp, rows - whole, Kp, packed_data, first, last, bias, out, out_stride, count);
  _tile_release();
#else
  (void)x, (void)rows, (void)Kp, (void)packed_data, (void)first, (void)last, (void)bias, (void)out,
      (void)out_stride, (void)count;
  TORCH_CHECK(false, "onednn_amx_groups: this build has no AMX");
#endif
}

}  // namespace quire

torch::Tensor onednn_gemv(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
#ifdef QUIRE_ONEDNN_GEMV
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "onednn_gemv: x must be [M, K] bfloat16");
  TORCH_CHECK(packed.is_mkldnn() && packed.dim() == 2, "onednn_gemv: the weight must be packed by oneDNN");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(M <= onednn_gemv_max_rows(), "onednn_gemv: at most ", onednn_gemv_max_rows(), " rows, got ", M);
  TORCH_CHECK(packed.size(1) == K, "onednn_gemv: x has ", K, " columns, the weight ", packed.size(1));
  TORCH_CHECK(g_width.load() != 0, "onednn_gemv: no packed weight has passed onednn_gemv_layout yet");
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "onednn_gemv: bias must have ", N, " elements");
    bias_c = bias->to(at::kBFloat16).contiguous();
  }
  const auto* bias_p = bias_c.defined() ? reinterpret_cast<const uint16_t*>(bias_c.data_ptr<at::BFloat16>()) : nullptr;
  const int64_t P = quire::round_up(K, kBlock) / 2, blocks = quire::round_up(N, kBlock) / kBlock;
  const auto xc = x.contiguous();
  const auto* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* w = static_cast<const uint16_t*>(at::native::data_ptr_from_mkldnn(packed));
  auto* y = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
#ifdef QUIRE_ONEDNN_AMX
  if (M > kGemvRows && quire::amx_permitted() && g_width.load() != 2 * kBlock) {
    const AmxRows rows(x, xs, M, K, 2 * P);
    quire::parallel_chunks(0, blocks, quire::chunk_size(blocks, 1, 4), [&](int64_t begin, int64_t end) {
      _tile_loadconfig(&quire::full_tile_config());  // per thread and call: oneDNN's kernels load their own
      rows.groups(w, begin, end, bias_p != nullptr ? bias_p + begin * kBlock : nullptr, y + begin * kBlock, N,
                  N - begin * kBlock);
      _tile_release();
    });
    return out;
  }
#endif
  std::vector<uint32_t> padded;
  const uint32_t* pairs = k_pairs(xs, M, K, P, padded);
  // work units: a block (W outputs) by a run of rows, block-major, so that each thread mostly reads its own
  // blocks from memory and the threads stay level where the blocks are few (576 outputs: 9 blocks)
  const int64_t unit = quire::onednn_gemv_block_groups(), block_units = (blocks + unit - 1) / unit;
  const int64_t per_pass = rows_per_pass(M), runs = (M + per_pass - 1) / per_pass;
  const int64_t units = block_units * runs;
  quire::parallel_chunks(0, units, quire::chunk_size(units, 1, 4), [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = (u / runs) * unit;
      gemv_unit(pairs, M, P, w, b, u % runs, runs, (u / runs + 1) * runs < end, y + b * kBlock, N,
                bias_p != nullptr ? bias_p + b * kBlock : nullptr, std::min(unit * kBlock, N - b * kBlock));
    }
  });
  return out;
#else
  (void)x;
  (void)packed;
  (void)bias;
  TORCH_CHECK(false, "onednn_gemv: this build has no AVX-512 BF16");
#endif
}

// ---- each row's argmax of onednn_gemv's logits, without writing them ----
//
// From 9 rows (decode steps of a busy server or a batch) onednn_gemv computes an LM head on AMX tiles, or in runs
// of rows on oneDNN's 64-output blocks, and writes every logit, which the sampler then reads back for a plain
// greedy step's argmax: SmolLM2-135M's head at 64 rows writes and reads 6.3 MB for 64 indices. Here each thread
// computes its blocks with the same kernel call into a block-sized buffer and keeps, per row and lane, the largest
// value so far and its block; the lanes and threads are then merged (first index on a tie), so the token is
// argmax(onednn_gemv(x, packed)) exactly. Empty (the caller computes the logits) where x is not finite or a logit
// is NaN.
#ifdef QUIRE_ONEDNN_GEMV
namespace {

// The running argmax of M rows over blocks of `width` outputs (a multiple of 16).
class LaneArgmax {
 public:
  LaneArgmax(int64_t M, int64_t width) : M_(M), width_(width), best_(M * width, -INFINITY), block_(M * width, -1) {}

  // logits[m * width + c] for the first n outputs of block b
  void update(const uint16_t* logits, int64_t b, int64_t n) {
    const __m512i block = _mm512_set1_epi32(static_cast<int32_t>(b));
    for (int64_t h = 0; 16 * h < n; ++h) {
      const int64_t left = n - 16 * h;
      const __mmask16 valid = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
      for (int64_t m = 0; m < M_; ++m) {
        const int64_t at = m * width_ + 16 * h;
        const __m512 v = quire::bf16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(logits + at)));
        nan_lanes_ |= _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
        const __mmask16 larger = _mm512_mask_cmp_ps_mask(valid, v, _mm512_loadu_ps(&best_[at]), _CMP_GT_OQ);
        _mm512_mask_storeu_ps(&best_[at], larger, v);
        _mm512_mask_storeu_epi32(&block_[at], larger, block);
      }
    }
  }

  // into each row's best value and index (the first index on a tie); false if a logit was NaN
  bool merge_into(std::vector<float>& best, std::vector<int64_t>& index) const {
    for (int64_t m = 0; m < M_; ++m) {
      for (int64_t lane = 0; lane < width_; ++lane) {
        const int32_t from = block_[m * width_ + lane];
        if (from < 0) continue;
        const float v = best_[m * width_ + lane];
        const int64_t at = static_cast<int64_t>(from) * width_ + lane;
        if (index[m] < 0 || v > best[m] || (v == best[m] && at < index[m])) {
          best[m] = v;
          index[m] = at;
        }
      }
    }
    return nan_lanes_ == 0;
  }

 private:
  int64_t M_, width_;
  std::vector<float> best_;
  std::vector<int32_t> block_;
  __mmask16 nan_lanes_ = 0;
};

// M, K and N of an argmax call's x [M, K] (bfloat16) and oneDNN-packed weight [N, K], checked
std::array<int64_t, 3> argmax_shape(const char* name, const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": x must be [M, K] bfloat16");
  TORCH_CHECK(packed.is_mkldnn() && packed.dim() == 2, name, ": the weight must be packed by oneDNN");
  TORCH_CHECK(packed.size(1) == x.size(1), name, ": x has ", x.size(1), " columns, the weight ", packed.size(1));
  return {x.size(0), x.size(1), packed.size(0)};
}

// The argmax of M rows, each thread running compute(begin, end, argmax) over its share of `blocks` blocks of
// `width` outputs: an int64 [M] tensor, or empty where x is not finite, a logit was NaN or a row saw only -inf.
template <typename F>
torch::Tensor rows_argmax(const torch::Tensor& x, const uint16_t* xs, int64_t M, int64_t K, int64_t blocks,
                          int64_t width, F&& compute) {
  auto none = torch::empty({0}, x.options().dtype(at::kLong));
  for (int64_t i = 0; i < M * K; ++i) {
    if ((xs[i] & 0x7F80) == 0x7F80) return none;  // inf or NaN
  }
  std::vector<float> best(M, -INFINITY);
  std::vector<int64_t> index(M, -1);
  std::atomic<bool> saw_nan{false};
  std::mutex merge_lock;
  quire::parallel_chunks(0, blocks, quire::chunk_size(blocks, 1, 4), [&](int64_t begin, int64_t end) {
    LaneArgmax argmax(M, width);
    compute(begin, end, argmax);
    std::lock_guard<std::mutex> guard(merge_lock);
    if (!argmax.merge_into(best, index)) saw_nan.store(true, std::memory_order_relaxed);
  });
  if (saw_nan.load()) return none;
  auto tokens = torch::empty({M}, x.options().dtype(at::kLong));
  auto* out = tokens.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    if (index[m] < 0) return none;  // (every logit -inf: no lane ever took a value)
    out[m] = index[m];
  }
  return tokens;
}

}  // namespace
#endif  // QUIRE_ONEDNN_GEMV

torch::Tensor onednn_amx_argmax(torch::Tensor x, torch::Tensor packed) {
#ifdef QUIRE_ONEDNN_AMX
  const auto shape = argmax_shape("onednn_amx_argmax", x, packed);
  const int64_t M = shape[0], K = shape[1], N = shape[2];
  if (M <= kGemvRows || M > quire::onednn_amx_max_rows() || N == 0) {
    return torch::empty({0}, x.options().dtype(at::kLong));
  }
  const auto xc = x.contiguous();
  const auto* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const int64_t P = quire::round_up(K, kBlock) / 2, blocks = quire::round_up(N, kBlock) / kBlock;
  const auto* w = static_cast<const uint16_t*>(at::native::data_ptr_from_mkldnn(packed));
  const AmxRows rows(x, xs, M, K, 2 * P);
  return rows_argmax(x, xs, M, K, blocks, kBlock, [&](int64_t begin, int64_t end, LaneArgmax& argmax) {
    _tile_loadconfig(&quire::full_tile_config());
    std::vector<uint16_t> logits(M * kBlock);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = std::min(kBlock, N - b * kBlock);
      rows.groups(w, b, b + 1, nullptr, logits.data(), kBlock, n);
      argmax.update(logits.data(), b, n);
    }
    _tile_release();
  });
#else
  (void)packed;
  return torch::empty({0}, x.options().dtype(at::kLong));
#endif
}

// The same on oneDNN's 64-output blocks (AVX-512 BF16 without AMX), 1 to onednn_wide_max_rows rows: each block
// through onednn_wide_groups (onednn_gemv's runs of rows, the claim's next block brought into L2 by the later
// runs), so the bits of onednn_gemv's logits. (From 3 rows this is faster than the int16 screen below.)
torch::Tensor onednn_wide_argmax(torch::Tensor x, torch::Tensor packed) {
#ifdef QUIRE_ONEDNN_GEMV
  const auto shape = argmax_shape("onednn_wide_argmax", x, packed);
  const int64_t M = shape[0], K = shape[1], N = shape[2];
  const int64_t width = 2 * kBlock;
  if (M < 1 || M > quire::onednn_wide_max_rows() || N == 0) {
    return torch::empty({0}, x.options().dtype(at::kLong));
  }
  const auto xc = x.contiguous();
  const auto* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const int64_t P = quire::round_up(K, kBlock) / 2, blocks = quire::round_up(N, width) / width;
  std::vector<uint32_t> padded;
  const uint32_t* pairs = k_pairs(xs, M, K, P, padded);
  const auto* w = static_cast<const uint16_t*>(at::native::data_ptr_from_mkldnn(packed));
  const int64_t groups = quire::round_up(N, kBlock) / kBlock;
  return rows_argmax(x, xs, M, K, blocks, width, [&](int64_t begin, int64_t end, LaneArgmax& argmax) {
    std::vector<uint16_t> logits(M * width);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = std::min(width, N - b * width);
      // groups 2b and 2b + 1; the next block's groups are in range where this thread computes it next
      quire::onednn_wide_groups(pairs, M, P, w, 2 * b, std::min(groups, 2 * std::min(b + 2, end)), nullptr,
                                logits.data(), width, n);
      argmax.update(logits.data(), b, n);
    }
  });
#else
  (void)packed;
  return torch::empty({0}, x.options().dtype(at::kLong));
#endif
}

// ---- greedy tokens from an LM head without computing every logit ----
//
// A plain greedy step needs only the argmax of each row's logits. An int8 copy of the head (one scale per
// output, `greedy_head_*` in Python) screens the vocabulary at half the bytes: with x rounded to int16, each
// approximate logit is an exact integer dot product times two scales, and a bound on its distance to the
// logit onednn_gemv would compute (the weight's and x's rounding, float32 summation, bfloat16 output
// rounding) leaves only the outputs whose upper bound reaches the best lower bound. Only their 32-output
// blocks are then computed the way onednn_gemv computes them (gemv_block<1, 1>, the same bits at every batch size
// up to 8), so the token is exactly onednn_gemv's argmax: the first index of the largest bfloat16 logit.
// Returns an empty tensor where it cannot decide cheaply (x not finite or all zero, too many candidates):
// the caller then computes the full logits.

#if defined(QUIRE_ONEDNN_GEMV) && defined(__AVX512VNNI__)
#define QUIRE_GREEDY_HEAD 1
#endif

namespace {
constexpr int64_t kGreedyMaxRows = kGemvRows;
constexpr int64_t kGreedyMaxBlocks = 64;  // candidate blocks past this: the full head is as cheap
#ifdef QUIRE_GREEDY_HEAD
// Lane j of the result: the sum of the sixteen lanes of v[j] (integers: exact).
inline __m512i sum_lanes16_epi32(const __m512i v[16]) {
  __m512i pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    quads[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[2 * i], pairs[2 * i + 1]),
                                _mm512_unpackhi_epi64(pairs[2 * i], pairs[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                 _mm512_shuffle_i32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(halves[0], halves[1], 0x88),
                          _mm512_shuffle_i32x4(halves[0], halves[1], 0xDD));
}
#endif
}  // namespace

bool greedy_head_supported() {
#ifdef QUIRE_GREEDY_HEAD
  return true;
#else
  return false;
#endif
}

torch::Tensor greedy_head_tokens(torch::Tensor x, torch::Tensor packed, torch::Tensor q, torch::Tensor scale,
                                 torch::Tensor bound) {
#ifdef QUIRE_GREEDY_HEAD
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "greedy_head_tokens: x must be [M, K] bfloat16");
  TORCH_CHECK(packed.is_mkldnn() && packed.dim() == 2, "greedy_head_tokens: the head must be packed by oneDNN");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && q.dim() == 2 && q.size(0) == N && q.size(1) == K && q.scalar_type() == at::kChar &&
                  q.is_contiguous(), "greedy_head_tokens: q must be int8 [N, K]");
  TORCH_CHECK(scale.numel() == N && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "greedy_head_tokens: scale must be float32 [N]");
  TORCH_CHECK(bound.dim() == 2 && bound.size(0) == 3 && bound.size(1) == N && bound.scalar_type() == at::kFloat &&
                  bound.is_contiguous(), "greedy_head_tokens: bound must be float32 [3, N]");
  auto none = torch::empty({0}, x.options().dtype(at::kLong));
  // (no weight accepted by onednn_gemv_layout yet: the head's layout is unknown)
  if (M == 0 || M > kGreedyMaxRows || K % 32 != 0 || g_width.load() == 0) return none;
  const auto xc = x.contiguous();
  const auto* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  quire::screen::QuantizedRows rows;
  if (!quire::screen::quantize_rows(M, K, [&](int64_t i) { return quire::bf16_to_float(xs[i]); }, rows)) return none;
  const std::vector<int16_t>& xq = rows.xq;
  const std::vector<double> &l1 = rows.l1, &step = rows.step, &x_error = rows.x_error;
  const auto* qs = q.data_ptr<int8_t>();
  const float* row_scale = scale.data_ptr<float>();
  // bound rows: [0] the largest |w - scale q| of each output, [1] sum |q|, [2] the largest |w|
  const float* w_error = bound.data_ptr<float>();
  const float* q_l1 = w_error + N;
  const float* w_max = w_error + 2 * N;
  std::vector<float> approx(M * N), radius(M * N);
  const double summation = quire::screen::summation_error(K);
  std::vector<double> best_lower(M, -INFINITY);  // of each row, over every output
  std::mutex best_lock;
  const int64_t chunk = quire::chunk_size(N, 64, 8);
  const int64_t chunks = K / 32;
  // float32 copies of the per-row terms, each rounded up (the bound's own float32 arithmetic is covered by
  // the 2^-20 margins below)
  float l1_f[kGreedyMaxRows], step_f[kGreedyMaxRows], x_error_f[kGreedyMaxRows];
  for (int64_t m = 0; m < M; ++m) {
    l1_f[m] = static_cast<float>(l1[m] * (1.0 + 1e-6));
    step_f[m] = static_cast<float>(step[m]);
    x_error_f[m] = static_cast<float>(x_error[m] * (1.0 + 1e-6));
  }
  // the groups ahead into L1 (Intel: oneDNN's 32-wide blocks), or into L2 with its 64-wide blocks (AMD Zen 4,
  // whose 32 KB L1 the group in hand, the next and the one asked for nearly fill: SmolLM2-135M at batch 1 in
  // the engine, the two alternated in one process, 1.04-1.12x the tokens/s in three runs)
  const bool into_l2 = block_width() == 2 * kBlock;
  quire::parallel_chunks(0, N, chunk, [&](int64_t begin, int64_t end) {
    double chunk_lower[kGreedyMaxRows];
    for (int64_t m = 0; m < M; ++m) chunk_lower[m] = -INFINITY;
    int64_t n = begin;
    // sixteen outputs at a time: their integer dot products summed across lanes together, the bounds in vectors
    for (; n + 16 <= end; n += 16) {
      const int8_t* rows = qs + n * K;
      // the group after next, all of it: the sixteen rows are read across, not front to back (SmolLM2-135M's
      // head at batch 1: 1.56 ms without, 1.24 with)
      if (n + 48 <= end) {
        const char* ahead = reinterpret_cast<const char*>(rows + 32 * K);
        if (into_l2) {
          for (int64_t offset = 0; offset < 16 * K; offset += 64) _mm_prefetch(ahead + offset, _MM_HINT_T1);
        } else {
          for (int64_t offset = 0; offset < 16 * K; offset += 64) _mm_prefetch(ahead + offset, _MM_HINT_T0);
        }
      }
      const __m512 scale16 = _mm512_loadu_ps(row_scale + n), error16 = _mm512_loadu_ps(w_error + n);
      const __m512 l1q16 = _mm512_loadu_ps(q_l1 + n), wmax16 = _mm512_loadu_ps(w_max + n);
      for (int64_t m = 0; m < M; ++m) {
        __m512i acc[16];
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_si512();
        for (int64_t c = 0; c < chunks; ++c) {
          const __m512i xv = _mm512_loadu_si512(&xq[m * K + 32 * c]);
          for (int r = 0; r < 16; ++r) {
            const __m512i w = _mm512_cvtepi8_epi16(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + r * K + 32 * c)));
            acc[r] = _mm512_dpwssd_epi32(acc[r], w, xv);
          }
        }
        const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(sum_lanes16_epi32(acc)),
                                       _mm512_mul_ps(scale16, _mm512_set1_ps(step_f[m])));
        __m512 r = _mm512_mul_ps(error16, _mm512_set1_ps(l1_f[m]));
        r = _mm512_fmadd_ps(_mm512_mul_ps(scale16, l1q16), _mm512_set1_ps(x_error_f[m]), r);
        r = _mm512_fmadd_ps(wmax16, _mm512_set1_ps(static_cast<float>(summation * l1[m] * (1.0 + 1e-6))), r);
        const __m512 margin = _mm512_set1_ps(std::ldexp(1.f, -20));
        r = _mm512_fmadd_ps(r, margin, r);
        r = _mm512_fmadd_ps(_mm512_abs_ps(a), margin, r);
        r = _mm512_add_ps(r, _mm512_set1_ps(1e-30f));
        _mm512_storeu_ps(&approx[m * N + n], a);
        _mm512_storeu_ps(&radius[m * N + n], r);
        chunk_lower[m] = std::max(chunk_lower[m], static_cast<double>(_mm512_reduce_max_ps(_mm512_sub_ps(a, r))));
      }
    }
    for (; n < end; ++n) {
      const int8_t* row = qs + n * K;
      __m512i acc[kGreedyMaxRows];
      for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
        for (int64_t m = 0; m < M; ++m)
          acc[m] = _mm512_dpwssd_epi32(acc[m], w, _mm512_loadu_si512(&xq[m * K + 32 * c]));
      }
      for (int64_t m = 0; m < M; ++m) {
        const double dot = static_cast<double>(_mm512_reduce_add_epi32(acc[m]));
        const double a = dot * row_scale[n] * step[m];
        const double r = quire::screen::radius(w_error[n], row_scale[n], q_l1[n], w_max[n], l1[m], x_error[m],
                                               summation);
        approx[m * N + n] = static_cast<float>(a);
        radius[m * N + n] = static_cast<float>(r * (1.0 + 1e-6) + std::fabs(a) * 1e-6);
        chunk_lower[m] = std::max(chunk_lower[m], a - r);
      }
    }
    std::lock_guard<std::mutex> guard(best_lock);
    for (int64_t m = 0; m < M; ++m) best_lower[m] = std::max(best_lower[m], chunk_lower[m]);
  });
  auto tokens = torch::empty({M}, x.options().dtype(at::kLong));
  auto* out = tokens.data_ptr<int64_t>();
  const int64_t P = quire::round_up(K, kBlock) / 2;
  const auto* w = static_cast<const uint16_t*>(at::native::data_ptr_from_mkldnn(packed));
  for (int64_t m = 0; m < M; ++m) {
    const double lower = best_lower[m];
    const double cut = quire::screen::cut_below(lower);
    std::vector<int64_t> blocks;
    for (int64_t n = 0; n < N; ++n) {
      if (static_cast<double>(approx[m * N + n]) + static_cast<double>(radius[m * N + n]) >= cut) {
        if (blocks.empty() || blocks.back() != n / kBlock) blocks.push_back(n / kBlock);
        if (static_cast<int64_t>(blocks.size()) > kGreedyMaxBlocks) return none;
      }
    }
    std::vector<uint32_t> pairs(P, 0);
    std::memcpy(pairs.data(), xs + m * K, K * 2);
    float best = -INFINITY;
    int64_t token = -1;
    alignas(64) uint16_t logits[kBlock];
    for (const int64_t b : blocks) {
      const int64_t count = std::min(kBlock, N - b * kBlock);
      gemv_block<1, 1>(pairs.data(), P, group_data(w, b, P), row_stride(), logits, kBlock, nullptr, count, {});
      for (int64_t i = 0; i < count; ++i) {
        const int64_t n = b * kBlock + i;
        if (static_cast<double>(approx[m * N + n]) + static_cast<double>(radius[m * N + n]) < cut) continue;
        uint32_t bits = static_cast<uint32_t>(logits[i]) << 16;
        float v;
        std::memcpy(&v, &bits, 4);
        if (token < 0 || v > best) {
          best = v;
          token = n;
        }
      }
    }
    if (token < 0 || !std::isfinite(best)) return none;
    out[m] = token;
  }
  return tokens;
#else
  (void)x;
  (void)packed;
  (void)q;
  (void)scale;
  (void)bound;
  TORCH_CHECK(false, "greedy_head_tokens: this build has no AVX-512 VNNI");
#endif
}
