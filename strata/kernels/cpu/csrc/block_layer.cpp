// A dense decoder layer over GGUF block weights on the CPU as one object and one call
// (`models/layers.py: DecoderLayer._forward_blocks_cpu`).
//
// Why: a one-lane decode step of the default model makes about 120 block products and as
// many row-wise ops and pool writes; dispatched one by one from Python, their wrappers cost
// about as much as the products' arithmetic. `BlockLayer` holds a layer's weights (made once)
// and composes the same C++ functions in the same order as the Python path (the rounding of
// every intermediate to the compute dtype included), so the bits are the Python path's:
//   project: x = rms_norm(h); qkv = [x W_s^T for each segment s] (+ bias); rope_qkv(qkv)
//   tail:    a = out W_o^T; (h, x) = add_rms_norm(h, a); y = down(silu_mul(gate_up(x))); h + y
//   forward: project, the new K/V written to the pool's cells, attend in place, tail
// The weights come as segments: a projection whose rows are of several block types (Q4_K_M
// files mix Q4_K and Q6_K) is one product per segment, concatenated along the output.
#include "kernels.h"

namespace {

// x W^T for W held as segments of rows (`BlockLinear.segments()`), in x's dtype
at::Tensor segments_product(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                            const std::vector<int64_t>& qtypes) {
  if (blocks.size() == 1) return block_matmul(x, blocks[0], qtypes[0], false);
  std::vector<at::Tensor> parts;
  parts.reserve(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) parts.push_back(block_matmul(x, blocks[i], qtypes[i], false));
  return at::cat(parts, -1);
}

}  // namespace

BlockLayer::BlockLayer(at::Tensor pre_norm, double pre_eps, Segments qkv, c10::optional<at::Tensor> qkv_bias,
                       int64_t hq, int64_t hkv, Segments o, at::Tensor post_norm, double post_eps,
                       Segments gate_up, Segments down)
    : pre_norm(std::move(pre_norm)), post_norm(std::move(post_norm)), qkv_bias(std::move(qkv_bias)),
      qkv(std::move(qkv)), o(std::move(o)), gate_up(std::move(gate_up)), down(std::move(down)),
      pre_eps(pre_eps), post_eps(post_eps), hq(hq), hkv(hkv) {
  for (const Segments* s : {&this->qkv, &this->o, &this->gate_up, &this->down})
    TORCH_CHECK(!s->first.empty() && s->first.size() == s->second.size(), "BlockLayer: one qtype per segment");
}

// h [T, H] -> q [T, Hq, D], k and v [T, Hkv, D]: the input norm, the fused q/k/v product (its
// bias added in the dtype, as `BlockLinear.forward` does) and RoPE (`ops.rope_qkv`).
std::tuple<at::Tensor, at::Tensor, at::Tensor> BlockLayer::project(const at::Tensor& h, const at::Tensor& cos,
                                                                   const at::Tensor& sin) const {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "BlockLayer: h must be a contiguous [T, H]");
  at::Tensor y = segments_product(rms_norm(h, pre_norm, pre_eps), qkv.first, qkv.second);
  if (qkv_bias.has_value()) y = y + *qkv_bias;
  return rope_qkv(y, cos, sin, hq, hkv);
}

// The rest of the layer after attention: h [T, H], attention's output [T, Hq D] -> the next h.
at::Tensor BlockLayer::tail(const at::Tensor& h, const at::Tensor& out) const {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && out.dim() == 2 && out.is_contiguous(),
              "BlockLayer: h and out must be contiguous [T, width]");
  at::Tensor a = segments_product(out, o.first, o.second);
  auto [hn, x] = add_rms_norm(h, a, post_norm, post_eps);
  at::Tensor act = silu_mul(segments_product(x, gate_up.first, gate_up.second));
  return hn + segments_product(act, down.first, down.second);
}

// The whole layer where attention reads plain cells in place (`TableAttention.in_place`): the
// new K/V stored at write_cells of the pool's k / v tensors (index_copy_, as `PlainFormat.write`),
// then `attend` over cells, as the context's own path does.
at::Tensor BlockLayer::forward(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cells,
                               at::Tensor v_cells, const at::Tensor& write_cells, const at::Tensor& cells,
                               const at::Tensor& row_seq, const at::Tensor& row_pos, double scale,
                               int64_t window) const {
  auto [q, k, v] = project(h, cos, sin);
  TORCH_CHECK(k.scalar_type() == k_cells.scalar_type() && v.scalar_type() == v_cells.scalar_type(),
              "BlockLayer: the pool's cells are of another dtype than the layer's");
  k_cells.index_copy_(0, write_cells, k);
  v_cells.index_copy_(0, write_cells, v);
  at::Tensor out = attend(q, k_cells, v_cells, cells, row_seq, row_pos, scale, window);
  return tail(h, out.reshape({h.size(0), -1}));
}
