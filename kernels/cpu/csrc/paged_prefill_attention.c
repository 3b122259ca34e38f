/* Paged causal attention on the CPU for prefill chunks: each query row attends to its sequence's
 * cached context up to and including its own position.
 *
 * torch's CPU flash attention runs the default model's shapes (9 query heads over 3 KV heads of 64,
 * one call per sequence) in bf16 at a fraction of the model's linear layers' rate, so prefill spent
 * as long in attention as in the linears (measured: docs/benchmarks.md). Here a work item is one
 * KV head of a tile of TILE_POS query positions of one sequence: the tile's rows (TILE_POS
 * positions x the head's GQA group) are kept in float32 and walked over the context in chunks of
 * KEY_CHUNK keys with an online softmax (FlashAttention, Dao et al. 2022, arXiv:2205.14135); each
 * chunk's K is transposed into a float32 buffer once and used by every row of the tile, so both
 * products are small register-blocked matrix products. K/V are read in place through the block
 * table (PagedAttention, Kwon et al. 2023, arXiv:2309.06180), the chunk's own K/V included (the
 * backend stores them first), so a chunk that continues a cached prefix needs no gather. On a CPU
 * with AVX512-BF16 the bf16 products run on its pair dot products (USE_DPBF16 below).
 * Against torch's SDPA: `python benchmarks/kernels/cpu_prefill_attention_bench.py` (measured:
 * docs/benchmarks.md).
 *
 * Layouts (row-major, contiguous):
 *   query, out         [num_query_rows, num_q_heads, HEAD_DIM]; sequence b's rows are
 *                      query_starts[b] .. query_starts[b + 1] - 1, its last positions
 *   k_cache, v_cache   [num_blocks, block_size, num_kv_heads, HEAD_DIM]
 *   block_tables       int32 [num_seqs, table_stride]
 *   seq_lens           int32 [num_seqs], context length after this chunk (>= its query rows)
 * Arithmetic is float32 whatever the storage type (float32 or bfloat16).
 * Compiled and loaded at run time by kernels/cpu/library.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx512_bf16.h"
#include "vector_math.h"

/* paged_decode_attention.c: the sequences of at most max_rows query rows, walked once each. */
int paged_short_chunk_attention(int is_bf16, const void *query, const void *k_cache, const void *v_cache,
                                const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                                const int32_t *query_starts, int num_seqs, int num_q_heads, int num_kv_heads,
                                int head_dim, int block_size, float scale, void *out, int num_threads, int max_rows,
                                int window, const float *sinks);
int short_chunk_rows(int short_chunks, int is_bf16, int head_dim, int group, int limit);

/* Chunks of up to this many query rows go to `paged_short_chunk_attention`, which is as fast as
 * this kernel's tiles or faster up to there on the default model's shapes
 * (`benchmarks/kernels/verify_attention_bench.py`; measured: docs/benchmarks.md). */
#ifndef SHORT_CHUNK_ROWS
#define SHORT_CHUNK_ROWS 8
#endif

#if defined(__AVX512BF16__) && LANES == 16 && HAVE_AVX512_BF16_OPS
#define USE_DPBF16 1
#else
#define USE_DPBF16 0
#endif

/* Tile sizes; each can be overridden with -D to tune (measured: docs/benchmarks.md). */
#ifndef TILE_POS
#define TILE_POS 32 /* query positions per work item */
#endif
#ifndef KEY_CHUNK_VECTORS
#define KEY_CHUNK_VECTORS 8 /* 2 and 4 pay more softmax bookkeeping a key */
#endif
#define KEY_CHUNK (KEY_CHUNK_VECTORS * LANES) /* keys per step of the online softmax */
#define NVK KEY_CHUNK_VECTORS
#ifndef SCORE_ROWS
#define SCORE_ROWS 6 /* rows per score micro-kernel pass: 6 x SCORE_COLS accumulators */
#endif
#ifndef SCORE_COLS
#define SCORE_COLS 2 /* key vectors per score micro-kernel pass */
#endif
#ifndef PV_ROWS
#define PV_ROWS (REGISTER_LIGHT ? 2 : 6) /* rows per output micro-kernel pass */
#endif
#define PV_COLS 4 /* output vectors per pass: PV_ROWS x PV_COLS accumulators + PV_COLS V vectors */

typedef struct {
  const void *query, *k_cache, *v_cache;
  const int32_t *block_tables, *seq_lens, *query_starts;
  int64_t table_stride, row_stride, block_stride;
  int num_q_heads, num_kv_heads, group, block_size;
  float scale;
  void *out;
  int window; /* > 0: each row sees only the `window` keys up to its position (sliding window) */
  const float *sinks; /* [num_q_heads] sink logits joining each row's denominator only, or NULL */
} PrefillArgs;

typedef struct {
  int seq, head, first; /* tile's first query row within its sequence's chunk */
  int64_t keys;         /* the context up to the tile's last row */
  int64_t work;         /* keys the tile reads (fewer in a window), for ordering */
} Item;

/* Per-thread buffers, float32: the tile's queries and outputs [rows][D], the chunk's scores
 * [rows][KEY_CHUNK], K transposed [D][KEY_CHUNK], V [KEY_CHUNK][D], and per-row softmax state. */
typedef struct {
  float *q, *o, *s, *kt, *v, *m, *l, *alpha;
  uint32_t *qb, *ktp, *vp, *pb; /* the bf16 path's views: bf16 pairs as 32-bit words */
} Scratch;

static inline __attribute__((always_inline)) float load_elem(const void *p, int64_t i, int is_bf16) {
  if (is_bf16) {
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
  }
  return ((const float *)p)[i];
}

static inline __attribute__((always_inline)) vf load_vec(const void *p, int64_t i, int is_bf16) {
  return is_bf16 ? load_bf16((const uint16_t *)p + i) : load_f32((const float *)p + i);
}

static inline __attribute__((always_inline)) void store_vec(void *p, int64_t i, vf v, int is_bf16) {
  if (is_bf16)
    store_bf16((uint16_t *)p + i, v);
  else
    store_f32((float *)p + i, v);
}

static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

/* The largest lane, by halving (as hsum). */
static inline float hmax(vf v) {
#if LANES == 16
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#else
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
#endif
  return v[0];
}

/* K transposed and V of one chunk, in float32 (`kt` [D][KEY_CHUNK], `v` [KEY_CHUNK][D]); K past
 * the context is zero (its scores are masked), V past it is never read. */
static inline __attribute__((always_inline)) void stage_chunk_f32(const PrefillArgs *a, Scratch *w,
                                                                  const int32_t *table, int h, int64_t c0,
                                                                  int kc, const int D, const int is_bf16) {
  const int NVD = D / LANES;
  for (int j = 0; j < KEY_CHUNK; j++) {
    if (j >= kc) {
      for (int d = 0; d < D; d++) w->kt[d * KEY_CHUNK + j] = 0.f;
      continue;
    }
    const int64_t key = c0 + j;
    const int64_t at = (int64_t)table[key / a->block_size] * a->block_stride +
                       (key % a->block_size) * a->row_stride + (int64_t)h * D;
    for (int d = 0; d < D; d++) w->kt[d * KEY_CHUNK + j] = load_elem(a->k_cache, at + d, is_bf16);
    for (int d = 0; d < NVD; d++) store_f32(w->v + j * D + d * LANES, load_vec(a->v_cache, at + d * LANES, is_bf16));
  }
}

#if USE_DPBF16
/* The bf16 products on AVX512-BF16: VDPBF16PS multiplies pairs of bf16 exactly and adds both
 * products to a float32 lane, twice the work of a float32 FMA per instruction. Its operands pair
 * adjacent elements of the reduced dimension, so K is staged as pairs of head dimensions per key
 * (`ktp` [D/2][KEY_CHUNK]) and V as pairs of keys per head dimension (`vp` [KEY_CHUNK/2][D]); the
 * queries stay bf16 (`qb`), the probabilities are rounded to bf16 (`pb`) as in FlashAttention's
 * bf16 kernels, and their row sums are taken before that rounding. */
static inline vf dot_pairs(vf acc, vu a, vu b) {
  return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
}

static inline __attribute__((always_inline)) void stage_chunk_pairs(const PrefillArgs *a, Scratch *w,
                                                                    const int32_t *table, int h, int64_t c0,
                                                                    int kc, const int D) {
  const uint16_t *kc_ = a->k_cache, *vc_ = a->v_cache;
  if ((D / 2) % 16 == 0) {
    /* K in blocks of 16 keys x 16 pairs, each transposed in registers (far fewer instructions
     * than a word at a time); only the key vectors the scores read, keys past the context zero. */
    const int used = (kc + LANES - 1) / LANES * LANES;
    for (int j0 = 0; j0 < used; j0 += 16) {
      const uint16_t *rows[16];
      for (int i = 0; i < 16; i++) {
        const int64_t key = c0 + j0 + i;
        rows[i] = j0 + i < kc ? kc_ + (int64_t)table[key / a->block_size] * a->block_stride +
                                    (key % a->block_size) * a->row_stride + (int64_t)h * D
                              : NULL;
      }
      for (int p0 = 0; p0 < D / 2; p0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = rows[i] ? _mm512_loadu_si512(rows[i] + 2 * p0) : _mm512_setzero_si512();
        transpose_16x16(r);
        for (int p = 0; p < 16; p++) _mm512_storeu_si512(w->ktp + (p0 + p) * KEY_CHUNK + j0, r[p]);
      }
    }
  } else
  for (int j = 0; j < KEY_CHUNK; j++) {
    if (j >= kc) { /* zero K, and a zero partner for an odd last key's V (its probability is 0) */
      for (int p = 0; p < D / 2; p++) w->ktp[p * KEY_CHUNK + j] = 0;
      continue;
    }
    const int64_t key = c0 + j;
    const int64_t at = (int64_t)table[key / a->block_size] * a->block_stride +
                       (key % a->block_size) * a->row_stride + (int64_t)h * D;
    uint32_t pairs[64];
    memcpy(pairs, kc_ + at, (size_t)D * 2);
    for (int p = 0; p < D / 2; p++) w->ktp[p * KEY_CHUNK + j] = pairs[p];
  }
  for (int j = 0; j < kc; j += 2) {
    const int64_t key = c0 + j;
    const uint16_t *v0 = vc_ + (int64_t)table[key / a->block_size] * a->block_stride +
                         (key % a->block_size) * a->row_stride + (int64_t)h * D;
    const uint16_t *v1 = j + 1 < kc ? vc_ + (int64_t)table[(key + 1) / a->block_size] * a->block_stride +
                                          ((key + 1) % a->block_size) * a->row_stride + (int64_t)h * D
                                    : NULL;
    for (int d = 0; d < D; d += LANES) {
      vh lo, hi = (vh){};
      memcpy(&lo, v0 + d, sizeof lo);
      if (v1) memcpy(&hi, v1 + d, sizeof hi);
      const vu pair = __builtin_convertvector(lo, vu) | (__builtin_convertvector(hi, vu) << 16);
      memcpy(w->vp + (j / 2) * D + d, &pair, sizeof pair);
    }
  }
}

static inline vu broadcast_u32(uint32_t x) { return (vu){} + x; }

/* The largest lane of each of four vectors, as hsum4 (vector_math.h) does sums. */
static inline void hmax4(const vf v[4], float *out) {
  vf ab = vmax(__builtin_shufflevector(v[0], v[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
               __builtin_shufflevector(v[0], v[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));
  vf cd = vmax(__builtin_shufflevector(v[2], v[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
               __builtin_shufflevector(v[2], v[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));
  vf u = vmax(__builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
              __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31));
  u = vmax(u, __builtin_shufflevector(u, u, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  u = vmax(u, __builtin_shufflevector(u, u, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  out[0] = u[0];
  out[1] = u[4];
  out[2] = u[8];
  out[3] = u[12];
}

/* The online-softmax step of one chunk on the bf16 dot-product path, four rows at a time: each
 * row's maximum in one pass over its scores, the four horizontal maxima and sums together, then
 * exp(score * scale - max) in a second pass (one FMA for the argument; the causal mask and exp's
 * underflow in its final scaling), rounded to bf16 pairs into `pb`; the row sums, `alpha` (one
 * vector exp for the four rows) and the running maximum update `l`, `alpha` and `m`. Written this
 * way because the one-row-at-a-time loop kept its scores on the stack and waited on each row's
 * chain of horizontal reductions (measured: docs/benchmarks.md). */
static inline __attribute__((always_inline)) void softmax_pairs(Scratch *w, int rows, int kv_used, int masked,
                                                                int first_pos, int n, int64_t c0, float scale,
                                                                int window) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int r0 = 0; r0 < rows; r0 += 4) {
    int row[4];
    __m512i last_key[4], first_key[4]; /* the row's last and first visible keys, relative to the chunk */
    vf mx[4];
    for (int i = 0; i < 4; i++) {
      row[i] = r0 + i < rows ? r0 + i : r0; /* past the end: a repeat of the first, not stored */
      last_key[i] = _mm512_set1_epi32(masked ? first_pos + row[i] % n - (int)c0 : KEY_CHUNK);
      first_key[i] = _mm512_set1_epi32(masked && window > 0 ? first_pos + row[i] % n - window + 1 - (int)c0 : -1);
      const float *s = w->s + row[i] * KEY_CHUNK;
      __m512 m = _mm512_set1_ps(-INFINITY);
      for (int j = 0; j < kv_used; j++) {
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(j * LANES));
        const __mmask16 keep = _mm512_cmple_epi32_mask(key, last_key[i]) & _mm512_cmpge_epi32_mask(key, first_key[i]);
        m = _mm512_mask_max_ps(m, keep, m, _mm512_loadu_ps(s + j * LANES));
      }
      mx[i] = (vf)m;
    }
    float chunk_max[4], m_new[4], m_old[4];
    hmax4(mx, chunk_max);
    vf sums[4];
    for (int i = 0; i < 4; i++) {
      m_old[i] = w->m[row[i]];
      const float scaled = chunk_max[i] * scale; /* = the largest scaled score: rounding is monotonic */
      m_new[i] = scaled > m_old[i] ? scaled : m_old[i]; /* finite: every row sees a key of its first chunk */
      const float *s = w->s + row[i] * KEY_CHUNK;
      const __m512 minus_max = _mm512_set1_ps(-m_new[i]);
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < kv_used; j += 2) { /* two vectors a conversion; the pair past kv_used is unread */
        __m512 e[2];
        for (int t = 0; t < 2; t++) {
          const int v = j + t;
          const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(v * LANES));
          const __mmask16 keep =
              v < kv_used ? _mm512_cmple_epi32_mask(key, last_key[i]) & _mm512_cmpge_epi32_mask(key, first_key[i]) : 0;
          e[t] = (__m512)vexp_where((vf)_mm512_fmadd_ps(_mm512_loadu_ps(s + v * LANES), scale_v, minus_max), keep);
          sum = _mm512_add_ps(sum, e[t]);
        }
        const __m512bh both = _mm512_cvtne2ps_pbh(e[1], e[0]);
        memcpy((uint16_t *)w->pb + row[i] * KEY_CHUNK + j * LANES, &both, sizeof both);
      }
      sums[i] = (vf)sum;
    }
    float row_sum[4];
    hsum4(sums[0], sums[1], sums[2], sums[3], row_sum);
    const __m512 alpha_v = (__m512)vexp_where((vf)_mm512_sub_ps(_mm512_set_ps(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, m_old[3], m_old[2], m_old[1], m_old[0]),
                                                    _mm512_set_ps(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, m_new[3], m_new[2], m_new[1], m_new[0])),
                                      0xf); /* exp(-inf) (a first chunk) underflows to 0 */
    float alpha[16];
    _mm512_storeu_ps(alpha, alpha_v);
    for (int i = 0; i < 4 && r0 + i < rows; i++) {
      w->alpha[row[i]] = alpha[i];
      w->l[row[i]] = w->l[row[i]] * alpha[i] + row_sum[i];
      w->m[row[i]] = m_new[i];
    }
  }
}
#endif

/* acc + row[s] * y, row[s] broadcast to every lane: a float32 FMA, or on the bf16 dot-product path
 * (`pairs`) a VDPBF16PS of the 32-bit word holding two bf16 against y's bf16 pairs. `pairs` is a
 * constant in every caller, so each path compiles to its one instruction. */
static inline __attribute__((always_inline)) vf mac(vf acc, const void *row, int s, vf y, const int pairs) {
#if USE_DPBF16
  if (pairs) return dot_pairs(acc, broadcast_u32(((const uint32_t *)row)[s]), (vu)y);
#endif
  (void)pairs;
  return acc + ((const float *)row)[s] * y;
}

/* Scores [rows][KEY_CHUNK] = q [rows][D] . kt [D][KEY_CHUNK], SCORE_ROWS x SCORE_COLS at a time;
 * on the pairs path the reduction runs over D/2 pairs (`qb` rows, `ktp` sharing kt's stride). */
static inline __attribute__((always_inline)) void scores(Scratch *w, int rows, int kv_used, const int D,
                                                         const int pairs) {
  const int steps = pairs ? D / 2 : D;
#define Q_ROW(r) (pairs ? (const void *)(w->qb + (int64_t)(r) * (D / 2)) : (const void *)(w->q + (int64_t)(r) * D))
  int r = 0;
  for (; r + SCORE_ROWS <= rows; r += SCORE_ROWS)
    for (int j0 = 0; j0 < kv_used; j0 += SCORE_COLS) {
      vf acc[SCORE_ROWS][SCORE_COLS];
      for (int rr = 0; rr < SCORE_ROWS; rr++)
        for (int j = 0; j < SCORE_COLS; j++) acc[rr][j] = (vf){};
      for (int d = 0; d < steps; d++) {
        vf k[SCORE_COLS];
        for (int j = 0; j < SCORE_COLS; j++) k[j] = load_f32(w->kt + d * KEY_CHUNK + (j0 + j) * LANES);
        for (int rr = 0; rr < SCORE_ROWS; rr++)
          for (int j = 0; j < SCORE_COLS; j++) acc[rr][j] = mac(acc[rr][j], Q_ROW(r + rr), d, k[j], pairs);
      }
      for (int rr = 0; rr < SCORE_ROWS; rr++)
        for (int j = 0; j < SCORE_COLS; j++) store_f32(w->s + (r + rr) * KEY_CHUNK + (j0 + j) * LANES, acc[rr][j]);
    }
  for (; r < rows; r++)
    for (int j = 0; j < kv_used; j++) {
      vf acc = (vf){};
      for (int d = 0; d < steps; d++) acc = mac(acc, Q_ROW(r), d, load_f32(w->kt + d * KEY_CHUNK + j * LANES), pairs);
      store_f32(w->s + r * KEY_CHUNK + j * LANES, acc);
    }
#undef Q_ROW
}

/* o [rows][D] = o * alpha + p [rows][KEY_CHUNK] . v [KEY_CHUNK][D], in blocks of PV_ROWS rows x
 * PV_COLS vectors of D (fixed-size arrays with constant bounds once D is known, so the accumulators
 * stay in registers), then the rows left over one at a time. On the pairs path the reduction runs
 * over key pairs (`pb` rows, `vp` sharing v's stride). */
static inline __attribute__((always_inline)) void outputs(Scratch *w, int rows, int kc, const int D,
                                                          const int pairs) {
  const int NVD = D / LANES, steps = pairs ? (kc + 1) / 2 : kc;
#define P_ROW(r) (pairs ? (const void *)(w->pb + (r) * (KEY_CHUNK / 2)) : (const void *)(w->s + (r) * KEY_CHUNK))
  for (int j0 = 0; j0 < NVD; j0 += PV_COLS) {
    const int cols = NVD < PV_COLS ? NVD : PV_COLS;
    int r = 0;
    for (; r + PV_ROWS <= rows; r += PV_ROWS) {
      vf acc[PV_ROWS][PV_COLS];
      for (int rr = 0; rr < PV_ROWS; rr++)
        for (int j = 0; j < cols; j++)
          acc[rr][j] = load_f32(w->o + (int64_t)(r + rr) * D + (j0 + j) * LANES) * w->alpha[r + rr];
      for (int key = 0; key < steps; key++) {
        vf v[PV_COLS];
        for (int j = 0; j < cols; j++) v[j] = load_f32(w->v + key * D + (j0 + j) * LANES);
        for (int rr = 0; rr < PV_ROWS; rr++)
          for (int j = 0; j < cols; j++) acc[rr][j] = mac(acc[rr][j], P_ROW(r + rr), key, v[j], pairs);
      }
      for (int rr = 0; rr < PV_ROWS; rr++)
        for (int j = 0; j < cols; j++) store_f32(w->o + (int64_t)(r + rr) * D + (j0 + j) * LANES, acc[rr][j]);
    }
    for (; r < rows; r++) {
      vf acc[PV_COLS];
      for (int j = 0; j < cols; j++) acc[j] = load_f32(w->o + (int64_t)r * D + (j0 + j) * LANES) * w->alpha[r];
      for (int key = 0; key < steps; key++)
        for (int j = 0; j < cols; j++)
          acc[j] = mac(acc[j], P_ROW(r), key, load_f32(w->v + key * D + (j0 + j) * LANES), pairs);
      for (int j = 0; j < cols; j++) store_f32(w->o + (int64_t)r * D + (j0 + j) * LANES, acc[j]);
    }
  }
#undef P_ROW
}

/* One work item; D is a compile-time constant in each caller, so the loops unroll into registers. */
static inline __attribute__((always_inline)) void prefill_item(const PrefillArgs *a, const Item *it,
                                                               Scratch *w, const int D, const int is_bf16) {
  const int NVD = D / LANES;
  const int pairs = USE_DPBF16 && is_bf16; /* the bf16 dot-product path */
  const int b = it->seq, h = it->head, G = a->group;
  const int q_begin = a->query_starts[b], q_len = a->query_starts[b + 1] - q_begin;
  const int first_pos = a->seq_lens[b] - q_len; /* position of the chunk's first query row */
  const int n = q_len - it->first < TILE_POS ? q_len - it->first : TILE_POS;
  const int rows = G * n; /* row g * n + i: query head h * G + g at chunk row it->first + i */
  const int64_t num_keys = it->keys;
  const int32_t *table = a->block_tables + (int64_t)b * a->table_stride;
  /* The bf16 path keeps the queries as they are and scales the scores instead. */
  const float score_scale = pairs ? a->scale : 1.f;
  for (int g = 0; g < G; g++)
    for (int i = 0; i < n; i++) {
      const int64_t src = ((int64_t)(q_begin + it->first + i) * a->num_q_heads + h * G + g) * D;
      const int r = g * n + i;
      if (pairs)
        memcpy(w->qb + (int64_t)r * (D / 2), (const uint16_t *)a->query + src, (size_t)D * 2);
      else
        for (int j = 0; j < NVD; j++)
          store_f32(w->q + (int64_t)r * D + j * LANES, load_vec(a->query, src + j * LANES, is_bf16) * a->scale);
    }
  for (int r = 0; r < rows; r++) {
    w->m[r] = -INFINITY;
    w->l[r] = 0.f;
    for (int j = 0; j < NVD; j++) store_f32(w->o + (int64_t)r * D + j * LANES, (vf){});
  }
  const int tile_first_pos = first_pos + it->first, window = a->window;
  /* A sliding window starts at the first row's window; each later row's window starts within
   * TILE_POS <= KEY_CHUNK keys of it, so every row sees a key of the first chunk. */
  const int64_t c_first = window > 0 && tile_first_pos - window + 1 > 0 ? tile_first_pos - window + 1 : 0;
  vi lane;
  for (int l = 0; l < LANES; l++) lane[l] = l;
  for (int64_t c0 = c_first; c0 < num_keys; c0 += KEY_CHUNK) {
    const int kc = num_keys - c0 < KEY_CHUNK ? (int)(num_keys - c0) : KEY_CHUNK;
    const int kv_used = (kc + LANES - 1) / LANES; /* key vectors holding a key of the context */
#if USE_DPBF16
    if (pairs)
      stage_chunk_pairs(a, w, table, h, c0, kc, D);
    else
#endif
      stage_chunk_f32(a, w, table, h, c0, kc, D, is_bf16);
    scores(w, rows, kv_used, D, pairs);
    /* Causal mask where the chunk reaches past a row's position (or, in a window, starts before the
     * last row's window), then the online softmax. */
    const int masked = c0 + KEY_CHUNK - 1 > tile_first_pos || (window > 0 && c0 < tile_first_pos + n - window);
#if USE_DPBF16
    if (pairs)
      softmax_pairs(w, rows, kv_used, masked, tile_first_pos, n, c0, a->scale, window);
    else
#endif
    for (int r = 0; r < rows; r++) {
      float *s = w->s + r * KEY_CHUNK;
      vf x[NVK];
      x[0] = load_f32(s) * score_scale; /* kv_used >= 1 */
      for (int j = 1; j < kv_used; j++) x[j] = load_f32(s + j * LANES) * score_scale;
      if (masked) {
        const int pos = tile_first_pos + r % n;
        for (int j = 0; j < kv_used; j++) {
          const vi key = lane + (int)(c0 + j * LANES);
          x[j] = vselect(key > pos, (vf){} - INFINITY, x[j]);
          if (window > 0) x[j] = vselect(key < pos - window + 1, (vf){} - INFINITY, x[j]);
        }
      }
      vf mx = x[0];
      for (int j = 1; j < kv_used; j++) mx = vmax(x[j], mx);
      const float chunk_max = hmax(mx);
      const float m_old = w->m[r];
      const float m_new = chunk_max > m_old ? chunk_max : m_old; /* finite: every row sees a key of its first chunk */
      vf sum = (vf){};
      for (int j = 0; j < kv_used; j++) {
        x[j] = vexp(x[j] - m_new);
        sum += x[j];
      }
#if USE_DPBF16
      if (pairs) /* two vectors a conversion (round to nearest even); the pair past kv_used is unread */
        for (int j = 0; j < kv_used; j += 2) {
          const __m512bh both = _mm512_cvtne2ps_pbh((__m512)(j + 1 < kv_used ? x[j + 1] : (vf){}), (__m512)x[j]);
          memcpy((uint16_t *)w->pb + r * KEY_CHUNK + j * LANES, &both, sizeof both);
        }
      else
#endif
        for (int j = 0; j < kv_used; j++) store_f32(s + j * LANES, x[j]);
      const float alpha = m_old == -INFINITY ? 0.f : expf(m_old - m_new);
      w->alpha[r] = alpha;
      w->l[r] = w->l[r] * alpha + hsum(sum);
      w->m[r] = m_new;
    }
    outputs(w, rows, kc, D, pairs);
  }
  for (int g = 0; g < G; g++)
    for (int i = 0; i < n; i++) {
      const int r = g * n + i;
      float inv = 1.f / w->l[r];
      if (a->sinks) { /* the sink's exp(sink - max) joins the sum, both taken at the larger maximum */
        const float sink = a->sinks[h * G + g], m = w->m[r], top = sink > m ? sink : m;
        const float c = expf(m - top);
        inv = c / (w->l[r] * c + expf(sink - top));
      }
      const int64_t dst = ((int64_t)(q_begin + it->first + i) * a->num_q_heads + h * G + g) * D;
      for (int j = 0; j < NVD; j++) store_vec(a->out, dst + j * LANES, load_f32(w->o + (int64_t)r * D + j * LANES) * inv, is_bf16);
    }
}

#define DEFINE_PREFILL_ITEM(D)                                                                        \
  static void prefill_item_f32_##D(const PrefillArgs *a, const Item *it, Scratch *w) {              \
    prefill_item(a, it, w, D, 0);                                                                      \
  }                                                                                                    \
  static void prefill_item_bf16_##D(const PrefillArgs *a, const Item *it, Scratch *w) {             \
    prefill_item(a, it, w, D, 1);                                                                      \
  }
DEFINE_PREFILL_ITEM(16)
DEFINE_PREFILL_ITEM(32)
DEFINE_PREFILL_ITEM(64)
DEFINE_PREFILL_ITEM(128)

typedef void (*prefill_fn)(const PrefillArgs *, const Item *, Scratch *);

static prefill_fn find_prefill_item(int is_bf16, int head_dim) {
  RETURN_HEAD_DIM_VARIANT(prefill_item, is_bf16, head_dim)
}

static int by_keys_descending(const void *x, const void *y) {
  const int64_t a = ((const Item *)x)->work, b = ((const Item *)y)->work;
  return (a < b) - (a > b);
}

/* 1 where bf16 inputs take the AVX512-BF16 dot products (probabilities rounded to bf16), else 0. */
int paged_prefill_attention_bf16_dot(void) { return USE_DPBF16; }

/* Whether (dtype, head_dim, group) is compiled in: 0 yes, 1 no. */
int paged_prefill_attention_supported(int is_bf16, int head_dim, int group) {
  return find_prefill_item(is_bf16, head_dim) != NULL && group >= 1 && group <= MAX_GROUP ? 0 : 1;
}

/* Returns 0 on success, 1 for an unsupported shape, 2 when memory could not be allocated. Work
 * items are (sequence, KV head, tile of TILE_POS query rows), largest first, spread over
 * `num_threads` OpenMP threads. short_chunks: 1 where the step verifies draft tokens (below).
 * window > 0: each row sees only the `window` keys up to its own position (a sliding-window layer;
 * keys before the tile's first window are not read), 0: its whole context. sinks: float32 [num_q_heads]
 * per-head sink logits (gpt-oss) that join each row's softmax denominator only, or NULL. */
int paged_prefill_attention(int is_bf16, const void *query, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                            const int32_t *query_starts, int num_seqs, int num_q_heads, int num_kv_heads,
                            int head_dim, int block_size, float scale, void *out, int num_threads,
                            int short_chunks, int window, const float *sinks) {
  const int group = num_q_heads / num_kv_heads;
  prefill_fn run = find_prefill_item(is_bf16, head_dim);
  if (run == NULL || group < 1 || group > MAX_GROUP || group * num_kv_heads != num_q_heads) return 1;
  if (num_seqs <= 0) return 0;
  /* short_chunks (a step that verifies draft tokens): chunks of a few rows walk their context once
   * in the decode kernel instead, which pays per key for their rows only, not for a tile of TILE_POS
   * positions (where it has the head size compiled in). Only then: a row's result here does not
   * depend on how its prompt was cut into chunks, which keeps a resumed job's greedy text the same. */
  const int short_rows = short_chunk_rows(short_chunks, is_bf16, head_dim, group, SHORT_CHUNK_ROWS);
  const int status = paged_short_chunk_attention(is_bf16, query, k_cache, v_cache, block_tables, table_stride,
                                                 seq_lens, query_starts, num_seqs, num_q_heads, num_kv_heads,
                                                 head_dim, block_size, scale, out, num_threads, short_rows, window,
                                                 sinks);
  if (status) return status;
  int64_t num_items = 0;
  for (int b = 0; b < num_seqs; b++) {
    const int q_len = query_starts[b + 1] - query_starts[b];
    num_items += q_len > short_rows ? (int64_t)(q_len + TILE_POS - 1) / TILE_POS * num_kv_heads : 0;
  }
  if (num_items == 0) return 0;
  Item *items = malloc(sizeof(Item) * num_items);
  if (items == NULL) return 2;
  int64_t k = 0;
  for (int b = 0; b < num_seqs; b++) {
    const int q_len = query_starts[b + 1] - query_starts[b];
    if (q_len <= short_rows) continue;
    for (int first = 0; first < q_len; first += TILE_POS) {
      const int last = first + TILE_POS < q_len ? first + TILE_POS : q_len;
      const int64_t end = (int64_t)seq_lens[b] - q_len + last, start = end - (last - first) - window + 1;
      for (int h = 0; h < num_kv_heads; h++) /* keys: the context end; the work, for the order */
        items[k++] = (Item){b, h, first, end, window > 0 && start > 0 ? end - start : end};
    }
  }
  qsort(items, num_items, sizeof(Item), by_keys_descending); /* long items first: even finish */
  const PrefillArgs args = {query,
                            k_cache,
                            v_cache,
                            block_tables,
                            seq_lens,
                            query_starts,
                            table_stride,
                            (int64_t)num_kv_heads * head_dim,
                            (int64_t)block_size * num_kv_heads * head_dim,
                            num_q_heads,
                            num_kv_heads,
                            group,
                            block_size,
                            scale,
                            out,
                            window,
                            sinks};
  const size_t rows = (size_t)TILE_POS * group;
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    Scratch w;
    /* q, o [rows][D]; s [rows][KEY_CHUNK]; kt [D][KEY_CHUNK]; v [KEY_CHUNK][D]; pb (bf16 path)
     * [rows][KEY_CHUNK / 2] words; m, l, alpha [rows]. */
    const size_t floats = 2 * rows * head_dim + rows * KEY_CHUNK + 2 * (size_t)head_dim * KEY_CHUNK +
                          rows * KEY_CHUNK / 2 + 3 * rows;
    float *buffer = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64); /* a multiple of 64 */
    const int ok = buffer != NULL;
    if (!ok) {
#pragma omp atomic write
      failed = 2;
    } else {
      w.q = buffer;
      w.o = w.q + rows * head_dim;
      w.s = w.o + rows * head_dim;
      w.kt = w.s + rows * KEY_CHUNK;
      w.v = w.kt + (size_t)head_dim * KEY_CHUNK;
      w.pb = (uint32_t *)(w.v + (size_t)head_dim * KEY_CHUNK);
      w.m = (float *)w.pb + rows * KEY_CHUNK / 2;
      w.l = w.m + rows;
      w.alpha = w.l + rows;
      w.qb = (uint32_t *)w.q; /* the bf16 path's staging reuses the float32 path's buffers */
      w.ktp = (uint32_t *)w.kt;
      w.vp = (uint32_t *)w.v;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; i++)
      if (ok) run(&args, &items[i], &w);
    free(buffer);
  }
  free(items);
  return failed;
}
