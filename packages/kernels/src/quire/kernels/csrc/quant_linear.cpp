// Linear layers and dequantization for weights kept in GGUF's block formats (and Quire's INT8), on CPUs;
// the formats and their decoders are in quant_blocks.h.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), with FMA into float32 accumulators, by the rows M of x:
// - up to V::kMaxRows (8 with AVX-512, 4 with AVX2; decode batches): each weight row is decoded block by
//   block straight into registers (a block decoder hands each vector of values to a sink, at an offset
//   known at compile time) and multiplied with all M rows of x, so every weight byte is read and decoded
//   once. Batch 1 streams each thread's weight rows front to back: one sequential stream, which the
//   hardware prefetcher follows best (see linear_bf16.cpp).
// - up to kDequantizeBatch: tiles of NR weight rows are decoded into an L1 buffer, a K-chunk at a time,
//   and multiplied with tiles of MR rows of x in MR x NR vector accumulators (as in linear_bf16.cpp): the
//   decoding is shared by every row of x.
// - from kDequantizeBatch rows on (prompts): the weight is decoded into float32 tiles of about 8 MiB that
//   at::mm (MKL / oneDNN) multiplies, faster there than the register tiles.
// - instead of the first, the integer path: at batch 1 on the vector paths, and up to 8 rows for Q4_0, Q4_1 and
//   Q8_0 on AVX-512 VNNI: x is rounded to int16 per group of 32 (before the threads start) and multiplied with the
//   weights' integers (quant_int_dot.h). On the VNNI path a row's result is bit-identical at every batch size
//   up to 8 (speculative decoding verifies 1 + k tokens as the rows of one batch, and its greedy output must
//   be plain decoding's). A row of x holding an infinity or a NaN takes the float32 path at batch 1; a batch
//   with such a row is computed row by row, so that the others keep their results.
// Weight rows are split between threads with quire::parallel_chunks.
//
// The instruction set is chosen at run time (__builtin_cpu_supports), not by the build's -march=native, so
// that every path exists in one build and the AVX2 one can be tested on AVX-512 machines (resolve_isa).
#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "quant_blocks.h"
#include "quant_int_dot.h"

namespace {

using namespace quire::quant;

enum class QType { Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, INT8 };
enum class Isa { Scalar, Avx2, Avx512 };

struct Format {
  int64_t block_elements, block_bytes;
};

QType parse_qtype(const std::string& name) {
  if (name == "Q8_0") return QType::Q8_0;
  if (name == "Q4_0") return QType::Q4_0;
  if (name == "Q4_1") return QType::Q4_1;
  if (name == "Q4_K") return QType::Q4_K;
  if (name == "Q6_K") return QType::Q6_K;
  if (name == "INT8") return QType::INT8;
  TORCH_CHECK(false, "quantized weight: unknown type ", name);
}

Format format_of(QType type) {
  switch (type) {
    case QType::Q8_0: return {Q8_0::kElements, Q8_0::kBytes};
    case QType::Q4_0: return {Q4_0::kElements, Q4_0::kBytes};
    case QType::Q4_1: return {Q4_1::kElements, Q4_1::kBytes};
    case QType::Q4_K: return {Q4_K::kElements, Q4_K::kBytes};
    case QType::Q6_K: return {Q6_K::kElements, Q6_K::kBytes};
    case QType::INT8: return {1, 1};  // any K
  }
  return {1, 1};
}

// ---- linear ----

struct LinearProblem {
  const float* x;  // [M, K] float32
  int64_t M, K, N;
  const uint8_t* w;  // [N, row_bytes]
  int64_t row_bytes;
  const float* row_scale;  // [N] (INT8) or nullptr
  const float* bias;       // [N] or nullptr
  float* y;                // [M, N] when the output is float32
  uint16_t* y_bf16;        // [M, N] when it is bfloat16
#ifdef QUIRE_QUANT_X86
  const QuantizedX* xq = nullptr;  // x rounded to int16 (batch 1): the integer path
  const PairedX* xpairs = nullptr;  // x rounded and paired (batches up to 8: Q4_0, Q4_1, Q8_0 on AVX-512 VNNI)
#endif
};

inline void store_output(const LinearProblem& p, int64_t m, int64_t n, float v) {
  if (p.bias != nullptr) v += p.bias[n];
  if (p.y_bf16 != nullptr) {
    p.y_bf16[m * p.N + n] = c10::BFloat16(v).x;  // rounded to nearest even, as PyTorch does
  } else {
    p.y[m * p.N + n] = v;
  }
}

// out[i][j] += dot(x row i, w row j) over `len` elements, for MR rows of x (row stride ldx) and NR decoded
// weight rows (row stride ldw). Few accumulators (batch 1) are split into chains over consecutive vectors
// so that each FMA does not wait for the one before.
template <class V, int MR, int NR>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t len, float out[MR][NR]) {
  using F = typename V::F;
  constexpr int kChains = MR * NR >= 4 ? 1 : 4;
  // NOTE: every loop over the accumulators is unrolled, so that they stay in registers
  F acc[kChains][MR][NR];
#pragma GCC unroll 32
  for (int c = 0; c < kChains; ++c)
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[c][i][j] = V::zero();
  int64_t k = 0;
  for (; k + kChains * V::L <= len; k += kChains * V::L) {
#pragma GCC unroll 4
    for (int c = 0; c < kChains; ++c) {
      F wv[NR];
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) wv[j] = V::load(w + j * ldw + k + c * V::L);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const F xv = V::load(x + i * ldx + k + c * V::L);
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) acc[c][i][j] = V::fmadd(xv, wv[j], acc[c][i][j]);
      }
    }
  }
  for (; k + V::L <= len; k += V::L) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const F xv = V::load(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[0][i][j] = V::fmadd(xv, V::load(w + j * ldw + k), acc[0][i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      F sum = acc[0][i][j];
#pragma GCC unroll 4
      for (int c = 1; c < kChains; ++c) sum = V::add(sum, acc[c][i][j]);
      out[i][j] += V::hsum(sum);
    }
  for (; k < len; ++k)  // fewer than V::L elements left (INT8 rows only)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) out[i][j] += x[i * ldx + k] * w[j * ldw + k];
}

// Rows [m0, m0 + MR) of x against the decoded rows in w, added to acc ([M][NR]).
template <class V, int MR, int NR>
inline void tile_into(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t len, float* acc) {
  float out[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i][j] = 0.f;
  tile<V, MR, NR>(x, ldx, w, ldw, len, out);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i * NR + j] += out[i][j];
}

// A row tile of `rows` rows (2 to V::kMaxRows): the instantiation for that count.
template <class V, int NR, int MR = V::kMaxRows>
void row_tile(int rows, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t len, float* acc) {
  if (rows == MR) {
    tile_into<V, MR, NR>(x, ldx, w, ldw, len, acc);
  } else if constexpr (MR > 2) {
    row_tile<V, NR, MR - 1>(rows, x, ldx, w, ldw, len, acc);
  }
}

// Decoded weights per tile: NR rows of at most kChunkElements (a multiple of every block size), in L1.
constexpr int64_t kChunkElements = 2048, kMaxTileCols = 3;

// Every row of y for weight rows [n_begin, n_end) (the work of one chunk of parallel_chunks): each tile of
// NR weight rows is decoded once, a chunk of K at a time, and multiplied with every row of x.
template <class V, class Q, int NR>
void linear_tiles(const LinearProblem& p, int64_t n_begin, int64_t n_end) {
  static_assert(NR <= kMaxTileCols, "the decode buffer holds kMaxTileCols rows");
  alignas(64) float decoded[kMaxTileCols * kChunkElements];
  std::vector<float> acc(p.M * NR);
  const int64_t chunk = std::min(p.K, kChunkElements);
  // row tiles of balanced sizes (9 rows: 5 + 4, not 8 + 1)
  const int64_t num_row_tiles = (p.M + V::kMaxRows - 1) / V::kMaxRows;
  for (int64_t n0 = n_begin; n0 < n_end; n0 += NR) {
    const int cols = static_cast<int>(std::min<int64_t>(NR, n_end - n0));
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t k0 = 0; k0 < p.K; k0 += chunk) {
      const int64_t len = std::min(chunk, p.K - k0);
      for (int j = 0; j < NR; ++j) {  // a partial tile repeats its last row
        const int64_t n = n0 + std::min(j, cols - 1);
        decode_row<V, Q>(p.w + n * p.row_bytes, p.row_scale != nullptr ? p.row_scale[n] : 1.f, k0, k0 + len,
                         decoded + j * chunk);
      }
      if (p.M == 1) {
        tile_into<V, 1, NR>(p.x + k0, p.K, decoded, chunk, len, acc.data());
        continue;
      }
      int64_t m0 = 0;
      for (int64_t t = 0; t < num_row_tiles; ++t) {
        const int rows = static_cast<int>(p.M / num_row_tiles + (t < p.M % num_row_tiles ? 1 : 0));
        row_tile<V, NR>(rows, p.x + m0 * p.K + k0, p.K, decoded, chunk, len, acc.data() + m0 * NR);
        m0 += rows;
      }
    }
    for (int64_t m = 0; m < p.M; ++m)
      for (int j = 0; j < cols; ++j) store_output(p, m, n0 + j, acc[m * NR + j]);
  }
}

#ifdef QUIRE_QUANT_X86
// A sink that multiplies the decoded values of one weight row with MR rows of x (at the current block),
// with few accumulators (batch 1) split into chains over a block's vectors so that each FMA does not wait
// for the one before.
template <class V, int MR>
struct DotSink {
  static constexpr int kChains = MR >= 4 ? 1 : MR >= 2 ? 2 : 4;
  const float* x;
  int64_t ldx;
  typename V::F acc[kChains][MR];
  template <int E>
  void put(typename V::F w) {
    constexpr int c = E / V::L % kChains;
    static_for<MR>([&](auto i) {
      constexpr int I = decltype(i)::value;
      acc[c][I] = V::fmadd(V::load(x + I * ldx + E), w, acc[c][I]);
    });
  }
};

// Batches of up to kMaxRows rows: each weight row is decoded block by block straight into registers and
// multiplied with all MR rows of x, one weight row after the other. x is read a K-chunk at a time that stays
// in L1 (the whole row when it fits: batch 1 streams each weight row front to back), for groups of
// kFusedGroup weight rows whose partial sums wait in a small buffer.
constexpr int64_t kFusedXBytes = 24 << 10, kFusedGroup = 16;

template <class V, class Q, int MR>
void linear_fused(const LinearProblem& p, int64_t n_begin, int64_t n_end) {
  using F = typename V::F;
  using Sink = DotSink<V, MR>;
  const int64_t num_blocks = p.K / Q::kElements, k_tail = num_blocks * Q::kElements;
  const int64_t chunk_blocks = std::max<int64_t>(1, kFusedXBytes / (4 * MR * Q::kElements));
  F partial[kFusedGroup][MR];
  for (int64_t g0 = n_begin; g0 < n_end; g0 += kFusedGroup) {
    const int64_t group = std::min(kFusedGroup, n_end - g0);
    for (int64_t b0 = 0; b0 < num_blocks || b0 == 0; b0 += chunk_blocks) {
      const int64_t b1 = std::min(num_blocks, b0 + chunk_blocks);
      for (int64_t r = 0; r < group; ++r) {
        const int64_t n = g0 + r;
        const uint8_t* row = p.w + n * p.row_bytes;
        const float row_scale = p.row_scale != nullptr ? p.row_scale[n] : 1.f;
        Sink sink{p.x, p.K, {}};
        static_for<Sink::kChains * MR>([&](auto ci) {
          constexpr int C = decltype(ci)::value / MR, I = decltype(ci)::value % MR;
          sink.acc[C][I] = C == 0 && b0 > 0 ? partial[r][I] : V::zero();
        });
        for (int64_t b = b0; b < b1; ++b) {
          sink.x = p.x + b * Q::kElements;
          Q::template decode<V>(row + b * Q::kBytes, row_scale, sink);
        }
        static_for<MR>([&](auto i) {
          constexpr int I = decltype(i)::value;
          F sum = sink.acc[0][I];
          static_for<Sink::kChains - 1>([&](auto c) { sum = V::add(sum, sink.acc[decltype(c)::value + 1][I]); });
          partial[r][I] = sum;
        });
      }
    }
    for (int64_t r = 0; r < group; ++r) {
      const int64_t n = g0 + r;
      float tail[Q::kElements];
      if (k_tail < p.K)
        Q::decode_scalar(p.w + n * p.row_bytes + num_blocks * Q::kBytes,
                         p.row_scale != nullptr ? p.row_scale[n] : 1.f, tail, static_cast<int>(p.K - k_tail));
      for (int i = 0; i < MR; ++i) {
        float value = V::hsum(partial[r][i]);
        for (int64_t k = k_tail; k < p.K; ++k) value += p.x[i * p.K + k] * tail[k - k_tail];
        store_output(p, i, n, value);
      }
    }
  }
}

// The formats with an integer path for batches of 1 to 8 rows on AVX-512 VNNI (dot_pairs).
template <class Q>
constexpr bool has_pairs = std::is_same_v<Q, Q4_0> || std::is_same_v<Q, Q4_1> || std::is_same_v<Q, Q8_0>;

// Q4_0, Q4_1 and Q8_0 on AVX-512 VNNI (quant_int_dot.h), batches of 1 to 8 rows (x rounded to int16 and paired):
// each pair of weight blocks is read and widened once and multiplied with every row of x. A row's result is
// bit-identical at every batch size (dot_pairs), so this path serves batch 1 as well.
template <class Q, int MR>
QUIRE_AVX512_VNNI void linear_pairs(const LinearProblem& p, int64_t n_begin, int64_t n_end) {
  const int64_t num_blocks = p.K / Q::kElements;
  for (int64_t n = n_begin; n < n_end; ++n) {
    float out[MR];
    dot_pairs<Q, MR>(p.w + n * p.row_bytes, num_blocks, *p.xpairs, out);
    for (int i = 0; i < MR; ++i) store_output(p, i, n, out[i]);
  }
}

// Batch 1 with x rounded to int16 (quant_int_dot.h): each weight row's groups of 32 are widened to int16 and
// multiplied with x, into two sums (even and odd blocks) so that each block's FMA does not wait for the last.
// (Larger batches stay on float32, but for linear_pairs: there the int16 path's per-row work, a conversion
// and a scaling per group, costs more than the float32 FMAs it replaces.)
template <class V, class Q>
void linear_int(const LinearProblem& p, int64_t n_begin, int64_t n_end) {
  constexpr int kGroups = Q::kElements / 32;
  const int64_t num_blocks = p.K / Q::kElements, k_tail = num_blocks * Q::kElements;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    const float row_scale = p.row_scale != nullptr ? p.row_scale[n] : 1.f;
    IntDotSink<V> even(*p.xq), odd(*p.xq);
    int64_t b = 0;
    for (; b + 1 < num_blocks; b += 2) {
      even.first = b * kGroups;
      IntGroups<Q>::decode(row + b * Q::kBytes, row_scale, even);
      odd.first = (b + 1) * kGroups;
      IntGroups<Q>::decode(row + (b + 1) * Q::kBytes, row_scale, odd);
    }
    if (b < num_blocks) {
      even.first = b * kGroups;
      IntGroups<Q>::decode(row + b * Q::kBytes, row_scale, even);
    }
    float value = V::hsum(V::add(even.acc, odd.acc)) + (even.offset + odd.offset);
    if (k_tail < p.K) {
      float tail[Q::kElements];
      Q::decode_scalar(row + num_blocks * Q::kBytes, row_scale, tail, static_cast<int>(p.K - k_tail));
      for (int64_t k = k_tail; k < p.K; ++k) value += p.x[k] * tail[k - k_tail];
    }
    store_output(p, 0, n, value);
  }
}

template <class V, class Q, int MR = V::kMaxRows>
void linear_fused_rows(const LinearProblem& p, int64_t n_begin, int64_t n_end) {
  if (p.M == MR) {
    if constexpr (std::is_same_v<V, Avx512> && has_pairs<Q>) {
      if (p.xpairs != nullptr) {
        linear_pairs<Q, MR>(p, n_begin, n_end);
        return;
      }
    }
    if (MR == 1 && p.xq != nullptr) {
      linear_int<V, Q>(p, n_begin, n_end);
    } else {
      linear_fused<V, Q, MR>(p, n_begin, n_end);
    }
  } else if constexpr (MR > 1) {
    linear_fused_rows<V, Q, MR - 1>(p, n_begin, n_end);
  }
}
#endif

// Every row of y for weight rows [n_begin, n_end): the work of one chunk of parallel_chunks.
template <class V, class Q>
void linear_chunk(const LinearProblem& p, int64_t n_begin, int64_t n_end) {
#ifdef QUIRE_QUANT_X86
  if constexpr (!std::is_same_v<V, Scalar>) {
    if (p.M <= V::kMaxRows) {
      linear_fused_rows<V, Q>(p, n_begin, n_end);
      return;
    }
  }
#endif
  if (p.M == 1) {
    linear_tiles<V, Q, 1>(p, n_begin, n_end);
  } else {
    linear_tiles<V, Q, V::kTileCols>(p, n_begin, n_end);
  }
}

// ---- dequantization ----

struct DequantizeProblem {
  const uint8_t* w;
  int64_t K, row_bytes;
  const float* row_scale;  // [N] (INT8) or nullptr
  const int64_t* rows;     // weight row of each output row, or nullptr for all rows in order
  float* out;              // [num_rows, K]
};

template <class V, class Q>
void dequantize_chunk(const DequantizeProblem& p, int64_t r_begin, int64_t r_end) {
  for (int64_t r = r_begin; r < r_end; ++r) {
    const int64_t n = p.rows != nullptr ? p.rows[r] : r;
    decode_row<V, Q>(p.w + n * p.row_bytes, p.row_scale != nullptr ? p.row_scale[n] : 1.f, 0, p.K, p.out + r * p.K);
  }
}

// ---- per-ISA entry points and dispatch ----

using LinearFn = void (*)(const LinearProblem&, int64_t, int64_t);
using DequantizeFn = void (*)(const DequantizeProblem&, int64_t, int64_t);

// Rounds x [M, K] to int16 for the integer path (quant_int_dot.h); false where x is not finite.
using QuantizeXFn = bool (*)(const float*, int64_t, int64_t, int16_t*, float*, float*);

struct Kernels {
  LinearFn linear;
  DequantizeFn dequantize;
  int64_t tile_cols;      // weight rows per tile of linear's decoded tiles
  int64_t fused_rows;     // batches up to this size decode straight into registers
  QuantizeXFn quantize_x;  // nullptr: no integer path
  bool pairs = false;      // batches up to fused_rows take x as PairedX (has_pairs on AVX-512 VNNI)
};

template <class Q>
void linear_scalar(const LinearProblem& p, int64_t b, int64_t e) { linear_chunk<Scalar, Q>(p, b, e); }
template <class Q>
void dequantize_scalar(const DequantizeProblem& p, int64_t b, int64_t e) { dequantize_chunk<Scalar, Q>(p, b, e); }

#ifdef QUIRE_QUANT_X86
template <class Q>
QUIRE_AVX2 __attribute__((flatten)) void linear_avx2(const LinearProblem& p, int64_t b, int64_t e) {
  linear_chunk<Avx2, Q>(p, b, e);
}
template <class Q>
QUIRE_AVX2 __attribute__((flatten)) void dequantize_avx2(const DequantizeProblem& p, int64_t b, int64_t e) {
  dequantize_chunk<Avx2, Q>(p, b, e);
}
template <class Q>
QUIRE_AVX512 __attribute__((flatten)) void linear_avx512(const LinearProblem& p, int64_t b, int64_t e) {
  linear_chunk<Avx512, Q>(p, b, e);
}
template <class Q>
QUIRE_AVX512 __attribute__((flatten)) void dequantize_avx512(const DequantizeProblem& p, int64_t b, int64_t e) {
  dequantize_chunk<Avx512, Q>(p, b, e);
}
#endif

bool cpu_has_vnni() {
#ifdef QUIRE_QUANT_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  return has;
#else
  return false;
#endif
}

template <class Q>
Kernels kernels_for([[maybe_unused]] Isa isa) {
#ifdef QUIRE_QUANT_X86
  if (isa == Isa::Avx512)
    return {&linear_avx512<Q>, &dequantize_avx512<Q>, Avx512::kTileCols, Avx512::kMaxRows, &quantize_x_avx512,
            has_pairs<Q> && cpu_has_vnni()};
  if (isa == Isa::Avx2)
    return {&linear_avx2<Q>, &dequantize_avx2<Q>, Avx2::kTileCols, Avx2::kMaxRows, &quantize_x_avx2};
#endif
  return {&linear_scalar<Q>, &dequantize_scalar<Q>, Scalar::kTileCols, 1, nullptr};
}

Kernels kernels_for(QType type, Isa isa) {
  switch (type) {
    case QType::Q8_0: return kernels_for<Q8_0>(isa);
    case QType::Q4_0: return kernels_for<Q4_0>(isa);
    case QType::Q4_1: return kernels_for<Q4_1>(isa);
    case QType::Q4_K: return kernels_for<Q4_K>(isa);
    case QType::Q6_K: return kernels_for<Q6_K>(isa);
    case QType::INT8: return kernels_for<Int8>(isa);
  }
  return kernels_for<Int8>(isa);
}

bool cpu_has(Isa isa) {
#ifdef QUIRE_QUANT_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == Isa::Avx2) return avx2;
  if (isa == Isa::Avx512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#endif
  return isa == Isa::Scalar;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    case Isa::Scalar: return "scalar";
  }
  return "scalar";
}

// "" or "auto": the widest this CPU has; otherwise the one named, which the CPU must have.
Isa resolve_isa(const std::string& requested) {
  if (requested.empty() || requested == "auto") {
    for (Isa isa : {Isa::Avx512, Isa::Avx2})
      if (cpu_has(isa)) return isa;
    return Isa::Scalar;
  }
  for (Isa isa : {Isa::Avx512, Isa::Avx2, Isa::Scalar}) {
    if (requested == isa_name(isa)) {
      TORCH_CHECK(cpu_has(isa), "quantized kernels: this CPU (or build) has no ", requested, " path");
      return isa;
    }
  }
  TORCH_CHECK(false, "quantized kernels: unknown isa ", requested, " (auto, avx512, avx2 or scalar)");
}

struct Weight {
  QType type;
  const uint8_t* bytes;
  int64_t N, K, row_bytes;
  const float* row_scale;
};

// Checks the weight's tensors against its type: uint8 [N, K / block * block_bytes] for GGUF types, int8
// [N, K] with float32 scales [N] for INT8. K < 0: taken from the row size.
Weight check_weight(const torch::Tensor& data, const c10::optional<torch::Tensor>& scale, const std::string& qtype,
                    int64_t K) {
  const QType type = parse_qtype(qtype);
  const Format format = format_of(type);
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.is_cpu(),
              "quantized weight: data must be a contiguous 2-D CPU tensor");
  const int64_t N = data.size(0), row_bytes = data.size(1);
  if (K < 0) K = row_bytes / format.block_bytes * format.block_elements;
  TORCH_CHECK(K % format.block_elements == 0 && K / format.block_elements * format.block_bytes == row_bytes,
              "quantized weight: ", qtype, " rows of ", row_bytes, " bytes do not hold ", K, " elements");
  const float* row_scale = nullptr;
  if (type == QType::INT8) {
    TORCH_CHECK(data.scalar_type() == at::kChar, "quantized weight: INT8 data must be int8");
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                    scale->numel() == N,
                "quantized weight: INT8 needs a float32 scale per row");
    row_scale = scale->data_ptr<float>();
  } else {
    TORCH_CHECK(data.scalar_type() == at::kByte, "quantized weight: ", qtype, " data must be uint8");
  }
  return {type, static_cast<const uint8_t*>(data.data_ptr()), N, K, row_bytes, row_scale};
}

// Weight rows [n_begin, n_end) decoded into out ([n_end - n_begin, K] float32), threaded.
void dequantize_range(const Weight& w, const Kernels& kernels, int64_t n_begin, int64_t n_end, float* out) {
  const DequantizeProblem p{w.bytes + n_begin * w.row_bytes, w.K, w.row_bytes,
                            w.row_scale != nullptr ? w.row_scale + n_begin : nullptr, nullptr, out};
  const int64_t count = n_end - n_begin;
  quire::parallel_chunks(0, count, quire::chunk_size(count, std::max<int64_t>(1, 16384 / w.K)),
                         [&](int64_t b, int64_t e) { kernels.dequantize(p, b, e); });
}

// From this many rows of x on, decoding the weight into float32 tiles for at::mm beats the register tiles
// (one Zen 4 core: about even at 128 rows, 10-20% faster from 256; the register tiles win below 128, by
// 20-50% at 9-16 rows).
constexpr int64_t kDequantizeBatch = 128;

torch::Tensor linear_by_dequantizing(const torch::Tensor& x32, const Weight& w, const Kernels& kernels,
                                     const c10::optional<torch::Tensor>& bias, at::ScalarType out_dtype) {
  // tiles of about 8 MiB of float32 weights: large enough for at::mm to run at full speed (1 MiB tiles
  // lost 10-20% at 512 rows), a bounded temporary for large output layers
  const int64_t tile_rows = std::min(w.N, std::max<int64_t>(16, (int64_t{8} << 20) / (4 * w.K)));
  auto y = torch::empty({x32.size(0), w.N}, x32.options());
  auto tile = torch::empty({tile_rows, w.K}, x32.options());
  for (int64_t n0 = 0; n0 < w.N; n0 += tile_rows) {
    const int64_t rows = std::min(tile_rows, w.N - n0);
    auto weights = tile.narrow(0, 0, rows);
    dequantize_range(w, kernels, n0, n0 + rows, weights.data_ptr<float>());
    auto y_tile = y.narrow(1, n0, rows);
    if (bias.has_value()) {
      at::addmm_out(y_tile, bias->narrow(0, n0, rows), x32, weights.t());
    } else {
      at::mm_out(y_tile, x32, weights.t());
    }
  }
  return y.to(out_dtype);
}

// y for fewer than kDequantizeBatch rows of x: on the integer path where this ISA and type have one for this
// batch size (x rounded here, before the threads share it), else on float32.
void linear_rows(LinearProblem p, const Kernels& kernels) {
#ifdef QUIRE_QUANT_X86
  // the calling thread's buffers for x rounded to int16 (the kernel's threads only read them)
  thread_local std::vector<int16_t> x_values, paired_values;
  thread_local std::vector<float> x_scales, paired_scales;
  const int64_t groups = p.K / 32, pairs = (groups + 1) / 2;
  QuantizedX xq{};
  PairedX xpairs{};
  const bool has_integer_path = p.M == 1 || (kernels.pairs && p.M <= kernels.fused_rows);
  if (has_integer_path && kernels.quantize_x != nullptr && groups > 0) {
    x_values.resize(p.M * groups * 32);
    x_scales.resize(2 * p.M * groups);
    xq = {x_values.data(), x_scales.data(), x_scales.data() + p.M * groups};
    if (kernels.quantize_x(p.x, p.M, p.K, x_values.data(), x_scales.data(), x_scales.data() + p.M * groups)) {
      p.xq = &xq;
      if (kernels.pairs) {
        paired_values.resize(pairs * p.M * 64);
        paired_scales.resize(4 * pairs * p.M);
        float* paired_sums = paired_scales.data() + 2 * pairs * p.M;
        pair_x(xq, p.M, groups, paired_values.data(), paired_scales.data(), paired_sums);
        xpairs = {paired_values.data(), paired_scales.data(), paired_sums, pairs};
        p.xpairs = &xpairs;
      }
    } else if (p.M > 1) {
      // NOTE: a row holding an infinity or a NaN takes the float32 path at batch 1; here every row is
      // computed as at batch 1, so that each row's result does not depend on the others
      for (int64_t m = 0; m < p.M; ++m) {
        LinearProblem row = p;
        row.x = p.x + m * p.K;
        row.M = 1;
        if (p.y != nullptr) row.y = p.y + m * p.N;
        if (p.y_bf16 != nullptr) row.y_bf16 = p.y_bf16 + m * p.N;
        linear_rows(row, kernels);
      }
      return;
    }
  }
#endif
  // chunks of whole tiles of weight rows (single rows on the fused path)
  const int64_t cols = p.M <= kernels.fused_rows ? 1 : kernels.tile_cols;
  const int64_t num_col_tiles = (p.N + cols - 1) / cols;
  const int64_t chunk = quire::chunk_size(num_col_tiles, cols == 1 ? 16 : 4);
  quire::parallel_chunks(0, num_col_tiles, chunk, [&](int64_t b, int64_t e) {
    kernels.linear(p, b * cols, std::min(p.N, e * cols));
  });
}

}  // namespace

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor data, c10::optional<torch::Tensor> scale,
                           const std::string& qtype, c10::optional<torch::Tensor> bias, const std::string& isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_cpu(), "quant_linear: x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be float32 or bfloat16");
  const Weight w = check_weight(data, scale, qtype, x.size(1));
  const Kernels kernels = kernels_for(w.type, resolve_isa(isa));
  c10::optional<torch::Tensor> bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == w.N, "quant_linear: bias must have one value per output");
    bias32 = bias->to(at::kFloat).contiguous().view({w.N});
  }
  const int64_t M = x.size(0);
  const auto x32 = x.to(at::kFloat).contiguous();
  if (M >= kDequantizeBatch) return linear_by_dequantizing(x32, w, kernels, bias32, x.scalar_type());

  auto y = torch::empty({M, w.N}, x.options());
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  const LinearProblem p{x32.data_ptr<float>(), M, w.K, w.N, w.bytes, w.row_bytes, w.row_scale,
                        bias32.has_value() ? bias32->data_ptr<float>() : nullptr,
                        is_bf16 ? nullptr : y.data_ptr<float>(),
                        is_bf16 ? reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) : nullptr};
  linear_rows(p, kernels);
  return y;
}

torch::Tensor quant_dequantize(torch::Tensor data, c10::optional<torch::Tensor> scale, const std::string& qtype,
                               c10::optional<torch::Tensor> rows, const std::string& isa) {
  const Weight w = check_weight(data, scale, qtype, -1);
  const Kernels kernels = kernels_for(w.type, resolve_isa(isa));
  if (!rows.has_value()) {
    auto out = torch::empty({w.N, w.K}, torch::dtype(at::kFloat));
    dequantize_range(w, kernels, 0, w.N, out.data_ptr<float>());
    return out;
  }
  const auto index = rows->to(at::kLong).contiguous().view({-1});
  const int64_t* ids = index.data_ptr<int64_t>();
  const int64_t count = index.numel();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < w.N, "quant_dequantize: row ", ids[i], " is out of range for ", w.N,
                " rows");
  auto out = torch::empty({count, w.K}, torch::dtype(at::kFloat));
  const DequantizeProblem p{w.bytes, w.K, w.row_bytes, w.row_scale, ids, out.data_ptr<float>()};
  quire::parallel_chunks(0, count, quire::chunk_size(count, std::max<int64_t>(1, 16384 / w.K)),
                         [&](int64_t b, int64_t e) { kernels.dequantize(p, b, e); });
  return out;
}

std::string quant_isa(const std::string& requested) { return isa_name(resolve_isa(requested)); }
