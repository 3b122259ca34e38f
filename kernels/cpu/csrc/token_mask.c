/* Structured outputs' token masks applied to a step's logits on the CPU: every token whose bit is
 * clear in the row's bitmask gets -inf.
 *
 * xgrammar's own CPU apply walks every token of every row (about 0.15 ms a row at a 49k vocabulary,
 * measured: docs/benchmarks.md); here a word of 32 allowed tokens is skipped in one test, and a
 * word of none is 32 stores. Bitmask layout as xgrammar's: int32 words, bit t % 32 of word t / 32
 * set when token t may be sampled. Compiled with the other kernels by kernels/cpu/library.py.
 */
#include <stdint.h>

/* dtype: 0 float32, 1 bfloat16, 2 float16. logits rows `logits_stride` elements apart, bitmask rows
 * `mask_stride` words apart; rows[i] names the row of both to mask. */
void apply_token_bitmask(void *logits, int64_t logits_stride, int dtype, const int32_t *bitmask,
                         int64_t mask_stride, const int64_t *rows, int64_t num_rows, int64_t vocab) {
  const int64_t words = (vocab + 31) / 32;
  for (int64_t i = 0; i < num_rows; i++) {
    const int64_t row = rows[i];
    const int32_t *mask = bitmask + row * mask_stride;
    for (int64_t w = 0; w < words; w++) {
      const uint32_t word = (uint32_t)mask[w];
      if (word == 0xFFFFFFFFu) continue;
      const int64_t first = w * 32;
      const int64_t last = first + 32 < vocab ? first + 32 : vocab;
      if (dtype == 0) {
        uint32_t *out = (uint32_t *)logits + row * logits_stride;
        for (int64_t t = first; t < last; t++)
          if (!((word >> (t - first)) & 1u)) out[t] = 0xFF800000u; /* -inf */
      } else {
        uint16_t *out = (uint16_t *)logits + row * logits_stride;
        const uint16_t minus_inf = dtype == 1 ? 0xFF80u : 0xFC00u;
        for (int64_t t = first; t < last; t++)
          if (!((word >> (t - first)) & 1u)) out[t] = minus_inf;
      }
    }
  }
}
