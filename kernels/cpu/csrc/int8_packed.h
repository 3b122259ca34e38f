/* The packed int8 weight layout shared by int8_w8a16.c and int8_w8a8.c, and their common helpers.
 *
 * A weight W [N][K] of int8 values q with float32 scales per output channel and group of K, and
 * optionally float32 offsets alike (the weight of channel n at k being
 * scales[n][k / group] * q[n][k] + offsets[n][k / group]; no offsets: symmetric, the int8 of
 * `--quantization int8`; offsets: a GGUF Q4_1 or K-quant block's minimum) is packed by
 * kernels/cpu/int8_weight.py into strips of LANES output channels (16 with AVX-512, 8 with AVX2),
 * each strip's K in quads of 4:
 *   w       int8    [ceil(N / LANES)][K4 / 4][LANES][4]   (K4 = K rounded up to 4, zero padded)
 *   scales  float32 [ceil(N / LANES)][groups][LANES]      (groups = ceil(K4 / group); 0 for padding)
 *   offsets float32 [ceil(N / LANES)][groups][LANES]      (or none; 0 for padding: W8A16 only)
 *   comp    int32   [ceil(N / LANES)][groups][LANES]      (128 * the sum of the group's q: W8A8)
 * One quad row of a strip is 4 * LANES bytes: a 64-byte line with AVX-512, exactly the operand of
 * VPDPBUSD (4 products of a lane's 4 bytes, summed into one int32 lane per output channel). A
 * thread's strips are contiguous, so its weights are one sequential stream, read once a call
 * however many rows there are: the kernels take the rows in tiles inside each strip, and the
 * strip (K4 * LANES bytes: 9-24 KiB for the default model) stays in the core's cache between them.
 */
#ifndef BATCHGEN_INT8_PACKED_H
#define BATCHGEN_INT8_PACKED_H

#include <stdint.h>
#include <string.h>

#include "vector_math.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QUAD 4
/* Rows of the input kept hot in cache while a thread's strips stream past them. */
#define INT8_ROW_BLOCK 64
/* Weights are prefetched this many bytes ahead of the quad being read (a thread's share is one
 * stream, so this reaches into the next strip as a strip ends). */
#define INT8_PREFETCH_BYTES 1024
/* Below this many multiply-adds a call runs on one thread: waking the pool costs more. */
#define INT8_PARALLEL_MIN_MACS (1 << 16)

/* float32 -> bf16, rounded to nearest even as torch rounds; a NaN stays a (quiet) NaN. */
static inline uint16_t int8_float_to_bf16(float value) {
  uint32_t u;
  memcpy(&u, &value, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One input element as float32 (`bf16`: x holds bf16 bits). */
static inline float int8_input(const void *x, int bf16, int64_t index) {
  if (!bf16) return ((const float *)x)[index];
  const uint32_t bits = (uint32_t)((const uint16_t *)x)[index] << 16;
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

/* A finished tile: rows x `width` channel sums (`out`, LANES apart) plus bias into y. */
static inline void int8_store_tile(const float *out, int64_t rows, int64_t width, const float *bias, void *y,
                                   int y_bf16, int64_t ldy, int64_t row0, int64_t n0) {
  if (width == LANES) { /* a whole strip: vector stores */
    const vf b = bias ? load_f32(bias + n0) : (vf){};
    for (int64_t r = 0; r < rows; r++) {
      const vf value = load_f32(out + r * LANES) + b;
      if (y_bf16)
        store_bf16((uint16_t *)y + (row0 + r) * ldy + n0, value);
      else
        store_f32((float *)y + (row0 + r) * ldy + n0, value);
    }
    return;
  }
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < width; c++) {
      const float value = out[r * LANES + c] + (bias ? bias[n0 + c] : 0.0f);
      if (y_bf16)
        ((uint16_t *)y)[(row0 + r) * ldy + n0 + c] = int8_float_to_bf16(value);
      else
        ((float *)y)[(row0 + r) * ldy + n0 + c] = value;
    }
}

/* The strips [first, last) of `strips` that thread `t` of `threads` takes. */
static inline void int8_share(int64_t strips, int64_t t, int64_t threads, int64_t *first, int64_t *last) {
  *first = strips * t / threads;
  *last = strips * (t + 1) / threads;
}

#endif
