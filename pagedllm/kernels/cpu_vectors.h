/* The vector types of the CPU kernels (cpu_kernels.c, cpu_sampling.c): GCC (12 and later) / clang vector
   extensions. */

#ifndef PAGEDLLM_CPU_VECTORS_H
#define PAGEDLLM_CPU_VECTORS_H

#include <stdint.h>
#include <string.h>

/* 16 floats, the attention kernels' unit: one AVX-512 register, two AVX2 ones. */
#define LANES 16

typedef float f32x16 __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t i32x16 __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline f32x16 load16(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, f32x16 v) { memcpy(p, &v, sizeof v); }

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

typedef float fvec __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(VL * sizeof(int32_t))));

static inline fvec loadv(const float *p) {
    fvec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storev(float *p, fvec v) { memcpy(p, &v, sizeof v); }

#endif
