// Fused element-wise kernels for CPUs: RMSNorm (with the residual add), rotary embedding, SiLU-and-multiply,
// and the row-wise argmax of greedy sampling.
//
// Each replaces a chain of small PyTorch ops with one pass over memory, and reproduces the rounding of
// that chain: with bfloat16 every intermediate result that PyTorch would store in bfloat16 is rounded to
// bfloat16 here too (to nearest even), so outputs match the PyTorch references (and transformers).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "bf16.h"
#include "kernels.h"
#include "parallel.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace {

using quire::bf16_to_float;
using quire::float_to_bf16;

inline float load(float v) { return v; }
inline float load(uint16_t bits16) { return bf16_to_float(bits16); }
inline void store(float* out, float v) { *out = v; }
inline void store(uint16_t* out, float v) { *out = float_to_bf16(v); }
// What storing and reloading does to a value: nothing in float32, bfloat16 rounding in bfloat16.
inline float round_as(float v, float) { return v; }
inline float round_as(float v, uint16_t) { return load(float_to_bf16(v)); }

// How many rows of `row_elements` each thread should get at least. Waking the other OpenMP threads costs
// more than a small batch's work, and when the engine shares the cores with the server's front end, a
// parallel region waits for a thread the OS may not schedule for a while: only work worth tens of
// microseconds is split. `element_cost` weighs elements that take longer (an exp) against a plain one.
inline int64_t grain_rows(int64_t row_elements, int64_t element_cost = 1) {
  constexpr int64_t kElementsPerThread = 32768;
  return std::max<int64_t>(1, kElementsPerThread / std::max<int64_t>(1, row_elements * element_cost));
}

}  // namespace

namespace quire {

// One row each, compiled once (noinline) so that every caller, the batched kernels below and the decoder
// stack's one-region path (decode_stack.cpp), computes with the same machine code and so the same bits.

template <typename T>
__attribute__((noinline)) void rms_norm_row(const T* x, const T* residual, const T* weight, T* out,
                                            T* new_residual, int64_t hidden, float eps, float* summed) {
  float* v = summed;
  float squares = 0.f;
  if (residual != nullptr) {
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; ++i) {
      const float sum = round_as(load(x[i]) + load(residual[i]), T{});  // x + residual, stored in T
      store(new_residual + i, sum);
      v[i] = sum;
      squares += sum * sum;
    }
  } else {
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; ++i) {
      v[i] = load(x[i]);
      squares += v[i] * v[i];
    }
  }
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) store(out + i, load(weight[i]) * round_as(v[i] * scale, T{}));
}

template <typename T>
__attribute__((noinline)) void rotate_head(const T* x, const T* cos, const T* sin, T* out, int64_t dim) {
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load(x[i]), x2 = load(x[i + half]), ci = load(cos[i]), si = load(sin[i]);
    store(out + i, round_as(x1 * ci, T{}) - round_as(x2 * si, T{}));
    store(out + i + half, round_as(x2 * ci, T{}) + round_as(x1 * si, T{}));
  }
}

// SiLU in double, rounded to float32: close enough to correctly rounded that bfloat16 results are PyTorch's to
// the bit (a float exp's last-bit errors flipped bfloat16 greedy tokens against transformers).
inline float silu_in_double(float g) { return static_cast<float>(g / (1.0 + std::exp(-static_cast<double>(g)))); }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__x86_64__) && defined(__GLIBC__)
#define QUIRE_SILU_FLOAT_SCREEN 1
extern "C" __m512 _ZGVeN16v_expf(__m512);  // libmvec's 16-lane expf (what `omp simd` loops call)

// Sixteen bfloat16 gates and ups: SiLU in float32, which rounds to the same bfloat16 as the double path
// unless its result lies within kMargin float32 ulp of a bfloat16 rounding midpoint (its low 16 bits near
// 0x8000; the float32 path is a few ulp from exact) or the gate is below -80 (expf overflows; -inf) or NaN.
// Those lanes, about one in 2,000, are recomputed in double. Every bfloat16 gate is checked against the
// double path in tests/kernels/test_norm_activation.py (with this glibc's expf none needs the margin; it is
// there for another's). SmolLM2-135M's MLP width, one thread: 1.4 -> 0.75-0.86 ns an element.
inline void silu_mul_16(const uint16_t* gate, const uint16_t* up, uint16_t* out) {
  constexpr uint32_t kMargin = 16;
  const auto widen = [](const uint16_t* p) {
    return bf16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  const auto to_bf16_bits = [](__m512 v) {  // nearest even, as float_to_bf16 (in the low halves)
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
  };
  const __m512 g = widen(gate);
  const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 activated = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  const __m512i low = _mm512_and_si512(_mm512_castps_si512(activated), _mm512_set1_epi32(0xFFFF));
  const __mmask16 near = _mm512_cmple_epu32_mask(_mm512_sub_epi32(low, _mm512_set1_epi32(0x8000 - kMargin)),
                                                 _mm512_set1_epi32(2 * kMargin));
  const __mmask16 again = near | _mm512_cmp_ps_mask(g, _mm512_set1_ps(-80.f), _CMP_NGE_UQ);
  const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(to_bf16_bits(activated), 16));
  const __m512i result = to_bf16_bits(_mm512_mul_ps(rounded, widen(up)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(result));
  for (unsigned lanes = again; lanes != 0; lanes &= lanes - 1) {
    const int i = __builtin_ctz(lanes);
    store(out + i, round_as(silu_in_double(load(gate[i])), uint16_t{}) * load(up[i]));  // the double path
  }
}
#endif

template <typename T>
__attribute__((noinline)) void silu_mul_span(const T* gate, const T* up, T* out, int64_t count) {
  int64_t first = 0;
#ifdef QUIRE_SILU_FLOAT_SCREEN
  if constexpr (std::is_same_v<T, uint16_t>) {
    for (; first + 16 <= count; first += 16) silu_mul_16(gate + first, up + first, out + first);
  }
#endif
#pragma omp simd
  for (int64_t i = first; i < count; ++i) store(out + i, round_as(silu_in_double(load(gate[i])), T{}) * load(up[i]));
}

template void rms_norm_row<float>(const float*, const float*, const float*, float*, float*, int64_t, float, float*);
template void rms_norm_row<uint16_t>(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, uint16_t*, int64_t,
                                     float, float*);
template void rotate_head<float>(const float*, const float*, const float*, float*, int64_t);
template void rotate_head<uint16_t>(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t);
template void silu_mul_span<float>(const float*, const float*, float*, int64_t);
template void silu_mul_span<uint16_t>(const uint16_t*, const uint16_t*, uint16_t*, int64_t);

}  // namespace quire

namespace {

template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* new_residual, int64_t rows,
                   int64_t hidden, float eps) {
  quire::parallel_chunks(0, rows, quire::chunk_size(rows, grain_rows(hidden)), [&](int64_t begin, int64_t end) {
    std::vector<float> summed(hidden);
    for (int64_t r = begin; r < end; ++r) {
      quire::rms_norm_row(x + r * hidden, residual != nullptr ? residual + r * hidden : nullptr, weight,
                          out + r * hidden, residual != nullptr ? new_residual + r * hidden : nullptr, hidden, eps,
                          summed.data());
    }
  });
}

template <typename T>
void rotate_rows(const T* x, int64_t x_stride, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads,
                 int64_t dim) {
  const int64_t half = dim / 2;
  const int64_t chunk = quire::chunk_size(tokens, grain_rows(heads * dim));
  quire::parallel_chunks(0, tokens, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        quire::rotate_head(x + t * x_stride + h * dim, cos + t * half, sin + t * half, out + (t * heads + h) * dim,
                           dim);
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t dim) {
  // split along rows and, for small batches, along the row too (an exp in double costs about ten plain
  // element operations)
  constexpr int64_t kExpCost = 10;
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(dim / 512, 2 * at::get_num_threads() / std::max<int64_t>(rows, 1)));
  const int64_t width = (dim + pieces - 1) / pieces;
  const int64_t chunk = quire::chunk_size(rows * pieces, grain_rows(width, kExpCost));
  quire::parallel_chunks(0, rows * pieces, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / pieces, first = (item % pieces) * width, last = std::min(dim, first + width);
      const T* gate = x + r * 2 * dim;
      quire::silu_mul_span(gate + first, gate + dim + first, out + r * dim + first, last - first);
    }
  });
}

template <typename Fn>
void dispatch(const torch::Tensor& t, Fn fn) {
  if (t.scalar_type() == torch::kBFloat16) {
    fn(uint16_t{});
  } else {
    TORCH_CHECK(t.scalar_type() == torch::kFloat32, "Quire's CPU kernels support float32 and bfloat16");
    fn(float{});
  }
}

template <typename T>
T* ptr(const torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

}  // namespace

std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
                                    double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm needs contiguous inputs");
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  auto out = torch::empty_like(x);
  torch::Tensor new_residual;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous(), "rms_norm needs a contiguous residual");
    new_residual = torch::empty_like(x);
  }
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(ptr<T>(x), residual.has_value() ? ptr<T>(*residual) : nullptr, ptr<T>(weight), ptr<T>(out),
                     residual.has_value() ? ptr<T>(new_residual) : nullptr, rows, hidden, static_cast<float>(eps));
  });
  if (residual.has_value()) return {out, new_residual};
  return {out};
}

torch::Tensor rotate(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  // x [T, H, D] (any strides in T: q/k are views of the fused projection, read in place); cos/sin [T, D/2]
  // contiguous
  auto input = x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
  auto out = torch::empty(input.sizes(), input.options());
  dispatch(input, [&](auto tag) {
    using T = decltype(tag);
    rotate_rows<T>(ptr<T>(input), input.stride(0), ptr<T>(cos), ptr<T>(sin), ptr<T>(out), input.size(0),
                   input.size(1), input.size(2));
  });
  return out;
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  auto input = x.contiguous();
  const int64_t dim = input.size(-1) / 2, rows = input.numel() / input.size(-1);
  auto sizes = input.sizes().vec();
  sizes.back() = dim;
  auto out = torch::empty(sizes, input.options());
  dispatch(input, [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(ptr<T>(input), ptr<T>(out), rows, dim);
  });
  return out;
}

namespace {

template <typename T>
void argmax_rows_impl(const T* x, int64_t* out, int64_t rows, int64_t width) {
  quire::parallel_chunks(0, rows, quire::chunk_size(rows, grain_rows(width)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * width;
      float maximum = load(row[0]);
#pragma omp simd reduction(max : maximum)
      for (int64_t i = 0; i < width; ++i) maximum = std::max(maximum, load(row[i]));
      // the first index holding the maximum, as torch.max(dim) returns; 0 when every value is -inf (the
      // reduction may have started from -FLT_MAX). NOTE: found a chunk at a time with vector compares: a
      // loop of one compare and branch per element ran at one or two cycles an element depending on where
      // the linker happened to place it.
      constexpr int64_t kChunk = 64;
      int64_t index = 0;
      for (int64_t begin_chunk = 0; begin_chunk < width; begin_chunk += kChunk) {
        const int64_t end_chunk = std::min(width, begin_chunk + kChunk);
        int64_t num_hits = 0;
#pragma omp simd reduction(+ : num_hits)
        for (int64_t i = begin_chunk; i < end_chunk; ++i) num_hits += load(row[i]) >= maximum;
        if (num_hits > 0) {
          index = begin_chunk;
          while (!(load(row[index]) >= maximum)) ++index;  // the hit: not `< maximum`, which a NaN also fails
          break;
        }
      }
      out[r] = index;
    }
  });
}

}  // namespace

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2, "argmax_rows expects [rows, width]");
  auto input = x.contiguous();
  auto out = torch::empty({input.size(0)}, input.options().dtype(torch::kInt64));
  dispatch(input, [&](auto tag) {
    using T = decltype(tag);
    argmax_rows_impl<T>(ptr<T>(input), out.data_ptr<int64_t>(), input.size(0), input.size(1));
  });
  return out;
}
