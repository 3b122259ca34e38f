/* What the two layouts of the experts kernel share (moe_experts.c: weights in the model's plain
 * layout; moe_experts_packed.c: bf16 weights packed for VDPBF16PS): the job both phases read, and
 * torch's bf16 rounding. */
#ifndef BATCHGEN_MOE_EXPERTS_H
#define BATCHGEN_MOE_EXPERTS_H

#include <stdint.h>
#include <string.h>

/* The routing (`starts` [E + 1] into `pairs`, the pair indices token * top_k + slot in expert order),
 * the operands (`esize` bytes an element), the workspaces and the output. */
typedef struct {
  int is_bf16, top_k;
  int64_t num_experts, num_tokens, hidden, inter, ldx, ldo, esize;
  const char *x, *gate_up, *down;
  const float *weights;
  const int32_t *starts, *pairs;
  char *act;
  float *acc;
  char *out;
  const void *tiles; /* the plain layout's tile functions of the dtype */
} moe_job;

static inline float bf16_value(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Round to nearest even, as torch's float -> bfloat16; NaN stays NaN. */
static inline uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return bf16_value(to_bf16(f)); }

/* moe_experts_packed.c: 1 where this build has the packed kernels (AVX512-BF16), else 0 (and the
 * phases below do nothing). Phase 1 takes gate strips [s0, s1) of I / 16, phase 2 output strips
 * [s0, s1) of H / 16 (see moe_experts.c for what each phase computes). */
int moe_experts_packed_available(void);
void moe_packed_gate_up(const moe_job *j, int64_t s0, int64_t s1);
void moe_packed_down(const moe_job *j, int64_t s0, int64_t s1);

#endif
