// The functions of Strata's CPU kernels, declared once: module.cpp binds them to Python and the
// files that compose them (block_layer.cpp, experts.cpp) call them.
#pragma once

#include <torch/extension.h>

#include <tuple>
#include <utility>
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
at::Tensor experts_dense(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                         const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down);
at::Tensor experts_blocks(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                          const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down, int64_t qgate,
                          int64_t qup, int64_t qdown);

// One dense decoder layer over GGUF block weights (block_layer.cpp): its norms and its
// projections as segments (blocks [N_s, row bytes] and gguf types), held once.
using Segments = std::pair<std::vector<at::Tensor>, std::vector<int64_t>>;

struct BlockLayer {
  BlockLayer(at::Tensor pre_norm, double pre_eps, Segments qkv, c10::optional<at::Tensor> qkv_bias, int64_t hq,
             int64_t hkv, Segments o, at::Tensor post_norm, double post_eps, Segments gate_up, Segments down);
  std::tuple<at::Tensor, at::Tensor, at::Tensor> project(const at::Tensor& h, const at::Tensor& cos,
                                                         const at::Tensor& sin) const;
  at::Tensor tail(const at::Tensor& h, const at::Tensor& out) const;
  at::Tensor forward(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cells,
                     at::Tensor v_cells, const at::Tensor& write_cells, const at::Tensor& cells,
                     const at::Tensor& row_seq, const at::Tensor& row_pos, double scale, int64_t window) const;

  at::Tensor pre_norm, post_norm;
  c10::optional<at::Tensor> qkv_bias;
  Segments qkv, o, gate_up, down;
  double pre_eps, post_eps;
  int64_t hq, hkv;
};
