/* Cephes' single-precision exp (http://www.netlib.org/cephes/, expf.c): range reduction by
 * n = round(x / ln 2) with ln 2 split in two parts, then a degree-6 polynomial on the reduced
 * argument; about 2 ulp. Written as expressions that work on a float and, through GCC/Clang vector
 * extensions, on a vector of floats alike, so the scalar and the vector kernels share them.
 * exp(x) = CEPHES_EXPF_POLY(r) * 2^n with r = CEPHES_EXPF_REDUCE(x, n). */
#ifndef BATCHGEN_CEPHES_EXPF_H
#define BATCHGEN_CEPHES_EXPF_H

/* Below this, float32 exp underflows: the kernels return 0 there. */
#define CEPHES_EXPF_MIN_ARG (-87.3f)
#define CEPHES_EXPF_LOG2E 1.44269504088896341f

#define CEPHES_EXPF_REDUCE(x, n) ((x) - (n) * 0.693359375f + (n) * 2.12194440e-4f)

#define CEPHES_EXPF_POLY(r)                                                                          \
  ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) +                \
      4.1665795894e-2f) * (r) + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) + (r) + 1.f)

#endif
