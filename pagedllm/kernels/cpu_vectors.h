/* The vector types of the CPU kernels (cpu_kernels.c, cpu_matmul.c, cpu_sampling.c): GCC (12 and later) / clang
   vector extensions; and their bfloat16 conversions. */

#ifndef PAGEDLLM_CPU_VECTORS_H
#define PAGEDLLM_CPU_VECTORS_H

#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* A float and an int32 vector type of n lanes with their unaligned load and store. */
#define VECTOR_TYPES(f, i, n, load, store)                                 \
    typedef float f __attribute__((vector_size((n) * sizeof(float))));     \
    typedef int32_t i __attribute__((vector_size((n) * sizeof(int32_t)))); \
    static inline f load(const float *p) {                                  \
        f v;                                                                \
        memcpy(&v, p, sizeof v);                                            \
        return v;                                                           \
    }                                                                       \
    static inline void store(float *p, f v) { memcpy(p, &v, sizeof v); }

/* 16 floats, the attention kernels' unit: one AVX-512 register, two AVX2 ones. */
#define LANES 16
VECTOR_TYPES(f32x16, i32x16, LANES, load16, store16)

/* Vectors of the CPU's own width (VL floats): 16 with AVX-512, else 8 (one AVX2 register, two SSE or NEON ones).
   Without AVX-512, GCC turns comparisons and conversions of 16-float vectors into scalar code. FULL_WIDTH: a 16-float
   vector is one register. */
#ifdef __AVX512F__
#define FULL_WIDTH 1
#define VL 16
#else
#define FULL_WIDTH 0
#define VL 8
#endif
VECTOR_TYPES(fvec, ivec, VL, loadv, storev)

/* x rounded to bfloat16 (nearest even, as torch rounds; NaN stays a quiet NaN), in the float32 bits' top half */
static inline uint32_t bf16_bits(float x) {
    union {
        float f;
        uint32_t u;
    } v = {x};
    return (v.u & 0x7fffffffu) > 0x7f800000u ? (v.u | 0x400000u) & 0xffff0000u
                                              : (v.u + 0x7fffu + ((v.u >> 16) & 1u)) & 0xffff0000u;
}

/* a bfloat16 value (its raw 16 bits) as the float32 it is exactly */
static inline float bf16_value(uint16_t bits) {
    const union {
        uint32_t u;
        float f;
    } v = {(uint32_t)bits << 16};
    return v.f;
}

/* ---- lane operations on fvec (the sampler's kernels) */

static inline fvec selectv(ivec mask, fvec a, fvec b) {
    return (fvec)(((ivec)a & mask) | ((ivec)b & ~mask));
}

static inline fvec maxv(fvec a, fvec b) { return selectv((ivec)(a > b), a, b); }

static inline float largestv(fvec v) {
    float m = v[0];
    for (int l = 1; l < VL; l++) m = v[l] > m ? v[l] : m;
    return m;
}

static inline float totalv(fvec v) {
    float s = 0.0f;
    for (int l = 0; l < VL; l++) s += v[l];
    return s;
}

/* 2^t of a vector of t <= 0 (NaN and -inf: 0): t = n + f (n an integer, |f| <= 1/2), 2^f by its Taylor polynomial
   of degree 6 (relative error below 2e-7), times 2^n: with AVX-512 by scalef (below 2^-149: 0), elsewhere built in
   the exponent bits (below 2^-126: 0). */
static inline fvec exp2v(fvec t) {
#ifdef __AVX512F__
    const __m512 c = _mm512_max_ps((__m512)t, _mm512_set1_ps(-160.0f)); /* NaN: -160 (max takes its second) */
    const __m512 n = _mm512_roundscale_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(c, n);
    __m512 p = _mm512_set1_ps(1.5403530393e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return (fvec)_mm512_scalef_ps(p, n);
#else
    const fvec lowest = (fvec){0} - 126.0f;
    const ivec inside = (ivec)(t > lowest); /* false for NaN, -inf and t <= -126 */
    const fvec c = selectv(inside, t, lowest);
    const fvec n = (c + 12582912.0f) - 12582912.0f; /* rounded to the nearest integer (1.5 * 2^23) */
    const fvec f = c - n;
    fvec p = (fvec){0} + 1.5403530393e-4f;
    p = p * f + 1.3333558146e-3f;
    p = p * f + 9.6181291076e-3f;
    p = p * f + 5.5504108665e-2f;
    p = p * f + 2.4022650696e-1f;
    p = p * f + 6.9314718056e-1f;
    p = p * f + 1.0f;
    const fvec two_n = (fvec)((__builtin_convertvector(n, ivec) + 127) << 23);
    return (fvec)((ivec)(p * two_n) & inside);
#endif
}

#endif
