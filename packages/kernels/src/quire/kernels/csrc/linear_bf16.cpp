// bfloat16 linear layers for CPUs whose oneDNN has no bfloat16 matrix path (AVX2 without AVX-512).
//
// There PyTorch's bfloat16 matrix multiply falls back to a generic loop (about 16 GFLOP/s on two cores,
// against about 50-120 for float32). This kernel keeps the weights in bfloat16, widens them to float32 in
// registers (a 16-bit shift: exact), multiplies with float32 activations using FMA and accumulates in
// float32, then rounds once to the output dtype: the arithmetic of a bfloat16 GEMM with float32
// accumulation, as oneDNN and MKL do it, with reads of half the bytes of a float32 weight.
//
// Layout: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]); each (row tile, output tile) is a set of dot
// products over K, with MR rows of x against NR rows of w held in MR x NR vector accumulators.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "bf16.h"
#include "greedy_screen.h"
#include "kernels.h"
#include "parallel.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QUIRE_AVX2 1
#endif

namespace {

using quire::bf16_to_float;
using quire::float_to_bf16;

#ifdef QUIRE_AVX2
using quire::load_bf16x8;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// MR rows of x (float32, row stride K) against NR rows of w (bfloat16): out[i][j] = dot(x_i, w_j).
template <int MR, int NR>
inline void tile(const float* x, const uint16_t* w, int64_t K, float out[MR][NR]) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load_bf16x8(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t k = K8; k < K; ++k) s += x[i * K + k] * bf16_to_float(w[j * K + k]);
      out[i][j] = s;
    }
}
#else
template <int MR, int NR>
inline void tile(const float* x, const uint16_t* w, int64_t K, float out[MR][NR]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[i * K + k] * bf16_to_float(w[j * K + k]);
      out[i][j] = s;
    }
}
#endif

template <typename Out>
inline void store(Out* y, float v);
template <>
inline void store<float>(float* y, float v) { *y = v; }
template <>
inline void store<uint16_t>(uint16_t* y, float v) { *y = float_to_bf16(v); }

// Rows [m0, m0 + MR) against outputs [n0, n0 + NR).
template <int MR, int NR, typename Out>
inline void block(const float* x, const uint16_t* w, const float* bias, Out* y, int64_t m0, int64_t n0,
                  int64_t K, int64_t N) {
  float out[MR][NR];
  tile<MR, NR>(x + m0 * K, w + n0 * K, K, out);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) store<Out>(y + (m0 + i) * N + n0 + j, out[i][j] + (bias ? bias[n0 + j] : 0.f));
}

template <int NR, typename Out>
inline void column(const float* x, const uint16_t* w, const float* bias, Out* y, int64_t M, int64_t n0,
                   int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) block<4, NR>(x, w, bias, y, m, n0, K, N);
  switch (M - m) {
    case 3: block<3, NR>(x, w, bias, y, m, n0, K, N); break;
    case 2: block<2, NR>(x, w, bias, y, m, n0, K, N); break;
    case 1: block<1, NR>(x, w, bias, y, m, n0, K, N); break;
    default: break;
  }
}

// Rows are processed in chunks whose float32 activations stay in the core's L2 while every weight tile
// of the thread's share streams past them once per chunk.
constexpr int64_t kRowChunk = 64;

template <typename Out>
void linear_rows(const float* x, const uint16_t* w, const float* bias, Out* y, int64_t M, int64_t K,
                 int64_t N) {
  constexpr int64_t NR = 3;
  const int64_t tiles = (N + NR - 1) / NR;
  quire::parallel_chunks(0, tiles, quire::chunk_size(tiles, 8), [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t rows = std::min(kRowChunk, M - m0);
      const float* xc = x + m0 * K;
      Out* yc = y + m0 * N;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * NR;
        switch (std::min<int64_t>(NR, N - n0)) {
          case 3: column<3>(xc, w, bias, yc, rows, n0, K, N); break;
          case 2: column<2>(xc, w, bias, yc, rows, n0, K, N); break;
          default: column<1>(xc, w, bias, yc, rows, n0, K, N); break;
        }
      }
    }
  });
}

// One row (batch-1 decode) is a pure stream over the weight. Reading each weight row front to back, one
// row after the other, keeps every thread on a single sequential stream, which the hardware prefetcher
// follows best: measured on an AVX2 EPYC, 21-24 GB/s over a decode step's weights (a plain read of memory
// gives 23-25) against 15-17 GB/s with six rows read side by side. Four accumulators cover the FMA
// latency; a software prefetch a few lines ahead helps where the stream crosses from one row to the next.
#ifdef QUIRE_AVX2
inline float row_dot(const float* x, const uint16_t* w, int64_t K) {
  constexpr int64_t kPrefetchBytes = 256;
  __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + kPrefetchBytes, _MM_HINT_T0);
    a = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load_bf16x8(w + k), a);
    b = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), load_bf16x8(w + k + 8), b);
    c = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), load_bf16x8(w + k + 16), c);
    d = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), load_bf16x8(w + k + 24), d);
  }
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
  for (; k < K; ++k) s += x[k] * bf16_to_float(w[k]);
  return s;
}
#else
inline float row_dot(const float* x, const uint16_t* w, int64_t K) {
  float s = 0.f;
  for (int64_t k = 0; k < K; ++k) s += x[k] * bf16_to_float(w[k]);
  return s;
}
#endif

// Outputs [first, last) of one row; noinline: linear_bf16 and the decoder stack's one-region path
// (decode_stack.cpp) compute with the same machine code, so the same bits.
template <typename Out>
__attribute__((noinline)) void row_outputs(const float* x, const uint16_t* w, const float* bias, Out* y, int64_t K,
                                           int64_t first, int64_t last) {
  for (int64_t n = first; n < last; ++n) store<Out>(y + n, row_dot(x, w + n * K, K) + (bias ? bias[n] : 0.f));
}

template <typename Out>
void linear_row(const float* x, const uint16_t* w, const float* bias, Out* y, int64_t K, int64_t N) {
  quire::parallel_chunks(0, N, quire::chunk_size(N, 16), [&](int64_t begin, int64_t end) {
    row_outputs(x, w, bias, y, K, begin, end);
  });
}

// Many rows (prompt prefill): float32 GEMM through ATen (MKL's or oneDNN's sgemm, blocked for the caches) on
// float32 copies of the weight, kColumns outputs at a time (a narrower layer in two runs): a thread claims a
// run of outputs, widens those weight rows into a buffer it keeps, multiplies every row of x by them on its
// own (ATen's GEMM runs on one thread inside the region), then adds the bias and rounds into y. The split into
// runs does not depend on the number of threads, so neither do the results. Widening costs one pass over the
// weight, which the rows' products amortise: measured on an AVX2 EPYC (2 cores, SmolLM2-135M's layer shapes),
// 2,048 rows take 2.8-3.5 s for the 30 layers against 3.5-4.0 s through the tiles above and 128 rows
// 0.23-0.25 s against 0.29 s, while at 64 rows the tiles are still ahead (0.165 s against 0.176). Runs of 128
// outputs rather than 64 halve how often the GEMM packs x: 512 rows 0.74-0.75 -> 0.68-0.69 s, 2,048 rows
// 2.9-3.0 -> 2.7-2.85 s (quiet hour, 180 GFLOP/s float32 matmul); runs sized to split a 576-wide layer evenly
// were slower. Each run's GEMM still packs all of its rows of x, so a long prompt is also cut into blocks of
// kRowBlock rows and the runs are widened to 256 outputs: one thread's GEMM of 2,048 x 576 by 576 x 128 ran at
// 75 GFLOP/s against 92 for 512 x 576 by 576 x 256 (widening the same weight rows once per block costs ~3% of a
// run), and the four SmolLM2 layer shapes went from 154-157 to 162-165 GFLOP/s at 2,048 rows and from 159-163
// to 167-172 at 1,024 (quiet minutes, interleaved builds). A run is a (row block, output block) pair whose
// sizes depend only on M and N, so the results still do not depend on the threads.
constexpr int64_t kGemmRows = 128;
constexpr int64_t kColumns = 256;
constexpr int64_t kRowBlock = 512;

template <typename Out>
void linear_gemm(const torch::Tensor& xf, const uint16_t* w, const float* bias, Out* y, int64_t M, int64_t K,
                 int64_t N) {
  // At least two runs: one run would be computed outside any parallel region, where ATen's GEMM threads
  // itself and its bits then follow the thread count (linear_any sends a single output to the tiles).
  const int64_t columns = N > kColumns ? kColumns : (N + 1) / 2, column_runs = (N + columns - 1) / columns;
  const int64_t row_runs = (M + kRowBlock - 1) / kRowBlock;
  quire::parallel_chunks(0, row_runs * column_runs, 1, [&](int64_t begin, int64_t end) {
    // plain memory, wrapped anew in each call: a tensor kept across calls would carry the inference mode of
    // the call that made it, and writing into an inference tensor outside that mode is refused
    thread_local std::vector<float> panel, product;
    panel.resize(std::max<size_t>(panel.size(), kColumns * K));
    product.resize(std::max<size_t>(product.size(), std::min(M, kRowBlock) * kColumns));
    for (int64_t run = begin; run < end; ++run) {
      const int64_t n0 = (run / row_runs) * columns, cols = std::min(columns, N - n0);
      const int64_t m0 = (run % row_runs) * kRowBlock, rows = std::min(kRowBlock, M - m0);
      float* wf = panel.data();
      const uint16_t* src = w + n0 * K;
#pragma omp simd
      for (int64_t i = 0; i < cols * K; ++i) wf[i] = bf16_to_float(src[i]);
      auto out = torch::from_blob(product.data(), {rows, cols}, xf.options());
      at::mm_out(out, xf.narrow(0, m0, rows), torch::from_blob(wf, {cols, K}, xf.options()).t());
      const float* o = product.data();
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t j = 0; j < cols; ++j)
          store<Out>(y + (m0 + m) * N + n0 + j, o[m * cols + j] + (bias ? bias[n0 + j] : 0.f));
    }
  });
}

template <typename Out>
void linear_any(const torch::Tensor& xf, const uint16_t* w, const float* bias, Out* y, int64_t M, int64_t K,
                int64_t N) {
  const float* x = xf.data_ptr<float>();
  if (M == 1) {
    linear_row(x, w, bias, y, K, N);
  } else if (M >= kGemmRows && N >= 2) {
    linear_gemm(xf, w, bias, y, M, K, N);
  } else {
    linear_rows(x, w, bias, y, M, K, N);
  }
}

// float32 copy of x (bfloat16 widened by a shift; PyTorch's own conversion is several times slower here).
torch::Tensor widen(const torch::Tensor& x) {
  if (x.scalar_type() != at::kBFloat16) return x.to(at::kFloat);
  auto out = torch::empty(x.sizes(), x.options().dtype(at::kFloat));
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* dst = out.data_ptr<float>();
  quire::parallel_chunks(0, x.numel(), quire::chunk_size(x.numel(), 1 << 16), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = bf16_to_float(src[i]);
  });
  return out;
}

}  // namespace

namespace quire {
void linear_bf16_row_outputs(const float* x, const uint16_t* w, const float* bias, uint16_t* y, int64_t K,
                             int64_t first, int64_t last) {
  row_outputs(x, w, bias, y, K, first, last);
}
}  // namespace quire

bool linear_bf16_vectorized() {
#ifdef QUIRE_AVX2
  return true;
#else
  return false;
#endif
}

// x: [M, K] float32 or bfloat16; weight: [N, K] bfloat16; bias: [N] or none. Returns [M, N] in x's dtype.
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear_bf16: shape mismatch");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "linear_bf16: the weight must be bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const auto w = weight.contiguous();
  const auto xf = widen(x.contiguous());
  c10::optional<torch::Tensor> bf;
  if (bias.has_value()) bf = bias->to(at::kFloat).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const float* bp = bf.has_value() ? bf->data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kBFloat16) {
    linear_any(xf, wp, bp, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, K, N);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "linear_bf16: x must be float32 or bfloat16");
    linear_any(xf, wp, bp, y.data_ptr<float>(), M, K, N);
  }
  return y;
}

// ---- greedy tokens from a bfloat16 head without computing every logit (the AVX2 path) ----
//
// The counterpart of greedy_head_tokens (onednn_gemv.cpp) for heads linear_bf16 computes: an int8 copy of the
// head (one scale per output, made in Python) screens the vocabulary at half the bytes of the bfloat16 weight.
// With x rounded to int16, each approximate logit is an exact integer dot product (vpmaddwd) times two scales,
// and its bound covers the weight's and x's rounding and float32 summation in any order, with margins for the
// bound's own float32 arithmetic; only outputs whose upper bound reaches the best lower bound (less one
// bfloat16 rounding) are then computed exactly, with linear_bf16's own code for that number of rows (row_dot
// for one row; the tile for several, whose bits do not depend on the tile's shape or place: every accumulator
// runs the same FMA sequence), so the token is exactly the first index of the largest bfloat16 logit
// linear_bf16 returns. Returns an empty tensor where it cannot decide cheaply (x not finite or all zero, too
// many candidates, K not a multiple of 16): the caller then computes the full logits.
namespace {
constexpr int64_t kScreenMaxRows = 64;  // below linear_gemm's rows: the tiles' bits
constexpr int64_t kScreenMaxCandidates = 512;  // per row; past this the full head is about as cheap
#ifdef QUIRE_AVX2
// Lane j of the result: the sum of the eight lanes of v[j] (integers: exact).
inline __m256i sum_lanes8_epi32(const __m256i v[8]) {
  const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}
#endif
}  // namespace

bool greedy_head_bf16_supported() {
#ifdef QUIRE_AVX2
  return true;
#else
  return false;
#endif
}

torch::Tensor greedy_head_tokens_bf16(torch::Tensor x, torch::Tensor weight, torch::Tensor q, torch::Tensor scale,
                                      torch::Tensor bound) {
#ifdef QUIRE_AVX2
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "greedy_head_tokens_bf16: x must be [M, K] bfloat16");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1), "greedy_head_tokens_bf16: weight must be contiguous bfloat16 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(q.dim() == 2 && q.size(0) == N && q.size(1) == K && q.scalar_type() == at::kChar && q.is_contiguous(),
              "greedy_head_tokens_bf16: q must be int8 [N, K]");
  TORCH_CHECK(scale.numel() == N && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "greedy_head_tokens_bf16: scale must be float32 [N]");
  TORCH_CHECK(bound.dim() == 2 && bound.size(0) == 3 && bound.size(1) == N && bound.scalar_type() == at::kFloat &&
                  bound.is_contiguous(), "greedy_head_tokens_bf16: bound must be float32 [3, N]");
  auto none = torch::empty({0}, x.options().dtype(at::kLong));
  if (M == 0 || M > kScreenMaxRows || K % 16 != 0 || N == 0) return none;
  const auto xf = widen(x.contiguous());
  const float* xs = xf.data_ptr<float>();
  quire::screen::QuantizedRows rows;
  if (!quire::screen::quantize_rows(M, K, [&](int64_t i) { return xs[i]; }, rows)) return none;
  const std::vector<int16_t>& xq = rows.xq;
  const std::vector<double> &l1 = rows.l1, &step = rows.step, &x_error = rows.x_error;
  const auto* qs = q.data_ptr<int8_t>();
  const float* row_scale = scale.data_ptr<float>();
  // bound rows: [0] the largest |w - scale q| of each output, [1] sum |q|, [2] the largest |w|
  const float* w_error = bound.data_ptr<float>();
  const float* q_l1 = w_error + N;
  const float* w_max = w_error + 2 * N;
  const double summation = quire::screen::summation_error(K);
  // float32 copies of the per-row terms, each rounded up (the bound's own float32 arithmetic, and rounding
  // a + r and a - r to float32, are covered by the 2^-20 margins below)
  std::vector<float> l1_f(M), step_f(M), x_error_f(M), sum_f(M);
  for (int64_t m = 0; m < M; ++m) {
    l1_f[m] = static_cast<float>(l1[m] * (1.0 + 1e-6));
    step_f[m] = static_cast<float>(step[m]);
    x_error_f[m] = static_cast<float>(x_error[m] * (1.0 + 1e-6));
    sum_f[m] = static_cast<float>(summation * l1[m] * (1.0 + 1e-6));
  }
  std::vector<float> upper(M * N);  // approximate logit + radius, per row and output
  std::vector<double> best_lower(M, -INFINITY);  // of each row, over every output
  std::mutex best_lock;
  const int64_t groups = N / 8, chunks = K / 16;
  quire::parallel_chunks(0, groups, quire::chunk_size(groups, 16), [&](int64_t begin, int64_t end) {
    std::vector<__m256> chunk_lower(M, _mm256_set1_ps(-INFINITY));  // per row, lane by lane
    std::vector<int16_t> widened(8 * K);  // the group's eight int8 rows as int16 (L1-resident for every row of x)
    const __m256 margin = _mm256_set1_ps(std::ldexp(1.f, -20));
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = g * 8;
      const int8_t* rows = qs + n * K;
      for (int64_t i = 0; i < 8 * K; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&widened[i]),
                            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + i))));
      const __m256 scale8 = _mm256_loadu_ps(row_scale + n), error8 = _mm256_loadu_ps(w_error + n);
      const __m256 scaled_l1q8 = _mm256_mul_ps(scale8, _mm256_loadu_ps(q_l1 + n));
      const __m256 wmax8 = _mm256_loadu_ps(w_max + n);
      for (int64_t m = 0; m < M; ++m) {
        __m256i acc[8];
        for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_si256();
        const int16_t* xrow = &xq[m * K];
        for (int64_t c = 0; c < chunks; ++c) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xrow + 16 * c));
          for (int r = 0; r < 8; ++r)
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(xv, _mm256_loadu_si256(
                                                  reinterpret_cast<const __m256i*>(&widened[r * K + 16 * c]))));
        }
        const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(sum_lanes8_epi32(acc)),
                                       _mm256_mul_ps(scale8, _mm256_set1_ps(step_f[m])));
        __m256 r = _mm256_mul_ps(error8, _mm256_set1_ps(l1_f[m]));
        r = _mm256_fmadd_ps(scaled_l1q8, _mm256_set1_ps(x_error_f[m]), r);
        r = _mm256_fmadd_ps(wmax8, _mm256_set1_ps(sum_f[m]), r);
        r = _mm256_fmadd_ps(r, margin, r);
        r = _mm256_fmadd_ps(_mm256_andnot_ps(sign, a), margin, r);
        r = _mm256_add_ps(r, _mm256_set1_ps(1e-30f));
        _mm256_storeu_ps(&upper[m * N + n], _mm256_add_ps(a, r));
        chunk_lower[m] = _mm256_max_ps(chunk_lower[m], _mm256_sub_ps(a, r));
      }
    }
    std::lock_guard<std::mutex> guard(best_lock);
    for (int64_t m = 0; m < M; ++m) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, chunk_lower[m]);
      for (int i = 0; i < 8; ++i) best_lower[m] = std::max(best_lower[m], static_cast<double>(lanes[i]));
    }
  });
  for (int64_t n = groups * 8; n < N; ++n) {  // the last outputs, one at a time
    for (int64_t m = 0; m < M; ++m) {
      int64_t dot = 0;
      for (int64_t k = 0; k < K; ++k) dot += static_cast<int64_t>(qs[n * K + k]) * xq[m * K + k];
      const double a = static_cast<double>(dot) * row_scale[n] * step[m];
      const double r = quire::screen::radius(w_error[n], row_scale[n], q_l1[n], w_max[n], l1[m], x_error[m],
                                             summation);
      upper[m * N + n] = static_cast<float>((a + r) * (1.0 + 1e-6) + std::fabs(a) * 1e-6);
      best_lower[m] = std::max(best_lower[m], a - r - std::fabs(a) * 1e-6);
    }
  }
  auto tokens = torch::empty({M}, x.options().dtype(at::kLong));
  auto* out = tokens.data_ptr<int64_t>();
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  for (int64_t m = 0; m < M; ++m) {
    const double lower = best_lower[m];
    const double cut = quire::screen::cut_below(lower);
    const __m256 cut8 = _mm256_set1_ps(std::nextafter(static_cast<float>(cut), -INFINITY));
    const float* row_upper = &upper[m * N];
    std::vector<int64_t> candidates;
    int64_t n = 0;
    for (; n < N; n += 8) {
      int mask = 0xFF;  // the last partial group: each checked below
      if (n + 8 <= N) mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row_upper + n), cut8, _CMP_GE_OQ));
      for (int i = 0; mask != 0 && i < 8 && n + i < N; ++i, mask >>= 1) {
        if ((mask & 1) && static_cast<double>(row_upper[n + i]) >= cut) {
          candidates.push_back(n + i);
          if (static_cast<int64_t>(candidates.size()) > kScreenMaxCandidates) return none;
        }
      }
    }
    float best = -INFINITY;
    int64_t token = -1;
    for (const int64_t c : candidates) {
      // the logit exactly as linear_bf16 computes it for M rows (bias: none)
      uint16_t logit;
      if (M == 1) {
        row_outputs<uint16_t>(xs, w + c * K, nullptr, &logit, K, 0, 1);
      } else {
        float dot[1][1];
        tile<1, 1>(xs + m * K, w + c * K, K, dot);
        store<uint16_t>(&logit, dot[0][0] + 0.f);
      }
      const float v = bf16_to_float(logit);
      if (token < 0 || v > best) {
        best = v;
        token = c;
      }
    }
    if (token < 0 || !std::isfinite(best)) return none;
    out[m] = token;
  }
  return tokens;
#else
  (void)x;
  (void)weight;
  (void)q;
  (void)scale;
  (void)bound;
  TORCH_CHECK(false, "greedy_head_tokens_bf16: this build has no AVX2 and FMA");
#endif
}
