// The decoder stack for decode steps (see decode_stack.h).
//
// A batch-1 decode step of a 0.5B model spends ~40 ms reading weights and, through the Python modules,
// ~6 ms more in the glue between ~15 kernel calls per layer (module calls, views, argument conversion,
// the KV write through index_copy_). Here the same kernels run back to back from C++.
#include "decode_stack.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstring>

#include "kernels.h"

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
