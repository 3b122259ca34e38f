/* bf16 linear layers on CPUs with AVX512-BF16: y = x W^T + b with float32 accumulation.
 *
 * oneDNN's prepacked bf16 matmul (kernels/cpu/linear.py) streams the weights of decode steps (1-16
 * rows) well below the rate two cores read DRAM at, and gains little from more rows until about 64
 * (measured: docs/benchmarks.md). Here the weight is packed once into
 * strips of 16 output columns whose K dimension is stored in pairs, [N/16][K/2][16][2], so one
 * 64-byte load holds a pair of K values for 16 columns: exactly the operand of VDPBF16PS, which
 * multiplies two bf16 pairs and adds both products to a float32 lane. A tile of up to 6 input rows
 * x 4 strips (or 8 x 3) keeps 24 float32 accumulators in registers; each row's pair of inputs is a
 * broadcast 32-bit load. This is the register-blocked micro-kernel of high-performance GEMM (Goto
 * and van de Geijn, "Anatomy of High-Performance Matrix Multiplication", ACM TOMS 2008), with each
 * thread taking its own share of the strips and prefetching the next strips while it computes.
 * Against oneDNN and torch: `python benchmarks/kernels/linear_bench.py` (measured: docs/benchmarks.md).
 *
 * Layouts: x [M] rows of K bf16, `ldx` elements apart; w_packed [N/16][K/2][16][2] bf16 (packed by
 * kernels/cpu/linear.py); bias float32 [N] or NULL; y [M] rows of N bf16, `ldy` elements apart,
 * rounded to nearest even from the float32 sums. N must be a multiple of 16 and K even.
 * Compiled with the other kernels into one library by kernels/cpu/library.py.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* Tiles keep at most 24 float32 accumulators in registers (plus the strips' weight vectors and a
 * broadcast input: at most 29 of 32 zmm): up to 6 rows x 4 strips or 8 x 3. */
#define MAX_ACCUMULATORS 24
#define MAX_STRIPS 4
#define MAX_TILE_ROWS 8
/* Weight loads are prefetched this many K pairs (64-byte lines per strip) ahead: the hardware
 * prefetcher alone starts over at every strip (measured: docs/benchmarks.md). */
#define PREFETCH_PAIRS 16
/* Below this many multiply-adds a call runs on one thread: waking the pool costs more. */
#define PARALLEL_MIN_MACS (1 << 16)

/* 1 when this build has the kernel (the CPU has AVX512-BF16 and the compiler targeted it), else 0. */
int bf16_linear_available(void) { return HAVE_DPBF16; }

#if HAVE_DPBF16
/* One tile: ROWS input rows x STRIPS strips, the whole K. `w` points at the first strip, whose
 * successors are `strip_stride` elements apart; `bias` and `y` at the tile's first column. At K pair
 * p it prefetches line p of `pf_count` strips, `pf` and then every `pf_stride` elements on. */
#define DEFINE_TILE(ROWS, STRIPS)                                                                     \
  static void tile_##ROWS##_##STRIPS(const uint16_t *x, int64_t ldx, const uint16_t *w,              \
                                     int64_t strip_stride, const float *bias, uint16_t *y,           \
                                     int64_t ldy, int64_t k, const uint16_t *pf, int64_t pf_stride,  \
                                     int pf_count) {                                                 \
    __m512 acc[ROWS][STRIPS];                                                                         \
    for (int r = 0; r < ROWS; r++)                                                                    \
      for (int j = 0; j < STRIPS; j++) acc[r][j] = _mm512_setzero_ps();                               \
    for (int64_t p = 0; p < k / 2; p++) {                                                             \
      for (int i = 0; i < STRIPS; i++)                                                                \
        if (i < pf_count) _mm_prefetch((const char *)(pf + i * pf_stride + p * 32), _MM_HINT_T0);    \
      __m512bh wv[STRIPS];                                                                            \
      for (int j = 0; j < STRIPS; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * strip_stride + p * 32); \
      for (int r = 0; r < ROWS; r++) {                                                                \
        int32_t pair;                                                                                 \
        memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);                                              \
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                                        \
        for (int j = 0; j < STRIPS; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);          \
      }                                                                                               \
    }                                                                                                 \
    for (int r = 0; r < ROWS; r++)                                                                    \
      for (int j = 0; j < STRIPS; j++) {                                                              \
        __m512 v = acc[r][j];                                                                         \
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * j));                               \
        _mm256_storeu_si256((__m256i *)(y + r * ldy + 16 * j), (__m256i)_mm512_cvtneps_pbh(v));       \
      }                                                                                               \
  }

#define DEFINE_TILES_6(S) DEFINE_TILE(1, S) DEFINE_TILE(2, S) DEFINE_TILE(3, S) DEFINE_TILE(4, S) DEFINE_TILE(5, S) DEFINE_TILE(6, S)
#define DEFINE_TILES_8(S) DEFINE_TILES_6(S) DEFINE_TILE(7, S) DEFINE_TILE(8, S)
DEFINE_TILES_8(1)
DEFINE_TILES_8(2)
DEFINE_TILES_8(3)
DEFINE_TILES_6(4)

typedef void (*tile_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, const float *, uint16_t *,
                        int64_t, int64_t, const uint16_t *, int64_t, int);
#define T(R, S) tile_##R##_##S
/* TILES[strips][rows]; NULL past MAX_ACCUMULATORS. */
static const tile_fn TILES[MAX_STRIPS + 1][MAX_TILE_ROWS + 1] = {
    {NULL},
    {NULL, T(1, 1), T(2, 1), T(3, 1), T(4, 1), T(5, 1), T(6, 1), T(7, 1), T(8, 1)},
    {NULL, T(1, 2), T(2, 2), T(3, 2), T(4, 2), T(5, 2), T(6, 2), T(7, 2), T(8, 2)},
    {NULL, T(1, 3), T(2, 3), T(3, 3), T(4, 3), T(5, 3), T(6, 3), T(7, 3), T(8, 3)},
    {NULL, T(1, 4), T(2, 4), T(3, 4), T(4, 4), T(5, 4), T(6, 4)},
};
#undef T
#endif

/* y = x W^T (+ bias). Returns 0 on success; 1 when the kernel is not built here or the shape is
 * not one it takes (N % 16, odd K), with nothing written. Each thread takes a contiguous share of
 * the strips and walks it in groups of 3-4 strips, every row tile of a group before the next group,
 * so a group's weights (16 x 4 x K bf16) are read from memory once and from cache after. */
int bf16_linear(const uint16_t *x, int64_t ldx, const uint16_t *w_packed, const float *bias, uint16_t *y,
                int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
#if HAVE_DPBF16
  if (n % 16 != 0 || k % 2 != 0 || k <= 0) return 1;
  if (m <= 0 || n == 0) return 0;
  const int64_t strips = n / 16, strip_stride = 16 * k;
  /* Up to 8 rows, one tile covers every row (as many strips as the accumulators allow), so each
   * weight is read once, streamed from memory PREFETCH_PAIRS lines ahead. More rows take tiles of
   * 6 rows x 4 strips, and a group of strips is read once per row tile: from memory by the first
   * (for the thread's first group) and from cache by the rest, which meanwhile prefetch the next
   * group, so memory streams while they compute instead of between. The single 8 x 3 tile beats
   * two prefetching tiles at 7-8 rows, and two 6-row tiles beat a 12 x 2 tile at 9-12 rows
   * (measured: docs/benchmarks.md). */
  const int64_t tile_rows = m <= MAX_TILE_ROWS ? m : 6;
  const int64_t group_strips = MAX_ACCUMULATORS / tile_rows < MAX_STRIPS ? MAX_ACCUMULATORS / tile_rows : MAX_STRIPS;
  const int64_t row_tiles = (m + tile_rows - 1) / tile_rows;
#pragma omp parallel num_threads(num_threads) if (m * n * k >= PARALLEL_MIN_MACS)
  {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
    const int64_t t = 0, threads = 1;
#endif
    const int64_t s0 = strips * t / threads, s1 = strips * (t + 1) / threads;
    for (int64_t s = s0; s < s1; s += group_strips) {
      const int64_t group = s1 - s < group_strips ? s1 - s : group_strips;
      const int64_t next = s + group, next_group = s1 - next < group_strips ? s1 - next : group_strips;
      for (int64_t tile = 0; tile < row_tiles; tile++) {
        const int64_t r = tile * tile_rows, rows = m - r < tile_rows ? m - r : tile_rows;
        const uint16_t *pf = w_packed + s * strip_stride + PREFETCH_PAIRS * 32; /* own group, ahead */
        int64_t pf_stride = strip_stride, pf_count = group;
        if (row_tiles > 1 && (s > s0 || tile > 0)) { /* the next group's strips, dealt out over the tiles */
          const int64_t first = s == s0 ? tile - 1 : tile, sharers = s == s0 ? row_tiles - 1 : row_tiles;
          pf = w_packed + (next + first) * strip_stride;
          pf_stride = sharers * strip_stride;
          pf_count = first < next_group ? (next_group - first + sharers - 1) / sharers : 0;
        }
        TILES[group][rows](x + r * ldx, ldx, w_packed + s * strip_stride, strip_stride, bias ? bias + 16 * s : NULL,
                           y + r * ldy + 16 * s, ldy, k, pf, pf_stride, (int)pf_count);
      }
    }
  }
  return 0;
#else
  (void)x, (void)ldx, (void)w_packed, (void)bias, (void)y, (void)ldy, (void)m, (void)n, (void)k, (void)num_threads;
  return 1;
#endif
}
