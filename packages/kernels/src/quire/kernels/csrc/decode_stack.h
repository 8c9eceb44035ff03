// A Llama-family decoder stack for decode steps on the CPU, run layer after layer in C++.
#pragma once

#include <torch/extension.h>

#include <array>
#include <atomic>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace quire {

// One row segment of a quantized weight as quire.kernels.quant.QuantizedWeight holds it: (data, scale, qtype).
using QuantSegment = std::tuple<torch::Tensor, std::optional<torch::Tensor>, std::string>;

// A linear layer's weight: a bfloat16 tensor [out, in] for linear_bf16, a bfloat16 weight oneDNN has packed
// (an mkldnn tensor, for its linear op, as quire.kernels.linear.OneDNNLinear runs it), or quantized row
// segments for quant_linear whose outputs are concatenated (a fused projection of several GGUF tensors).
struct LinearWeight {
  torch::Tensor dense;
  bool onednn = false;
  bool gemv = false;  // a packed weight onednn_gemv reads (few rows), as OneDNNLinear decides
  std::vector<QuantSegment> segments;
  int64_t out_features = 0;
};

struct DecoderLayerWeights {
  torch::Tensor input_norm;
  LinearWeight qkv;                        // [q + 2 kv, hidden]
  std::optional<torch::Tensor> qkv_bias;   // [q + 2 kv]
  std::optional<torch::Tensor> q_norm;     // [head_dim] (Qwen3)
  std::optional<torch::Tensor> k_norm;
  LinearWeight o_proj;                     // [hidden, q]
  std::optional<torch::Tensor> o_bias;
  torch::Tensor post_norm;
  LinearWeight gate_up;                    // [2 intermediate, hidden]
  LinearWeight down;                       // [hidden, intermediate]
};

// Every layer of the decoder for a batch in which each request brings one new token: the same kernels,
// in the same order and with the same roundings as the Python modules (quire.core.models.llama), without
// returning to Python between them.
class DecodeStack {
 public:
  // `layers`: per layer [input_norm, qkv, qkv_bias, q_norm, k_norm, o_proj, o_bias, post_norm, gate_up, down],
  // None where a checkpoint has no such tensor. `quantized` (empty, or one entry per layer): the row segments
  // of [qkv, o_proj, gate_up, down] for a layer whose linear weights are quantized (None in `layers`).
  DecodeStack(const std::vector<std::vector<std::optional<torch::Tensor>>>& layers, torch::Tensor final_norm,
              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              const std::vector<std::vector<std::vector<QuantSegment>>>& quantized = {});

  // hidden [B, hidden] (the embeddings of the batch's tokens); kv_caches: per layer [2, N, block, Hk, D];
  // block_tables [B, max_blocks], seq_lens [B] (including the new token), slot_mapping [B];
  // cos/sin [B, D/2]. Returns the final norm's output [B, hidden].
  torch::Tensor forward(torch::Tensor hidden, const std::vector<torch::Tensor>& kv_caches,
                        torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor slot_mapping,
                        torch::Tensor cos, torch::Tensor sin) const;

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // Whether steps of up to this many rows run as one parallel region (forward_one_region), and how many
  // steps have so far (for tests).
  int64_t one_region_max_rows() const;
  int64_t one_region_steps() const { return one_region_steps_; }
  // How many of those steps split their rows between the threads (forward_one_region's split rows).
  int64_t split_steps() const { return split_steps_; }

 private:
  // onednn_gemv's vdpbf16ps kernel takes up to 8 rows (onednn_gemv_block); more go through AMX tiles where present,
  // or its runs of rows (onednn_wide_groups) where oneDNN packs 64-output blocks
  static constexpr int64_t kOneRegionMaxRows = 8;
  // Split rows: on this many threads, from this many rows a thread (32-row steps of SmolLM2-135M on two Zen 4
  // cores: 34.1 -> 31.5 ms; 16 rows 23.1 -> 21.3, 64 rows 67.5 -> 62.5; 12 rows slower, 18.3 against 16.6)
  static constexpr int kSplitThreads = 2;
  static constexpr int64_t kSplitMinRows = 8;
  torch::Tensor forward_one_region(const torch::Tensor& hidden, const std::vector<torch::Tensor>& kv_caches,
                                   const torch::Tensor& tables, const torch::Tensor& lengths,
                                   const torch::Tensor& slots, const torch::Tensor& cos,
                                   const torch::Tensor& sin) const;

  // The same for a single row on Quire's AVX2 kernel path (plain bfloat16 weights read by linear_bf16's
  // one-row kernel, the portable paged_decode).
  torch::Tensor forward_one_row(const torch::Tensor& hidden, const std::vector<torch::Tensor>& kv_caches,
                                const torch::Tensor& tables, const torch::Tensor& lengths, const torch::Tensor& slots,
                                const torch::Tensor& cos, const torch::Tensor& sin) const;

  std::vector<DecoderLayerWeights> layers_;
  torch::Tensor final_norm_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  bool one_region_ = false;  // every layer bfloat16 through onednn_gemv, shapes its blocks and heads take
  bool row_region_ = false;  // every layer bfloat16 through linear_bf16 (AVX2): batch-1 steps in one region
  std::vector<std::array<torch::Tensor, 2>> float_biases_;  // per layer: qkv and o biases in float32, or undefined
  int64_t intermediate_ = 0;
  mutable std::atomic<int64_t> one_region_steps_{0};
  mutable std::atomic<int64_t> split_steps_{0};
};

}  // namespace quire
