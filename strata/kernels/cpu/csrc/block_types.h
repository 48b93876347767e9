// The GGUF block types the CPU kernels read: each block's integer codes (int8, value order) and
// per group its scale and min, decoded as ggml does (fp16 fields converted exactly). Shared by
// blocks.cpp (float32 activations) and blocks_fixed.cpp (16-bit fixed-point activations).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define STRATA_BLOCKS_AVX2 1
#include <immintrin.h>
#endif

namespace strata_blocks {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(STRATA_BLOCKS_AVX2)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}


// ---- block types: a block's codes (int8, value order), and per group its scale and min ----
// block(b, c, s, m) returns the QK codes (in c, or in the block itself for Q8_0), writes the
// scale s[g] and the min m[g] of each group g: the value of code q is s[g] * q + m[g].

// the 6-bit scale and min of group j of Q4_K / Q5_K, as ggml's get_scale_min_k4
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K / Q5_K: d * scale, and the min negated (the file's value is d sc q - dmin mn)
inline void k4_scales(const uint8_t* b, float* s, float* m) {
  const float d = f16(b), dmin = f16(b + 2);
  for (int g = 0; g < 8; ++g) {
    int sc, mn;
    scale_min_k4(g, b + 4, sc, mn);
    s[g] = d * static_cast<float>(sc);
    m[g] = -(dmin * static_cast<float>(mn));
  }
}

// 16 bytes -> their low nibbles then their high nibbles, minus `off`
inline void nibbles16(const uint8_t* qs, int8_t* c, int off) {
#if defined(STRATA_BLOCKS_AVX2)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), f = _mm_set1_epi8(0x0F);
  const __m128i o = _mm_set1_epi8(static_cast<char>(off));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(c), _mm_sub_epi8(_mm_and_si128(v, f), o));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(c + 16), _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), f), o));
#else
  for (int j = 0; j < 16; ++j) {
    c[j] = static_cast<int8_t>((qs[j] & 0xF) - off);
    c[j + 16] = static_cast<int8_t>((qs[j] >> 4) - off);
  }
#endif
}

struct Q4_0 {
  static constexpr int QK = 32, BYTES = 18, G = 32;
  static constexpr bool MIN = false;
  static const int8_t* block(const uint8_t* b, int8_t* c, float* s, float*) {
    s[0] = f16(b);
    nibbles16(b + 2, c, 8);
    return c;
  }
};

struct Q4_1 {
  static constexpr int QK = 32, BYTES = 20, G = 32;
  static constexpr bool MIN = true;
  static const int8_t* block(const uint8_t* b, int8_t* c, float* s, float* m) {
    s[0] = f16(b);
    m[0] = f16(b + 2);
    nibbles16(b + 4, c, 0);
    return c;
  }
};

// Q5_0 / Q5_1: the fifth bit of value j is bit j of the 32-bit little-endian qh
inline void fives(const uint8_t* qhp, const uint8_t* qs, int8_t* c, int off) {
  uint32_t qh;
  std::memcpy(&qh, qhp, 4);
  for (int j = 0; j < 16; ++j) {
    c[j] = static_cast<int8_t>(((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - off);
    c[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off);
  }
}

struct Q5_0 {
  static constexpr int QK = 32, BYTES = 22, G = 32;
  static constexpr bool MIN = false;
  static const int8_t* block(const uint8_t* b, int8_t* c, float* s, float*) {
    s[0] = f16(b);
    fives(b + 2, b + 6, c, 16);
    return c;
  }
};

struct Q5_1 {
  static constexpr int QK = 32, BYTES = 24, G = 32;
  static constexpr bool MIN = true;
  static const int8_t* block(const uint8_t* b, int8_t* c, float* s, float* m) {
    s[0] = f16(b);
    m[0] = f16(b + 2);
    fives(b + 4, b + 8, c, 0);
    return c;
  }
};

struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34, G = 32;
  static constexpr bool MIN = false;
  static const int8_t* block(const uint8_t* b, int8_t*, float* s, float*) {
    s[0] = f16(b);
    return reinterpret_cast<const int8_t*>(b + 2);
  }
};

// d, dmin, scales[12], qs[128]: 32 bytes of qs give 32 low nibbles (group 2i), 32 high (2i + 1)
struct Q4_K {
  static constexpr int QK = 256, BYTES = 144, G = 32;
  static constexpr bool MIN = true;
  static const int8_t* block(const uint8_t* b, int8_t* c, float* s, float* m) {
    k4_scales(b, s, m);
    const uint8_t* qs = b + 16;
#if defined(STRATA_BLOCKS_AVX2)
    const __m256i f = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 64 * i), _mm256_and_si256(v, f));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 64 * i + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), f));
    }
#else
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < 32; ++l) {
        c[64 * i + l] = static_cast<int8_t>(qs[32 * i + l] & 0xF);
        c[64 * i + 32 + l] = static_cast<int8_t>(qs[32 * i + l] >> 4);
      }
#endif
    return c;
  }
};

// Q4_K plus qh[32] after the scales: bit g of qh[l] is the fifth bit of value 32 g + l
struct Q5_K {
  static constexpr int QK = 256, BYTES = 176, G = 32;
  static constexpr bool MIN = true;
  static const int8_t* block(const uint8_t* b, int8_t* c, float* s, float* m) {
    k4_scales(b, s, m);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int g = 0; g < 8; ++g)
      for (int l = 0; l < 32; ++l) {
        const int low = (qs[32 * (g / 2) + l] >> (4 * (g % 2))) & 0xF;
        c[32 * g + l] = static_cast<int8_t>(low | (((qh[l] >> g) & 1) << 4));
      }
    return c;
  }
};

// ql[128], qh[64], scales[16] (int8), d. Value r of half h (0..127): low 4 bits from
// ql[64 h + r % 64] >> (4 (r / 64)), high 2 from qh[32 h + r % 32] >> (2 (r / 32)); minus 32.
struct Q6_K {
  static constexpr int QK = 256, BYTES = 210, G = 16;
  static constexpr bool MIN = false;
  static const int8_t* block(const uint8_t* b, int8_t* c, float* s, float*) {
    const float d = f16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int g = 0; g < 16; ++g) s[g] = d * static_cast<float>(sc[g]);
    for (int h = 0; h < 2; ++h) {
      const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
      int8_t* o = c + 128 * h;
#if defined(STRATA_BLOCKS_AVX2)
      const __m256i f = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
      const __m256i lows[4] = {_mm256_and_si256(l0, f), _mm256_and_si256(l1, f),
                               _mm256_and_si256(_mm256_srli_epi16(l0, 4), f),
                               _mm256_and_si256(_mm256_srli_epi16(l1, 4), f)};
      for (int i = 0; i < 4; ++i) {
        const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hv, _mm_cvtsi32_si128(2 * i)), three), 4);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * i), _mm256_sub_epi8(_mm256_or_si256(lows[i], hi), k32));
      }
#else
      for (int r = 0; r < 128; ++r) {
        const int low = (ql[r % 64] >> (4 * (r / 64))) & 0xF, high = (qh[r % 32] >> (2 * (r / 32))) & 3;
        o[r] = static_cast<int8_t>((low | (high << 4)) - 32);
      }
#endif
    }
    return c;
  }
};

// scales[16] (4-bit scale | 4-bit min << 4), qs[64] (2 bits), d, dmin: value = d sc q - dmin mn
struct Q2_K {
  static constexpr int QK = 256, BYTES = 84, G = 16;
  static constexpr bool MIN = true;
  static const int8_t* block(const uint8_t* b, int8_t* c, float* s, float* m) {
    const float d = f16(b + 80), dmin = f16(b + 82);
    for (int g = 0; g < 16; ++g) {
      s[g] = d * static_cast<float>(b[g] & 0xF);
      m[g] = -(dmin * static_cast<float>(b[g] >> 4));
    }
    const uint8_t* qs = b + 16;
    for (int i = 0; i < 256; ++i) {
      const int h = i / 128, r = i % 128;
      c[i] = static_cast<int8_t>((qs[32 * h + r % 32] >> (2 * (r / 32))) & 3);
    }
    return c;
  }
};

// hmask[32] (a clear bit subtracts 4), qs[64] (2 bits), scales[12] (6-bit, minus 32), d
struct Q3_K {
  static constexpr int QK = 256, BYTES = 110, G = 16;
  static constexpr bool MIN = false;
  static const int8_t* block(const uint8_t* b, int8_t* c, float* s, float*) {
    const float d = f16(b + 108);
    const uint8_t* p = b + 96;
    for (int g = 0; g < 16; ++g) {
      const int low = g < 8 ? p[g] & 0xF : p[g - 8] >> 4;
      const int high = (p[8 + g % 4] >> (2 * (g / 4))) & 3;
      s[g] = d * static_cast<float>(static_cast<int8_t>(low | (high << 4)) - 32);
    }
    const uint8_t *hm = b, *qs = b + 32;
    for (int i = 0; i < 256; ++i) {
      const int h = i / 128, r = i % 128;
      const int q = (qs[32 * h + r % 32] >> (2 * (r / 32))) & 3;
      c[i] = static_cast<int8_t>(q - (((hm[i % 32] >> (i / 32)) & 1) ? 0 : 4));
    }
    return c;
  }
};


// How both block kernels share a product among threads: by output rows, never along a row's
// reduction, so a row's bits do not depend on the thread count. The product's M rows of x
// pick the shape: one lane takes weight rows `fly` at a time, 2..few lanes `few_unit` at a
// time, more lanes tiles of `per_tile` decoded rows. A small matrix (under 64 KiB) stays on
// the calling thread: waking a second one costs more than it saves. each(n0, rows) computes
// rows n0 .. n0 + rows - 1 of the output for every x row.
template <class Each>
void split_rows(int64_t N, int64_t row_bytes, int64_t M, int64_t fly, int64_t few, int64_t few_unit,
                int64_t per_tile, Each each) {
  const bool small = N * row_bytes < (1 << 16);
  const int64_t unit = M == 1 ? fly : M <= few ? few_unit : per_tile;
  const int64_t units = (N + unit - 1) / unit;
  const int64_t grain = M > few ? 1 : small ? units + 1 : M == 1 ? 1 : std::max<int64_t>(1, 8 / few_unit);
  at::parallel_for(0, units, grain, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) each(u * unit, std::min(unit, N - u * unit));
  });
}

}  // namespace strata_blocks
