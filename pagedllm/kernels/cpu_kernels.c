/* CPU kernels of the torch attention backend, built at first use by cpu_kernels.py (cc -O3 -march=native).

   Cache layout (torch_backend.allocate_kv_cache): K and V each [num_kv_heads, num_blocks, block_size, head_dim], a
   head's part of a block one run of memory. Values are float32 or bfloat16 (`bf16` = 0 / 1; bfloat16 as its raw 16
   bits); every sum runs in float32. Vectors: cpu_vectors.h (the attention in 16-float vectors). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vectors.h"

#define MAX_GROUP 16           /* query heads per kv head */
#define MAX_DIM 256            /* head_dim, a multiple of LANES */
#define MAX_BLOCK_VALUES 8192  /* block_size * head_dim */

/* The 16 lane sums of v[0..15] as one vector (lane t: the sum of v[t]), by a tree of shuffles and adds: each level
   halves the lanes every value is spread over, keeping the values side by side. */
static inline f32x16 sum_lanes16(const f32x16 *v) {
    f32x16 w[8], u[4], z[2];
    for (int i = 0; i < 8; i++) { /* w[i]: value i in lanes 0-7, value i + 8 in lanes 8-15 */
        w[i] = __builtin_shufflevector(v[i], v[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[i], v[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 4; i++) { /* u[i]: values i, i + 4, i + 8, i + 12 in 4 lanes each */
        u[i] = __builtin_shufflevector(w[i], w[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(w[i], w[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
    for (int i = 0; i < 2; i++) { /* z[i]: values i, i + 2, ..., i + 14 in 2 lanes each */
        z[i] = __builtin_shufflevector(u[i], u[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(u[i], u[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
    return __builtin_shufflevector(z[0], z[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(z[0], z[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

/* n values at src (float32 or bfloat16) to float32 at dst */
static void to_float(float *restrict dst, const void *restrict src, int64_t n, int bf16) {
    if (!bf16) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    const uint16_t *s = src;
    uint32_t *d = (uint32_t *)dst;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) d[i] = (uint32_t)s[i] << 16;
}

/* n float32 values to dst (float32 or bfloat16) */
static void from_float(void *restrict dst, const float *restrict src, int64_t n, int bf16) {
    if (!bf16) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    uint16_t *d = dst;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) d[i] = (uint16_t)(bf16_bits(src[i]) >> 16);
}

/* exp(x) of the values x <= 0 (or -inf) of a vector, in vector arithmetic (libm's expf is a call per value): 2^n e^r
   with n = round(x / ln 2) (adding and subtracting 1.5 * 2^23 rounds to nearest), r = x - n ln 2 (ln 2 in two parts,
   for exactness), e^r by a degree-7 polynomial (relative error about 1e-7, 1-2 float ulps); below -87 it is 0. */
#define DEFINE_EXP(name, fvec, ivec)                                                    \
    static inline fvec name(fvec x) {                                                   \
        const fvec zero = {0}, lowest = zero - 87.0f;                                   \
        const ivec under = (ivec)(x < lowest); /* all ones where x < -87 */             \
        const fvec y = (fvec)(((ivec)x & ~under) | ((ivec)lowest & under));             \
        const fvec n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f;         \
        const fvec r = (y - n * 0.693359375f) + n * 2.12194440e-4f;                     \
        fvec p = zero + 1.9875691500e-4f;                                               \
        p = p * r + 1.3981999507e-3f;                                                   \
        p = p * r + 8.3334519073e-3f;                                                   \
        p = p * r + 4.1665795894e-2f;                                                   \
        p = p * r + 1.6666665459e-1f;                                                   \
        p = p * r + 5.0000001201e-1f;                                                   \
        p = p * r * r + r + 1.0f;                                                       \
        const fvec two_n = (fvec)((__builtin_convertvector(n, ivec) + 127) << 23);      \
        return (fvec)((ivec)(p * two_n) & ~under);                                      \
    }

/* exp16 at full width; without it (cpu_vectors.h), on two halves of 8 (expv: the CPU's width, for SiLU) */
#if FULL_WIDTH
DEFINE_EXP(exp16, f32x16, i32x16)
#define expv exp16
#else
DEFINE_EXP(expv, fvec, ivec)

static inline f32x16 exp16(f32x16 x) {
    const fvec lo = expv(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7));
    const fvec hi = expv(__builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#endif

/* Whether the attention kernels run at full width here (cpu_kernels.supports asks; elsewhere the torch backend keeps
   its torch ops). */
int full_width_vectors(void) { return FULL_WIDTH; }

/* The running softmax state of one query head over the keys seen so far. */
typedef struct {
    float max, sum;
    float acc[MAX_DIM];
} Running;

/* Folds tokens [t0, t1) of one cache block into the states of the `group` query heads q[g]: keys and values
   [block_size][dim], float32. */
static void attend_block(Running *restrict state, const float (*q)[MAX_DIM], int64_t group,
                         const float *restrict keys, const float *restrict values, int64_t t0, int64_t t1,
                         int64_t dim, float scale) {
    for (int64_t g = 0; g < group; g++) {
        Running *st = &state[g];
        for (int64_t c0 = t0 - t0 % LANES; c0 < t1; c0 += LANES) { /* LANES tokens at a time */
            const int64_t n = t1 - c0 < LANES ? t1 - c0 : LANES;
            f32x16 dots[LANES]; /* per token, the products summed over dim / LANES vectors */
            for (int64_t i = 0; i < LANES; i++) {
                const float *k = keys + (c0 + i) * dim;
                f32x16 a = {0}, b = {0};
                if (i < n) {
                    for (int64_t d = 0; d < dim; d += 2 * LANES) { /* dim is a multiple of LANES */
                        a += load16(q[g] + d) * load16(k + d);
                        if (d + LANES < dim) b += load16(q[g] + d + LANES) * load16(k + d + LANES);
                    }
                }
                dots[i] = a + b;
            }
            const f32x16 s = sum_lanes16(dots);
            float p[LANES], top = st->max;
            store16(p, s * scale);
            for (int64_t i = 0; i < LANES; i++) {
                const int64_t t = c0 + i;
                if (t < t0 || t >= t1) p[i] = -INFINITY; /* outside the range, or past the block */
                top = p[i] > top ? p[i] : top;
            }
            const f32x16 zero = {0}, e = exp16(load16(p) - top);
            const float keep = exp16(zero + (st->max - top))[0]; /* 0 while max is -inf */
            store16(p, e);
            float sum = 0.0f;
            for (int64_t i = 0; i < LANES; i++) sum += p[i];
            st->max = top;
            st->sum = st->sum * keep + sum;
            const float *v = values + c0 * dim;
            for (int64_t d0 = 0; d0 < dim; d0 += LANES) {
                f32x16 a0 = load16(st->acc + d0) * keep, a1 = {0}, a2 = {0}, a3 = {0};
                int64_t i = 0;
                for (; i + 4 <= n; i += 4) {
                    a0 += p[i] * load16(v + i * dim + d0);
                    a1 += p[i + 1] * load16(v + (i + 1) * dim + d0);
                    a2 += p[i + 2] * load16(v + (i + 2) * dim + d0);
                    a3 += p[i + 3] * load16(v + (i + 3) * dim + d0);
                }
                for (; i < n; i++) a0 += p[i] * load16(v + i * dim + d0);
                store16(st->acc + d0, (a0 + a1) + (a2 + a3));
            }
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define BF16_DOT 1 /* the CPU has bfloat16 pair dot products (vdpbf16ps): bfloat16 caches are read as they are */

/* A 32-value chunk of bfloat16 keys or values (its first n <= 32 values; the rest read as zeros, never loaded) */
static inline __m512i load_chunk(const uint16_t *p, int64_t n) {
    return n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1u), p);
}

/* The accumulator lane of dim d in the p·V sums below: unpacking two tokens' 32-value chunks interleaves them per
   128-bit lane, so a chunk's low accumulator holds dims 8L + 0..3 in lanes 4L + 0..3 and its high one dims
   8L + 4..7 (L = 0..3); chunk c's two accumulators are acc[32c .. 32c + 15] and acc[32c + 16 .. 32c + 31]. */
static inline int64_t unpacked_lane(int64_t d) {
    const int64_t c = d / 32, in = d % 32, L = in / 8, i = in % 8;
    return 32 * c + (i < 4 ? 4 * L + i : 16 + 4 * L + i - 4);
}

static const __m512i lane_index = {0x100000000, 0x300000002, 0x500000004, 0x700000006,
                                   0x900000008, 0xb0000000a, 0xd0000000c, 0xf0000000e}; /* int32 lanes 0..15 */

/* attend_block straight from a bfloat16 cache block, for the `group` query heads together: each key and value
   chunk is loaded once for all of them. q·k as bfloat16 pair dot products (exact products, float32 sums), p·V with
   each probability rounded to bfloat16 (the rounded value also goes into the softmax sum) and two tokens' values
   interleaved by unpacking, into accumulators in the order unpacked_lane gives. q: the group's query heads as
   32-value chunks, [group][chunks]. Every head's sums run in the order of a head alone. Inlined with a constant
   group where attend_group_bf16 dispatches on it, so that the heads' accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_block_bf16(Running *restrict state, const __m512i *q,
                                                                    const int64_t group,
                                                                    const uint16_t *restrict keys,
                                                                    const uint16_t *restrict values, int64_t t0,
                                                                    int64_t t1, int64_t dim, float scale) {
    const int64_t chunks = (dim + 31) / 32;
    for (int64_t c0 = t0 - t0 % LANES; c0 < t1; c0 += LANES) { /* LANES tokens at a time */
        const int64_t n = t1 - c0 < LANES ? t1 - c0 : LANES;
        f32x16 dots[MAX_GROUP][LANES];
        for (int64_t i = 0; i < LANES; i++) {
            if (i >= n) {
                for (int64_t g = 0; g < group; g++) dots[g][i] = (f32x16){0};
                continue;
            }
            const uint16_t *k = keys + (c0 + i) * dim;
            __m512i kc[MAX_DIM / 32];
            for (int64_t c = 0; c < chunks; c++) kc[c] = load_chunk(k + 32 * c, dim - 32 * c);
            for (int64_t g = 0; g < group; g++) {
                __m512 a = _mm512_setzero_ps();
                for (int64_t c = 0; c < chunks; c++) a = _mm512_dpbf16_ps(a, (__m512bh)kc[c], (__m512bh)q[g * chunks + c]);
                dots[g][i] = (f32x16)a;
            }
        }
        const __m512i index = _mm512_add_epi32(_mm512_set1_epi32((int)c0), lane_index);
        const __mmask16 inside = _mm512_cmpge_epi32_mask(index, _mm512_set1_epi32((int)t0)) &
                                 _mm512_cmplt_epi32_mask(index, _mm512_set1_epi32((int)t1));
        /* per head, the probabilities rounded to bfloat16: 8 pairs of neighbouring tokens, as p·V takes them */
        uint32_t pairs[MAX_GROUP][LANES / 2];
        float sums[MAX_GROUP];
        f32x16 drop = {0}; /* lane g: head g's old max minus its new one */
        for (int64_t g = 0; g < group; g++) {
            Running *st = &state[g];
            const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), inside,
                                                _mm512_mul_ps((__m512)sum_lanes16(dots[g]), _mm512_set1_ps(scale)));
            const float top = fmaxf(st->max, _mm512_reduce_max_ps(s));
            _mm256_storeu_si256((__m256i *)pairs[g], (__m256i)_mm512_cvtneps_pbh((__m512)exp16((f32x16)s - top)));
            const __m512 rounded = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)pairs[g])), 16));
            sums[g] = _mm512_reduce_add_ps(rounded);
            drop[g] = st->max - top;
            st->max = top;
        }
        const f32x16 keep = exp16(drop); /* lane g: head g's rescale, 0 while its max is -inf */
        for (int64_t g = 0; g < group; g++) state[g].sum = state[g].sum * keep[g] + sums[g];
        const uint16_t *v = values + c0 * dim;
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t left = dim - 32 * c;
            __m512 lo[MAX_GROUP], hi[MAX_GROUP];
            for (int64_t g = 0; g < group; g++) {
                lo[g] = _mm512_mul_ps(_mm512_loadu_ps(state[g].acc + 32 * c), _mm512_set1_ps(keep[g]));
                hi[g] = _mm512_mul_ps(_mm512_loadu_ps(state[g].acc + 32 * c + 16), _mm512_set1_ps(keep[g]));
            }
            for (int64_t i = 0; i < n; i += 2) { /* tokens i and i + 1 (a zero past the end) */
                const __m512i a = load_chunk(v + i * dim + 32 * c, left);
                const __m512i b = i + 1 < n ? load_chunk(v + (i + 1) * dim + 32 * c, left) : _mm512_setzero_si512();
                const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(a, b), high = (__m512bh)_mm512_unpackhi_epi16(a, b);
                for (int64_t g = 0; g < group; g++) {
                    const __m512bh pair = (__m512bh)_mm512_set1_epi32((int)pairs[g][i / 2]);
                    lo[g] = _mm512_dpbf16_ps(lo[g], low, pair);
                    hi[g] = _mm512_dpbf16_ps(hi[g], high, pair);
                }
            }
            for (int64_t g = 0; g < group; g++) {
                _mm512_storeu_ps(state[g].acc + 32 * c, lo[g]);
                _mm512_storeu_ps(state[g].acc + 32 * c + 16, hi[g]);
            }
        }
    }
}
#endif

#ifdef BF16_DOT
/* attend_block_bf16 with the group sizes of common models as constants */
static void attend_group_bf16(Running *restrict state, const __m512i *q, int64_t group, const uint16_t *keys,
                              const uint16_t *values, int64_t t0, int64_t t1, int64_t dim, float scale) {
#define ATTEND(G) attend_block_bf16(state, q, G, keys, values, t0, t1, dim, scale)
    switch (group) {
        case 1: ATTEND(1); break;
        case 2: ATTEND(2); break;
        case 3: ATTEND(3); break;
        case 4: ATTEND(4); break;
        case 5: ATTEND(5); break;
        case 6: ATTEND(6); break;
        case 7: ATTEND(7); break;
        case 8: ATTEND(8); break;
        default: ATTEND(group);
    }
#undef ATTEND
}
#endif

/* Decode attention: one query token per row r (a decode, or one token of a short prefill chunk), over its request's
   first seq_lens[r] cached tokens (the last sliding_window of them when sliding_window > 0). One work item per (row,
   kv head): its `group` query heads read each key and value once, a block at a time, with an online softmax.

   q and out are read / written at rows token_rows[r] ([*, num_heads, head_dim], strides q_tok / q_head and o_tok /
   o_head); block_table [num_rows, *] (row stride bt_row), each row's request's blocks; seq_lens [num_rows]. */
void decode_attention(const void *q, int64_t q_tok, int64_t q_head, void *out, int64_t o_tok, int64_t o_head,
                      const int64_t *token_rows, const void *k_cache, const void *v_cache, const int64_t *block_table,
                      int64_t bt_row, const int64_t *seq_lens, int64_t num_rows, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks, float scale,
                      int64_t sliding_window, int bf16) {
    const int64_t group = num_heads / num_kv_heads, width = bf16 ? 2 : 4, block_values = block_size * head_dim;
#ifdef BF16_DOT
    const int in_place = bf16; /* bfloat16 caches are read in place, their blocks never converted */
#else
    const int in_place = 0;
#endif
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_rows * num_kv_heads; item++) {
        const int64_t r = item / num_kv_heads, h = item % num_kv_heads, row = token_rows[r];
        const int64_t len = seq_lens[r], *blocks = block_table + r * bt_row;
        const int64_t first = sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
        const char *q_item = (const char *)q + (row * q_tok + h * group * q_head) * width;
        Running state[MAX_GROUP];
        float qf[MAX_GROUP][MAX_DIM], keys[MAX_BLOCK_VALUES], values[MAX_BLOCK_VALUES];
#ifdef BF16_DOT
        __m512i qc[MAX_GROUP * MAX_DIM / 32]; /* the bfloat16 query heads as 32-value chunks, [group][chunks] */
        const int64_t chunks = (head_dim + 31) / 32;
#endif
        for (int64_t g = 0; g < group; g++) {
            const char *qg = q_item + g * q_head * width;
#ifdef BF16_DOT
            if (in_place)
                for (int64_t c = 0; c < chunks; c++)
                    qc[g * chunks + c] = load_chunk((const uint16_t *)qg + 32 * c, head_dim - 32 * c);
#endif
            if (!in_place) to_float(qf[g], qg, head_dim, bf16);
            state[g].max = -INFINITY;
            state[g].sum = 0.0f;
            memset(state[g].acc, 0, sizeof state[g].acc);
        }
        for (int64_t b = first / block_size; b * block_size < len; b++) {
            const int64_t start = b * block_size;
            const int64_t t0 = first > start ? first - start : 0;
            const int64_t t1 = len - start < block_size ? len - start : block_size;
            const int64_t offset = (h * num_blocks + blocks[b]) * block_values;
            /* the next block's keys and values start on their way from memory, into L2 (prefetching into L1 ran
               out of its miss buffers and was a third slower) */
            if ((b + 1) * block_size < len) {
                const int64_t next = (h * num_blocks + blocks[b + 1]) * block_values * width;
                for (int64_t byte = 0; byte < block_values * width; byte += 64) {
                    __builtin_prefetch((const char *)k_cache + next + byte, 0, 1);
                    __builtin_prefetch((const char *)v_cache + next + byte, 0, 1);
                }
            }
            /* only the slots up to the request's length: the rest of its last block may not be written yet */
#ifdef BF16_DOT
            if (in_place) {
                attend_group_bf16(state, qc, group, (const uint16_t *)k_cache + offset,
                                  (const uint16_t *)v_cache + offset, t0, t1, head_dim, scale);
                continue;
            }
#endif
            to_float(keys, (const char *)k_cache + offset * width, t1 * head_dim, bf16);
            to_float(values, (const char *)v_cache + offset * width, t1 * head_dim, bf16);
            attend_block(state, (const float(*)[MAX_DIM])qf, group, keys, values, t0, t1, head_dim, scale);
        }
        for (int64_t g = 0; g < group; g++) {
            float o[MAX_DIM];
            const float inv = 1.0f / state[g].sum;
#ifdef BF16_DOT
            if (in_place) {
                for (int64_t d = 0; d < head_dim; d++) o[d] = state[g].acc[unpacked_lane(d)] * inv;
            } else
#endif
                for (int64_t d = 0; d < head_dim; d++) o[d] = state[g].acc[d] * inv;
            from_float((char *)out + (row * o_tok + (h * group + g) * o_head) * width, o, head_dim, bf16);
        }
    }
}

/* Writes the new tokens' K and V (k, v [num_tokens, num_kv_heads, head_dim], row strides k_tok / v_tok, heads
   contiguous) to their cache slots; a slot below 0 is skipped. */
void write_kv(const void *k, int64_t k_tok, const void *v, int64_t v_tok, void *k_cache, void *v_cache,
              const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
              int bf16) {
    const int64_t width = bf16 ? 2 : 4, row = head_dim * width;
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] < 0) continue;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t dst = (h * num_slots + slots[i]) * row;
            for (int64_t byte = 0; byte < row; byte += 64) {
                __builtin_prefetch((char *)k_cache + dst + byte, 1, 3);
                __builtin_prefetch((char *)v_cache + dst + byte, 1, 3);
            }
        }
    }
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] < 0) continue;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t dst = (h * num_slots + slots[i]) * row;
            memcpy((char *)k_cache + dst, (const char *)k + (i * k_tok + h * head_dim) * width, row);
            memcpy((char *)v_cache + dst, (const char *)v + (i * v_tok + h * head_dim) * width, row);
        }
    }
}

/* ---- The decoder layers' element-wise ops, one pass each. They round to the model dtype where the torch layer
   code does (the residual sum, the normalized activations, the products), so both paths agree to a bit or two. */

#define CHUNK 1024 /* values converted to float32 at a time */

/* x rounded to bfloat16, as a float32 */
static inline float round_bf16(float x) {
    const union {
        uint32_t u;
        float f;
    } v = {bf16_bits(x)};
    return v.f;
}

static void round_all(float *x, int64_t n, int bf16) {
    if (!bf16) return;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = round_bf16(x[i]);
}

static float sum_squares(const float *h, int64_t n) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < n; i++) squares += h[i] * h[i];
    return squares;
}

/* RMSNorm's last steps on n values, as the torch layer does them: h * rstd rounded to the model dtype, times the
   weights w (the product is rounded by the caller's store) */
static void normalize(float *restrict h, const float *restrict w, int64_t n, float rstd, int bf16) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) h[i] *= rstd;
    round_all(h, n, bf16);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) h[i] *= w[i];
}

/* Per row of `rows`: with a residual, s = x + residual (rounded) goes to residual_out and is normalized; without,
   x is. out = weight * (s / sqrt(mean(s^2) + eps), rounded). x and residual rows are strided (x_row, r_row),
   out and residual_out contiguous [rows, dim]. */
void rms_norm(const void *x, int64_t x_row, const void *residual, int64_t r_row, void *residual_out,
              const void *weight, void *out, int64_t rows, int64_t dim, float eps, int bf16) {
    const int64_t width = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        float h[CHUNK], w[CHUNK];
        const char *src = (const char *)x + row * x_row * width;
        char *summed = residual ? (char *)residual_out + row * dim * width : NULL;
        float squares = 0.0f;
        for (int64_t c = 0; c < dim; c += CHUNK) {
            const int64_t n = dim - c < CHUNK ? dim - c : CHUNK;
            to_float(h, src + c * width, n, bf16);
            if (residual) {
                to_float(w, (const char *)residual + (row * r_row + c) * width, n, bf16);
#pragma omp simd
                for (int64_t i = 0; i < n; i++) h[i] += w[i];
                round_all(h, n, bf16);
                from_float(summed + c * width, h, n, bf16);
            }
            squares += sum_squares(h, n);
        }
        const float rstd = 1.0f / sqrtf(squares / (float)dim + eps);
        for (int64_t c = 0; c < dim; c += CHUNK) {
            const int64_t n = dim - c < CHUNK ? dim - c : CHUNK;
            to_float(h, (summed ? summed : src) + c * width, n, bf16);
            to_float(w, (const char *)weight + c * width, n, bf16);
            normalize(h, w, n, rstd, bf16);
            from_float((char *)out + (row * dim + c) * width, h, n, bf16);
        }
    }
}

/* out[r, :d] = silu(x[r, :d]) * x[r, d:] (silu rounded, then the product), x rows strided (x_row), out [rows, d]. */
void silu_and_mul(const void *x, int64_t x_row, void *out, int64_t rows, int64_t d, int bf16) {
    const int64_t width = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        float a[CHUNK], b[CHUNK];
        const char *src = (const char *)x + row * x_row * width;
        for (int64_t c = 0; c < d; c += CHUNK) {
            const int64_t n = d - c < CHUNK ? d - c : CHUNK;
            to_float(a, src + c * width, n, bf16);
            to_float(b, src + (d + c) * width, n, bf16);
            for (int64_t i = n; i < (n + VL - 1) / VL * VL; i++) a[i] = 0.0f; /* the last vector's tail */
            for (int64_t i = 0; i < n; i += VL) {
                const fvec v = loadv(a + i), zero = {0};
                const ivec negative = (ivec)v >> 31; /* the sign bit */
                const fvec e = expv((fvec)((ivec)v | INT32_MIN)); /* exp(-|v|): the sign bit set */
                /* sigmoid(v) = 1 / (1 + exp(-v)), as e / (1 + e) for negative v (e = exp(v)) */
                const fvec top = (fvec)(((ivec)e & negative) | ((ivec)(zero + 1.0f) & ~negative));
                storev(a + i, v * (top / (1.0f + e)));
            }
            round_all(a, n, bf16);
#pragma omp simd
            for (int64_t i = 0; i < n; i++) a[i] *= b[i];
            from_float((char *)out + (row * d + c) * width, a, n, bf16);
        }
    }
}

/* One head vector (float32, in place): an optional per-head RMSNorm with `norm` weights (rounded as rms_norm
   rounds), then the neox rotation by cos / sin (half = dim / 2 values each), every product and sum rounded. */
static void norm_rotate(float *h, const void *norm, float eps, const float *cos, const float *sin, int64_t dim,
                        int bf16) {
    if (norm) {
        float w[MAX_DIM];
        to_float(w, norm, dim, bf16);
        normalize(h, w, dim, 1.0f / sqrtf(sum_squares(h, dim) / (float)dim + eps), bf16);
        round_all(h, dim, bf16);
    }
    const int64_t half = dim / 2;
    float a[MAX_DIM / 2], b[MAX_DIM / 2], c[MAX_DIM / 2], e[MAX_DIM / 2];
    for (int64_t i = 0; i < half; i++) {
        a[i] = h[i] * cos[i];
        b[i] = h[half + i] * sin[i];
        c[i] = h[half + i] * cos[i];
        e[i] = h[i] * sin[i];
    }
    round_all(a, half, bf16), round_all(b, half, bf16), round_all(c, half, bf16), round_all(e, half, bf16);
    for (int64_t i = 0; i < half; i++) {
        h[i] = a[i] - b[i];
        h[half + i] = c[i] + e[i];
    }
    round_all(h, dim, bf16);
}

/* Rotary of the q and k heads of num_tokens tokens (q [*, num_heads, dim], k [*, num_kv_heads, dim], token
   strides q_tok / k_tok, heads contiguous) into q_out / k_out (contiguous); cos / sin [num_tokens, dim / 2]. With
   q_norm / k_norm (Qwen3) each head is RMS-normalized first. */
void qk_rotary(const void *q, int64_t q_tok, const void *k, int64_t k_tok, void *q_out, void *k_out, const void *cos,
               const void *sin, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t dim,
               const void *q_norm, const void *k_norm, float q_eps, float k_eps, int bf16) {
    const int64_t width = bf16 ? 2 : 4, half = dim / 2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; t++) {
        float h[MAX_DIM], c[MAX_DIM / 2], s[MAX_DIM / 2];
        to_float(c, (const char *)cos + t * half * width, half, bf16);
        to_float(s, (const char *)sin + t * half * width, half, bf16);
        for (int64_t head = 0; head < num_heads + num_kv_heads; head++) {
            const int is_q = head < num_heads;
            const int64_t j = is_q ? head : head - num_heads;
            const char *src = is_q ? (const char *)q + (t * q_tok + j * dim) * width
                                   : (const char *)k + (t * k_tok + j * dim) * width;
            char *dst = is_q ? (char *)q_out + ((t * num_heads + j) * dim) * width
                             : (char *)k_out + ((t * num_kv_heads + j) * dim) * width;
            to_float(h, src, dim, bf16);
            norm_rotate(h, is_q ? q_norm : k_norm, is_q ? q_eps : k_eps, c, s, dim, bf16);
            from_float(dst, h, dim, bf16);
        }
    }
}
