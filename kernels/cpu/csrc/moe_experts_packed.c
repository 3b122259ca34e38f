/* The experts kernel (moe_experts.c) on bf16 weights packed as batchgen's bf16 linear packs them
 * (bf16_linear.c: each expert's [N][K] weight as [N/16][K/2][16][2], strips of 16 output columns
 * with K in pairs), on CPUs with AVX512-BF16.
 *
 * The plain layout's dot products read TILE_COLS weight rows side by side and sum each across its
 * vector at the end; here one 64-byte load is a pair of K values for 16 columns, the operand of
 * VDPBF16PS with a broadcast pair of one row's inputs, so a tile of up to 6 rows x 4 strips keeps
 * its 24 accumulators as whole output vectors and streams 4 strips, each prefetched ahead: the
 * pattern of bf16_linear.c, which read the experts' weights faster than the plain layout's dot
 * products did at one thread (measured: docs/benchmarks.md). SiLU(gate) * up and the weighted
 * accumulation run on those vectors directly.
 */
#include "moe_experts.h"

#include "avx512_bf16.h"

#if HAVE_AVX512_BF16_OPS
#define PACKED_TILE_ROWS 6
#define PACKED_MAX_STRIPS 4
#define PREFETCH_PAIRS 16 /* 64-byte lines of a strip ahead of its loads */

/* sums[r][16 j .. 16 j + 15] = x[r] . columns of strip j, over k (even) values. */
typedef void (*packed_tile)(const uint16_t *const *x, const uint16_t *const *w, int64_t k, float *sums);

#define DEFINE_PACKED_TILE(ROWS, STRIPS)                                                                \
  static void packed_##ROWS##_##STRIPS(const uint16_t *const *x, const uint16_t *const *w, int64_t k,   \
                                       float *sums) {                                                  \
    __m512 acc[ROWS][STRIPS];                                                                           \
    for (int r = 0; r < ROWS; r++)                                                                      \
      for (int j = 0; j < STRIPS; j++) acc[r][j] = _mm512_setzero_ps();                                 \
    for (int64_t p = 0; p < k / 2; p++) {                                                               \
      __m512bh wv[STRIPS];                                                                              \
      for (int j = 0; j < STRIPS; j++) {                                                                \
        _mm_prefetch((const char *)(w[j] + (p + PREFETCH_PAIRS) * 32), _MM_HINT_T0);                    \
        wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + p * 32);                                            \
      }                                                                                                 \
      for (int r = 0; r < ROWS; r++) {                                                                  \
        int32_t pair;                                                                                   \
        memcpy(&pair, x[r] + 2 * p, sizeof pair);                                                       \
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                                          \
        for (int j = 0; j < STRIPS; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);            \
      }                                                                                                 \
    }                                                                                                   \
    for (int r = 0; r < ROWS; r++)                                                                      \
      for (int j = 0; j < STRIPS; j++) _mm512_storeu_ps(sums + (r * PACKED_MAX_STRIPS + j) * 16, acc[r][j]); \
  }
#define DEFINE_PACKED_ROWS(S)                                                                           \
  DEFINE_PACKED_TILE(1, S) DEFINE_PACKED_TILE(2, S) DEFINE_PACKED_TILE(3, S) DEFINE_PACKED_TILE(4, S)   \
  DEFINE_PACKED_TILE(5, S) DEFINE_PACKED_TILE(6, S)
DEFINE_PACKED_ROWS(1)
DEFINE_PACKED_ROWS(2)
DEFINE_PACKED_ROWS(3)
DEFINE_PACKED_ROWS(4)
#define ROW_TILES(S) {NULL, packed_1_##S, packed_2_##S, packed_3_##S, packed_4_##S, packed_5_##S, packed_6_##S}
/* TILES[strips][rows] */
static const packed_tile TILES[PACKED_MAX_STRIPS + 1][PACKED_TILE_ROWS + 1] = {
    {NULL}, ROW_TILES(1), ROW_TILES(2), ROW_TILES(3), ROW_TILES(4)};

int moe_experts_packed_available(void) { return 1; }

/* Gate strips [s0, s1) (two at a time, with their up strips I/16 further): act = SiLU(gate) * up. */
void moe_packed_gate_up(const moe_job *j, int64_t s0, int64_t s1) {
  const int64_t h = j->hidden, inter = j->inter, strip = 16 * h, gate_strips = inter / 16;
  float sums[PACKED_TILE_ROWS * PACKED_MAX_STRIPS * 16];
  for (int64_t e = 0; e < j->num_experts; e++) {
    const int32_t first = j->starts[e], last = j->starts[e + 1];
    if (first == last) continue;
    const uint16_t *we = (const uint16_t *)j->gate_up + e * 2 * inter * h;
    for (int64_t s = s0; s < s1; s += 2) {
      const int half = s1 - s < 2 ? 1 : 2;
      const uint16_t *w[PACKED_MAX_STRIPS];
      for (int q = 0; q < half; q++) w[q] = we + (s + q) * strip, w[half + q] = we + (gate_strips + s + q) * strip;
      for (int32_t row = first; row < last; row += PACKED_TILE_ROWS) {
        const int rows = last - row < PACKED_TILE_ROWS ? last - row : PACKED_TILE_ROWS;
        const uint16_t *x[PACKED_TILE_ROWS];
        for (int r = 0; r < rows; r++) x[r] = (const uint16_t *)j->x + (j->pairs[row + r] / j->top_k) * j->ldx;
        TILES[2 * half][rows](x, w, h, sums);
        for (int r = 0; r < rows; r++)
          for (int q = 0; q < half; q++) {
            const float *at = sums + r * PACKED_MAX_STRIPS * 16;
            const __m512 gate = round16(_mm512_loadu_ps(at + 16 * q)), up = round16(_mm512_loadu_ps(at + 16 * (half + q)));
            store16((uint16_t *)j->act + (row + r) * inter + 16 * (s + q), 0xffff, silu_mul16(gate, up));
          }
      }
    }
  }
}

/* Output strips [s0, s1) (four at a time): acc[token] += weight * round(down[e] @ act[pair]). */
void moe_packed_down(const moe_job *j, int64_t s0, int64_t s1) {
  const int64_t h = j->hidden, inter = j->inter, strip = 16 * inter;
  float sums[PACKED_TILE_ROWS * PACKED_MAX_STRIPS * 16];
  for (int64_t e = 0; e < j->num_experts; e++) {
    const int32_t first = j->starts[e], last = j->starts[e + 1];
    if (first == last) continue;
    const uint16_t *we = (const uint16_t *)j->down + e * h * inter;
    for (int64_t s = s0; s < s1; s += PACKED_MAX_STRIPS) {
      const int strips = s1 - s < PACKED_MAX_STRIPS ? (int)(s1 - s) : PACKED_MAX_STRIPS;
      const uint16_t *w[PACKED_MAX_STRIPS];
      for (int q = 0; q < strips; q++) w[q] = we + (s + q) * strip;
      for (int32_t row = first; row < last; row += PACKED_TILE_ROWS) {
        const int rows = last - row < PACKED_TILE_ROWS ? last - row : PACKED_TILE_ROWS;
        const uint16_t *x[PACKED_TILE_ROWS];
        for (int r = 0; r < rows; r++) x[r] = (const uint16_t *)j->act + (row + r) * inter;
        TILES[strips][rows](x, w, inter, sums);
        for (int r = 0; r < rows; r++) {
          const int32_t pair = j->pairs[row + r];
          const __m512 weight = _mm512_set1_ps(j->weights[pair]);
          float *acc = j->acc + (pair / j->top_k) * h + 16 * s;
          for (int q = 0; q < strips; q++) {
            const __m512 y = round16(_mm512_loadu_ps(sums + (r * PACKED_MAX_STRIPS + q) * 16));
            _mm512_storeu_ps(acc + 16 * q, _mm512_fmadd_ps(weight, y, _mm512_loadu_ps(acc + 16 * q)));
          }
        }
      }
    }
  }
}
#else
int moe_experts_packed_available(void) { return 0; }
void moe_packed_gate_up(const moe_job *j, int64_t s0, int64_t s1) { (void)j, (void)s0, (void)s1; }
void moe_packed_down(const moe_job *j, int64_t s0, int64_t s1) { (void)j, (void)s0, (void)s1; }
#endif
