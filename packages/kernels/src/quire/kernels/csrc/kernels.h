// Entry points of Quire's CPU kernels, shared by the Python bindings and the C++ decoder stack.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
// Causal attention of whole prompts over their own keys (prefill_attention.cpp): query/out [T, Hq, D], key/value
// [T, Hk, D], bfloat16; each (start, end) row of `ranges` is one prompt, written to those rows of out (the rest
// untouched). Runs on AMX tiles where the build has AMX BF16, the OS grants the tiles and D is a multiple of 32,
// else in PyTorch's own order where that gives PyTorch's bits here (AVX-512, D a multiple of 16 up to 128:
// prefill_sdpa_order.cpp), else on AVX2 FMA where D is a multiple of 16; D <= 256 (prefill_attention_runs).
// Whether attention should take it (prefill_attention_available) is narrower: AMX, PyTorch's order, or AVX2 FMA
// on CPUs without AVX-512 BF16.
bool prefill_attention_runs(int64_t head_dim);
// Whether whole prompts of this head size take prefill_attention, and on which path: "amx", "pytorch order"
// (prefill_sdpa_order.cpp) or "avx2"; "" where they keep PyTorch's SDPA.
std::string prefill_attention_path(int64_t head_dim);
bool prefill_attention_available(int64_t head_dim);
void prefill_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, double scale, torch::Tensor ranges,
                       torch::Tensor out);
// The same prompts always in PyTorch's order (where sdpa_order_runs), verified here or not: for tests.
void prefill_attention_pytorch_order(torch::Tensor query, torch::Tensor key, torch::Tensor value, double scale,
                                     torch::Tensor ranges, torch::Tensor out);
std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
                                    double eps);
torch::Tensor rotate(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor argmax_rows(torch::Tensor x);
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
bool linear_bf16_vectorized();
// The argmax of linear_bf16(x, weight) for up to 64 rows, screened with an int8 copy of the weight
// (linear_bf16.cpp); empty where it declines.
bool greedy_head_bf16_supported();
torch::Tensor greedy_head_tokens_bf16(torch::Tensor x, torch::Tensor weight, torch::Tensor q, torch::Tensor scale,
                                      torch::Tensor bound);
// A few rows times a bfloat16 weight oneDNN has packed (onednn_gemv.cpp), for weights onednn_gemv_layout accepts.
bool onednn_gemv_layout(torch::Tensor packed);
int64_t onednn_gemv_max_rows();
torch::Tensor onednn_gemv(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);
// The argmax of x @ packed.T (onednn_gemv's logits) for up to 8 rows, screened with an int8 copy (onednn_gemv.cpp);
// empty where it declines.
bool greedy_head_supported();
// The argmax of onednn_gemv's logits for 9 to onednn_amx_max_rows() rows on AMX tiles, or for 1 to
// onednn_wide_max_rows() rows on oneDNN's 64-output blocks, without writing them; empty where it declines (other
// rows, x not finite, a NaN logit).
torch::Tensor onednn_amx_argmax(torch::Tensor x, torch::Tensor packed);
torch::Tensor onednn_wide_argmax(torch::Tensor x, torch::Tensor packed);
torch::Tensor greedy_head_tokens(torch::Tensor x, torch::Tensor packed, torch::Tensor q, torch::Tensor scale,
                                 torch::Tensor bound);
// Quantized weights (quant_linear.cpp): data/scale/qtype as quire.kernels.quant.QuantizedWeight holds them;
// isa "" picks the widest instruction set the CPU has, "avx512", "avx2" or "scalar" forces one.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor data, c10::optional<torch::Tensor> scale,
                           const std::string& qtype, c10::optional<torch::Tensor> bias, const std::string& isa);
torch::Tensor quant_dequantize(torch::Tensor data, c10::optional<torch::Tensor> scale, const std::string& qtype,
                               c10::optional<torch::Tensor> rows, const std::string& isa);
std::string quant_isa(const std::string& requested);

namespace quire {
// v rounded up to a multiple of `to` (padding of packed blocks and tiles).
inline int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }
}  // namespace quire

// Row-level pieces of the kernels above, for the decoder stack's one-region path (decode_stack.cpp), which
// splits the work over its threads itself. Each is compiled once, so every caller gets the same bits.
namespace quire {

// out = weight * x / rms(x), with x += residual first where residual is given (new_residual = that sum);
// `summed`: scratch for `hidden` floats. T: float or uint16_t (bfloat16 bits).
template <typename T>
void rms_norm_row(const T* x, const T* residual, const T* weight, T* out, T* new_residual, int64_t hidden, float eps,
                  float* summed);
// One head of rotate (rotate-half layout): cos/sin hold dim / 2 values.
template <typename T>
void rotate_head(const T* x, const T* cos, const T* sin, T* out, int64_t dim);
// out[i] = silu(gate[i]) * up[i] for count values.
template <typename T>
void silu_mul_span(const T* gate, const T* up, T* out, int64_t count);
// onednn_gemv's kernel from one 32-output group of a packed weight on (onednn_gemv.cpp; `packed_data` from
// onednn_packed_data): rows (<= 8) of x as k-pairs (`P` per row, zero past K), `count` outputs (<= 32 times
// onednn_gemv_block_groups(): with oneDNN's 64-output blocks, two groups from an even one read in one pass;
// bias already offset to them or null) to out (row stride out_stride). Unavailable in a build without AVX-512 BF16.
bool onednn_gemv_blocks_available();
int64_t onednn_gemv_block_groups();
const uint16_t* onednn_packed_data(const torch::Tensor& packed);
void onednn_gemv_block(const uint32_t* pairs, int64_t rows, int64_t P, const uint16_t* packed_data, int64_t block,
                       const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t count);
// onednn_gemv's AMX kernel for 32-output groups [first, last) of a packed weight: `rows` (<= onednn_amx_max_rows(),
// 0 where the CPU, the build or oneDNN's block width rule it out) rows of x, Kp bfloat16 each (zero past K),
// followed by zero rows up to a multiple of 16; `count` outputs from group `first` on (bias offset to them, or
// null) to out (row stride out_stride). Each row gets the bits onednn_gemv gives it. Loads and releases the tiles.
int64_t onednn_amx_max_rows();
void onednn_amx_groups(const uint16_t* x, int64_t rows, int64_t Kp, const uint16_t* packed_data, int64_t first,
                       int64_t last, const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t count);
// onednn_gemv's vdpbf16ps kernel for 9 to onednn_wide_max_rows() rows (0 unless oneDNN packs 64-output blocks:
// AMD Zen 4) over 32-output groups [first, last) of a packed weight (first even: whole blocks), block by block in
// runs of up to 6 rows, each block's later runs bringing the next block of the range into L2; rows of x as k-pairs
// (`P` per row, zero past K); `count` outputs from group `first` on (bias offset to them, or null) to out (row
// stride out_stride). Each row gets the bits onednn_gemv gives it.
int64_t onednn_wide_max_rows();
// Equal-sized pieces of memory (`slab_lines` cache lines each) that onednn_wide_groups brings into the cache on the
// way, `per_unit` pieces with the first run of each block, from `next` on (the decode stack's split rows: the next
// layer's cached keys and values of a thread's rows, asked for while the products, which do not wait on memory,
// run).
struct SlabQueue {
  const char* const* slabs = nullptr;
  int64_t count = 0, next = 0, per_unit = 0, slab_lines = 0;
};
void onednn_wide_groups(const uint32_t* pairs, int64_t rows, int64_t P, const uint16_t* packed_data, int64_t first,
                        int64_t last, const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t count,
                        SlabQueue* queue = nullptr);
// paged_decode's bfloat16 kernel for one request and KV head (paged_decode.cpp): the `group` query heads that
// share it (query: group x head_dim bfloat16, rotated), over `length` cached tokens in `blocks`; float32
// output [group, head_dim]. False in a build without AVX-512 BF16 (or head_dim not a multiple of 32).
struct AttentionScratch {
  std::vector<const uint16_t*> key_rows, value_rows;
  std::vector<float> probs, totals;
  std::vector<uint32_t> pairs;  // probabilities as bfloat16, two tokens a dword
  std::vector<uint16_t> zeros;  // a zero row (after an odd count of value rows)
};
bool paged_decode_item_available(int64_t head_dim);
// paged_decode's general path (AVX2 tiles, or portable code) for one request's KV heads [first_kv, last_kv) of a bfloat16 cache: `query` holds
// their query heads' rows in float32 ([(last_kv - first_kv) * group, head_dim]), `out` gets theirs in float32.
void paged_decode_heads_bf16(const float* query, const uint16_t* key_cache, const uint16_t* value_cache,
                             const int64_t* blocks, int64_t length, int64_t first_kv, int64_t last_kv, int64_t group,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float* out);
// linear_bf16 of one float32 row for outputs [first, last): y[n] = bfloat16(x . w[n] + bias[n]), the bits
// linear_bf16 computes for a single row (bias: float32, or null).
void linear_bf16_row_outputs(const float* x, const uint16_t* w, const float* bias, uint16_t* y, int64_t K,
                             int64_t first, int64_t last);
void paged_decode_bf16_item(const uint16_t* query, const uint16_t* key_cache, const uint16_t* value_cache,
                            const int64_t* blocks, int64_t length, int64_t kv, int64_t group, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, float* out, AttentionScratch& scratch);
}  // namespace quire

namespace quire {

// Causal attention of whole bfloat16 prompts in the order of PyTorch's CPU flash kernel (prefill_sdpa_order.cpp),
// for AVX-512 builds and head sizes that are a multiple of 16 up to 128 (sdpa_order_runs). sdpa_order_verified
// also checks once per head size that its bits are at::scaled_dot_product_attention's here.
struct SdpaOrderCall {
  const uint16_t *query, *key, *value;  // rows [T][heads][D], bfloat16, heads and dims dense within a row
  int64_t q_stride, k_stride, v_stride;  // elements from one row to the next
  int64_t Hq, Hk, D;
  float scale;
  uint16_t* out;
  int64_t out_stride;
  std::vector<std::pair<int64_t, int64_t>> prompts;  // (first row, rows), each a whole prompt
};
bool sdpa_order_runs(int64_t head_dim);
bool sdpa_order_verified(int64_t head_dim);
void sdpa_order_attention(const SdpaOrderCall& call);

}  // namespace quire
