// x @ W.T for W in GGUF blocks with bf16/fp16 activations: x in 16-bit fixed point per 32 values.
//
// Why: blocks.cpp converts every code to float and multiplies it by a float x; that costs
// about three instructions per weight and kept the CPU's decode well below what memory
// allows. Here a pair of 16-bit products is one integer instruction (madd), exact, and
// converting to float happens once per pair. A bf16 x value is kept exactly when it is at
// least 2^-7 of its 32-value block's largest (fp16: 2^-4); a smaller one is rounded to the
// block's step, by at most max|x| * 2^-15 (llama.cpp rounds x to 8 bits per 32 values here).
//
// Arithmetic (this file is built with -ffp-contract=off; the FMAs below are explicit).
// x row, per 32-value block j: max|x| = f 2^e (f in [0.5, 1)), the step d_j = 2^(e - 15), and
// q = rint(x / d_j) (ties to even) as int16. A block whose max is 0 or below 2^-100 has d_j = 0
// and q = 0; one with an inf or NaN has d_j = NaN. Weights: the block's integer codes c and
// per group its scale s and min m (value = s c + m), exactly as blocks.cpp decodes them.
// For output (i, n), in 16 float lanes k (values 2k and 2k + 1 of each x block), over the
// blocks j of the row in order:
//   P   = c[2k] q[2k] + c[2k+1] q[2k+1]                  (int32, exact; |P| < 2^24)
//   acc = fma(s * d_j, float(P), acc)                    (s * d_j exact: d_j is a power of two)
// where s is the scale of the group holding values 2k, 2k+1 (16-value groups: lanes 0-7 and
// 8-15 have their own), and then sum = the lanes added in a fixed tree (k + 8, k + 4, k + 2,
// k + 1). Types with a min also keep one float chain over the row's groups g in order:
//   mn  = fma(m_g, X_g, mn),  X_g = d_j * float(the sum of q over the group)   (exact)
// and the output is sum + mn (one rounding); it is rounded once more to x's dtype (not for
// float32 logits). AVX-512, AVX2 and plain C++ compute exactly these operations,
// so the bits are the same on every machine, and a row's result depends on nothing but its
// own x row: not on M, the other rows or the thread count.
//
// Speed (AVX-512, one to eight x rows): a block's work is bound by the vector ports, not by
// memory. Q4_0 / Q4_1 / Q8_0 codes go from the block to registers directly (`fly_direct`),
// and the blocks' fp16 scales and mins are gathered and converted 16 blocks at a time
// (`block_heads`), with s * d_j as one pass of products over them; one at a time, the two
// scalar conversions were a third of a Q4_1 block's instructions.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_types.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define STRATA_FIXED_512 1
#endif

namespace {

using namespace strata_blocks;

// ---- 16 float lanes (F) and 32 int16 values (I): AVX-512, two AVX2 halves, or arrays ----
#if defined(STRATA_FIXED_512)
struct F { __m512 v; };
struct I { __m512i v; };
inline F fzero() { return {_mm512_setzero_ps()}; }
inline F fset(float a) { return {_mm512_set1_ps(a)}; }
inline F fhalves(float lo, float hi) {  // lanes 0-7 lo, 8-15 hi
  const __m512d l = _mm512_castps_pd(_mm512_set1_ps(lo));
  return {_mm512_castpd_ps(_mm512_insertf64x4(l, _mm256_castps_pd(_mm256_set1_ps(hi)), 1))};
}
inline F fload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void fstore(float* p, F a) { _mm512_storeu_ps(p, a.v); }
inline F ffma(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F fmul(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline I codes(const int8_t* c) {  // two 16-byte loads: each forwards from the store that wrote it
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16));
  return {_mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1))};
}
inline I iload(const int16_t* p) { return {_mm512_loadu_si512(p)}; }
inline void istore(int16_t* p, I a) { _mm512_storeu_si512(p, a.v); }
inline F pairs(I c, I x) { return {_mm512_cvtepi32_ps(_mm512_madd_epi16(c.v, x.v))}; }
inline float fsum(F a) {
  const __m256 lo = _mm512_castps512_ps256(a.v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
  const __m256 t = _mm256_add_ps(lo, hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#elif defined(STRATA_BLOCKS_AVX2)
struct F { __m256 a, b; };
struct I { __m256i a, b; };
inline F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F fset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F fhalves(float lo, float hi) { return {_mm256_set1_ps(lo), _mm256_set1_ps(hi)}; }
inline F fload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void fstore(float* p, F x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
inline F ffma(F x, F y, F z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline F fmul(F x, F y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline I codes(const int8_t* c) {
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16)))};
}
inline I iload(const int16_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
}
inline void istore(int16_t* p, I x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x.a);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16), x.b);
}
inline F pairs(I c, I x) {
  return {_mm256_cvtepi32_ps(_mm256_madd_epi16(c.a, x.a)), _mm256_cvtepi32_ps(_mm256_madd_epi16(c.b, x.b))};
}
inline float fsum(F x) {
  const __m256 t = _mm256_add_ps(x.a, x.b);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
struct F { float v[16]; };
struct I { int16_t v[32]; };
inline F fzero() { return F{}; }
inline F fset(float a) { F r; for (float& e : r.v) e = a; return r; }
inline F fhalves(float lo, float hi) { F r; for (int k = 0; k < 16; ++k) r.v[k] = k < 8 ? lo : hi; return r; }
inline F fload(const float* p) { F r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void fstore(float* p, F a) { std::memcpy(p, a.v, sizeof a.v); }
inline F ffma(F a, F b, F c) { for (int k = 0; k < 16; ++k) c.v[k] = std::fma(a.v[k], b.v[k], c.v[k]); return c; }
inline F fmul(F a, F b) { for (int k = 0; k < 16; ++k) a.v[k] *= b.v[k]; return a; }
inline I codes(const int8_t* c) { I r; for (int l = 0; l < 32; ++l) r.v[l] = c[l]; return r; }
inline I iload(const int16_t* p) { I r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void istore(int16_t* p, I a) { std::memcpy(p, a.v, sizeof a.v); }
inline F pairs(I c, I x) {
  F r;
  for (int k = 0; k < 16; ++k)
    r.v[k] = static_cast<float>(int32_t{c.v[2 * k]} * x.v[2 * k] + int32_t{c.v[2 * k + 1]} * x.v[2 * k + 1]);
  return r;
}
inline float fsum(F a) {  // the vector trees above
  float t[8], s[4];
  for (int l = 0; l < 8; ++l) t[l] = a.v[l] + a.v[l + 8];
  for (int l = 0; l < 4; ++l) s[l] = t[l] + t[l + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}
#endif

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// ---- x rows in fixed point: codes q [M, K], steps d [M, K / 32], min terms xs [M, K / G] ----
struct Fixed {
  std::vector<int16_t> q;
  std::vector<float> d, xs;  // xs: X_g of each min group (group values G)
  int64_t K = 0, G = 32;
  const int16_t* row_q(int64_t i) const { return q.data() + i * K; }
  const float* row_d(int64_t i) const { return d.data() + i * (K / 32); }
  const float* row_xs(int64_t i) const { return xs.data() + i * (K / G); }
};

// one 32-value block: its step and codes (see the arithmetic above)
inline float quantize32(const float* x, int16_t* q) {
  float mx = 0.f;
  bool finite = true;
  for (int l = 0; l < 32; ++l) {
    const float a = std::fabs(x[l]);
    finite = finite && std::isfinite(a);
    mx = std::max(mx, a);
  }
  int e = 0;
  std::frexp(mx, &e);
  if (!finite || mx == 0.f || e < -100) {
    std::memset(q, 0, 32 * sizeof(int16_t));
    return finite ? 0.f : NAN;
  }
  const float up = std::ldexp(1.f, 15 - e);  // exact: x * up only moves the exponent
#if defined(STRATA_BLOCKS_AVX2)
  const __m256 u = _mm256_set1_ps(up);
  for (int l = 0; l < 32; l += 16) {  // cvtps rounds ties to even, as rint in the default mode
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + l), u));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + l + 8), u));
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // saturates at int16
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + l), p);
  }
#else
  for (int l = 0; l < 32; ++l)
    q[l] = static_cast<int16_t>(std::clamp(std::nearbyint(x[l] * up), -32768.f, 32767.f));
#endif
  return std::ldexp(1.f, e - 15);
}

// min_group: the values of a min's group (16 or 32), 0 for types without a min
void to_fixed(const float* x, int64_t M, int64_t K, int min_group, Fixed& fx) {
  const int64_t nj = K / 32;
  fx.K = K;
  fx.G = min_group ? min_group : 32;
  fx.q.resize(M * K);
  fx.d.resize(M * nj);
  fx.xs.resize(min_group ? M * (K / min_group) : 0);
  at::parallel_for(0, M, M >= 16 ? 4 : M + 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      for (int64_t j = 0; j < nj; ++j) {
        int16_t* q = fx.q.data() + i * K + 32 * j;
        const float d = quantize32(x + i * K + 32 * j, q);
        fx.d[i * nj + j] = d;
        if (!min_group) continue;
        for (int g = 0; g < 32 / min_group; ++g) {
          int32_t sum = 0;
          for (int l = 0; l < min_group; ++l) sum += q[g * min_group + l];
          fx.xs[i * (K / min_group) + j * (32 / min_group) + g] = d * static_cast<float>(sum);
        }
      }
  });
}

// Q4_0 / Q4_1 / Q8_0 codes straight from the block into registers (the generic path stores
// them to a buffer first): the same integers as their T::block give.
template <class T>
struct Direct {
  static constexpr bool on = false;
};

#if defined(STRATA_BLOCKS_AVX2)
#if defined(STRATA_FIXED_512)
inline I nibble_codes(const uint8_t* qs, int off) {
  // the 16 bytes in both halves (a broadcast load), widened; the high half shifted down by 4
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i w = _mm512_and_si512(_mm512_srlv_epi16(_mm512_cvtepu8_epi16(v), shift), _mm512_set1_epi16(0x0F));
  return {_mm512_sub_epi16(w, _mm512_set1_epi16(static_cast<int16_t>(off)))};
}
#else
inline I nibble_codes(const uint8_t* qs, int off) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), f = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, f), hi = _mm_and_si128(_mm_srli_epi16(v, 4), f);
  const __m256i o = _mm256_set1_epi16(static_cast<int16_t>(off));
  return {_mm256_sub_epi16(_mm256_cvtepu8_epi16(lo), o), _mm256_sub_epi16(_mm256_cvtepu8_epi16(hi), o)};
}
#endif

template <>
struct Direct<Q4_0> {
  static constexpr bool on = true;
  static I codes(const uint8_t* b) { return nibble_codes(b + 2, 8); }
};

template <>
struct Direct<Q4_1> {
  static constexpr bool on = true;
  static I codes(const uint8_t* b) { return nibble_codes(b + 4, 0); }
};

template <>
struct Direct<Q8_0> {
  static constexpr bool on = true;
#if defined(STRATA_FIXED_512)
  static I codes(const uint8_t* b) {  // one 32-byte load, widened
    return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)))};
  }
#else
  static I codes(const uint8_t* b) { return ::codes(reinterpret_cast<const int8_t*>(b + 2)); }
#endif
};
#endif

constexpr int HEAD = 16;  // blocks whose fp16 scale (and min) are converted together

// The fp16 scale (bytes 0-1) and min (bytes 2-3) of n <= 16 consecutive blocks of `bytes` each,
// as float32. With AVX-512: one gather of their first four bytes and two vector conversions,
// where one block at a time cost two conversions of a scalar each (a third of a Q4_1 block's
// instructions); elsewhere a block at a time. The values are exact either way.
inline void block_heads(const uint8_t* w, int bytes, int n, float* s, float* m) {
#if defined(STRATA_FIXED_512)
  const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(bytes));
  const __mmask16 k = static_cast<__mmask16>((1u << n) - 1);
  const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, at, w, 1);
  _mm512_storeu_ps(s, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
  if (m != nullptr) _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))));
#else
  for (int k = 0; k < n; ++k) {
    s[k] = f16(w + k * bytes);
    if (m != nullptr) m[k] = f16(w + k * bytes + 2);
  }
#endif
}

// sd[k] = s[k] * d[k] for k < n <= 16 (one masked vector product with AVX-512)
inline void scale_steps(const float* s, const float* d, int n, float* sd) {
#if defined(STRATA_FIXED_512)
  const __mmask16 k = static_cast<__mmask16>((1u << n) - 1);
  _mm512_storeu_ps(sd, _mm512_mul_ps(_mm512_loadu_ps(s), _mm512_maskz_loadu_ps(k, d)));
#else
  for (int k = 0; k < n; ++k) sd[k] = s[k] * d[k];
#endif
}

// MR x rows against NR weight rows of a type whose codes load straight from the block
// (Direct): per 16 blocks their scales and mins converted together and s * d_j as one pass of
// products, then per block fma(s * d_j, pair sums, acc) and the min chain (the arithmetic at
// the top of this file).
template <class T, int MR, int NR>
void fly_direct(const uint8_t* w, int64_t rb, const Fixed& fx, int64_t nb, float* y, int64_t N) {
  constexpr int LINES = (NR * T::BYTES + 63) / 64;
  alignas(64) float s[NR][HEAD], m[NR][HEAD], sd[MR][NR][HEAD];
  F acc[MR][NR];
  float mn[MR][NR] = {};
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = fzero();
  const char* next = reinterpret_cast<const char*>(w + NR * rb);
  for (int64_t b0 = 0; b0 < nb; b0 += HEAD) {
    const int n = static_cast<int>(std::min<int64_t>(HEAD, nb - b0));
    for (int r = 0; r < NR; ++r) block_heads(w + r * rb + b0 * T::BYTES, T::BYTES, n, s[r], T::MIN ? m[r] : nullptr);
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) scale_steps(s[r], fx.row_d(i) + b0, n, sd[i][r]);
    for (int jb = 0; jb < n; ++jb) {
      const int64_t b = b0 + jb;
      for (int l = 0; l < LINES; ++l) prefetch(next + (b * LINES + l) * 64);
      I c[NR];
      for (int r = 0; r < NR; ++r) c[r] = Direct<T>::codes(w + r * rb + b * T::BYTES);
      for (int i = 0; i < MR; ++i) {
        const I xv = iload(fx.row_q(i) + 32 * b);
        for (int r = 0; r < NR; ++r) acc[i][r] = ffma(fset(sd[i][r][jb]), pairs(c[r], xv), acc[i][r]);
        if constexpr (T::MIN)
          for (int r = 0; r < NR; ++r) mn[i][r] = std::fma(m[r][jb], fx.row_xs(i)[b], mn[i][r]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) y[i * N + r] = T::MIN ? fsum(acc[i][r]) + mn[i][r] : fsum(acc[i][r]);
}

// the scale lanes of x block jj of a weight block whose groups hold G values (s: its scales)
template <class T>
inline F scales(const float* s, int jj) {
  if constexpr (T::G == 32) return fset(s[jj]);
  else return fhalves(s[2 * jj], s[2 * jj + 1]);
}

// ---- the products ----

// MR x rows (one lane, or a few: a drafted run) against NR weight rows, each block unpacked
// once, prefetching the next NR weight rows as it goes. y [MR rows of stride N][NR].
template <class T, int MR, int NR>
void fly(const uint8_t* w, int64_t rb, const Fixed& fx, int64_t nb, float* y, int64_t N) {
  if constexpr (Direct<T>::on) return fly_direct<T, MR, NR>(w, rb, fx, nb, y, N);
  constexpr int NG = T::QK / T::G, NJ = T::QK / 32, LINES = (NR * T::BYTES + 63) / 64;
  alignas(64) int8_t cbuf[NR][T::QK];
  float s[NR][NG], m[NR][NG];
  F acc[MR][NR];
  float mn[MR][NR] = {};
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = fzero();
  const char* next = reinterpret_cast<const char*>(w + NR * rb);
  for (int64_t b = 0; b < nb; ++b) {
    for (int l = 0; l < LINES; ++l) prefetch(next + (b * LINES + l) * 64);
    const int8_t* q[NR];
    for (int r = 0; r < NR; ++r) q[r] = T::block(w + r * rb + b * T::BYTES, cbuf[r], s[r], m[r]);
    for (int jj = 0; jj < NJ; ++jj) {
      const int64_t j = b * NJ + jj;
      I c[NR];
      F sv[NR];
      for (int r = 0; r < NR; ++r) {
        c[r] = codes(q[r] + 32 * jj);
        sv[r] = scales<T>(s[r], jj);
      }
      for (int i = 0; i < MR; ++i) {
        const I xv = iload(fx.row_q(i) + 32 * j);
        const F d = fset(fx.row_d(i)[j]);
        for (int r = 0; r < NR; ++r) acc[i][r] = ffma(fmul(sv[r], d), pairs(c[r], xv), acc[i][r]);
      }
    }
    if constexpr (T::MIN)
      for (int i = 0; i < MR; ++i)
        for (int r = 0; r < NR; ++r)
          for (int g = 0; g < NG; ++g) mn[i][r] = std::fma(m[r][g], fx.row_xs(i)[b * NG + g], mn[i][r]);
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) y[i * N + r] = T::MIN ? fsum(acc[i][r]) + mn[i][r] : fsum(acc[i][r]);
}

constexpr int FEW_ROWS = 8;
#if defined(STRATA_FIXED_512)
constexpr int FLY_ROWS = 4;  // weight rows a step of one to four lanes runs together
#else
constexpr int FLY_ROWS = 2;  // AVX2: each F is two of 16 registers
#endif

// MR = 1..FEW_ROWS x rows against `nr` weight rows (FLY_ROWS, or a tail of fewer, a row at a time)
template <class T, int MR>
void fly_rows(int nr, const uint8_t* w, int64_t rb, const Fixed& fx, int64_t nb, float* y, int64_t N) {
  constexpr int NR = MR <= 4 ? FLY_ROWS : (FLY_ROWS + 1) / 2;  // the accumulators fit the registers
  int r = 0;
  for (; r + NR <= nr; r += NR) fly<T, MR, NR>(w + r * rb, rb, fx, nb, y + r, N);
  for (; r < nr; ++r) fly<T, MR, 1>(w + r * rb, rb, fx, nb, y + r, N);
}

template <class T>
void few_rows(int mr, int nr, const uint8_t* w, int64_t rb, const Fixed& fx, int64_t nb, float* y, int64_t N) {
  switch (mr) {
    case 1: return fly_rows<T, 1>(nr, w, rb, fx, nb, y, N);
    case 2: return fly_rows<T, 2>(nr, w, rb, fx, nb, y, N);
    case 3: return fly_rows<T, 3>(nr, w, rb, fx, nb, y, N);
    case 4: return fly_rows<T, 4>(nr, w, rb, fx, nb, y, N);
    case 5: return fly_rows<T, 5>(nr, w, rb, fx, nb, y, N);
    case 6: return fly_rows<T, 6>(nr, w, rb, fx, nb, y, N);
    case 7: return fly_rows<T, 7>(nr, w, rb, fx, nb, y, N);
    default: return fly_rows<T, 8>(nr, w, rb, fx, nb, y, N);
  }
}

// A tile of weight rows decoded once: int16 codes [rows][K], scales [rows][K / G], and the mins
// transposed, [K / G][rows], so that one vector carries 16 rows' min chains.
struct Tile {
  std::vector<int16_t> q;
  std::vector<float> s, mt;
  int rows = 0;
};

template <class T>
void decode_rows(const uint8_t* w, int64_t rb, int rows, int64_t nb, Tile& t) {
  constexpr int NG = T::QK / T::G;
  const int64_t K = nb * T::QK, ng = nb * NG;
  t.rows = rows;
  t.q.resize(rows * K);
  t.s.resize(rows * ng);
  t.mt.resize(T::MIN ? rows * ng : 0);
  alignas(64) int8_t cbuf[T::QK];
  float m[NG];
  for (int r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* c = T::block(w + r * rb + b * T::BYTES, cbuf, t.s.data() + r * ng + b * NG, m);
      for (int jj = 0; jj < T::QK / 32; ++jj) istore(t.q.data() + r * K + b * T::QK + 32 * jj, codes(c + 32 * jj));
      if constexpr (T::MIN)
        for (int g = 0; g < NG; ++g) t.mt[(b * NG + g) * rows + r] = m[g];
    }
}

// The min chains of a tile's rows for x row i, added to the lane sums in y: 16 rows a vector.
template <class T>
void tile_mins(const Tile& t, int64_t K, const Fixed& fx, int64_t i, float* y) {
  const int64_t ng = K / T::G;
  const float* xs = fx.row_xs(i);
  int r = 0;
  for (; r + 16 <= t.rows; r += 16) {
    F mn = fzero();
    for (int64_t g = 0; g < ng; ++g) mn = ffma(fload(t.mt.data() + g * t.rows + r), fset(xs[g]), mn);
    alignas(64) float v[16];
    fstore(v, mn);
    for (int l = 0; l < 16; ++l) y[r + l] += v[l];
  }
  for (; r < t.rows; ++r) {
    float mn = 0.f;
    for (int64_t g = 0; g < ng; ++g) mn = std::fma(t.mt[g * t.rows + r], xs[g], mn);
    y[r] += mn;
  }
}

// MR x rows against NR decoded weight rows: per (x row, weight row) fly()'s operations.
template <class T, int MR, int NR>
void tile_kernel(const Tile& t, int r0, int64_t K, const Fixed& fx, int64_t i0, float* y, int64_t N) {
  const int64_t ng = K / T::G, nj = K / 32;
  F acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = fzero();
  for (int64_t j = 0; j < nj; ++j) {
    const int64_t g0 = j * 32 / T::G;  // the group of the block's first value
    I c[NR];
    F sv[NR];  // the rows' scales in their lanes; s * d below is the same product as fly's
    for (int r = 0; r < NR; ++r) {
      c[r] = iload(t.q.data() + (r0 + r) * K + 32 * j);
      sv[r] = scales<T>(t.s.data() + (r0 + r) * ng + g0, 0);
    }
    for (int i = 0; i < MR; ++i) {
      const I xv = iload(fx.row_q(i0 + i) + 32 * j);
      const F d = fset(fx.row_d(i0 + i)[j]);
      for (int r = 0; r < NR; ++r) acc[i][r] = ffma(fmul(sv[r], d), pairs(c[r], xv), acc[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) y[(i0 + i) * N + r] = fsum(acc[i][r]);
}

#if defined(STRATA_FIXED_512)
constexpr int TILE_MR = 4, TILE_NR = 3;  // 12 accumulators of 32 registers
#else
constexpr int TILE_MR = 2, TILE_NR = 2;  // AVX2: each F is two of 16 registers
#endif
constexpr int64_t TILE_VALUES = 1 << 16;  // decoded tile: 128 KiB of int16 codes, inside L2

template <class T, int MR>
void tile_cols(int nr, const Tile& t, int r0, int64_t K, const Fixed& fx, int64_t i0, float* y, int64_t N) {
  if constexpr (TILE_NR >= 3) {
    if (nr == 3) return tile_kernel<T, MR, 3>(t, r0, K, fx, i0, y, N);
  }
  if (nr == 2) return tile_kernel<T, MR, 2>(t, r0, K, fx, i0, y, N);
  return tile_kernel<T, MR, 1>(t, r0, K, fx, i0, y, N);
}

template <class T>
void tile_rows(int mr, int nr, const Tile& t, int r0, int64_t K, const Fixed& fx, int64_t i0, float* y,
               int64_t N) {
  if constexpr (TILE_MR >= 4) {
    if (mr == 4) return tile_cols<T, 4>(nr, t, r0, K, fx, i0, y, N);
    if (mr == 3) return tile_cols<T, 3>(nr, t, r0, K, fx, i0, y, N);
  }
  if (mr == 2) return tile_cols<T, 2>(nr, t, r0, K, fx, i0, y, N);
  return tile_cols<T, 1>(nr, t, r0, K, fx, i0, y, N);
}

template <class T>
void run(const uint8_t* w, int64_t N, int64_t K, const Fixed& fx, int64_t M, float* y) {
  const int64_t nb = K / T::QK, rb = nb * T::BYTES;
  const int64_t per_tile = std::max<int64_t>(TILE_NR, TILE_VALUES / K / TILE_NR * TILE_NR);
  split_rows(N, rb, M, FLY_ROWS, FEW_ROWS, FLY_ROWS, per_tile, [&](int64_t n0, int64_t count) {
    if (M <= FEW_ROWS)
      return few_rows<T>(static_cast<int>(M), static_cast<int>(count), w + n0 * rb, rb, fx, nb, y + n0, N);
    thread_local Tile t;
    const int rows = static_cast<int>(count);
    decode_rows<T>(w + n0 * rb, rb, rows, nb, t);
    for (int64_t i = 0; i < M; i += TILE_MR)
      for (int r = 0; r < rows; r += TILE_NR)
        tile_rows<T>(static_cast<int>(std::min<int64_t>(TILE_MR, M - i)), std::min(TILE_NR, rows - r), t, r, K, fx,
                     i, y + n0 + r, N);
    if constexpr (T::MIN)
      for (int64_t i = 0; i < M; ++i) tile_mins<T>(t, K, fx, i, y + i * N + n0);
  });
}

struct TypeInfo {
  int64_t qtype;
  bool min;
  int64_t group;
  void (*fn)(const uint8_t*, int64_t, int64_t, const Fixed&, int64_t, float*);
};

template <class T>
constexpr TypeInfo info(int64_t qtype) {
  return {qtype, T::MIN, T::G, &run<T>};
}

const TypeInfo TYPES[] = {
    info<Q4_0>(2), info<Q4_1>(3), info<Q5_0>(6), info<Q5_1>(7), info<Q8_0>(8),
    info<Q2_K>(10), info<Q3_K>(11), info<Q4_K>(12), info<Q5_K>(13), info<Q6_K>(14),
};

}  // namespace

// x [M, K] float32 (converted exactly from bf16/fp16 by the caller), blocks [N, bytes] of
// gguf type qtype (checked by the caller), y [M, N] float32.
void fixed_block_matmul(const float* x, int64_t M, int64_t K, const uint8_t* blocks, int64_t N, int64_t qtype,
                        float* y) {
  const TypeInfo* ti = nullptr;
  for (const TypeInfo& t : TYPES)
    if (t.qtype == qtype) ti = &t;
  TORCH_CHECK(ti != nullptr, "block_matmul: unsupported GGML quantization type ", qtype);
  thread_local Fixed fx;  // the thread's own and kept: a decode step makes a hundred small calls
  to_fixed(x, M, K, ti->min ? static_cast<int>(ti->group) : 0, fx);
  ti->fn(blocks, N, K, fx, M, y);
}
