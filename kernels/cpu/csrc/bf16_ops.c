/* Element-wise bfloat16 operations of a decoder layer on the CPU, each one pass over its rows.
 *
 * A decode step multiplies only a few rows, so each torch call costs more in dispatch than in
 * arithmetic: bf16 `F.rms_norm` alone runs about eight ATen operations. Each
 * function here replaces one chain of calls with one call, and rounds to bfloat16 where torch's
 * chain rounds (every torch bf16 operation computes in float32 and rounds its result), so the
 * results are those of the Hugging Face formulas up to the order of a float32 sum.
 *
 * Rows are contiguous `cols` bfloat16 values at `stride` elements apart. Large calls are split over
 * `num_threads` OpenMP threads by rows; small ones (decode steps) stay on the calling thread.
 * Compiled with paged_decode_attention.c into one library by kernels/cpu/library.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "avx512_bf16.h"
#include "cephes_expf.h"

/* Below this many elements a call runs on one thread: waking the pool costs more. */
#define PARALLEL_MIN_ELEMENTS (1 << 16)

static inline float to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays NaN. */
static inline uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return to_f32(to_bf16(f)); }


/* Optionally `hidden += delta` (in place, rounded), then `out = weight * bf16(hidden * rsqrt(mean(
 * hidden^2) + eps))` with the product rounded: Hugging Face's LlamaRMSNorm (Zhang & Sennrich 2019)
 * on a bf16 input, the statistic in float32. `delta` may be NULL. */
void add_rms_norm_bf16(uint16_t *hidden, int64_t hidden_stride, const uint16_t *delta, int64_t delta_stride,
                       const uint16_t *weight, float eps, int64_t rows, int cols, uint16_t *out,
                       int64_t out_stride, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    uint16_t *h = hidden + r * hidden_stride;
#if HAVE_AVX512_BF16_OPS
    {
      const uint16_t *d = delta != NULL ? delta + r * delta_stride : NULL;
      __m512 partial = _mm512_setzero_ps();
      for (int c = 0; c < cols; c += 16) {
        const __mmask16 m = tail_mask(cols - c);
        __m512 x = load16(h + c, m);
        if (d != NULL) {
          x = round16(_mm512_add_ps(x, load16(d + c, m)));
          store16(h + c, m, x);
        }
        partial = _mm512_fmadd_ps(x, x, partial);
      }
      const float inv = 1.f / sqrtf(_mm512_reduce_add_ps(partial) / (float)cols + eps);
      const __m512 scale = _mm512_set1_ps(inv);
      uint16_t *o = out + r * out_stride;
      for (int c = 0; c < cols; c += 16) {
        const __mmask16 m = tail_mask(cols - c);
        store16(o + c, m, _mm512_mul_ps(load16(weight + c, m), round16(_mm512_mul_ps(load16(h + c, m), scale))));
      }
      continue;
    }
#endif
    if (delta != NULL) {
      const uint16_t *d = delta + r * delta_stride;
      for (int c = 0; c < cols; c++) h[c] = to_bf16(to_f32(h[c]) + to_f32(d[c]));
    }
    /* Sixteen running sums, so the compiler can keep them in one vector register. */
    float partial[16] = {0.f};
    int c = 0;
    for (; c + 16 <= cols; c += 16)
      for (int j = 0; j < 16; j++) partial[j] += to_f32(h[c + j]) * to_f32(h[c + j]);
    for (; c < cols; c++) partial[0] += to_f32(h[c]) * to_f32(h[c]);
    float sum = 0.f;
    for (int j = 0; j < 16; j++) sum += partial[j];
    const float inv = 1.f / sqrtf(sum / (float)cols + eps);
    uint16_t *o = out + r * out_stride;
    for (c = 0; c < cols; c++) o[c] = to_bf16(to_f32(weight[c]) * round_bf16(to_f32(h[c]) * inv));
  }
}

/* exp(x) for x <= 0 (cephes_expf.h), about 2 ulp; vectorizable. Below -87.3 (where float32 exp
 * underflows) the result is 0. */
static inline float exp_nonpositive(float x) {
  const int underflow = x < CEPHES_EXPF_MIN_ARG;
  x = underflow ? CEPHES_EXPF_MIN_ARG : x;
  const float n = floorf(x * CEPHES_EXPF_LOG2E + 0.5f);
  const float r = CEPHES_EXPF_REDUCE(x, n);
  int32_t e = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &e, sizeof scale);
  return underflow ? 0.f : CEPHES_EXPF_POLY(r) * scale;
}

/* out = bf16(silu(gate)) * up, rounded: SwiGLU's gate (Shazeer 2020) as torch's bf16 `F.silu(gate)
 * * up`. Each row of `gate_up` holds `cols` gate values, then `cols` up values. */
void silu_mul_bf16(const uint16_t *gate_up, int64_t gate_up_stride, int64_t rows, int cols, uint16_t *out,
                   int64_t out_stride, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    const uint16_t *gate = gate_up + r * gate_up_stride, *up = gate + cols;
    uint16_t *o = out + r * out_stride;
#if HAVE_AVX512_BF16_OPS
    for (int c = 0; c < cols; c += 16) {
      const __mmask16 m = tail_mask(cols - c);
      store16(o + c, m, silu_mul16(load16(gate + c, m), load16(up + c, m)));
    }
    continue;
#endif
    for (int c = 0; c < cols; c++) {
      const float x = to_f32(gate[c]);
      const float e = exp_nonpositive(-fabsf(x)); /* exp(-|x|) never overflows */
      /* One division, not one in each branch: vector division is the loop's slowest instruction
       * and both branches are computed in vector code. */
      const float sigmoid = (x >= 0.f ? 1.f : e) / (1.f + e);
      o[c] = to_bf16(round_bf16(x * sigmoid) * to_f32(up[c]));
    }
  }
}

/* Rotary embedding (RoFormer, Su et al. 2021) as Hugging Face applies it in bf16:
 * bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), with cos/sin already in bf16, for the first
 * `heads` heads of each row of `x` (queries then keys of a fused QKV output). Head h of row r goes to
 * `q_out` (the first `q_heads` heads, rows `q_heads * head_dim` apart) or `k_out` (the rest). */
void rotary_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *sin,
                 int64_t cos_stride, int64_t rows, int q_heads, int k_heads, int head_dim, uint16_t *q_out,
                 uint16_t *k_out, int num_threads) {
  const int half = head_dim / 2, heads = q_heads + k_heads;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    const uint16_t *c = cos + r * cos_stride, *s = sin + r * cos_stride;
    for (int h = 0; h < heads; h++) {
      const uint16_t *restrict in = x + r * x_stride + (int64_t)h * head_dim;
      uint16_t *restrict o = h < q_heads ? q_out + (r * q_heads + h) * head_dim
                                : k_out + (r * k_heads + (h - q_heads)) * head_dim;
#if HAVE_AVX512_BF16_OPS
      for (int d = 0; d < half; d += 16) {
        const __mmask16 m = tail_mask(half - d);
        const __m512 lo = load16(in + d, m), hi = load16(in + half + d, m);
        const __m512 c_lo = load16(c + d, m), c_hi = load16(c + half + d, m);
        const __m512 s_lo = load16(s + d, m), s_hi = load16(s + half + d, m);
        store16(o + d, m, _mm512_sub_ps(round16(_mm512_mul_ps(lo, c_lo)), round16(_mm512_mul_ps(hi, s_lo))));
        store16(o + half + d, m, _mm512_add_ps(round16(_mm512_mul_ps(hi, c_hi)), round16(_mm512_mul_ps(lo, s_hi))));
      }
      continue;
#endif
      for (int d = 0; d < half; d++)
        o[d] = to_bf16(round_bf16(to_f32(in[d]) * to_f32(c[d])) - round_bf16(to_f32(in[d + half]) * to_f32(s[d])));
      for (int d = half; d < head_dim; d++)
        o[d] = to_bf16(round_bf16(to_f32(in[d]) * to_f32(c[d])) + round_bf16(to_f32(in[d - half]) * to_f32(s[d])));
    }
  }
}
