/* y[M, N] = x[M, K] W^T (+ b), float32, with W packed once at load in tiles of 16 columns.
 *
 * A decode step multiplies a few dozen rows by every weight of the model, read from memory once.
 * With oneDNN on a 2-core CPU the weight stream and the arithmetic took turns: at 25 rows the
 * weights of a whole model took 78-105 ms from memory against about 70 ms with the same weights
 * in cache, and at 5 rows the stream ran at about half the memory's bandwidth. Here each thread
 * walks its tiles in memory order and, while it computes one tile, prefetches the next, spread
 * over the passes it makes over the current one, so both go on at once: the same 25 rows take
 * 42-55 ms, 5 rows 25-30 ms (docs/architecture.md, "CPU: matmuls", gives the measurements).
 *
 * Packed layout: tile t holds output columns 16t .. 16t+15 as [K][16] (zero-padded past N).
 * Threads take blocks of tiles (one with AVX2, two with AVX-512: below), each computed in passes
 * of at most MAX_ROWS rows. Every output is one sum over k in order, with fused multiply-adds,
 * whatever the vector width, so the AVX2 and AVX-512 builds give the same bits (tested); it
 * differs from PyTorch's matmul by rounding only (the start-up check in engine/models/linear.py
 * bounds it). Vectors are GCC's generic vectors: the same source builds for any CPU the
 * compiler targets.
 */
#pragma GCC optimize("fp-contract=fast") /* FMA here, whatever the library's other files use */
#include <stdint.h>
#include <string.h>

#define TILE 16
#if defined(__AVX512F__)
/* A block is two tiles, one 16-float vector of each per row, so each broadcast input feeds two
 * FMAs. 8 rows (16 accumulators): at 24-32 rows, 4 passes with the next block's prefetch spread
 * over all of them ran a decode step's matmuls in 31-35 ms, against 30-38 ms with 12-row passes
 * (docs/architecture.md, "CPU: matmuls"). */
typedef float vec __attribute__((vector_size(64)));
#define BLOCK_TILES 2
#define MAX_ROWS 8
#else
/* A block is one tile, two 8-float vectors per row: 6 rows x 2 accumulators, the two weight
 * vectors and the broadcast input fill 15 of the 16 AVX2 registers. */
typedef float vec __attribute__((vector_size(32)));
#define BLOCK_TILES 1
#define MAX_ROWS 6
#endif
#define LANES 2                            /* vectors per row and k */
#define VEC_FLOATS ((int)(sizeof(vec) / sizeof(float)))
#define BLOCK_COLS (LANES * VEC_FLOATS)    /* = BLOCK_TILES * TILE */
_Static_assert(BLOCK_COLS == BLOCK_TILES * TILE, "a block is whole tiles");
_Static_assert(MAX_ROWS == 6 || MAX_ROWS == 8, "rows_block_any has a case for every row count");

void batchyard_gemm_pack(const float *w, int64_t N, int64_t K, float *packed) {
    const int64_t tiles = (N + TILE - 1) / TILE;
    for (int64_t t = 0; t < tiles; ++t)
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < TILE; ++j) {
                const int64_t n = t * TILE + j;
                packed[(t * K + k) * TILE + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

/* R rows (a compile-time constant after inlining) times one block. Lane l reads lane[l] + k *
 * TILE; tile b of the next block is prefetched from next[b], one line every 2^pf_shift k. */
static inline __attribute__((always_inline)) void rows_block(
        const float *x, int64_t K, const float *const lane[LANES],
        const float *const next[BLOCK_TILES], int64_t pf_shift, float *y, int64_t ldy,
        int64_t cols, const float *bias, const int R) {
    const int64_t pf_mask = ((int64_t)1 << pf_shift) - 1;
    vec acc[MAX_ROWS][LANES];
    for (int r = 0; r < R; ++r)
        for (int l = 0; l < LANES; ++l) acc[r][l] = (vec){0};
    for (int64_t k = 0; k < K; ++k) {
        if ((k & pf_mask) == 0)
            for (int b = 0; b < BLOCK_TILES; ++b)
                __builtin_prefetch(next[b] + (k >> pf_shift) * TILE, 0, 2);
        vec wk[LANES];
        for (int l = 0; l < LANES; ++l) memcpy(&wk[l], lane[l] + k * TILE, sizeof wk[l]);
        for (int r = 0; r < R; ++r) {
            const float xv = x[r * K + k];
            for (int l = 0; l < LANES; ++l) acc[r][l] += wk[l] * xv;
        }
    }
    for (int r = 0; r < R; ++r) {
        float out[BLOCK_COLS];
        memcpy(out, acc[r], sizeof out);
        for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = out[j] + (bias ? bias[j] : 0.0f);
    }
}

static void rows_block_any(const float *x, int64_t K, const float *const lane[LANES],
                           const float *const next[BLOCK_TILES], int64_t pf_shift, float *y,
                           int64_t ldy, int64_t cols, const float *bias, int R) {
    switch (R) {
#define ROWS(n) case n: rows_block(x, K, lane, next, pf_shift, y, ldy, cols, bias, n); break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5)
#if MAX_ROWS == 8
    ROWS(6) ROWS(7)
#endif
#undef ROWS
    default: rows_block(x, K, lane, next, pf_shift, y, ldy, cols, bias, MAX_ROWS); break;
    }
}

/* x [M, K] and y [M, N] contiguous; bias [N] or NULL. */
void batchyard_gemm(const float *x, const float *packed, const float *bias, float *y, int64_t M,
                    int64_t N, int64_t K, int threads) {
    const int64_t tiles = (N + TILE - 1) / TILE;
    const int64_t blocks = (tiles + BLOCK_TILES - 1) / BLOCK_TILES;
    /* Rows split evenly (25 = 5 x 5, not 6+6+6+6+1: a pass of one row costs nearly a full one) */
    const int64_t passes = (M + MAX_ROWS - 1) / MAX_ROWS;
    /* The next block is prefetched over the first 2^shift passes, one line every 2^shift k: a
     * steady stream at the pace of the arithmetic, not a burst that fills the miss buffers. */
    const int64_t shift = passes >= 4 ? 2 : passes >= 2 ? 1 : 0;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const float *tile_at[2 * BLOCK_TILES];  /* this block's tiles, then the next block's */
        for (int b = 0; b < 2 * BLOCK_TILES; ++b) {
            const int64_t t = blk * BLOCK_TILES + b;  /* past the end: the last tile, unused */
            tile_at[b] = packed + (t < tiles ? t : tiles - 1) * K * TILE;
        }
        const float *lane[LANES];
        for (int l = 0; l < LANES; ++l)
            lane[l] = tile_at[l * VEC_FLOATS / TILE] + l * VEC_FLOATS % TILE;
        const int64_t n0 = blk * BLOCK_COLS, cols = N - n0 < BLOCK_COLS ? N - n0 : BLOCK_COLS;
        for (int64_t p = 0, r0 = 0; p < passes; ++p) {
            const int64_t rows = M / passes + (p < M % passes);
            const float *next[BLOCK_TILES];
            for (int b = 0; b < BLOCK_TILES; ++b)
                next[b] = p < (1 << shift) ? tile_at[BLOCK_TILES + b] + p * (K >> shift) * TILE
                                           : tile_at[b];
            rows_block_any(x + r0 * K, K, lane, next, shift, y + r0 * N + n0, N, cols,
                           bias ? bias + n0 : 0, (int)rows);
            r0 += rows;
        }
    }
}
