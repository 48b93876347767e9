// A mixture-of-experts layer's routed experts on the CPU, in one call (`models/moe.py`).
//
// A decode step of a MoE model runs k experts per layer, each three small products and
// a few element-wise ops; dispatched one by one from Python that is most of the step. This
// does the same loop in C++ with the same torch operations in the same order as
// `moe.combine_loop` over `moe.swiglu` / `block_experts.BlockMath._swiglu`, so the bits are
// the Python path's: experts in ascending id, each one's tokens gathered, silu(gate) * up
// rounded in the dtype, the weighted product added into the token's row.
#include <functional>

#include "kernels.h"

namespace {

using Product = std::function<at::Tensor(int64_t, const at::Tensor&)>;

// F.linear as `dense.stable_linear` computes it on the CPU (a lone row as the first of two).
at::Tensor stable_linear(const at::Tensor& x, const at::Tensor& w) {
  if (x.size(0) == 1) return at::linear(x.expand({2, -1}), w).slice(0, 0, 1);
  return at::linear(x, w);
}

at::Tensor combine(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const Product& swiglu) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "experts: x must be a CPU [T, H] tensor");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && weights.sizes() == ids.sizes(),
              "experts: ids and weights must be [T, k] for x [T, H]");
  at::Tensor out = at::zeros_like(x);
  const int64_t k = ids.size(1);
  at::Tensor flat = ids.reshape({-1}).to(at::kLong);
  at::Tensor order = at::argsort(flat, /*stable=*/true, 0, false);
  at::Tensor sorted = flat.index_select(0, order).contiguous();
  at::Tensor w = weights.reshape({-1});
  const int64_t* e = sorted.data_ptr<int64_t>();
  const int64_t n = sorted.numel();
  for (int64_t start = 0; start < n;) {
    int64_t end = start + 1;
    while (end < n && e[end] == e[start]) ++end;
    at::Tensor pairs = order.slice(0, start, end);
    at::Tensor tokens = at::floor_divide(pairs, k);
    at::Tensor y = swiglu(e[start], x.index_select(0, tokens));
    out.index_add_(0, tokens, y * w.index_select(0, pairs).unsqueeze(1));
    start = end;
  }
  return out;
}

}  // namespace

// Experts held dense: gate, up [E, I, H], down [E, H, I] in x's dtype.
at::Tensor experts_dense(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                         const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down) {
  return combine(x, ids, weights, [&](int64_t e, const at::Tensor& rows) {
    at::Tensor g = stable_linear(rows, gate[e]);
    at::Tensor u = stable_linear(rows, up[e]);
    return stable_linear(at::silu(g) * u, down[e]);
  });
}

// Experts held as GGUF blocks: uint8 [E, N, row bytes] each, with their gguf types.
at::Tensor experts_blocks(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                          const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down, int64_t qgate,
                          int64_t qup, int64_t qdown) {
  TORCH_CHECK(x.is_contiguous(), "experts_blocks: x must be contiguous");
  return combine(x, ids, weights, [&](int64_t e, const at::Tensor& rows) {
    at::Tensor g = block_matmul(rows, gate[e], qgate, false);
    at::Tensor u = block_matmul(rows, up[e], qup, false);
    return block_matmul((at::silu(g) * u).contiguous(), down[e], qdown, false);
  });
}
