/* Paged causal attention of bf16 prefill chunks on AMX tiles: the same contract as
 * paged_prefill_attention.c (each query row attends to its sequence's cached context up to and
 * including its own position), with both matrix products on TDPBF16PS.
 *
 * FlashAttention's loop (Dao et al. 2022, arXiv:2205.14135): a work item is 16 query positions of
 * one query head; it walks the context in blocks of 64 keys, S = Q K^T on the tiles, an online
 * softmax of S in AVX-512 registers (running maximum and sum per row, float32, in the log2 domain),
 * then O += P V on the tiles with P rounded to bf16 (as torch's CPU flash attention and
 * FlashAttention's bf16 kernels do), O kept in float32 and rescaled when a row's maximum grows by
 * more than a margin (lazy rescaling, as in FlashAttention-4's softmax). Only the key
 * blocks a row can see are visited (the causal triangle plus the cached prefix).
 *
 * The tiles need their B operands in pairs along the reduced dimension: K^T as [D/2][keys][2]
 * for S, V as [keys/2][D][2] for P V. Every sequence's K and V are first gathered from the paged
 * cache (PagedAttention, Kwon et al. 2023, arXiv:2309.06180) into those layouts, once per KV head,
 * and then serve the whole GQA group and every query tile (first parallel pass, scratch reused
 * between calls); the query tiles run in a second pass, longest first.
 *
 * Layouts as in paged_prefill_attention.c: query, out [num_query_rows, num_q_heads, D] bf16;
 * k_cache, v_cache [num_blocks, block_size, num_kv_heads, D] bf16; block_tables int32 [num_seqs,
 * table_stride]; seq_lens int32 [num_seqs]; query_starts int32 [num_seqs + 1]. D a multiple of 32
 * up to 128. Compiled with the other kernels by kernels/cpu/library.py; Linux must grant the AMX tile
 * state (amx_linear.c asks for it).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx512_bf16.h"

/* paged_decode_attention.c: the sequences of at most max_rows query rows, walked once each. */
int paged_short_chunk_attention(int is_bf16, const void *query, const void *k_cache, const void *v_cache,
                                const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                                const int32_t *query_starts, int num_seqs, int num_q_heads, int num_kv_heads,
                                int head_dim, int block_size, float scale, void *out, int num_threads, int max_rows,
                                int window, const float *sinks);
int short_chunk_rows(int short_chunks, int is_bf16, int head_dim, int group, int limit);

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && HAVE_AVX512_BF16_OPS && defined(__linux__)
#define HAVE_AMX_ATTENTION 1
#else
#define HAVE_AMX_ATTENTION 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define Q_TILE 16   /* query positions per work item: one A tile of rows */
#define KEY_BLOCK 64 /* keys per step of the online softmax: four S tiles, two P tiles of K */
/* Chunks of up to this many query rows go to `paged_short_chunk_attention`, which beats this
 * kernel up to there on the default model's shapes (measured: docs/benchmarks.md). */
#ifndef AMX_SHORT_CHUNK_ROWS
#define AMX_SHORT_CHUNK_ROWS 6
#endif
#define MAX_D 128
#define RESCALE_MARGIN 8.f /* log2 units: see attend_tile */

int amx_linear_available(void);

/* 1 where this build has the kernel and Linux grants this process the AMX tile state. */
int paged_prefill_attention_amx_available(void) { return HAVE_AMX_ATTENTION && amx_linear_available(); }

#if HAVE_AMX_ATTENTION
typedef struct {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* Every tile 16 rows of 64 bytes: 0-1 A operands, 2-3 B operands, 4-7 accumulators. */
static void configure_tiles(void) {
  tile_config config;
  memset(&config, 0, sizeof config);
  config.palette_id = 1;
  for (int i = 0; i < 8; i++) config.rows[i] = 16, config.colsb[i] = 64;
  _tile_loadconfig(&config);
}

typedef struct {
  const uint16_t *query, *k_cache, *v_cache;
  const int32_t *block_tables, *seq_lens, *query_starts;
  int64_t table_stride;
  int num_q_heads, num_kv_heads, head_dim, block_size;
  float scale;
  uint16_t *out;
  /* Scratch: sequence b, KV head h at kt + (offset[b] * num_kv_heads + h * padded[b]) * D (and
   * likewise vt), padded[b] = its context rounded up to KEY_BLOCK. */
  uint16_t *kt, *vt;
  const int64_t *offset;
} Args;

/* The address of key t of one sequence's KV head h in the paged cache (NULL past its context). */
static inline const uint16_t *cache_row(const Args *a, const uint16_t *cache, const int32_t *table, int h, int t,
                                        int len) {
  if (t >= len) return NULL;
  const int64_t row_stride = (int64_t)a->num_kv_heads * a->head_dim, bs = a->block_size;
  return cache + (int64_t)table[t / bs] * bs * row_stride + (t % bs) * row_stride + (int64_t)h * a->head_dim;
}

/* K^T and V of one sequence's KV head, gathered from the paged cache into the tiles' pair layouts,
 * zeros past the context. kt: per 16 keys, per 32 of D, a tile of 16 lines [16 keys][2 d] (the
 * keys' rows of 16 d-pairs, transposed as 16 x 16 words). vt: per 32 keys, per 16 of D, a tile of
 * 16 lines [16 d][2 keys] (the rows of keys 2r and 2r + 1 interleaved). */
static void gather_pairs(const Args *a, int b, int h) {
  const int D = a->head_dim, len = a->seq_lens[b];
  const int padded = (len + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
  const int64_t base = (a->offset[b] * a->num_kv_heads + (int64_t)h * padded) * D;
  uint16_t *kt = a->kt + base, *vt = a->vt + base;
  const int32_t *table = a->block_tables + b * a->table_stride;
  /* even 16-bit lanes from the first row's 16 values, odd ones from the second's */
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int t0 = 0; t0 < padded; t0 += 16) {
    const uint16_t *k[16], *v[16];
    for (int i = 0; i < 16; i++) {
      k[i] = cache_row(a, a->k_cache, table, h, t0 + i, len);
      v[i] = cache_row(a, a->v_cache, table, h, t0 + i, len);
    }
    for (int d0 = 0; d0 < D; d0 += 32) {
      __m512i r[16];
      for (int i = 0; i < 16; i++) r[i] = k[i] ? _mm512_loadu_si512(k[i] + d0) : _mm512_setzero_si512();
      transpose_16x16(r);
      uint16_t *tile = kt + (int64_t)(t0 / 16) * 16 * D + (d0 / 32) * 512;
      for (int i = 0; i < 16; i++) _mm512_store_si512((void *)(tile + i * 32), r[i]);
    }
    uint16_t *vg = vt + (int64_t)(t0 / 32) * 32 * D + ((t0 % 32) / 2) * 32; /* this half's 8 lines */
    for (int d0 = 0; d0 < D; d0 += 16)
      for (int i = 0; i < 16; i += 2) {
        const __m256i lo = v[i] ? _mm256_loadu_si256((const __m256i *)(v[i] + d0)) : _mm256_setzero_si256();
        const __m256i hi = v[i + 1] ? _mm256_loadu_si256((const __m256i *)(v[i + 1] + d0)) : _mm256_setzero_si256();
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        _mm512_store_si512((void *)(vg + (d0 / 16) * 512 + (i / 2) * 32), _mm512_permutexvar_epi16(interleave, both));
      }
  }
}

/* One work item: query positions [q0, q0 + rows) of sequence b's chunk, query head qh. */
static void attend_tile(const Args *a, int b, int qh, int q0, int rows) {
  const int D = a->head_dim, group = a->num_q_heads / a->num_kv_heads, h = qh / group;
  const int len = a->seq_lens[b], qlen = a->query_starts[b + 1] - a->query_starts[b];
  const int prefix = len - qlen; /* query row i sits at position prefix + i */
  const int padded = (len + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
  const int64_t base = (a->offset[b] * a->num_kv_heads + (int64_t)h * padded) * D;
  const uint16_t *kt = a->kt + base, *vt = a->vt + base;
  const int64_t q_stride = (int64_t)a->num_q_heads * D;
  const uint16_t *query = a->query + (a->query_starts[b] + q0) * q_stride + (int64_t)qh * D;

  uint16_t q_rows[Q_TILE * MAX_D] __attribute__((aligned(64)));
  memset(q_rows, 0, sizeof(uint16_t) * Q_TILE * D);
  for (int r = 0; r < rows; r++) memcpy(q_rows + r * D, query + r * q_stride, sizeof(uint16_t) * D);
  float o[Q_TILE * MAX_D] __attribute__((aligned(64)));
  memset(o, 0, sizeof(float) * Q_TILE * D);
  float row_max[Q_TILE];
  __m512 row_sum[Q_TILE]; /* per row, 16 partial sums: reduced once at the end */
  for (int r = 0; r < Q_TILE; r++) row_max[r] = -INFINITY, row_sum[r] = _mm512_setzero_ps();
  float s[Q_TILE * KEY_BLOCK] __attribute__((aligned(64)));
  uint16_t p[Q_TILE * KEY_BLOCK] __attribute__((aligned(64)));
  float pv[Q_TILE * 64] __attribute__((aligned(64)));
  const __m512 scale = _mm512_set1_ps(a->scale * 1.44269504088896341f), minus_inf = _mm512_set1_ps(-INFINITY);
  enum { KV = KEY_BLOCK / 16 }; /* 16-key vectors a block */

  const int last_key = prefix + q0 + rows - 1; /* the tile's last row sees keys 0..last_key */
  for (int k0 = 0; k0 <= last_key; k0 += KEY_BLOCK) {
    /* S = Q K^T for the block's keys: one 16-key accumulator a vector, D / 32 products each. */
    _tile_zero(4); /* the tile numbers are immediates */
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int d0 = 0; d0 < D; d0 += 32) {
      _tile_loadd(0, q_rows + d0, D * 2);
      const uint16_t *kd = kt + (int64_t)(k0 / 16) * 16 * D + (d0 / 32) * 512;
      _tile_loadd(2, kd, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_loadd(3, kd + 16 * D, 64);
      _tile_dpbf16ps(5, 0, 3);
      _tile_loadd(2, kd + 32 * D, 64);
      _tile_dpbf16ps(6, 0, 2);
      _tile_loadd(3, kd + 48 * D, 64);
      _tile_dpbf16ps(7, 0, 3);
    }
    _tile_stored(4, s, KEY_BLOCK * 4);
    _tile_stored(5, s + 16, KEY_BLOCK * 4);
    _tile_stored(6, s + 32, KEY_BLOCK * 4);
    _tile_stored(7, s + 48, KEY_BLOCK * 4);
    /* Online softmax of each row's scores; P in bf16 for the tiles. */
    const int needs_mask = k0 + KEY_BLOCK - 1 > prefix + q0;
    for (int r = 0; r < Q_TILE; r++) {
      uint16_t *pr = p + r * KEY_BLOCK;
      if (r >= rows) { /* padding rows: no keys */
        memset(pr, 0, sizeof(uint16_t) * KEY_BLOCK);
        continue;
      }
      __m512 x[KV];
      const int visible = prefix + q0 + r - k0 + 1; /* keys k0 .. k0 + visible - 1 */
      for (int j = 0; j < KV; j++) {
        x[j] = _mm512_mul_ps(_mm512_load_ps(s + r * KEY_BLOCK + 16 * j), scale);
        if (needs_mask) x[j] = _mm512_mask_mov_ps(minus_inf, tail_mask(visible > 16 * j ? visible - 16 * j : 0), x[j]);
      }
      __m512 mx = x[0];
      for (int j = 1; j < KV; j++) mx = _mm512_max_ps(mx, x[j]);
      /* Lazy rescaling: the running maximum moves only when a score exceeds it by more than
       * RESCALE_MARGIN (log2 units), so P's values stay under 2^RESCALE_MARGIN and O is rescaled a
       * few times a row, not at every block that raises the maximum a little. The test is one
       * compare of 16 lanes; the block's maximum is reduced only when it passes. A row's first
       * block always holds a visible key (key 0), so its maximum is finite from then on. */
      if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(row_max[r] + RESCALE_MARGIN), _CMP_GT_OQ)) {
        const float block_max = _mm512_reduce_max_ps(mx);
        if (row_max[r] != -INFINITY) {
          const __m512 alpha = _mm512_set1_ps(exp2f(row_max[r] - block_max));
          row_sum[r] = _mm512_mul_ps(row_sum[r], alpha);
          for (int d = 0; d < D; d += 16) _mm512_store_ps(o + r * D + d, _mm512_mul_ps(_mm512_load_ps(o + r * D + d), alpha));
        }
        row_max[r] = block_max;
      }
      const __m512 m = _mm512_set1_ps(row_max[r]);
      for (int j = 0; j < KV; j += 2) {
        const __m512 e0 = exp2_nonpositive16(_mm512_sub_ps(x[j], m)),
                     e1 = exp2_nonpositive16(_mm512_sub_ps(x[j + 1], m));
        row_sum[r] = _mm512_add_ps(row_sum[r], _mm512_add_ps(e0, e1));
        _mm512_store_si512((void *)(pr + 16 * j),
                           _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16_16(e0)), to_bf16_16(e1), 1));
      }
    }
    /* O += P V, 64 columns of D at a time (four 16-column accumulators), 32 keys a product. */
    const uint16_t *vblock = vt + (int64_t)(k0 / 32) * 32 * D;
    for (int d0 = 0; d0 < D; d0 += 64) {
      const int quarters = D - d0 < 64 ? (D - d0) / 16 : 4;
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int kk = 0; kk < KEY_BLOCK; kk += 32) {
        _tile_loadd(0, p + kk, KEY_BLOCK * 2);
        const uint16_t *vk = vblock + (int64_t)kk * D + (d0 / 16) * 512;
        _tile_loadd(2, vk, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_loadd(3, vk + 512, 64);
        _tile_dpbf16ps(5, 0, 3);
        if (quarters > 2) {
          _tile_loadd(2, vk + 1024, 64);
          _tile_dpbf16ps(6, 0, 2);
          _tile_loadd(3, vk + 1536, 64);
          _tile_dpbf16ps(7, 0, 3);
        }
      }
      _tile_stored(4, pv, 256);
      _tile_stored(5, pv + 16, 256);
      if (quarters > 2) {
        _tile_stored(6, pv + 32, 256);
        _tile_stored(7, pv + 48, 256);
      }
      for (int r = 0; r < rows; r++)
        for (int q = 0; q < quarters; q++) {
          float *orow = o + r * D + d0 + q * 16;
          _mm512_store_ps(orow, _mm512_add_ps(_mm512_load_ps(orow), _mm512_load_ps(pv + r * 64 + q * 16)));
        }
    }
  }
  uint16_t *out = a->out + (a->query_starts[b] + q0) * q_stride + (int64_t)qh * D;
  for (int r = 0; r < rows; r++) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(row_sum[r]));
    for (int d = 0; d < D; d += 16) store16(out + r * q_stride + d, 0xffff, _mm512_mul_ps(_mm512_load_ps(o + r * D + d), inv));
  }
}

typedef struct {
  int b, qh, q0, rows;
  int64_t work;
} Item;

static int by_work_descending(const void *x, const void *y) {
  const int64_t a = ((const Item *)x)->work, b = ((const Item *)y)->work;
  return (a < b) - (a > b);
}
#endif

/* Returns 0; 1 for a dtype or shape this kernel does not take (float32, D not a multiple of 32 or
 * over 128, a group that does not divide) or a machine without AMX; 2 when memory ran out. */
int paged_prefill_attention_amx(int is_bf16, const void *query, const void *k_cache, const void *v_cache,
                                const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                                const int32_t *query_starts, int num_seqs, int num_q_heads, int num_kv_heads,
                                int head_dim, int block_size, float scale, void *out, int num_threads,
                                int short_chunks) {
#if HAVE_AMX_ATTENTION
  if (!is_bf16 || head_dim % 32 || head_dim > MAX_D || num_kv_heads <= 0 || num_q_heads % num_kv_heads ||
      !paged_prefill_attention_amx_available())
    return 1;
  if (num_seqs <= 0) return 0;
  int64_t *offset = malloc(sizeof(int64_t) * (num_seqs + 1));
  int64_t num_items = 0;
  if (!offset) return 2;
  offset[0] = 0;
  /* short_chunks (a step that verifies draft tokens): chunks of a few rows walk their context once
   * in the decode kernel instead (where it has the head size compiled in): a tile's cost here is
   * mostly the gather of K and V into the tiles' layouts. Only then, as in paged_prefill_attention.c. */
  const int group = num_q_heads / num_kv_heads;
  const int short_rows = short_chunk_rows(short_chunks, 1, head_dim, group, AMX_SHORT_CHUNK_ROWS);
  const int status = paged_short_chunk_attention(1, query, k_cache, v_cache, block_tables, table_stride, seq_lens,
                                                 query_starts, num_seqs, num_q_heads, num_kv_heads, head_dim,
                                                 block_size, scale, out, num_threads, short_rows, 0, NULL);
  if (status) {
    free(offset);
    return status;
  }
  for (int b = 0; b < num_seqs; b++) {
    const int qlen = query_starts[b + 1] - query_starts[b], here = qlen > short_rows;
    offset[b + 1] = offset[b] + (here ? (seq_lens[b] + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK : 0);
    num_items += here ? (int64_t)num_q_heads * ((qlen + Q_TILE - 1) / Q_TILE) : 0;
  }
  const size_t scratch = ((size_t)offset[num_seqs] * num_kv_heads * head_dim * sizeof(uint16_t) + 63) / 64 * 64;
  uint16_t *kt = aligned_alloc(64, scratch), *vt = aligned_alloc(64, scratch);
  Item *items = malloc(sizeof(Item) * (num_items + 1));
  if (!kt || !vt || !items) {
    free(offset), free(kt), free(vt), free(items);
    return 2;
  }
  int64_t n = 0;
  for (int b = 0; b < num_seqs; b++) {
    const int qlen = query_starts[b + 1] - query_starts[b], prefix = seq_lens[b] - qlen;
    if (qlen <= short_rows) continue;
    for (int q0 = 0; q0 < qlen; q0 += Q_TILE)
      for (int qh = 0; qh < num_q_heads; qh++) {
        const int rows = qlen - q0 < Q_TILE ? qlen - q0 : Q_TILE;
        items[n++] = (Item){b, qh, q0, rows, (int64_t)prefix + q0 + rows};
      }
  }
  qsort(items, (size_t)n, sizeof(Item), by_work_descending); /* longest first: the last wave is short */
  const Args a = {query, k_cache, v_cache, block_tables, seq_lens, query_starts, table_stride, num_q_heads,
                  num_kv_heads, head_dim, block_size, scale, out, kt, vt, offset};
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < (int64_t)num_seqs * num_kv_heads; i++) {
      const int b = (int)(i / num_kv_heads);
      if (query_starts[b + 1] - query_starts[b] > short_rows) gather_pairs(&a, b, (int)(i % num_kv_heads));
    }
    configure_tiles();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; i++) attend_tile(&a, items[i].b, items[i].qh, items[i].q0, items[i].rows);
    _tile_release();
  }
  free(offset), free(kt), free(vt), free(items);
  return 0;
#else
  (void)is_bf16, (void)query, (void)k_cache, (void)v_cache, (void)block_tables, (void)table_stride, (void)seq_lens;
  (void)query_starts, (void)num_seqs, (void)num_q_heads, (void)num_kv_heads, (void)head_dim, (void)block_size;
  (void)scale, (void)out, (void)num_threads, (void)short_chunks;
  return 1;
#endif
}
