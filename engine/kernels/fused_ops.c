/* The small per-layer ops of a decoder layer on CPU, fused (float32).
 *
 * At decode a layer's activations are a few tens of KB, but the matmuls between them stream
 * megabytes of weights through the caches, so each small PyTorch op starts cold and costs 2-5x
 * its hot time; RMSNorm is seven such ops and RoPE plus the KV write nine. Here each is one
 * pass. RoPE is the same float operations as PyTorch's (built with -ffp-contract=off: no FMA),
 * so it is bit-identical; RMSNorm sums its squares in another order (~1e-7 relative).
 */
#include <math.h>
#include <stdint.h>

/* If residual: x += residual (in place). Then out = weight * (x / sqrt(mean(x^2) + eps)),
 * computed as transformers does: x * rsqrt(var + eps), then weight * that. x, out [N, H]. */
void batchyard_add_rms_norm(float *x, const float *residual, const float *weight, float *out,
                            int64_t N, int64_t H, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (N * H > 65536)
    for (int64_t n = 0; n < N; ++n) {
        float *xn = x + n * H, *on = out + n * H;
        if (residual) {
            const float *rn = residual + n * H;
#pragma omp simd
            for (int64_t i = 0; i < H; ++i) xn[i] = xn[i] + rn[i];
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < H; ++i) sum += xn[i] * xn[i];
        const float r = 1.0f / sqrtf(sum / (float)H + eps);
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) on[i] = weight[i] * (xn[i] * r);
    }
}

/* qkv [N, (H + 2 Hkv) * D] from the fused projection; cos, sin [N, D]. Writes the rotated
 * queries to q_out [N, H, D], the rotated keys and the values to the pool rows slots[n]
 * (k_cache, v_cache [slots, Hkv, D]). rotate_half(x) = cat(-x[D/2:], x[:D/2]). */
void batchyard_rope_store(const float *qkv, const float *cos_, const float *sin_, float *q_out,
                          float *k_cache, float *v_cache, const int64_t *slots, int64_t N,
                          int64_t H, int64_t Hkv, int64_t D, int threads) {
    const int64_t width = (H + 2 * Hkv) * D, half = D / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (N > 64)
    for (int64_t n = 0; n < N; ++n) {
        const float *row = qkv + n * width, *c = cos_ + n * D, *s = sin_ + n * D;
        for (int64_t h = 0; h < H + Hkv; ++h) {
            const float *x = row + h * D;
            float *y = h < H ? q_out + (n * H + h) * D : k_cache + (slots[n] * Hkv + h - H) * D;
            for (int64_t d = 0; d < half; ++d) {
                const float a = x[d] * c[d], b = -x[d + half] * s[d];
                y[d] = a + b;
            }
            for (int64_t d = half; d < D; ++d) {
                const float a = x[d] * c[d], b = x[d - half] * s[d];
                y[d] = a + b;
            }
        }
        const float *v = row + (H + Hkv) * D;
        float *v_row = v_cache + slots[n] * Hkv * D;
        for (int64_t i = 0; i < Hkv * D; ++i) v_row[i] = v[i];
    }
}
