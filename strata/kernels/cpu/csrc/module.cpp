// The Python module of Strata's CPU kernels: attention.cpp, elementwise.cpp, blocks.cpp, block_layer.cpp and
// experts.cpp.
#include <torch/extension.h>

#include <tuple>
#include <vector>

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cells,
                  const at::Tensor& row_seq, const at::Tensor& row_pos, double scale, int64_t window);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& a, const at::Tensor& weight,
                                                double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t hq, int64_t hkv);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, bool float_out);
std::vector<int64_t> block_types();
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_qkv(const at::Tensor& h, const at::Tensor& norm_weight,
                                                         double eps, const std::vector<at::Tensor>& blocks,
                                                         const std::vector<int64_t>& qtypes,
                                                         const c10::optional<at::Tensor>& bias, const at::Tensor& cos,
                                                         const at::Tensor& sin, int64_t hq, int64_t hkv);
at::Tensor block_tail(const at::Tensor& h, const at::Tensor& out, const std::vector<at::Tensor>& o_blocks,
                      const std::vector<int64_t>& o_qtypes, const at::Tensor& norm_weight, double eps,
                      const std::vector<at::Tensor>& gate_up_blocks, const std::vector<int64_t>& gate_up_qtypes,
                      const std::vector<at::Tensor>& down_blocks, const std::vector<int64_t>& down_qtypes);
at::Tensor experts_dense(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                         const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down);
at::Tensor experts_blocks(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                          const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down, int64_t qgate,
                          int64_t qup, int64_t qdown);

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
  m.def("block_qkv", &block_qkv, "q, k (rotated), v of a layer over GGUF blocks: norm, product, bias, RoPE");
  m.def("block_tail", &block_tail, "a layer's o product, residual, norm and SwiGLU MLP over GGUF blocks");
  m.def("experts_dense", &experts_dense, "a MoE layer's routed experts, dense weights, in expert order");
  m.def("experts_blocks", &experts_blocks, "a MoE layer's routed experts, GGUF block weights, in expert order");
}
