/* The CPU's C kernels: decode attention over the paged KV pool read in place, 4-bit KV writes,
 * and RMSNorm.
 *
 * Decode attention: each row's new query tokens attend to the keys its row's pool rows name,
 * with no gathered copy of K and V.
 *
 *   q      [R, HQ, T, D] float32, each row's T new tokens' queries (RoPE applied): one token
 *                        in decode, a few in a speculative chain's verify
 *   k, v   the pool's K and V, row n holding every KV head's D values (width = KVH * D):
 *            float32 [N, width], or 4-bit (``kvstore.Int4Buffer``): codes uint8 [N, width / 2]
 *            (even index in the low nibble) and per group of `group` values an fp16 (scale,
 *            minimum) pair [N, width / group, 2], value = code * scale + minimum
 *   rows   [R, L]        int64, the pool row of each key of each row
 *   n_keys [R]           int64, how many of its L keys each row's first new token attends (the
 *                        first n_keys); token t attends to n_keys + t (causal among the new ones)
 *   out    [R, HQ, T, D] float32
 *
 * Grouped-query attention: query head h reads KV head h / (HQ / KVH). For each row, every
 * head's scores are computed in one pass over the keys' K rows, softmaxed, and the weighted sums
 * taken in one pass over their V rows: each key's K and V are read once, whole (a 4-bit row is
 * dequantized into a scratch row first, with torch's rounding: the product, then the sum). The
 * softmax is float32 as torch's reference computes it (max subtracted first); only the order of
 * the sums differs from it. Single-threaded: the caller runs it on its own thread.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Keys live in blocks of consecutive rows scattered over the pool: the rows a few keys ahead are
 * fetched whole (several cache lines each), which the hardware prefetcher does not do across
 * blocks. */
#define AHEAD 8

typedef struct {
    const float *plain;    /* float32 rows, or NULL for 4-bit ones */
    const uint8_t *codes;  /* 4-bit: codes and (scale, minimum) pairs */
    const uint16_t *meta;
    int64_t width, group;
} field_t;

static inline void prefetch(const void *start, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)start + i);
}

static inline void prefetch_row(const field_t *f, int64_t row) {
    if (f->plain != NULL) {
        prefetch(f->plain + row * f->width, f->width * 4);
    } else {
        prefetch(f->codes + row * (f->width / 2), f->width / 2);
        prefetch(f->meta + row * (f->width / f->group) * 2, f->width / f->group * 4);
    }
}

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    union { uint32_t u; float f; } bits;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24 */
        const float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    bits.u = sign | (exponent == 31 ? 0x7f800000u | (mantissa << 13) : ((exponent + 112) << 23) | (mantissa << 13));
    return bits.f;
}

/* float32 to fp16 bits, rounded to nearest even as torch's `.to(torch.float16)` rounds. */
static inline uint16_t float_to_half(float f) {
    union { float f; uint32_t u; } bits = {f};
    const uint32_t sign = (bits.u >> 16) & 0x8000u, magnitude = bits.u & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (magnitude > 0x7f800000u ? 0x200u : 0u));
    if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* 65520 and up: infinity */
    if (magnitude < 0x38800000u) { /* below 2^-14: a subnormal, |f| * 2^24 rounded (exact product) */
        return (uint16_t)(sign | (uint32_t)nearbyintf(fabsf(f) * 16777216.0f));
    }
    uint32_t half = (magnitude >> 13) - (112u << 10); /* exponent rebiased, mantissa cut to 10 bits */
    const uint32_t rest = magnitude & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half += 1u;
    return (uint16_t)(sign | half);
}

/* Row `row` of field `f` as floats: the pool's own memory, or `scratch` dequantized. */
static inline const float *row_of(const field_t *f, int64_t row, float *scratch) {
    if (f->plain != NULL) return f->plain + row * f->width;
    const uint8_t *codes = f->codes + row * (f->width / 2);
    const uint16_t *meta = f->meta + row * (f->width / f->group) * 2;
#pragma omp simd
    for (int64_t i = 0; i < f->width / 2; ++i) {
        scratch[2 * i] = (float)(codes[i] & 15u);
        scratch[2 * i + 1] = (float)(codes[i] >> 4);
    }
    for (int64_t g = 0; g < f->width / f->group; ++g) {
        const float s = half_to_float(meta[2 * g]), minimum = half_to_float(meta[2 * g + 1]);
        float *x = scratch + g * f->group;
        for (int64_t i = 0; i < f->group; ++i) x[i] *= s; /* two loops: rounded as torch rounds */
        for (int64_t i = 0; i < f->group; ++i) x[i] += minimum;
    }
    return scratch;
}

static int attend(const float *q, const field_t *k, const field_t *v, const int64_t *rows, const int64_t *n_keys,
                  float *out, int64_t R, int64_t HQ, int64_t KVH, int64_t D, int64_t L, int64_t T, float scale) {
    const int64_t G = HQ / KVH, head = T * D; /* q and out [R, HQ, T, D]: a head's stride */
    /* [HQ, L] scores, then 1 / sum per head, then a scratch row for a 4-bit key */
    float *scores = malloc(sizeof(float) * (size_t)(HQ * L + HQ + k->width));
    if (scores == NULL) return 1;
    float *inv = scores + HQ * L, *scratch = inv + HQ;
    for (int64_t r = 0; r < R; ++r)
        for (int64_t t = 0; t < T; ++t) {
            const int64_t n = n_keys[r] + t; /* query t sees the keys before it and itself */
            const int64_t *key_rows = rows + r * L;
            const float *qr = q + r * HQ * head + t * D;
            float *out_r = out + r * HQ * head + t * D;
            /* scores: one pass over the keys' K rows, every head of a key while its row is in cache */
            for (int64_t j = 0; j < n; ++j) {
                if (j + AHEAD < n) prefetch_row(k, key_rows[j + AHEAD]);
                const float *kj = row_of(k, key_rows[j], scratch);
                for (int64_t h = 0, hq = 0; h < KVH; ++h) {
                    const float *kh = kj + h * D;
                    for (int64_t g = 0; g < G; ++g, ++hq) {
                        const float *qh = qr + hq * head;
                        float s = 0.0f;
#pragma omp simd reduction(+ : s)
                        for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
                        scores[hq * L + j] = s * scale;
                    }
                }
            }
            for (int64_t hq = 0; hq < HQ; ++hq) { /* softmax per query head: float32, max first */
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
            for (int64_t hq = 0; hq < HQ; ++hq)
                for (int64_t d = 0; d < D; ++d) out_r[hq * head + d] = 0.0f;
            for (int64_t j = 0; j < n; ++j) {
                if (j + AHEAD < n) prefetch_row(v, key_rows[j + AHEAD]);
                const float *vj = row_of(v, key_rows[j], scratch);
                for (int64_t h = 0, hq = 0; h < KVH; ++h) {
                    const float *vh = vj + h * D;
                    for (int64_t g = 0; g < G; ++g, ++hq) {
                        const float p = scores[hq * L + j];
                        float *oh = out_r + hq * head;
#pragma omp simd
                        for (int64_t d = 0; d < D; ++d) oh[d] += p * vh[d];
                    }
                }
            }
            for (int64_t hq = 0; hq < HQ; ++hq)
                for (int64_t d = 0; d < D; ++d) out_r[hq * head + d] *= inv[hq];
        }
    free(scores);
    return 0;
}

int tl_decode_attention(const float *q, const float *k, const float *v, const int64_t *rows,
                        const int64_t *n_keys, float *out, int64_t R, int64_t HQ, int64_t KVH,
                        int64_t D, int64_t L, int64_t T, float scale) {
    const field_t kf = {k, NULL, NULL, KVH * D, 1}, vf = {v, NULL, NULL, KVH * D, 1};
    return attend(q, &kf, &vf, rows, n_keys, out, R, HQ, KVH, D, L, T, scale);
}

int tl_decode_attention_int4(const float *q, const uint8_t *k_codes, const uint16_t *k_meta,
                             const uint8_t *v_codes, const uint16_t *v_meta, const int64_t *rows,
                             const int64_t *n_keys, float *out, int64_t R, int64_t HQ, int64_t KVH,
                             int64_t D, int64_t L, int64_t T, int64_t group, float scale) {
    const field_t kf = {NULL, k_codes, k_meta, KVH * D, group}, vf = {NULL, v_codes, v_meta, KVH * D, group};
    return attend(q, &kf, &vf, rows, n_keys, out, R, HQ, KVH, D, L, T, scale);
}

/* RMSNorm of `rows` rows of H float32 values: x / sqrt(mean(x^2) + eps) * w, in torch's order
 * (the row scaled by the reciprocal, then by the weight); only the order of the sum of squares
 * differs from torch's. */
void tl_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t H, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * H;
        float *o = out + r * H, squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t h = 0; h < H; ++h) squares += xr[h] * xr[h];
        const float inv = 1.0f / sqrtf(squares / (float)H + eps);
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) o[h] = xr[h] * inv * w[h];
    }
}

/* 4-bit quantization of `n` rows of `width` float32 values into pool rows `rows` (codes
 * [N, width / 2], even index in the low nibble; fp16 (scale, minimum) per group of `group`), as
 * ``kvstore.quantize_int4`` computes it: minimum and (maximum - minimum) / 15 clamped to fp16's
 * range and rounded to fp16, each value quantized against the rounded pair, to nearest even. */
void tl_quantize_int4_rows(const float *x, const int64_t *rows, int64_t n, uint8_t *codes, uint16_t *meta,
                           int64_t width, int64_t group) {
    const float fp16_max = 65504.0f;
    for (int64_t i = 0; i < n; ++i) {
        const float *xi = x + i * width;
        uint8_t *c = codes + rows[i] * (width / 2);
        uint16_t *m = meta + rows[i] * (width / group) * 2;
        for (int64_t g = 0; g < width / group; ++g) {
            const float *xg = xi + g * group;
            float lo = xg[0], hi = xg[0];
            for (int64_t j = 1; j < group; ++j) { /* a NaN stays (torch's amin and amax propagate it) */
                const float value = xg[j];
                if (value != value) lo = hi = value;
                if (lo == lo) {
                    lo = value < lo ? value : lo;
                    hi = value > hi ? value : hi;
                }
            }
            lo = lo < -fp16_max ? -fp16_max : (lo > fp16_max ? fp16_max : lo);
            float scale = (hi - lo) / 15.0f;
            scale = scale > fp16_max ? fp16_max : scale;
            m[2 * g] = float_to_half(scale);
            m[2 * g + 1] = float_to_half(lo);
            const float s = half_to_float(m[2 * g]), minimum = half_to_float(m[2 * g + 1]);
            const float divisor = s < 1e-30f ? 1e-30f : s;
            uint8_t q[2] = {0, 0};
            for (int64_t j = 0; j < group; ++j) {
                float code = nearbyintf((xg[j] - minimum) / divisor);
                code = code > 15.0f ? 15.0f : code;
                q[j & 1] = code >= 0.0f ? (uint8_t)code : 0u; /* below 0, and NaN: 0 */
                if (j & 1) c[(g * group + j) / 2] = (uint8_t)(q[0] | (q[1] << 4));
            }
        }
    }
}
