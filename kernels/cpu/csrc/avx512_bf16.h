/* AVX-512 helpers for bfloat16 rows, shared by the element-wise kernels (bf16_ops.c) and the AMX
 * prefill attention (amx_prefill_attention.c). 16 float32 lanes a vector; a row's last `n % 16`
 * values go through the same vector code under a mask (`tail_mask`), so a value's result never
 * depends on where it sits in its row. Conversions to bf16 are the hardware's VCVTNEPS2BF16, which
 * rounds to nearest even as torch does (NaNs stay NaNs, with another payload).
 *
 * HAVE_AVX512_BF16_OPS is 1 where the compiler targets AVX-512 F/BW and AVX512-BF16, else 0 (and
 * nothing else is defined).
 */
#ifndef BATCHGEN_AVX512_BF16_H
#define BATCHGEN_AVX512_BF16_H

#include <stdint.h>

#include "cephes_expf.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512_BF16_OPS 1

static inline __mmask16 tail_mask(int remaining) {
  return remaining >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << remaining) - 1);
}

/* 16 bf16 values (lanes outside `m` read as 0) -> float32. */
static inline __m512 load16(const uint16_t *p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline __m256i to_bf16_16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

static inline void store16(uint16_t *p, __mmask16 m, __m512 v) { _mm256_mask_storeu_epi16(p, m, to_bf16_16(v)); }

/* float32 -> rounded to bf16 -> float32: a torch bf16 operation's result, back in float32. */
static inline __m512 round16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_16(v)), 16));
}

/* exp(x) for x <= 0 (cephes_expf.h), about 2 ulp; below -87.3, where float32 exp underflows, 0. */
static inline __m512 exp_nonpositive16(__m512 x) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(CEPHES_EXPF_MIN_ARG), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(CEPHES_EXPF_MIN_ARG));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(CEPHES_EXPF_LOG2E), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = CEPHES_EXPF_REDUCE(x, n);
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 value = _mm512_mul_ps(CEPHES_EXPF_POLY(r), _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(~underflow, value);
}
/* In-place transpose of a 16 x 16 matrix of 32-bit words held as 16 rows: 64 shuffles (pairs of
 * words, then of 64-bit halves, then two rounds of 128-bit lanes). */
static inline __attribute__((always_inline)) void transpose_16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  /* u[4g + c], 128-bit lane L: column 4L + c of rows 4g .. 4g + 3 */
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; c++) {
    const __m512i even_lo = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), odd_lo = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i even_hi = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88),
                  odd_hi = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(even_lo, even_hi, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(even_lo, even_hi, 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0xdd);
  }
}
#else
#define HAVE_AVX512_BF16_OPS 0
#endif

#endif
