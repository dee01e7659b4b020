/* The sampler's CPU kernels (pagedllm/sample/sampler.py, pagedllm/worker/sample_inputs.py), built with
   cpu_kernels.c into one library: the draw of one token per row (greedy, temperature, min-p, top-k, top-p), the
   logprobs of chosen tokens with each row's top-n, and the repetition / presence / frequency penalties.

   Rows are float32 logits. A thread takes a row at a time: the row is read from memory once and its later passes
   run in cache (49,152 logits are 192 KiB: L2), in the thread's part of the caller's scratch.

   The draw. x / T with NaN as -inf (never drawn); a row whose largest x / T is +inf draws among its +inf tokens
   alone, a row of -inf takes token 0. Weights p = exp(x / T - max) (the largest 1); min-p drops p < min_p, as
   x / T < max + log(min_p) (exact for the max and its ties: min_p 1 keeps them, whatever exp's rounding). top-k
   keeps the tokens at or above the k-th largest (ties all kept, as HF's TopKLogitsWarper), top-p then keeps the
   tokens whose more likely ones weigh less than top_p of the kept mass (HF's TopPLogitsWarper: the sorted cumsum
   rule, ties at the cut all kept). The token is an inverse-CDF draw over the kept weights with the row's uniform
   number u: the first, in token order (a top-k row with top-p: by weight), whose running sum exceeds u times their
   sum.
   - top-k rows never weigh the whole row: a row's k largest lie in the k tiles of TILE tokens with the largest
     maxima, whose tokens at or above the k-th largest maximum are the candidates (usually a few more than k).
   - top-p rows without top-k draw by rejection (draw_nucleus): a draw over the whole row is kept when it passes the
     rule, else the next draw is over the tokens more likely than it; one pass over the row (in cache) a round.
   Plain rows weigh blocks of BLOCK tokens and weigh again only the block the draw falls in. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "cpu_vectors.h" /* vectors of the CPU's own width: fvec, VL floats */

#define TILE 64      /* tokens per tile: candidates come from the tiles with the largest maxima */
#define BLOCK 256    /* tokens per partial sum of the inverse-CDF draw */
#define GREEDY_BELOW 1e-5f /* a temperature below this takes the argmax (as SamplingMetadata) */
#define LOG2E 1.44269504088896341f
#define SMALL_K 64 /* kth_largest keeps up to this many in order */

typedef struct {
    float value;
    int32_t token;
} Entry;

/* One thread's scratch, carved from the caller's buffer (sampling_scratch_floats floats per thread). */
typedef struct {
    float *row;     /* [padded] the weights of a top-p row */
    float *maxima;  /* [padded / TILE] */
    float *sums;    /* [padded / BLOCK] */
    float *values;  /* [padded] a copy to select in */
    float *inf_row; /* [padded] a row with +inf logits: 0 there, -inf elsewhere */
    Entry *entries; /* [padded] candidates */
} Scratch;

static int64_t padded_of(int64_t vocab) { return (vocab + BLOCK - 1) / BLOCK * BLOCK; }

/* Floats of scratch one thread needs for rows of `vocab` logits. */
int64_t sampling_scratch_floats(int64_t vocab) {
    const int64_t padded = padded_of(vocab);
    return 3 * padded + padded / TILE + padded / BLOCK + 2 * padded;
}

static Scratch scratch_of(float *buffer, int64_t vocab, int thread) {
    const int64_t padded = padded_of(vocab);
    float *s = buffer + thread * sampling_scratch_floats(vocab);
    Scratch out = {s, s + padded, s + padded + padded / TILE, s + padded + padded / TILE + padded / BLOCK, NULL, NULL};
    out.inf_row = out.values + padded;
    out.entries = (Entry *)(out.inf_row + padded);
    return out;
}

static int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

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

static inline int32_t bits_of(float x) {
    int32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

/* ---- selection and sorting of small arrays */

/* The k-th largest of a[0..n) (1 <= k <= n, no NaN); a may be reordered. A small k keeps the k largest in order, in
   registers' reach (most values fail the first comparison); a larger one partitions (quickselect). */
static float kth_largest(float *a, int64_t n, int64_t k) {
    if (k <= SMALL_K) {
        float best[SMALL_K];
        int64_t held = 0;
        for (int64_t i = 0; i < n; i++) {
            const float v = a[i];
            if (held == k && !(v > best[k - 1])) continue;
            int64_t j = held < k ? held++ : k - 1; /* insert v, dropping the least if full */
            while (j > 0 && best[j - 1] < v) best[j] = best[j - 1], j--;
            best[j] = v;
        }
        return best[k - 1];
    }
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        const float x = a[lo], y = a[(lo + hi) / 2], z = a[hi]; /* the median of three as pivot */
        const float pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) { /* descending: larger values to the left */
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                const float t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return a[want]; /* between the two halves: equal to the pivot */
    }
    return a[lo];
}

static int by_value_then_token(const void *a, const void *b) {
    const Entry *x = a, *y = b;
    if (x->value != y->value) return x->value > y->value ? -1 : 1;
    return (x->token > y->token) - (x->token < y->token);
}

static int descending(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* ---- the passes over a row. A row is read as s = x * inv_t, NaN as -inf, -inf past the vocabulary (to a whole
   BLOCK): x may be a row of the batch, read in place, or a prepared row in scratch. */

/* A row being read: its logits x (vocab of them) and 1 / T; the last block, if partial, through a copy padded with
   -inf. */
typedef struct {
    const float *x;
    int64_t vocab;
    float inv_t;
    float tail[BLOCK];
} Row;

static Row row_of(const float *x, int64_t vocab, float inv_t) {
    Row r = {x, vocab, inv_t, {0}};
    const int64_t start = vocab / BLOCK * BLOCK;
    for (int64_t i = 0; i < BLOCK; i++) r.tail[i] = start + i < vocab ? x[start + i] : -INFINITY;
    return r;
}

/* The logits of the block from start (a multiple of BLOCK). */
static inline const float *block_of(const Row *r, int64_t start) {
    return start + BLOCK <= r->vocab ? r->x + start : r->tail;
}

/* s of VL logits at p */
static inline fvec scaledv(const float *p, float inv_t) {
    const fvec s = loadv(p) * inv_t;
    return selectv((ivec)(s == s), s, (fvec){0} - INFINITY);
}

/* The largest of n (even) vectors' lanes, as a vector: two chains. */
static inline fvec max_of(const fvec *v, int n) {
    fvec a = v[0], b = v[1];
    for (int i = 2; i < n; i += 2) a = maxv(a, v[i]), b = maxv(b, v[i + 1]);
    return maxv(a, b);
}

/* The row's largest s; with maxima, each tile's. */
static float row_max(const Row *r, float *maxima, int64_t padded) {
    fvec top = (fvec){0} - INFINITY;
    for (int64_t start = 0; start < padded; start += BLOCK) {
        const float *p = block_of(r, start);
        fvec tile[BLOCK / TILE];
        for (int t = 0; t < BLOCK / TILE; t++) {
            fvec v[TILE / VL];
            for (int i = 0; i < TILE / VL; i++) v[i] = scaledv(p + t * TILE + i * VL, r->inv_t);
            tile[t] = max_of(v, TILE / VL);
            if (maxima) maxima[start / TILE + t] = largestv(tile[t]);
        }
        top = maxv(top, max_of(tile, BLOCK / TILE));
    }
    return largestv(top);
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

/* The weights p = exp(s - top) of one block's tokens, 0 where s < lowest_s (min-p), into w[BLOCK]; returns their sum. */
static inline float block_weights(const Row *r, int64_t start, float top, float lowest_s, float *w) {
    const float *x = block_of(r, start);
    const float scale = r->inv_t * LOG2E, shift = top * LOG2E;
    const fvec zero = {0};
    fvec acc[4] = {zero, zero, zero, zero};
    for (int64_t i = 0; i < BLOCK; i += VL) {
        fvec p = exp2v(loadv(x + i) * scale - shift); /* (x / T - top) * log2(e) */
        p = selectv((ivec)(loadv(x + i) * r->inv_t < lowest_s), zero, p); /* s as row_max computed it */
        storev(w + i, p);
        acc[(i / VL) % 4] += p;
    }
    return totalv((acc[0] + acc[1]) + (acc[2] + acc[3]));
}

/* sums[b]: the weight of block b; with row, the weights are kept there. Returns their total. */
static float weigh(const Row *r, float *restrict row, float *restrict sums, int64_t padded, float top, float lowest_s) {
    float w[BLOCK], total = 0.0f;
    for (int64_t start = 0; start < padded; start += BLOCK) {
        total += sums[start / BLOCK] = block_weights(r, start, top, lowest_s, row ? row + start : w);
    }
    return total;
}

/* sums[b]: the weight of block b's kept weights (row[BLOCK * b:][:BLOCK] above lower); returns their total. */
static float weigh_above(const float *restrict row, float *restrict sums, int64_t padded, float lower) {
    const fvec zero = {0};
    float total = 0.0f;
    for (int64_t start = 0; start < padded; start += BLOCK) {
        fvec acc = zero;
        for (int64_t i = start; i < start + BLOCK; i += VL) {
            const fvec p = loadv(row + i);
            acc += selectv((ivec)(p > lower), p, zero);
        }
        total += sums[start / BLOCK] = totalv(acc);
    }
    return total;
}

/* The inverse-CDF draw with u over the weights above lower, given each block's sum of them and their total: the
   first token whose running sum exceeds u times the total. Weights come from row where given, else are computed
   again from x. */
static int64_t draw(const Row *r, const float *row, const float *sums, int64_t padded, float total, float top,
                    float lowest_s, float lower, float u) {
    const int64_t blocks = padded / BLOCK;
    const float target = u * total;
    float acc = 0.0f, w[BLOCK];
    int64_t b = 0, last = -1; /* the block of the target, else the last with weight */
    for (; b < blocks; b++) {
        if (sums[b] <= 0.0f) continue;
        last = b;
        if (acc + sums[b] > target) break;
        acc += sums[b];
    }
    if (last < 0) return 0;
    b = b < blocks ? b : last;
    const float *p = row ? row + b * BLOCK : w;
    if (!row) block_weights(r, b * BLOCK, top, lowest_s, w);
    int64_t pick = -1;
    for (int64_t i = 0; i < BLOCK; i++) {
        if (p[i] > lower) {
            pick = i;
            acc += p[i];
            if (acc > target) break;
        }
    }
    return b * BLOCK + pick; /* (the sum in another order fell short of the target: the block's last kept token) */
}

/* Another uniform number from u (the next round of a top-p draw). */
static float next_uniform(float u, int round) {
    uint32_t h = (uint32_t)bits_of(u) ^ (0x9E3779B9u * (uint32_t)(round + 1));
    h = (h ^ (h >> 16)) * 0x45D9F3Bu;
    h = (h ^ (h >> 16)) * 0x45D9F3Bu;
    h ^= h >> 16;
    return (float)(h >> 8) * (1.0f / 16777216.0f);
}

/* A top-p row without top-k, its weights in row, each block's sum in sums and their total: a token is kept when the
   tokens more likely than it weigh less than top_p of the total. Drawn by rejection: a draw over the weights above
   `lower` (first all) is kept if it passes; else no token as likely as it passes and lower rises to its weight. The
   kept draw is one from the kept tokens, renormalized: every round draws from a set that holds them all. Each round
   is one pass over the row, the first usually the last (the kept tokens weigh at least top_p of the total). */
static int64_t draw_nucleus(float *row, float *sums, int64_t padded, float total, float top_p, float u) {
    const float target = top_p * total;
    float lower = 0.0f, above = total;
    for (int round = 0;; round++) {
        const int64_t token = draw(NULL, row, sums, padded, above, 0.0f, -INFINITY, lower, u);
        lower = row[token];
        above = weigh_above(row, sums, padded, lower); /* the next round's blocks and total */
        if (above < target || lower >= 1.0f) return token;
        u = next_uniform(u, round);
    }
}

/* How many tokens a top-p row keeps (its weights in row; for the tests): sorted, the cut is the first at which the
   running weight (in double) reaches top_p of the total; every token as likely as the cut is kept. */
static int64_t nucleus_size(const float *row, float *values, int64_t padded, float top_p) {
    int64_t n = 0;
    double total = 0.0;
    for (int64_t i = 0; i < padded; i++) {
        values[n] = row[i];
        total += row[i];
        n += row[i] > 0.0f;
    }
    qsort(values, n, sizeof *values, descending);
    double above = 0.0;
    float cut = 0.0f;
    for (int64_t i = 0; i < n && above < top_p * total; i++) above += cut = values[i];
    int64_t kept = 0;
    for (int64_t i = 0; i < n; i++) kept += values[i] >= cut;
    return kept;
}

/* The candidates for a row's k largest s (1 <= k < vocab; maxima its tiles'): every token at or above the k-th
   largest tile maximum (at least k tokens reach it), in token order, into s->entries. Returns how many. */
static int64_t candidates(const Row *r, const float *maxima, Scratch *s, int64_t padded, int64_t k) {
    const int64_t tiles = padded / TILE;
    float bound;
    if (k <= tiles) {
        memcpy(s->values, maxima, tiles * sizeof(float));
        bound = kth_largest(s->values, tiles, k);
    } else {
        for (int64_t i = 0; i < padded; i += VL)
            storev(s->values + i, scaledv(block_of(r, i / BLOCK * BLOCK) + i % BLOCK, r->inv_t));
        bound = kth_largest(s->values, padded, k);
    }
    Entry *e = s->entries;
    int64_t n = 0;
    for (int64_t t = 0; t < tiles; t++) {
        if (maxima[t] < bound) continue;
        const float *p = block_of(r, t * TILE / BLOCK * BLOCK) + t * TILE % BLOCK;
        for (int64_t i = 0; i < TILE; i += VL) {
            const fvec v = scaledv(p + i, r->inv_t);
            for (int l = 0; l < VL; l++) {
                e[n].value = v[l], e[n].token = (int32_t)(t * TILE + i + l);
                n += v[l] >= bound;
            }
        }
    }
    return n;
}

/* A top-k row (1 <= k < vocab): the candidates, the k-th largest as the cut, then min-p (s >= lowest_s) and top-p over
   them and the draw, in token order (top-p: by weight). */
static int64_t draw_top_k(const Row *r, const float *maxima, Scratch *s, int64_t padded, float top, int64_t k,
                          float top_p, float lowest_s, float u, int64_t *kept_out) {
    Entry *e = s->entries;
    const int64_t n = candidates(r, maxima, s, padded, k);
    for (int64_t i = 0; i < n; i++) s->values[i] = e[i].value;
    const float cut = kth_largest(s->values, n, k);
    int64_t kept = 0;
    float total = 0.0f;
    for (int64_t i = 0; i < n; i++) { /* the k largest (and ties), as weights, min-p applied */
        const float w = expf(e[i].value - top);
        if (e[i].value >= cut && e[i].value >= lowest_s && w > 0.0f) {
            e[kept].value = w, e[kept].token = e[i].token;
            kept++;
            total += w;
        }
    }
    if (top_p < 1.0f) { /* by weight, descending: keep while the more likely weigh less than the target */
        qsort(e, kept, sizeof *e, by_value_then_token);
        const float target = top_p * total;
        float before = 0.0f;
        int64_t i = 0;
        while (i < kept && (before < target || (i > 0 && e[i].value == e[i - 1].value))) before += e[i++].value;
        kept = i;
        total = before;
    }
    if (kept_out) *kept_out = kept;
    const float target = u * total;
    float acc = 0.0f;
    for (int64_t i = 0; i < kept; i++) {
        acc += e[i].value;
        if (acc > target) return e[i].token;
    }
    return kept ? e[kept - 1].token : 0;
}

/* One sampled row: returns its token; `kept`, where not NULL, gets how many tokens it could have drawn. */
static int64_t sample_row(const float *x, Scratch *s, int64_t vocab, float temperature, int64_t top_k, float top_p,
                          float min_p, float u, int64_t *kept) {
    const int64_t padded = padded_of(vocab);
    if (top_k >= vocab) top_k = 0;
    Row r = row_of(x, vocab, 1.0f / temperature);
    float top = row_max(&r, top_k > 0 ? s->maxima : NULL, padded);
    if (top == -INFINITY) { /* every token banned */
        if (kept) *kept = 0;
        return 0;
    }
    if (top == INFINITY) { /* the +inf tokens alone, equally likely: a prepared row of 0 and -inf */
        const fvec none = (fvec){0} - INFINITY;
        for (int64_t i = 0; i < padded; i += VL) {
            const fvec v = scaledv(block_of(&r, i / BLOCK * BLOCK) + i % BLOCK, r.inv_t);
            storev(s->inf_row + i, selectv((ivec)(v == INFINITY), (fvec){0}, none));
        }
        r = row_of(s->inf_row, padded, 1.0f);
        top = row_max(&r, top_k > 0 ? s->maxima : NULL, padded);
    }
    const float lowest_s = min_p > 0.0f ? top + logf(min_p) : -INFINITY; /* min-p in x / T */
    if (top_k > 0) return draw_top_k(&r, s->maxima, s, padded, top, top_k, top_p, lowest_s, u, kept);
    if (top_p >= 1.0f) {
        const float total = weigh(&r, kept ? s->row : NULL, s->sums, padded, top, lowest_s);
        if (kept) {
            *kept = 0;
            for (int64_t i = 0; i < padded; i++) *kept += s->row[i] > 0.0f;
        }
        return draw(&r, NULL, s->sums, padded, total, top, lowest_s, 0.0f, u);
    }
    const float total = weigh(&r, s->row, s->sums, padded, top, lowest_s);
    if (kept) *kept = nucleus_size(s->row, s->values, padded, top_p);
    return draw_nucleus(s->row, s->sums, padded, total, top_p, u);
}

/* torch.argmax of a row: the first largest, NaN counting as the largest. Blocks' maxima first, then the first
   place of the largest in the first block that holds it. */
static int64_t argmax_row(const float *x, int64_t vocab) {
    const Row r = row_of(x, vocab, 1.0f);
    const int64_t padded = padded_of(vocab);
    float best = -INFINITY;
    int64_t at = 0;
    ivec nan = {0};
    for (int64_t start = 0; start < padded; start += BLOCK) {
        const float *p = block_of(&r, start);
        fvec v[BLOCK / VL];
        for (int i = 0; i < BLOCK / VL; i++) {
            v[i] = loadv(p + i * VL);
            nan |= (ivec)(v[i] != v[i]);
        }
        const float bm = largestv(max_of(v, BLOCK / VL));
        if (bm > best) best = bm, at = start;
    }
    int any_nan = 0;
    for (int l = 0; l < VL; l++) any_nan |= nan[l] != 0;
    for (int64_t i = any_nan ? 0 : at; i < vocab; i++) /* the first NaN where there is one, else the largest */
        if (x[i] != x[i] || (!any_nan && x[i] == best)) return i;
    return 0; /* every logit -inf */
}

/* argmax_row of every row of bfloat16 logits [rows, vocab] (row stride `stride`, raw 16-bit values; each converts
   to float32 exactly, so the result is the argmax of their float32 copy), into out [rows]. */
void argmax_rows_bf16(const uint16_t *logits, int64_t stride, int64_t rows, int64_t vocab, int64_t *out,
                      int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *x = logits + r * stride;
        float best = -INFINITY;
        int64_t at = 0;
        int any_nan = 0;
        for (int64_t start = 0; start < vocab; start += BLOCK) {
            const int64_t n = vocab - start < BLOCK ? vocab - start : BLOCK;
            float top = -INFINITY;
            int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
            for (int64_t i = 0; i < n; i++) {
                const float v = bf16_value(x[start + i]);
                nan |= v != v;
                top = v > top ? v : top;
            }
            any_nan |= nan;
            if (top > best) best = top, at = start;
        }
        out[r] = 0; /* every logit -inf */
        for (int64_t i = any_nan ? 0 : at; i < vocab; i++) { /* the first NaN where there is one, else the largest */
            const float v = bf16_value(x[i]);
            if (v != v || (!any_nan && v == best)) {
                out[r] = i;
                break;
            }
        }
    }
}

/* One token per row of logits [rows, vocab] (row stride `stride`): params [rows, 4] (temperature: below
   GREEDY_BELOW the argmax; top_k: 0 off; top_p: 1 off; min_p: 0 off), uniforms [rows] in [0, 1). kept [rows] or
   NULL (for the tests): how many tokens each row could have drawn (tokens of weight 0 not counted). scratch:
   `threads` times sampling_scratch_floats(vocab) floats. */
void sample_rows(const float *logits, int64_t stride, int64_t rows, int64_t vocab, const float *params,
                 const float *uniforms, int64_t *out, int64_t *kept, float *scratch, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * stride, *p = params + 4 * r;
        if (!(p[0] >= GREEDY_BELOW)) {
            out[r] = argmax_row(x, vocab);
            if (kept) kept[r] = 1;
            continue;
        }
        Scratch s = scratch_of(scratch, vocab, thread_id());
        out[r] = sample_row(x, &s, vocab, p[0], (int64_t)p[1], p[2], p[3], uniforms[r], kept ? kept + r : NULL);
    }
}

/* ---- logprobs */

/* Per row j (its float32 logits at address rows[j]): the logprob of token chosen[j] and its rank (1 + how many are
   larger), and the row's num_top largest (by value, then the lower token first) with their logprobs into
   top_ids / top_lp [rows, num_top]. NaN counts as -inf and +inf as the largest float, as in the GPU kernel. One pass
   over the row: per block its largest value and its sum of exp(x - that), joined at the end. */
void logprobs_rows(const int64_t *rows, int64_t num_rows, int64_t vocab, const int64_t *chosen, int64_t num_top,
                   float *chosen_lp, int64_t *ranks, int64_t *top_ids, float *top_lp, float *scratch, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t j = 0; j < num_rows; j++) {
        Scratch s = scratch_of(scratch, vocab, thread_id());
        const int64_t padded = padded_of(vocab);
        const Row r = row_of((const float *)rows[j], vocab, 1.0f);
        float *block_max = s.sums, *block_sum = s.values;
        const float c_raw = r.x[chosen[j]], c = c_raw == c_raw ? fminf(c_raw, FLT_MAX) : -INFINITY;
        const fvec biggest = (fvec){0} + FLT_MAX;
        ivec larger = {0};
        float top = -INFINITY;
        for (int64_t start = 0; start < padded; start += BLOCK) {
            const float *p = block_of(&r, start);
            fvec v[BLOCK / VL], tile[BLOCK / TILE];
            for (int t = 0; t < BLOCK / TILE; t++) {
                for (int i = 0; i < TILE / VL; i++) {
                    const int q = t * (TILE / VL) + i;
                    v[q] = scaledv(p + q * VL, 1.0f);
                    v[q] = selectv((ivec)(v[q] > FLT_MAX), biggest, v[q]);
                    larger -= (ivec)(v[q] > c);
                }
                tile[t] = max_of(v + t * (TILE / VL), TILE / VL);
                s.maxima[start / TILE + t] = largestv(tile[t]);
            }
            const float bm = largestv(max_of(tile, BLOCK / TILE));
            const fvec zero = {0};
            fvec acc[4] = {zero, zero, zero, zero};
            if (bm > -INFINITY)
                for (int q = 0; q < BLOCK / VL; q++) acc[q % 4] += exp2v((v[q] - bm) * LOG2E);
            block_max[start / BLOCK] = bm;
            block_sum[start / BLOCK] = totalv((acc[0] + acc[1]) + (acc[2] + acc[3]));
            top = bm > top ? bm : top;
        }
        float sum = 0.0f;
        for (int64_t b = 0; b < padded / BLOCK; b++)
            if (block_max[b] > -INFINITY) sum += block_sum[b] * expf(block_max[b] - top);
        const float lse = top == -INFINITY ? -INFINITY : top + logf(sum);
        int64_t count = 0;
        for (int l = 0; l < VL; l++) count += larger[l];
        chosen_lp[j] = c - lse;
        ranks[j] = count + 1;
        if (num_top <= 0) continue;
        Entry *e = s.entries;
        int64_t n = num_top;
        if (num_top < vocab) {
            n = candidates(&r, s.maxima, &s, padded, num_top);
        } else {
            for (int64_t i = 0; i < vocab; i++) e[i].value = r.x[i] == r.x[i] ? r.x[i] : -INFINITY, e[i].token = (int32_t)i;
        }
        qsort(e, n, sizeof *e, by_value_then_token);
        for (int64_t i = 0; i < num_top; i++) {
            const float v = i < n ? fminf(e[i].value, FLT_MAX) : -INFINITY;
            top_ids[j * num_top + i] = i < n ? e[i].token : 0;
            top_lp[j * num_top + i] = v - lse;
        }
    }
}

/* ---- penalties */

/* For each penalized row r (logits row rows[r], stride `stride`; its tokens[r, :num_tokens[r]], the first
   num_prompt[r] the prompt's): the repetition penalty (HF / CTRL: positive logits divided by it, the others
   multiplied) on every token seen, then the OpenAI penalties on the output tokens: minus frequency times the count,
   minus presence once. counts: `threads` times vocab zeros (left zero). */
void apply_penalties(float *logits, int64_t stride, const int64_t *rows, int64_t n, const int64_t *tokens,
                     int64_t tokens_stride, const int64_t *num_prompt, const int64_t *num_tokens,
                     const float *repetition, const float *presence, const float *frequency, int64_t vocab,
                     int32_t *counts, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t r = 0; r < n; r++) {
        int32_t *seen = counts + thread_id() * vocab; /* per token: 1 + twice its count among the outputs */
        const int64_t *t = tokens + r * tokens_stride;
        float *x = logits + rows[r] * stride;
        for (int64_t i = 0; i < num_tokens[r]; i++) {
            if (t[i] >= 0 && t[i] < vocab) seen[t[i]] = (seen[t[i]] | 1) + 2 * (i >= num_prompt[r]);
        }
        for (int64_t i = 0; i < num_tokens[r]; i++) {
            if (t[i] < 0 || t[i] >= vocab || !seen[t[i]]) continue; /* a token's first place alone */
            const int32_t output = seen[t[i]] >> 1;
            float v = x[t[i]];
            v = v > 0.0f ? v / repetition[r] : v * repetition[r];
            v -= frequency[r] * (float)output;
            v -= presence[r] * (float)(output > 0);
            x[t[i]] = v;
            seen[t[i]] = 0;
        }
    }
}
