/* W8A8 linear on packed int8 weights (int8_packed.h): the activations quantized per token to int8
 * once a call, then integer dot products; y = x W^T (+ b) in float32 or bf16.
 *
 * The many-row case, where a float kernel is compute-bound: one VPDPBUSD multiplies 64 byte pairs
 * and adds them into 16 int32 lanes, 4x the multiply-adds of a float32 FMA. Each row r is quantized
 * symmetrically, xs[r] = max |x[r]| / 127 and xq = x * (127 / max |x[r]|) rounded to nearest even
 * (in [-127, 127]). Per weight group the products are summed in int32, exactly (127 * 127 * group
 * fits in int32 for any group up to 133,000, and converts to float32 exactly up to 1,040), then
 * scaled: y[r][n] = xs[r] * sum_g scales[n][g] * sum_{k in g} xq[r][k] q[n][k].
 *
 * VPDPBUSD multiplies unsigned by signed bytes, so the activations go in as u = xq + 128 and the
 * group's 128 * sum q (`comp`, computed at packing) is subtracted from each group sum (the trick of
 * oneDNN's and llama.cpp's int8 kernels). Without AVX512-VNNI, on AVX2 (x86-64-v3: Zen 3, Haswell),
 * VPMADDUBSW multiplies unsigned by signed bytes into int16 pairs, which saturate at 32,767: with
 * u = xq + 128 a pair reaches 2 * 255 * 127. So there the unsigned operand is |q| and the signed
 * one xq with q's sign (VPSIGNB), a pair at most 2 * 127 * 127 = 32,258, and VPMADDWD against ones
 * widens the pairs into int32 (llama.cpp's AVX2 dot products do the same); no compensation.
 *
 * Layouts as int8_w8a16.c; `comp` int32 as in int8_packed.h. Wrapped by
 * kernels/cpu/quantized_linear.py (`Int8W8A8Linear`).
 */
#include <stdlib.h>

#include "int8_packed.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && LANES == 16
#define W8A8_VNNI 1
#define W8A8_ROWS 8 /* 8 int32 + 8 float32 accumulators, a weight and two group vectors: 19 of 32 */
typedef __m512i vint;
typedef __m512 vflt;
#elif defined(__AVX2__) && LANES == 8
#define W8A8_VNNI 0
#define W8A8_ROWS 4 /* 4 + 4 accumulators, the weight, |weight|, ones and two group vectors: 15 of 16 */
typedef __m256i vint;
typedef __m256 vflt;
#else
#define W8A8_ROWS 0 /* neither: the kernel is not offered (int8_w8a8_available) */
#endif

/* 1 when this build has the kernel (AVX512-VNNI with 16 lanes, or AVX2 with 8), else 0. */
int int8_w8a8_available(void) { return W8A8_ROWS > 0; }

/* 1.5 * 2^23: adding and subtracting it rounds a float32 of magnitude below 2^22 to the nearest
 * integer, ties to even, in vector code (the conversion instructions' own rounding is not
 * portable to GCC's generic vectors). */
#define ROUNDING_MAGIC 12582912.0f

/* Row r of x quantized into xq[r][0..k4) (int8, + `offset` as unsigned bytes when offset = 128),
 * its scale into xs[r]. A row of zeros gets scale 0 and all-zero values. */
static void quantize_row(const void *x, int x_bf16, int64_t k, int64_t k4, int offset, uint8_t *xq, float *xs) {
  vf most = (vf){};
  int64_t p = 0;
  for (; p + LANES <= k; p += LANES) {
    const vf v = x_bf16 ? load_bf16((const uint16_t *)x + p) : load_f32((const float *)x + p);
    const vf magnitude = (vf)((vu)v & 0x7fffffffu);
    most = vselect(magnitude > most, magnitude, most);
  }
  float absmax = 0.0f;
  for (int i = 0; i < LANES; i++) absmax = absmax > most[i] ? absmax : most[i];
  for (; p < k; p++) {
    const float v = __builtin_fabsf(int8_input(x, x_bf16, p));
    absmax = absmax > v ? absmax : v;
  }
  const float inverse = absmax > 0.0f ? 127.0f / absmax : 0.0f;
  *xs = absmax / 127.0f;
  for (p = 0; p + LANES <= k; p += LANES) {
      const vf v = x_bf16 ? load_bf16((const uint16_t *)x + p) : load_f32((const float *)x + p);
      const vf rounded = (v * inverse + ROUNDING_MAGIC) - ROUNDING_MAGIC;
      const vi q = __builtin_convertvector(rounded, vi) + offset;
      for (int i = 0; i < LANES; i++) xq[p + i] = (uint8_t)q[i];
    }
  for (; p < k; p++) {
    const float rounded = (int8_input(x, x_bf16, p) * inverse + ROUNDING_MAGIC) - ROUNDING_MAGIC;
    xq[p] = (uint8_t)((int)rounded + offset);
  }
  for (; p < k4; p++) xq[p] = (uint8_t)offset;
}

#if W8A8_ROWS
/* The int32 sums of 4 byte products per lane, added into acc: VPDPBUSD on u = xq + 128, or
 * VPMADDUBSW on |q| and sign-carrying xq then VPMADDWD (see the header). */
static inline vint dot4(vint acc, vint w, vint w_abs, int32_t x_quad) {
#if W8A8_VNNI
  (void)w_abs;
  return _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(x_quad), w);
#else
  const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(_mm256_set1_epi32(x_quad), w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* One tile: `rows` rows (a constant after inlining) x one strip; the sums times xs into out. */
static inline __attribute__((always_inline)) void w8a8_tile(const int rows, const uint8_t *xq, int64_t ldq,
                                                           const float *xs, const int8_t *w, const float *scales,
                                                           const int32_t *comp, int64_t group, int64_t k4,
                                                           float *out) {
  vflt acc[W8A8_ROWS];
  for (int r = 0; r < rows; r++) acc[r] = (vflt){};
  for (int64_t g0 = 0; g0 < k4; g0 += group, scales += LANES, comp += LANES) {
    /* VPDPBUSD's sums start at -comp, so they end at the signed products' sum. */
    vint sums[W8A8_ROWS], start = (vint){};
#if W8A8_VNNI
    memcpy(&start, comp, sizeof start);
    start = _mm512_sub_epi32(_mm512_setzero_si512(), start);
#endif
    for (int r = 0; r < rows; r++) sums[r] = start;
    const int64_t end = g0 + group < k4 ? g0 + group : k4;
    for (int64_t q = g0; q < end; q += QUAD) {
      const int8_t *wq = w + q * LANES;
      __builtin_prefetch(wq + INT8_PREFETCH_BYTES, 0, 0);
      vint wv;
      memcpy(&wv, wq, sizeof wv);
#if W8A8_VNNI
      const vint w_abs = wv;
#else
      const vint w_abs = _mm256_abs_epi8(wv);
#endif
      for (int r = 0; r < rows; r++) {
        int32_t quad;
        memcpy(&quad, xq + r * ldq + q, sizeof quad);
        sums[r] = dot4(sums[r], wv, w_abs, quad);
      }
    }
    vflt s;
    memcpy(&s, scales, sizeof s);
    for (int r = 0; r < rows; r++) acc[r] += (vflt)__builtin_convertvector((vi)sums[r], vf) * s;
  }
  for (int r = 0; r < rows; r++) store_f32(out + r * LANES, (vf)acc[r] * xs[r]);
}

static void run_tile(int64_t rows, const uint8_t *xq, int64_t ldq, const float *xs, const int8_t *w,
                     const float *scales, const int32_t *comp, int64_t group, int64_t k4, float *out) {
  switch (rows) {
  case 1: w8a8_tile(1, xq, ldq, xs, w, scales, comp, group, k4, out); break;
  case 2: w8a8_tile(2, xq, ldq, xs, w, scales, comp, group, k4, out); break;
  case 3: w8a8_tile(3, xq, ldq, xs, w, scales, comp, group, k4, out); break;
#if W8A8_ROWS == 8
  case 4: w8a8_tile(4, xq, ldq, xs, w, scales, comp, group, k4, out); break;
  case 5: w8a8_tile(5, xq, ldq, xs, w, scales, comp, group, k4, out); break;
  case 6: w8a8_tile(6, xq, ldq, xs, w, scales, comp, group, k4, out); break;
  case 7: w8a8_tile(7, xq, ldq, xs, w, scales, comp, group, k4, out); break;
  default: w8a8_tile(8, xq, ldq, xs, w, scales, comp, group, k4, out); break;
#else
  default: w8a8_tile(4, xq, ldq, xs, w, scales, comp, group, k4, out); break;
#endif
  }
}
#endif

/* The strips of this thread, every row (in blocks), into y. */
static void run_share(const uint8_t *xq, int64_t k4, const float *xs, const int8_t *w, const float *scales,
                      const int32_t *comp, int64_t group, const float *bias, void *y, int y_bf16, int64_t ldy,
                      int64_t m, int64_t n, int64_t first, int64_t last) {
#if W8A8_ROWS
  const int64_t groups = (k4 + group - 1) / group;
  float out[W8A8_ROWS * LANES];
  for (int64_t block = 0; block < m; block += INT8_ROW_BLOCK) {
    const int64_t block_end = block + INT8_ROW_BLOCK < m ? block + INT8_ROW_BLOCK : m;
    for (int64_t s = first; s < last; s++) {
      const int64_t n0 = s * LANES, width = n - n0 < LANES ? n - n0 : LANES;
      for (int64_t r = block; r < block_end; r += W8A8_ROWS) {
        const int64_t rows = block_end - r < W8A8_ROWS ? block_end - r : W8A8_ROWS;
        run_tile(rows, xq + r * k4, k4, xs + r, w + s * k4 * LANES, scales + s * groups * LANES,
                 comp + s * groups * LANES, group, k4, out);
        int8_store_tile(out, rows, width, bias, y, y_bf16, ldy, r, n0);
      }
    }
  }
#else
  (void)xq, (void)k4, (void)xs, (void)w, (void)scales, (void)comp, (void)group, (void)bias, (void)y;
  (void)y_bf16, (void)ldy, (void)m, (void)n, (void)first, (void)last;
#endif
}

/* y = xs * (xq (scales * W)^T) (+ bias). Returns 0 on success, 1 where it does not apply (no
 * kernel in this build, K < 1, a group that is not a positive multiple of 4 or over 65,536), 2
 * when scratch memory could not be had. */
int int8_w8a8_linear(const void *x, int x_bf16, int64_t ldx, const int8_t *w, const float *scales,
                     const int32_t *comp, int64_t group, const float *bias, void *y, int y_bf16, int64_t ldy,
                     int64_t m, int64_t n, int64_t k, int num_threads) {
  if (!int8_w8a8_available() || k < 1 || group < QUAD || group % QUAD || group > 65536) return 1;
  if (m <= 0 || n <= 0) return 0;
  const int64_t k4 = (k + QUAD - 1) / QUAD * QUAD, strips = (n + LANES - 1) / LANES;
  const int parallel = m * n * k >= INT8_PARALLEL_MIN_MACS && num_threads > 1;
  uint8_t *xq = malloc((size_t)(m * k4));
  float *xs = malloc((size_t)m * sizeof(float));
  if (xq == NULL || xs == NULL) {
    free(xq);
    free(xs);
    return 2;
  }
#ifdef W8A8_VNNI
  const int offset = W8A8_VNNI ? 128 : 0;
#else
  const int offset = 0;
#endif
  const size_t element = x_bf16 ? 2 : 4;
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
    const int64_t t = 0, threads = 1;
#endif
#pragma omp for
    for (int64_t r = 0; r < m; r++)
      quantize_row((const char *)x + (size_t)(r * ldx) * element, x_bf16, k, k4, offset, xq + r * k4, xs + r);
    int64_t first, last;
    int8_share(strips, t, threads, &first, &last);
    run_share(xq, k4, xs, w, scales, comp, group, bias, y, y_bf16, ldy, m, n, first, last);
  }
  free(xq);
  free(xs);
  return 0;
}
