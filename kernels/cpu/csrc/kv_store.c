/* Writing a step's new K/V rows into the paged KV cache on the CPU.
 *
 * torch's `index_copy_` into the flat cache view (two calls a layer) spends its time mostly in
 * TensorIterator set-up (measured: docs/benchmarks.md); a row here is one memcpy.
 *
 * Layouts: key and value [num_tokens] rows of `row_bytes` bytes (num_kv_heads * head_dim elements,
 * contiguous within the row), rows `key_stride` / `value_stride` bytes apart; k_cache and v_cache
 * [num_slots] rows of `row_bytes` (the [num_blocks, block_size, num_kv_heads, head_dim] cache, with
 * slot = block * block_size + offset, as PagedAttention, Kwon et al. 2023, arXiv:2309.06180).
 * Compiled with the other kernels into one library by kernels/cpu/library.py.
 */
#include <stdint.h>
#include <string.h>

/* Below this many bytes a call runs on one thread: waking the pool costs more. */
#define PARALLEL_MIN_BYTES (1 << 20)

/* Copies row t of key/value to cache row slots[t]; slot -1 marks a padding token, skipped.
 * Returns -1 when every slot is -1 or in [0, num_slots); otherwise nothing is written and the
 * index of the first bad slot is returned. */
int64_t store_kv_rows(const char *key, int64_t key_stride, const char *value, int64_t value_stride, char *k_cache,
                      char *v_cache, const int64_t *slots, int64_t num_tokens, int64_t row_bytes,
                      int64_t num_slots, int num_threads) {
  for (int64_t t = 0; t < num_tokens; t++)
    if (slots[t] < -1 || slots[t] >= num_slots) return t;
#pragma omp parallel for num_threads(num_threads) if (2 * num_tokens * row_bytes >= PARALLEL_MIN_BYTES)
  for (int64_t t = 0; t < num_tokens; t++) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    memcpy(k_cache + slot * row_bytes, key + t * key_stride, (size_t)row_bytes);
    memcpy(v_cache + slot * row_bytes, value + t * value_stride, (size_t)row_bytes);
  }
  return -1;
}
