// Fused element-wise kernels for CPUs: RMSNorm (with the residual add), rotary embedding, SiLU-and-multiply.
//
// Each replaces a chain of small PyTorch ops with one pass over memory, and reproduces the rounding of
// that chain: with bfloat16 every intermediate result that PyTorch would store in bfloat16 is rounded to
// bfloat16 here too (to nearest even), so outputs match the PyTorch references (and transformers).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

namespace {

inline float load(float v) { return v; }
inline float load(uint16_t bits16) {
  const uint32_t bits = static_cast<uint32_t>(bits16) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}
inline uint16_t to_bf16_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
inline void store(float* out, float v) { *out = v; }
inline void store(uint16_t* out, float v) { *out = to_bf16_bits(v); }
// What storing and reloading does to a value: nothing in float32, bfloat16 rounding in bfloat16.
inline float round_as(float v, float) { return v; }
inline float round_as(float v, uint16_t) { return load(to_bf16_bits(v)); }

template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* new_residual, int64_t rows,
                   int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> summed(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      float squares = 0.f;
      for (int64_t i = 0; i < hidden; ++i) {
        float v = load(xr[i]);
        if (residual != nullptr) {
          v = round_as(v + load(residual[r * hidden + i]), T{});  // x + residual, stored in T
          store(new_residual + r * hidden + i, v);
        }
        summed[i] = v;
        squares += v * v;
      }
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      for (int64_t i = 0; i < hidden; ++i) {
        const float normalized = round_as(summed[i] * scale, T{});  // .to(input dtype)
        store(out + r * hidden + i, load(weight[i]) * normalized);
      }
    }
  });
}

template <typename T>
void rotate_rows(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + (t * heads + h) * dim;
        T* o = out + (t * heads + h) * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = load(xr[i]), x2 = load(xr[i + half]), ci = load(c[i]), si = load(s[i]);
          store(o + i, round_as(x1 * ci, T{}) - round_as(x2 * si, T{}));
          store(o + i + half, round_as(x2 * ci, T{}) + round_as(x1 * si, T{}));
        }
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t dim) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * dim;
      const T* up = gate + dim;
      for (int64_t i = 0; i < dim; ++i) {
        const float g = load(gate[i]);
        // in double: close enough to correctly rounded that the bfloat16 result matches PyTorch's
        const float activated = round_as(static_cast<float>(g / (1.0 + std::exp(-static_cast<double>(g)))), T{});
        store(out + r * dim + i, activated * load(up[i]));
      }
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
  // x [T, H, D] (any strides in T: q/k are views of the fused projection); cos/sin [T, D/2] contiguous
  auto input = x.contiguous();
  auto out = torch::empty_like(input);
  dispatch(input, [&](auto tag) {
    using T = decltype(tag);
    rotate_rows<T>(ptr<T>(input), ptr<T>(cos), ptr<T>(sin), ptr<T>(out), input.size(0), input.size(1),
                   input.size(2));
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
