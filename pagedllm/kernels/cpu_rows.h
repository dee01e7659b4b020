/* What the sampler's row kernels share (cpu_sampling.c: the draw; cpu_logprobs.c: logprobs): a thread's
   scratch, the small-array selection, and the passes over a row of logits. Static: each file gets its copy. */

#ifndef PAGEDLLM_CPU_ROWS_H
#define PAGEDLLM_CPU_ROWS_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_vectors.h"

#define TILE 64      /* tokens per tile: candidates come from the tiles with the largest maxima */
#define BLOCK 256    /* tokens per partial sum of the inverse-CDF draw */
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
static inline int64_t scratch_floats(int64_t vocab) {
    const int64_t padded = padded_of(vocab);
    return 3 * padded + padded / TILE + padded / BLOCK + 2 * padded;
}

static Scratch scratch_of(float *buffer, int64_t vocab, int thread) {
    const int64_t padded = padded_of(vocab);
    float *s = buffer + thread * scratch_floats(vocab);
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

#endif
