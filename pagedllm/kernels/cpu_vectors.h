/* The vector types of the CPU kernels (cpu_kernels.c, cpu_matmul.c, cpu_sampling.c): GCC (12 and later) / clang
   vector extensions; and their bfloat16 conversions. */

#ifndef PAGEDLLM_CPU_VECTORS_H
#define PAGEDLLM_CPU_VECTORS_H

#include <stdint.h>
#include <string.h>

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

#endif
