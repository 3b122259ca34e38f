/* Every decoder layer of a step in one call: bf16 Llama-family layers on CPUs with AVX512-BF16,
 * their linears on packed bf16 weights or on packed int8 ones (`--quantization int8`'s, or a GGUF
 * file's blocks repacked); or float32 layers on any CPU with their linears on packed int8 weights
 * (`decoder_stack_f32`).
 *
 * The model's Python forward calls about ten C kernels a layer (norms, four linears, rotary, the
 * K/V store, attention, SiLU-and-multiply), each through ctypes with its torch allocations and
 * argument checks, time outside the kernels that `batchgen bench --profile` shows (measured:
 * docs/benchmarks.md). Here the same kernels run in the same order on the same inputs,
 * so the result is bit for bit the Python path's (in bf16; in float32 the norms, rotary and SiLU are
 * f32_ops.c's where the Python path runs torch's, equal up to float32 rounding); only the calls
 * between them move into C. This is
 * the CPU counterpart of replaying a captured CUDA graph (as vLLM does for its decode steps).
 *
 * Per layer, with H = hidden size, Q = query heads x head_dim, KV = KV heads x head_dim, I = the
 * MLP's intermediate size (every buffer of the model's dtype, rows of the step's T tokens):
 *   normed  = rms_norm(hidden += delta)              (no add on the first layer: delta is unset)
 *   qkv     = normed W_qkv^T                          [T, Q + 2 KV]
 *   q, k    = rotary(qkv's first Q + KV columns)      [T, Q], [T, KV]
 *   cache  <- k, v (qkv's last KV columns) at the step's slots
 *   attn    = paged attention: decode rows, then prefill chunks   [T, Q]
 *   normed  = rms_norm(hidden += attn W_o^T)
 *   delta   = silu_mul(normed W_gate_up^T) W_down^T   [T, H]; added by the next layer's first norm
 * so on return `delta` holds the last layer's MLP output, not yet added to `hidden` (the caller adds
 * it for the rows it samples, as the Python path does).
 *
 * Compiled with the other kernels into one library by kernels/cpu/library.py; wrapped by
 * kernels/cpu/stack.py, which checks every shape, layout and bound before calling.
 */
#include <stddef.h>
#include <stdint.h>

/* The kernels of the library's other files. */
void add_rms_norm_bf16(uint16_t *hidden, int64_t hidden_stride, const uint16_t *delta, int64_t delta_stride,
                       const uint16_t *weight, float eps, int64_t rows, int cols, uint16_t *out,
                       int64_t out_stride, int num_threads);
void silu_mul_bf16(const uint16_t *gate_up, int64_t gate_up_stride, int64_t rows, int cols, uint16_t *out,
                   int64_t out_stride, int num_threads);
void rotary_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *sin,
                 int64_t cos_stride, int64_t rows, int q_heads, int k_heads, int head_dim, uint16_t *q_out,
                 uint16_t *k_out, int num_threads);
void add_rms_norm_f32(float *hidden, int64_t hidden_stride, const float *delta, int64_t delta_stride,
                      const float *weight, float eps, int64_t rows, int cols, float *out, int64_t out_stride,
                      int num_threads);
void silu_mul_f32(const float *gate_up, int64_t gate_up_stride, int64_t rows, int cols, float *out,
                  int64_t out_stride, int num_threads);
void rotary_f32(const float *x, int64_t x_stride, const float *cos, const float *sin, int64_t cos_stride,
                int64_t rows, int q_heads, int k_heads, int head_dim, float *q_out, float *k_out,
                int num_threads);
int bf16_linear(const uint16_t *x, int64_t ldx, const uint16_t *w_packed, const float *bias, uint16_t *y,
                int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads);
int amx_linear(const uint16_t *x, int64_t ldx, const uint16_t *w_packed, const float *bias, uint16_t *y,
               int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads);
int amx_swiglu(const uint16_t *x, int64_t ldx, const uint16_t *w_packed, const float *bias, uint16_t *y,
               int64_t ldy, int64_t m, int64_t intermediate, int64_t k, int num_threads);
int int8_w8a16_linear(const void *x, int x_bf16, int bf16_dot, int64_t ldx, const int8_t *w, const float *scales,
                      const float *offsets, int64_t group, const float *bias, void *y, int y_bf16, int64_t ldy, int64_t m, int64_t n,
                      int64_t k, int num_threads);
int64_t store_kv_rows(const char *key, int64_t key_stride, const char *value, int64_t value_stride, char *k_cache,
                      char *v_cache, const int64_t *slots, int64_t num_tokens, int64_t row_bytes,
                      int64_t num_slots, int num_threads);
int paged_decode_attention(int is_bf16, const void *query, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                           int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                           float scale, void *out, int num_threads, int window, const float *sinks);
int paged_prefill_attention(int is_bf16, const void *query, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                            const int32_t *query_starts, int num_seqs, int num_q_heads, int num_kv_heads,
                            int head_dim, int block_size, float scale, void *out, int num_threads,
                            int short_chunks, int window, const float *sinks);

/* Columns of the per-layer table `layers` [num_layers][LAYER_FIELDS]: addresses, as int64. */
enum {
  INPUT_NORM,     /* the model's dtype [H] */
  QKV_WEIGHT,     /* packed bf16 (kernels/cpu/linear.py Bf16Linear) of [Q + 2 KV, H]; 0 in float32 */
  O_WEIGHT,       /* packed [H, Q] */
  POST_NORM,      /* the model's dtype [H] */
  GATE_UP_WEIGHT, /* packed [2 I, H] */
  DOWN_WEIGHT,    /* packed [H, I] */
  K_CACHE,        /* the model's dtype [num_blocks, block_size, KV heads, head_dim] */
  V_CACHE,
  /* The four projections as packed int8 (int8_packed.h: values, float32 scales, float32 offsets or
   * 0 for a symmetric weight; all 0 where the model has none), for LINEAR_INT8: QKV_INT8,
   * QKV_SCALES, QKV_OFFSETS, O_INT8, ..., DOWN_OFFSETS. */
  QKV_INT8,
  QKV_SCALES,
  QKV_OFFSETS,
  O_INT8,
  O_SCALES,
  O_OFFSETS,
  GATE_UP_INT8,
  GATE_UP_SCALES,
  GATE_UP_OFFSETS,
  DOWN_INT8,
  DOWN_SCALES,
  DOWN_OFFSETS,
  LAYER_FIELDS
};

/* Entries of `dims`; INT8_GROUP: the K of an int8 scale group (0 without int8 weights). */
enum { HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, BLOCK_SIZE, NUM_SLOTS, INT8_GROUP, NUM_DIMS };

/* The linear kernels the stack runs (`linear_kind`). */
enum { LINEAR_BF16, LINEAR_AMX, LINEAR_INT8 };

/* y = x W^T for projection `which` (0 qkv, 1 o, 2 gate/up, 3 down) of layer row `w`: batchgen's
 * bf16 or AMX kernel on the packed bf16 weight, the int8 kernel on the packed int8 weight
 * (int8_w8a16.c: with `f32`, float32 in and out through its float32 tiles; else bf16 in and out
 * through its VDPBF16PS tiles). Returns the kernel's status (1: refused, 2: no memory). */
static int stack_linear(int kind, int f32, const int64_t *w, int which, int64_t group, const void *x, int64_t ldx,
                        void *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
  static const int bf16_field[4] = {QKV_WEIGHT, O_WEIGHT, GATE_UP_WEIGHT, DOWN_WEIGHT};
  static const int int8_field[4] = {QKV_INT8, O_INT8, GATE_UP_INT8, DOWN_INT8};
  if (kind == LINEAR_INT8)
    return int8_w8a16_linear(x, !f32, !f32, ldx, (const int8_t *)(intptr_t)w[int8_field[which]],
                             (const float *)(intptr_t)w[int8_field[which] + 1],
                             (const float *)(intptr_t)w[int8_field[which] + 2], group, NULL, y, !f32, ldy, m, n, k,
                             num_threads);
  if (f32) return 1; /* float32 layers run int8 linears only */
  const uint16_t *packed = (const uint16_t *)(intptr_t)w[bf16_field[which]];
  return kind == LINEAR_AMX ? amx_linear(x, ldx, packed, NULL, y, ldy, m, n, k, num_threads)
                            : bf16_linear(x, ldx, packed, NULL, y, ldy, m, n, k, num_threads);
}

/* Elements (of the model's dtype) of workspace a token needs (see the layout in stack_layers). */
int64_t decoder_stack_workspace_per_token(const int64_t *dims) {
  const int64_t h = dims[HIDDEN], q = dims[Q_HEADS] * dims[HEAD_DIM], kv = dims[KV_HEADS] * dims[HEAD_DIM];
  return 2 * h + (q + 2 * kv) + q + kv + q + 3 * dims[INTERMEDIATE];
}

/* The element-wise kernels of one dtype: bf16_ops.c's or f32_ops.c's. */
static void add_rms_norm(int f32, void *hidden, int64_t stride, const void *delta, const void *weight, float eps,
                         int64_t rows, int cols, void *out, int num_threads) {
  if (f32)
    add_rms_norm_f32(hidden, stride, delta, stride, weight, eps, rows, cols, out, stride, num_threads);
  else
    add_rms_norm_bf16(hidden, stride, delta, stride, weight, eps, rows, cols, out, stride, num_threads);
}

static void silu_mul(int f32, const void *gate_up, int64_t rows, int cols, void *out, int num_threads) {
  if (f32)
    silu_mul_f32(gate_up, 2 * (int64_t)cols, rows, cols, out, cols, num_threads);
  else
    silu_mul_bf16(gate_up, 2 * (int64_t)cols, rows, cols, out, cols, num_threads);
}

static void rotary(int f32, const void *x, int64_t x_stride, const void *cos, const void *sin, int64_t rows,
                   int q_heads, int k_heads, int head_dim, void *q_out, void *k_out, int num_threads) {
  if (f32)
    rotary_f32(x, x_stride, cos, sin, head_dim, rows, q_heads, k_heads, head_dim, q_out, k_out, num_threads);
  else
    rotary_bf16(x, x_stride, cos, sin, head_dim, rows, q_heads, k_heads, head_dim, q_out, k_out, num_threads);
}

/* Runs all `num_layers` layers on the step's `num_tokens` rows, every buffer of one dtype: float32
 * (`f32`) or bf16. Arguments as decoder_stack_bf16's; `es` below is the element size in bytes. */
static int stack_layers(int f32, const int64_t *layers, int num_layers, const int64_t *dims, float eps, float scale,
                        int64_t num_tokens, char *hidden, char *delta, const char *cos, const char *sin,
                        const int64_t *slots, const int32_t *block_tables, int64_t table_stride,
                        const int32_t *seq_lens, int num_decodes, int num_seqs, const int32_t *prefill_query_starts,
                        char *workspace, int num_threads, int linear_kind, int short_chunks) {
  const int64_t t = num_tokens, h = dims[HIDDEN], d = dims[HEAD_DIM], inter = dims[INTERMEDIATE];
  const int64_t group = dims[INT8_GROUP], es = f32 ? 4 : 2;
  const int hq = (int)dims[Q_HEADS], hkv = (int)dims[KV_HEADS], block_size = (int)dims[BLOCK_SIZE];
  const int64_t q = hq * d, kv = hkv * d, qkv_width = q + 2 * kv;
  char *normed = workspace, *qkv = normed + t * h * es, *query = qkv + t * qkv_width * es;
  char *key = query + t * q * es, *attn = key + t * kv * es, *o = attn + t * q * es;
  char *gate_up = o + t * h * es, *act = gate_up + t * 2 * inter * es;
  const int num_prefills = num_seqs - num_decodes;
  for (int l = 0; l < num_layers; l++) {
    const int64_t *w = layers + (int64_t)l * LAYER_FIELDS;
    void *k_cache = (void *)(intptr_t)w[K_CACHE], *v_cache = (void *)(intptr_t)w[V_CACHE];
    add_rms_norm(f32, hidden, h, l ? delta : NULL, (const void *)(intptr_t)w[INPUT_NORM], eps, t, (int)h, normed,
                 num_threads);
    int status = stack_linear(linear_kind, f32, w, 0, group, normed, h, qkv, qkv_width, t, qkv_width, h,
                              num_threads);
    if (status) return status;
    rotary(f32, qkv, qkv_width, cos, sin, t, hq, hkv, (int)d, query, key, num_threads);
    if (store_kv_rows(key, kv * es, qkv + (q + kv) * es, qkv_width * es, k_cache, v_cache, slots, t, kv * es,
                      dims[NUM_SLOTS], num_threads) >= 0)
      return 3;
    if (num_decodes > 0)
      status = paged_decode_attention(!f32, query, k_cache, v_cache, block_tables, table_stride, seq_lens,
                                      num_decodes, hq, hkv, (int)d, block_size, scale, attn, num_threads, 0, NULL);
    if (status == 0 && num_prefills > 0)
      status = paged_prefill_attention(!f32, query + num_decodes * q * es, k_cache, v_cache,
                                       block_tables + num_decodes * table_stride, table_stride,
                                       seq_lens + num_decodes, prefill_query_starts, num_prefills, hq, hkv,
                                       (int)d, block_size, scale, attn + num_decodes * q * es, num_threads,
                                       short_chunks, 0, NULL);
    if (status) return status;
    status = stack_linear(linear_kind, f32, w, 1, group, attn, q, o, h, t, h, q, num_threads);
    if (status) return status;
    add_rms_norm(f32, hidden, h, o, (const void *)(intptr_t)w[POST_NORM], eps, t, (int)h, normed, num_threads);
    if (linear_kind == LINEAR_AMX && !f32) { /* SiLU(gate) * up in the AMX kernel's store: no [T, 2 I] intermediate */
      const uint16_t *gate_up_weight = (const uint16_t *)(intptr_t)w[GATE_UP_WEIGHT];
      if (amx_swiglu((const uint16_t *)normed, h, gate_up_weight, NULL, (uint16_t *)act, inter, t, inter, h,
                     num_threads))
        return 1;
    } else {
      status = stack_linear(linear_kind, f32, w, 2, group, normed, h, gate_up, 2 * inter, t, 2 * inter, h,
                            num_threads);
      if (status) return status;
      silu_mul(f32, gate_up, t, (int)inter, act, num_threads);
    }
    status = stack_linear(linear_kind, f32, w, 3, group, act, inter, delta, h, t, h, inter, num_threads);
    if (status) return status;
  }
  return 0;
}

/* Runs all `num_layers` layers of a bf16 model on the step's `num_tokens` rows.
 *
 * hidden   bf16 [T, H], the residual stream (the embeddings on entry), updated in place
 * delta    bf16 [T, H], out: the last layer's MLP output
 * cos, sin bf16 [T, head_dim], the step's rotary tables
 * slots    int64 [T], cache slot of each token (-1: not stored)
 * block_tables int32 [num_seqs] rows `table_stride` apart; seq_lens int32 [num_seqs], context
 *          lengths after the step; the first `num_decodes` sequences have one query row each, the
 *          rest are prefill chunks whose rows start at `prefill_query_starts` [num_seqs - num_decodes
 *          + 1] (from 0, relative to the first prefill row)
 * workspace bf16, decoder_stack_workspace_per_token(dims) x T elements
 * linear_kind LINEAR_BF16: the linears run bf16_linear.c's kernel, LINEAR_AMX: amx_linear.c's (the
 *          same packed bf16 weights), LINEAR_INT8: int8_w8a16.c's on the packed int8 weights
 * short_chunks 1: the step verifies draft tokens (paged_prefill_attention's short chunks)
 *
 * Returns 0; 1 when a kernel refused a shape; 2 when one could not allocate memory; 3 when a slot
 * lies outside the cache (nothing of that layer's K/V written). Bounds of the tables and lengths are
 * the caller's to check: the attention kernels trust them. */
int decoder_stack_bf16(const int64_t *layers, int num_layers, const int64_t *dims, float eps, float scale,
                       int64_t num_tokens, uint16_t *hidden, uint16_t *delta, const uint16_t *cos,
                       const uint16_t *sin, const int64_t *slots, const int32_t *block_tables,
                       int64_t table_stride, const int32_t *seq_lens, int num_decodes, int num_seqs,
                       const int32_t *prefill_query_starts, uint16_t *workspace, int num_threads,
                       int linear_kind, int short_chunks) {
  return stack_layers(0, layers, num_layers, dims, eps, scale, num_tokens, (char *)hidden, (char *)delta,
                      (const char *)cos, (const char *)sin, slots, block_tables, table_stride, seq_lens, num_decodes,
                      num_seqs, prefill_query_starts, (char *)workspace, num_threads, linear_kind, short_chunks);
}

/* decoder_stack_bf16 for a float32 model: every buffer, norm weight and cache float32, the linears
 * LINEAR_INT8 (int8_w8a16.c's float32 tiles) only (the bf16 weight fields unused).
 * Returns as decoder_stack_bf16 does, and 1 for any other `linear_kind`. */
int decoder_stack_f32(const int64_t *layers, int num_layers, const int64_t *dims, float eps, float scale,
                      int64_t num_tokens, float *hidden, float *delta, const float *cos, const float *sin,
                      const int64_t *slots, const int32_t *block_tables, int64_t table_stride,
                      const int32_t *seq_lens, int num_decodes, int num_seqs, const int32_t *prefill_query_starts,
                      float *workspace, int num_threads, int linear_kind, int short_chunks) {
  if (linear_kind != LINEAR_INT8) return 1;
  return stack_layers(1, layers, num_layers, dims, eps, scale, num_tokens, (char *)hidden, (char *)delta,
                      (const char *)cos, (const char *)sin, slots, block_tables, table_stride, seq_lens, num_decodes,
                      num_seqs, prefill_query_starts, (char *)workspace, num_threads, linear_kind, short_chunks);
}
