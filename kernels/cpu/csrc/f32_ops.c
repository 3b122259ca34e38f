/* Element-wise float32 operations of a decoder layer on the CPU, for the float32 decoder stack
 * (decoder_stack.c): RMSNorm with the residual add, rotary embedding, SiLU-and-multiply.
 *
 * The float32 counterparts of bf16_ops.c. The float32 per-layer path runs torch's ops for these
 * (`batchgen.model.layers`); the results here are the same formulas in float32, up to the order of
 * the RMSNorm's sum and the exp's last bits (cephes_expf.h, about 2 ulp), so they agree with
 * torch's to float32 rounding, not bit for bit. Rows are contiguous `cols` floats at `stride`
 * elements apart; GCC/Clang vector extensions (vector_math.h) give AVX2 or AVX-512 code from the
 * same source. Decode steps (few rows) stay on the calling thread; big calls split rows over
 * `num_threads` OpenMP threads.
 */
#include <math.h>
#include <stdint.h>

#include "vector_math.h"

/* Below this many elements a call runs on one thread: waking the pool costs more. */
#define PARALLEL_MIN_ELEMENTS (1 << 16)

/* Optionally `hidden += delta` (in place), then `out = weight * (hidden * rsqrt(mean(hidden^2) +
 * eps))`: Hugging Face's LlamaRMSNorm (Zhang & Sennrich 2019) in float32. `delta` may be NULL. */
void add_rms_norm_f32(float *hidden, int64_t hidden_stride, const float *delta, int64_t delta_stride,
                      const float *weight, float eps, int64_t rows, int cols, float *out, int64_t out_stride,
                      int num_threads) {
  const int whole = cols / LANES * LANES;
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    float *h = hidden + r * hidden_stride;
    if (delta != NULL) {
      const float *d = delta + r * delta_stride;
      for (int c = 0; c < cols; c++) h[c] += d[c];
    }
    vf partial = {};
    for (int c = 0; c < whole; c += LANES) {
      const vf x = load_f32(h + c);
      partial += x * x;
    }
    float sum = hsum(partial);
    for (int c = whole; c < cols; c++) sum += h[c] * h[c];
    const float inv = 1.f / sqrtf(sum / (float)cols + eps);
    float *o = out + r * out_stride;
    for (int c = 0; c < whole; c += LANES) store_f32(o + c, load_f32(weight + c) * (load_f32(h + c) * inv));
    for (int c = whole; c < cols; c++) o[c] = weight[c] * (h[c] * inv);
  }
}

/* out = silu(gate) * up (SwiGLU's gate, Shazeer 2020), as torch's float32 `F.silu(gate) * up`.
 * Each row of `gate_up` holds `cols` gate values, then `cols` up values. */
void silu_mul_f32(const float *gate_up, int64_t gate_up_stride, int64_t rows, int cols, float *out,
                  int64_t out_stride, int num_threads) {
  const int whole = cols / LANES * LANES;
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    const float *gate = gate_up + r * gate_up_stride, *up = gate + cols;
    float *o = out + r * out_stride;
    for (int c = 0; c < whole; c += LANES) {
      const vf x = load_f32(gate + c);
      const vf e = vexp(vselect(x > 0.f, -x, x)); /* exp(-|x|): never overflows */
      const vf one = (vf){} + 1.f;
      store_f32(o + c, x * (vselect(x >= 0.f, one, e) / (one + e)) * load_f32(up + c));
    }
    for (int c = whole; c < cols; c++) {
      const float x = gate[c], e = expf(-fabsf(x));
      o[c] = x * ((x >= 0.f ? 1.f : e) / (1.f + e)) * up[c];
    }
  }
}

/* Rotary embedding (RoFormer, Su et al. 2021) as Hugging Face applies it: x * cos +
 * rotate_half(x) * sin, for the first `q_heads + k_heads` heads of each row of `x` (queries then
 * keys of a fused QKV output). Head h of row r goes to `q_out` (the first `q_heads` heads, rows
 * `q_heads * head_dim` apart) or `k_out` (the rest). */
void rotary_f32(const float *x, int64_t x_stride, const float *cos, const float *sin, int64_t cos_stride,
                int64_t rows, int q_heads, int k_heads, int head_dim, float *q_out, float *k_out,
                int num_threads) {
  const int half = head_dim / 2, heads = q_heads + k_heads;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    const float *c = cos + r * cos_stride, *s = sin + r * cos_stride;
    for (int h = 0; h < heads; h++) {
      const float *restrict in = x + r * x_stride + (int64_t)h * head_dim;
      float *restrict o = h < q_heads ? q_out + (r * q_heads + h) * head_dim
                                      : k_out + (r * k_heads + (h - q_heads)) * head_dim;
      for (int d = 0; d < half; d++) o[d] = in[d] * c[d] - in[d + half] * s[d];
      for (int d = half; d < head_dim; d++) o[d] = in[d] * c[d] + in[d - half] * s[d];
    }
  }
}
