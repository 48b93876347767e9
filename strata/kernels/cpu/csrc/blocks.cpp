// x @ W.T for W held in a GGUF file's own quantized blocks (Q4_0 ... Q6_K): float32 x here,
// bf16/fp16 x through blocks_fixed.cpp's 16-bit fixed point (the CPU's usual compute dtype).
//
// Why: re-quantizing a 4-bit file to torch's int4 layout rounds its fp16
// scales to bf16. Here the blocks stay as the file stores them, and every
// weight is the value gguf.quants.dequantize gives: scale * code + min, with
// the fp16 scales converted exactly and K-quant sub-scales decoded (and
// rounded to float32) as ggml does (block_types.h).
//
// Arithmetic of a float32 x, all float32 (this file is built with -ffp-contract=off; the
// FMAs below are explicit). A group is the run of values that share one
// scale s and min m (32 values; 16 for Q6_K, Q2_K, Q3_K). For output (i, n),
// over the groups of weight row n in order, in 8 lanes:
//   p   = q[0:8] * x[0:8], then p = fma(q[8j:8j+8], x[8j:8j+8], p) for the rest
//   acc = fma(s, p, acc)         (acc starts at 0)
//   acc = fma(m, xs, acc)        (types with a min; xs = the group's x summed per lane)
// and y = the lanes of acc summed in a fixed tree. That is sum over groups of
// s * sum(q x) + m * sum(x): the dequantized weights exactly, factored. The
// order depends on nothing but K, so row i of the output has the same bits
// whatever M, the other rows of x or the thread count: threads split the
// output rows N only, never K. One lane (M = 1) unpacks each block's codes to
// int8 (in L1) and converts them as it multiplies, four weight rows at a
// time; two to eight lanes (a drafted run, a few lanes) unpack and convert
// each block once and run every x row over it; more lanes decode a tile of
// weight rows to float32 once (in L2) and run every x row over it with the
// same operations, so the converted codes are the same exact integers.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_types.h"

namespace {

using namespace strata_blocks;

// ---- 8-lane float vectors: AVX2, or plain arrays with the same steps ----
#if defined(STRATA_BLOCKS_AVX2)
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a); }
inline V vset(float a) { return _mm256_set1_ps(a); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vcodes(const int8_t* q) {  // 8 int8 codes as floats (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
inline float vsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
struct V { float v[8]; };
inline V vzero() { return V{}; }
inline V vload(const float* p) { V r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void vstore(float* p, V a) { std::memcpy(p, a.v, sizeof a.v); }
inline V vset(float a) { V r; for (float& e : r.v) e = a; return r; }
inline V vadd(V a, V b) { for (int l = 0; l < 8; ++l) a.v[l] += b.v[l]; return a; }
inline V vmul(V a, V b) { for (int l = 0; l < 8; ++l) a.v[l] *= b.v[l]; return a; }
inline V vfma(V a, V b, V c) { for (int l = 0; l < 8; ++l) c.v[l] += a.v[l] * b.v[l]; return c; }
inline V vcodes(const int8_t* q) { V r; for (int l = 0; l < 8; ++l) r.v[l] = q[l]; return r; }
inline float vsum(V a) {  // the AVX2 tree
  float s[4];
  for (int l = 0; l < 4; ++l) s[l] = a.v[l] + a.v[l + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}
#endif

// ---- the products ----

// One lane: NR weight rows at once against one x row (independent chains hide FMA latency).
template <class T, int NR>
void fly(const uint8_t* w, int64_t row_bytes, const float* x, const float* xs, int64_t nb, float* y) {
  constexpr int NG = T::QK / T::G, GV = T::G / 8;
  alignas(32) int8_t cbuf[NR][T::QK];
  float s[NR][NG], m[NR][NG];
  V acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = vzero();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* q[NR];
    for (int r = 0; r < NR; ++r) q[r] = T::block(w + r * row_bytes + b * T::BYTES, cbuf[r], s[r], m[r]);
    const float* xb = x + b * T::QK;
    for (int g = 0; g < NG; ++g) {
      V p[NR];
      const V x0 = vload(xb + g * T::G);
      for (int r = 0; r < NR; ++r) p[r] = vmul(vcodes(q[r] + g * T::G), x0);
      for (int j = 1; j < GV; ++j) {
        const V xj = vload(xb + g * T::G + 8 * j);
        for (int r = 0; r < NR; ++r) p[r] = vfma(vcodes(q[r] + g * T::G + 8 * j), xj, p[r]);
      }
      for (int r = 0; r < NR; ++r) acc[r] = vfma(vset(s[r][g]), p[r], acc[r]);
      if constexpr (T::MIN) {
        const V sx = vload(xs + 8 * (b * NG + g));
        for (int r = 0; r < NR; ++r) acc[r] = vfma(vset(m[r][g]), sx, acc[r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) y[r] = vsum(acc[r]);
}

// A few lanes (2..FEW_ROWS x rows) against one weight row: each block's codes are unpacked and
// converted once and every x row runs over them with fly()'s operations, so the bits are fly's.
template <class T, int MR>
void fly_few(const uint8_t* w, const float* x, int64_t K, const float* xs, int64_t xsw, int64_t nb,
             float* y, int64_t N) {
  constexpr int NG = T::QK / T::G, GV = T::G / 8;
  alignas(32) int8_t cbuf[T::QK];
  float s[NG], m[NG];
  V acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = vzero();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* q = T::block(w + b * T::BYTES, cbuf, s, m);
    for (int g = 0; g < NG; ++g) {
      V c[GV];
      for (int j = 0; j < GV; ++j) c[j] = vcodes(q + g * T::G + 8 * j);
      const int64_t o = b * T::QK + g * T::G;
      for (int i = 0; i < MR; ++i) {
        const float* xi = x + i * K + o;
        V p = vmul(c[0], vload(xi));
        for (int j = 1; j < GV; ++j) p = vfma(c[j], vload(xi + 8 * j), p);
        acc[i] = vfma(vset(s[g]), p, acc[i]);
        if constexpr (T::MIN) acc[i] = vfma(vset(m[g]), vload(xs + i * xsw + 8 * (b * NG + g)), acc[i]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) y[i * N] = vsum(acc[i]);
}

constexpr int FEW_ROWS = 8;  // x rows up to which fly_few beats decoding tiles (drafted runs, few lanes)

template <class T>
void few_rows(int mr, const uint8_t* w, const float* x, int64_t K, const float* xs, int64_t xsw, int64_t nb,
              float* y, int64_t N) {
  switch (mr) {
    case 8: return fly_few<T, 8>(w, x, K, xs, xsw, nb, y, N);
    case 7: return fly_few<T, 7>(w, x, K, xs, xsw, nb, y, N);
    case 6: return fly_few<T, 6>(w, x, K, xs, xsw, nb, y, N);
    case 5: return fly_few<T, 5>(w, x, K, xs, xsw, nb, y, N);
    case 4: return fly_few<T, 4>(w, x, K, xs, xsw, nb, y, N);
    case 3: return fly_few<T, 3>(w, x, K, xs, xsw, nb, y, N);
    default: return fly_few<T, 2>(w, x, K, xs, xsw, nb, y, N);
  }
}

// A tile of weight rows decoded to float32: codes [rows][K], scales and mins [rows][K / G].
struct Tile {
  std::vector<float> q, s, m;
};

template <class T>
void decode_rows(const uint8_t* w, int64_t row_bytes, int rows, int64_t nb, Tile& t) {
  constexpr int NG = T::QK / T::G;
  const int64_t K = nb * T::QK, ng = nb * NG;
  t.q.resize(rows * K);
  t.s.resize(rows * ng);
  t.m.resize(rows * ng);
  alignas(32) int8_t cbuf[T::QK];
  for (int r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      float* sp = t.s.data() + r * ng + b * NG;
      float* mp = t.m.data() + r * ng + b * NG;
      const int8_t* c = T::block(w + r * row_bytes + b * T::BYTES, cbuf, sp, mp);
      float* qp = t.q.data() + r * K + b * T::QK;
      for (int j = 0; j < T::QK; j += 8) vstore(qp + j, vcodes(c + j));
    }
}

// MR x rows against NR decoded weight rows: per (x row, weight row) the operations of fly().
template <class T, int MR, int NR>
void tile_kernel(const Tile& t, int r0, int64_t K, const float* const* x, const float* const* xs,
                 float* const* y) {
  constexpr int GV = T::G / 8;
  const int64_t ng = K / T::G;
  const float* q[NR];
  const float *s[NR], *m[NR];
  for (int r = 0; r < NR; ++r) {
    q[r] = t.q.data() + (r0 + r) * K;
    s[r] = t.s.data() + (r0 + r) * ng;
    m[r] = t.m.data() + (r0 + r) * ng;
  }
  V acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = vzero();
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t o = g * T::G;
    V p[MR][NR];
    {
      V qv[NR];
      for (int r = 0; r < NR; ++r) qv[r] = vload(q[r] + o);
      for (int i = 0; i < MR; ++i) {
        const V xv = vload(x[i] + o);
        for (int r = 0; r < NR; ++r) p[i][r] = vmul(qv[r], xv);
      }
    }
    for (int j = 1; j < GV; ++j) {
      V qv[NR];
      for (int r = 0; r < NR; ++r) qv[r] = vload(q[r] + o + 8 * j);
      for (int i = 0; i < MR; ++i) {
        const V xv = vload(x[i] + o + 8 * j);
        for (int r = 0; r < NR; ++r) p[i][r] = vfma(qv[r], xv, p[i][r]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const V sv = vset(s[r][g]);
      for (int i = 0; i < MR; ++i) acc[i][r] = vfma(sv, p[i][r], acc[i][r]);
    }
    if constexpr (T::MIN) {
      for (int i = 0; i < MR; ++i) {
        const V sx = vload(xs[i] + 8 * g);
        for (int r = 0; r < NR; ++r) acc[i][r] = vfma(vset(m[r][g]), sx, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) y[i][r] = vsum(acc[i][r]);
}

constexpr int FLY_ROWS = 4;     // weight rows a lane's loop runs together: independent chains
constexpr int TILE_MR = 2, TILE_NR = 3;
constexpr int64_t TILE_FLOATS = 1 << 15;  // decoded tile: 128 KiB, well inside L2

template <class T>
void fly_rows(int nr, const uint8_t* w, int64_t rb, const float* x, const float* xs, int64_t nb, float* y) {
  if (nr == FLY_ROWS) return fly<T, FLY_ROWS>(w, rb, x, xs, nb, y);
  // a tail of fewer rows: the same per-row operations, one row at a time
  for (int r = 0; r < nr; ++r) fly<T, 1>(w + r * rb, rb, x, xs, nb, y + r);
}

template <class T, int MR>
void tile_cols(int nr, const Tile& t, int r0, int64_t K, const float* const* x, const float* const* xs,
               float* const* y) {
  switch (nr) {
    case 3: return tile_kernel<T, MR, 3>(t, r0, K, x, xs, y);
    case 2: return tile_kernel<T, MR, 2>(t, r0, K, x, xs, y);
    default: return tile_kernel<T, MR, 1>(t, r0, K, x, xs, y);
  }
}

template <class T>
void run(const uint8_t* w, int64_t N, int64_t K, const float* x, const float* xs, int64_t M, float* y) {
  const int64_t nb = K / T::QK, rb = nb * T::BYTES, xsw = T::MIN ? 8 * (K / T::G) : 0;
  const int64_t per_tile = std::max<int64_t>(TILE_NR, TILE_FLOATS / K / TILE_NR * TILE_NR);
  split_rows(N, rb, M, FLY_ROWS, FEW_ROWS, 1, per_tile, [&](int64_t n0, int64_t count) {
    if (M == 1) return fly_rows<T>(static_cast<int>(count), w + n0 * rb, rb, x, xs, nb, y + n0);
    if (M <= FEW_ROWS) return few_rows<T>(static_cast<int>(M), w + n0 * rb, x, K, xs, xsw, nb, y + n0, N);
    thread_local Tile t;
    const int rows = static_cast<int>(count);
    decode_rows<T>(w + n0 * rb, rb, rows, nb, t);
    for (int64_t i = 0; i < M; i += TILE_MR) {
      const int mr = static_cast<int>(std::min<int64_t>(TILE_MR, M - i));
      const float* xp[TILE_MR];
      const float* xsp[TILE_MR];
      for (int a = 0; a < mr; ++a) {
        xp[a] = x + (i + a) * K;
        xsp[a] = xs + (i + a) * xsw;
      }
      for (int r = 0; r < rows; r += TILE_NR) {
        const int nr = std::min(TILE_NR, rows - r);
        float* yp[TILE_MR];
        for (int a = 0; a < mr; ++a) yp[a] = y + (i + a) * N + n0 + r;
        if (mr == TILE_MR)
          tile_cols<T, TILE_MR>(nr, t, r, K, xp, xsp, yp);
        else
          tile_cols<T, 1>(nr, t, r, K, xp, xsp, yp);
      }
    }
  });
}

struct TypeInfo {
  int64_t qtype, qk, bytes, group;
  bool min;
  void (*fn)(const uint8_t*, int64_t, int64_t, const float*, const float*, int64_t, float*);
};

template <class T>
constexpr TypeInfo info(int64_t qtype) {
  return {qtype, T::QK, T::BYTES, T::G, T::MIN, &run<T>};
}

// gguf.GGMLQuantizationType values
const TypeInfo TYPES[] = {
    info<Q4_0>(2), info<Q4_1>(3), info<Q5_0>(6), info<Q5_1>(7), info<Q8_0>(8),
    info<Q2_K>(10), info<Q3_K>(11), info<Q4_K>(12), info<Q5_K>(13), info<Q6_K>(14),
};

}  // namespace

std::vector<int64_t> block_types() {
  std::vector<int64_t> out;
  for (const TypeInfo& t : TYPES) out.push_back(t.qtype);
  return out;
}

// float_out: float32 products, not rounded to x's dtype (logits).
// x [M, K] float32/bfloat16/float16; blocks uint8 [N, K / block size * type size], row n the
// file's bytes of weight row n; qtype a gguf.GGMLQuantizationType value. Returns x @ W.T [M, N].
void fixed_block_matmul(const float* x, int64_t M, int64_t K, const uint8_t* blocks, int64_t N, int64_t qtype,
                        float* y);

at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, bool float_out) {
  const TypeInfo* ti = nullptr;
  for (const TypeInfo& t : TYPES)
    if (t.qtype == qtype) ti = &t;
  TORCH_CHECK(ti != nullptr, "block_matmul: unsupported GGML quantization type ", qtype);
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "block_matmul: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "block_matmul: x must be a contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "block_matmul: x dtype ", x.scalar_type(), " is not float32, bfloat16 or float16");
  TORCH_CHECK(blocks.scalar_type() == at::kByte, "block_matmul: blocks must be uint8, not ", blocks.scalar_type());
  TORCH_CHECK(blocks.dim() == 2 && blocks.is_contiguous(), "block_matmul: blocks must be a contiguous [N, bytes]");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(K % ti->qk == 0, "block_matmul: K = ", K, " is not a multiple of the block size ", ti->qk);
  TORCH_CHECK(blocks.size(1) == K / ti->qk * ti->bytes, "block_matmul: ", blocks.size(1),
              " bytes per row do not hold K = ", K, " values (", K / ti->qk * ti->bytes, " bytes)");
  at::Tensor out = at::empty({M, N}, float_out ? x.options().dtype(at::kFloat) : x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  // x as float32 (exact from bf16/fp16); the buffers are the thread's own and kept: a decode
  // step makes a hundred small calls
  thread_local std::vector<float> xbuf, xs, ybuf;
  if (x.scalar_type() != at::kFloat) {  // bf16/fp16: 16-bit fixed point, blocks_fixed.cpp
    xbuf.resize(M * K);
    AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "block_matmul", [&] {
      const scalar_t* src = x.data_ptr<scalar_t>();
      for (int64_t i = 0; i < M * K; ++i) xbuf[i] = static_cast<float>(src[i]);
    });
    if (float_out) {
      fixed_block_matmul(xbuf.data(), M, K, blocks.data_ptr<uint8_t>(), N, qtype, out.data_ptr<float>());
      return out;
    }
    ybuf.resize(M * N);
    fixed_block_matmul(xbuf.data(), M, K, blocks.data_ptr<uint8_t>(), N, qtype, ybuf.data());
    AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "block_matmul", [&] {
      scalar_t* dst = out.data_ptr<scalar_t>();
      for (int64_t i = 0; i < M * N; ++i) dst[i] = static_cast<scalar_t>(ybuf[i]);
    });
    return out;
  }
  // float32: per group the lane sums for the min term
  const float* xp = x.data_ptr<float>();
  const int64_t ng = K / ti->group, xsw = ti->min ? 8 * ng : 0;
  xs.resize(M * xsw);
  if (ti->min) {
    const int gv = static_cast<int>(ti->group / 8);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t g = 0; g < ng; ++g) {
        const float* p = xp + i * K + g * ti->group;
        V s = vload(p);
        for (int j = 1; j < gv; ++j) s = vadd(s, vload(p + 8 * j));
        vstore(xs.data() + i * xsw + 8 * g, s);
      }
  }
  ti->fn(blocks.data_ptr<uint8_t>(), N, K, xp, xs.data(), M, out.data_ptr<float>());
  return out;
}
