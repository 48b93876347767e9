// The functions of Strata's CPU kernels, declared once: module.cpp binds them to Python and the
// files that compose them (block_layer.cpp, experts.cpp) call them.
#pragma once

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
