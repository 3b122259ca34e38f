/* Linear layers on GGUF Q8_0 blocks as stored: y = x W^T (+ b), the weights read from memory as
 * stored and widened to float32 in registers (the activations stay float32 or bf16). The int8
 * weights of `--quantization int8` have their own packed kernels (int8_w8a16.c, int8_w8a8.c).
 *
 * A decode step of a few rows reads every weight once and does little arithmetic with it, so its
 * time is the weights' bytes over the memory bandwidth. Each weight row is K/32 blocks of 34 bytes,
 * a float16 scale d then 32 int8 values q, the weight being d * q (ggml's block_q8_0, as llama.cpp
 * stores it). Each block's 32 values are widened and multiplied by d (exact in float32: 11 x 8
 * significant bits) before the multiply-adds, so the result is the float32 product with the
 * dequantized weight up to the order of the sums.
 *
 * The kernel walks tiles of up to MAX_ROWS rows x 4 output channels along K: LANES weights of each
 * of the 4 channels are loaded and widened once and multiplied into every row of the tile, and the
 * 4 channel sums of a row are reduced together (`hsum4`). Threads (OpenMP) take contiguous shares
 * of the output channels; rows go in blocks of ROW_BLOCK, so a block's inputs stay in cache while
 * the thread's channels stream past them. The vector width is the build's (vector_math.h: 16 lanes
 * with AVX-512, 8 with AVX2 + FMA under x86-64-v3, the compiler's plain code elsewhere).
 *
 * Layouts: x [M] rows of K float32 or bf16 (`x_bf16`), `ldx` elements apart; bias float32 [N] or
 * NULL; y [M] rows of N float32 or bf16 (`y_bf16`, rounded to nearest even), `ldy` elements apart.
 * Compiled with the other kernels into one library by kernels/cpu/library.py; wrapped by
 * kernels/cpu/quantized_linear.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

typedef int8_t vb __attribute__((vector_size(LANES)));

/* Row tile: MAX_ROWS x 4 accumulators plus 4 weight vectors and an input vector must stay in
 * registers: 21 of 32 with AVX-512, 13 of 16 with AVX2. */
#if REGISTER_LIGHT
#define MAX_ROWS 2
#else
#define MAX_ROWS 4
#endif
#define CHANNELS 4
#define ROW_BLOCK 32
#define Q8_0_BLOCK 32
#define Q8_0_BYTES 34
#define PREFETCH_TILES 2
/* Below this many multiply-adds a call runs on one thread: waking the pool costs more. */
#define PARALLEL_MIN_MACS (1 << 16)

/* The width of this build's vectors in float lanes (16: AVX-512, 8: AVX2), for the wrappers. */
int int8_linear_lanes(void) { return LANES; }

/* LANES int8 values widened to float32: two instructions (sign extension, conversion) where the
 * build has AVX2 or AVX-512; GCC's generic conversion of the vector type went lane by lane. */
static inline vf load_i8(const int8_t *p) {
#if defined(__AVX512F__) && LANES == 16
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__) && LANES == 8
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
  vb b;
  memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vf);
#endif
}

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) { /* zero or subnormal: mantissa x 2^-24, exact in float32 */
    const float value = (float)mantissa * 5.9604644775390625e-8f;
    return sign ? -value : value;
  }
  if (exponent == 31)
    bits = sign | 0x7f800000u | (mantissa << 13);
  else
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

/* float32 -> bf16, rounded to nearest even as torch rounds; a NaN stays a (quiet) NaN. */
static inline uint16_t float_to_bf16(float value) {
  uint32_t u;
  memcpy(&u, &value, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One tile of Q8_0 blocks: sums[r][j] = sum_k x[r][k] * d * q[j][k] for ROWS rows and the 4 channel
 * rows `w` (a tail tile repeats its last channel), each block's values scaled by its d first. */
#define DEFINE_Q8_0_TILE(ROWS)                                                                        \
  static void q8_0_tile_##ROWS(const float *x, int64_t ldx, const int8_t *const *w, int64_t k,       \
                               int64_t ahead, float sums[][CHANNELS]) {                               \
    vf acc[ROWS][CHANNELS];                                                                           \
    for (int r = 0; r < ROWS; r++)                                                                    \
      for (int j = 0; j < CHANNELS; j++) acc[r][j] = (vf){};                                          \
    for (int64_t b = 0; b < k / Q8_0_BLOCK; b++) {                                                    \
      for (int j = 0; j < CHANNELS; j++) __builtin_prefetch(w[j] + b * Q8_0_BYTES + ahead, 0, 0);     \
      float d[CHANNELS];                                                                              \
      for (int j = 0; j < CHANNELS; j++) {                                                            \
        uint16_t half;                                                                                \
        memcpy(&half, w[j] + b * Q8_0_BYTES, sizeof half);                                            \
        d[j] = half_to_float(half);                                                                   \
      }                                                                                               \
      for (int s = 0; s < Q8_0_BLOCK; s += LANES) {                                                   \
        vf wv[CHANNELS];                                                                              \
        for (int j = 0; j < CHANNELS; j++) wv[j] = load_i8(w[j] + b * Q8_0_BYTES + 2 + s) * d[j];     \
        for (int r = 0; r < ROWS; r++) {                                                              \
          const vf xv = load_f32(x + r * ldx + b * Q8_0_BLOCK + s);                                   \
          for (int j = 0; j < CHANNELS; j++) acc[r][j] += wv[j] * xv;                                 \
        }                                                                                             \
      }                                                                                               \
    }                                                                                                 \
    for (int r = 0; r < ROWS; r++) hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], sums[r]);       \
  }

typedef void (*tile_fn)(const float *, int64_t, const int8_t *const *, int64_t, int64_t, float[][CHANNELS]);

DEFINE_Q8_0_TILE(1)
DEFINE_Q8_0_TILE(2)
#if MAX_ROWS == 4
DEFINE_Q8_0_TILE(3)
DEFINE_Q8_0_TILE(4)
static const tile_fn Q8_0_TILES[MAX_ROWS + 1] = {NULL, q8_0_tile_1, q8_0_tile_2, q8_0_tile_3, q8_0_tile_4};
#else
static const tile_fn Q8_0_TILES[MAX_ROWS + 1] = {NULL, q8_0_tile_1, q8_0_tile_2};
#endif

/* The kernel: x widened to float32 once (a bf16 x into a scratch copy), then every tile. `w` is
 * the first channel's row and `row_bytes` the distance between channels. */
static int run_tiles(const tile_fn *tiles, const void *x, int x_bf16, int64_t ldx, const int8_t *w,
                     int64_t row_bytes, const float *bias, void *y, int y_bf16,
                     int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
  if (m <= 0 || n <= 0) return 0;
  const int parallel = m * n * k >= PARALLEL_MIN_MACS && num_threads > 1;
  const float *xf = (const float *)x;
  float *scratch = NULL;
  if (x_bf16) {
    scratch = malloc((size_t)(m * k) * sizeof(float));
    if (scratch == NULL) return 2;
#pragma omp parallel for num_threads(num_threads) if (parallel && m > 1)
    for (int64_t r = 0; r < m; r++) {
      const uint16_t *row = (const uint16_t *)x + r * ldx;
      for (int64_t p = 0; p < k; p++) {
        const uint32_t bits = (uint32_t)row[p] << 16;
        memcpy(scratch + r * k + p, &bits, sizeof(float));
      }
    }
    xf = scratch;
    ldx = k;
  }
  const int64_t channel_tiles = (n + CHANNELS - 1) / CHANNELS;
  /* Each tile's rows are CHANNELS short streams, too short for the hardware prefetcher to follow
   * from one tile into the next: the weights a tile reads are prefetched PREFETCH_TILES tiles
   * ahead (the next channels, the next bytes of the thread's share of the matrix). */
  const int64_t ahead = PREFETCH_TILES * CHANNELS * row_bytes;
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
    const int64_t t = 0, threads = 1;
#endif
    const int64_t first = channel_tiles * t / threads, last = channel_tiles * (t + 1) / threads;
    for (int64_t block = 0; block < m; block += ROW_BLOCK) {
      const int64_t block_end = block + ROW_BLOCK < m ? block + ROW_BLOCK : m;
      for (int64_t tile = first; tile < last; tile++) {
        const int64_t n0 = tile * CHANNELS, width = n - n0 < CHANNELS ? n - n0 : CHANNELS;
        const int8_t *rows[CHANNELS];
        for (int j = 0; j < CHANNELS; j++) rows[j] = w + (n0 + (j < width ? j : width - 1)) * row_bytes;
        for (int64_t r = block; r < block_end; r += MAX_ROWS) {
          const int64_t count = block_end - r < MAX_ROWS ? block_end - r : MAX_ROWS;
          float sums[MAX_ROWS][CHANNELS];
          tiles[count](xf + r * ldx, ldx, rows, k, ahead, sums);
          for (int64_t i = 0; i < count; i++)
            for (int64_t j = 0; j < width; j++) {
              float value = sums[i][j];
              if (bias) value += bias[n0 + j];
              if (y_bf16)
                ((uint16_t *)y)[(r + i) * ldy + n0 + j] = float_to_bf16(value);
              else
                ((float *)y)[(r + i) * ldy + n0 + j] = value;
            }
        }
      }
    }
  }
  free(scratch);
  return 0;
}

/* y = x W^T (+ bias) on GGUF Q8_0 blocks, W [N][K / 32] blocks of 34 bytes. Returns 0 on success,
 * 1 for a K that is not a positive multiple of 32, 2 when scratch memory could not be had. */
int q8_0_linear(const void *x, int x_bf16, int64_t ldx, const uint8_t *blocks, const float *bias, void *y,
                int y_bf16, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
  if (k < Q8_0_BLOCK || k % Q8_0_BLOCK) return 1;
  const int64_t row_bytes = k / Q8_0_BLOCK * Q8_0_BYTES;
  return run_tiles(Q8_0_TILES, x, x_bf16, ldx, (const int8_t *)blocks, row_bytes, bias, y, y_bf16, ldy, m,
                   n, k, num_threads);
}
