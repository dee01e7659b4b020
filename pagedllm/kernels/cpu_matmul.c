/* bfloat16 linear layers on Intel AMX tiles, for batches of decode size (built by cpu_kernels.py with the other CPU
   kernels; the layers call it up to linear.TILE_ROWS tokens and oneDNN's matmul above).

   y [m, n] = x [m, k] · w [n, k]^T (+ bias), bfloat16 in and out, float32 sums (the tiles' dot products), each
   output rounded once to bfloat16: finite values and inf as torch rounds them (nearest even), a NaN stays a NaN
   (quiet, its sign kept), and the tile unit counts denormal inputs and results as zero (as oneDNN's AMX matmul).
   The weight is packed once (pack_tiles): per 16 output columns and 32 inputs, one 1 KiB tile of 16 rows, row r
   holding for each column c the inputs 2r and 2r + 1 (the pairs the tile dot product takes), so each thread streams
   its columns' weights in order. A thread takes 32 columns at a time (two weight tiles) and every group of 32 rows
   of x (two x tiles) for them: four accumulator tiles, eight tiles in all; x is taken in chunks of CHUNK_ROWS rows
   that stay in L2 while the weights pass, and the last rows short of 32 from a zero-padded copy (so the tiles keep
   one shape). At 64 rows the weights dominate the bytes and are read once per call: SmolLM2's 120 decoder linears,
   called in turn over 30 layers' weights (out of cache), took 11.8-12.1 ms here against oneDNN's 14.0-14.9, and a
   call costs a few microseconds of host time against oneDNN's ~20. From 128 rows up oneDNN's blocking wins (25-35%
   at 2,560 rows).

   Without AMX (the compiler's -march=native defines __AMX_TILE__ and __AMX_BF16__ only on CPUs that have it)
   matmul_tiles() is 0, linear_tiles returns 0 without computing, and the layers keep oneDNN. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vectors.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAS_TILES 1
#else
#define HAS_TILES 0
#endif

#define TILE_VALUES 512 /* bfloat16 values per packed weight tile: 16 columns x 32 inputs */
#define CHUNK_ROWS 256  /* rows of x per pass over the weights (at most 768 KiB of x at k = 1536) */

/* Packs w [n, k] (bfloat16 bits, rows of stride w_row) for linear_tiles: [n / 16][k / 32][16][16][2]. n and k
   multiples of 32. */
void pack_tiles(const uint16_t *w, int64_t w_row, uint16_t *out, int64_t n, int64_t k) {
    const int64_t k_tiles = k / 32;
    for (int64_t nb = 0; nb < n / 16; nb++)
        for (int64_t kb = 0; kb < k_tiles; kb++) {
            uint16_t *tile = out + (nb * k_tiles + kb) * TILE_VALUES;
            for (int64_t r = 0; r < 16; r++)
                for (int64_t c = 0; c < 16; c++) {
                    const uint16_t *src = w + (nb * 16 + c) * w_row + kb * 32 + 2 * r;
                    tile[r * 32 + 2 * c] = src[0];
                    tile[r * 32 + 2 * c + 1] = src[1];
                }
        }
}

#if HAS_TILES
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 4 and 5: x's two row tiles (rows 0-15 / 16-31 of a group); 6 and 7: two weight tiles (16 columns each);
   0-3: the sums, (x tile, weight tile) = (4, 6), (5, 6), (4, 7), (5, 7). All 16 rows of 64 bytes. */
static void configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* The first `rows` rows of a sums tile [16][16] float32 (+ bias [16] float32), rounded to bfloat16 (bf16_bits), into
   y (row stride n). */
static void store_rounded(const float (*sums)[16], int64_t rows, const float *bias, uint16_t *y, int64_t n) {
    float b[16] = {0};
    if (bias) memcpy(b, bias, sizeof b);
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *out = y + r * n;
#pragma omp simd
        for (int c = 0; c < 16; c++) out[c] = (uint16_t)(bf16_bits(sums[r][c] + b[c]) >> 16);
    }
}
#endif

/* Whether linear_tiles runs here: built for AMX, and the OS lets this process use the tiles (Linux asks each
   process to request them once). */
int matmul_tiles(void) {
#if HAS_TILES
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

/* y [m, n] (contiguous) = x [m, k] (rows of stride x_row) · the packed weight (pack_tiles) + bias [n] float32 (or
   NULL). n and k multiples of 32; any m. Returns 1, or 0 where the tiles cannot run (built without AMX, or the
   padded copy of the last rows could not be allocated): then y is not written. */
int linear_tiles(const uint16_t *x, int64_t x_row, const uint16_t *packed, const float *bias, uint16_t *y, int64_t m,
                 int64_t n, int64_t k) {
#if HAS_TILES
    const int64_t k_tiles = k / 32, pairs = n / 32, full = m - m % 32;
    uint16_t *tail = NULL; /* the last m % 32 rows, then zeros: [32][k] */
    if (m > full) {
        tail = calloc(32 * k, sizeof *tail);
        if (tail == NULL) return 0;
        for (int64_t r = full; r < m; r++) memcpy(tail + (r - full) * k, x + r * x_row, k * sizeof *tail);
    }
#pragma omp parallel
    {
        float sums[4][16][16];
        int configured = 0;
        for (int64_t chunk = 0; chunk < m; chunk += CHUNK_ROWS) { /* rows of x that stay in L2 for every column */
            const int64_t chunk_end = m - chunk < CHUNK_ROWS ? m : chunk + CHUNK_ROWS;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < pairs; p++) {
                const uint16_t *w0 = packed + 2 * p * k_tiles * TILE_VALUES, *w1 = w0 + k_tiles * TILE_VALUES;
                if (!configured) {
                    configure();
                    configured = 1;
                }
                for (int64_t m0 = chunk; m0 < chunk_end; m0 += 32) {
                    const int64_t rows = chunk_end - m0 < 32 ? chunk_end - m0 : 32;
                    const uint16_t *a = m0 < full ? x + m0 * x_row : tail;
                    const int64_t stride = (m0 < full ? x_row : k) * 2;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t kb = 0; kb < k_tiles; kb++) {
                        _tile_loadd(6, w0 + kb * TILE_VALUES, 64);
                        _tile_loadd(7, w1 + kb * TILE_VALUES, 64);
                        _tile_loadd(4, a + kb * 32, stride);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(2, 4, 7);
                        _tile_loadd(5, (const char *)(a + kb * 32) + 16 * stride, stride);
                        _tile_dpbf16ps(1, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(0, sums[0], 64);
                    _tile_stored(1, sums[1], 64);
                    _tile_stored(2, sums[2], 64);
                    _tile_stored(3, sums[3], 64);
                    const int64_t top = rows < 16 ? rows : 16;
                    for (int t = 0; t < 4; t++) {
                        const int64_t r0 = m0 + (t & 1) * 16, c0 = (2 * p + (t >> 1)) * 16;
                        store_rounded(sums[t], t & 1 ? rows - top : top, bias ? bias + c0 : NULL, y + r0 * n + c0, n);
                    }
                }
            }
        }
        if (configured) _tile_release();
    }
    free(tail);
    return 1;
#else
    (void)x, (void)x_row, (void)packed, (void)bias, (void)y, (void)m, (void)n, (void)k;
    return 0;
#endif
}
