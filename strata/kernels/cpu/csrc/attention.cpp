// Causal grouped-query attention for CPU tensors, one query row at a time.
//
// Why a kernel: a decode step of a small model spent most of its attention
// time dispatching twenty small torch operations per layer. Why this shape:
// every query row is computed by the same function over exactly its own keys
// (cells[seq, 0..pos]) in a fixed order, so its result does not depend on how
// many rows, sequences or padding are computed beside it. A lane decodes the
// same bits alone or in a batch, and a prompt read in chunks gives the K/V
// that a prompt read at once gives.
//
// Arithmetic: float32 throughout; exact two-pass softmax (max, then exp and
// sum). A row with more than CHUNK keys is read in chunks of CHUNK keys (from
// its first key; so the chunks depend on the row's own length only), each
// chunk's maximum, sum and unnormalised output kept, then combined in chunk
// order: M = the largest maximum, w_c = exp(max_c - M), out = (sum of w_c *
// out_c) / (sum of w_c * sum_c). The chunks of one decode row spread over the
// threads; a row of at most CHUNK keys is computed as one piece, as before. With AVX-512 the 16-wide vectors below; elsewhere the same steps in
// scalar code (a different machine may round differently, one machine never
// does). exp is a degree-6 polynomial after range reduction (about 1 ulp).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr float LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693145751953125f;
constexpr float LN2_LO = 1.428606765330187e-06f;
constexpr float EXP_FLOOR = -87.0f;  // exp below this is taken as 0

#if defined(__AVX512F__)
constexpr int64_t W = 16;

inline __mmask16 tail(int64_t left) { return left >= W ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load(const c10::BFloat16* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load(const c10::Half* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }

// exp(x) for x <= 0, 16 at a time
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_FLOOR), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
  const __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(LN2_HI), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, k));
}

// exp(x) of one x <= 0, as the softmax computes it
inline float chunk_weight(float x) { return _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(x))); }

// Full vectors are loaded and stored without masks: a masked load of data a
// masked store just wrote is not forwarded from the store buffer and stalls.
// one row of D values as float32 into buf
template <typename T>
inline void widen(const T* src, float* buf, int64_t D) {
  int64_t d = 0;
  for (; d + W <= D; d += W) _mm512_storeu_ps(buf + d, load(src + d, 0xFFFF));
  if (d < D) _mm512_mask_storeu_ps(buf + d, tail(D - d), load(src + d, tail(D - d)));
}

inline float dot(const float* a, const float* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + W <= D; d += W) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  if (d < D) acc = _mm512_fmadd_ps(load(a + d, tail(D - d)), load(b + d, tail(D - d)), acc);
  return _mm512_reduce_add_ps(acc);
}

// s[0..n) = exp(s - max(s)); returns their sum
inline float softmax_numerators(float* s, int64_t n, float* peak_out) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + W <= n; j += W) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
  if (j < n) mx = _mm512_mask_max_ps(mx, tail(n - j), mx, load(s + j, tail(n - j)));
  *peak_out = _mm512_reduce_max_ps(mx);
  const __m512 peak = _mm512_set1_ps(*peak_out);
  __m512 total = _mm512_setzero_ps();
  for (j = 0; j + W <= n; j += W) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), peak));
    _mm512_storeu_ps(s + j, e);
    total = _mm512_add_ps(total, e);
  }
  if (j < n) {
    const __mmask16 m = tail(n - j);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(load(s + j, m), peak)));
    _mm512_mask_storeu_ps(s + j, m, e);
    total = _mm512_add_ps(total, e);
  }
  return _mm512_reduce_add_ps(total);
}

inline void axpy(float p, const float* x, float* y, int64_t D) {
  const __m512 pv = _mm512_set1_ps(p);
  int64_t d = 0;
  for (; d + W <= D; d += W) _mm512_storeu_ps(y + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + d), _mm512_loadu_ps(y + d)));
  if (d < D) {
    const __mmask16 m = tail(D - d);
    _mm512_mask_storeu_ps(y + d, m, _mm512_fmadd_ps(pv, load(x + d, m), load(y + d, m)));
  }
}

constexpr int64_t AHEAD = 16;  // keys ahead whose rows are prefetched (a gather by cell)

inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(p) + o, _MM_HINT_T0);
}

// GB heads' weighted sums of the value rows (weights s[g * n + j], the softmax numerators),
// then either the output (divided by denom) or a chunk's piece (max, sum, unnormalised sum).
template <int NV, int GB, typename Q, typename KV>
void weigh_values(const KV* v, int64_t cell_stride, const int64_t* cells, int64_t n, const float* s,
                  const float* peak, const float* denom, Q* out, float* acc, float* part) {
  constexpr int64_t D = NV * W;
  __m512 o[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) o[g][c] = _mm512_setzero_ps();
  for (int64_t jj = 0; jj < n; ++jj) {
    if (jj + AHEAD < n) prefetch_row(v + cells[jj + AHEAD] * cell_stride, D * sizeof(KV));
    const KV* vr = v + cells[jj] * cell_stride;
    __m512 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = load(vr + c * W, 0xFFFF);
    for (int g = 0; g < GB; ++g) {
      const __m512 pv = _mm512_set1_ps(s[g * n + jj]);
      for (int c = 0; c < NV; ++c) o[g][c] = _mm512_fmadd_ps(pv, vv[c], o[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    if (part != nullptr) {  // a chunk: its maximum, sum and unnormalised output
      float* pg = part + g * (D + 2);
      pg[0] = peak[g];
      pg[1] = denom[g];
      for (int c = 0; c < NV; ++c) _mm512_storeu_ps(pg + 2 + c * W, o[g][c]);
      continue;
    }
    const float inv = 1.0f / denom[g];
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + c * W, _mm512_mul_ps(o[g][c], _mm512_set1_ps(inv)));
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<Q>(acc[d]);
  }
}

// attend_row for D = 16 * NV: rows live in registers, and four keys are scored
// at once so that four reductions overlap. Each key's score is the same
// arithmetic as in the generic path (one fused multiply-add chain over D,
// then one reduction), so the result of a row never depends on its neighbours.
template <int NV, typename Q, typename KV>
void attend_row_fixed(const Q* q, const KV* k, const KV* v, int64_t cell_stride, const int64_t* cells,
                      int64_t n, int64_t G, float scale, Q* out, float* work, float* part) {
  constexpr int64_t D = NV * W;
  float* s = work;
  float* acc = s + G * n;
  __m512 qv[8][NV];
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) qv[g][c] = load(q + g * D + c * W, 0xFFFF);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    if (j + AHEAD + 4 <= n)
      for (int u = 0; u < 4; ++u) prefetch_row(k + cells[j + AHEAD + u] * cell_stride, D * sizeof(KV));
    __m512 kr[4][NV];
    for (int u = 0; u < 4; ++u)
      for (int c = 0; c < NV; ++c) kr[u][c] = load(k + cells[j + u] * cell_stride + c * W, 0xFFFF);
    for (int64_t g = 0; g < G; ++g) {
      __m512 a[4];
      for (int u = 0; u < 4; ++u) {
        a[u] = _mm512_setzero_ps();
        for (int c = 0; c < NV; ++c) a[u] = _mm512_fmadd_ps(qv[g][c], kr[u][c], a[u]);
      }
      for (int u = 0; u < 4; ++u) s[g * n + j + u] = _mm512_reduce_add_ps(a[u]) * scale;
    }
  }
  for (; j < n; ++j) {
    __m512 kr[NV];
    for (int c = 0; c < NV; ++c) kr[c] = load(k + cells[j] * cell_stride + c * W, 0xFFFF);
    for (int64_t g = 0; g < G; ++g) {
      __m512 a = _mm512_setzero_ps();
      for (int c = 0; c < NV; ++c) a = _mm512_fmadd_ps(qv[g][c], kr[c], a);
      s[g * n + j] = _mm512_reduce_add_ps(a) * scale;
    }
  }
  float peak[8], denom[8];
  for (int64_t g = 0; g < G; ++g) denom[g] = softmax_numerators(s + g * n, n, &peak[g]);
  // the values: one pass over the keys for up to four heads at a time (each head's sum runs
  // over the keys in order, as one head at a time would)
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const auto weigh = [&](auto heads) {
      weigh_values<NV, decltype(heads)::value>(v, cell_stride, cells, n, s + g0 * n, peak + g0, denom + g0,
                                               out + g0 * D, acc, part ? part + g0 * (D + 2) : nullptr);
    };
    switch (std::min<int64_t>(4, G - g0)) {
      case 4: weigh(std::integral_constant<int, 4>{}); break;
      case 3: weigh(std::integral_constant<int, 3>{}); break;
      case 2: weigh(std::integral_constant<int, 2>{}); break;
      default: weigh(std::integral_constant<int, 1>{}); break;
    }
  }
}
#else
template <typename T>
inline void widen(const T* src, float* buf, int64_t D) {
  for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(src[d]);
}

inline float dot(const float* a, const float* b, int64_t D) {
  float acc = 0.f;
  for (int64_t d = 0; d < D; ++d) acc += a[d] * b[d];
  return acc;
}

inline float softmax_numerators(float* s, int64_t n, float* peak_out) {
  float peak = -INFINITY;
  for (int64_t j = 0; j < n; ++j) peak = s[j] > peak ? s[j] : peak;
  *peak_out = peak;
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float x = s[j] - peak;
    s[j] = x >= EXP_FLOOR ? std::exp(x) : 0.f;
    total += s[j];
  }
  return total;
}

inline void axpy(float p, const float* x, float* y, int64_t D) {
  for (int64_t d = 0; d < D; ++d) y[d] += p * x[d];
}

inline float chunk_weight(float x) { return x >= EXP_FLOOR ? std::exp(x) : 0.f; }
#endif

// One query row of G heads sharing one KV head, over n keys at `cells`.
// work: G*D (q) + D (a key or value row) + G*n (scores) + G*D (weighted sums).
template <typename Q, typename KV>
void attend_row(const Q* q, const KV* k, const KV* v, int64_t cell_stride, const int64_t* cells, int64_t n,
                int64_t G, int64_t D, float scale, Q* out, float* work, float* part) {
  float* qf = work;
  float* row = qf + G * D;
  float* s = row + D;
  float* acc = s + G * n;
  for (int64_t g = 0; g < G; ++g) widen(q + g * D, qf + g * D, D);
  for (int64_t j = 0; j < n; ++j) {
    widen(k + cells[j] * cell_stride, row, D);
    for (int64_t g = 0; g < G; ++g) s[g * n + j] = dot(qf + g * D, row, D) * scale;
  }
  float denom[64], peak[64];
  for (int64_t g = 0; g < G; ++g) denom[g] = softmax_numerators(s + g * n, n, &peak[g]);
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    widen(v + cells[j] * cell_stride, row, D);
    for (int64_t g = 0; g < G; ++g) axpy(s[g * n + j], row, acc + g * D, D);
  }
  for (int64_t g = 0; g < G; ++g) {
    if (part != nullptr) {  // a chunk: its maximum, sum and unnormalised output
      float* pg = part + g * (D + 2);
      pg[0] = peak[g];
      pg[1] = denom[g];
      std::copy(acc + g * D, acc + (g + 1) * D, pg + 2);
      continue;
    }
    const float inv = 1.0f / denom[g];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<Q>(acc[g * D + d] * inv);
  }
}

constexpr int64_t CHUNK = 512;  // keys a piece of a row reads (see the arithmetic above)

// pieces [chunks][G][max, sum, D unnormalised outputs] of one row and kv head -> out [G, D]
template <typename Q>
void combine_chunks(const float* pieces, int64_t chunks, int64_t G, int64_t D, Q* out) {
  const int64_t stride = G * (D + 2);
  std::vector<float> o(D);
  for (int64_t g = 0; g < G; ++g) {
    float top = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) top = std::max(top, pieces[c * stride + g * (D + 2)]);
    float total = 0.f;
    std::fill(o.begin(), o.end(), 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* p = pieces + c * stride + g * (D + 2);
      const float w = chunk_weight(p[0] - top);
      total = total + w * p[1];
      for (int64_t d = 0; d < D; ++d) o[d] = o[d] + w * p[2 + d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<Q>(o[d] * inv);
  }
}

// window > 0: row t reads only the last `window` positions up to its own (a sliding-window layer)
template <typename Q, typename KV>
void attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cells,
                const at::Tensor& row_seq, const at::Tensor& row_pos, float scale, int64_t window,
                at::Tensor& out) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1);
  const int64_t G = Hq / Hkv;
  const int64_t L = cells.size(1);
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const KV* kp = k.data_ptr<KV>();
  const KV* vp = v.data_ptr<KV>();
  const int64_t* cp = cells.data_ptr<int64_t>();
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* pos = row_pos.data_ptr<int64_t>();
  const auto first_of = [&](int64_t t) { return window > 0 && pos[t] >= window ? pos[t] - window + 1 : 0; };
  int64_t keys = 0;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < L, "row ", t, " reads ", pos[t] + 1, " keys of ", L, " cells");
    keys += pos[t] + 1 - first_of(t);
  }
  // a row's chunks: rows past CHUNK keys keep per-chunk pieces in `parts`, combined below
  std::vector<int64_t> first_item(T + 1), first_part(T + 1);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t chunks = (pos[t] + 1 - first_of(t) + CHUNK - 1) / CHUNK;
    first_item[t + 1] = first_item[t] + chunks * Hkv;
    first_part[t + 1] = first_part[t] + (chunks > 1 ? chunks * Hkv : 0);
  }
  const int64_t items = first_item[T];
  // every piece is written before it is read: no zeroing (a prompt's pieces run to megabytes)
  std::unique_ptr<float[]> parts(new float[static_cast<size_t>(first_part[T] * G * (D + 2))]);
  // threads pay only for large steps (prompt reading, many lanes, long rows)
  const int64_t grain = keys * Hq * D < (1 << 18) ? items + 1 : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> work;
    int64_t t = std::upper_bound(first_item.begin(), first_item.end(), begin) - first_item.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= first_item[t + 1]) ++t;
      const int64_t chunks = (first_item[t + 1] - first_item[t]) / Hkv;
      const int64_t h = (item - first_item[t]) / chunks, chunk = (item - first_item[t]) % chunks;
      const int64_t first = first_of(t) + chunk * CHUNK;
      const int64_t n = std::min(CHUNK, pos[t] + 1 - first);
      const size_t need = static_cast<size_t>(2 * G * D + D + G * n);
      if (work.size() < need) work.resize(need);
      const Q* qr = qp + (t * Hq + h * G) * D;
      Q* orow = op + (t * Hq + h * G) * D;
      const int64_t* c = cp + seq[t] * L + first;
      float* part = chunks > 1 ? parts.get() + (first_part[t] + h * chunks + chunk) * G * (D + 2) : nullptr;
#if defined(__AVX512F__)
      if (D == 64 && G <= 8) {
        attend_row_fixed<4, Q, KV>(qr, kp + h * D, vp + h * D, Hkv * D, c, n, G, scale, orow, work.data(), part);
        continue;
      }
      if (D == 128 && G <= 8) {
        attend_row_fixed<8, Q, KV>(qr, kp + h * D, vp + h * D, Hkv * D, c, n, G, scale, orow, work.data(), part);
        continue;
      }
#endif
      attend_row<Q, KV>(qr, kp + h * D, vp + h * D, Hkv * D, c, n, G, D, scale, orow, work.data(), part);
    }
  });
  for (int64_t t = 0; t < T; ++t) {  // the chunked rows: their pieces combined in chunk order
    const int64_t chunks = (first_item[t + 1] - first_item[t]) / Hkv;
    if (chunks == 1) continue;
    for (int64_t h = 0; h < Hkv; ++h)
      combine_chunks(parts.get() + (first_part[t] + h * chunks) * G * (D + 2), chunks, G, D,
                     op + (t * Hq + h * G) * D);
  }
}

template <typename Q>
void dispatch_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cells,
                 const at::Tensor& row_seq, const at::Tensor& row_pos, float scale, int64_t window,
                 at::Tensor& out) {
  switch (k.scalar_type()) {
    case at::kBFloat16:
      return attend_all<Q, c10::BFloat16>(q, k, v, cells, row_seq, row_pos, scale, window, out);
    case at::kHalf: return attend_all<Q, c10::Half>(q, k, v, cells, row_seq, row_pos, scale, window, out);
    case at::kFloat: return attend_all<Q, float>(q, k, v, cells, row_seq, row_pos, scale, window, out);
    default: TORCH_CHECK(false, "K/V dtype ", k.scalar_type(), " is not bf16, fp16 or fp32");
  }
}

}  // namespace

// q [T, Hq, D]; k, v [N, Hkv, D] (the pool's cells); cells [S, L] int64: the cell of each position
// of each sequence; row_seq, row_pos [T] int64: row t attends to cells[row_seq[t], 0..row_pos[t]];
// window > 0: only to the last `window` of them (positions > row_pos[t] - window).
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cells,
                  const at::Tensor& row_seq, const at::Tensor& row_pos, double scale, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [rows, heads, dim]");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "q, k, v must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "k and v differ in shape or dtype");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0, "q heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(1) / k.size(1) <= 64, "at most 64 query heads per kv head");
  TORCH_CHECK(cells.scalar_type() == at::kLong && row_seq.scalar_type() == at::kLong &&
              row_pos.scalar_type() == at::kLong, "cells, row_seq and row_pos must be int64");
  TORCH_CHECK(cells.dim() == 2 && cells.is_contiguous(), "cells must be a contiguous [sequences, positions]");
  TORCH_CHECK(row_seq.numel() == q.size(0) && row_pos.numel() == q.size(0), "one row_seq and row_pos per row");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  at::Tensor out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  auto rs = row_seq.contiguous(), rp = row_pos.contiguous();
  switch (q.scalar_type()) {
    case at::kBFloat16: dispatch_kv<c10::BFloat16>(q, k, v, cells, rs, rp, s, window, out); break;
    case at::kHalf: dispatch_kv<c10::Half>(q, k, v, cells, rs, rp, s, window, out); break;
    case at::kFloat: dispatch_kv<float>(q, k, v, cells, rs, rp, s, window, out); break;
    default: TORCH_CHECK(false, "query dtype ", q.scalar_type(), " is not bf16, fp16 or fp32");
  }
  return out;
}
