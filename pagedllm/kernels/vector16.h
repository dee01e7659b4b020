/* 16-float vectors for the CPU kernels: GCC (12 and later) / clang vector extensions, one AVX-512 register or two
   AVX2 ones. */

#ifndef PAGEDLLM_VECTOR16_H
#define PAGEDLLM_VECTOR16_H

#include <stdint.h>
#include <string.h>

#define LANES 16

typedef float f32x16 __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t i32x16 __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline f32x16 load16(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, f32x16 v) { memcpy(p, &v, sizeof v); }

/* exp(x) of 16 values x <= 0 (or -inf), in vector arithmetic (libm's expf is a call per value): 2^n e^r with
   n = round(x / ln 2) (adding and subtracting 1.5 * 2^23 rounds to nearest), r = x - n ln 2 (ln 2 in two parts,
   for exactness), e^r by a degree-7 polynomial (relative error about 1e-7, 1-2 float ulps); below -87 it is 0. */
static inline f32x16 exp16(f32x16 x) {
    const f32x16 zero = {0}, lowest = zero - 87.0f;
    const i32x16 under = (i32x16)(x < lowest); /* all ones where x < -87 */
    const f32x16 y = (f32x16)(((i32x16)x & ~under) | ((i32x16)lowest & under));
    const f32x16 n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const f32x16 r = (y - n * 0.693359375f) + n * 2.12194440e-4f;
    f32x16 p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const f32x16 two_n = (f32x16)((__builtin_convertvector(n, i32x16) + 127) << 23);
    return (f32x16)((i32x16)(p * two_n) & ~under);
}

#endif
