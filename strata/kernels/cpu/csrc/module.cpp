// The Python module of Strata's CPU kernels: attention.cpp, elementwise.cpp, blocks.cpp, block_layer.cpp and
// experts.cpp.
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "causal grouped-query attention over pool cells, row by row", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("cells"), py::arg("row_seq"), py::arg("row_pos"), py::arg("scale"),
        py::arg("window") = 0);
  m.def("rms_norm", &rms_norm, "weight * rms_normalise(x)");
  m.def("add_rms_norm", &add_rms_norm, "(h + a, weight * rms_normalise(h + a))");
  m.def("rope_qkv", &rope_qkv, "q, k rotated and v, out of the fused projection");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("block_matmul", &block_matmul, "x @ W.T with W in a GGUF file's own quantized blocks", py::arg("x"),
        py::arg("blocks"), py::arg("qtype"), py::arg("float_out") = false);
  m.def("block_types", &block_types, "the gguf.GGMLQuantizationType values block_matmul takes");
  py::class_<BlockLayer>(m, "BlockLayer", "a dense decoder layer over GGUF block weights")
      .def(py::init<at::Tensor, double, Segments, c10::optional<at::Tensor>, int64_t, int64_t, Segments, at::Tensor,
                    double, Segments, Segments>(),
           py::arg("pre_norm"), py::arg("pre_eps"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("hq"), py::arg("hkv"),
           py::arg("o"), py::arg("post_norm"), py::arg("post_eps"), py::arg("gate_up"), py::arg("down"))
      .def("project", &BlockLayer::project, "q, k (rotated), v: the input norm, q/k/v product, bias, RoPE")
      .def("tail", &BlockLayer::tail, "the o product, residual, norm, SwiGLU MLP and residual")
      .def("forward", &BlockLayer::forward, "project, K/V written to the pool's cells, attention in place, tail");
  m.def("experts_dense", &experts_dense, "a MoE layer's routed experts, dense weights, in expert order");
  m.def("experts_blocks", &experts_blocks, "a MoE layer's routed experts, GGUF block weights, in expert order");
}
