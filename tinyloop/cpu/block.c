/* One decoder block's decode step in one call: every row's one new token through the block,
 * the same kernels `Block.run` calls one by one from Python (kernels.c, qmatmul.c), in the same
 * order on the same buffers, so the result is theirs; only the SwiGLU is computed here.
 *
 * Why: a decode step of a small model at batch 1 spent about 150 us a block between the kernels
 * (the Python and torch calls around them: norms, views, RoPE tables, residual adds, the KV
 * write, ~20 calls), as long as the kernels themselves took on a ~100M model. Here a block is
 * one call.
 *
 *   x       [R, H]   the block's input (row r's residual stream), read
 *   normed  [R, H]   n1(x) when the block before made it, else NULL (computed here)
 *   cos/sin [cs_rows, D] each row's RoPE at its position (cs_rows R, or 1 for every row)
 *   kv      the layer's KV pool (`tl_kv`): float32 K and V [pool_rows, KVH * D], or 4-bit
 *            (``kvstore.Int4Buffer``: codes [pool_rows, KVH * D / 2], fp16 (scale, minimum) per
 *            group [pool_rows, KVH * D / group, 2]); `write_rows` [R] where each row's new K and
 *            V go, `key_rows` [R, L] the rows its keys are read from, of which the first
 *            n_keys[r] (its own new one included) are attended
 *   then_w  [H] the next block's input norm, or NULL; then_out [R, H] gets it of the output
 *   x_out   [R, H]   the block's output
 *
 * The block (``layers.Block``): a fused [q; k; v] projection or three, q and k biases where the
 * block has them, RoPE on q and k, no q/k norm with a weight (Parcae's weightless one per head
 * after RoPE, `qk_head_norm`, is covered), Parcae's value embeddings added to v; a SwiGLU MLP
 * with a fused [gate; up] projection, or Parcae's 0.5 relu(fc)^2 (`relu2`); norms placed by `style`:
 *   0 pre_ln:   x = x + attn(n1(x));      x = x + mlp(n3(x))
 *   1 sandwich: x = n2(x + attn(n1(x)));  x = n4(x + mlp(n3(x)))
 *   2 peri_ln:  x = x + n2(attn(n1(x)));  x = x + n4(mlp(n3(x)))
 * Each weight is float32 panels (kernels.c's `tl_pack_panels`), int8, int4 or bf16 (qmatmul.c).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"

typedef struct {
    int64_t kind; /* 0 float32 panels, 1 int8, 2 int4, 3 bf16 */
    int64_t n, k, group;
    const void *panels;
    const float *scales; /* int8 with group 0: one per output (else its scales are in the panels) */
    int64_t terms;       /* int8 and int4: the activations in 1 or 2 int8 terms (qmatmul.c's `q_matmul`) */
} tl_weight;

typedef struct {
    int64_t int4, group, pool_rows; /* int4: 4-bit codes and meta, else float32 k and v */
    float *k, *v;
    uint8_t *k_codes, *v_codes;
    uint16_t *k_meta, *v_meta;
} tl_kv;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, style, rope_half;
    const float *n1, *n2, *n3, *n4; /* NULL where the style has none */
    tl_weight qkv, o, fc, proj;
    float eps;
    int64_t fused_qkv; /* 0: q, k and v are three products (Ouro) */
    tl_weight q, k, v;
    const float *q_bias, *k_bias; /* [HQ, D] and [KVH, D] added before RoPE (Huginn), or NULL */
    int64_t relu2;        /* the MLP: 0 SwiGLU over fc = [gate; up] (2I wide), 1 0.5 relu(fc)^2 (I wide; Parcae) */
    int64_t qk_head_norm; /* 1: q and k RMS-normed per head after RoPE, no weight, eps head_eps (Parcae) */
    float head_eps;
    /* Parcae's value embeddings, or NULL: v += 2 sigmoid(value_gate . in[:gate_channels]) * value_table[id]
     * (value_table [vocab, KVH * D], value_gate [KVH, gate_channels], float32; `ids` then required) */
    const float *value_table, *value_gate;
    int64_t gate_channels, vocab; /* vocab: value_table's rows (an id past them: code 3) */
} tl_block;

static int product(const tl_weight *w, const float *x, int64_t M, float *y) {
    switch (w->kind) {
    case 0: return tl_panel_matmul(x, M, w->k, w->panels, w->n, NULL, y);
    case 1: return tl_matmul_q8(x, M, w->k, w->panels, w->n, w->scales, w->group, NULL, y, w->terms);
    case 2: return tl_matmul_q4(x, M, w->k, w->panels, w->n, w->group, NULL, y, w->terms);
    default: return tl_matmul_bf16(x, M, w->k, w->panels, w->n, NULL, y);
    }
}

/* A residual add with its norms (`Backend.residual_norm`): r from x and the sublayer's a (`a`
 * is overwritten), then h = norm(r) by w_out where there is one. */
static void join(const tl_block *b, const float *x, const float *a, const float *w_in, const float *w_out,
                 int64_t R, float *r, float *h) {
    tl_residual_rows(x, a, w_in, w_out, R, b->hidden, b->style, b->eps, r, h);
}

/* Returns 0; 1 where scratch memory could not be allocated; 2 where a write row is outside the
 * pool, 3 where a block with value embeddings got no `ids` [R] or one past its table (nothing of
 * the block is then kept). */
int tl_decode_block(const tl_block *b, const float *x, const float *normed, int64_t R, const float *cos,
                    const float *sin, int64_t cs_rows, const tl_kv *kv, const int64_t *write_rows,
                    const int64_t *key_rows, int64_t L, const int64_t *n_keys, const float *then_w, float *x_out,
                    float *then_out, const int64_t *ids) {
    const int64_t H = b->hidden, HQ = b->heads, KVH = b->kv_heads, D = b->head_dim, I = b->intermediate;
    const int64_t qkv_w = (HQ + 2 * KVH) * D, qk_w = (HQ + KVH) * D, kv_w = KVH * D;
    for (int64_t i = 0; i < R; ++i)
        if (write_rows[i] < 0 || write_rows[i] >= kv->pool_rows) return 2;
    if (b->value_table != NULL) {
        if (ids == NULL) return 3;
        for (int64_t i = 0; i < R; ++i)
            if (ids[i] < 0 || ids[i] >= b->vocab) return 3;
    }
    const size_t floats = (size_t)R * (size_t)(3 * H + 2 * qkv_w + qk_w + HQ * D + 3 * I + 2 * kv_w);
    float *memory = malloc(floats * sizeof(float));
    if (memory == NULL) return 1;
    float *h = memory, *a = h + R * H, *r = a + R * H, *qkv = r + R * H, *qk = qkv + R * qkv_w;
    float *att = qk + R * qk_w, *fc = att + R * HQ * D, *s = fc + R * 2 * I, *new_k = s + R * I, *new_v = new_k + R * kv_w;
    float *sep = new_v + R * kv_w; /* q, k, v of three products, [R, HQ * D] then [R, kv_w] twice */
    int failed = 0;
    if (normed == NULL) tl_rms_norm(x, b->n1, h, R, H, b->eps);
    const float *in = normed != NULL ? normed : h;
    if (b->fused_qkv) {
        failed |= product(&b->qkv, in, R, qkv);
    } else {
        float *q = sep, *k = q + R * HQ * D, *v = k + R * kv_w;
        failed |= product(&b->q, in, R, q) | product(&b->k, in, R, k) | product(&b->v, in, R, v);
        for (int64_t m = 0; m < R; ++m) {
            memcpy(qkv + m * qkv_w, q + m * HQ * D, (size_t)(HQ * D) * sizeof(float));
            memcpy(qkv + m * qkv_w + HQ * D, k + m * kv_w, (size_t)kv_w * sizeof(float));
            memcpy(qkv + m * qkv_w + qk_w, v + m * kv_w, (size_t)kv_w * sizeof(float));
        }
    }
    if (b->q_bias != NULL) /* (the same float adds as torch's `q + q_bias`) */
        for (int64_t m = 0; m < R; ++m) {
            float *row = qkv + m * qkv_w;
            for (int64_t i = 0; i < HQ * D; ++i) row[i] = row[i] + b->q_bias[i];
            for (int64_t i = 0; i < kv_w; ++i) row[HQ * D + i] = row[HQ * D + i] + b->k_bias[i];
        }
    if (b->value_table != NULL) /* v += gate * the token's value embedding, per KV head */
        for (int64_t m = 0; m < R; ++m) {
            float *v = qkv + m * qkv_w + qk_w;
            const float *row = b->value_table + ids[m] * kv_w, *xin = in + m * H;
            for (int64_t h = 0; h < KVH; ++h) {
                const float *g = b->value_gate + h * b->gate_channels;
                float dot = 0.0f;
                for (int64_t c = 0; c < b->gate_channels; ++c) dot += xin[c] * g[c];
                const float gate = 2.0f * (1.0f / (1.0f + expf(-dot)));
                for (int64_t d = 0; d < D; ++d) v[h * D + d] = v[h * D + d] + gate * row[h * D + d];
            }
        }
    tl_rope(qkv, qkv_w, cos, sin, cs_rows, qk, R, HQ + KVH, 1, D, (int)b->rope_half); /* [R, HQ + KVH, D] */
    if (b->qk_head_norm) /* each head of q and k over its D values (`F.rms_norm(q, (D,))`) */
        for (int64_t i = 0; i < R * (HQ + KVH); ++i) {
            float *head = qk + i * D, squares = 0.0f;
            for (int64_t d = 0; d < D; ++d) squares += head[d] * head[d];
            const float inv = 1.0f / sqrtf(squares / (float)D + b->head_eps);
            for (int64_t d = 0; d < D; ++d) head[d] = head[d] * inv;
        }
    const float scale = (float)(1.0 / sqrt((double)D));
    if (kv->int4) { /* the new K and V quantized as the pool stores them, then read back with the rest */
        for (int64_t m = 0; m < R; ++m) {
            memcpy(new_k + m * kv_w, qk + m * qk_w + HQ * D, (size_t)kv_w * sizeof(float));
            memcpy(new_v + m * kv_w, qkv + m * qkv_w + qk_w, (size_t)kv_w * sizeof(float));
        }
        tl_quantize_int4_rows(new_k, write_rows, R, kv->k_codes, kv->k_meta, kv_w, kv->group);
        tl_quantize_int4_rows(new_v, write_rows, R, kv->v_codes, kv->v_meta, kv_w, kv->group);
        failed |= tl_decode_attention_int4(qk, qk_w, kv->k_codes, kv->k_meta, kv->v_codes, kv->v_meta, key_rows,
                                           n_keys, att, R, HQ, KVH, D, L, 1, kv->group, scale);
    } else {
        tl_write_rows(qk + HQ * D, qk_w, write_rows, R, kv->k, kv->pool_rows, kv_w);
        tl_write_rows(qkv + qk_w, qkv_w, write_rows, R, kv->v, kv->pool_rows, kv_w);
        failed |= tl_decode_attention(qk, qk_w, kv->k, kv->v, key_rows, n_keys, att, R, HQ, KVH, D, L, 1, scale);
    }
    failed |= product(&b->o, att, R, a);
    join(b, x, a, b->n2, b->n3, R, r, h); /* r: the stream after attention, h: n3(r) */
    failed |= product(&b->fc, h, R, fc);
    if (b->relu2) /* `F.relu(fc).square().mul(0.5)`: fc is [R, I] */
        for (int64_t i = 0; i < R * I; ++i) {
            const float t = fc[i] > 0.0f ? fc[i] : 0.0f;
            s[i] = (t * t) * 0.5f;
        }
    else
        for (int64_t m = 0; m < R; ++m) tl_swiglu_row(fc + m * 2 * I, fc + m * 2 * I + I, s + m * I, I);
    failed |= product(&b->proj, s, R, a);
    join(b, r, a, b->n4, then_w, R, x_out, then_out);
    free(memory);
    return failed ? 1 : 0;
}

/* A stack of blocks (a prelude, one loop of the core, a coda) in one call: block i runs at slot
 * `slot0 + i`, its write and key rows the slot's rows of `write_by_slot` [S, R] and
 * `keys_by_slot` [S, R, L]; each block's output norm feeds the next block's input (as
 * `LoopedLM.stack` passes `then`), the last block's none; the first block norms its own input.
 * x [R, H] is updated in place; `scratch` [R, H] holds the norms between blocks.
 * Returns the first failing block's code (the stack stops there). */
int tl_decode_stack(const tl_block *const *blocks, int64_t n, int64_t slot0, float *x, float *scratch, int64_t R,
                    const float *cos, const float *sin, int64_t cs_rows, const tl_kv *kv, const int64_t *write_by_slot, const int64_t *keys_by_slot, int64_t L, const int64_t *n_keys) {
    for (int64_t i = 0; i < n; ++i) {
        const int64_t slot = slot0 + i;
        const float *then_w = i + 1 < n ? blocks[i + 1]->n1 : NULL;
        const int code = tl_decode_block(blocks[i], x, i == 0 ? NULL : scratch, R, cos, sin, cs_rows, kv,
                                         write_by_slot + slot * R, keys_by_slot + slot * R * L, L, n_keys, then_w,
                                         x, then_w != NULL ? scratch : NULL, NULL);
        if (code) return code;
    }
    return 0;
}

/* A looped model's whole decode step (`LoopedLM.forward` of one new token a row, every row the
 * same loops, no exit rule, no warm state) in one call: `cpu.step.FusedStep`. The same kernels
 * in the same order as the step through Python (embedding row, prelude stack, prelude norm, the
 * initial state, each loop's injection and core stack, the final norm, the coda, the head).
 *   tokens [R]  each row's token (one past the embedding: code 3, nothing run)
 *   state  [R, H]  the initial core state (zeros or each row's noise; `init_embed`: written
 *                  here from e), then the last loop's state (`ForwardOutput.state`)
 *   core_slots [loops] each loop's first core slot; coda_slot the coda's
 *   logits [R, V]
 * Returns 0, 1 where scratch memory could not be allocated, or a stack's code (2, 3). */
typedef struct {
    int64_t hidden, vocab, n_prelude, n_core, n_coda;
    const tl_block *const *prelude, *const *core, *const *coda;
    const float *embed; /* [vocab, H], row i's value h at i * embed_row + h * embed_col (a tied head's */
    int64_t embed_row, embed_col; /* table may be column-major: cpu_linear) */
    float embed_scale;
    const float *prelude_norm; /* NULL: none */
    int64_t concat;            /* 1: each loop's input is adapter([state; e]) (concat_linear), 0: the state */
    tl_weight adapter;
    int64_t init_embed; /* 1: the initial state is e (state_init "embed") */
    int64_t every_loop; /* 1: final_norm on the state after each loop (loop_norm "every_loop") */
    int64_t norm_first; /* 1: final_norm on the state before the coda (loop_norm "final_only") */
    int64_t norm_last;  /* 1: final_norm after the coda (there is one, or loop_norm "none") */
    const float *final_norm;
    float eps;
    tl_weight head;
} tl_model;

int tl_decode_model(const tl_model *m, const int64_t *tokens, int64_t R, int64_t loops, const int64_t *core_slots,
                    int64_t coda_slot, float *state, float *logits, const float *cos, const float *sin,
                    int64_t cs_rows, const tl_kv *kv, const int64_t *write_by_slot, const int64_t *keys_by_slot,
                    int64_t L, const int64_t *n_keys) {
    const int64_t H = m->hidden;
    for (int64_t i = 0; i < R; ++i)
        if (tokens[i] < 0 || tokens[i] >= m->vocab) return 3;
    float *memory = malloc((size_t)(R * 5 * H) * sizeof(float));
    if (memory == NULL) return 1;
    float *x = memory, *e = x + R * H, *scratch = e + R * H, *cat = scratch + R * H; /* cat: [R, 2H] */
    int code = 0;
    for (int64_t i = 0; i < R; ++i) {
        const float *row = m->embed + tokens[i] * m->embed_row;
        if (m->embed_scale != 1.0f)
            for (int64_t h = 0; h < H; ++h) x[i * H + h] = row[h * m->embed_col] * m->embed_scale;
        else
            for (int64_t h = 0; h < H; ++h) x[i * H + h] = row[h * m->embed_col];
    }
#define STACK(blocks, n, slot, buf)                                                                              \
    if ((n) > 0 && (code = tl_decode_stack((blocks), (n), (slot), (buf), scratch, R, cos, sin, cs_rows, kv,      \
                                           write_by_slot, keys_by_slot, L, n_keys)) != 0)                       \
        goto done;
    STACK(m->prelude, m->n_prelude, 0, x)
    if (m->prelude_norm != NULL)
        tl_rms_norm(x, m->prelude_norm, e, R, H, m->eps);
    else
        memcpy(e, x, (size_t)(R * H) * sizeof(float));
    if (m->init_embed) memcpy(state, e, (size_t)(R * H) * sizeof(float));
    for (int64_t r = 0; r < loops; ++r) {
        if (m->concat) {
            for (int64_t i = 0; i < R; ++i) {
                memcpy(cat + i * 2 * H, state + i * H, (size_t)H * sizeof(float));
                memcpy(cat + i * 2 * H + H, e + i * H, (size_t)H * sizeof(float));
            }
            if ((code = product(&m->adapter, cat, R, state)) != 0) goto done;
        }
        STACK(m->core, m->n_core, core_slots[r], state)
        if (m->every_loop) tl_rms_norm(state, m->final_norm, state, R, H, m->eps); /* (row by row: in place) */
    }
    if (m->norm_first)
        tl_rms_norm(state, m->final_norm, x, R, H, m->eps);
    else
        memcpy(x, state, (size_t)(R * H) * sizeof(float));
    STACK(m->coda, m->n_coda, coda_slot, x)
    if (m->norm_last) tl_rms_norm(x, m->final_norm, x, R, H, m->eps);
    code = product(&m->head, x, R, logits);
#undef STACK
done:
    free(memory);
    return code;
}

/* The softmax probability of id `at` (the maximum) over x[0 .. limit - 1]. */
static float pick_prob(const float *x, int64_t limit, int64_t at) {
    const float top = x[at];
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t v = 0; v < limit; ++v) total += expf(x[v] - top);
    return 1.0f / total;
}

/* A lone row's greedy burst: up to K steps of `tl_decode_model` at batch 1, each feeding the token
 * the step before picked (the first: `token`), each pick the first maximum of the step's logits
 * over ids below `limit` (`tl_max_rows`, the sampler's greedy rule). Step i stores its K and V at
 * position start + i and attends to start + i + 1 keys.
 *   init   [K, H] each step's initial core state (its noise), or NULL: zeros, or e where the model
 *          makes it (`init_embed`)
 *   state  [H] scratch, then the last step's state; logits [V] scratch, then the last step's
 *   cos/sin [K, D] each step's RoPE; write [K, S] each step's KV row per slot; keys [S, L] the
 *          rows of every key (L >= start + K)
 *   stops  [n_stops] ids after which the burst ends (EOS, stop tokens)
 *   min_prob  the burst also ends after a pick whose softmax probability (over ids below
 *          `limit`) is below it (a speculative draft's unsure token); 0: never
 *   out    [K] the picked ids; *made how many steps ran to a pick
 * Returns 0 (K steps, or a stop id picked), 5 where step *made's logits held a NaN or +inf or
 * nothing finite (nothing picked from them), or `tl_decode_model`'s code. */
int tl_decode_burst(const tl_model *m, int64_t token, int64_t K, int64_t loops, const int64_t *core_slots,
                    int64_t coda_slot, const float *init, float *state, float *logits, const float *cos,
                    const float *sin, int64_t D, const tl_kv *kv, const int64_t *write, int64_t S,
                    const int64_t *keys, int64_t L, int64_t start, int64_t limit, const int64_t *stops,
                    int64_t n_stops, float min_prob, int64_t *out, int64_t *made) {
    const int64_t H = m->hidden;
    *made = 0;
    if (limit < 1 || limit > m->head.n || start + K > L) return 4;
    for (int64_t i = 0; i < K; ++i) {
        if (init != NULL)
            memcpy(state, init + i * H, (size_t)H * sizeof(float));
        else
            memset(state, 0, (size_t)H * sizeof(float));
        const int64_t n_keys = start + i + 1;
        const int code = tl_decode_model(m, &token, 1, loops, core_slots, coda_slot, state, logits, cos + i * D,
                                         sin + i * D, 1, kv, write + i * S, keys, L, &n_keys);
        if (code != 0) return code;
        int64_t at = 0;
        int8_t usable = 0;
        tl_max_rows(logits, 1, limit, &at, &usable);
        if (!usable) return 5;
        out[i] = token = at;
        *made = i + 1;
        for (int64_t j = 0; j < n_stops; ++j)
            if (stops[j] == at) return 0;
        if (min_prob > 0.0f && pick_prob(logits, limit, at) < min_prob) return 0;
    }
    return 0;
}
