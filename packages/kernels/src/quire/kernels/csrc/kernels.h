// Entry points of Quire's CPU kernels, shared by the Python bindings and the C++ decoder stack.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
                                    double eps);
torch::Tensor rotate(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor argmax_rows(torch::Tensor x);
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
bool linear_bf16_vectorized();
// A few rows times a bfloat16 weight oneDNN has packed (onednn_gemv.cpp), for weights onednn_gemv_layout accepts.
bool onednn_gemv_layout(torch::Tensor packed);
int64_t onednn_gemv_max_rows();
torch::Tensor onednn_gemv(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);
// The argmax of x @ packed.T (onednn_gemv's logits) for up to 8 rows, screened with an int8 copy (onednn_gemv.cpp);
// empty where it declines.
bool greedy_head_supported();
torch::Tensor greedy_head_tokens(torch::Tensor x, torch::Tensor packed, torch::Tensor q, torch::Tensor scale,
                                 torch::Tensor bound);
// Quantized weights (quant_linear.cpp): data/scale/qtype as quire.kernels.quant.QuantizedWeight holds them;
// isa "" picks the widest instruction set the CPU has, "avx512", "avx2" or "scalar" forces one.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor data, c10::optional<torch::Tensor> scale,
                           const std::string& qtype, c10::optional<torch::Tensor> bias, const std::string& isa);
torch::Tensor quant_dequantize(torch::Tensor data, c10::optional<torch::Tensor> scale, const std::string& qtype,
                               c10::optional<torch::Tensor> rows, const std::string& isa);
std::string quant_isa(const std::string& requested);
