/* W8A16 linear on packed int8 weights (int8_packed.h): y = x W^T (+ b), the activations float32
 * or bf16 (widened to float32), each weight widened to float32 and scaled in registers.
 *
 * The few-row case of a decode step: its time is the weight bytes over the memory bandwidth, so
 * the weights are one sequential stream per thread, read once a call: rows go in tiles of up to
 * W8A16_ROWS inside each strip (the strip stays in cache for the next tile), and the stream is
 * prefetched ahead. A vector of weights holds LANES / 4 channels x 4 consecutive K (the layout's
 * quads), so the input's 4 values at a quad are broadcast to every group of 4 lanes and each lane
 * accumulates its own (channel, k mod 4) products; the 4 partial sums of a channel are added once
 * at the end of K (`reduce_quads`). Those 4 accumulators a row fill the registers at 2 rows (AVX2)
 * or 4 (AVX-512); more rows go in half-strip tiles (`w8a16_halves`), 2 accumulators a row, so each
 * weight is widened once per 5 rows (AVX2) or 12 (AVX-512) rather than once per 2 or 4. The group scales are multiplied into the widened weights, and a
 * group's offset added in the same instruction (one multiply-add per weight vector, shared by every
 * row of the tile; a zero offset for a symmetric weight, so both cost the same), so the tile needs one
 * set of accumulators whatever the number of groups.
 *
 * With bf16 activations on a CPU with AVX512-BF16, `bf16_dot` runs tiles of up to 8 rows through
 * VDPBF16PS instead (`dp_tile`): the scaled weights rounded to bf16 in registers, two products a
 * lane an instruction, so from a few rows on the widening and the multiply-adds cost about half.
 * The registry times both as candidates ("int8_c", "int8_c_dpbf16").
 *
 * Layouts: x [M] rows of K float32 or bf16 (`x_bf16`), `ldx` elements apart; w, scales and
 * offsets (NULL: a symmetric weight) as in int8_packed.h, `group` the K of a scale group (a positive
 * multiple of 4); bias float32 [N] or
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

/* Group g's offsets of a strip (`offsets` as the scales, or NULL for a symmetric weight: zeros). */
static inline vf group_offsets(const float *offsets, int64_t g) {
  return offsets ? load_f32(offsets + g * LANES) : (vf){};
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
                                                            const float *offsets, int64_t group, int64_t k4,
                                                            float *out) {
  vf acc[W8A16_ROWS][QUAD];
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < QUAD; j++) acc[r][j] = (vf){};
  for (int64_t g = 0, g0 = 0; g0 < k4; g++, g0 += group) {
    const vf s = load_f32(scales + g * LANES), o = group_offsets(offsets, g);
    vf sv[QUAD], ov[QUAD];
    for (int j = 0; j < QUAD; j++) sv[j] = expand_scales(s, j), ov[j] = expand_scales(o, j);
    const int64_t end = g0 + group < k4 ? g0 + group : k4;
    for (int64_t q = g0; q < end; q += QUAD) {
      const int8_t *wq = w + q * LANES;
      __builtin_prefetch(wq + INT8_PREFETCH_BYTES, 0, 0);
      vf xv[W8A16_ROWS];
      for (int r = 0; r < rows; r++) xv[r] = broadcast_quad(x + r * ldx + q);
      for (int j = 0; j < QUAD; j++) {
        const vf wv = widen_i8(wq + j * LANES) * sv[j] + ov[j];
        for (int r = 0; r < rows; r++) acc[r][j] += wv * xv[r];
      }
    }
  }
  for (int r = 0; r < rows; r++) store_f32(out + r * LANES, reduce_quads(acc[r]));
}

/* Rows of a half-strip tile: 2 accumulators a row, plus 2 weight and 2 scale vectors and a
 * broadcast input: 5 x 2 + 5 = 15 of 16 registers with AVX2, 12 x 2 + 5 = 29 of 32 with AVX-512. */
#if REGISTER_LIGHT
#define W8A16_HALF_ROWS 5
#else
#define W8A16_HALF_ROWS 12
#endif

/* Half `half` of a strip (quarters 2 half and 2 half + 1) for `rows` rows (a constant after
 * inlining), the whole K4, into acc[r][2 half..2 half + 1]. A tile of more rows than `w8a16_tile`
 * holds: that one widens every weight once per W8A16_ROWS rows (its 4 accumulators a row fill the
 * registers), this one once per W8A16_HALF_ROWS, each input quad broadcast twice instead. Each
 * accumulator takes the same products in the same order as in `w8a16_tile`, so a row's result does
 * not depend on the tile it ran in (nor on the batch around it). */
static inline __attribute__((always_inline)) void w8a16_half_tile(const int rows, const int half, const float *x,
                                                                 int64_t ldx, const int8_t *w, const float *scales,
                                                                 const float *offsets, int64_t group, int64_t k4,
                                                                 vf acc[][QUAD]) {
  vf part[W8A16_HALF_ROWS][2];
#pragma GCC unroll 16
  for (int r = 0; r < rows; r++) part[r][0] = part[r][1] = (vf){};
  for (int64_t g = 0, g0 = 0; g0 < k4; g++, g0 += group) {
    const vf s = load_f32(scales + g * LANES), o = group_offsets(offsets, g);
    const vf s0 = expand_scales(s, 2 * half), s1 = expand_scales(s, 2 * half + 1);
    const vf o0 = expand_scales(o, 2 * half), o1 = expand_scales(o, 2 * half + 1);
    const int64_t end = g0 + group < k4 ? g0 + group : k4;
    for (int64_t q = g0; q < end; q += QUAD) {
      const int8_t *wq = w + q * LANES + 2 * half * LANES;
      __builtin_prefetch(wq + INT8_PREFETCH_BYTES, 0, 0);
      const vf w0 = widen_i8(wq) * s0 + o0, w1 = widen_i8(wq + LANES) * s1 + o1;
#pragma GCC unroll 16
      for (int r = 0; r < rows; r++) {
        const vf xv = broadcast_quad(x + r * ldx + q);
        part[r][0] += w0 * xv;
        part[r][1] += w1 * xv;
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < rows; r++) {
    acc[r][2 * half] = part[r][0];
    acc[r][2 * half + 1] = part[r][1];
  }
}

/* `rows` rows in two half-strip tiles, the channel sums into out[rows][LANES]. */
static inline __attribute__((always_inline)) void w8a16_halves(const int rows, const float *x, int64_t ldx,
                                                              const int8_t *w, const float *scales,
                                                              const float *offsets, int64_t group, int64_t k4,
                                                              float *out) {
  vf acc[W8A16_HALF_ROWS][QUAD];
  w8a16_half_tile(rows, 0, x, ldx, w, scales, offsets, group, k4, acc);
  w8a16_half_tile(rows, 1, x, ldx, w, scales, offsets, group, k4, acc);
  for (int r = 0; r < rows; r++) store_f32(out + r * LANES, reduce_quads(acc[r]));
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && LANES == 16
#define W8A16_DPBF16 1
#define DP_ROWS 8 /* 16 accumulators, 4 weight and 4 scale vectors, 2 bf16 operands, the input: 27 */
/* One tile of bf16 rows with VDPBF16PS: each quad's scaled weights rounded to bf16 (to nearest
 * even, the very bf16 weight the float layouts of the layer hold) and paired as the instruction
 * takes them: lane L of `lo` holds channel L / 2's k0,k1 (L even) or k2,k3 (L odd), `hi` channels
 * 8-15 alike, so the input's 4 bf16 values at the quad are one 64-bit broadcast, and a channel's
 * sum is its two lanes added at the end. Two products a lane an instruction: half the multiply
 * instructions of the float32 tile, whose widening is shared by up to 8 rows instead of 4. */
static inline __attribute__((always_inline)) void dp_tile(const int rows, const uint16_t *x, int64_t ldx,
                                                         const int8_t *w, const float *scales, const float *offsets,
                                                         int64_t group, int64_t k4, float *out) {
  __m512 acc[DP_ROWS][2];
  for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0, g0 = 0; g0 < k4; g++, g0 += group) {
    const vf s = load_f32(scales + g * LANES), o = group_offsets(offsets, g);
    vf sv[QUAD], ov[QUAD];
    for (int j = 0; j < QUAD; j++) sv[j] = expand_scales(s, j), ov[j] = expand_scales(o, j);
    const int64_t end = g0 + group < k4 ? g0 + group : k4;
    for (int64_t q = g0; q < end; q += QUAD) {
      const int8_t *wq = w + q * LANES;
      __builtin_prefetch(wq + INT8_PREFETCH_BYTES, 0, 0);
      vf f[QUAD];
      for (int j = 0; j < QUAD; j++) f[j] = widen_i8(wq + j * LANES) * sv[j] + ov[j];
      const __m512bh lo = _mm512_cvtne2ps_pbh((__m512)f[1], (__m512)f[0]);
      const __m512bh hi = _mm512_cvtne2ps_pbh((__m512)f[3], (__m512)f[2]);
      for (int r = 0; r < rows; r++) {
        long long bits;
        memcpy(&bits, x + r * ldx + q, sizeof bits);
        const __m512bh xv = (__m512bh)_mm512_set1_epi64(bits);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], lo, xv);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], hi, xv);
      }
    }
  }
#define EVEN 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define ODD 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
  for (int r = 0; r < rows; r++) {
    const vf a = (vf)acc[r][0], b = (vf)acc[r][1];
    store_f32(out + r * LANES, __builtin_shufflevector(a, b, EVEN) + __builtin_shufflevector(a, b, ODD));
  }
#undef EVEN
#undef ODD
}
#else
#define W8A16_DPBF16 0
#define DP_ROWS 1
#endif

/* The tile of `rows` rows: `dp` (bf16 input, W8A16_DPBF16 built) through `dp_tile`, else the
 * float32 one. */
static void run_tile(int dp, int64_t rows, const void *x, int64_t ldx, const int8_t *w, const float *scales,
                     const float *offsets, int64_t group, int64_t k4, float *out) {
#if W8A16_DPBF16
  if (dp) {
    const uint16_t *xb = x;
    switch (rows) {
    case 1: dp_tile(1, xb, ldx, w, scales, offsets, group, k4, out); return;
    case 2: dp_tile(2, xb, ldx, w, scales, offsets, group, k4, out); return;
    case 3: dp_tile(3, xb, ldx, w, scales, offsets, group, k4, out); return;
    case 4: dp_tile(4, xb, ldx, w, scales, offsets, group, k4, out); return;
    case 5: dp_tile(5, xb, ldx, w, scales, offsets, group, k4, out); return;
    case 6: dp_tile(6, xb, ldx, w, scales, offsets, group, k4, out); return;
    case 7: dp_tile(7, xb, ldx, w, scales, offsets, group, k4, out); return;
    default: dp_tile(8, xb, ldx, w, scales, offsets, group, k4, out); return;
    }
  }
#else
  (void)dp;
#endif
  const float *xf = x;
  switch (rows) {
  case 1: w8a16_tile(1, xf, ldx, w, scales, offsets, group, k4, out); return;
  case 2: w8a16_tile(2, xf, ldx, w, scales, offsets, group, k4, out); return;
#if W8A16_ROWS == 4
  case 3: w8a16_tile(3, xf, ldx, w, scales, offsets, group, k4, out); return;
  case 4: w8a16_tile(4, xf, ldx, w, scales, offsets, group, k4, out); return;
#else
  case 3: w8a16_halves(3, xf, ldx, w, scales, offsets, group, k4, out); return;
  case 4: w8a16_halves(4, xf, ldx, w, scales, offsets, group, k4, out); return;
#endif
  case 5: w8a16_halves(5, xf, ldx, w, scales, offsets, group, k4, out); return;
#if W8A16_HALF_ROWS == 12
  case 6: w8a16_halves(6, xf, ldx, w, scales, offsets, group, k4, out); return;
  case 7: w8a16_halves(7, xf, ldx, w, scales, offsets, group, k4, out); return;
  case 8: w8a16_halves(8, xf, ldx, w, scales, offsets, group, k4, out); return;
  case 9: w8a16_halves(9, xf, ldx, w, scales, offsets, group, k4, out); return;
  case 10: w8a16_halves(10, xf, ldx, w, scales, offsets, group, k4, out); return;
  case 11: w8a16_halves(11, xf, ldx, w, scales, offsets, group, k4, out); return;
  default: w8a16_halves(12, xf, ldx, w, scales, offsets, group, k4, out); return;
#else
  default: w8a16_halves(5, xf, ldx, w, scales, offsets, group, k4, out); return;
#endif
  }
}

/* x as rows of K4 (zero padded) where the tiles cannot read it as it is: bf16 rows when `dp` and K
 * is not a multiple of 4, float32 rows when x is bf16 without `dp` or K is not a multiple of 4;
 * NULL (use x as it is) otherwise, or on no memory (`*failed`). */
static void *padded_input(const void *x, int x_bf16, int dp, int64_t ldx, int64_t m, int64_t k, int64_t k4,
                          int parallel, int num_threads, int *failed) {
  *failed = 0;
  if ((dp || !x_bf16) && k == k4) return NULL;
  void *copy = malloc((size_t)(m * k4) * (dp ? sizeof(uint16_t) : sizeof(float)));
  if (copy == NULL) {
    *failed = 1;
    return NULL;
  }
#pragma omp parallel for num_threads(num_threads) if (parallel && m > 1)
  for (int64_t r = 0; r < m; r++) {
    if (dp) {
      uint16_t *row = (uint16_t *)copy + r * k4;
      memcpy(row, (const uint16_t *)x + r * ldx, (size_t)k * sizeof(uint16_t));
      for (int64_t p = k; p < k4; p++) row[p] = 0;
      continue;
    }
    float *row = (float *)copy + r * k4;
    for (int64_t p = 0; p < k; p++) row[p] = int8_input(x, x_bf16, r * ldx + p);
    for (int64_t p = k; p < k4; p++) row[p] = 0.0f;
  }
  return copy;
}

/* The width of this build's vectors in float lanes (16: AVX-512, 8: AVX2), for the wrappers: the
 * strips' width of the packed layout (int8_packed.h). */
int int8_linear_lanes(void) { return LANES; }

/* 1 when this build has the VDPBF16PS tiles (AVX512-BF16 with 16 lanes), else 0. */
int int8_w8a16_bf16_dot_available(void) { return W8A16_DPBF16; }

/* y = x (scales * W + offsets)^T (+ bias); `bf16_dot`: bf16 x through the VDPBF16PS tiles (the weights
 * rounded to bf16), else the float32 ones. Returns 0 on success, 1 for a shape or mode it does not
 * take (K < 1, a group that is not a positive multiple of 4, `bf16_dot` without bf16 x or without
 * the tiles in this build), 2 when scratch memory could not be had. */
int int8_w8a16_linear(const void *x, int x_bf16, int bf16_dot, int64_t ldx, const int8_t *w, const float *scales,
                      const float *offsets, int64_t group, const float *bias, void *y, int y_bf16, int64_t ldy, int64_t m, int64_t n,
                      int64_t k, int num_threads) {
  if (k < 1 || group < QUAD || group % QUAD) return 1;
  if (bf16_dot && !(x_bf16 && W8A16_DPBF16)) return 1;
  if (m <= 0 || n <= 0) return 0;
  const int64_t k4 = (k + QUAD - 1) / QUAD * QUAD, groups = (k4 + group - 1) / group;
  const int64_t strips = (n + LANES - 1) / LANES;
  const int parallel = m * n * k >= INT8_PARALLEL_MIN_MACS && num_threads > 1;
  const int dp = bf16_dot;
  const int64_t tile_rows = dp ? DP_ROWS : W8A16_HALF_ROWS, element = dp ? 2 : 4;
  int failed;
  void *copy = padded_input(x, x_bf16, dp, ldx, m, k, k4, parallel, num_threads, &failed);
  if (failed) return 2;
  const char *xs = copy ? copy : x;
  const int64_t ldxs = copy ? k4 : ldx;
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
    const int64_t t = 0, threads = 1;
#endif
    int64_t first, last;
    int8_share(strips, t, threads, &first, &last);
    float out[(DP_ROWS > W8A16_HALF_ROWS ? DP_ROWS : W8A16_HALF_ROWS) * LANES];
    for (int64_t block = 0; block < m; block += INT8_ROW_BLOCK) {
      const int64_t block_end = block + INT8_ROW_BLOCK < m ? block + INT8_ROW_BLOCK : m;
      for (int64_t s = first; s < last; s++) {
        const int64_t n0 = s * LANES, width = n - n0 < LANES ? n - n0 : LANES;
        for (int64_t r = block; r < block_end; r += tile_rows) {
          const int64_t rows = block_end - r < tile_rows ? block_end - r : tile_rows;
          run_tile(dp, rows, xs + r * ldxs * element, ldxs, w + s * k4 * LANES, scales + s * groups * LANES,
                   offsets ? offsets + s * groups * LANES : NULL, group, k4, out);
          int8_store_tile(out, rows, width, bias, y, y_bf16, ldy, r, n0);
        }
      }
    }
  }
  free(copy);
  return 0;
}
