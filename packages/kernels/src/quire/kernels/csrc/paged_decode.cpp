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
// cache row is read once for all the query heads that share it. Built with -O3 -ffast-math: every value is finite (the running maximum starts at
// -FLT_MAX, not -inf).
//
// NOTE: with bfloat16 the arithmetic follows PyTorch's CPU flash attention (the reference, and what
// transformers runs): scores are (q . k) * scale in float32, probabilities are rounded to bfloat16 before
// they weight the values, and the float32 sum of the unrounded ones divides at the end. Greedy outputs
// then agree with transformers wherever its own margins are clear.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float v) { return v; }
inline float to_float(uint16_t bf16_bits) {
  const uint32_t bits = static_cast<uint32_t>(bf16_bits) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// The weight a probability gets when it meets a value: itself in float32, rounded (to nearest even)
// to bfloat16 when the cache is bfloat16.
inline float probability_weight(float p, float) { return p; }
inline float probability_weight(float p, uint16_t) {
  uint32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  float rounded;
  std::memcpy(&rounded, &bits, sizeof(rounded));
  return rounded;
}

// Blocks sit anywhere in the cache: ask for the next block's row while this block's is being used, so
// that a jump between blocks does not stall on memory latency.
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 1);
}

template <typename T>
void decode(const float* query, const T* key_cache, const T* value_cache, const int64_t* block_tables,
            const int64_t* seq_lens, float* output, int64_t num_requests, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  // A work item is one request and a range of its KV heads: all of them when there are enough requests
  // to keep every thread busy (reading whole cache rows), fewer when there are not (batch 1).
  const int64_t threads = at::get_num_threads();
  const int64_t head_splits = std::min<int64_t>(num_kv_heads, std::max<int64_t>(1, 4 * threads / num_requests));
  const int64_t heads_per_item = (num_kv_heads + head_splits - 1) / head_splits;
  at::parallel_for(0, num_requests * head_splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, totals, query_f, accumulator;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t request = item / head_splits;
      const int64_t first_kv = (item % head_splits) * heads_per_item;
      const int64_t last_kv = std::min(num_kv_heads, first_kv + heads_per_item);
      const int64_t rows = (last_kv - first_kv) * group;  // query heads handled here
      const int64_t row_bytes = (last_kv - first_kv) * head_dim * sizeof(T);
      const int64_t length = seq_lens[request];
      const int64_t* blocks = block_tables + request * max_blocks;
      const float* q_base = query + (request * num_heads + first_kv * group) * head_dim;
      query_f.assign(q_base, q_base + rows * head_dim);
      scores.resize(rows * length);
      totals.assign(rows, 0.f);
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
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += q[d] * to_float(key[d]);
            scores[r * length + t0 + i] = dot * scale;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* s = &scores[r * length];
        float maximum = -FLT_MAX;
        for (int64_t t = 0; t < length; ++t) maximum = std::max(maximum, s[t]);
        float total = 0.f;
        for (int64_t t = 0; t < length; ++t) {
          const float p = std::exp(s[t] - maximum);
          total += p;
          s[t] = probability_weight(p, T{});
        }
        totals[r] = total;
      }
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
      float* out = output + (request * num_heads + first_kv * group) * head_dim;
      for (int64_t r = 0; r < rows; ++r) {
        const float inverse = 1.f / totals[r];
        for (int64_t d = 0; d < head_dim; ++d) out[r * head_dim + d] = accumulator[r * head_dim + d] * inverse;
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [B, H, D] and caches [N, B, H, D] expected");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  auto query_f = query.to(torch::kFloat32).contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lengths = seq_lens.to(torch::kInt64).contiguous();
  auto output = torch::empty(query.sizes(), query.options().dtype(torch::kFloat32));
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t block_size = key_cache.size(1), Hk = key_cache.size(2), max_blocks = tables.size(1);
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


