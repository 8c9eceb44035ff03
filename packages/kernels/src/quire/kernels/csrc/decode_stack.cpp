// The decoder stack for decode steps (see decode_stack.h).
//
// A batch-1 decode step of a 0.5B model spends ~40 ms reading weights and, through the Python modules,
// ~6 ms more in the glue between ~15 kernel calls per layer (module calls, views, argument conversion,
// the KV write through index_copy_). Here the same kernels run back to back from C++.
#include "decode_stack.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_set>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"
#include "kernels.h"
#include "parallel.h"

namespace quire {

namespace {

torch::Tensor required(const std::optional<torch::Tensor>& t, const char* name) {
  TORCH_CHECK(t.has_value() && t->defined(), "DecodeStack: every layer needs ", name);
  return t->contiguous();
}

std::optional<torch::Tensor> optional(const std::optional<torch::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  return t->contiguous();
}

// A linear weight from a bfloat16 tensor or, where `segments` is not empty, from quantized row segments.
LinearWeight linear_weight(const std::optional<torch::Tensor>& dense, const std::vector<QuantSegment>& segments,
                           const char* name) {
  LinearWeight w;
  if (segments.empty()) {
    TORCH_CHECK(dense.has_value() && dense->defined(), "DecodeStack: every layer needs ", name);
    w.onednn = dense->is_mkldnn();
    w.dense = w.onednn ? *dense : dense->contiguous();  // a packed weight has no strides to make contiguous
    w.gemv = w.onednn && onednn_gemv_layout(w.dense);
    TORCH_CHECK(w.dense.scalar_type() == at::kBFloat16, "DecodeStack: ", name,
                " must be bfloat16 or quantized");
    w.out_features = w.dense.size(0);
    return w;
  }
  TORCH_CHECK(!dense.has_value() || !dense->defined(), "DecodeStack: ", name, " is both dense and quantized");
  for (const auto& [data, scale, qtype] : segments) {
    TORCH_CHECK(data.dim() == 2 && data.is_contiguous(), "DecodeStack: ", name,
                " segments must be contiguous 2-D tensors");
    w.out_features += data.size(0);
  }
  w.segments = segments;
  return w;
}

// oneDNN's linear op on a weight it packed, called as quire.kernels.linear.OneDNNLinear calls it from Python
// (through the dispatcher: PyTorch exports no C++ function for it).
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const std::optional<torch::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias.has_value() ? c10::IValue(*bias) : c10::IValue(), c10::IValue("none"),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x @ w.T + bias with the kernels (and in the order) quire.core.models.layers.Linear uses.
torch::Tensor apply(const LinearWeight& w, const torch::Tensor& x, const std::optional<torch::Tensor>& bias) {
  if (w.onednn) {
    return w.gemv && x.size(0) <= onednn_gemv_max_rows() ? onednn_gemv(x, w.dense, bias)
                                                         : onednn_linear(x, w.dense, bias);
  }
  if (w.segments.empty()) return linear_bf16(x, w.dense, bias);
  if (w.segments.size() == 1) {
    const auto& [data, scale, qtype] = w.segments[0];
    return quant_linear(x, data, scale, qtype, bias, "");
  }
  std::vector<torch::Tensor> parts;
  parts.reserve(w.segments.size());
  for (const auto& [data, scale, qtype] : w.segments) parts.push_back(quant_linear(x, data, scale, qtype, {}, ""));
  auto out = torch::cat(parts, -1);
  return bias.has_value() ? out + *bias : out;
}

// Store each row's new key ([B, Hk, D], contiguous) and value (rows of `value`, each Hk * D contiguous)
// in its slot of the layer's cache [2, N, block, Hk, D].
void write_kv(const torch::Tensor& key, const torch::Tensor& value, const torch::Tensor& cache,
              const torch::Tensor& slots) {
  TORCH_CHECK(cache.is_contiguous() && cache.scalar_type() == key.scalar_type(),
              "DecodeStack: the KV cache must be contiguous and of the model's dtype");
  const int64_t rows = key.size(0), row_elements = key.size(1) * key.size(2);
  TORCH_CHECK(cache.size(3) * cache.size(4) == row_elements, "DecodeStack: KV cache heads do not match");
  const int64_t num_slots = cache.size(1) * cache.size(2), element = key.element_size();
  const int64_t row_bytes = row_elements * element;
  auto* keys = static_cast<char*>(cache.data_ptr());
  auto* values = keys + cache.stride(0) * element;
  const auto* key_rows = static_cast<const char*>(key.data_ptr());
  const auto* value_rows = static_cast<const char*>(value.data_ptr());
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < num_slots, "DecodeStack: slot ", slot[r], " is outside the cache");
    std::memcpy(keys + slot[r] * row_bytes, key_rows + r * row_bytes, row_bytes);
    std::memcpy(values + slot[r] * row_bytes, value_rows + r * value.stride(0) * element, row_bytes);
  }
}

}  // namespace

DecodeStack::DecodeStack(const std::vector<std::vector<std::optional<torch::Tensor>>>& layers,
                         torch::Tensor final_norm, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         double eps, double scale,
                         const std::vector<std::vector<std::vector<QuantSegment>>>& quantized)
    : final_norm_(final_norm.contiguous()), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
      head_dim_(head_dim), eps_(eps), scale_(scale) {
  TORCH_CHECK(quantized.empty() || quantized.size() == layers.size(),
              "DecodeStack: quantized weights must be given for every layer or none");
  const std::vector<std::vector<QuantSegment>> dense(4);
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& t = layers[i];
    TORCH_CHECK(t.size() == 10, "DecodeStack: each layer is 10 tensors (or None)");
    const auto& q = quantized.empty() ? dense : quantized[i];
    TORCH_CHECK(q.size() == 4, "DecodeStack: quantized weights are [qkv, o_proj, gate_up, down] per layer");
    layers_.push_back({required(t[0], "input_norm"), linear_weight(t[1], q[0], "qkv"), optional(t[2]),
                       optional(t[3]), optional(t[4]), linear_weight(t[5], q[1], "o_proj"), optional(t[6]),
                       required(t[7], "post_norm"), linear_weight(t[8], q[2], "gate_up"),
                       linear_weight(t[9], q[3], "down")});
    const auto& layer = layers_.back();
    TORCH_CHECK(layer.qkv.out_features == (num_heads + 2 * num_kv_heads) * head_dim,
                "DecodeStack: qkv has ", layer.qkv.out_features, " rows for ", num_heads, "+2x", num_kv_heads,
                " heads of ", head_dim);
    TORCH_CHECK(layer.q_norm.has_value() == layer.k_norm.has_value(), "DecodeStack: q_norm without k_norm");
  }
  // The one-region path: every linear layer read by onednn_gemv's kernel, bfloat16 norms and biases, head_dim
  // that paged_decode's bfloat16 kernel takes, and gate/up halves that split at a 32-output block.
  one_region_ = !layers_.empty() && onednn_gemv_blocks_available() && paged_decode_item_available(head_dim) &&
                final_norm_.scalar_type() == at::kBFloat16;
  const int64_t hidden = final_norm_.numel();
  for (const auto& layer : layers_) {
    intermediate_ = layer.gate_up.out_features / 2;
    const bool bf16 = layer.input_norm.scalar_type() == at::kBFloat16 &&
                      layer.post_norm.scalar_type() == at::kBFloat16 &&
                      (!layer.qkv_bias.has_value() || layer.qkv_bias->scalar_type() == at::kBFloat16) &&
                      (!layer.o_bias.has_value() || layer.o_bias->scalar_type() == at::kBFloat16) &&
                      (!layer.q_norm.has_value() || (layer.q_norm->scalar_type() == at::kBFloat16 &&
                                                     layer.k_norm->scalar_type() == at::kBFloat16));
    one_region_ = one_region_ && bf16 && layer.qkv.gemv && layer.o_proj.gemv && layer.gate_up.gemv &&
                  layer.down.gemv && intermediate_ % 32 == 0 && layer.gate_up.out_features == 2 * intermediate_ &&
                  layer.o_proj.out_features == hidden && layer.down.out_features == hidden &&
                  layer.qkv.dense.size(1) == hidden && layer.o_proj.dense.size(1) == num_heads * head_dim &&
                  layer.gate_up.dense.size(1) == hidden && layer.down.dense.size(1) == intermediate_ &&
                  intermediate_ == layers_.front().gate_up.out_features / 2;
  }
  // The one-row path: every linear layer a plain bfloat16 weight for linear_bf16's AVX2 kernel, and the
  // same bfloat16 norms, biases and shapes.
  row_region_ = !one_region_ && !layers_.empty() && linear_bf16_vectorized() &&
                final_norm_.scalar_type() == at::kBFloat16;
  for (const auto& layer : layers_) {
    const auto plain = [](const LinearWeight& w) {
      return !w.onednn && w.segments.empty() && w.dense.dim() == 2 && w.dense.is_contiguous();
    };
    const bool bf16 = layer.input_norm.scalar_type() == at::kBFloat16 &&
                      layer.post_norm.scalar_type() == at::kBFloat16 &&
                      (!layer.qkv_bias.has_value() || layer.qkv_bias->scalar_type() == at::kBFloat16) &&
                      (!layer.o_bias.has_value() || layer.o_bias->scalar_type() == at::kBFloat16) &&
                      (!layer.q_norm.has_value() || (layer.q_norm->scalar_type() == at::kBFloat16 &&
                                                     layer.k_norm->scalar_type() == at::kBFloat16));
    const int64_t inter = layer.gate_up.out_features / 2;
    row_region_ = row_region_ && bf16 && plain(layer.qkv) && plain(layer.o_proj) && plain(layer.gate_up) &&
                  plain(layer.down) && layer.gate_up.out_features == 2 * inter &&
                  layer.o_proj.out_features == hidden && layer.down.out_features == hidden &&
                  layer.qkv.dense.size(1) == hidden && layer.o_proj.dense.size(1) == num_heads * head_dim &&
                  layer.gate_up.dense.size(1) == hidden && layer.down.dense.size(1) == inter;
    // linear_bf16 adds a bias as float32 (the bfloat16 value, exactly)
    float_biases_.push_back({layer.qkv_bias.has_value() ? layer.qkv_bias->to(at::kFloat) : torch::Tensor(),
                             layer.o_bias.has_value() ? layer.o_bias->to(at::kFloat) : torch::Tensor()});
  }
  const char* setting = std::getenv("QUIRE_DECODE_ONE_REGION");  // "0": always the kernel-by-kernel path
  if (setting != nullptr && std::string(setting) == "0") one_region_ = row_region_ = false;
}

// ---- one parallel region for a whole decode step (up to 8 rows; 128 with AMX, 64 with oneDNN's 64-wide blocks) ----
//
// At batch 1 a layer of a small model is ~0.3 ms of weight reads, and the path above spends a good part of
// it between kernels: each opens and closes its own parallel region (~6 per layer), allocates its output,
// and the norms, rotations and KV writes run on one thread while the others wait. Here every thread runs
// the whole stack in one region: the linear layers' 32-output blocks and the attention's KV heads are
// claimed from shared counters, a barrier follows each, and the small row operations (norms, residual adds)
// run on every thread at once, each on its own copy, instead of on one thread between two barriers (with
// more than 8 rows the norms' rows are shared out instead, a barrier after each).
// Gate/up and SiLU are fused: a thread claims a run of gate blocks, computes it and the matching run of up
// blocks (I/32 further on), then their SiLU-and-multiply straight into the down projection's input.
// Every value is computed by the same compiled functions as on the path above (rms_norm_row, rotate_head,
// silu_mul_span, onednn_gemv_block, onednn_wide_groups or onednn_amx_groups, paged_decode_bf16_item), so the
// results are the same bits. From 16 rows on two threads (oneDNN's 64-output blocks), each thread instead takes
// its own run of rows through every layer without barriers (split rows, below).

namespace {

// the k-pairs view of a padded row buffer (uint32_t) as bfloat16 bits
inline uint16_t* as_bf16(std::vector<uint32_t>& pairs) { return reinterpret_cast<uint16_t*>(pairs.data()); }

const uint16_t* bf16_data(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

const uint16_t* bf16_data(const std::optional<torch::Tensor>& t) {
  return t.has_value() ? bf16_data(*t) : nullptr;
}


// run(first, last) over [0, count), claimed `chunk` at a time from a phase's counter shared by the threads
template <typename F>
void claim(std::atomic<int64_t>& counter, int64_t count, int64_t chunk, F&& run) {
  for (int64_t first = counter.fetch_add(chunk, std::memory_order_relaxed); first < count;
       first = counter.fetch_add(chunk, std::memory_order_relaxed)) {
    run(first, std::min(count, first + chunk));
  }
}

// run(first, last, r0, rows) over groups [0, count) and rows [0, B), claimed as claim() does, `chunk` groups and
// every row at a time, except that where the claims do not go evenly round the threads the last one is split by
// rows into `threads` parts (quire::row_run's runs of rows): at 32 rows SmolLM2-135M's qkv is 15 claims of
// a 64-output block, its o_proj and down 9, and a thread that took one claim more kept the other waiting at the
// barrier for it. Both parts read the block's whole weight, the second mostly from the shared L3.
template <typename F>
void claim_split_last(std::atomic<int64_t>& counter, int64_t count, int64_t chunk, int64_t B, int64_t threads,
                      F&& run) {
  const int64_t claims = (count + chunk - 1) / chunk;
  const bool split = threads > 1 && claims % threads != 0 && B >= 2 * threads;
  const int64_t items = split ? claims - 1 + threads : claims;
  for (int64_t item = counter.fetch_add(1, std::memory_order_relaxed); item < items;
       item = counter.fetch_add(1, std::memory_order_relaxed)) {
    const int64_t claim = std::min(item, claims - 1), first = claim * chunk, last = std::min(count, first + chunk);
    if (split && item >= claims - 1) {
      const auto [r0, rows] = quire::row_run(B, threads, item - (claims - 1));
      run(first, last, r0, rows);
    } else {
      run(first, last, int64_t{0}, B);
    }
  }
}

// Each layer's key and value halves of its bfloat16 cache [2, N, block, Hk, D], checked.
void cache_halves(const std::vector<torch::Tensor>& kv_caches, int64_t block_size, int64_t num_slots, int64_t Hk,
                  int64_t D, std::vector<const uint16_t*>& keys, std::vector<const uint16_t*>& values) {
  for (const auto& cache : kv_caches) {
    TORCH_CHECK(cache.is_contiguous() && cache.scalar_type() == at::kBFloat16 && cache.dim() == 5 &&
                    cache.size(2) == block_size && cache.size(1) * block_size == num_slots &&
                    cache.size(3) == Hk && cache.size(4) == D,
                "DecodeStack: the KV caches must be contiguous bfloat16 [2, N, block, ", Hk, ", ", D, "]");
    keys.push_back(bf16_data(cache));
    values.push_back(keys.back() + cache.stride(0));
  }
}

struct ThreadBuffers {
  std::vector<uint32_t> x;          // the normed hidden state as k-pairs, rows x P_hidden
  std::vector<uint16_t> residual[2];
  std::vector<float> summed;        // rms_norm_row's scratch
  std::vector<uint16_t> query;      // a KV head's group of rotated query heads
  std::vector<uint16_t> head;       // a q/k head after its norm
  std::vector<float> attention;     // the group's float32 attention output
  std::vector<uint16_t> gate_up;    // rows x (gate block, up block)
  AttentionScratch scratch;
  std::vector<const char*> slabs;   // split rows: the blocks of the next layer's cache that its rows read
  SlabQueue queue;
};

}  // namespace

torch::Tensor DecodeStack::forward_one_region(const torch::Tensor& hidden, const std::vector<torch::Tensor>& kv_caches,
                                              const torch::Tensor& tables, const torch::Tensor& lengths,
                                              const torch::Tensor& slots, const torch::Tensor& cos,
                                              const torch::Tensor& sin) const {
  const int64_t B = hidden.size(0), Hd = hidden.size(1), H = num_heads_, Hk = num_kv_heads_, D = head_dim_;
  const int64_t group = H / Hk, q_size = H * D, kv_size = Hk * D, I = intermediate_;
  const int64_t qkv_n = q_size + 2 * kv_size, half = D / 2;
  const int64_t P_hidden = (Hd + 31) / 32 * 16, P_q = (q_size + 31) / 32 * 16, P_inter = I / 2;
  const int64_t max_blocks = tables.size(1), num_layers = static_cast<int64_t>(layers_.size());
  const int64_t block_size = kv_caches[0].size(2), num_slots = kv_caches[0].size(1) * block_size;
  const int64_t* length_of = lengths.data_ptr<int64_t>();
  const int64_t* slot_of = slots.data_ptr<int64_t>();
  const int64_t* table = tables.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(slot_of[b] >= 0 && slot_of[b] < num_slots, "DecodeStack: slot ", slot_of[b], " is outside the cache");
    TORCH_CHECK(length_of[b] >= 1 && length_of[b] <= max_blocks * block_size, "DecodeStack: sequence length ",
                length_of[b], " does not fit its block table");
    longest = std::max(longest, length_of[b]);
  }
  // Whether a row reads a cache slot another row of this step writes (several queries of one request: a prompt's
  // tail after its cached prefix, or a speculative step's drafts). Such a step writes every row's keys and values
  // into the cache before any row's attention; otherwise each row's attention follows its own write.
  bool chained = false;
  {
    const std::unordered_set<int64_t> written(slot_of, slot_of + B);
    for (int64_t b = 0; b < B && !chained; ++b) {
      for (int64_t p = std::max<int64_t>(0, length_of[b] - B); p + 1 < length_of[b] && !chained; ++p) {
        chained = written.count(table[b * max_blocks + p / block_size] * block_size + p % block_size) > 0;
      }
    }
  }
  std::vector<const uint16_t*> keys, values;
  cache_halves(kv_caches, block_size, num_slots, Hk, D, keys, values);
  std::vector<const uint16_t*> weights(num_layers * 4);
  for (int64_t l = 0; l < num_layers; ++l) {
    const auto& layer = layers_[l];
    weights[l * 4 + 0] = onednn_packed_data(layer.qkv.dense);
    weights[l * 4 + 1] = onednn_packed_data(layer.o_proj.dense);
    weights[l * 4 + 2] = onednn_packed_data(layer.gate_up.dense);
    weights[l * 4 + 3] = onednn_packed_data(layer.down.dense);
  }
  const int threads = std::max(1, at::get_num_threads());
  // Up to kOneRegionMaxRows rows the linear layers run on onednn_gemv_block and every thread computes each norm
  // for itself. More rows share one copy of the normed rows, the norms' rows shared out among the threads, a
  // barrier after each (a thread's own copy of 64 rows would cost more than the barrier), and the linear layers
  // go through AMX tiles (up to onednn_amx_max_rows, from row buffers padded with zero rows to a multiple of 16)
  // or, with oneDNN's 64-output blocks, through onednn_gemv's runs of rows (up to onednn_wide_max_rows).
  const bool shared = B > kOneRegionMaxRows;
  const bool amx = shared && onednn_amx_max_rows() >= B;
  const int64_t padded_rows = amx ? (B + 15) / 16 * 16 : B;
  const int64_t qkv_blocks = (qkv_n + 31) / 32, hidden_blocks = (Hd + 31) / 32, inter_blocks = I / 32;
  // claims of whole units (two 32-output groups where oneDNN packs 64-output blocks), starting on a unit
  const int64_t unit = onednn_gemv_block_groups();
  auto chunk_of = [threads, unit](int64_t blocks) {
    return std::max<int64_t>(1, blocks / (4 * threads) / unit) * unit;
  };
  const int64_t qkv_chunk = chunk_of(qkv_blocks), hidden_chunk = chunk_of(hidden_blocks);
  const int64_t inter_chunk = chunk_of(inter_blocks), row_chunk = std::max<int64_t>(1, B / (4 * threads));
  // a row's KV heads together where there are rows enough to go round (as paged_decode takes them: the heads of
  // a token share its cache lines, which the hardware then brings into one core's cache for all of them)
  const int64_t heads_chunk = B >= 4 * threads ? Hk : 1;
  // Split rows (on oneDNN's 64-output blocks, two threads, at least kSplitMinRows rows a thread, no row reading
  // another's new key): each thread takes a run of the rows through every layer on its own, every projection
  // whole, with no barrier until the end. Its attention, which waits on memory, then overlaps the other thread's
  // products, and the weight the first thread brings in is in the shared L3 when the second reads it.
  const bool split = shared && !amx && !chained && threads == kSplitThreads && B >= kSplitMinRows * threads;
  // Split rows: the next layer's cached keys and values of a thread's rows (a block's keys, or its values, are one
  // slab of whole cache lines) are brought into the cache while its products run, spread over the units of blocks
  // (the units' first runs take them) from the up projection to the next qkv. (From o_proj on, further from the
  // attention that reads them, was ~2% slower a step.)
  const auto units = [unit](int64_t groups) { return (groups + unit - 1) / unit; };
  const int64_t qkv_units = units(qkv_blocks);
  const int64_t units_from_up = units(inter_blocks) + units(hidden_blocks) + qkv_units;
  const int64_t slab_bytes = block_size * kv_size * 2;
  const int64_t slab_lines = slab_bytes / 64;
  const bool prefetch_kv = split && slab_bytes % 64 == 0;
  std::vector<int64_t> bounds(threads + 1, B);
  bounds[0] = 0;
  if (split) {
    // runs of rows of about equal cost: a row's multiply-adds in the projections, and those of its attention
    // (two per query head and dim, for each cached token) at kAttentionCost times theirs: on memory's pace, a
    // multiply-add there took about six times as long (Zen 4, SmolLM2-135M's 32-row steps)
    constexpr int64_t kAttentionCost = 6;
    const int64_t row_cost = Hd * (qkv_n + 2 * I) + (q_size + I) * Hd, token_cost = kAttentionCost * 2 * H * D;
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b) total += row_cost + token_cost * length_of[b];
    int64_t so_far = 0;
    for (int64_t b = 0, t = 1; b < B && t < threads; ++b) {
      so_far += row_cost + token_cost * length_of[b];
      while (t < threads && so_far * threads >= total * t) bounds[t++] = b + 1;
    }
  }
  std::vector<ThreadBuffers> buffers(threads);
  for (auto& t : buffers) {
    if (!shared) {
      t.x.assign(B * P_hidden, 0);
      t.residual[0].resize(B * Hd);
      t.residual[1].resize(B * Hd);
    }
    t.summed.resize(std::max(Hd, D));
    t.query.resize(group * D);
    t.head.resize(D);
    t.attention.resize(group * D);
    t.gate_up.resize(B * 64 * (split ? inter_blocks : inter_chunk));
    t.scratch.key_rows.reserve(longest);
    t.scratch.value_rows.reserve(longest);
    t.scratch.probs.reserve(group * longest);
    t.scratch.totals.reserve(group);
  }
  // shared: the projections' outputs (each written by whichever thread claims a block), the attention and
  // SiLU outputs as k-pairs (zero past their width), the counters each phase claims work from; with shared rows
  // the normed rows and the residual too
  std::vector<uint16_t> qkv(B * qkv_n), projected(B * Hd), down(B * Hd), queries(chained ? B * q_size : 0);
  std::vector<uint32_t> attention_pairs(padded_rows * P_q, 0), act_pairs(padded_rows * P_inter, 0);
  std::vector<uint32_t> shared_x(shared ? padded_rows * P_hidden : 0, 0);
  std::vector<uint16_t> shared_residual[2] = {std::vector<uint16_t>(shared ? B * Hd : 0),
                                              std::vector<uint16_t>(shared ? B * Hd : 0)};
  constexpr int64_t kPhases = 8;
  std::unique_ptr<std::atomic<int64_t>[]> counters(new std::atomic<int64_t>[num_layers * kPhases + 1]());
  auto out = torch::empty({B, Hd}, hidden.options());
  const uint16_t* input = bf16_data(hidden);
  const uint16_t* cos_p = bf16_data(cos);
  const uint16_t* sin_p = bf16_data(sin);
  const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);
  auto each = [](auto&& run) {  // run(i) for each index of a claimed range
    return [&run](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) run(i);
    };
  };
  // out[m][0:n] = the B rows of `in` (k-pairs, P per row) . groups [first, last) of weight w, + bias (offset to
  // group first, or null); out and bias start at group first's output 0, n outputs from there
  auto linear = [&](const uint32_t* in, int64_t P, const uint16_t* w, int64_t first, int64_t last,
                    const uint16_t* bias, uint16_t* out_first, int64_t out_stride, int64_t n) {
    if (amx) {
      onednn_amx_groups(reinterpret_cast<const uint16_t*>(in), B, 2 * P, w, first, last, bias, out_first, out_stride,
                        n);
      return;
    }
    if (shared) {
      onednn_wide_groups(in, B, P, w, first, last, bias, out_first, out_stride, n);
      return;
    }
    for (int64_t b = first; b < last; b += unit) {
      const int64_t c0 = (b - first) * 32;
      onednn_gemv_block(in, B, P, w, b, bias != nullptr ? bias + c0 : nullptr, out_first + c0, out_stride,
                        std::min<int64_t>(32 * std::min(unit, last - b), n - c0));
    }
  };

  // qkv, o_proj and down: out[m][0:n] = the rows of `in` . weight w (+ bias), claims of `chunk` groups from the
  // phase's counter; on onednn_gemv's runs of rows the last claim split by rows (claim_split_last)
  auto project = [&](std::atomic<int64_t>& counter, int64_t groups, int64_t chunk, const uint32_t* in, int64_t P,
                     const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t n) {
    if (shared && !amx) {
      claim_split_last(counter, groups, chunk, B, threads, [&](int64_t first, int64_t last, int64_t r0, int64_t rows) {
        onednn_wide_groups(in + r0 * P, rows, P, w, first, last, bias != nullptr ? bias + first * 32 : nullptr,
                           out + r0 * out_stride + first * 32, out_stride, n - first * 32);
      });
      return;
    }
    claim(counter, groups, chunk, [&](int64_t first, int64_t last) {
      linear(in, P, w, first, last, bias != nullptr ? bias + first * 32 : nullptr, out + first * 32, out_stride,
             n - first * 32);
    });
  };

#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    const int me = omp_get_thread_num(), team = omp_get_num_threads();
#else
    const int me = 0, team = 1;
#endif
    ThreadBuffers& mine = buffers[me];
    // split: this thread's own rows, [my_first, my_last), through every layer (the runs of `threads` shared out
    // among the team, should OpenMP have started fewer)
    const int64_t my_first = bounds[me * threads / team], my_last = bounds[(me + 1) * threads / team];
    const int64_t my_rows = my_last - my_first;
    // split rows: layer l's cached keys and values of this thread's rows, block by block as its attention reads
    // them, for the first runs of the next `spread` units of products to bring in
    SlabQueue* queue = nullptr;
    auto queue_layer = [&](int64_t l, int64_t spread) {
      queue = nullptr;
      if (!prefetch_kv || l >= num_layers) return;
      mine.slabs.clear();
      for (int64_t m = my_first; m < my_last; ++m) {
        const int64_t blocks = (length_of[m] + block_size - 1) / block_size;
        for (const uint16_t* half : {keys[l], values[l]}) {
          for (int64_t b = 0; b < blocks; ++b) {
            mine.slabs.push_back(reinterpret_cast<const char*>(half + table[m * max_blocks + b] * block_size * kv_size));
          }
        }
      }
      const int64_t count = static_cast<int64_t>(mine.slabs.size());
      mine.queue = SlabQueue{mine.slabs.data(), count, 0, (count + spread - 1) / spread, slab_lines};
      queue = &mine.queue;
    };
    if (split) queue_layer(0, qkv_units);
    uint32_t* x_pairs = shared ? shared_x.data() : mine.x.data();
    uint16_t* x = reinterpret_cast<uint16_t*>(x_pairs);
    uint16_t* residual_out[2] = {shared ? shared_residual[0].data() : mine.residual[0].data(),
                                 shared ? shared_residual[1].data() : mine.residual[1].data()};
    // norm(m) for each row: every thread all of them (its own copy), or with shared rows a share of them
    auto norm_rows = [&](std::atomic<int64_t>& counter, auto&& norm) {
      if (split) {
        for (int64_t m = my_first; m < my_last; ++m) norm(m);
      } else if (shared) {
        claim(counter, B, row_chunk, each(norm));
      } else {
        for (int64_t m = 0; m < B; ++m) norm(m);
      }
    };
    const uint16_t* residual = input;  // layer 0: the embeddings are the residual
    int flip = 0;
    for (int64_t l = 0; l < num_layers; ++l) {
      const auto& layer = layers_[l];
      std::atomic<int64_t>* counter = &counters[l * kPhases];
      // input norm
      norm_rows(counter[5], [&](int64_t m) {
        if (l == 0) {
          rms_norm_row<uint16_t>(input + m * Hd, nullptr, bf16_data(layer.input_norm), x + m * 2 * P_hidden,
                                 nullptr, Hd, eps, mine.summed.data());
        } else {
          rms_norm_row<uint16_t>(down.data() + m * Hd, residual + m * Hd, bf16_data(layer.input_norm),
                                 x + m * 2 * P_hidden, residual_out[flip] + m * Hd, Hd, eps, mine.summed.data());
        }
      });
      if (shared && !split) {
#pragma omp barrier
      }
      if (l > 0) {
        residual = residual_out[flip];
        flip ^= 1;
      }
      // qkv
      const uint16_t* qkv_bias = bf16_data(layer.qkv_bias);
      if (split) {
        onednn_wide_groups(x_pairs + my_first * P_hidden, my_rows, P_hidden, weights[l * 4 + 0], 0, qkv_blocks,
                           qkv_bias, qkv.data() + my_first * qkv_n, qkv_n, qkv_n, queue);
      } else {
        project(counter[0], qkv_blocks, qkv_chunk, x_pairs, P_hidden, weights[l * 4 + 0], qkv_bias, qkv.data(),
                qkv_n, qkv_n);
#pragma omp barrier
      }
      // per row and KV head: q/k norms, rotation, the new key and value into the cache, attention
      uint16_t* attention_out = as_bf16(attention_pairs);
      // a row's KV head: q/k norms, rotation, the new key and value into the cache; its group of rotated query
      // heads into query_out
      auto prepare_head = [&](int64_t m, int64_t kv, uint16_t* query_out) {
        const uint16_t* row = qkv.data() + m * qkv_n;
        const uint16_t* c = cos_p + m * half;
        const uint16_t* s = sin_p + m * half;
        const int64_t slot_offset = slot_of[m] * kv_size + kv * D;
        uint16_t* key_slot = const_cast<uint16_t*>(keys[l]) + slot_offset;
        uint16_t* value_slot = const_cast<uint16_t*>(values[l]) + slot_offset;
        const uint16_t* key = row + q_size + kv * D;
        if (layer.k_norm.has_value()) {
          rms_norm_row<uint16_t>(key, nullptr, bf16_data(layer.k_norm), mine.head.data(), nullptr, D, eps,
                                 mine.summed.data());
          key = mine.head.data();
        }
        rotate_head<uint16_t>(key, c, s, key_slot, D);
        std::memcpy(value_slot, row + q_size + kv_size + kv * D, D * sizeof(uint16_t));
        for (int64_t r = 0; r < group; ++r) {
          const uint16_t* query = row + (kv * group + r) * D;
          if (layer.q_norm.has_value()) {
            rms_norm_row<uint16_t>(query, nullptr, bf16_data(layer.q_norm), mine.head.data(), nullptr, D, eps,
                                   mine.summed.data());
            query = mine.head.data();
          }
          rotate_head<uint16_t>(query, c, s, query_out + r * D, D);
        }
      };
      // attention of a row's KV head, from its rotated query heads
      auto attend = [&](int64_t m, int64_t kv, const uint16_t* query) {
        paged_decode_bf16_item(query, keys[l], values[l], table + m * max_blocks, length_of[m], kv, group, Hk, D,
                               block_size, scale, mine.attention.data(), mine.scratch);
        uint16_t* dst = attention_out + m * 2 * P_q + kv * group * D;
        for (int64_t i = 0; i < group * D; ++i) dst[i] = float_to_bf16_as_torch(mine.attention[i]);
      };
      if (split) {
        for (int64_t m = my_first; m < my_last; ++m) {
          for (int64_t kv = 0; kv < Hk; ++kv) {
            prepare_head(m, kv, mine.query.data());
            attend(m, kv, mine.query.data());
          }
        }
      } else if (chained) {  // every row's cache writes (and rotated queries), then every row's attention
        claim(counter[1], B * Hk, heads_chunk, each([&](int64_t item) {
          const int64_t m = item / Hk, kv = item % Hk;
          prepare_head(m, kv, queries.data() + m * q_size + kv * group * D);
        }));
#pragma omp barrier
        claim(counter[7], B * Hk, heads_chunk, each([&](int64_t item) {
          const int64_t m = item / Hk, kv = item % Hk;
          attend(m, kv, queries.data() + m * q_size + kv * group * D);
        }));
      } else {
        claim(counter[1], B * Hk, heads_chunk, each([&](int64_t item) {
          const int64_t m = item / Hk, kv = item % Hk;
          prepare_head(m, kv, mine.query.data());
          attend(m, kv, mine.query.data());
        }));
      }
      // o_proj
      const uint16_t* o_bias = bf16_data(layer.o_bias);
      if (split) {
        onednn_wide_groups(attention_pairs.data() + my_first * P_q, my_rows, P_q, weights[l * 4 + 1], 0,
                           hidden_blocks, o_bias, projected.data() + my_first * Hd, Hd, Hd);
      } else {
#pragma omp barrier
        project(counter[2], hidden_blocks, hidden_chunk, attention_pairs.data(), P_q, weights[l * 4 + 1], o_bias,
                projected.data(), Hd, Hd);
#pragma omp barrier
      }
      // post-attention norm
      norm_rows(counter[6], [&](int64_t m) {
        rms_norm_row<uint16_t>(projected.data() + m * Hd, residual + m * Hd, bf16_data(layer.post_norm),
                               x + m * 2 * P_hidden, residual_out[flip] + m * Hd, Hd, eps, mine.summed.data());
      });
      if (shared && !split) {
#pragma omp barrier
      }
      residual = residual_out[flip];
      flip ^= 1;
      // gate/up and SiLU, a claimed run of gate blocks, then the same run of up blocks (two long streams)
      uint16_t* act = as_bf16(act_pairs);
      if (split) {
        // all of gate, then all of up (two long streams; shorter runs of blocks were slower here)
        uint16_t* gate = mine.gate_up.data();
        uint16_t* up = gate + my_rows * I;
        const uint32_t* in = x_pairs + my_first * P_hidden;
        onednn_wide_groups(in, my_rows, P_hidden, weights[l * 4 + 2], 0, inter_blocks, nullptr, gate, I, I);
        queue_layer(l + 1, units_from_up);
        onednn_wide_groups(in, my_rows, P_hidden, weights[l * 4 + 2], inter_blocks, 2 * inter_blocks, nullptr, up, I,
                           I, queue);
        for (int64_t m = 0; m < my_rows; ++m)
          silu_mul_span<uint16_t>(gate + m * I, up + m * I, act + (my_first + m) * I, I);
        onednn_wide_groups(act_pairs.data() + my_first * P_inter, my_rows, P_inter, weights[l * 4 + 3], 0,
                           hidden_blocks, nullptr, down.data() + my_first * Hd, Hd, Hd, queue);
        continue;
      }
      claim(counter[3], inter_blocks, inter_chunk, [&](int64_t first, int64_t last) {
        const int64_t width = (last - first) * 32;
        uint16_t* gate = mine.gate_up.data();
        uint16_t* up = gate + B * width;
        linear(x_pairs, P_hidden, weights[l * 4 + 2], first, last, nullptr, gate, width, width);
        linear(x_pairs, P_hidden, weights[l * 4 + 2], inter_blocks + first, inter_blocks + last, nullptr, up, width,
               width);
        for (int64_t m = 0; m < B; ++m)
          silu_mul_span<uint16_t>(gate + m * width, up + m * width, act + m * I + first * 32, width);
      });
#pragma omp barrier
      // down
      project(counter[4], hidden_blocks, hidden_chunk, act_pairs.data(), P_inter, weights[l * 4 + 3], nullptr,
              down.data(), Hd, Hd);
#pragma omp barrier
    }
    // the final norm: thread 0 alone, or with shared rows a share of the rows each
    auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    auto final_norm = [&](int64_t m) {
      rms_norm_row<uint16_t>(down.data() + m * Hd, residual + m * Hd, bf16_data(final_norm_), o + m * Hd,
                             residual_out[flip] + m * Hd, Hd, eps, mine.summed.data());
    };
    bool lead = true;
#ifdef _OPENMP
    lead = omp_get_thread_num() == 0;
#endif
    if (split) {
      for (int64_t m = my_first; m < my_last; ++m) final_norm(m);
    } else if (shared) {
      claim(counters[num_layers * kPhases], B, row_chunk, each(final_norm));
    } else if (lead) {
      for (int64_t m = 0; m < B; ++m) final_norm(m);
    }
  }
  one_region_steps_.fetch_add(1, std::memory_order_relaxed);
  if (split) split_steps_.fetch_add(1, std::memory_order_relaxed);
  return out;
}

int64_t DecodeStack::one_region_max_rows() const {
  if (!one_region_) return row_region_ ? 1 : 0;
  return std::max({kOneRegionMaxRows, onednn_amx_max_rows(), onednn_wide_max_rows()});
}

// ---- one parallel region for a batch-1 step on the AVX2 kernel path ----
//
// The same plan as forward_one_region for one row, with the kernels the path above runs on AVX2 CPUs:
// linear_bf16's one-row kernel (float32 activations against bfloat16 weight rows, claimed 32 outputs at a
// time) and paged_decode's portable path (one KV head per item). On 2 cores this removes ~120 parallel
// regions a token of SmolLM2-135M and the allocations between them. Same functions, so the same bits.
torch::Tensor DecodeStack::forward_one_row(const torch::Tensor& hidden, const std::vector<torch::Tensor>& kv_caches,
                                           const torch::Tensor& tables, const torch::Tensor& lengths,
                                           const torch::Tensor& slots, const torch::Tensor& cos,
                                           const torch::Tensor& sin) const {
  const int64_t Hd = hidden.size(1), H = num_heads_, Hk = num_kv_heads_, D = head_dim_;
  const int64_t group = H / Hk, q_size = H * D, kv_size = Hk * D;
  const int64_t qkv_n = q_size + 2 * kv_size, half = D / 2, num_layers = static_cast<int64_t>(layers_.size());
  const int64_t I = layers_.front().gate_up.out_features / 2;
  const int64_t block_size = kv_caches[0].size(2), num_slots = kv_caches[0].size(1) * block_size;
  const int64_t length = lengths.data_ptr<int64_t>()[0], slot = slots.data_ptr<int64_t>()[0];
  const int64_t* table = tables.data_ptr<int64_t>();
  TORCH_CHECK(slot >= 0 && slot < num_slots, "DecodeStack: slot ", slot, " is outside the cache");
  TORCH_CHECK(length >= 1 && length <= tables.size(1) * block_size, "DecodeStack: sequence length ", length,
              " does not fit its block table");
  std::vector<const uint16_t*> keys, values;
  cache_halves(kv_caches, block_size, num_slots, Hk, D, keys, values);
  for (const auto& layer : layers_) {
    TORCH_CHECK(layer.gate_up.out_features == 2 * I, "DecodeStack: layers of different MLP widths");
  }
  const int threads = std::max(1, at::get_num_threads());
  static constexpr int64_t kBlock = 32;  // outputs a claim takes at least
  auto chunk_of = [threads](int64_t outputs) {
    return std::max<int64_t>(kBlock, (outputs / (4 * threads) + kBlock - 1) / kBlock * kBlock);
  };
  struct RowBuffers {
    std::vector<uint16_t> x, residual[2], head, query;
    std::vector<float> xf, summed, query_f, attention;
  };
  std::vector<RowBuffers> buffers(threads);
  for (auto& t : buffers) {
    t.x.resize(Hd);
    t.residual[0].resize(Hd);
    t.residual[1].resize(Hd);
    t.head.resize(D);
    t.query.resize(group * D);
    t.xf.resize(std::max({Hd, q_size, I}));
    t.summed.resize(std::max(Hd, D));
    t.query_f.resize(group * D);
    t.attention.resize(group * D);
  }
  std::vector<uint16_t> qkv(qkv_n), attention(q_size), projected(Hd), gate_up(2 * I), act(I), down(Hd);
  std::unique_ptr<std::atomic<int64_t>[]> counters(new std::atomic<int64_t>[num_layers * 6]());
  auto out = torch::empty({1, Hd}, hidden.options());
  const uint16_t* input = bf16_data(hidden);
  const uint16_t* c = bf16_data(cos);
  const uint16_t* s = bf16_data(sin);
  const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);
  auto widen_into = [](const uint16_t* from, int64_t n, float* to) {
    for (int64_t i = 0; i < n; ++i) to[i] = bf16_to_float(from[i]);
  };
  auto float_data = [](const torch::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };

#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    RowBuffers& mine = buffers[omp_get_thread_num()];
#else
    RowBuffers& mine = buffers[0];
#endif
    const uint16_t* residual = input;
    int flip = 0;
    for (int64_t l = 0; l < num_layers; ++l) {
      const auto& layer = layers_[l];
      std::atomic<int64_t>* counter = &counters[l * 6];
      if (l == 0) {
        rms_norm_row<uint16_t>(input, nullptr, bf16_data(layer.input_norm), mine.x.data(), nullptr, Hd, eps,
                               mine.summed.data());
      } else {
        rms_norm_row<uint16_t>(down.data(), residual, bf16_data(layer.input_norm), mine.x.data(),
                               mine.residual[flip].data(), Hd, eps, mine.summed.data());
        residual = mine.residual[flip].data();
        flip ^= 1;
      }
      widen_into(mine.x.data(), Hd, mine.xf.data());
      const uint16_t* w_qkv = bf16_data(layer.qkv.dense);
      const float* qkv_bias = float_data(float_biases_[l][0]);
      claim(counter[0], qkv_n, chunk_of(qkv_n), [&](int64_t first, int64_t last) {
        linear_bf16_row_outputs(mine.xf.data(), w_qkv, qkv_bias, qkv.data(), Hd, first, last);
      });
#pragma omp barrier
      claim(counter[1], Hk, 1, [&](int64_t first, int64_t last) {
        for (int64_t kv = first; kv < last; ++kv) {
          const int64_t slot_offset = slot * kv_size + kv * D;
          const uint16_t* key = qkv.data() + q_size + kv * D;
          if (layer.k_norm.has_value()) {
            rms_norm_row<uint16_t>(key, nullptr, bf16_data(layer.k_norm), mine.head.data(), nullptr, D, eps,
                                   mine.summed.data());
            key = mine.head.data();
          }
          rotate_head<uint16_t>(key, c, s, const_cast<uint16_t*>(keys[l]) + slot_offset, D);
          std::memcpy(const_cast<uint16_t*>(values[l]) + slot_offset, qkv.data() + q_size + kv_size + kv * D,
                      D * sizeof(uint16_t));
          // the head's attention reads only its own KV head's cache rows, the new one included
          for (int64_t r = 0; r < group; ++r) {
            const uint16_t* query = qkv.data() + (kv * group + r) * D;
            if (layer.q_norm.has_value()) {
              rms_norm_row<uint16_t>(query, nullptr, bf16_data(layer.q_norm), mine.head.data(), nullptr, D, eps,
                                     mine.summed.data());
              query = mine.head.data();
            }
            rotate_head<uint16_t>(query, c, s, mine.query.data() + r * D, D);
          }
          widen_into(mine.query.data(), group * D, mine.query_f.data());
          paged_decode_heads_bf16(mine.query_f.data(), keys[l], values[l], table, length, kv, kv + 1, group, Hk, D,
                                  block_size, scale, mine.attention.data());
          for (int64_t i = 0; i < group * D; ++i) attention[kv * group * D + i] = float_to_bf16_as_torch(mine.attention[i]);
        }
      });
#pragma omp barrier
      widen_into(attention.data(), q_size, mine.xf.data());
      const uint16_t* w_o = bf16_data(layer.o_proj.dense);
      const float* o_bias = float_data(float_biases_[l][1]);
      claim(counter[3], Hd, chunk_of(Hd), [&](int64_t first, int64_t last) {
        linear_bf16_row_outputs(mine.xf.data(), w_o, o_bias, projected.data(), q_size, first, last);
      });
#pragma omp barrier
      rms_norm_row<uint16_t>(projected.data(), residual, bf16_data(layer.post_norm), mine.x.data(),
                             mine.residual[flip].data(), Hd, eps, mine.summed.data());
      residual = mine.residual[flip].data();
      flip ^= 1;
      widen_into(mine.x.data(), Hd, mine.xf.data());
      // gate/up: a claimed run of gate outputs, then the same run of up outputs, then their SiLU-and-multiply
      const uint16_t* w_gate_up = bf16_data(layer.gate_up.dense);
      claim(counter[4], I, chunk_of(I), [&](int64_t first, int64_t last) {
        linear_bf16_row_outputs(mine.xf.data(), w_gate_up, nullptr, gate_up.data(), Hd, first, last);
        linear_bf16_row_outputs(mine.xf.data(), w_gate_up, nullptr, gate_up.data(), Hd, I + first, I + last);
        silu_mul_span<uint16_t>(gate_up.data() + first, gate_up.data() + I + first, act.data() + first, last - first);
      });
#pragma omp barrier
      widen_into(act.data(), I, mine.xf.data());
      const uint16_t* w_down = bf16_data(layer.down.dense);
      claim(counter[5], Hd, chunk_of(Hd), [&](int64_t first, int64_t last) {
        linear_bf16_row_outputs(mine.xf.data(), w_down, nullptr, down.data(), I, first, last);
      });
#pragma omp barrier
    }
#ifdef _OPENMP
    if (omp_get_thread_num() == 0)
#endif
    {
      rms_norm_row<uint16_t>(down.data(), residual, bf16_data(final_norm_),
                             reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), mine.residual[flip].data(),
                             Hd, eps, mine.summed.data());
    }
  }
  one_region_steps_.fetch_add(1, std::memory_order_relaxed);
  return out;
}

torch::Tensor DecodeStack::forward(torch::Tensor hidden, const std::vector<torch::Tensor>& kv_caches,
                                   torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor slot_mapping,
                                   torch::Tensor cos, torch::Tensor sin) const {
  TORCH_CHECK(kv_caches.size() == layers_.size(), "DecodeStack: ", layers_.size(), " layers but ",
              kv_caches.size(), " KV caches");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "DecodeStack: hidden must be [B, hidden], contiguous");
  const int64_t B = hidden.size(0), H = num_heads_, Hk = num_kv_heads_, D = head_dim_;
  const int64_t q_size = H * D, kv_size = Hk * D;
  const auto slots = slot_mapping.to(torch::kInt64).contiguous();
  const auto tables = block_tables.to(torch::kInt64).contiguous();
  const auto lengths = seq_lens.to(torch::kInt64).contiguous();
  TORCH_CHECK(slots.numel() == B && tables.size(0) == B && lengths.numel() == B,
              "DecodeStack: one slot, block table row and length per token expected");
  const auto cos_c = cos.contiguous(), sin_c = sin.contiguous();
  if (one_region_ && B >= 1 && B <= one_region_max_rows() && hidden.scalar_type() == at::kBFloat16 &&
      cos_c.scalar_type() == at::kBFloat16 && sin_c.scalar_type() == at::kBFloat16 &&
      hidden.size(1) == final_norm_.numel() && cos_c.size(0) == B && cos_c.size(1) == head_dim_ / 2 &&
      sin_c.sizes() == cos_c.sizes()
#ifdef _OPENMP
      && !omp_in_parallel()
#endif
  ) {
    return forward_one_region(hidden, kv_caches, tables, lengths, slots, cos_c, sin_c);
  }
  if (row_region_ && B == 1 && hidden.scalar_type() == at::kBFloat16 && cos_c.scalar_type() == at::kBFloat16 &&
      sin_c.scalar_type() == at::kBFloat16 && hidden.size(1) == final_norm_.numel() && cos_c.size(0) == 1 &&
      cos_c.size(1) == head_dim_ / 2 && sin_c.sizes() == cos_c.sizes()
#ifdef _OPENMP
      && !omp_in_parallel()
#endif
  ) {
    return forward_one_row(hidden, kv_caches, tables, lengths, slots, cos_c, sin_c);
  }
  torch::Tensor residual;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& layer = layers_[i];
    torch::Tensor x;
    if (i == 0) {
      residual = hidden;
      x = rms_norm(hidden, c10::nullopt, layer.input_norm, eps_)[0];
    } else {
      auto normed = rms_norm(hidden, residual, layer.input_norm, eps_);
      x = normed[0];
      residual = normed[1];
    }
    const auto qkv = apply(layer.qkv, x, layer.qkv_bias);
    auto query = qkv.narrow(1, 0, q_size).view({B, H, D});
    auto key = qkv.narrow(1, q_size, kv_size).view({B, Hk, D});
    const auto value = qkv.narrow(1, q_size + kv_size, kv_size);
    if (layer.q_norm.has_value()) {
      query = rms_norm(query.contiguous(), c10::nullopt, *layer.q_norm, eps_)[0];
      key = rms_norm(key.contiguous(), c10::nullopt, *layer.k_norm, eps_)[0];
    }
    query = rotate(query, cos_c, sin_c);
    key = rotate(key, cos_c, sin_c);
    const auto& cache = kv_caches[i];
    write_kv(key, value, cache, slots);
    const auto attention = paged_decode(query, cache[0], cache[1], tables, lengths, scale_);
    const auto out = apply(layer.o_proj, attention.view({B, q_size}), layer.o_bias);
    auto normed = rms_norm(out, residual, layer.post_norm, eps_);
    residual = normed[1];
    hidden = apply(layer.down, silu_and_mul(apply(layer.gate_up, normed[0], std::nullopt)), std::nullopt);
  }
  return rms_norm(hidden, residual, final_norm_, eps_)[0];
}

}  // namespace quire
