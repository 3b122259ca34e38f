/* A mixture-of-experts layer's experts in one call: y[t] = sum over t's slots of
 * weight * down[e] @ (SiLU(gate[e] @ x[t]) * (up[e] @ x[t])), for the few tokens an expert gets in
 * a decode step.
 *
 * At 8 tokens a step and top-8 of 128 experts, each of ~52 routed experts gets one or two tokens: the
 * step is ~100 matrix-vector products, each bound by reading its expert's weights. One call per
 * expert and projection (kernels/cpu/moe.py's torch paths) pays a library call, a thread wake-up and
 * a gather or scatter each time; here one call walks all routed experts and reads each weight once
 * for all the tokens routed to it. The weights stay in the model's plain layout (`gate_up` [E][2I][H],
 * gate rows first; `down` [E][H][I]), so torch's paths can run on the same tensors: each output
 * column is a dot product along a contiguous weight row (AVX512-BF16's VDPBF16PS on bf16 where the
 * CPU has it, else float32 FMAs on GCC vectors: AVX2 under x86-64-v3, AVX-512F, NEON).
 *
 * Threads split columns, not experts, so their shares are equal whatever the routing: in the first
 * phase each thread takes a share of every routed expert's I gate/up column pairs and writes
 * SiLU(gate) * up for its columns of each (token, slot) pair; after one barrier, each takes a share of
 * the H output columns, multiplies every pair's activation by its expert's down rows and adds it,
 * scaled by the routing weight, into its own columns of a float32 accumulator: no two threads write
 * the same element, and no reduction follows.
 *
 * Rounding (bf16): the gate and up sums, SiLU(gate), its product with up and each expert's output
 * are rounded to bf16 as torch's bf16 ops round them; the weighted sum over the slots is float32,
 * rounded once. float32 runs in float32 throughout.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "moe_experts.h"
#include "vector_math.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define MOE_DPBF16 1
#else
#define MOE_DPBF16 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* A tile: up to TILE_ROWS (token, slot) rows x TILE_COLS weight rows, each pair's dot product held in
 * a vector accumulator (24 of 32 registers; 8 of 16 where there are 16). */
#if REGISTER_LIGHT
#define TILE_COLS 4
#define TILE_ROWS 2
#else
#define TILE_COLS 8
#define TILE_ROWS 3
#endif
/* Each weight row is prefetched this many bytes ahead of its loads: a tile reads TILE_COLS rows at
 * once, more streams than the hardware prefetcher follows well. */
#define PREFETCH_BYTES 512

/* sums[r][c] = dot(x[r], w[c]) over k elements, for R = 1 .. TILE_ROWS rows. */
typedef void (*dot_tile)(const void *const *x, const void *const *w, int64_t k, float sums[][TILE_COLS]);

static inline float f32_value(float f) { return f; }

/* The float32-FMA tile on GCC vectors, for float32 (LOAD load_f32) or bf16 (load_bf16) rows. */
#define DEFINE_VECTOR_TILE(NAME, T, LOAD, VALUE, R)                                                     \
  static void NAME##_##R(const void *const *xp, const void *const *wp, int64_t k, float sums[][TILE_COLS]) { \
    const T *x[R], *w[TILE_COLS];                                                                       \
    for (int r = 0; r < R; r++) x[r] = (const T *)xp[r];                                                \
    for (int c = 0; c < TILE_COLS; c++) w[c] = (const T *)wp[c];                                        \
    vf acc[R][TILE_COLS];                                                                               \
    memset(acc, 0, sizeof acc);                                                                         \
    int64_t i = 0;                                                                                      \
    for (; i + LANES <= k; i += LANES) {                                                                \
      vf xv[R];                                                                                         \
      for (int r = 0; r < R; r++) xv[r] = LOAD(x[r] + i);                                               \
      for (int c = 0; c < TILE_COLS; c++) {                                                             \
        __builtin_prefetch((const char *)(w[c] + i) + PREFETCH_BYTES, 0, 0);                            \
        const vf wv = LOAD(w[c] + i);                                                                   \
        for (int r = 0; r < R; r++) acc[r][c] += xv[r] * wv;                                            \
      }                                                                                                 \
    }                                                                                                   \
    for (int r = 0; r < R; r++)                                                                         \
      for (int c = 0; c < TILE_COLS; c += 4) hsum4(acc[r][c], acc[r][c + 1], acc[r][c + 2], acc[r][c + 3], &sums[r][c]); \
    for (; i < k; i++)                                                                                  \
      for (int r = 0; r < R; r++)                                                                       \
        for (int c = 0; c < TILE_COLS; c++) sums[r][c] += VALUE(x[r][i]) * VALUE(w[c][i]);              \
  }

#define DEFINE_VECTOR_TILES(NAME, T, LOAD, VALUE)                                                       \
  DEFINE_VECTOR_TILE(NAME, T, LOAD, VALUE, 1) DEFINE_VECTOR_TILE(NAME, T, LOAD, VALUE, 2)
DEFINE_VECTOR_TILES(f32_tile, float, load_f32, f32_value)
DEFINE_VECTOR_TILES(bf16_tile, uint16_t, load_bf16, bf16_value)
#if TILE_ROWS == 3
DEFINE_VECTOR_TILE(f32_tile, float, load_f32, f32_value, 3)
DEFINE_VECTOR_TILE(bf16_tile, uint16_t, load_bf16, bf16_value, 3)
static const dot_tile F32_TILES[TILE_ROWS + 1] = {NULL, f32_tile_1, f32_tile_2, f32_tile_3};
__attribute__((unused)) static const dot_tile BF16_VECTOR_TILES[TILE_ROWS + 1] = {NULL, bf16_tile_1, bf16_tile_2, bf16_tile_3};
#else
static const dot_tile F32_TILES[TILE_ROWS + 1] = {NULL, f32_tile_1, f32_tile_2};
__attribute__((unused)) static const dot_tile BF16_VECTOR_TILES[TILE_ROWS + 1] = {NULL, bf16_tile_1, bf16_tile_2};
#endif

#if MOE_DPBF16
/* The bf16 tile on VDPBF16PS: 32 elements (16 pairs) of a row a step; the last k % 32 through a mask
 * that reads zeros, so any k works. */
/* One 32-element step of a row tile: `m` masks the elements read (zeros past the row's end). */
#define DPBF16_STEP(R, LOAD)                                                                            \
  {                                                                                                     \
    __m512bh xv[R];                                                                                     \
    for (int r = 0; r < R; r++) xv[r] = (__m512bh)LOAD(x[r] + i);                                      \
    for (int c = 0; c < TILE_COLS; c++) {                                                               \
      _mm_prefetch((const char *)(w[c] + i) + PREFETCH_BYTES, _MM_HINT_T0);                             \
      const __m512bh wv = (__m512bh)LOAD(w[c] + i);                                                     \
      for (int r = 0; r < R; r++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv[r], wv);                   \
    }                                                                                                   \
  }
#define TAIL_LOAD(p) _mm512_maskz_loadu_epi16(tail, p)
#define DEFINE_DPBF16_TILE(R)                                                                           \
  static void dpbf16_tile_##R(const void *const *xp, const void *const *wp, int64_t k, float sums[][TILE_COLS]) { \
    const uint16_t *x[R], *w[TILE_COLS];                                                                \
    for (int r = 0; r < R; r++) x[r] = (const uint16_t *)xp[r];                                         \
    for (int c = 0; c < TILE_COLS; c++) w[c] = (const uint16_t *)wp[c];                                 \
    __m512 acc[R][TILE_COLS];                                                                           \
    for (int r = 0; r < R; r++)                                                                         \
      for (int c = 0; c < TILE_COLS; c++) acc[r][c] = _mm512_setzero_ps();                              \
    int64_t i = 0;                                                                                      \
    for (; i + 32 <= k; i += 32) DPBF16_STEP(R, _mm512_loadu_si512)                                     \
    const __mmask32 tail = (__mmask32)((1u << (k - i)) - 1);                                            \
    if (i < k) DPBF16_STEP(R, TAIL_LOAD)                                                                \
    for (int r = 0; r < R; r++)                                                                         \
      for (int c = 0; c < TILE_COLS; c += 4)                                                            \
        hsum4((vf)acc[r][c], (vf)acc[r][c + 1], (vf)acc[r][c + 2], (vf)acc[r][c + 3], &sums[r][c]);     \
  }
DEFINE_DPBF16_TILE(1)
DEFINE_DPBF16_TILE(2)
DEFINE_DPBF16_TILE(3)
static const dot_tile BF16_TILES[TILE_ROWS + 1] = {NULL, dpbf16_tile_1, dpbf16_tile_2, dpbf16_tile_3};
#else
#define BF16_TILES BF16_VECTOR_TILES
#endif

/* Phase 1, columns [c0, c1) of I (multiples of TILE_COLS / 2 but the last): act[s][col] =
 * SiLU(gate) * up of every pair s, for every routed expert. */
static void gate_up_columns(const moe_job *j, int64_t c0, int64_t c1) {
  const int64_t half = TILE_COLS / 2, h = j->hidden, inter = j->inter, es = j->esize;
  for (int64_t e = 0; e < j->num_experts; e++) {
    const int32_t s0 = j->starts[e], s1 = j->starts[e + 1];
    if (s0 == s1) continue;
    const char *we = j->gate_up + e * 2 * inter * h * es;
    for (int64_t col = c0; col < c1; col += half) {
      const void *w[TILE_COLS];
      for (int64_t c = 0; c < half; c++) { /* past the last column: repeat it, the sums unused */
        const int64_t n = col + c < c1 ? col + c : c1 - 1;
        w[c] = we + n * h * es;
        w[half + c] = we + (inter + n) * h * es;
      }
      for (int32_t s = s0; s < s1; s += TILE_ROWS) {
        const int rows = s1 - s < TILE_ROWS ? s1 - s : TILE_ROWS;
        const void *x[TILE_ROWS];
        for (int r = 0; r < rows; r++) x[r] = j->x + (j->pairs[s + r] / j->top_k) * j->ldx * es;
        float sums[TILE_ROWS][TILE_COLS];
        ((const dot_tile *)j->tiles)[rows](x, w, h, sums);
        for (int r = 0; r < rows; r++)
          for (int64_t c = 0; c < half && col + c < c1; c++) {
            float g = sums[r][c], u = sums[r][half + c];
            const int64_t at = (s + r) * inter + col + c;
            if (j->is_bf16) {
              g = round_bf16(g), u = round_bf16(u);
              ((uint16_t *)j->act)[at] = to_bf16(round_bf16(g / (1.f + expf(-g))) * u);
            } else {
              ((float *)j->act)[at] = g / (1.f + expf(-g)) * u;
            }
          }
      }
    }
  }
}

/* Phase 2, output columns [c0, c1) of H: acc[t][col] = sum over t's pairs of weight * down[e] @ act,
 * then out[t][col] = acc[t][col] in the dtype. */
static void down_columns(const moe_job *j, int64_t c0, int64_t c1) {
  const int64_t h = j->hidden, inter = j->inter, es = j->esize;
  for (int64_t e = 0; e < j->num_experts; e++) {
    const int32_t s0 = j->starts[e], s1 = j->starts[e + 1];
    if (s0 == s1) continue;
    const char *we = j->down + e * h * inter * es;
    for (int64_t col = c0; col < c1; col += TILE_COLS) {
      const void *w[TILE_COLS];
      for (int64_t c = 0; c < TILE_COLS; c++) w[c] = we + (col + c < c1 ? col + c : c1 - 1) * inter * es;
      for (int32_t s = s0; s < s1; s += TILE_ROWS) {
        const int rows = s1 - s < TILE_ROWS ? s1 - s : TILE_ROWS;
        const void *x[TILE_ROWS];
        for (int r = 0; r < rows; r++) x[r] = j->act + (s + r) * inter * es;
        float sums[TILE_ROWS][TILE_COLS];
        ((const dot_tile *)j->tiles)[rows](x, w, inter, sums);
        for (int r = 0; r < rows; r++) {
          const int32_t pair = j->pairs[s + r];
          float *acc = j->acc + (pair / j->top_k) * h + col;
          const float weight = j->weights[pair];
          for (int64_t c = 0; c < TILE_COLS && col + c < c1; c++)
            acc[c] += weight * (j->is_bf16 ? round_bf16(sums[r][c]) : sums[r][c]);
        }
      }
    }
  }
}

/* out[t][c0 .. c1) = acc[t][c0 .. c1) in the dtype, for every token. */
static void write_columns(const moe_job *j, int64_t c0, int64_t c1) {
  for (int64_t t = 0; t < j->num_tokens; t++)
    for (int64_t col = c0; col < c1; col++) {
      const float v = j->acc[t * j->hidden + col];
      if (j->is_bf16)
        ((uint16_t *)j->out)[t * j->ldo + col] = to_bf16(v);
      else
        ((float *)j->out)[t * j->ldo + col] = v;
    }
}

/* Counting sort of the (token, slot) pairs by expert: starts [E + 1], pairs [S], cursor [E]
 * scratch. Returns 1 when an id is outside [0, E). */
static int sort_pairs(const int64_t *ids, int64_t pairs_count, int64_t experts, int32_t *starts, int32_t *pairs,
                      int32_t *cursor) {
  memset(starts, 0, (size_t)(experts + 1) * sizeof *starts);
  for (int64_t p = 0; p < pairs_count; p++) {
    if (ids[p] < 0 || ids[p] >= experts) return 1;
    starts[ids[p] + 1]++;
  }
  for (int64_t e = 0; e < experts; e++) starts[e + 1] += starts[e];
  memcpy(cursor, starts, (size_t)experts * sizeof *cursor);
  for (int64_t p = 0; p < pairs_count; p++) pairs[cursor[ids[p]]++] = (int32_t)p;
  return 0;
}

/* This thread's share [*lo, *hi) of `units` units of `unit` elements, clipped to `size`. */
static void share(int64_t units, int64_t unit, int64_t size, int64_t t, int64_t threads, int64_t *lo, int64_t *hi) {
  *lo = units * t / threads * unit;
  *hi = units * (t + 1) / threads * unit;
  if (*hi > size) *hi = size;
}

/* One thread's part of both phases: its share of I, the barrier, its share of H. */
static void run_phases(const moe_job *j, int packed, int64_t t, int64_t threads) {
  const int64_t h = j->hidden, inter = j->inter, half = TILE_COLS / 2;
  int64_t lo, hi;
  if (packed) /* in strips of 16 columns, gate strips two at a time, output strips four */
    share((inter / 16 + 1) / 2, 2, inter / 16, t, threads, &lo, &hi);
  else
    share((inter + half - 1) / half, half, inter, t, threads, &lo, &hi);
  if (lo < hi) (packed ? moe_packed_gate_up : gate_up_columns)(j, lo, hi);
#pragma omp barrier
  if (packed)
    share((h / 16 + 3) / 4, 4, h / 16, t, threads, &lo, &hi), lo *= 16, hi *= 16;
  else
    share((h + TILE_COLS - 1) / TILE_COLS, TILE_COLS, h, t, threads, &lo, &hi);
  if (lo >= hi) return;
  for (int64_t token = 0; token < j->num_tokens; token++) memset(j->acc + token * h + lo, 0, (size_t)(hi - lo) * sizeof(float));
  if (packed)
    moe_packed_down(j, lo / 16, hi / 16);
  else
    down_columns(j, lo, hi);
  write_columns(j, lo, hi);
}

/* The experts of one layer. x [T] rows of H (`ldx` apart), ids int64 [T][top_k] expert ids, weights
 * float32 [T][top_k] routing weights, out [T] rows of H (`ldo` apart); x, the weights and out float32
 * (is_bf16 0) or bf16 (1). The weights: gate_up [E][2I][H] (gate rows first) and down [E][H][I]; or
 * with `packed` (bf16 only, I and H multiples of 16, moe_experts_packed_available()) each expert's
 * packed as [N/16][K/2][16][2]. Workspace: act [T * top_k][I] of the dtype, acc float32 [T][H], lists
 * int32 [2E + 1 + T * top_k]. Returns 0; 1 when an id is out of range, 2 when `packed` does not
 * apply (nothing written to out either way). */
int moe_experts(int is_bf16, int packed, const void *x, int64_t ldx, int64_t num_tokens, int64_t hidden, int64_t inter,
                int64_t num_experts, int top_k, const int64_t *ids, const float *weights, const void *gate_up,
                const void *down, void *act, float *acc, int32_t *lists, void *out, int64_t ldo, int num_threads) {
  if (packed && (!is_bf16 || hidden % 16 || inter % 16 || !moe_experts_packed_available())) return 2;
  int32_t *starts = lists, *cursor = lists + num_experts + 1, *pairs = cursor + num_experts;
  if (sort_pairs(ids, num_tokens * top_k, num_experts, starts, pairs, cursor)) return 1;
  const moe_job job = {is_bf16, top_k, num_experts, num_tokens, hidden, inter, ldx, ldo, is_bf16 ? 2 : 4,
                       x, gate_up, down, weights, starts, pairs, act, acc, out,
                       is_bf16 ? BF16_TILES : F32_TILES};
#pragma omp parallel num_threads(num_threads)
  {
#ifdef _OPENMP
    run_phases(&job, packed, omp_get_thread_num(), omp_get_num_threads());
#else
    run_phases(&job, packed, 0, 1);
#endif
  }
  return 0;
}
