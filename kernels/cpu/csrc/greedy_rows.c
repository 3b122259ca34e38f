/* Greedy sampling on the CPU: each logits row's argmax and whether the row is finite, in one pass.
 *
 * torch's `max(dim=-1)` over bfloat16 logits walks them element by element (about 31 ms for 256
 * rows of a 49k vocabulary on one Zen 4 core, against 2 ms for a sum: docs/benchmarks.md), and the
 * step also sums each row to find NaN and infinities. Here each row is read once: its values turned
 * into integer keys that order as the floats do (sign-magnitude to two's complement), the maximum
 * key taken per chunk of CHUNK values (loops the compiler vectorizes), the first chunk that holds
 * the row's maximum remembered, and that chunk searched for its first maximal value: the first
 * maximum, as torch's argmax. Keys order -0.0 below +0.0 (floats call them equal): a row whose
 * maximum is a zero of both signs gives the +0.0's index. A NaN or infinite value (all exponent
 * bits set) clears the row's finite flag; its id is then meaningless (the engine fails the row).
 * Compiled with the other kernels by kernels/cpu/library.py.
 */
#include <stdint.h>

#define CHUNK 64
/* Below this many values a call runs on one thread: waking the pool costs more. */
#define PARALLEL_MIN_VALUES (1 << 18)

static inline int16_t key16(uint16_t h) { return (int16_t)(h ^ ((uint16_t)((int16_t)h >> 15) & 0x7fffu)); }

static inline int32_t key32(uint32_t u) { return (int32_t)(u ^ ((uint32_t)((int32_t)u >> 31) & 0x7fffffffu)); }

static void row_bf16(const uint16_t *x, int64_t n, int64_t *id, int64_t *finite) {
  int32_t best = -32769; /* below every key */
  int64_t best_chunk = 0;
  uint16_t special = 0;
  for (int64_t c = 0; c < n; c += CHUNK) {
    const int64_t len = n - c < CHUNK ? n - c : CHUNK;
    int16_t m = INT16_MIN;
    uint16_t all_ones = 0;
    for (int64_t i = 0; i < len; i++) {
      const int16_t k = key16(x[c + i]);
      m = k > m ? k : m;
      all_ones |= (uint16_t)((x[c + i] & 0x7f80u) == 0x7f80u);
    }
    special |= all_ones;
    if (m > best) {
      best = m;
      best_chunk = c;
    }
  }
  int64_t at = best_chunk;
  while (key16(x[at]) != best) at++;
  *id = at;
  *finite = special ? 0 : 1;
}

static void row_f32(const uint32_t *x, int64_t n, int64_t *id, int64_t *finite) {
  int64_t best = INT64_MIN;
  int64_t best_chunk = 0;
  uint32_t special = 0;
  for (int64_t c = 0; c < n; c += CHUNK) {
    const int64_t len = n - c < CHUNK ? n - c : CHUNK;
    int32_t m = INT32_MIN;
    uint32_t all_ones = 0;
    for (int64_t i = 0; i < len; i++) {
      const int32_t k = key32(x[c + i]);
      m = k > m ? k : m;
      all_ones |= (uint32_t)((x[c + i] & 0x7f800000u) == 0x7f800000u);
    }
    special |= all_ones;
    if (m > best) {
      best = m;
      best_chunk = c;
    }
  }
  int64_t at = best_chunk;
  while (key32(x[at]) != best) at++;
  *id = at;
  *finite = special ? 0 : 1;
}

/* logits: `rows` rows of `vocab` values, `stride` elements apart; dtype 0 float32, 1 bfloat16.
 * out: int64 [2, rows]: the argmax ids, then the finite flags (1 finite, 0 not). vocab >= 1. */
void greedy_rows(const void *logits, int64_t rows, int64_t vocab, int64_t stride, int dtype, int64_t *out,
                 int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * vocab >= PARALLEL_MIN_VALUES)
  for (int64_t r = 0; r < rows; r++) {
    if (dtype == 1)
      row_bf16((const uint16_t *)logits + r * stride, vocab, out + r, out + rows + r);
    else
      row_f32((const uint32_t *)logits + r * stride, vocab, out + r, out + rows + r);
  }
}
