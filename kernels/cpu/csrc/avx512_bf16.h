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
#else
#define HAVE_AVX512_BF16_OPS 0
#endif

#endif
