/* W8A16 linear on packed int8 weights (int8_packed.h): y = x W^T (+ b), the activations float32
 * or bf16 (widened to float32), each weight widened to float32 and scaled in registers.
 *
 * The few-row case of a decode step: its time is the weight bytes over the memory bandwidth, so
 * the weights are one sequential stream per thread, read once a call: rows go in tiles of up to
 * W8A16_ROWS inside each strip (the strip stays in cache for the next tile), and the stream is
 * prefetched ahead. A vector of weights holds LANES / 4 channels x 4 consecutive K (the layout's
 * quads), so the input's 4 values at a quad are broadcast to every group of 4 lanes and each lane
 * accumulates its own (channel, k mod 4) products; the 4 partial sums of a channel are added once
 * at the end of K (`reduce_quads`). The group scales are multiplied into the widened weights (one
 * multiply per weight vector, shared by every row of the tile), so the tile needs one set of
 * accumulators whatever the number of groups.
 *
 * Layouts: x [M] rows of K float32 or bf16 (`x_bf16`), `ldx` elements apart; w, scales as in
 * int8_packed.h, `group` the K of a scale group (a positive multiple of 4); bias float32 [N] or
 * NULL; y [M] rows of N float32 or bf16 (`y_bf16`, rounded to nearest even), `ldy` apart.
 * Wrapped by kernels/cpu/quantized_linear.py (`Int8Linear`).
 */
#include <stdlib.h>

#include "int8_packed.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Accumulators: 4 a row (one per quarter of the strip), plus 4 scale vectors, a weight and a
 * broadcast input per row: 4 x 4 + 4 + 1 + 4 = 25 of 32 registers with AVX-512, 2 rows in 16. */
#if REGISTER_LIGHT
#define W8A16_ROWS 2
#else
#define W8A16_ROWS 4
#endif

typedef int8_t vb __attribute__((vector_size(LANES)));

/* LANES int8 values widened to float32: sign extension then conversion. */
static inline vf widen_i8(const int8_t *p) {
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

/* x[0..3] repeated across the vector's groups of 4 lanes. */
static inline vf broadcast_quad(const float *x) {
#if defined(__AVX512F__) && LANES == 16
  return (vf)_mm512_broadcast_f32x4(_mm_loadu_ps(x));
#elif defined(__AVX2__) && LANES == 8
  return (vf)_mm256_broadcast_ps((const __m128 *)x);
#else
  vf v;
  for (int i = 0; i < LANES; i++) v[i] = x[i % QUAD];
  return v;
#endif
}

/* Quarter j of the strip's scales s, each repeated over its channel's 4 lanes. */
static inline vf expand_scales(vf s, int j) {
#define E(c) c, c, c, c
#if LANES == 16
  switch (j) {
  case 0: return __builtin_shufflevector(s, s, E(0), E(1), E(2), E(3));
  case 1: return __builtin_shufflevector(s, s, E(4), E(5), E(6), E(7));
  case 2: return __builtin_shufflevector(s, s, E(8), E(9), E(10), E(11));
  default: return __builtin_shufflevector(s, s, E(12), E(13), E(14), E(15));
  }
#else
  switch (j) {
  case 0: return __builtin_shufflevector(s, s, E(0), E(1));
  case 1: return __builtin_shufflevector(s, s, E(2), E(3));
  case 2: return __builtin_shufflevector(s, s, E(4), E(5));
  default: return __builtin_shufflevector(s, s, E(6), E(7));
  }
#endif
#undef E
}

/* The channel sums of a row's 4 accumulators (quarter j: channels j * LANES / 4 on, 4 lanes each):
 * pairs of lanes added, then pairs of pairs, leaving the LANES channels in order. */
static inline vf reduce_quads(const vf *a) {
#if LANES == 16
#define EVEN 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define ODD 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#else
#define EVEN 0, 2, 4, 6, 8, 10, 12, 14
#define ODD 1, 3, 5, 7, 9, 11, 13, 15
#endif
  const vf ab = __builtin_shufflevector(a[0], a[1], EVEN) + __builtin_shufflevector(a[0], a[1], ODD);
  const vf cd = __builtin_shufflevector(a[2], a[3], EVEN) + __builtin_shufflevector(a[2], a[3], ODD);
  return __builtin_shufflevector(ab, cd, EVEN) + __builtin_shufflevector(ab, cd, ODD);
#undef EVEN
#undef ODD
}

/* One tile: `rows` rows (a constant after inlining) x one strip, the whole K4; the channel sums into
 * out[rows][LANES]. */
static inline __attribute__((always_inline)) void w8a16_tile(const int rows, const float *x, int64_t ldx,
                                                            const int8_t *w, const float *scales,
                                                            int64_t group, int64_t k4, float *out) {
  vf acc[W8A16_ROWS][QUAD];
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < QUAD; j++) acc[r][j] = (vf){};
  for (int64_t g0 = 0; g0 < k4; g0 += group, scales += LANES) {
    const vf s = load_f32(scales);
    vf sv[QUAD];
    for (int j = 0; j < QUAD; j++) sv[j] = expand_scales(s, j);
    const int64_t end = g0 + group < k4 ? g0 + group : k4;
    for (int64_t q = g0; q < end; q += QUAD) {
      const int8_t *wq = w + q * LANES;
      __builtin_prefetch(wq + INT8_PREFETCH_BYTES, 0, 0);
      vf xv[W8A16_ROWS];
      for (int r = 0; r < rows; r++) xv[r] = broadcast_quad(x + r * ldx + q);
      for (int j = 0; j < QUAD; j++) {
        const vf wv = widen_i8(wq + j * LANES) * sv[j];
        for (int r = 0; r < rows; r++) acc[r][j] += wv * xv[r];
      }
    }
  }
  for (int r = 0; r < rows; r++) store_f32(out + r * LANES, reduce_quads(acc[r]));
}

static void run_tile(int64_t rows, const float *x, int64_t ldx, const int8_t *w, const float *scales,
                     int64_t group, int64_t k4, float *out) {
  switch (rows) {
  case 1: w8a16_tile(1, x, ldx, w, scales, group, k4, out); break;
#if W8A16_ROWS == 4
  case 3: w8a16_tile(3, x, ldx, w, scales, group, k4, out); break;
  case 4: w8a16_tile(4, x, ldx, w, scales, group, k4, out); break;
#endif
  default: w8a16_tile(2, x, ldx, w, scales, group, k4, out); break;
  }
}

/* x as float32 rows of K4 (zero padded) where it is bf16 or K is not a multiple of 4; NULL (use x
 * as it is) otherwise, or on no memory (`*failed`). */
static float *padded_input(const void *x, int x_bf16, int64_t ldx, int64_t m, int64_t k, int64_t k4,
                           int parallel, int num_threads, int *failed) {
  *failed = 0;
  if (!x_bf16 && k == k4) return NULL;
  float *copy = malloc((size_t)(m * k4) * sizeof(float));
  if (copy == NULL) {
    *failed = 1;
    return NULL;
  }
#pragma omp parallel for num_threads(num_threads) if (parallel && m > 1)
  for (int64_t r = 0; r < m; r++) {
    for (int64_t p = 0; p < k; p++) copy[r * k4 + p] = int8_input(x, x_bf16, r * ldx + p);
    for (int64_t p = k; p < k4; p++) copy[r * k4 + p] = 0.0f;
  }
  return copy;
}

/* y = x (scales * W)^T (+ bias). Returns 0 on success, 1 for a shape it does not take (K < 1, a
 * group that is not a positive multiple of 4), 2 when scratch memory could not be had. */
int int8_w8a16_linear(const void *x, int x_bf16, int64_t ldx, const int8_t *w, const float *scales, int64_t group,
                      const float *bias, void *y, int y_bf16, int64_t ldy, int64_t m, int64_t n, int64_t k,
                      int num_threads) {
  if (k < 1 || group < QUAD || group % QUAD) return 1;
  if (m <= 0 || n <= 0) return 0;
  const int64_t k4 = (k + QUAD - 1) / QUAD * QUAD, groups = (k4 + group - 1) / group;
  const int64_t strips = (n + LANES - 1) / LANES;
  const int parallel = m * n * k >= INT8_PARALLEL_MIN_MACS && num_threads > 1;
  int failed;
  float *copy = padded_input(x, x_bf16, ldx, m, k, k4, parallel, num_threads, &failed);
  if (failed) return 2;
  const float *xf = copy ? copy : (const float *)x;
  const int64_t ldxf = copy ? k4 : ldx;
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
    const int64_t t = 0, threads = 1;
#endif
    int64_t first, last;
    int8_share(strips, t, threads, &first, &last);
    float out[W8A16_ROWS * LANES];
    for (int64_t block = 0; block < m; block += INT8_ROW_BLOCK) {
      const int64_t block_end = block + INT8_ROW_BLOCK < m ? block + INT8_ROW_BLOCK : m;
      for (int64_t s = first; s < last; s++) {
        const int64_t n0 = s * LANES, width = n - n0 < LANES ? n - n0 : LANES;
        for (int64_t r = block; r < block_end; r += W8A16_ROWS) {
          const int64_t rows = block_end - r < W8A16_ROWS ? block_end - r : W8A16_ROWS;
          run_tile(rows, xf + r * ldxf, ldxf, w + s * k4 * LANES, scales + s * groups * LANES, group, k4, out);
          int8_store_tile(out, rows, width, bias, y, y_bf16, ldy, r, n0);
        }
      }
    }
  }
  free(copy);
  return 0;
}
