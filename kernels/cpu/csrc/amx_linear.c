/* bf16 linear layers through AMX tiles (Intel Advanced Matrix Extensions): y = x W^T + b with
 * float32 accumulation, on the same packed weight as bf16_linear.c.
 *
 * The packed layout [N/16][K/2][16][2] (kernels/cpu/linear.py Bf16Linear) stores, for each strip of
 * 16 output columns, one 64-byte line per pair of K values: 16 consecutive lines are exactly the B
 * operand of TDPBF16PS for 32 values of K (Intel 64 and IA-32 Architectures Software Developer's
 * Manual, vol. 2, "TDPBF16PS": B is K/2 rows of 16 column pairs). So a B tile is one contiguous
 * kilobyte of the packed weight, read once per call when the rows fit one row block: a few-row
 * call is a stream of the weight, and a many-row call multiplies 32 x 32 output blocks at the
 * tiles' rate (the 2 x 2 register blocking of A and B tiles that oneDNN's brgemm kernels use too).
 *
 * Rows go in panels of up to PANEL_ROWS (their A rows stay in the core's cache while every strip
 * pair passes over them), each panel in blocks of 32 rows (two A tiles of 16) against pairs of
 * strips (two B tiles); each thread takes its own share of the strip pairs. The four float32 C
 * tiles of a block are stored to a buffer and rounded to bf16 (nearest even, as torch) with the
 * bias added first.
 *
 * Layouts: x [M] rows of K bf16, `ldx` elements apart; w_packed as above; bias float32 [N] or NULL;
 * y [M] rows of N bf16, `ldy` elements apart. N must be a multiple of 16 and K of 32.
 *
 * `amx_swiglu` runs a SwiGLU layer's fused gate/up projection (the first I outputs gate, the next I
 * up) with SiLU(gate) * up in the store: each block pairs gate strip j with up strip j (the same
 * packed weight, the second B tile I/16 strips further on) and writes I bf16 values a row instead
 * of 2 I, rounding gate and up to bf16 first, so the result is bit for bit that of `amx_linear`
 * followed by bf16_ops.c's `silu_mul_bf16`, without the [M, 2 I] intermediate's write and read.
 * Linux hands out AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, kernel 5.16+):
 * `amx_linear_available` asks once. Compiled with the other kernels by kernels/cpu/library.py.
 */
#include <stdint.h>
#include <string.h>

#include "avx512_bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && HAVE_AVX512_BF16_OPS && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* Rows of one panel: 512 rows of K = 1,536 bf16 are 1.5 MiB, within a core's L2. */
#define PANEL_ROWS 512
/* Below this many multiply-adds a call runs on one thread: waking the pool costs more. */
#define PARALLEL_MIN_MACS (1 << 16)

#if HAVE_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* The LDTILECFG operand (palette 1): bytes per row and rows of each of the 8 tile registers. */
typedef struct {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* Tiles: 0, 1 the A rows 0-15 and 16-31 of a block; 2, 3 the B tiles of two strips; 4, 5 the C tiles
 * of A0 x B0, A0 x B1; 6, 7 of A1 x B0, A1 x B1. */
static void configure(int rows0, int rows1) {
  tile_config config;
  memset(&config, 0, sizeof config);
  config.palette_id = 1;
  const int rows[8] = {rows0, rows1, 16, 16, rows0, rows0, rows1, rows1};
  for (int i = 0; i < 8; i++) {
    config.rows[i] = (uint8_t)rows[i];
    config.colsb[i] = rows[i] ? 64 : 0;
  }
  _tile_loadconfig(&config);
}

/* C tile rows (float32 [rows][strips * 16] in `acc`, 128 bytes a row) -> bf16 y rows, bias added. */
static void store_rows(const float *acc, int rows, int strips, const float *bias, uint16_t *y, int64_t ldy) {
  for (int r = 0; r < rows; r++) {
    for (int s = 0; s < strips; s++) {
      __m512 v = _mm512_loadu_ps(acc + r * 32 + s * 16);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + s * 16));
      __m256bh rounded = _mm512_cvtneps_pbh(v);
      memcpy(y + r * ldy + s * 16, &rounded, 32);
    }
  }
}

/* SwiGLU store: C tile rows with gate strip j in columns 0-15 and up strip j in 16-31 of each
 * 128-byte row of `acc` -> bf16(silu(bf16(gate)) * bf16(up)) [rows][16], biases added first. */
static void store_swiglu(const float *acc, int rows, const float *gate_bias, const float *up_bias, uint16_t *y,
                         int64_t ldy) {
  for (int r = 0; r < rows; r++) {
    __m512 gate = _mm512_loadu_ps(acc + r * 32), up = _mm512_loadu_ps(acc + r * 32 + 16);
    if (gate_bias) {
      gate = _mm512_add_ps(gate, _mm512_loadu_ps(gate_bias));
      up = _mm512_add_ps(up, _mm512_loadu_ps(up_bias));
    }
    store16(y + r * ldy, 0xffff, silu_mul16(round16(gate), round16(up)));
  }
}

/* One block: `rows` (1-32) rows of x against `strips` (1-2) strips, the whole K, into `acc`
 * (float32 [rows][32]: the first strip in columns 0-15, the second `second_strip` elements further
 * on in the packed weight, in 16-31). */
static void block(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t second_strip, int strips, int rows,
                  int64_t k, float *acc) {
  const int two_a = rows > 16;
  _tile_zero(4);
  _tile_zero(5);
  if (two_a) {
    _tile_zero(6);
    _tile_zero(7);
  }
  const int64_t x_bytes = ldx * 2;
  for (int64_t kk = 0; kk < k; kk += 32) {
    const uint16_t *wk = w + kk * 16; /* 16 pair lines of 32 bf16 per 32 values of K */
    _tile_loadd(0, x + kk, x_bytes);
    _tile_loadd(2, wk, 64);
    _tile_dpbf16ps(4, 0, 2);
    if (two_a) {
      _tile_loadd(1, x + 16 * ldx + kk, x_bytes);
      _tile_dpbf16ps(6, 1, 2);
    }
    if (strips == 2) {
      _tile_loadd(3, wk + second_strip, 64);
      _tile_dpbf16ps(5, 0, 3);
      if (two_a) _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, acc, 128);
  if (strips == 2) _tile_stored(5, acc + 16, 128);
  if (two_a) {
    _tile_stored(6, acc + 16 * 32, 128);
    if (strips == 2) _tile_stored(7, acc + 16 * 32 + 16, 128);
  }
}

static int amx_permission(void) {
  static int state = 0; /* 0: not asked yet, 1: granted, -1: refused (asking again is harmless) */
  if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
  return state == 1;
}
#endif

/* 1 when this build has the kernel and the OS lets this process use AMX tiles, else 0. */
int amx_linear_available(void) {
#if HAVE_AMX
  return amx_permission();
#else
  return 0;
#endif
}

#if HAVE_AMX
/* Both entry points over `strips` strips of the packed weight, split into units of work that the
 * threads share: a pair of adjacent strips (a linear: 32 output columns), or gate strip j and up
 * strip j, I/16 strips apart (`swiglu`: 16 output columns). */
static void run(const uint16_t *x, int64_t ldx, const uint16_t *w_packed, const float *bias, uint16_t *y,
                int64_t ldy, int64_t m, int64_t strips, int64_t k, int swiglu, int num_threads) {
  const int64_t strip_stride = k * 16;
  const int64_t units = swiglu ? strips / 2 : (strips + 1) / 2;
  const int64_t unit_stride = swiglu ? strip_stride : 2 * strip_stride;
  const int64_t second_strip = swiglu ? units * strip_stride : strip_stride;
  const int64_t out_width = swiglu ? 16 : 32, n = 16 * strips;
#pragma omp parallel num_threads(num_threads) if (m * n * k >= PARALLEL_MIN_MACS)
  {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
    const int64_t t = 0, threads = 1;
#endif
    const int64_t u0 = units * t / threads, u1 = units * (t + 1) / threads;
    int configured0 = -1, configured1 = -1;
    float acc[32 * 32];
    for (int64_t panel = 0; panel < m; panel += PANEL_ROWS) {
      const int64_t panel_end = m - panel < PANEL_ROWS ? m : panel + PANEL_ROWS;
      for (int64_t u = u0; u < u1; u++) {
        const int strips_here = swiglu || 2 * u + 1 < strips ? 2 : 1;
        for (int64_t r = panel; r < panel_end; r += 32) {
          const int rows = panel_end - r < 32 ? (int)(panel_end - r) : 32;
          const int rows0 = rows < 16 ? rows : 16, rows1 = rows - rows0;
          if (rows0 != configured0 || rows1 != configured1) {
            configure(rows0, rows1);
            configured0 = rows0, configured1 = rows1;
          }
          block(x + r * ldx, ldx, w_packed + u * unit_stride, second_strip, strips_here, rows, k, acc);
          uint16_t *out = y + r * ldy + out_width * u;
          if (swiglu) {
            store_swiglu(acc, rows, bias ? bias + 16 * u : NULL, bias ? bias + 16 * (u + units) : NULL, out, ldy);
          } else {
            store_rows(acc, rows, strips_here, bias ? bias + 32 * u : NULL, out, ldy);
          }
        }
      }
    }
    if (configured0 >= 0) _tile_release();
  }
}
#endif

/* y = x W^T + b; returns 0, or 1 when the shape or the machine is not one this kernel takes. */
int amx_linear(const uint16_t *x, int64_t ldx, const uint16_t *w_packed, const float *bias, uint16_t *y,
               int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
#if HAVE_AMX
  if (n % 16 || k % 32 || k <= 0 || m < 0 || !amx_permission()) return 1;
  run(x, ldx, w_packed, bias, y, ldy, m, n / 16, k, 0, num_threads);
  return 0;
#else
  (void)x, (void)ldx, (void)w_packed, (void)bias, (void)y, (void)ldy, (void)m, (void)n, (void)k, (void)num_threads;
  return 1;
#endif
}

/* y [M, I] = silu(g) * u for [g | u] = x W^T + b, W the packed [2 I, K] gate/up weight (gate rows
 * first); returns 0, or 1 when the shape or the machine is not one this kernel takes. */
int amx_swiglu(const uint16_t *x, int64_t ldx, const uint16_t *w_packed, const float *bias, uint16_t *y,
               int64_t ldy, int64_t m, int64_t intermediate, int64_t k, int num_threads) {
#if HAVE_AMX
  if (intermediate % 16 || intermediate <= 0 || k % 32 || k <= 0 || m < 0 || !amx_permission()) return 1;
  run(x, ldx, w_packed, bias, y, ldy, m, intermediate / 8, k, 1, num_threads);
  return 0;
#else
  (void)x, (void)ldx, (void)w_packed, (void)bias, (void)y, (void)ldy, (void)m, (void)intermediate, (void)k,
      (void)num_threads;
  return 1;
#endif
}
