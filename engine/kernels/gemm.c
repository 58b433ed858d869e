/* y[M, N] = x[M, K] W^T (+ b), float32, with W packed once at load in tiles of 16 columns.
 *
 * A decode step multiplies a few dozen rows by every weight of the model, read from memory once.
 * With oneDNN on a 2-core CPU the weight stream and the arithmetic took turns: at 25 rows the
 * weights of a whole model took 78-105 ms from memory against about 70 ms with the same weights
 * in cache, and at 5 rows the stream ran at about half the memory's bandwidth. Here each thread
 * walks its tiles in memory order and, while it computes one tile, prefetches the next, spread
 * over the passes it makes over the current one, so both go on at once: the same 25 rows take
 * 42-55 ms, 5 rows 25-30 ms (README, How it works, gives the measurements).
 *
 * Packed layout: tile t holds output columns 16t .. 16t+15 as [K][16] (zero-padded past N).
 * Each tile is computed in passes of at most MAX_ROWS rows (12 vector accumulators: what 16
 * AVX2 registers hold beside the weights and the broadcast input). Every output is one sum over
 * k in order, with fused multiply-adds; it differs from PyTorch's matmul by rounding only (the
 * start-up check in engine/models/linear.py bounds it). Vectors are GCC's generic vectors: the
 * same source builds for any CPU the compiler targets.
 */
#pragma GCC optimize("fp-contract=fast") /* FMA here, whatever the library's other files use */
#include <stdint.h>
#include <string.h>

#define TILE 16
#define MAX_ROWS 6
typedef float v8 __attribute__((vector_size(32)));

void batchyard_gemm_pack(const float *w, int64_t N, int64_t K, float *packed) {
    const int64_t tiles = (N + TILE - 1) / TILE;
    for (int64_t t = 0; t < tiles; ++t)
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < TILE; ++j) {
                const int64_t n = t * TILE + j;
                packed[(t * K + k) * TILE + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

/* R rows (a compile-time constant after inlining) times one tile. One line of `next` is
 * prefetched every 2^pf_shift steps of k. */
static inline __attribute__((always_inline)) void rows_tile(
        const float *x, int64_t K, const float *w, const float *next, int64_t pf_shift,
        float *y, int64_t ldy, int64_t cols, const float *bias, const int R) {
    const int64_t pf_mask = ((int64_t)1 << pf_shift) - 1;
    v8 acc[MAX_ROWS][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = (v8){0};
    for (int64_t k = 0; k < K; ++k) {
        if ((k & pf_mask) == 0) __builtin_prefetch(next + (k >> pf_shift) * TILE, 0, 2);
        v8 b0, b1;
        memcpy(&b0, w + k * TILE, sizeof b0);
        memcpy(&b1, w + k * TILE + 8, sizeof b1);
        for (int r = 0; r < R; ++r) {
            const float xv = x[r * K + k];
            acc[r][0] += b0 * xv;
            acc[r][1] += b1 * xv;
        }
    }
    for (int r = 0; r < R; ++r) {
        float out[TILE];
        memcpy(out, &acc[r][0], sizeof acc[r][0]);
        memcpy(out + 8, &acc[r][1], sizeof acc[r][1]);
        for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = out[j] + (bias ? bias[j] : 0.0f);
    }
}

static void rows_tile_any(const float *x, int64_t K, const float *w, const float *next,
                          int64_t pf_shift, float *y, int64_t ldy, int64_t cols,
                          const float *bias, int R) {
    switch (R) {
    case 1: rows_tile(x, K, w, next, pf_shift, y, ldy, cols, bias, 1); break;
    case 2: rows_tile(x, K, w, next, pf_shift, y, ldy, cols, bias, 2); break;
    case 3: rows_tile(x, K, w, next, pf_shift, y, ldy, cols, bias, 3); break;
    case 4: rows_tile(x, K, w, next, pf_shift, y, ldy, cols, bias, 4); break;
    case 5: rows_tile(x, K, w, next, pf_shift, y, ldy, cols, bias, 5); break;
    default: rows_tile(x, K, w, next, pf_shift, y, ldy, cols, bias, 6); break;
    }
}

/* x [M, K] and y [M, N] contiguous; bias [N] or NULL. */
void batchyard_gemm(const float *x, const float *packed, const float *bias, float *y, int64_t M,
                    int64_t N, int64_t K, int threads) {
    const int64_t tiles = (N + TILE - 1) / TILE;
    /* Rows split evenly (25 = 5 x 5, not 6+6+6+6+1: a pass of one row costs nearly a full one) */
    const int64_t passes = (M + MAX_ROWS - 1) / MAX_ROWS;
    /* The next tile is prefetched over the first 2^shift passes, one line every 2^shift k: a
     * steady stream at the pace of the arithmetic, not a burst that fills the miss buffers. */
    const int64_t shift = passes >= 4 ? 2 : passes >= 2 ? 1 : 0;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; ++t) {
        const float *w = packed + t * K * TILE;
        const float *next = t + 1 < tiles ? w + K * TILE : w;
        const int64_t n0 = t * TILE, cols = N - n0 < TILE ? N - n0 : TILE;
        for (int64_t p = 0, r0 = 0; p < passes; ++p) {
            const int64_t rows = M / passes + (p < M % passes);
            const float *pf = p < (1 << shift) ? next + p * (K >> shift) * TILE : w;
            rows_tile_any(x + r0 * K, K, w, pf, shift, y + r0 * N + n0, N, cols,
                          bias ? bias + n0 : 0, (int)rows);
            r0 += rows;
        }
    }
}
