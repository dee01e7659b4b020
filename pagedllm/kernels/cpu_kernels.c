/* CPU kernels of the torch attention backend, built at first use by cpu_kernels.py (cc -O3 -march=native).

   Cache layout (torch_backend.allocate_kv_cache): K and V each [num_kv_heads, num_blocks, block_size * head_dim],
   a head's part of a block one run of memory; within it K is stored transposed, [head_dim][block_size], so that one
   key dimension of 16 consecutive tokens is one vector load, and V as is, [block_size][head_dim]. Values are float32
   or bfloat16 (`bf16` = 0 / 1; bfloat16 as its raw 16 bits); every sum runs in float32. Vectors are GCC/clang
   vector extensions of 16 floats (one AVX-512 register, two AVX2 ones). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define MAX_GROUP 16           /* query heads per kv head */
#define MAX_DIM 256            /* head_dim, a multiple of LANES */
#define MAX_BLOCK_VALUES 8192  /* block_size * head_dim */

typedef float f32x16 __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t i32x16 __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline f32x16 load16(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, f32x16 v) { memcpy(p, &v, sizeof v); }

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

/* n float32 values to dst (float32 or bfloat16, rounded to nearest even as torch does) */
static void from_float(void *restrict dst, const float *restrict src, int64_t n, int bf16) {
    if (!bf16) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &src[i], sizeof bits);
        if ((bits & 0x7fffffffu) > 0x7f800000u) {
            d[i] = (uint16_t)((bits >> 16) | 0x40u); /* NaN stays a (quiet) NaN */
        } else {
            d[i] = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
        }
    }
}

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

/* The running softmax state of one query head over the keys seen so far. */
typedef struct {
    float max, sum;
    float acc[MAX_DIM];
} Running;

/* Folds tokens [t0, t1) of one cache block into the states of the `group` query heads q[g]: keys_t
   [dim][block_size] (transposed, LANES floats of slack after it), values [block_size][dim], both float32. */
static void attend_block(Running *restrict state, const float (*q)[MAX_DIM], int64_t group,
                         const float *restrict keys_t, const float *restrict values, int64_t block_size, int64_t t0,
                         int64_t t1, int64_t dim, float scale) {
    for (int64_t g = 0; g < group; g++) {
        Running *st = &state[g];
        for (int64_t c0 = t0 - t0 % LANES; c0 < t1; c0 += LANES) { /* LANES tokens at a time */
            /* four independent sums: one chain would wait on each multiply-add's latency */
            f32x16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            const float *k = keys_t + c0;
            for (int64_t d = 0; d < dim; d += 4) { /* dim is a multiple of LANES */
                s0 += q[g][d] * load16(k + d * block_size);
                s1 += q[g][d + 1] * load16(k + (d + 1) * block_size);
                s2 += q[g][d + 2] * load16(k + (d + 2) * block_size);
                s3 += q[g][d + 3] * load16(k + (d + 3) * block_size);
            }
            const f32x16 s = (s0 + s1) + (s2 + s3);
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
            const int64_t n = t1 - c0 < LANES ? t1 - c0 : LANES;
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

/* Decode attention: one query token per request, over the request's first seq_lens[r] cached tokens (the last
   sliding_window of them when sliding_window > 0). One work item per (request, kv head): its `group` query heads
   read each key and value once, a block at a time, with an online softmax.

   q and out are read / written at rows token_rows[r] ([*, num_heads, head_dim], strides q_tok / q_head and o_tok /
   o_head); block_table [num_reqs, *] (row stride bt_row); seq_lens [num_reqs]. */
void decode_attention(const void *q, int64_t q_tok, int64_t q_head, void *out, int64_t o_tok, int64_t o_head,
                      const int64_t *token_rows, const void *k_cache, const void *v_cache, const int64_t *block_table,
                      int64_t bt_row, const int64_t *seq_lens, int64_t num_reqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks, float scale,
                      int64_t sliding_window, int bf16) {
    const int64_t group = num_heads / num_kv_heads, width = bf16 ? 2 : 4, block_values = block_size * head_dim;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_reqs * num_kv_heads; item++) {
        const int64_t r = item / num_kv_heads, h = item % num_kv_heads, row = token_rows[r];
        float qf[MAX_GROUP][MAX_DIM], keys_t[MAX_BLOCK_VALUES + LANES], values[MAX_BLOCK_VALUES];
        Running state[MAX_GROUP];
        memset(keys_t + block_values, 0, LANES * sizeof(float)); /* the slack the last key row's load reads */
        for (int64_t g = 0; g < group; g++) {
            to_float(qf[g], (const char *)q + (row * q_tok + (h * group + g) * q_head) * width, head_dim, bf16);
            state[g].max = -INFINITY;
            state[g].sum = 0.0f;
            memset(state[g].acc, 0, head_dim * sizeof(float));
        }
        const int64_t len = seq_lens[r];
        const int64_t first = sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
        for (int64_t b = first / block_size; b * block_size < len; b++) {
            const int64_t start = b * block_size;
            const int64_t t0 = first > start ? first - start : 0;
            const int64_t t1 = len - start < block_size ? len - start : block_size;
            const int64_t offset = (h * num_blocks + block_table[r * bt_row + b]) * block_values;
            if ((b + 1) * block_size < len) { /* the next block's keys and values start on their way from memory */
                const int64_t next = (h * num_blocks + block_table[r * bt_row + b + 1]) * block_values * width;
                for (int64_t byte = 0; byte < block_values * width; byte += 64) {
                    __builtin_prefetch((const char *)k_cache + next + byte);
                    __builtin_prefetch((const char *)v_cache + next + byte);
                }
            }
            to_float(keys_t, (const char *)k_cache + offset * width, block_values, bf16);
            to_float(values, (const char *)v_cache + offset * width, block_values, bf16);
            attend_block(state, (const float(*)[MAX_DIM])qf, group, keys_t, values, block_size, t0, t1, head_dim,
                         scale);
        }
        for (int64_t g = 0; g < group; g++) {
            float o[MAX_DIM];
            const float inv = 1.0f / state[g].sum;
            for (int64_t d = 0; d < head_dim; d++) o[d] = state[g].acc[d] * inv;
            from_float((char *)out + (row * o_tok + (h * group + g) * o_head) * width, o, head_dim, bf16);
        }
    }
}

/* Writes the new tokens' K and V (k, v [num_tokens, num_kv_heads, head_dim], row strides k_tok / v_tok, heads
   contiguous) to their cache slots, K transposed within its block; a slot below 0 is skipped. */
void write_kv(const void *k, int64_t k_tok, const void *v, int64_t v_tok, void *k_cache, void *v_cache,
              const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
              int64_t num_blocks, int bf16) {
    const int64_t width = bf16 ? 2 : 4;
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] < 0) continue;
        const int64_t block = slots[i] / block_size, t = slots[i] % block_size;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t base = (h * num_blocks + block) * block_size * head_dim;
            const char *src_k = (const char *)k + (i * k_tok + h * head_dim) * width;
            for (int64_t d = 0; d < head_dim; d++) {
                memcpy((char *)k_cache + (base + d * block_size + t) * width, src_k + d * width, width);
            }
            memcpy((char *)v_cache + (base + t * head_dim) * width, (const char *)v + (i * v_tok + h * head_dim) * width,
                   head_dim * width);
        }
    }
}
