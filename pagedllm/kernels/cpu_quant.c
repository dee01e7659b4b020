/* Linear layers on GGUF-quantized weights kept packed, for batches of decode size (built by cpu_kernels.py with the
   other CPU kernels; wrapped by cpu_quant.py).

   y [m, n] = x [m, k] · w [n, k]^T (+ bias), x and y float32 or bfloat16 (`bf16` = 0 / 1). The weight comes in groups
   of 32 inputs per output row: 4-bit (w = d * q + c, q in 0..15: GGUF's Q4_0 / Q4_1) or 8-bit (w = d * q, q in
   -128..127: Q8_0), d and c float32 per group. The groups of a row go in pairs, their bytes interleaved two at a
   time (cpu_quant.py packs them; k is padded to whole pairs):
     4-bit, 32 bytes a pair: for t in 0..7, group 0's bytes 2t, 2t + 1, then group 1's; a byte holds input j of its
       group in its low nibble and input j + 16 in its high one (GGUF's bytes);
     8-bit, 64 bytes a pair: for h in 0..1, for t in 0..7, group 0's inputs 16h + 2t, 16h + 2t + 1, then group 1's.
   The output rows go in quads (n padded to a multiple of 4): per quad and pair one block, the 4 rows' pair bytes,
   then their factors (float32 d0, d1, c0, c1 for 4-bit; d0, d1 for 8-bit), so a thread reads one stream.
   x is laid out the same way (64 values a pair: for h, t, group, the inputs 16h + 2t and 16h + 2t + 1), so the
   i-th weight of a pair's block meets the i-th x value, and each 32-bit lane of an int16 dot product holds one group.

   Two kernels, one result up to float rounding:
   - float (any CPU; float32 x): per pair the weights as floats (4-bit: looked up in the group's table of its 16
     values d * q + c, the values torch's dequantization gives) times x, summed in 16 float lanes. Each weight costs
     a lookup or a conversion and a multiply-add.
   - int16 (AVX-512 VNNI; bfloat16 x): x is scaled to int16 per group by a power of two (see quantize_x: exact for
     all but the values far below their group's largest), each group's sum q · x_int16 exact in int32 (vpdpwssd: two
     products a lane per instruction), then times d and the scale in float, and the c terms from the float sums of x
     per group. About half the instructions of the float kernel.
   Rows of x go 1, 2 or 4 at a time over each run of output rows (a weight comes from memory once, then from L1);
   threads split the output rows in contiguous runs of 4. Each result is rounded once to the output dtype. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vectors.h"

#define GROUP 32
#define PAIR 64 /* inputs of a pair of groups */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__)
#define HAS_INT16 1
#else
#define HAS_INT16 0
#endif

/* Whether the int16 kernel is built (else q*_linear with int16 = 1 computes nothing and returns 0). */
int quant_int16(void) { return HAS_INT16; }

static inline float lane_sum(f32x16 v) {
#ifdef __AVX512F__
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += v[l];
    return s;
#endif
}

/* x [m, k] (rows of stride x_row) in the pair layout, float32 [m, kp] (zeros past k): for each pair, h, t, group,
   the inputs 16h + 2t and 16h + 2t + 1 of the group. */
static void arrange_x(const void *x, int64_t x_row, int64_t m, int64_t k, int64_t kp, int bf16, float *xf) {
    float row[kp];
    for (int64_t r = 0; r < m; r++) {
        for (int64_t i = 0; i < kp; i++)
            row[i] = i >= k ? 0.0f
                   : bf16   ? bf16_value(((const uint16_t *)x)[r * x_row + i])
                            : ((const float *)x)[r * x_row + i];
        float *dst = xf + r * kp;
        for (int64_t p = 0; p < kp; p += PAIR)
            for (int h = 0; h < 2; h++)
                for (int t = 0; t < 8; t++)
                    for (int grp = 0; grp < 2; grp++, dst += 2) {
                        dst[0] = row[p + grp * GROUP + h * 16 + 2 * t];
                        dst[1] = row[p + grp * GROUP + h * 16 + 2 * t + 1];
                    }
    }
}

/* ---- the float kernel */

/* 16 weights of a 4-bit pair block: the 16 bytes at q (their low or high nibbles), looked up in t0 / t1 by the
   group of each byte (bit 4 of the index picks t1). */
static inline f32x16 q4_lookup(const uint8_t *q, int high, f32x16 t0, f32x16 t1) {
#ifdef __AVX512F__
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    const __m512i sel = _mm512_set_epi32(16, 16, 0, 0, 16, 16, 0, 0, 16, 16, 0, 0, 16, 16, 0, 0);
    const __m512i nib = high ? _mm512_srli_epi32(b, 4) : _mm512_and_si512(b, _mm512_set1_epi32(15));
    return (f32x16)_mm512_permutex2var_ps((__m512)t0, _mm512_or_si512(nib, sel), (__m512)t1);
#else
    f32x16 w;
    for (int i = 0; i < 16; i++) {
        const int v = high ? q[i] >> 4 : q[i] & 15;
        w[i] = (i / 2) % 2 ? t1[v] : t0[v];
    }
    return w;
#endif
}

/* 16 weights of an 8-bit pair block: the 16 bytes at q times their group's d (d01: d0, d0, d1, d1, ...). */
static inline f32x16 q8_scaled(const int8_t *q, f32x16 d01) {
#ifdef __AVX512F__
    return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))) * d01;
#else
    f32x16 w;
    for (int i = 0; i < 16; i++) w[i] = (float)q[i] * d01[i];
    return w;
#endif
}

/* The 4 output rows of quad `quad` times nr rows of x (from r0) into result[r * 4 + jj], float kernel. */
static inline __attribute__((always_inline)) void float_rows(int bits, int nr, const uint8_t *blob, const float *xf,
                                                             int64_t kp, int64_t quad, int64_t r0, float *result) {
    const int64_t pairs = kp / PAIR, qbytes = bits == 4 ? 32 : 64, fnum = bits == 4 ? 4 : 2;
    const int64_t block = 4 * (qbytes + fnum * 4);
    const f32x16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    f32x16 acc[4][4] = {{{0}}};
    for (int64_t p = 0; p < pairs; p++) {
        const uint8_t *base = blob + (quad * pairs + p) * block;
        for (int jj = 0; jj < 4; jj++) {
            const uint8_t *q = base + jj * qbytes;
            const float *f = (const float *)(base + 4 * qbytes) + jj * fnum; /* d0, d1 (, c0, c1) */
            f32x16 w[4];
            if (bits == 4) {
                const f32x16 t0 = iota * f[0] + f[2], t1 = iota * f[1] + f[3];
                for (int part = 0; part < 4; part++) w[part] = q4_lookup(q + 16 * (part % 2), part / 2, t0, t1);
            } else {
                f32x16 d01;
                for (int i = 0; i < 16; i++) d01[i] = f[(i / 2) % 2];
                for (int part = 0; part < 4; part++) w[part] = q8_scaled((const int8_t *)q + 16 * part, d01);
            }
            for (int r = 0; r < nr; r++) {
                const float *xp = xf + (r0 + r) * kp + p * PAIR;
                acc[r][jj] += w[0] * load16(xp) + w[1] * load16(xp + 16) + w[2] * load16(xp + 32) +
                              w[3] * load16(xp + 48);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int jj = 0; jj < 4; jj++) result[r * 4 + jj] = lane_sum(acc[r][jj]);
}

/* ---- the int16 kernel */

#if HAS_INT16
/* x rows (in the pair layout, float32) as int16 [m, kp], each group with its scale s = 2^e, the smallest power of
   two with max|x| / s below 2^15 ([m, kp / 32]): a bfloat16 value within 2^7 of its group's largest is exact, a
   smaller one off by at most s / 2 (under 1/64 of the rounding of the group's largest value to bfloat16); and the
   float sums of x per group [m, kp / 32] (for the c terms). The group of pair-layout index i: pair * 2 + (i % 4) / 2. */
static void quantize_x(const float *xf, int64_t m, int64_t kp, int16_t *xq, float *scales, float *sums) {
    const int64_t groups = kp / GROUP;
    for (int64_t r = 0; r < m; r++) {
        const float *src = xf + r * kp;
        float *top = scales + r * groups, *sum = sums + r * groups;
        for (int64_t g = 0; g < groups; g++) top[g] = sum[g] = 0.0f;
        for (int64_t i = 0; i < kp; i++) {
            const int64_t g = (i / PAIR) * 2 + (i % 4) / 2;
            top[g] = fmaxf(top[g], fabsf(src[i]));
            sum[g] += src[i];
        }
        for (int64_t g = 0; g < groups; g++) {
            int e;
            frexpf(top[g], &e); /* top < 2^e */
            top[g] = top[g] > 0.0f ? ldexpf(1.0f, e - 15) : 1.0f;
        }
        for (int64_t i = 0; i < kp; i++) {
            const float v = src[i] / top[(i / PAIR) * 2 + (i % 4) / 2];
            xq[r * kp + i] = (int16_t)lrintf(fminf(fmaxf(v, -32767.0f), 32767.0f));
        }
    }
}

/* the two floats at f in alternate lanes (lane l: f[l % 2], the group of the lane's int32 sum) */
static inline __m512 pair_factors(const float *f) {
    return _mm512_broadcast_f32x2(_mm_castpd_ps(_mm_load_sd((const double *)f)));
}

static inline __attribute__((always_inline)) void int16_rows(int bits, int nr, const uint8_t *blob,
                                                             const int16_t *xq, const float *scales,
                                                             const float *sums, int64_t kp, int64_t quad, int64_t r0,
                                                             float *result) {
    const int64_t pairs = kp / PAIR, groups = kp / GROUP, qbytes = bits == 4 ? 32 : 64, fnum = bits == 4 ? 4 : 2;
    const int64_t block = 4 * (qbytes + fnum * 4);
    __m512 acc[4][4];
    float offset[4][4] = {{0}};
    for (int r = 0; r < nr; r++)
        for (int jj = 0; jj < 4; jj++) acc[r][jj] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const uint8_t *base = blob + (quad * pairs + p) * block;
        for (int jj = 0; jj < 4; jj++) {
            const uint8_t *q = base + jj * qbytes;
            const float *f = (const float *)(base + 4 * qbytes) + jj * fnum; /* d0, d1 (, c0, c1) */
            __m512i lo, hi;
            if (bits == 4) {
                const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)q));
                lo = _mm512_and_si512(w, _mm512_set1_epi16(15));
                hi = _mm512_srli_epi16(w, 4);
            } else {
                lo = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)q));
                hi = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32)));
            }
            const __m512 d01 = pair_factors(f);
            for (int r = 0; r < nr; r++) {
                const int16_t *xp = xq + (r0 + r) * kp + p * PAIR;
                const float *sc = scales + (r0 + r) * groups + 2 * p;
                __m512i s = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xp));
                s = _mm512_dpwssd_epi32(s, hi, _mm512_loadu_si512(xp + 32));
                acc[r][jj] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d01, pair_factors(sc)), acc[r][jj]);
                if (bits == 4) {
                    const float *sg = sums + (r0 + r) * groups + 2 * p;
                    offset[r][jj] += f[2] * sg[0] + f[3] * sg[1];
                }
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int jj = 0; jj < 4; jj++) result[r * 4 + jj] = _mm512_reduce_add_ps(acc[r][jj]) + offset[r][jj];
}
#endif

/* ---- the calls */

typedef struct {
    int bf16, int16;
    const uint8_t *blob;
    const float *bias, *xf, *scales, *sums;
    const int16_t *xq;
    void *out;
    int64_t m, n, kp;
} Job;

static inline __attribute__((always_inline)) void rows_of(const Job *job, int bits, int nr, int64_t quad, int64_t r0,
                                                          float *result) {
#if HAS_INT16
    if (job->int16) {
        int16_rows(bits, nr, job->blob, job->xq, job->scales, job->sums, job->kp, quad, r0, result);
        return;
    }
#endif
    float_rows(bits, nr, job->blob, job->xf, job->kp, quad, r0, result);
}

/* The 4 output rows of a quad for every row of x, x rows 1, 2 or 4 at a time; biased and stored (rows past n, the
   packing's padding, are not). */
static inline __attribute__((always_inline)) void out_rows(const Job *job, int bits, int64_t quad) {
    float result[16];
    for (int64_t r0 = 0; r0 < job->m;) {
        const int64_t left = job->m - r0;
        const int nr = left >= 4 ? 4 : left >= 2 ? 2 : 1;
        if (nr == 4)
            rows_of(job, bits, 4, quad, r0, result);
        else if (nr == 2)
            rows_of(job, bits, 2, quad, r0, result);
        else
            rows_of(job, bits, 1, quad, r0, result);
        for (int r = 0; r < nr; r++)
            for (int jj = 0; jj < 4 && quad * 4 + jj < job->n; jj++) {
                const int64_t j = quad * 4 + jj, at = (r0 + r) * job->n + j;
                const float v = result[r * 4 + jj] + (job->bias ? job->bias[j] : 0.0f);
                if (job->bf16)
                    ((uint16_t *)job->out)[at] = (uint16_t)(bf16_bits(v) >> 16);
                else
                    ((float *)job->out)[at] = v;
            }
        r0 += nr;
    }
}

#define DEFINE_RUN(name, bits)                                                     \
    static void name(const Job *job, int threads) {                                \
        const int64_t quads = (job->n + 3) / 4;                                    \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")          \
        for (int64_t quad = 0; quad < quads; quad++) out_rows(job, bits, quad);    \
    }
DEFINE_RUN(run4, 4)
DEFINE_RUN(run8, 8)

/* y = x · w^T (+ bias): blob the packed weight (see the top), n output rows (padded to quads in the blob); x [m, k]
   rows of stride x_row, k <= kp; out [m, n] contiguous; int16: the int16 kernel (quant_int16() must be 1). Returns 0
   when out of memory or the int16 kernel is not built (nothing computed). */
int quant_linear(int bits, const void *x, int64_t x_row, const uint8_t *blob, const float *bias, void *out, int64_t m,
                 int64_t n, int64_t k, int64_t kp, int bf16, int int16, int threads) {
    if (int16 && !HAS_INT16) return 0;
    const int64_t floats = m * kp + (int16 ? 2 * m * (kp / GROUP) : 0);
    float *xf = malloc(floats * sizeof(float) + (int16 ? m * kp * sizeof(int16_t) : 0));
    if (!xf) return 0;
    arrange_x(x, x_row, m, k, kp, bf16, xf);
    Job job = {bf16, int16, blob, bias, xf, NULL, NULL, NULL, out, m, n, kp};
#if HAS_INT16
    if (int16) {
        job.scales = xf + m * kp;
        job.sums = job.scales + m * (kp / GROUP);
        job.xq = (const int16_t *)(xf + floats);
        quantize_x(xf, m, kp, (int16_t *)job.xq, (float *)job.scales, (float *)job.sums);
    }
#endif
    if (bits == 4)
        run4(&job, threads);
    else
        run8(&job, threads);
    free(xf);
    return 1;
}
