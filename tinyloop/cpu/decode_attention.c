/* Decode attention over the paged KV pool, read in place: one new query token per row attends to
 * the keys its row's pool rows name, with no gathered copy of K and V.
 *
 *   q      [R, HQ, D]    float32, the rows' queries (RoPE applied)
 *   k, v   [N, KVH, D]   float32, the pool's K and V (row n at n * KVH * D)
 *   rows   [R, L]        int64, the pool row of each key of each row
 *   n_keys [R]           int64, how many of its L keys each row attends (the first n_keys)
 *   out    [R, HQ, D]    float32
 *
 * Grouped-query attention: query head h reads KV head h / (HQ / KVH). For each row, every
 * head's scores are computed in one pass over the keys' K rows, softmaxed, and the weighted sums
 * taken in one pass over their V rows: each key's K and V are read once, whole. The softmax is
 * float32 as torch's reference computes it (max subtracted first); only the order of the sums
 * differs from it. Single-threaded: the caller runs it on its own thread (the GIL released).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Keys live in blocks of consecutive rows scattered over the pool: the rows a few keys ahead are
 * fetched whole (each row is KVH * D floats, several cache lines), which the hardware prefetcher
 * does not do across blocks. */
#define AHEAD 8
static inline void prefetch_row(const float *row, int64_t width) {
    for (int64_t i = 0; i < width; i += 16) __builtin_prefetch(row + i);
}

int tl_decode_attention(const float *q, const float *k, const float *v, const int64_t *rows,
                        const int64_t *n_keys, float *out, int64_t R, int64_t HQ, int64_t KVH,
                        int64_t D, int64_t L, float scale) {
    const int64_t G = HQ / KVH, width = KVH * D;
    float *scores = malloc(sizeof(float) * (size_t)(HQ * L + HQ));  /* [HQ, L], then 1 / sum per head */
    if (scores == NULL) return 1;
    float *inv = scores + HQ * L;
    for (int64_t r = 0; r < R; ++r) {
        const int64_t n = n_keys[r];
        const int64_t *key_rows = rows + r * L;
        const float *qr = q + r * HQ * D;
        float *out_r = out + r * HQ * D;
        /* scores: one pass over the keys' K rows, every head of a key while its row is in cache */
        for (int64_t j = 0; j < n; ++j) {
            const float *kj = k + key_rows[j] * width;
            if (j + AHEAD < n) prefetch_row(k + key_rows[j + AHEAD] * width, width);
            for (int64_t h = 0, hq = 0; h < KVH; ++h) {
                const float *kh = kj + h * D;
                for (int64_t g = 0; g < G; ++g, ++hq) {
                    const float *qh = qr + hq * D;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
                    scores[hq * L + j] = s * scale;
                }
            }
        }
        for (int64_t hq = 0; hq < HQ; ++hq) {  /* softmax per query head: float32, max first */
            float *sh = scores + hq * L;
            float top = -INFINITY, total = 0.0f;
            for (int64_t j = 0; j < n; ++j) top = sh[j] > top ? sh[j] : top;
            for (int64_t j = 0; j < n; ++j) {
                sh[j] = expf(sh[j] - top);
                total += sh[j];
            }
            inv[hq] = 1.0f / total;
        }
        /* the weighted sum: one pass over the keys' V rows, normalised at the end */
        for (int64_t i = 0; i < HQ * D; ++i) out_r[i] = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
            const float *vj = v + key_rows[j] * width;
            if (j + AHEAD < n) prefetch_row(v + key_rows[j + AHEAD] * width, width);
            for (int64_t h = 0, hq = 0; h < KVH; ++h) {
                const float *vh = vj + h * D;
                for (int64_t g = 0; g < G; ++g, ++hq) {
                    const float p = scores[hq * L + j];
                    float *oh = out_r + hq * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) oh[d] += p * vh[d];
                }
            }
        }
        for (int64_t hq = 0; hq < HQ; ++hq)
            for (int64_t d = 0; d < D; ++d) out_r[hq * D + d] *= inv[hq];
    }
    free(scores);
    return 0;
}
