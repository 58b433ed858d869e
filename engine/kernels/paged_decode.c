/* Decode attention over the paged KV pool, read in place (float32).
 *
 * The reference backend copies each decode row's pages out of the pool before SDPA, so every
 * layer moves its KV three times (read, write, read again); on a CPU that copy is most of decode
 * attention. These two loops read each K and V row of the pool once, through the page table,
 * as vLLM's CPU kernel does. The softmax between them stays in PyTorch.
 *
 * Layouts (all contiguous): q, out [B, H, D]; k_cache, v_cache [slots, Hkv, D];
 * pages [B, max_pages] pool pages of page_size slots; ctx, lo [B]: row b sees positions
 * lo[b] <= t < ctx[b]; scores, probs [B, H, width], width >= every ctx.
 * The H query heads of KV head kh are kh*G .. kh*G+G-1 (G = H / Hkv), as in transformers.
 */
#include <math.h>
#include <stdint.h>

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* A head's dot product and its weighted add, with D a constant for the usual head sizes so the
 * compiler unrolls them. Callers walk the heads KV head by KV head: the earlier loops over h,
 * with runtime D and an integer division per head to find its KV head, took 9.0 ms for a
 * batch-28 step's attention with the pool in cache against 7.1 ms (11.1 / 10.4 from memory) on
 * a 2-vCPU AVX-512 Xeon. */
static inline __attribute__((always_inline)) float dot_n(const float *a, const float *b,
                                                         int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
    return acc;
}

static inline float dot(const float *a, const float *b, int64_t D) {
    return D == 64 ? dot_n(a, b, 64) : D == 128 ? dot_n(a, b, 128) : dot_n(a, b, D);
}

static inline __attribute__((always_inline)) void axpy_n(float w, const float *v, float *o,
                                                         int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) o[d] += w * v[d];
}

static inline void axpy(float w, const float *v, float *o, int64_t D) {
    if (D == 64) axpy_n(w, v, o, 64);
    else if (D == 128) axpy_n(w, v, o, 128);
    else axpy_n(w, v, o, D);
}

/* The pool is far larger than the caches and a row's pages are scattered over it, which no
 * hardware prefetcher can guess: a row's first page is requested at once, and each later page
 * slot by slot while the page before it is used (one slot's lines per slot computed), so the
 * requests keep pace with the arithmetic instead of filling the miss buffers in one burst. */
static inline void prefetch_lines(const float *start, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(start + i);
}

static inline void prefetch_page(const float *cache, const int64_t *row_pages, int64_t page,
                                 int64_t page_size, int64_t slot_floats) {
    prefetch_lines(cache + row_pages[page] * page_size * slot_floats, page_size * slot_floats);
}

/* Positions first .. *next - 1 lie in one page (*next: its end, at most `end`): returns the pool
 * row of `first`; the following rows are consecutive. *ahead: the same slot of the row's next
 * page (the current one's when there is none), to prefetch from slot by slot. */
static inline const float *page_run(const float *cache, const int64_t *row_pages, int64_t first,
                                    int64_t end, int64_t page_size, int64_t slot_floats,
                                    int64_t *next, const float **ahead) {
    const int64_t page = first / page_size;
    const int64_t ahead_page = page + 1 <= (end - 1) / page_size ? page + 1 : page;
    *next = min64(end, (page + 1) * page_size);
    *ahead = cache + (row_pages[ahead_page] * page_size + first % page_size) * slot_floats;
    return cache + (row_pages[page] * page_size + first % page_size) * slot_floats;
}

/* One task per row. Its positions are walked page by page and every KV head of a slot is used
 * at once: a page is then one sequential run of memory, which the prefetcher follows. */
void batchyard_decode_scores(const float *q, const float *k_cache, const int64_t *pages,
                             const int64_t *ctx, const int64_t *lo, float *scores, int64_t B,
                             int64_t H, int64_t Hkv, int64_t D, int64_t page_size,
                             int64_t max_pages, int64_t width, float scale, int threads) {
    const int64_t G = H / Hkv, slot_floats = Hkv * D;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t b = 0; b < B; ++b) {
        const int64_t *row_pages = pages + b * max_pages;
        const float *qb = q + b * H * D;
        float *s = scores + b * H * width;
        for (int64_t h = 0; h < H; ++h) {
            for (int64_t t = 0; t < width; ++t) {
                if (t < lo[b] || t >= ctx[b]) s[h * width + t] = -INFINITY;
            }
        }
        prefetch_page(k_cache, row_pages, lo[b] / page_size, page_size, slot_floats);
        for (int64_t first = lo[b], next; first < ctx[b]; first = next) {
            const float *ahead, *row = page_run(k_cache, row_pages, first, ctx[b], page_size,
                                                slot_floats, &next, &ahead);
            for (int64_t t = first; t < next; ++t, row += slot_floats, ahead += slot_floats) {
                prefetch_lines(ahead, slot_floats);
                for (int64_t kh = 0, h = 0; kh < Hkv; ++kh)
                    for (int64_t g = 0; g < G; ++g, ++h)
                        s[h * width + t] = dot(qb + h * D, row + kh * D, D) * scale;
            }
        }
    }
}

void batchyard_decode_values(const float *probs, const float *v_cache, const int64_t *pages,
                             const int64_t *ctx, const int64_t *lo, float *out, int64_t B,
                             int64_t H, int64_t Hkv, int64_t D, int64_t page_size,
                             int64_t max_pages, int64_t width, int threads) {
    const int64_t G = H / Hkv, slot_floats = Hkv * D;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t b = 0; b < B; ++b) {
        const int64_t *row_pages = pages + b * max_pages;
        const float *p = probs + b * H * width;
        float *o = out + b * H * D;
        for (int64_t i = 0; i < H * D; ++i) o[i] = 0.0f;
        prefetch_page(v_cache, row_pages, lo[b] / page_size, page_size, slot_floats);
        for (int64_t first = lo[b], next; first < ctx[b]; first = next) {
            const float *ahead, *row = page_run(v_cache, row_pages, first, ctx[b], page_size,
                                                slot_floats, &next, &ahead);
            for (int64_t t = first; t < next; ++t, row += slot_floats, ahead += slot_floats) {
                prefetch_lines(ahead, slot_floats);
                for (int64_t kh = 0, h = 0; kh < Hkv; ++kh)
                    for (int64_t g = 0; g < G; ++g, ++h)
                        axpy(p[h * width + t], row + kh * D, o + h * D, D);
            }
        }
    }
}
