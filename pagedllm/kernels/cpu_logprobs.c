/* The logprobs kernel of the sampler (pagedllm/sample/logprobs.py), built with cpu_sampling.c into one library. */

#include "cpu_rows.h"

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
