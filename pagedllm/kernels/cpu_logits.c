/* The sampler's CPU kernels that change logits in place before the draw (pagedllm/sample/adjust.py,
   pagedllm/sample/bitmask.py), built with cpu_sampling.c into one library: the repetition / presence / frequency
   penalties and the allowed-token bitmasks. */

#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
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

/* ---- allowed-token bitmasks */

/* Rows rows[j] of logits [*, vocab] (row stride `stride`) keep the tokens whose bit is set in masks [num_rows, words]
   (bit t % 32 of word t / 32, as xgrammar and llguidance pack them); every other token becomes -inf. Tokens past
   32 * words are kept. A word of all ones is skipped. */
void apply_bitmask(float *logits, int64_t stride, const int64_t *rows, int64_t num_rows, const int32_t *masks,
                   int64_t words, int64_t vocab, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < num_rows; j++) {
        float *x = logits + rows[j] * stride;
        const uint32_t *m = (const uint32_t *)(masks + j * words);
        const int64_t n = vocab < 32 * words ? vocab : 32 * words;
        for (int64_t w = 0; 32 * w < n; w++) {
            if (m[w] == 0xFFFFFFFFu) continue;
            const int64_t end = 32 * w + 32 < n ? 32 * w + 32 : n;
            for (int64_t t = 32 * w; t < end; t++)
                if (!((m[w] >> (t & 31)) & 1u)) x[t] = -INFINITY;
        }
    }
}
