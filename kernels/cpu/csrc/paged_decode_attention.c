/* Paged decode attention on the CPU: one query token per sequence against its cached context.
 *
 * The torch path gathers each sequence's blocks into a padded copy and runs SDPA on it, so every
 * K/V byte is read, written and read again. Here each sequence walks its blocks in place through
 * the block table (PagedAttention, Kwon et al. 2023, arXiv:2309.06180) and reads every K/V row
 * once, for all the query heads of each KV head's GQA group. The same walk serves short chunks
 * (`paged_short_chunk_attention`: a few query positions a sequence, such as a verification of
 * speculative draft tokens), called from the prefill kernels: every K and V row is read once for
 * all the chunk's positions, each position masked to its own causal length.
 *
 * Layouts (row-major, contiguous):
 *   query, out         [num_seqs, num_q_heads, HEAD_DIM]
 *   k_cache, v_cache   [num_blocks, block_size, num_kv_heads, HEAD_DIM]
 *   block_tables       int32 [num_seqs, table_stride]
 *   seq_lens           int32 [num_seqs], each >= 1
 * Arithmetic is float32 whatever the storage type (float32 or bfloat16).
 *
 * Written with GCC/Clang vector extensions instead of intrinsics, so the compiler maps the vectors
 * onto whatever the machine has with -march=native: 16 lanes (AVX-512, NEON), or 8 lanes on an
 * x86 CPU with AVX2 but no AVX-512. There, with 16 vector registers instead of 32, the loops that
 * keep four K rows (or a query group's accumulators) in registers spill; the AVX2 build reloads K
 * and V rows from L1 for each query head of a group instead (REGISTER_LIGHT; measured:
 * docs/benchmarks.md). Compiled and loaded at run time by kernels/cpu/attention.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

/* One sequence's KV heads [h0, h1) for its last `q_len` positions (one, or a short chunk such as
 * a verification of draft tokens): the scores of all its context rows for each head's query rows,
 * softmax, then the weighted sum of V rows. A head's query rows are its GQA group at each of the
 * q_len positions (position j's rows `q_stride` elements after position j - 1's); each K and V row
 * is read once for all of them (the score products are still computed per row, so a chunk costs
 * more than one decode; measured: docs/benchmarks.md). Row j attends to the first len - (q_len - 1 - j) keys. A block's
 * rows hold every KV head side by side, so the heads are walked inside the block loop: each block is
 * read as one contiguous run of memory (walking one head at a time read a third of every row and ran
 * at half the bandwidth). `scores` holds (h1 - h0) * q_len * group * padded floats; `qv` and `acc`
 * hold (h1 - h0) * q_len * group * D. With `window` > 0 (a sliding-window layer) row j sees only the
 * `window` keys up to its own position: the blocks before the first row's window are not read, and
 * each row's scores before its own window are masked. `sinks` (NULL: none) holds one logit per query
 * head (gpt-oss's attention sinks) that joins the row's softmax denominator only: the row's maximum
 * is taken over its scores and its sink, and exp(sink - max) is added to the sum. */
#define DEFINE_ITEM(SUFFIX, T, LOADV, STOREV, D)                                                      \
  static void item_##SUFFIX(const void *q_, const void *kc_, const void *vc_, const int32_t *table,  \
                            int len, int q_len, int64_t q_stride, int h0, int h1, int num_kv_heads,    \
                            int group, int64_t row_stride, int64_t block_stride, int block_size,       \
                            float scale, int window, const float *sinks, void *out_, float *scores,   \
                            vf *qv, vf *acc) {                                                         \
    enum { NV = D / LANES };                                                                           \
    /* The first key any row sees (the first row's window start), its block and its score vector. */  \
    int lo = window > 0 ? len - (q_len - 1) - window : 0;                                              \
    lo = lo < 0 ? 0 : lo;                                                                              \
    const int first_block = lo / block_size * block_size, base = lo / LANES * LANES;                   \
    const T *q = q_, *kc = kc_, *vc = vc_;                                                             \
    T *out = out_;                                                                                     \
    const int head_rows = q_len * group;    /* query rows of one KV head: (position, group head) */    \
    const int rows_q = (h1 - h0) * head_rows; /* row (h - h0, j, g) at ((h - h0) * q_len + j) * group + g */ \
    for (int i = 0; i < rows_q; i++) {                                                                 \
      const int hh = i / head_rows, j = i % head_rows / group, g = i % group;                          \
      const T *qi = q + j * q_stride + ((h0 + hh) * group + g) * D;                                    \
      for (int jj = 0; jj < NV; jj++) {                                                                \
        qv[i * NV + jj] = LOADV(qi + jj * LANES) * scale;                                              \
        acc[i * NV + jj] = (vf){};                                                                     \
      }                                                                                                \
    }                                                                                                  \
    const int padded = (len + LANES - 1) / LANES * LANES;                                              \
    /* A block's bytes from head h0 of its first row to head h1 - 1 of its last. */                   \
    const size_t span = ((size_t)block_stride - (size_t)(num_kv_heads - (h1 - h0)) * D) * sizeof(T);   \
    for (int t0 = first_block; t0 < len; t0 += block_size) {                                          \
      const T *block = kc + (int64_t)table[t0 / block_size] * block_stride;                            \
      const int rows = len - t0 < block_size ? len - t0 : block_size;                                  \
      const char *next = t0 + block_size < len                                                         \
          ? (const char *)(kc + (int64_t)table[t0 / block_size + 1] * block_stride + h0 * D)           \
          : NULL;                                                                                      \
      /* The V rows of this block, for the second pass: read from L2 then, not from memory. */         \
      const char *values = (const char *)(vc + (int64_t)table[t0 / block_size] * block_stride + h0 * D); \
      for (int h = h0; h < h1; h++) {                                                                  \
        const T *kb = block + (int64_t)h * D;                                                          \
        if (next) /* this head's share of the next block */                                            \
          prefetch_block(next + (size_t)(h - h0) * span / (h1 - h0), span / (h1 - h0) + 64);           \
        prefetch_block(values + (size_t)(h - h0) * span / (h1 - h0), span / (h1 - h0) + 64);          \
        const vf *qh = qv + (h - h0) * head_rows * NV;                                                 \
        float *sh = scores + (int64_t)(h - h0) * head_rows * padded + t0;                              \
        int r = 0;                                                                                     \
        for (; REGISTER_LIGHT && r + 4 <= rows; r += 4) {                                              \
          const T *r0 = kb + r * row_stride, *r1 = r0 + row_stride, *r2 = r1 + row_stride,              \
                  *r3 = r2 + row_stride;                                                               \
          for (int g = 0; g < head_rows; g++) {                                                        \
            const vf *qg = qh + g * NV;                                                                \
            vf s0 = qg[0] * LOADV(r0), s1 = qg[0] * LOADV(r1), s2 = qg[0] * LOADV(r2),                 \
               s3 = qg[0] * LOADV(r3);                                                                 \
            for (int j = 1; j < NV; j++) {                                                             \
              s0 += qg[j] * LOADV(r0 + j * LANES);                                                     \
              s1 += qg[j] * LOADV(r1 + j * LANES);                                                     \
              s2 += qg[j] * LOADV(r2 + j * LANES);                                                     \
              s3 += qg[j] * LOADV(r3 + j * LANES);                                                     \
            }                                                                                          \
            hsum4(s0, s1, s2, s3, sh + g * padded + r);                                                \
          }                                                                                            \
        }                                                                                              \
        for (; r + 4 <= rows; r += 4) {                                                                \
          vf k0[NV], k1[NV], k2[NV], k3[NV];                                                           \
          for (int j = 0; j < NV; j++) {                                                               \
            k0[j] = LOADV(kb + r * row_stride + j * LANES);                                            \
            k1[j] = LOADV(kb + (r + 1) * row_stride + j * LANES);                                      \
            k2[j] = LOADV(kb + (r + 2) * row_stride + j * LANES);                                      \
            k3[j] = LOADV(kb + (r + 3) * row_stride + j * LANES);                                      \
          }                                                                                            \
          for (int g = 0; g < head_rows; g++) {                                                        \
            const vf *qg = qh + g * NV;                                                                \
            vf s0 = qg[0] * k0[0], s1 = qg[0] * k1[0], s2 = qg[0] * k2[0], s3 = qg[0] * k3[0];         \
            for (int j = 1; j < NV; j++) {                                                             \
              s0 += qg[j] * k0[j];                                                                     \
              s1 += qg[j] * k1[j];                                                                     \
              s2 += qg[j] * k2[j];                                                                     \
              s3 += qg[j] * k3[j];                                                                     \
            }                                                                                          \
            hsum4(s0, s1, s2, s3, sh + g * padded + r);                                                \
          }                                                                                            \
        }                                                                                              \
        for (; r < rows; r++) {                                                                        \
          vf kv[NV];                                                                                   \
          for (int j = 0; j < NV; j++) kv[j] = LOADV(kb + r * row_stride + j * LANES);                 \
          for (int g = 0; g < head_rows; g++) {                                                        \
            const vf *qg = qh + g * NV;                                                                \
            vf s = qg[0] * kv[0];                                                                      \
            for (int j = 1; j < NV; j++) s += qg[j] * kv[j];                                           \
            sh[g * padded + r] = hsum(s);                                                              \
          }                                                                                            \
        }                                                                                              \
      }                                                                                                \
    }                                                                                                  \
    for (int i = 0; i < rows_q; i++) {                                                                 \
      float *si = scores + (int64_t)i * padded;                                                        \
      const int row_len = len - (q_len - 1 - i % head_rows / group); /* causal: its own position on */ \
      for (int t = row_len; t < padded; t++) si[t] = -INFINITY; /* exp(-inf - m) = 0 */               \
      const int row_lo = window > 0 ? row_len - window : 0; /* the first key of its window */         \
      for (int t = base; t < row_lo; t++) si[t] = -INFINITY;                                           \
      vf mv = load_f32(si + base);                                                                     \
      for (int t = base + LANES; t < padded; t += LANES) {                                             \
        vf x = load_f32(si + t);                                                                       \
        mv = vselect(x > mv, x, mv);                                                                   \
      }                                                                                                \
      float m = mv[0];                                                                                 \
      for (int l = 1; l < LANES; l++) m = mv[l] > m ? mv[l] : m;                                       \
      const float sink = sinks ? sinks[(h0 + i / head_rows) * group + i % group] : -INFINITY;          \
      m = sink > m ? sink : m;                                                                         \
      vf sum = (vf){};                                                                                 \
      for (int t = base; t < padded; t += LANES) {                                                     \
        vf e = vexp(load_f32(si + t) - m);                                                             \
        store_f32(si + t, e);                                                                          \
        sum += e;                                                                                      \
      }                                                                                                \
      const float inv = 1.f / (hsum(sum) + (sinks ? expf(sink - m) : 0.f));                            \
      for (int t = base; t < padded; t += LANES) store_f32(si + t, load_f32(si + t) * inv);            \
    }                                                                                                  \
    for (int t0 = first_block; t0 < len; t0 += block_size) {                                          \
      const T *block = vc + (int64_t)table[t0 / block_size] * block_stride;                            \
      const int rows = len - t0 < block_size ? len - t0 : block_size;                                  \
      const int r_lo = lo > t0 ? lo - t0 : 0; /* V rows before every window: never read */            \
      const char *next = t0 + block_size < len                                                         \
          ? (const char *)(vc + (int64_t)table[t0 / block_size + 1] * block_stride + h0 * D)           \
          : NULL;                                                                                      \
      for (int h = h0; h < h1; h++) {                                                                  \
        const T *vb = block + (int64_t)h * D;                                                          \
        if (next) /* this head's share of the next block */                                            \
          prefetch_block(next + (size_t)(h - h0) * span / (h1 - h0), span / (h1 - h0) + 64);           \
        vf *ah = acc + (h - h0) * head_rows * NV;                                                      \
        const float *sh = scores + (int64_t)(h - h0) * head_rows * padded + t0;                        \
        if (REGISTER_LIGHT) { /* per query row, up to 8 accumulators held over the block's rows */    \
          enum { JB = NV < 8 ? NV : 8 };                                                               \
          for (int g = 0; g < head_rows; g++)                                                          \
            for (int j0 = 0; j0 < NV; j0 += JB) {                                                      \
              vf a[JB];                                                                                \
              for (int j = 0; j < JB; j++) a[j] = ah[g * NV + j0 + j];                                 \
              for (int r = r_lo; r < rows; r++) {                                                      \
                const float p = sh[g * padded + r];                                                    \
                for (int j = 0; j < JB; j++) a[j] += p * LOADV(vb + r * row_stride + (j0 + j) * LANES); \
              }                                                                                        \
              for (int j = 0; j < JB; j++) ah[g * NV + j0 + j] = a[j];                                 \
            }                                                                                          \
          continue;                                                                                    \
        }                                                                                              \
        /* The rows' accumulators stay in registers over the block, 16 vectors at a time (a decode's \
         * group at once; a chunk's rows in passes, each V row read again from L1). */                \
        enum { MAX_G = NV <= 16 ? 16 / NV : 1 };                                                       \
        for (int g0 = 0; g0 < head_rows; g0 += MAX_G) {                                                \
          const int n = head_rows - g0 < MAX_G ? head_rows - g0 : MAX_G;                               \
          vf a[MAX_G * NV];                                                                            \
          for (int g = 0; g < MAX_G; g++)                                                              \
            if (g < n)                                                                                 \
              for (int j = 0; j < NV; j++) a[g * NV + j] = ah[(g0 + g) * NV + j];                      \
          for (int r = r_lo; r < rows; r++) {                                                          \
            vf vv[NV];                                                                                 \
            for (int j = 0; j < NV; j++) vv[j] = LOADV(vb + r * row_stride + j * LANES);               \
            for (int g = 0; g < MAX_G; g++)                                                            \
              if (g < n) {                                                                             \
                const float p = sh[(g0 + g) * padded + r];                                             \
                for (int j = 0; j < NV; j++) a[g * NV + j] += p * vv[j];                               \
              }                                                                                        \
          }                                                                                            \
          for (int g = 0; g < MAX_G; g++)                                                              \
            if (g < n)                                                                                 \
              for (int j = 0; j < NV; j++) ah[(g0 + g) * NV + j] = a[g * NV + j];                      \
        }                                                                                              \
      }                                                                                                \
    }                                                                                                  \
    for (int i = 0; i < rows_q; i++) {                                                                 \
      const int hh = i / head_rows, j = i % head_rows / group, g = i % group;                          \
      T *oi = out + j * q_stride + ((h0 + hh) * group + g) * D;                                        \
      for (int jj = 0; jj < NV; jj++) STOREV(oi + jj * LANES, acc[i * NV + jj]);                       \
    }                                                                                                  \
  }

DEFINE_ITEM(f32_16, float, load_f32, store_f32, 16)
DEFINE_ITEM(f32_32, float, load_f32, store_f32, 32)
DEFINE_ITEM(f32_64, float, load_f32, store_f32, 64)
DEFINE_ITEM(f32_128, float, load_f32, store_f32, 128)
DEFINE_ITEM(bf16_16, uint16_t, load_bf16, store_bf16, 16)
DEFINE_ITEM(bf16_32, uint16_t, load_bf16, store_bf16, 32)
DEFINE_ITEM(bf16_64, uint16_t, load_bf16, store_bf16, 64)
DEFINE_ITEM(bf16_128, uint16_t, load_bf16, store_bf16, 128)

typedef void (*item_fn)(const void *, const void *, const void *, const int32_t *, int, int, int64_t, int, int,
                        int, int, int64_t, int64_t, int, float, int, const float *, void *, float *, vf *, vf *);

static item_fn find_item(int is_bf16, int head_dim) {
  RETURN_HEAD_DIM_VARIANT(item, is_bf16, head_dim)
}

/* Whether (dtype, head_dim, group) is compiled in: 0 yes, 1 no. */
int paged_decode_attention_supported(int is_bf16, int head_dim, int group) {
  return find_item(is_bf16, head_dim) != NULL && group >= 1 && group <= MAX_GROUP ? 0 : 1;
}

/* The chunk length up to which a prefill kernel hands chunks to `paged_short_chunk_attention`:
 * `limit` (the caller's measured one) in a step that verifies draft tokens (`short_chunks`) where
 * this kernel has the shape, else 0 (none). */
int short_chunk_rows(int short_chunks, int is_bf16, int head_dim, int group, int limit) {
  return short_chunks && paged_decode_attention_supported(is_bf16, head_dim, group) == 0 ? limit : 0;
}

/* Returns 0 on success, 1 for an unsupported shape, 2 when scratch memory could not be allocated.
 * Work items are sequences, or (sequence, range of KV heads) when there are fewer than two
 * sequences a thread, spread over `num_threads` OpenMP threads. query_starts NULL: sequence b's one
 * query row is row b; else its rows are query_starts[b] .. query_starts[b + 1] - 1 and only the
 * sequences with at most max_rows of them are computed (the others' rows are left untouched). */
static int decode_rows(int is_bf16, const void *query, const void *k_cache, const void *v_cache,
                       const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                       const int32_t *query_starts, int max_rows, int num_seqs, int num_q_heads, int num_kv_heads,
                       int head_dim, int block_size, float scale, void *out, int num_threads, int window,
                       const float *sinks) {
  if (num_seqs <= 0 || max_rows < 1) return 0; /* nothing to do is never refused (the prefill kernels' "none") */
  /* The sequences computed, `which` (NULL: all, one row each), and their longest chunk. */
  int count = num_seqs, max_q_len = 1, *which = NULL;
  if (query_starts) {
    which = malloc(sizeof(int) * num_seqs);
    if (which == NULL) return 2;
    count = 0;
    for (int b = 0; b < num_seqs; b++) {
      const int q_len = query_starts[b + 1] - query_starts[b];
      if (q_len < 1 || q_len > max_rows) continue;
      which[count++] = b;
      max_q_len = q_len > max_q_len ? q_len : max_q_len;
    }
  }
  const int group = num_q_heads / num_kv_heads;
  item_fn item = find_item(is_bf16, head_dim);
  if (count == 0 || item == NULL || group < 1 || group > MAX_GROUP || group * num_kv_heads != num_q_heads) {
    free(which);
    return count == 0 ? 0 : 1;
  }
  const size_t elem = is_bf16 ? 2 : 4;
  int max_len = 0;
  for (int i = 0; i < count; i++) {
    const int b = which ? which[i] : i;
    max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
  }
  const size_t padded = (size_t)(max_len + LANES - 1) / LANES * LANES;
  const int64_t row_stride = (int64_t)num_kv_heads * head_dim;
  const int64_t block_stride = (int64_t)block_size * row_stride;
  const int64_t q_stride = (int64_t)num_q_heads * head_dim; /* elements from one query row to the next */
  int splits = (2 * num_threads + count - 1) / count;
  splits = splits < 1 ? 1 : (splits > num_kv_heads ? num_kv_heads : splits);
  const int heads_per_split = (num_kv_heads + splits - 1) / splits;
  splits = (num_kv_heads + heads_per_split - 1) / heads_per_split;
  const int64_t num_items = (int64_t)count * splits;
  const size_t item_rows = (size_t)heads_per_split * group * max_q_len;
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    float *scores = malloc(sizeof(float) * item_rows * padded);
    vf *qv = aligned_alloc(sizeof(vf), sizeof(vf) * item_rows * (head_dim / LANES));
    vf *acc = aligned_alloc(sizeof(vf), sizeof(vf) * item_rows * (head_dim / LANES));
    const int ok = scores != NULL && qv != NULL && acc != NULL;
    if (!ok) {
#pragma omp atomic write
      failed = 2;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; i++) {
      if (!ok) continue;
      const int b = which ? which[i / splits] : (int)(i / splits), h0 = (int)(i % splits) * heads_per_split;
      const int h1 = h0 + heads_per_split < num_kv_heads ? h0 + heads_per_split : num_kv_heads;
      const int first = query_starts ? query_starts[b] : b;
      const int q_len = query_starts ? query_starts[b + 1] - first : 1;
      const size_t offset = (size_t)first * q_stride * elem;
      item((const char *)query + offset, k_cache, v_cache, block_tables + b * table_stride, seq_lens[b], q_len,
           q_stride, h0, h1, num_kv_heads, group, row_stride, block_stride, block_size, scale, window, sinks,
           (char *)out + offset,
           scores, qv, acc);
    }
    free(scores);
    free(qv);
    free(acc);
  }
  free(which);
  return failed;
}

/* One query row a sequence (row b for sequence b); window > 0: each row sees only its last `window`
 * keys (a sliding-window layer), 0: all of them; sinks: float32 [num_q_heads] sink logits, or NULL.
 * Returns as `decode_rows`. */
int paged_decode_attention(int is_bf16, const void *query, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                           int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                           float scale, void *out, int num_threads, int window, const float *sinks) {
  return decode_rows(is_bf16, query, k_cache, v_cache, block_tables, table_stride, seq_lens, NULL, 1, num_seqs,
                     num_q_heads, num_kv_heads, head_dim, block_size, scale, out, num_threads, window, sinks);
}

/* The prefill kernels' layouts (query_starts [num_seqs + 1]), for the sequences whose chunk has at
 * most `max_rows` query rows (their callers pass a limit only in steps that verify draft tokens):
 * each walks its context once for all its rows, where the prefill kernels' tiles of query
 * positions pay per key for a whole tile. The other sequences' rows are left untouched. `window` and
 * `sinks` as `paged_decode_attention`'s. Returns as `decode_rows`. */
int paged_short_chunk_attention(int is_bf16, const void *query, const void *k_cache, const void *v_cache,
                                const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                                const int32_t *query_starts, int num_seqs, int num_q_heads, int num_kv_heads,
                                int head_dim, int block_size, float scale, void *out, int num_threads, int max_rows,
                                int window, const float *sinks) {
  return decode_rows(is_bf16, query, k_cache, v_cache, block_tables, table_stride, seq_lens, query_starts, max_rows,
                     num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, scale, out, num_threads, window,
                     sinks);
}
