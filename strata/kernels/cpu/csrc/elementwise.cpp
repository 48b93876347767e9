// Row-wise pieces of a decoder layer for CPU tensors: RMSNorm (alone and after
// the residual add), RoPE on the fused q/k/v projection, and SiLU(gate) * up.
//
// Why: in a decode step each of these is a handful of tiny torch operations
// (RMSNorm alone is about ten), and dispatching them cost more than the
// arithmetic. Each output row depends only on its own input row, so batch
// company never changes a result. Rounding follows the torch expressions
// they replace: every intermediate that torch rounds to the compute dtype is
// rounded here too (this file is built with -ffp-contract=off, so a*b+c is
// two roundings, as in torch). RMSNorm's sum of squares and SiLU's exp
// (`exp_ieee`) are this file's own arithmetic, the same for every row.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

// Round to the tensor dtype and back, as torch does between two operations.
template <typename T>
inline float r(float x) { return static_cast<float>(static_cast<T>(x)); }

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, rows * n < (1 << 16) ? rows + 1 : 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* xr = x + i * n;
      float acc[16] = {0.f};
      int64_t j = 0;
      for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; ++l) {
          const float v = static_cast<float>(xr[j + l]);
          acc[l] += v * v;
        }
      for (int l = 0; j < n; ++j, ++l) acc[l] += static_cast<float>(xr[j]) * static_cast<float>(xr[j]);
      float ss = 0.f;
      for (int l = 0; l < 16; ++l) ss += acc[l];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* o = out + i * n;
      for (j = 0; j < n; ++j) o[j] = static_cast<T>(static_cast<float>(w[j]) * r<T>(static_cast<float>(xr[j]) * inv));
    }
  });
}

// e^t in IEEE float operations only, so that a loop of them vectorizes (a call to expf does
// not) and gives the same bits with or without vectors: t = n ln2 + r, n = t / ln2 rounded to
// the nearest integer (by adding and taking away 1.5 * 2^23), r from ln2 in two parts
// (Cody-Waite), e^r by Cephes' polynomial, times 2^n put in the exponent bits. Within 1 ulp of
// e^t on [-87.3, 88.37] (checked against float64 at 4 million points); 0 below, inf above
// (where e^t is past 2^127.5), NaN kept. A SiLU row of the default model (1,536 values) took
// 10 us with expf, the largest row-wise piece of a decode step.
inline float exp_ieee(float t) {
  const float c = std::min(std::max(t, -87.3365f), 88.3762f);
  const float n = (c * 1.44269504f + 12582912.0f) - 12582912.0f;
  const float r = (c - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = (p * r) * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  float y = e * scale;
  y = t > 88.3762f ? INFINITY : y;
  y = t < -87.3365f ? 0.0f : y;
  return t != t ? t : y;
}

inline float silu(float x) { return x / (1.0f + exp_ieee(-x)); }

}  // namespace

// weight * rms_normalise(x) over the last dimension; x [rows, n], weight [n], both the compute dtype
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_cpu() && x.is_contiguous() && weight.is_contiguous(), "contiguous CPU tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && x.size(-1) == weight.numel(), "x and weight differ");
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n,
                            static_cast<float>(eps));
  });
  return out;
}

// (h + a, weight * rms_normalise(h + a)): the residual add and the next norm in one pass
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& a, const at::Tensor& weight,
                                                double eps) {
  TORCH_CHECK(h.sizes() == a.sizes() && h.scalar_type() == a.scalar_type(), "h and a differ");
  TORCH_CHECK(h.is_contiguous() && a.is_contiguous(), "contiguous tensors only");
  at::Tensor sum = at::empty_like(h);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add", [&] {
    const scalar_t* hp = h.data_ptr<scalar_t>();
    const scalar_t* ap = a.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    for (int64_t i = 0, n = h.numel(); i < n; ++i)
      sp[i] = static_cast<scalar_t>(static_cast<float>(hp[i]) + static_cast<float>(ap[i]));
  });
  return {sum, rms_norm(sum, weight, eps)};
}

// q, k (rotated) and v, each contiguous [T, heads, D], out of the fused projection qkv [T, (Hq + 2 Hkv) D].
// cos, sin [T, D]: rows of the model's tables (sin's first half negated), so that
// rotated = x * cos + roll(x, D / 2) * sin, rounded after each operation as torch does.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t hq, int64_t hkv) {
  TORCH_CHECK(qkv.is_cpu() && qkv.is_contiguous() && qkv.dim() == 2, "qkv must be a contiguous [T, width]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type(),
              "cos and sin must be contiguous and of qkv's dtype");
  const int64_t T = qkv.size(0), D = cos.size(-1), width = qkv.size(1);
  TORCH_CHECK(width == (hq + 2 * hkv) * D && cos.numel() == T * D && sin.numel() == T * D && D % 2 == 0,
              "qkv, cos and sin shapes do not match");
  auto opt = qkv.options();
  at::Tensor q = at::empty({T, hq, D}, opt), k = at::empty({T, hkv, D}, opt), v = at::empty({T, hkv, D}, opt);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_qkv", [&] {
    const scalar_t* x = qkv.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    scalar_t* vp = v.data_ptr<scalar_t>();
    const int64_t half = D / 2;
    at::parallel_for(0, T, T * width < (1 << 16) ? T + 1 : 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* row = x + t * width;
        const scalar_t* ct = c + t * D;
        const scalar_t* st = s + t * D;
        for (int64_t h = 0; h < hq + hkv; ++h) {
          const scalar_t* xh = row + h * D;
          scalar_t* o = h < hq ? qp + (t * hq + h) * D : kp + (t * hkv + h - hq) * D;
          for (int64_t d = 0; d < D; ++d) {
            const float a = r<scalar_t>(static_cast<float>(xh[d]) * static_cast<float>(ct[d]));
            const float rolled = static_cast<float>(xh[d < half ? d + half : d - half]);
            const float b2 = r<scalar_t>(rolled * static_cast<float>(st[d]));
            o[d] = static_cast<scalar_t>(a + b2);
          }
        }
        std::copy(row + (hq + hkv) * D, row + width, vp + t * hkv * D);
      }
    });
  });
  return {q, k, v};
}

// silu(gate) * up for gate_up [rows, 2 I] (gate first): [rows, I]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_cpu() && gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "gate_up must be contiguous with an even last dimension");
  const int64_t I = gate_up.size(-1) / 2, rows = I ? gate_up.numel() / (2 * I) : 0;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  at::Tensor out = at::empty(sizes, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* x = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, rows * I < (1 << 16) ? rows + 1 : 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        for (int64_t j = 0; j < I; ++j) {
          const float g = r<scalar_t>(silu(static_cast<float>(x[i * 2 * I + j])));
          o[i * I + j] = static_cast<scalar_t>(g * static_cast<float>(x[i * 2 * I + I + j]));
        }
    });
  });
  return out;
}
