/* Greedy sampling on CPU (float32): the argmax of each row of logits and its log-probability.
 *
 * PyTorch needs three passes over a [rows, vocab] tensor for this (log_softmax writes a copy,
 * argmax and gather read it); at a batch of 28 and a 49k vocabulary that was 3 ms of a 130 ms
 * step. Here each row is read twice, in cache: its maximum, then the sum of exponentials.
 * argmax takes the first maximal index, as torch.argmax does. A row with a NaN or an infinite
 * maximum gets a NaN log-probability and the caller uses PyTorch, which defines those cases.
 */
#include <math.h>
#include <stdint.h>

#define CHUNK 256

/* exp(x) to about 1 ulp (Cephes' polynomial) in operations the compiler vectorizes: libm's
 * expf is a call per element. Inputs below -87.3 give ~1e-38, not 0, which no sum notices. */
static inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : x > 88.3f ? 88.3f : x;
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (x * 1.44269504088896341f + magic) - magic;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const union { int32_t bits; float value; } scale = {((int32_t)n + 127) << 23}; /* 2^n */
    return p * scale.value;
}

/* The first index of the largest value of x[0:V] (-1 if none is a number). */
static int64_t first_argmax(const float *x, int64_t V) {
    float best = -INFINITY;
    int64_t best_chunk = -1;
    for (int64_t c = 0; c < V; c += CHUNK) {
        const int64_t end = c + CHUNK < V ? c + CHUNK : V;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t i = c; i < end; ++i) m = x[i] > m ? x[i] : m;
        if (m > best || best_chunk < 0) best = m, best_chunk = c;
    }
    for (int64_t i = best_chunk; i < V; ++i) {
        if (x[i] == best) return i;
    }
    return -1;
}

/* logits [S, V] → out [S, 2]: the chosen id and its log-probability, NaN where the row needs
 * PyTorch; packed as the sampler's one host copy is (engine/runner/sampler.py). */
void batchyard_greedy(const float *logits, int64_t S, int64_t V, double *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t s = 0; s < S; ++s) {
        const float *x = logits + s * V;
        const int64_t i = first_argmax(x, V);
        float sum = 0.0f;
        int nan = 0; /* the max ignores NaN; torch.argmax would pick it */
        if (i >= 0 && isfinite(x[i])) {
            const float m = x[i];
#pragma omp simd reduction(+ : sum) reduction(| : nan)
            for (int64_t j = 0; j < V; ++j) {
                sum += exp_approx(x[j] - m);
                nan |= x[j] != x[j];
            }
        }
        const int ok = i >= 0 && isfinite(x[i]) && isfinite(sum) && !nan;
        out[2 * s] = (double)i;
        out[2 * s + 1] = ok ? (double)-logf(sum) : NAN;
    }
}
