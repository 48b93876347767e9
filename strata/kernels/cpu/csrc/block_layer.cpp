// A dense decoder layer over GGUF block weights on the CPU, in two calls instead of a dozen
// (`models/layers.py: DecoderLayer._forward_blocks_cpu`).
//
// Why: a one-lane decode step of the default model makes about 120 block products and as
// many row-wise ops; dispatched one by one from Python their wrappers cost about as much as
// the products' arithmetic. These compose the same C++ functions in the same order as the
// Python path (the rounding of every intermediate to the compute dtype included), so the
// bits are the Python path's:
//   block_qkv:  x = rms_norm(h); qkv = [x W_s^T for each segment s] (+ bias); rope_qkv(qkv)
//   block_tail: a = out W_o^T; (h, x) = add_rms_norm(h, a); y = down(silu_mul(gate_up(x)));
//               h + y
// The weights come as segments: a projection whose rows are of several block types (Q4_K_M
// files mix Q4_K and Q6_K) is one product per segment, concatenated along the output.
#include "kernels.h"

namespace {

// x W^T for W held as segments of rows (`BlockLinear.segments()`), in x's dtype
at::Tensor segments_product(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                            const std::vector<int64_t>& qtypes) {
  TORCH_CHECK(!blocks.empty() && blocks.size() == qtypes.size(), "block layer: one qtype per segment");
  if (blocks.size() == 1) return block_matmul(x, blocks[0], qtypes[0], false);
  std::vector<at::Tensor> parts;
  parts.reserve(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) parts.push_back(block_matmul(x, blocks[i], qtypes[i], false));
  return at::cat(parts, -1);
}

}  // namespace

// h [T, H] -> q [T, Hq, D], k and v [T, Hkv, D]: the input norm, the fused q/k/v product (its
// bias added in the dtype, as `BlockLinear.forward` does) and RoPE (`ops.rope_qkv`).
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_qkv(const at::Tensor& h, const at::Tensor& norm_weight,
                                                         double eps, const std::vector<at::Tensor>& blocks,
                                                         const std::vector<int64_t>& qtypes,
                                                         const c10::optional<at::Tensor>& bias, const at::Tensor& cos,
                                                         const at::Tensor& sin, int64_t hq, int64_t hkv) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "block_qkv: h must be a contiguous [T, H]");
  at::Tensor qkv = segments_product(rms_norm(h, norm_weight, eps), blocks, qtypes);
  if (bias.has_value()) qkv = qkv + *bias;
  return rope_qkv(qkv, cos, sin, hq, hkv);
}

// The rest of the layer after attention: h [T, H], attention's output [T, Hq D] -> the next h.
at::Tensor block_tail(const at::Tensor& h, const at::Tensor& out, const std::vector<at::Tensor>& o_blocks,
                      const std::vector<int64_t>& o_qtypes, const at::Tensor& norm_weight, double eps,
                      const std::vector<at::Tensor>& gate_up_blocks, const std::vector<int64_t>& gate_up_qtypes,
                      const std::vector<at::Tensor>& down_blocks, const std::vector<int64_t>& down_qtypes) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && out.dim() == 2 && out.is_contiguous(),
              "block_tail: h and out must be contiguous [T, width]");
  at::Tensor a = segments_product(out, o_blocks, o_qtypes);
  auto [hn, x] = add_rms_norm(h, a, norm_weight, eps);
  at::Tensor y = segments_product(silu_mul(segments_product(x, gate_up_blocks, gate_up_qtypes)), down_blocks,
                                  down_qtypes);
  return hn + y;
}
