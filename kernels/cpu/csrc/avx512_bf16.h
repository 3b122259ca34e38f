/* AVX-512 helpers for bfloat16 rows, shared by the element-wise kernels (bf16_ops.c), the AMX
 * linear's SwiGLU store (amx_linear.c) and the AMX prefill attention (amx_prefill_attention.c). 16 float32 lanes a vector; a row's last `n % 16`
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

/* 2^t for t <= 0: t = n + f with n = round(t) and f in [-0.5, 0.5], 2^f by its degree-6 Taylor
 * polynomial in f ln 2 (truncation error under 1.3e-7 relative, about Cephes' 2 ulp; degree 5, at
 * 2.4e-6, flipped enough bf16 roundings of SiLU to fail its one-ulp test), times 2^n by VSCALEFPS.
 * Below -125 the result is 0, set by a mask (so -inf and NaN give 0): a result below float32's
 * normal range would cost a microcode assist per instruction on Intel cores (measured:
 * docs/benchmarks.md). About 12 instructions a vector against 17 for Cephes' exp (cephes_expf.h)
 * with its two-part range reduction. */
static inline __m512 exp2_nonpositive16(__m512 t) {
  const __m512 least = _mm512_set1_ps(-125.f);
  const __mmask16 normal = _mm512_cmp_ps_mask(t, least, _CMP_GE_OQ);
  t = _mm512_max_ps(t, least);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 poly = _mm512_set1_ps(1.5403530393e-4f); /* ln(2)^k / k!, k = 6 .. 0 */
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.3333558146e-3f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(9.6181291076e-3f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(5.5504108665e-2f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(2.4022650696e-1f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(6.9314718056e-1f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(normal, poly, n);
}

/* SwiGLU's gate (Shazeer 2020) as torch's bf16 `F.silu(gate) * up` on values already rounded to bf16:
 * round(silu(gate)) * up in float32, for the caller's one rounding. silu(x) = x / (1 + exp(-x)) as
 * x * sigmoid(x) with exp(-|x|) (never overflows) and one division for both signs. */
static inline __m512 silu_mul16(__m512 gate, __m512 up) {
  const __m512 e = exp2_nonpositive16(_mm512_mul_ps(_mm512_abs_ps(gate), _mm512_set1_ps(-1.44269504088896341f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __mmask16 positive = _mm512_cmp_ps_mask(gate, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 sigmoid = _mm512_div_ps(_mm512_mask_mov_ps(e, positive, one), _mm512_add_ps(one, e));
  return _mm512_mul_ps(round16(_mm512_mul_ps(gate, sigmoid)), up);
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
