/* The Inkling-2 loop model's small per-token steps (``tinyloop.model.inkling2``), each one call
 * in place of the 5-40 torch ops it replaces there, for the engine's forward.
 *
 * Why: a decode step of the bench's Inkling-2 shape runs ~3500 torch ops, most on a few rows of
 * 512 floats, at 5-10 us each on the 2-core machines we measure on: about two thirds of a step at
 * batch 8 went to them, beside the expert and projection products. What is left in torch is the
 * products with weights (torch's GEMM reads them at memory speed) and the pool's reads and writes.
 *
 * Each kernel is the maths of the torch function named in its comment, in float32, on the calling
 * thread (the work is a few hundred thousand multiply-adds at most); sums run in a fixed order,
 * so a result differs from torch's by float rounding only. Rows are independent: R is any count.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

/* exp in plain C that loops of `omp simd` vectorise (libm's expf and tanhf are calls, ~20 ns
 * each: most of an activation's time): Cephes' expf, 2^n times a degree-6 polynomial of the
 * rest with ln 2 split in two, within 2 ulp of libm's over the range; below -87.3 it is 0. */
static inline float vexp(float x) {
    const float clamped = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* rounded (1.5 * 2^23) */
    const float r = (clamped - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * r) * r + r + 1.0f;
    const union { int32_t i; float f; } scale = {((int32_t)n + 127) << 23}; /* 2^n */
    return x < -87.3f ? 0.0f : p * scale.f;
}

/* tanh as Cephes' tanhf computes it, both ways then one chosen (so that loops vectorise): below
 * 0.625 in size x + x^3 P(x^2), else sign(x) (1 - 2 / (exp(2|x|) + 1)); within 2 ulp of libm's. */
static inline float vtanh(float x) {
    const float z = x * x, ax = fabsf(x);
    const float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
                          1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
    const float large = 1.0f - 2.0f / (vexp(2.0f * ax) + 1.0f);
    return ax < 0.625f ? small : (x < 0.0f ? -large : large);
}

static inline float sigmoidf(float x) { return 1.0f / (1.0f + vexp(-x)); }

/* 1 / rms of n floats, with eps inside the root (``F.rms_norm``'s). */
static inline float inv_rms(const float *x, int64_t n, float eps) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
    return 1.0f / sqrtf(squares / (float)n + eps);
}

/* ``_clip``: scale x (n floats) down to L2 norm `threshold` where it is longer. */
static inline void clip(float *x, int64_t n, float threshold, float eps) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
    float f = (1.0f / (sqrtf(squares) + eps)) * threshold;
    if (f > 1.0f) f = 1.0f;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] *= f;
}

#define INK_MAX_STATES 64
#define INK_MAX_RANK 256
#define INK_MAX_EXPERTS 1024
#define INK_MAX_TOP_K 64
#define INK_MAX_DIM 1024

/* ``_attend_states`` then, where `w` is given, ``_weighted_rms(., w[q], w_eps)`` (query q's
 * weight at w + q * ld_w): for each row r,
 * the Q queries [Q, H] attend over its N states (``states + r * ld``, each [H], rows N apart
 * by H): the states RMS-normed (eps), logits q . s / sqrt(H), softmax over N, the mix of the
 * normed states. out [R, Q, H]. Returns 1 (and does nothing) where N exceeds INK_MAX_STATES. */
int tl_ink_attend_states(const float *states, int64_t ld, int64_t R, int64_t N, int64_t H, const float *queries,
                          int64_t Q, float eps, const float *w, int64_t ld_w, float w_eps, float *out) {
    float inv[INK_MAX_STATES], p[INK_MAX_STATES];
    if (N > INK_MAX_STATES) return 1;
    const float scale = 1.0f / sqrtf((float)H);
    for (int64_t r = 0; r < R; ++r) {
        const float *s = states + r * ld;
        for (int64_t n = 0; n < N; ++n) inv[n] = inv_rms(s + n * H, H, eps);
        for (int64_t q = 0; q < Q; ++q) {
            const float *qv = queries + q * H;
            float top = -INFINITY, total = 0.0f;
            for (int64_t n = 0; n < N; ++n) {
                const float *sn = s + n * H;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t h = 0; h < H; ++h) dot += sn[h] * (qv[h] * scale);
                p[n] = dot * inv[n];
                if (p[n] > top) top = p[n];
            }
            for (int64_t n = 0; n < N; ++n) total += (p[n] = vexp(p[n] - top));
            float *o = out + (r * Q + q) * H;
            for (int64_t h = 0; h < H; ++h) o[h] = 0.0f;
            for (int64_t n = 0; n < N; ++n) {
                const float c = p[n] / total * inv[n], *sn = s + n * H;
#pragma omp simd
                for (int64_t h = 0; h < H; ++h) o[h] += c * sn[h];
            }
            if (w != NULL) {
                const float f = inv_rms(o, H, w_eps), *wq = w + q * ld_w;
#pragma omp simd
                for (int64_t h = 0; h < H; ++h) o[h] = wq[h] * (o[h] * f);
            }
        }
    }
    return 0;
}

/* ``_Controller`` then, where `w` is given, ``_weighted_rms(., w, w_eps)``: per row,
 * low = down [rank, 2H] . [rms(h); rms(m)], out = (1 - tanh(forget . low)) h + tanh(message . low) m
 * (forget_t, message_t: the two [H, rank] weights transposed, [rank, H]). h and m rows are ld_h
 * and ld_m apart; out [R, H]; gains [H] scratch. Returns 1 (and does nothing) where rank exceeds
 * INK_MAX_RANK. */
int tl_ink_controller(const float *h, int64_t ld_h, const float *m, int64_t ld_m, int64_t R, int64_t H,
                       int64_t rank, const float *down, const float *forget_t, const float *message_t, float eps,
                       const float *w, float w_eps, float *gains, float *out) {
    float low[INK_MAX_RANK];
    if (rank > INK_MAX_RANK) return 1;
    for (int64_t r = 0; r < R; ++r) {
        const float *hr = h + r * ld_h, *mr = m + r * ld_m;
        const float ih = inv_rms(hr, H, eps), im = inv_rms(mr, H, eps);
        for (int64_t k = 0; k < rank; ++k) {
            const float *d = down + k * 2 * H;
            float a = 0.0f, b = 0.0f;
#pragma omp simd reduction(+ : a, b)
            for (int64_t i = 0; i < H; ++i) {
                a += d[i] * (hr[i] * ih);
                b += d[H + i] * (mr[i] * im);
            }
            low[k] = a + b;
        }
        float *o = out + r * H;
        for (int64_t i = 0; i < H; ++i) o[i] = gains[i] = 0.0f;
        for (int64_t k = 0; k < rank; ++k) {
            const float *f = forget_t + k * H, *g = message_t + k * H, l = low[k];
#pragma omp simd
            for (int64_t i = 0; i < H; ++i) {
                o[i] += f[i] * l;
                gains[i] += g[i] * l;
            }
        }
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) o[i] = (1.0f - vtanh(o[i])) * hr[i] + vtanh(gains[i]) * mr[i];
        if (w != NULL) {
            const float f = inv_rms(o, H, w_eps);
#pragma omp simd
            for (int64_t i = 0; i < H; ++i) o[i] = w[i] * (o[i] * f);
        }
    }
    return 0;
}

/* ``_ShortConv`` over x [R, T, C] (rows ld_x apart, tokens C apart) after each row's K - 1 earlier
 * inputs `tail` (rows ld_t apart, tokens td apart; the oldest first): with taps [K, C] (row j:
 * j tokens back) and, where `dyn` is given, each token's extra taps [heads, K] (rows of dyn
 * ld_d apart, tokens heads * K apart; a head's C / heads channels share them),
 * out = (sum_j ctx[t - j] tap_j + x) / denom, then `post`: 0 nothing, 1 each group of `group`
 * channels clipped to L2 norm `clip_to` (``_clip``), 2 each group RMS-normed (eps `clip_to`),
 * and `residual` [R, T, C] (rows ld_x apart) added where given. out [R, T, C]. */
void tl_ink_short_conv(const float *x, int64_t ld_x, const float *tail, int64_t ld_t, int64_t td, int64_t R,
                       int64_t T, int64_t C, int64_t K, const float *taps, const float *dyn, int64_t ld_d,
                       int64_t heads, float denom, int64_t post, int64_t group, float clip_to,
                       const float *residual, float *out) {
    const int64_t per_head = heads > 0 ? C / heads : C;
    for (int64_t r = 0; r < R; ++r) {
        for (int64_t t = 0; t < T; ++t) {
            const float *xt = x + r * ld_x + t * C;
            float *o = out + (r * T + t) * C;
            for (int64_t c = 0; c < C; ++c) {
                float acc = 0.0f;
                for (int64_t j = 0; j < K; ++j) {
                    const int64_t back = t - j; /* the token j back: this call's, or the tail's */
                    const float in = back >= 0 ? x[r * ld_x + back * C + c]
                                               : tail[r * ld_t + (K - 1 + back) * td + c];
                    float tap = taps[j * C + c];
                    if (dyn != NULL) tap += dyn[r * ld_d + (t * heads + c / per_head) * K + j];
                    acc += in * tap;
                }
                o[c] = (acc + xt[c]) / denom;
            }
            if (post != 0) {
                for (int64_t g = 0; g < C; g += group) {
                    if (post == 1) {
                        clip(o + g, group, clip_to, 1e-6f);
                    } else {
                        const float f = inv_rms(o + g, group, clip_to);
                        for (int64_t i = 0; i < group; ++i) o[g + i] *= f;
                    }
                }
            }
            if (residual != NULL) {
                const float *res = residual + r * ld_x + t * C;
                for (int64_t c = 0; c < C; ++c) o[c] += res[c];
            }
        }
    }
}

/* ``_Attention``'s maths after the projections, for one new token a row (decode):
 *   q [R, HQ * D] (rows ld_q apart) times q_scale [HQ, D], clipped per head to qk_clip, times
 *     the log scale where `full` (1 + alpha log(max((pos + 1) / floor, 1)));
 *   rel [R, HQ * DR] (rows ld_rel apart) times rel_scale [HQ, DR], clipped per head to rel_clip,
 *     times the log scale where `full`; the bias of a key `dist` back is rel . rel_proj[:, dist]
 *     ([DR, extent]), zero from `extent` back;
 *   keys and values [R, L, KVH * D] (rows ld_kv apart, keys kd apart); row r's key l at
 *     key_pos[r, l] is seen where visible[r, l], it is not ahead (dist >= 0) and, where `window`
 *     > 0, dist < window; head h reads KV head h / (HQ / KVH);
 *   scores q . k / sqrt(D) + bias; softmax over them and the head's sink logit (sink [R, HQ],
 *     rows ld_sink apart), the sink's share dropped; out = the mix of the values times
 *     sigmoid(gate) (gate [R, HQ * D], rows ld_gate apart). out [R, HQ * D].
 * `scratch` holds L floats. Returns 1 (and does nothing) where D or DR exceeds INK_MAX_DIM, else 0. */
int tl_ink_decode_attention(const float *q, int64_t ld_q, const float *q_scale, const float *rel, int64_t ld_rel,
                            const float *rel_scale, const float *rel_proj, int64_t DR, int64_t extent,
                            const float *sink, int64_t ld_sink, const float *gate, int64_t ld_gate,
                            const float *keys, const float *values, int64_t ld_kv, int64_t kd,
                            const int64_t *key_pos, const uint8_t *visible, const int64_t *positions, int64_t R,
                            int64_t L, int64_t HQ, int64_t KVH, int64_t D, int64_t window, int64_t full,
                            float alpha, float floor_, float qk_clip, float rel_clip, float *scratch, float *out) {
    if (D > INK_MAX_DIM || DR > INK_MAX_DIM) return 1;
    float qh[INK_MAX_DIM], rh[INK_MAX_DIM], *p = scratch;
    const int64_t groups = HQ / KVH;
    const float scale = 1.0f / sqrtf((float)D);
    for (int64_t r = 0; r < R; ++r) {
        const int64_t pos = positions[r];
        float log_scale = 1.0f;
        if (full) {
            float ratio = (float)(pos + 1) / floor_;
            if (ratio < 1.0f) ratio = 1.0f;
            log_scale = 1.0f + alpha * logf(ratio);
        }
        const int64_t *kp = key_pos + r * L;
        const uint8_t *vis = visible + r * L;
        for (int64_t h = 0; h < HQ; ++h) {
            const float *qs = q + r * ld_q + h * D, *rs = rel + r * ld_rel + h * DR;
            for (int64_t d = 0; d < D; ++d) qh[d] = qs[d] * q_scale[h * D + d];
            clip(qh, D, qk_clip, 1e-6f);
            for (int64_t d = 0; d < DR; ++d) rh[d] = rs[d] * rel_scale[h * DR + d];
            clip(rh, DR, rel_clip, 1e-6f);
            if (full) {
                for (int64_t d = 0; d < D; ++d) qh[d] *= log_scale;
                for (int64_t d = 0; d < DR; ++d) rh[d] *= log_scale;
            }
            const int64_t kvh = h / groups;
            const float *kb = keys + r * ld_kv + kvh * D, *vb = values + r * ld_kv + kvh * D;
            const float sink_logit = sink[r * ld_sink + h];
            float top = sink_logit;
            for (int64_t l = 0; l < L; ++l) {
                const int64_t dist = pos - kp[l];
                if (!vis[l] || dist < 0 || (window > 0 && dist >= window)) {
                    p[l] = -INFINITY;
                    continue;
                }
                const float *k = kb + l * kd;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d];
                float bias = 0.0f;
                if (dist < extent)
                    for (int64_t d = 0; d < DR; ++d) bias += rh[d] * rel_proj[d * extent + dist];
                p[l] = dot * scale + bias;
                if (p[l] > top) top = p[l];
            }
            float total = vexp(sink_logit - top);
#pragma omp simd reduction(+ : total)
            for (int64_t l = 0; l < L; ++l) {
                p[l] = vexp(p[l] - top); /* (-inf: 0) */
                total += p[l];
            }
            float *o = out + r * HQ * D + h * D;
            for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
            for (int64_t l = 0; l < L; ++l) {
                if (p[l] == 0.0f) continue;
                const float c = p[l] / total, *v = vb + l * kd;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) o[d] += c * v[d];
            }
            const float *g = gate + r * ld_gate + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] *= sigmoidf(g[d]);
        }
    }
    return 0;
}

/* ``_MoE.route`` and the grouping after it: for each of N tokens x [N, H] (rows ld_x apart),
 * scores = sigmoid(router [E, H] . x), the top_k experts by score + bias (ties: the lower
 * expert), their scores renormalised (sum + 1e-20) times route_scale. Then the N * top_k
 * (token, expert) pairs grouped by expert, in token order within one: picked [N * top_k, H]
 * (the token's row), tokens [N * top_k] (its index), weights [N * top_k], counts [E]. Returns 1
 * (and does nothing) where E exceeds INK_MAX_EXPERTS or top_k INK_MAX_TOP_K or E. */
int tl_ink_route(const float *x, int64_t ld_x, int64_t N, int64_t H, const float *router, const float *bias,
                  int64_t E, int64_t top_k, float route_scale, float *picked, int64_t *tokens, float *weights,
                  int64_t *counts, int64_t *chosen_scratch, float *weight_scratch) {
    float scores[INK_MAX_EXPERTS];
    uint8_t taken[INK_MAX_EXPERTS];
    if (E > INK_MAX_EXPERTS || top_k > INK_MAX_TOP_K || top_k > E) return 1;
    for (int64_t e = 0; e < E; ++e) counts[e] = 0;
    for (int64_t n = 0; n < N; ++n) {
        const float *xn = x + n * ld_x;
        for (int64_t e = 0; e < E; ++e) {
            const float *w = router + e * H;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t h = 0; h < H; ++h) dot += xn[h] * w[h];
            scores[e] = sigmoidf(dot);
            taken[e] = 0;
        }
        float sum = 0.0f;
        for (int64_t k = 0; k < top_k; ++k) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e)
                if (!taken[e] && (best < 0 || scores[e] + bias[e] > scores[best] + bias[best])) best = e;
            taken[best] = 1;
            chosen_scratch[n * top_k + k] = best;
            weight_scratch[n * top_k + k] = scores[best];
            sum += scores[best];
            counts[best] += 1;
        }
        for (int64_t k = 0; k < top_k; ++k)
            weight_scratch[n * top_k + k] = weight_scratch[n * top_k + k] / (sum + 1e-20f) * route_scale;
    }
    int64_t start[INK_MAX_EXPERTS], at = 0;
    for (int64_t e = 0; e < E; ++e) {
        start[e] = at;
        at += counts[e];
    }
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t k = 0; k < top_k; ++k) {
            const int64_t e = chosen_scratch[n * top_k + k], i = start[e]++;
            tokens[i] = n;
            weights[i] = weight_scratch[n * top_k + k];
            const float *xn = x + n * ld_x;
            float *dst = picked + i * H;
            for (int64_t h = 0; h < H; ++h) dst[h] = xn[h];
        }
    }
    return 0;
}

/* ``_MoE._activation``: per row of gate_up [M, 2I] ([g; u]), a b tanh(g / a) tanh(u / b) sigmoid(g)
 * with a, b the gate's and up's softcaps. out [M, I]. */
void tl_ink_activation(const float *gate_up, int64_t M, int64_t I, float a, float b, float *out) {
    const float ia = 1.0f / a, ib = 1.0f / b, ab = a * b;
    for (int64_t m = 0; m < M; ++m) {
        const float *g = gate_up + m * 2 * I, *u = g + I;
        float *o = out + m * I;
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) o[i] = vtanh(g[i] * ia) * vtanh(u[i] * ib) * sigmoidf(g[i]) * ab;
    }
}

/* The experts' outputs back to their tokens: out [N, H] = sum over i of weights[i] down [i]
 * added to row tokens[i] (down [M, H]), in the order of i, from zero. */
void tl_ink_combine(const float *down, const int64_t *tokens, const float *weights, int64_t M, int64_t N, int64_t H,
                    float *out) {
    for (int64_t i = 0; i < N * H; ++i) out[i] = 0.0f;
    for (int64_t i = 0; i < M; ++i) {
        const float *d = down + i * H, w = weights[i];
        float *o = out + tokens[i] * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) o[h] += d[h] * w;
    }
}
