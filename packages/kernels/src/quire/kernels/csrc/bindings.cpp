// The Python module of Quire's CPU kernels.
#include <torch/extension.h>

#include "decode_stack.h"
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention");
  m.def("prefill_attention", &prefill_attention,
        "causal attention of whole prompts (rows start..end of each range) over their own keys, into out (AMX or AVX2)",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("scale"), py::arg("ranges"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention_runs", &prefill_attention_runs, "whether prefill_attention runs here for this head size");
  m.def("prefill_attention_available", &prefill_attention_available,
        "whether whole prompts of this head size should take prefill_attention here (rather than PyTorch's SDPA)");
  m.def("prefill_attention_pytorch_order", &prefill_attention_pytorch_order,
        "prefill_attention on the path in PyTorch's order, whether or not it has matched PyTorch's bits here");
  m.def("sdpa_order_runs", &quire::sdpa_order_runs, "whether the path in PyTorch's order is built for this head size");
  m.def("prefill_attention_path", &prefill_attention_path,
        "which path whole prompts of this head size take here: amx, pytorch order, avx2, or '' (PyTorch's SDPA)");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after adding a residual");
  m.def("rotate", &rotate, "rotary embedding (rotate-half layout)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("argmax_rows", &argmax_rows, "index of the first maximum of each row");
  m.def("linear_bf16", &linear_bf16, "x @ weight.T + bias with a bfloat16 weight, accumulated in float32");
  py::class_<quire::DecodeStack>(m, "DecodeStack", "every decoder layer of a decode step, in C++")
      .def(py::init<const std::vector<std::vector<std::optional<torch::Tensor>>>&, torch::Tensor, int64_t, int64_t,
                    int64_t, double, double, const std::vector<std::vector<std::vector<quire::QuantSegment>>>&>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("scale"),
           py::arg("quantized") = std::vector<std::vector<std::vector<quire::QuantSegment>>>{})
      .def("forward", &quire::DecodeStack::forward, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_layers", &quire::DecodeStack::num_layers)
      .def_property_readonly("one_region_max_rows", &quire::DecodeStack::one_region_max_rows,
                             "the most rows a step runs as one parallel region (0: this stack never does)")
      .def_property_readonly("one_region_steps", &quire::DecodeStack::one_region_steps,
                             "how many steps have run as one parallel region")
      .def_property_readonly("split_steps", &quire::DecodeStack::split_steps,
                             "how many of those steps split their rows between the threads");
  m.def("quant_linear", &quant_linear, "x @ w.T + bias, w in a GGUF block format or INT8, accumulated in float32");
  m.def("quant_dequantize", &quant_dequantize, "float32 rows of a quantized weight");
  m.def("quant_isa", &quant_isa, "the instruction set the quantized-weight kernels use for a request");
  m.def("onednn_gemv_layout", &onednn_gemv_layout, "whether onednn_gemv can read this oneDNN-packed weight");
  m.def("onednn_gemv_max_rows", &onednn_gemv_max_rows, "the most rows onednn_gemv takes (0: not in this build)");
  m.def("onednn_amx_max_rows", &quire::onednn_amx_max_rows,
        "the most rows onednn_gemv's AMX kernel takes (0: no AMX, or oneDNN's blocks are not 32 outputs wide)");
  m.def("onednn_wide_max_rows", &quire::onednn_wide_max_rows,
        "the most rows onednn_gemv's runs of rows take in a decode step's one parallel region (0: oneDNN's blocks "
        "are not 64 outputs wide)");
  m.def("onednn_gemv", &onednn_gemv, "x @ weight.T + bias for a few rows, on a weight oneDNN packed");
  m.def("onednn_amx_argmax", &onednn_amx_argmax,
        "each row's argmax of onednn_gemv(x, packed) on AMX tiles for 9 to onednn_amx_max_rows() rows (empty: declined)");
  m.def("onednn_wide_argmax", &onednn_wide_argmax,
        "each row's argmax of onednn_gemv(x, packed) on oneDNN's 64-output blocks for 1 to onednn_wide_max_rows() rows "
        "(empty: declined)");
  m.def("greedy_head_supported", &greedy_head_supported, "whether greedy_head_tokens exists in this build");
  m.def("greedy_head_tokens", &greedy_head_tokens,
        "each row's argmax of x @ packed.T, screened with an int8 copy of the head (empty: declined)");
  m.def("linear_bf16_vectorized", &linear_bf16_vectorized, "whether linear_bf16 was built with AVX2 and FMA");
  m.def("greedy_head_bf16_supported", &greedy_head_bf16_supported,
        "whether greedy_head_tokens_bf16 exists in this build");
  m.def("greedy_head_tokens_bf16", &greedy_head_tokens_bf16,
        "each row's argmax of linear_bf16(x, weight), screened with an int8 copy of it (empty: declined)");
}
