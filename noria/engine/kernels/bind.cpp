// The Python module of the engine's CPU kernels (built with the sources beside it by
// noria/engine/kernels/__init__.py).
//
// The kernels include only ATen's tensor, parallel and vector headers; this file alone includes
// torch's pybind11 glue. torch/extension.h (all of libtorch's C++ API) took 21 s of the compiler's
// time per source on a 2-core AMD EPYC Zen 4, nearly the whole build; the light headers take 2-4 s,
// and the four sources compile two at a time.

#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor block_tables,
                                  at::Tensor context_lens, int64_t block_size, double scale);
std::vector<at::Tensor> sample_rows(at::Tensor logits, at::Tensor temps, at::Tensor uniforms);
at::Tensor add_rmsnorm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps);
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads);
at::Tensor silu_mul(at::Tensor gu);
at::Tensor int8_linear(at::Tensor x, at::Tensor w, at::Tensor scale, int64_t path);
int64_t int8_linear_path(int64_t path);
void quantize_int8_packed(at::Tensor w, at::Tensor q, at::Tensor scale, at::Tensor scale_f32);
at::Tensor int4_linear(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor zero, int64_t path);
void quantize_int4_packed(at::Tensor w, at::Tensor q, at::Tensor scale, at::Tensor zero);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("sample_rows", &sample_rows, "fused per-row sampling and logprob (CPU)");
  m.def("add_rmsnorm", &add_rmsnorm, "residual add + RMSNorm (CPU)", py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("eps"));
  m.def("rope", &rope, "RoPE over the first heads of [T, H, D] (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [gate | up] (CPU)");
  m.def("int8_linear", &int8_linear, "weight-only int8 linear over packed codes (CPU)", py::arg("x"), py::arg("w"),
        py::arg("scale"), py::arg("path") = 0);
  m.def("quantize_int8_packed", &quantize_int8_packed, "quant.quantize_int8 into the packed layout, in place (CPU)");
  m.def("int4_linear", &int4_linear, "weight-only int4 linear over packed codes (CPU)", py::arg("x"), py::arg("w"),
        py::arg("scale"), py::arg("zero"), py::arg("path") = 0);
  m.def("quantize_int4_packed", &quantize_int4_packed, "quant.quantize_int4 into the packed layout, in place (CPU)");
  m.def("int8_linear_path", &int8_linear_path, "the int8_linear path that runs here (0: none)", py::arg("path") = 0);
}
