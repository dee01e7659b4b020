/* The sampler's CPU draw (pagedllm/sample/sampler.py), built with the other kernel files into one library: one
   token per row (greedy, temperature, min-p, top-k, top-p). The logprobs are in cpu_logprobs.c, the penalties and
   allowed-token masks in cpu_logits.c, what they share in cpu_rows.h.

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

#include "cpu_rows.h" /* scratch, selection and the passes over a row */

#define GREEDY_BELOW 1e-5f /* a temperature below this takes the argmax (as SamplingMetadata) */

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

/* Floats of scratch one thread needs for rows of `vocab` logits (the caller sizes its buffer by it). */
int64_t sampling_scratch_floats(int64_t vocab) { return scratch_floats(vocab); }
