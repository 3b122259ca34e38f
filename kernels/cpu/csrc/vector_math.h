/* Vector helpers shared by the CPU attention kernels (paged_decode_attention.c,
 * paged_prefill_attention.c): the lane count, float32 / bfloat16 loads and stores, horizontal sums,
 * block prefetches and a vector exp. GCC/Clang vector extensions, so -march=native picks the width:
 * 16 float lanes (AVX-512, NEON), or 8 on an x86 CPU with AVX2 but no AVX-512 (REGISTER_LIGHT:
 * 16 vector registers instead of 32, so the kernels keep fewer values in registers there). */
#ifndef BATCHGEN_VECTOR_MATH_H
#define BATCHGEN_VECTOR_MATH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cephes_expf.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
#define LANES 8
#define REGISTER_LIGHT 1 /* loops written for 16 vector registers */
#else
#define LANES 16
#define REGISTER_LIGHT 0
#endif
#define MAX_GROUP 16 /* query heads per KV head */

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2)));

static inline vf load_f32(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store_f32(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* bfloat16 is the top half of a float32: widening is a shift. */
static inline vf load_bf16(const uint16_t *p) {
  vh h;
  memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}

/* Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays NaN. */
static inline void store_bf16(uint16_t *p, vf v) {
  vu u = (vu)v;
  vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
  vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  vh h = __builtin_convertvector((rounded & ~nan) | (((u >> 16) | 0x40u) & nan), vh);
  memcpy(p, &h, sizeof h);
}

#if LANES == 16
static inline float hsum(vf v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

/* The lane sums of four vectors at once (a 4 x 16 transpose-and-add): about 3.5 vector operations a
 * sum instead of 8. Per-row horizontal sums were the kernel's bottleneck before this. */
static inline void hsum4(vf a, vf b, vf c, vf d, float *out) {
  vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
          __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
          __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  vf u = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  u += __builtin_shufflevector(u, u, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  u += __builtin_shufflevector(u, u, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  out[0] = u[0];
  out[1] = u[4];
  out[2] = u[8];
  out[3] = u[12];
}
#else
static inline float hsum(vf v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v[0];
}

/* hsum4 for 8 lanes: halves of a and b side by side, then quarters, then pairs. */
static inline void hsum4(vf a, vf b, vf c, vf d, float *out) {
  vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
          __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
          __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
  /* u = [a a c c b b d d] partial sums */
  vf u = __builtin_shufflevector(ab, cd, 0, 1, 8, 9, 4, 5, 12, 13) +
         __builtin_shufflevector(ab, cd, 2, 3, 10, 11, 6, 7, 14, 15);
  u += __builtin_shufflevector(u, u, 1, 0, 3, 2, 5, 4, 7, 6);
  out[0] = u[0];
  out[1] = u[4];
  out[2] = u[2];
  out[3] = u[6];
}
#endif

/* Ask for the next block while this one is computed: blocks sit anywhere in the pool, so the
 * hardware prefetcher cannot guess where the next one starts. The callers spread a block's
 * prefetches over the KV heads of the current one: issued all at once, they stalled on the
 * core's few outstanding-miss slots (measured: docs/benchmarks.md). */
static inline void prefetch_block(const void *block, size_t bytes) {
  for (size_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch((const char *)block + offset, 0, 1);
}

static inline vf vselect(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }

/* exp(x) for the x <= 0 of a softmax after its maximum is subtracted (cephes_expf.h), in vector
 * form; about 2 ulp. glibc's vector expf is only offered under -ffast-math, which would change the
 * whole process's float flags. Below -87.3 (where float32 exp underflows) the result is 0. */
#if defined(__AVX512F__) && LANES == 16
#include <immintrin.h>
/* AVX-512 has single instructions for the floor (VRNDSCALEPS) and for p * 2^n (VSCALEFPS, here
 * zeroing the underflowed lanes too): 19 instructions a vector instead of 28, with results
 * identical to the generic form below (n >= -126 after the clamp, so 2^n is a normal float). */
/* vexp in the lanes of `keep` and 0 in the others, whatever they hold (a causal mask folded into
 * the final scaling). */
static inline vf vexp_where(vf x, __mmask16 keep) {
  const __m512 min_arg = _mm512_set1_ps(CEPHES_EXPF_MIN_ARG);
  const __mmask16 underflow = _mm512_cmp_ps_mask((__m512)x, min_arg, _CMP_LT_OQ);
  x = (vf)_mm512_mask_mov_ps((__m512)x, underflow, min_arg);
  const vf n = (vf)_mm512_roundscale_ps((__m512)(x * CEPHES_EXPF_LOG2E + 0.5f), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const vf r = CEPHES_EXPF_REDUCE(x, n);
  return (vf)_mm512_maskz_scalef_ps(keep & (__mmask16)~underflow, (__m512)CEPHES_EXPF_POLY(r), (__m512)n);
}

static inline vf vexp(vf x) { return vexp_where(x, 0xffff); }
#else
static inline vf vexp(vf x) {
  const vi underflow = x < CEPHES_EXPF_MIN_ARG;
  x = vselect(underflow, (vf){} + CEPHES_EXPF_MIN_ARG, x);
  vf fx = x * CEPHES_EXPF_LOG2E + 0.5f;
  vf n = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
  n += __builtin_convertvector(n > fx, vf); /* truncation -> floor: the mask is -1 where n > fx */
  const vf r = CEPHES_EXPF_REDUCE(x, n);
  const vf scale = (vf)((__builtin_convertvector(n, vi) + 127) << 23);
  return vselect(underflow, (vf){}, CEPHES_EXPF_POLY(r) * scale);
}
#endif

/* The kernel variant PREFIX_bf16_D or PREFIX_f32_D for the head sizes the kernels are compiled for
 * (16, 32, 64, 128); NULL for any other. Used as a function body. */
#define RETURN_HEAD_DIM_VARIANT(PREFIX, is_bf16, head_dim)                                            \
  switch (head_dim) {                                                                                  \
  case 16:                                                                                             \
    return (is_bf16) ? PREFIX##_bf16_16 : PREFIX##_f32_16;                                             \
  case 32:                                                                                             \
    return (is_bf16) ? PREFIX##_bf16_32 : PREFIX##_f32_32;                                             \
  case 64:                                                                                             \
    return (is_bf16) ? PREFIX##_bf16_64 : PREFIX##_f32_64;                                             \
  case 128:                                                                                            \
    return (is_bf16) ? PREFIX##_bf16_128 : PREFIX##_f32_128;                                           \
  }                                                                                                    \
  return NULL;

#endif
