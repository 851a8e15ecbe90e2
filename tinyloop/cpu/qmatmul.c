/* Quantised matrix products with integer dot products: y [M, N] = x [M, K] W^T (+ bias [N]) for
 * int8 and int4 weights (`quant.QuantWeight`), the activations quantised to int8 on the fly.
 *
 * A batch-1 decode step reads every weight once and does two multiply-adds per weight: with the
 * weights widened to float32 as they are read (kernels.c's int8 and int4 panels) a core spends
 * three or more vector instructions on each 16 weights and runs out of instructions before the
 * memory runs out of bytes. Here the activations are quantised instead, once per call, per
 * block of QBLOCK (32) inputs: d = max|x| / 127, xq = round(x / d) in [-127, 127] (ties to even),
 * and each weight byte goes straight into an integer dot product: one AVX-512 VNNI `vpdpbusd`
 * multiplies 64 unsigned bytes by 64 signed ones and adds each four into 16 int32 sums, i.e. 16
 * output columns x 4 inputs a instruction. Each block's int32 sums are exact; they are turned
 * into float32 and scaled once per block.
 *
 * Layouts (`tl_pack_q8`, `tl_pack_q4`): the weight in panels of 16 output columns (the last one
 * zero-padded), each panel one sequential stream.
 *   int8  W[n, k] = q[n, k] * scale[n], q in [-127, 127]. A panel holds, per 4 inputs k..k+3,
 *         64 bytes: column j's four codes + 128 at bytes 4j..4j+3 (unsigned: `vpdpbusd` takes
 *         the weights as its unsigned operand and the activations as its signed one; the 128 *
 *         sum(xq) that adds is taken off each block's sums, exactly). K is padded to a multiple
 *         of 4 with code 0.
 *   int8 grouped (`tl_pack_q8g`): W[n, k] = q[n, k] * scale[n, g], a scale per group g of `group`
 *         inputs (a multiple of 32 dividing K; q8_0's weights at 32). A panel starts with its
 *         scales, 16 fp16 a group (padded to a cache line), then holds its codes as above: the
 *         codes stay on cache-line boundaries (with 32 bytes of scales after each group, every
 *         other group's loads would straddle two lines), and the stream prefetched ahead of one
 *         panel's codes reaches the next one's scales. 8.5 bits a weight at 32.
 *         y = sum_b d_b scale_g(b) dot_b.
 *   int4  W[n, k] = q[n, k] * scale[g, n] + shift[g, n] (shift = zero - 8 scale, i.e. QuantWeight's
 *         (q - 8) * scale + zero), q in [0, 15], groups g of `group` inputs (a multiple of 32).
 *         Per group, per 8 inputs k..k+7, 64 bytes: byte 4j + i holds column j's code of input
 *         k + i in its low nibble and of k + 4 + i in its high one (one AND, or a shift and an
 *         AND, and the 64 bytes are a `vpdpbusd` operand: no shuffle), then the group's 16
 *         scales and 16 shifts as fp16 (64 bytes): group * 8 + 64 bytes a group, 5 bits a weight.
 *         y = sum_g scale_g * sum_b d_b dot_b + shift_g * sum_b d_b sum(xq_b).
 *
 * Every result is the product of the dequantised weight with the dequantised activations (d_b *
 * xq), exact in each block's integer sum, float32 across blocks: paths differ from each other
 * only in float32 rounding across blocks.
 *
 * Paths (`tl_set_quant_isa`): 2 = AVX-512 VNNI and BW, 1 = AVX2 (`vpmaddubsw` + `vpmaddwd`:
 * int8 moves the activations' signs onto the weights, `vpsignb`, so no pair sum saturates), 0 =
 * portable C. The library is built for the CPU it runs on (-march=native, its cache key holds
 * the CPU's flags), so the best path this CPU has is compiled in and chosen; a lower one can be
 * forced (the tests run each in turn).
 */
#define _GNU_SOURCE
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include "kernels.h"

#define QBLOCK 32    /* inputs per activation block */
#define QPANEL 16    /* output columns per panel */
#define QMAX_ROWS 8  /* rows a panel pass keeps in registers */
/* bytes of the scales at the start of a grouped int8 panel of K inputs (`tl_pack_q8g`; group 0: none) */
#define Q8_HEAD_BYTES(K, group) ((group) ? ((K) / (group) * 2 * QPANEL + 63) / 64 * 64 : 0)
/* bytes: prefetch this far ahead along the panel stream, into L2 (`prefetcht1`: `prefetchnta` ran
 * 1.5-3.4x slower on an Intel Xeon, kernels.c's PANEL_AHEAD). 2 kB against 256 B, measured with the
 * hint already t1 (bench/LOG.md, 2026-12-02 23:50): one-row products 5-20% more GB/s at int8 and
 * int4, 7-24% at bf16; the engine's decode 8-13% faster at batch 1, 10-19% at batch 8; prefill
 * the same. (The earlier "128-256 B best" was measured before the hint was t1, on another machine.) */
#define Q_AHEAD 2048
#define Q_CHUNK_BYTES (192 * 1024) /* panels every block of rows reuses from L2 (past QMAX_ROWS rows) */
#define Q_SPLIT_BYTES (64 * 1024)  /* a product whose weights are smaller stays on its caller's thread */
#define Q_TASKS_PER_THREAD 4       /* tasks a thread at 1-3 rows (streaming: fewer claims) */
#define Q_TASKS_PER_THREAD_MANY 16 /* at 4 and more rows (compute: finer, the threads end together) */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define Q_BEST 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q_BEST 1
#else
#define Q_BEST 0
#endif

static _Atomic int q_isa = Q_BEST;

/* The best path compiled in (2 AVX-512 VNNI, 1 AVX2, 0 portable). */
int tl_quant_isa_best(void) { return Q_BEST; }

/* Use path `level` (clamped to what is compiled in; below 0: the best). Returns the path now used. */
int tl_set_quant_isa(int level) {
    level = level < 0 || level > Q_BEST ? Q_BEST : level;
    atomic_store(&q_isa, level);
    return level;
}

int tl_quant_isa(void) { return atomic_load(&q_isa); }

static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* x [M, K] float32 -> xq [M, Kp] int8 (zero past K), per block b of QBLOCK inputs d [M, nb] and
 * the block's sum of xq, sums [M, nb]. A block holding a NaN or an infinity gets codes 0 and
 * scale NaN: the outputs of its row come out NaN, as a float product's would, and the engine's
 * check of the logits fails that request alone. */
void tl_quantize_act(const float *x, int64_t M, int64_t K, int64_t Kp, int8_t *xq, float *d, int32_t *sums) {
    const int64_t nb = (Kp + QBLOCK - 1) / QBLOCK;
    for (int64_t m = 0; m < M; ++m) {
        const float *xr = x + m * K;
        int8_t *qr = xq + m * Kp;
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t k0 = b * QBLOCK, k1 = k0 + QBLOCK < K ? k0 + QBLOCK : K;
#if defined(__AVX512F__)
            if (k1 - k0 == QBLOCK) { /* a whole block in two registers: what the loops below compute */
                const __m512 v0 = _mm512_loadu_ps(xr + k0), v1 = _mm512_loadu_ps(xr + k0 + 16);
                const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1), big = _mm512_set1_ps(FLT_MAX);
                const int bad = (_mm512_cmp_ps_mask(a0, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(a1, big, _CMP_NLE_UQ)) != 0;
                const float scale = bad ? NAN : _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)) / 127.0f;
                int32_t total = 0;
                if (!bad && scale > 0.0f) { /* x / scale rounded to nearest even, as nearbyintf */
                    const __m512 s = _mm512_set1_ps(scale);
                    const __m512i q0 = _mm512_cvtps_epi32(_mm512_div_ps(v0, s)), q1 = _mm512_cvtps_epi32(_mm512_div_ps(v1, s));
                    _mm_storeu_si128((__m128i *)(void *)(qr + k0), _mm512_cvtepi32_epi8(q0));
                    _mm_storeu_si128((__m128i *)(void *)(qr + k0 + 16), _mm512_cvtepi32_epi8(q1));
                    total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
                } else {
                    memset(qr + k0, 0, QBLOCK);
                }
                d[m * nb + b] = scale;
                sums[m * nb + b] = total;
                continue;
            }
#endif
            float amax = 0.0f;
            int bad = 0; /* a NaN or an infinity: the block's scale is NaN, so every output it feeds is */
#pragma omp simd reduction(max : amax) reduction(| : bad)
            for (int64_t k = k0; k < k1; ++k) {
                const float a = fabsf(xr[k]);
                bad |= !(a <= FLT_MAX);
                amax = a > amax ? a : amax; /* (vectorises, where fmaxf is a call a value; NaN: `bad`) */
            }
            const float scale = bad ? NAN : amax / 127.0f;
            int32_t total = 0;
            if (!bad && scale > 0.0f) {
#pragma omp simd reduction(+ : total)
                for (int64_t k = k0; k < k1; ++k) {
                    const int32_t q = (int32_t)nearbyintf(xr[k] / scale);
                    qr[k] = (int8_t)q;
                    total += q;
                }
            } else {
                for (int64_t k = k0; k < k1; ++k) qr[k] = 0;
            }
            d[m * nb + b] = scale;
            sums[m * nb + b] = total;
        }
        for (int64_t k = K; k < Kp; ++k) qr[k] = 0;
    }
}

/* W [N, K] (row stride ldw) into panels of 16 columns, STEP inputs of a column side by side:
 * [ceil(N / 16)][ceil(K / STEP)][16][STEP], each value + OFFSET, zero (+ OFFSET) past N and K. */
#define PACK_INTERLEAVED(NAME, IN, OUT, STEP, OFFSET)                                                   \
    void NAME(const IN *w, int64_t ldw, int64_t N, int64_t K, OUT *panels) {                            \
        const int64_t Kp = (K + STEP - 1) / STEP * STEP, n_panels = (N + QPANEL - 1) / QPANEL;          \
        for (int64_t p = 0; p < n_panels; ++p)                                                          \
            for (int64_t k = 0; k < Kp; ++k)                                                            \
                for (int64_t j = 0; j < QPANEL; ++j) {                                                  \
                    const int64_t n = p * QPANEL + j;                                                   \
                    const int value = n < N && k < K ? (int)w[n * ldw + k] : 0;                         \
                    panels[p * Kp * QPANEL + (k / STEP) * STEP * QPANEL + STEP * j + (k % STEP)] = (OUT)(value + OFFSET); \
                }                                                                                       \
    }

/* int8 codes into [ceil(N / 16)][ceil(K / 4)][16][4] bytes, each code + 128. */
PACK_INTERLEAVED(tl_pack_q8, int8_t, uint8_t, 4, 128)

/* int8 codes [N, K] and a scale per group of `group` inputs, scales [N, K / group] float32, into
 * panels of Q8_HEAD_BYTES(K, group) + K * 16 bytes: the panel's scales as fp16, [K / group][16]
 * (zero-padded to a cache line), then its codes as `tl_pack_q8` lays them out (each + 128). */
void tl_pack_q8g(const int8_t *codes, const float *scales, int64_t N, int64_t K, int64_t group, uint8_t *panels) {
    const int64_t G = K / group, head = Q8_HEAD_BYTES(K, group), n_panels = (N + QPANEL - 1) / QPANEL;
    tl_pack_q8(codes, K, N, K, panels + head); /* every panel's codes back to back; each moves below */
    for (int64_t p = n_panels - 1; p >= 0; --p) { /* from the end: codes move up by `head` per panel */
        uint8_t *panel = panels + p * (head + K * QPANEL);
        memmove(panel + head, panels + head + p * K * QPANEL, (size_t)(K * QPANEL));
        memset(panel, 0, (size_t)head);
        uint16_t *params = (uint16_t *)(void *)panel;
        for (int64_t g = 0; g < G; ++g)
            for (int64_t j = 0; j < QPANEL; ++j) {
                const int64_t n = p * QPANEL + j;
                params[g * QPANEL + j] = float_to_half(n < N ? scales[n * G + g] : 0.0f);
            }
    }
}

/* int4 codes [N, K / 2] (q[n, 2i] in the low nibble of byte i), scales and zeros [G, N] float32
 * into panels [ceil(N / 16)][G][group * 8 + 64] bytes (see the top of this file). */
void tl_pack_q4(const uint8_t *codes, const float *scales, const float *zeros, int64_t N, int64_t K, int64_t group,
                uint8_t *panels) {
    const int64_t G = K / group, gbytes = group * 8 + 64, n_panels = (N + QPANEL - 1) / QPANEL;
    for (int64_t p = 0; p < n_panels; ++p)
        for (int64_t g = 0; g < G; ++g) {
            uint8_t *pg = panels + (p * G + g) * gbytes;
            for (int64_t c = 0; c < group / 8; ++c)
                for (int64_t j = 0; j < QPANEL; ++j)
                    for (int64_t i = 0; i < 4; ++i) {
                        const int64_t n = p * QPANEL + j, k = g * group + 8 * c + i;
                        uint8_t lo = 0, hi = 0;
                        if (n < N) {
                            lo = (codes[n * (K / 2) + k / 2] >> (4 * (k & 1))) & 15u;
                            hi = (codes[n * (K / 2) + (k + 4) / 2] >> (4 * ((k + 4) & 1))) & 15u;
                        }
                        pg[c * 64 + 4 * j + i] = (uint8_t)(lo | (hi << 4));
                    }
            uint16_t *params = (uint16_t *)(void *)(pg + group * 8);
            for (int64_t j = 0; j < QPANEL; ++j) {
                const int64_t n = p * QPANEL + j;
                const float s = n < N ? scales[g * N + n] : 0.0f, z = n < N ? zeros[g * N + n] : 0.0f;
                params[j] = float_to_half(s);
                params[QPANEL + j] = float_to_half(z - 8.0f * s);
            }
        }
}

/* A product's panels shared among the threads: `run(job, m, rows, p)` computes rows m .. m + rows
 * - 1 of panel p. Each task takes a range of panels and every row; past one block of rows, a
 * chunk of panels at a time, kept in L2 while every block of rows passes over it. A product
 * whose panels are Q_SPLIT_BYTES or more is split among the threads at any row count (one core
 * does not draw the memory's whole bandwidth), a smaller one stays on its caller's thread: into
 * about Q_TASKS_PER_THREAD tasks a thread, or Q_TASKS_PER_THREAD_MANY at 4 and more rows, where
 * the products are compute-bound and coarse tasks left one thread waiting for the other at the
 * end (a model's int4 products at 8 rows, 2 threads: 3.9-4.4 -> 3.3-4.2 ms; int8 unchanged). */
typedef void (*panel_fn)(const void *job, int64_t m, int rows, int64_t p);

typedef struct {
    const void *job;
    panel_fn run;
    panel_fn run2; /* or NULL: 4 rows of panels p and p + 1 at once (where blocks of rows are 4 or 8) */
    int64_t M, n_panels, per_task, chunk;
    int max_rows; /* rows the row kernels keep in registers at most */
} sweep_t;

static void sweep_task(const void *sweep_, int64_t task) {
    const sweep_t *sw = sweep_;
    const int64_t first = task * sw->per_task;
    const int64_t last = first + sw->per_task < sw->n_panels ? first + sw->per_task : sw->n_panels;
    for (int64_t c0 = first; c0 < last; c0 += sw->chunk) {
        const int64_t c1 = c0 + sw->chunk < last ? c0 + sw->chunk : last;
        for (int64_t m = 0; m < sw->M;) {
            const int64_t left = sw->M - m;
            const int rows = left >= sw->max_rows ? sw->max_rows : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            int64_t p = c0;
            if (sw->run2 != NULL && rows % 4 == 0)
                for (; p + 1 < c1; p += 2)
                    for (int r0 = 0; r0 < rows; r0 += 4) sw->run2(sw->job, m + r0, 4, p);
            for (; p < c1; ++p) sw->run(sw->job, m, rows, p);
            m += rows;
        }
    }
}

static void sweep(const void *job, panel_fn run, panel_fn run2, int64_t M, int64_t N, int64_t panel_bytes,
                  int max_rows) {
    const int64_t n_panels = (N + QPANEL - 1) / QPANEL, threads = tl_threads();
    int64_t per_task = n_panels;
    if (threads > 1 && n_panels * panel_bytes >= Q_SPLIT_BYTES) {
        const int64_t tasks = threads * (M >= 4 ? Q_TASKS_PER_THREAD_MANY : Q_TASKS_PER_THREAD);
        per_task = (n_panels + tasks - 1) / tasks;
    }
    const int64_t chunk = Q_CHUNK_BYTES / panel_bytes > 1 ? Q_CHUNK_BYTES / panel_bytes : 1;
    const sweep_t sw = {job, run, run2, M, n_panels, per_task, chunk, max_rows};
    tl_run_tasks(sweep_task, &sw, (n_panels + per_task - 1) / per_task);
}

/* One product's work: the activations quantised, the panels, and the row kernels of its path. */
typedef struct q_job q_job;
typedef void (*rows_fn)(const q_job *job, int64_t m, const uint8_t *panel, int64_t n0);
struct q_job {
    const int8_t *xq;     /* [M, Kp] */
    const float *d;       /* [M, nb] */
    const int32_t *sums;  /* [M, nb] */
    const float *xs;      /* int4: [M, G] sum over the group's blocks of d * sums */
    int64_t M, K, Kp, nb, N, group, panel_bytes;
    const uint8_t *panels;
    const float *scales, *bias; /* int8: a scale per output; bias may be NULL */
    float *y;
    const rows_fn *kernels; /* for 1, 2, 4 and 8 (or the path's most) rows */
    rows_fn pair4;          /* or NULL: 4 rows of two panels at once */
};

/* Row m's outputs n0 .. n0 + cols - 1 from acc (16 floats), times the int8 scales, plus bias. */
static inline void store_row(const q_job *job, int64_t m, int64_t n0, const float *acc) {
    const int64_t cols = job->N - n0 < QPANEL ? job->N - n0 : QPANEL;
    float *y = job->y + m * job->N + n0;
    for (int64_t j = 0; j < cols; ++j) {
        float v = acc[j];
        if (job->scales != NULL) v *= job->scales[n0 + j];
        if (job->bias != NULL) v += job->bias[n0 + j];
        y[j] = v;
    }
}

/* ---- portable C: any row count, one row at a time ---- */
static void q8_portable(const q_job *job, int64_t m, int R, const uint8_t *panel, int64_t n0) {
    const int64_t group = job->group, per = group ? group / QBLOCK : job->nb, G = job->nb / per;
    const uint8_t *codes = panel + Q8_HEAD_BYTES(job->K, group);
    for (int r = 0; r < R; ++r) {
        const int8_t *x = job->xq + (m + r) * job->Kp;
        float acc[QPANEL] = {0};
        for (int64_t g = 0; g < G; ++g) {
            float t[QPANEL] = {0};
            for (int64_t b = g * per; b < (g + 1) * per; ++b) {
                const int64_t k0 = b * QBLOCK, k1 = k0 + QBLOCK < job->Kp ? k0 + QBLOCK : job->Kp;
                int32_t dot[QPANEL] = {0};
                for (int64_t k = k0; k < k1; ++k)
                    for (int j = 0; j < QPANEL; ++j) dot[j] += ((int32_t)codes[(k / 4) * 64 + 4 * j + (k % 4)] - 128) * x[k];
                const float scale = job->d[(m + r) * job->nb + b];
                for (int j = 0; j < QPANEL; ++j) t[j] = fmaf((float)dot[j], scale, t[j]);
            }
            const uint16_t *params = (const uint16_t *)(const void *)panel + g * QPANEL;
            for (int j = 0; j < QPANEL; ++j) acc[j] = group ? fmaf(t[j], half_to_float(params[j]), acc[j]) : acc[j] + t[j];
        }
        store_row(job, m + r, n0, acc);
    }
}

static void q4_portable(const q_job *job, int64_t m, int R, const uint8_t *panel, int64_t n0) {
    const int64_t group = job->group, G = job->K / group, gbytes = group * 8 + 64, per = group / QBLOCK;
    for (int r = 0; r < R; ++r) {
        const int8_t *x = job->xq + (m + r) * job->Kp;
        float acc[QPANEL] = {0};
        for (int64_t g = 0; g < G; ++g) {
            const uint8_t *pg = panel + g * gbytes;
            float t[QPANEL] = {0};
            for (int64_t bb = 0; bb < per; ++bb) {
                const int64_t b = g * per + bb;
                int32_t dot[QPANEL] = {0};
                for (int64_t c = 0; c < QBLOCK / 8; ++c) {
                    const uint8_t *chunk = pg + (bb * (QBLOCK / 8) + c) * 64;
                    const int8_t *xk = x + b * QBLOCK + 8 * c;
                    for (int j = 0; j < QPANEL; ++j)
                        for (int i = 0; i < 4; ++i)
                            dot[j] += (chunk[4 * j + i] & 15) * xk[i] + (chunk[4 * j + i] >> 4) * xk[4 + i];
                }
                const float scale = job->d[(m + r) * job->nb + b];
                for (int j = 0; j < QPANEL; ++j) t[j] = fmaf((float)dot[j], scale, t[j]);
            }
            const uint16_t *params = (const uint16_t *)(const void *)(pg + group * 8);
            const float xs = job->xs[(m + r) * G + g];
            for (int j = 0; j < QPANEL; ++j) {
                acc[j] = fmaf(t[j], half_to_float(params[j]), acc[j]);
                acc[j] = fmaf(half_to_float(params[QPANEL + j]), xs, acc[j]);
            }
        }
        store_row(job, m + r, n0, acc);
    }
}

/* ---- AVX2: 8 columns a 256-bit register, the panel's two halves side by side ---- */
#if Q_BEST >= 1
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* int8: |x| (unsigned) times the weights with x's signs (`vpsignb`): each pair sum within
 * 2 * 127 * 127, no saturation. */
ALWAYS_INLINE void q8_avx2(const q_job *job, int64_t m, int R, const uint8_t *panel, int64_t n0) {
    __m256 acc[4][2];
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    const int64_t group = job->group, per = group ? group / QBLOCK : job->nb, G = job->nb / per;
    const uint8_t *pg = panel + Q8_HEAD_BYTES(job->K, group); /* + k * QPANEL: input k's codes */
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) { /* (one group of every block: a scale per output) */
        const uint8_t *params = panel + g * 2 * QPANEL;
        __m256 s[2];
        for (int h = 0; h < 2; ++h)
            s[h] = group ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(params + 16 * h)))
                         : _mm256_set1_ps(1.0f);
        for (int64_t b = g * per; b < (g + 1) * per; ++b) {
            const int64_t k0 = b * QBLOCK, k1 = k0 + QBLOCK < job->Kp ? k0 + QBLOCK : job->Kp;
            __m256i dot[4][2];
            for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
            for (int64_t k = k0; k < k1; k += 4) {
                const uint8_t *w = pg + k * QPANEL;
                __builtin_prefetch(w + Q_AHEAD, 0, 2);
                const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(const void *)w), flip);
                const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(const void *)(w + 32)), flip);
                for (int r = 0; r < R; ++r) {
                    const __m256i xb = _mm256_set1_epi32(load_i32(job->xq + (m + r) * job->Kp + k));
                    const __m256i ax = _mm256_abs_epi8(xb);
                    const __m256i p0 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb));
                    const __m256i p1 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb));
                    dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(p0, ones));
                    dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(p1, ones));
                }
            }
            for (int r = 0; r < R; ++r) {
                const __m256 scale = _mm256_set1_ps(job->d[(m + r) * job->nb + b]); /* times the group's scales */
                for (int h = 0; h < 2; ++h)
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), group ? _mm256_mul_ps(scale, s[h]) : scale,
                                                acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        float out[QPANEL];
        _mm256_storeu_ps(out, acc[r][0]);
        _mm256_storeu_ps(out + 8, acc[r][1]);
        store_row(job, m + r, n0, out);
    }
}

/* int4: the codes (0..15) are the unsigned operand: pair sums within 2 * 15 * 127. */
ALWAYS_INLINE void q4_avx2(const q_job *job, int64_t m, int R, const uint8_t *panel, int64_t n0) {
    const int64_t group = job->group, G = job->K / group, gbytes = group * 8 + 64, per = group / QBLOCK;
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc[4][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        const uint8_t *pg = panel + g * gbytes;
        __m256 t[4][2];
        for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm256_setzero_ps();
        for (int64_t bb = 0; bb < per; ++bb) {
            const int64_t b = g * per + bb;
            __m256i dot[4][2];
            for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
            for (int64_t c = 0; c < QBLOCK / 8; ++c) {
                const uint8_t *chunk = pg + (bb * (QBLOCK / 8) + c) * 64;
                __builtin_prefetch(chunk + Q_AHEAD, 0, 2);
                for (int h = 0; h < 2; ++h) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(chunk + 32 * h));
                    const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    for (int r = 0; r < R; ++r) {
                        const int8_t *xk = job->xq + (m + r) * job->Kp + b * QBLOCK + 8 * c;
                        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xk))),
                                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xk + 4))));
                        dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(p, ones));
                    }
                }
            }
            for (int r = 0; r < R; ++r) {
                const __m256 scale = _mm256_set1_ps(job->d[(m + r) * job->nb + b]);
                for (int h = 0; h < 2; ++h) t[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), scale, t[r][h]);
            }
        }
        const uint16_t *params = (const uint16_t *)(const void *)(pg + group * 8);
        for (int h = 0; h < 2; ++h) {
            const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(params + 8 * h)));
            const __m256 sh = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(params + QPANEL + 8 * h)));
            for (int r = 0; r < R; ++r) {
                acc[r][h] = _mm256_fmadd_ps(t[r][h], s, acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(sh, _mm256_set1_ps(job->xs[(m + r) * G + g]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        float out[QPANEL];
        _mm256_storeu_ps(out, acc[r][0]);
        _mm256_storeu_ps(out + 8, acc[r][1]);
        store_row(job, m + r, n0, out);
    }
}
#endif

/* ---- AVX-512 VNNI: a panel's 16 columns in one register ---- */
#if Q_BEST >= 2
ALWAYS_INLINE void store_acc512(const q_job *job, int64_t m, int64_t n0, __m512 acc) {
    const int64_t cols = job->N - n0 < QPANEL ? job->N - n0 : QPANEL;
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    if (job->scales != NULL) acc = _mm512_mul_ps(acc, _mm512_maskz_loadu_ps(mask, job->scales + n0));
    if (job->bias != NULL) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, job->bias + n0));
    _mm512_mask_storeu_ps(job->y + m * job->N + n0, mask, acc);
}

/* int8: two chains of dot products per row (even and odd groups of four inputs), so one or two
 * rows do not wait on `vpdpbusd`'s latency. */
ALWAYS_INLINE void q8_vnni(const q_job *job, int64_t m, int R, const uint8_t *panel, int64_t n0) {
    __m512 acc[QMAX_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t Kp = job->Kp, nb = job->nb, group = job->group, per = group ? group / QBLOCK : nb, G = nb / per;
    const uint8_t *pg = panel + Q8_HEAD_BYTES(job->K, group); /* + k * QPANEL: input k's codes */
    for (int64_t g = 0; g < G; ++g) { /* (one group of every block: a scale per output) */
        const __m512 s = group ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(panel + g * 2 * QPANEL)))
                               : _mm512_set1_ps(1.0f);
        for (int64_t b = g * per; b < (g + 1) * per; ++b) {
            const int64_t k0 = b * QBLOCK, k1 = k0 + QBLOCK < Kp ? k0 + QBLOCK : Kp;
            __m512i dot[QMAX_ROWS], dot2[QMAX_ROWS]; /* dot2: a second chain for one or two rows only */
            for (int r = 0; r < R; ++r) dot[r] = dot2[r] = _mm512_setzero_si512();
            int64_t k = k0;
            for (; k + 8 <= k1; k += 8) {
                const uint8_t *w = pg + k * QPANEL;
                __builtin_prefetch(w + Q_AHEAD, 0, 2);
                __builtin_prefetch(w + Q_AHEAD + 64, 0, 2);
                const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
                for (int r = 0; r < R; ++r) {
                    const int8_t *x = job->xq + (m + r) * Kp + k;
                    dot[r] = _mm512_dpbusd_epi32(dot[r], w0, _mm512_set1_epi32(load_i32(x)));
                    if (R <= 2) dot2[r] = _mm512_dpbusd_epi32(dot2[r], w1, _mm512_set1_epi32(load_i32(x + 4)));
                    else dot[r] = _mm512_dpbusd_epi32(dot[r], w1, _mm512_set1_epi32(load_i32(x + 4)));
                }
            }
            if (k < k1) { /* a last block of 4 inputs more than a multiple of 8 */
                const __m512i w0 = _mm512_loadu_si512(pg + k * QPANEL);
                for (int r = 0; r < R; ++r)
                    dot[r] = _mm512_dpbusd_epi32(dot[r], w0, _mm512_set1_epi32(load_i32(job->xq + (m + r) * Kp + k)));
            }
            for (int r = 0; r < R; ++r) {
                const __m512i exact = _mm512_sub_epi32(_mm512_add_epi32(dot[r], dot2[r]),
                                                       _mm512_set1_epi32(128 * job->sums[(m + r) * nb + b]));
                const __m512 d = _mm512_set1_ps(job->d[(m + r) * nb + b]); /* times the group's scales */
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), group ? _mm512_mul_ps(d, s) : d, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) store_acc512(job, m + r, n0, acc[r]);
}

ALWAYS_INLINE void q4_vnni_p(const q_job *job, int64_t m, int R, int P, const uint8_t *panel, int64_t n0) {
    const int64_t group = job->group, G = job->K / group, gbytes = group * 8 + 64, per = group / QBLOCK;
    const int64_t Kp = job->Kp, nb = job->nb, pb = job->panel_bytes;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[QMAX_ROWS][2];
    for (int r = 0; r < R; ++r)
        for (int q = 0; q < P; ++q) acc[r][q] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        __m512 t[QMAX_ROWS][2];
        for (int r = 0; r < R; ++r)
            for (int q = 0; q < P; ++q) t[r][q] = _mm512_setzero_ps();
        for (int64_t bb = 0; bb < per; ++bb) {
            const int64_t b = g * per + bb;
            __m512i lo_dot[QMAX_ROWS][2], hi_dot[QMAX_ROWS]; /* hi_dot: a second chain for one or two rows only */
            for (int r = 0; r < R; ++r) {
                hi_dot[r] = _mm512_setzero_si512();
                for (int q = 0; q < P; ++q) lo_dot[r][q] = _mm512_setzero_si512();
            }
            for (int64_t c = 0; c < QBLOCK / 8; ++c) {
                __m512i lo[2], hi[2];
                for (int q = 0; q < P; ++q) {
                    const uint8_t *chunk = panel + q * pb + g * gbytes + (bb * (QBLOCK / 8) + c) * 64;
                    __builtin_prefetch(chunk + Q_AHEAD, 0, 2);
                    const __m512i v = _mm512_loadu_si512(chunk);
                    lo[q] = _mm512_and_si512(v, low);
                    hi[q] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
                for (int r = 0; r < R; ++r) {
                    const int8_t *xk = job->xq + (m + r) * Kp + b * QBLOCK + 8 * c;
                    const __m512i x0 = _mm512_set1_epi32(load_i32(xk)), x1 = _mm512_set1_epi32(load_i32(xk + 4));
                    for (int q = 0; q < P; ++q) {
                        lo_dot[r][q] = _mm512_dpbusd_epi32(lo_dot[r][q], lo[q], x0);
                        if (R <= 2 && P == 1) hi_dot[r] = _mm512_dpbusd_epi32(hi_dot[r], hi[q], x1);
                        else lo_dot[r][q] = _mm512_dpbusd_epi32(lo_dot[r][q], hi[q], x1);
                    }
                }
            }
            for (int r = 0; r < R; ++r) {
                const __m512 d = _mm512_set1_ps(job->d[(m + r) * nb + b]);
                for (int q = 0; q < P; ++q)
                    t[r][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo_dot[r][q], hi_dot[r])), d, t[r][q]);
            }
        }
        for (int q = 0; q < P; ++q) {
            const uint8_t *pg = panel + q * pb + g * gbytes;
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(pg + group * 8)));
            const __m512 sh = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(pg + group * 8 + 32)));
            for (int r = 0; r < R; ++r) {
                acc[r][q] = _mm512_fmadd_ps(t[r][q], s, acc[r][q]);
                acc[r][q] = _mm512_fmadd_ps(sh, _mm512_set1_ps(job->xs[(m + r) * G + g]), acc[r][q]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int q = 0; q < P; ++q) store_acc512(job, m + r, n0 + q * QPANEL, acc[r][q]);
}

ALWAYS_INLINE void q4_vnni(const q_job *job, int64_t m, int R, const uint8_t *panel, int64_t n0) {
    q4_vnni_p(job, m, R, 1, panel, n0);
}
ALWAYS_INLINE void q4_vnni_pair(const q_job *job, int64_t m, int R, const uint8_t *panel, int64_t n0) {
    q4_vnni_p(job, m, R, 2, panel, n0);
}
#endif

/* Each path's row kernels for 1, 2, 4 and 8 rows (the row count a compile-time constant). */
#define ROW_KERNELS(FN, MAXR)                                                                          \
    static void FN##_r1(const q_job *j, int64_t m, const uint8_t *p, int64_t n0) { FN(j, m, 1, p, n0); } \
    static void FN##_r2(const q_job *j, int64_t m, const uint8_t *p, int64_t n0) { FN(j, m, 2, p, n0); } \
    static void FN##_r4(const q_job *j, int64_t m, const uint8_t *p, int64_t n0) { FN(j, m, 4, p, n0); } \
    static void FN##_r8(const q_job *j, int64_t m, const uint8_t *p, int64_t n0) { FN(j, m, MAXR, p, n0); } \
    static const rows_fn FN##_rows[4] = {FN##_r1, FN##_r2, FN##_r4, FN##_r8};
ROW_KERNELS(q8_portable, 8)
ROW_KERNELS(q4_portable, 8)
#if Q_BEST >= 1
ROW_KERNELS(q8_avx2, 4) /* 4 rows at most: AVX2 has 16 registers (the r8 slot is never chosen) */
ROW_KERNELS(q4_avx2, 4)
#endif
#if Q_BEST >= 2
ROW_KERNELS(q8_vnni, 8)
ROW_KERNELS(q4_vnni, 8)
static void q4_vnni_pair4(const q_job *j, int64_t m, const uint8_t *p, int64_t n0) { q4_vnni_pair(j, m, 4, p, n0); }
#endif

static const rows_fn *row_kernels(int isa, int bits, int *max_rows, rows_fn *pair4) {
    *max_rows = QMAX_ROWS;
    *pair4 = NULL;
#if Q_BEST >= 2
    if (isa >= 2) {
        /* int4: two panels share each nibble unpack's row broadcasts (measured 1.3-1.7x at 4 and 8
         * rows, in cache); int8 measured no faster paired (its 8-row kernel keeps every row) */
        *pair4 = bits == 4 ? q4_vnni_pair4 : NULL;
        return bits == 8 ? q8_vnni_rows : q4_vnni_rows;
    }
#endif
#if Q_BEST >= 1
    if (isa >= 1) {
        *max_rows = 4;
        return bits == 8 ? q8_avx2_rows : q4_avx2_rows;
    }
#endif
    (void)isa;
    return bits == 8 ? q8_portable_rows : q4_portable_rows;
}

/* Rows m .. m + rows - 1 of panel p, on the path's row kernel for that many rows. */
static void q_panel(const void *job_, int64_t m, int rows, int64_t p) {
    const q_job *job = job_;
    job->kernels[rows >= 8 ? 3 : rows >= 4 ? 2 : rows - 1](job, m, job->panels + p * job->panel_bytes, p * QPANEL);
}

/* Rows m .. m + 3 of panels p and p + 1. */
static void q_pair(const void *job_, int64_t m, int rows, int64_t p) {
    const q_job *job = job_;
    (void)rows;
    job->pair4(job, m, job->panels + p * job->panel_bytes, p * QPANEL);
}

/* x's residual after its quantisation, x - d * xq per block (`tl_quantize_act`'s rows): the second
 * term of two-term activations (NaN where the block's scale is). */
static void act_residual(const float *x, int64_t M, int64_t K, int64_t Kp, const int8_t *xq, const float *d,
                         float *r) {
    const int64_t nb = (Kp + QBLOCK - 1) / QBLOCK;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t k0 = b * QBLOCK, k1 = k0 + QBLOCK < K ? k0 + QBLOCK : K;
            const float scale = d[m * nb + b];
#pragma omp simd
            for (int64_t k = k0; k < k1; ++k) r[m * K + k] = x[m * K + k] - scale * (float)xq[m * Kp + k];
        }
}

/* The product: quantise x, then the panels shared among the threads. With `terms` 2 each row of
 * x is quantised twice, x ~ d1 xq1 + d2 xq2 (xq2 the residual's codes, about 2^-8 of the first
 * term's step): the kernels take the 2M rows in one pass over the panels and each output is the
 * sum of its two rows' (the bias added once), so the activations' rounding error shrinks ~250x
 * for the cost of a second row of dot products (a memory-bound product: a few per cent).
 * Returns 0, or -1 where the scratch memory could not be allocated. */
static int q_matmul(const float *x, int64_t M, int64_t K, const uint8_t *panels, int64_t N, int64_t group,
                    const float *scales, const float *bias, float *y, int bits, int64_t terms) {
    const int64_t R = terms == 2 ? 2 * M : M; /* the rows the kernels see */
    const int64_t Kp = (K + 3) / 4 * 4, nb = (Kp + QBLOCK - 1) / QBLOCK, G = bits == 4 ? K / group : 0;
    const int64_t panel_bytes = bits == 8 ? Q8_HEAD_BYTES(K, group) + Kp * QPANEL : G * (group * 8 + 64);
    const size_t scratch = (size_t)(R * Kp) + (size_t)(R * nb) * (sizeof(float) + sizeof(int32_t))
                           + (size_t)(R * G) * sizeof(float) + 64
                           + (terms == 2 ? (size_t)(M * K + R * N) * sizeof(float) : 0);
    char *memory = malloc(scratch);
    if (memory == NULL) return -1;
    float *d = (float *)(void *)memory;
    int32_t *sums = (int32_t *)(void *)(d + R * nb);
    float *xs = (float *)(void *)(sums + R * nb);
    float *residual = xs + R * G, *y2 = residual + (terms == 2 ? M * K : 0); /* terms 2 only */
    int8_t *xq = (int8_t *)(void *)(y2 + (terms == 2 ? R * N : 0));
    tl_quantize_act(x, M, K, Kp, xq, d, sums);
    if (terms == 2) { /* rows M .. 2M - 1: the residuals' codes */
        act_residual(x, M, K, Kp, xq, d, residual);
        tl_quantize_act(residual, M, K, Kp, xq + M * Kp, d + M * nb, sums + M * nb);
    }
    for (int64_t m = 0; m < R; ++m) /* int4: each group's sum of the dequantised activations */
        for (int64_t g = 0; g < G; ++g) {
            float total = 0.0f;
            for (int64_t b = g * (group / QBLOCK); b < (g + 1) * (group / QBLOCK); ++b)
                total = fmaf(d[m * nb + b], (float)sums[m * nb + b], total);
            xs[m * G + g] = total;
        }
    int max_rows;
    rows_fn pair4;
    const rows_fn *kernels = row_kernels(tl_quant_isa(), bits, &max_rows, &pair4);
    const q_job job = {xq, d, sums, xs, R, K, Kp, nb, N, group, panel_bytes, panels, scales,
                       terms == 2 ? NULL : bias, terms == 2 ? y2 : y, kernels, pair4};
    sweep(&job, q_panel, pair4 != NULL ? q_pair : NULL, R, N, panel_bytes, max_rows);
    if (terms == 2)
        for (int64_t m = 0; m < M; ++m) {
            const float *a = y2 + m * N, *b = y2 + (M + m) * N;
            float *out = y + m * N;
#pragma omp simd
            for (int64_t n = 0; n < N; ++n) out[n] = a[n] + b[n] + (bias != NULL ? bias[n] : 0.0f);
        }
    free(memory);
    return 0;
}

/* y [M, N] = x [M, K] W^T (+ bias) for int8 W as `tl_pack_q8` laid it out, scales [N] (group 0), or
 * as `tl_pack_q8g` laid it out with its scales per `group` inputs (scales unused); x in `terms` (1
 * or 2) int8 terms (`q_matmul`). */
int tl_matmul_q8(const float *x, int64_t M, int64_t K, const uint8_t *panels, int64_t N, const float *scales,
                 int64_t group, const float *bias, float *y, int64_t terms) {
    return q_matmul(x, M, K, panels, N, group, group ? NULL : scales, bias, y, 8, terms);
}

/* y [M, N] = x [M, K] W^T (+ bias) for int4 W as `tl_pack_q4` laid it out (group a multiple of 32);
 * x in `terms` (1 or 2) int8 terms. */
int tl_matmul_q4(const float *x, int64_t M, int64_t K, const uint8_t *panels, int64_t N, int64_t group,
                 const float *bias, float *y, int64_t terms) {
    return q_matmul(x, M, K, panels, N, group, NULL, bias, y, 4, terms);
}

/* ---- bf16 weights: y = bf16(x) W^T (+ bias), W [N, K] bfloat16 ----
 *
 * Published looped checkpoints ship in bfloat16; stored so, a weight is half of float32's bytes.
 * The panels hold, per 2 inputs k, k+1, 64 bytes: column j's two bf16 values at 4j..4j+3 (K padded
 * to even with zeros), one AVX-512 BF16 `vdpbf16ps` operand: 16 columns x 2 inputs a instruction.
 * x is rounded to bfloat16 (to nearest even, as torch's `.to(torch.bfloat16)`), each product is
 * exact in float32 and each lane adds the odd input's product, then the even one's, to a float32
 * sum, as the instruction does (the portable path in the same order, float32 throughout). */
static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } bits = {f};
    if ((bits.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits.u >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((bits.u + 0x7fffu + ((bits.u >> 16) & 1u)) >> 16);
}

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } bits = {(uint32_t)h << 16};
    return bits.f;
}

/* bf16 W [N, K] (uint16 bits) into panels [ceil(N / 16)][ceil(K / 2)][16][2]. */
PACK_INTERLEAVED(tl_pack_bf16, uint16_t, uint16_t, 2, 0)

typedef struct {
    const uint32_t *xb; /* [M, Kp / 2]: x rounded to bf16, two inputs a word */
    int64_t M, Kp, N;
    const uint16_t *panels;
    const float *bias;
    float *y;
    int native; /* on AVX-512 BF16 (the best path chosen, and built in) */
} bf16_job;

static void bf16_store(const bf16_job *job, int64_t m, int64_t n0, const float *acc) {
    const int64_t cols = job->N - n0 < QPANEL ? job->N - n0 : QPANEL;
    for (int64_t j = 0; j < cols; ++j) job->y[m * job->N + n0 + j] = acc[j] + (job->bias != NULL ? job->bias[n0 + j] : 0.0f);
}

static void bf16_portable(const bf16_job *job, int64_t m, int R, const uint16_t *panel, int64_t n0) {
    for (int r = 0; r < R; ++r) {
        const uint32_t *x = job->xb + (m + r) * (job->Kp / 2);
        float acc[QPANEL] = {0};
        for (int64_t p = 0; p < job->Kp / 2; ++p) {
            const float x0 = bf16_to_float((uint16_t)(x[p] & 0xffffu)), x1 = bf16_to_float((uint16_t)(x[p] >> 16));
            const uint16_t *w = panel + p * 32;
            for (int j = 0; j < QPANEL; ++j) {
                acc[j] += bf16_to_float(w[2 * j + 1]) * x1;
                acc[j] += bf16_to_float(w[2 * j]) * x0;
            }
        }
        bf16_store(job, m + r, n0, acc);
    }
}

#if defined(__AVX512BF16__) && Q_BEST >= 2
#define BF16_NATIVE 1
/* Four chains of sums per row for one or two rows (the instruction's latency), one from four. */
ALWAYS_INLINE void bf16_native(const bf16_job *job, int64_t m, int R, const uint16_t *panel, int64_t n0) {
    __m512 acc[4][QMAX_ROWS];
    const int S = R <= 2 ? 4 : 1;
    for (int s = 0; s < S; ++s)
        for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_ps();
    const int64_t pairs = job->Kp / 2;
    int64_t p = 0;
    for (; p + S <= pairs; p += S)
        for (int s = 0; s < S; ++s) {
            const uint16_t *w = panel + (p + s) * 32;
            __builtin_prefetch((const char *)w + Q_AHEAD, 0, 2);
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w);
            for (int r = 0; r < R; ++r) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)job->xb[(m + r) * pairs + p + s]);
                acc[s][r] = _mm512_dpbf16_ps(acc[s][r], wv, xv);
            }
        }
    for (; p < pairs; ++p) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(panel + p * 32);
        for (int r = 0; r < R; ++r)
            acc[0][r] = _mm512_dpbf16_ps(acc[0][r], wv, (__m512bh)_mm512_set1_epi32((int)job->xb[(m + r) * pairs + p]));
    }
    for (int r = 0; r < R; ++r) {
        for (int s = 1; s < S; ++s) acc[0][r] = _mm512_add_ps(acc[0][r], acc[s][r]);
        float out[QPANEL];
        _mm512_storeu_ps(out, acc[0][r]);
        bf16_store(job, m + r, n0, out);
    }
}
static void bf16_native_r1(const bf16_job *j, int64_t m, const uint16_t *p, int64_t n0) { bf16_native(j, m, 1, p, n0); }
static void bf16_native_r2(const bf16_job *j, int64_t m, const uint16_t *p, int64_t n0) { bf16_native(j, m, 2, p, n0); }
static void bf16_native_r4(const bf16_job *j, int64_t m, const uint16_t *p, int64_t n0) { bf16_native(j, m, 4, p, n0); }
static void bf16_native_r8(const bf16_job *j, int64_t m, const uint16_t *p, int64_t n0) { bf16_native(j, m, 8, p, n0); }
#else
#define BF16_NATIVE 0
#endif

/* Whether this build multiplies bf16 weights with AVX-512 BF16 (else the portable path). */
int tl_bf16_native(void) { return BF16_NATIVE; }

/* ---- bf16 on AMX: tiles of 16 x 16 sums, 32 inputs a tile product (`tdpbf16ps`) ----
 *
 * A prefill's bf16 products (16 rows and more) on an Intel CPU with AMX: the panels are already
 * AMX's B operand (a panel's 16 pair rows of 64 bytes for 32 inputs: one 1 kB tile, contiguous),
 * the rounded activations its A operand (16 rows of 32 bf16, the rows' stride apart). Each task
 * takes pairs of panels; for every 32 rows it keeps four 16 x 16 float32 tiles of sums (2 row
 * blocks x 2 panels) over all K, two A and two B tiles loaded a step. Sums in float32 as
 * `vdpbf16ps` adds them (denormal inputs and sums flushed to zero, as AMX does); K a multiple
 * of 32, else the AVX-512 path. Linux gives a process AMX's tile state only once asked
 * (`arch_prctl(ARCH_REQ_XCOMP_PERM)`): asked once, the AVX-512 path where refused.
 * torch's own bf16 products run on AMX at about 1 TFLOP/s a core here, against 0.2-0.3 for
 * `vdpbf16ps`. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__) && BF16_NATIVE
#define BF16_AMX 1
#define AMX_MIN_ROWS 16
static _Atomic int amx_state; /* 0 not asked yet, 1 granted, -1 refused */
static _Atomic int amx_wanted = 1;

static int amx_ready(void) {
    int state = atomic_load(&amx_state);
    if (state == 0) {
        state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
        atomic_store(&amx_state, state);
    }
    return state > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

typedef struct {
    const uint16_t *xb; /* [Mp, Kp]: rounded activations, Mp a multiple of 32 (zero rows past M) */
    int64_t M, Mp, K, N;
    const uint16_t *panels;
    const float *bias;
    float *y;
} amx_job;

/* The 16 x 16 sums of tile `acc` (rows m.., panel p's columns) into y, with the bias. */
static void amx_store(const amx_job *j, const float *acc, int64_t m, int64_t p) {
    const int64_t n0 = p * QPANEL, cols = j->N - n0 < QPANEL ? j->N - n0 : QPANEL;
    for (int64_t r = 0; r < 16 && m + r < j->M; ++r)
        for (int64_t c = 0; c < cols; ++c) j->y[(m + r) * j->N + n0 + c] = acc[r * 16 + c] + (j->bias != NULL ? j->bias[n0 + c] : 0.0f);
}

static void amx_task(const void *job_, int64_t task) {
    const amx_job *j = job_;
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    const int64_t p = 2 * task, n_panels = (j->N + QPANEL - 1) / QPANEL, stride = j->K * 2;
    const int two = p + 1 < n_panels;
    const uint16_t *b0 = j->panels + p * j->K * QPANEL, *b1 = b0 + j->K * QPANEL;
    float acc[16 * 16];
    for (int64_t m = 0; m < j->Mp; m += 32) {
        const uint16_t *a0 = j->xb + m * j->K, *a1 = a0 + 16 * j->K;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < j->K; k += 32) {
            _tile_loadd(4, a0 + k, stride);
            _tile_loadd(5, a1 + k, stride);
            _tile_loadd(6, b0 + k * QPANEL, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            if (two) {
                _tile_loadd(7, b1 + k * QPANEL, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, acc, 64);
        amx_store(j, acc, m, p);
        _tile_stored(1, acc, 64);
        amx_store(j, acc, m + 16, p);
        if (two) {
            _tile_stored(2, acc, 64);
            amx_store(j, acc, m, p + 1);
            _tile_stored(3, acc, 64);
            amx_store(j, acc, m + 16, p + 1);
        }
    }
    _tile_release();
}
#else
#define BF16_AMX 0
#endif

/* Whether bf16 products of 16 rows and more run on AMX here (built in, wanted, and Linux
 * granted the tile state). */
int tl_bf16_amx(void) {
#if BF16_AMX
    return atomic_load(&amx_wanted) && tl_quant_isa() >= 2 && amx_ready();
#else
    return 0;
#endif
}

/* Use AMX for bf16 products where it is there (1, the default) or not (0: the AVX-512 path).
 * Returns tl_bf16_amx(). */
int tl_set_bf16_amx(int on) {
#if BF16_AMX
    atomic_store(&amx_wanted, on != 0);
#endif
    (void)on;
    return tl_bf16_amx();
}

/* x [M, K] float32 rounded to bf16 into rows of `ld` values (zero past K). */
static void round_rows_bf16(const float *x, int64_t M, int64_t K, uint16_t *out, int64_t ld) {
    for (int64_t m = 0; m < M; ++m) {
        const float *row = x + m * K;
        uint16_t *dst = out + m * ld;
        int64_t k = 0;
#if BF16_NATIVE
        for (; k + 32 <= K; k += 32) /* (round to nearest even, NaN kept quiet: float_to_bf16's) */
            _mm512_storeu_si512(dst + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + k + 16),
                                                                     _mm512_loadu_ps(row + k)));
#endif
        for (; k < K; ++k) dst[k] = float_to_bf16(row[k]);
        for (; k < ld; ++k) dst[k] = 0;
    }
}

/* Rows m .. m + rows - 1 of panel p. */
static void bf16_panel(const void *job_, int64_t m, int rows, int64_t p) {
    const bf16_job *job = job_;
    const uint16_t *panel = job->panels + p * job->Kp * QPANEL;
#if BF16_NATIVE
    if (job->native) {
        switch (rows) {
        case 8: bf16_native_r8(job, m, panel, p * QPANEL); return;
        case 4: bf16_native_r4(job, m, panel, p * QPANEL); return;
        case 2: bf16_native_r2(job, m, panel, p * QPANEL); return;
        default: bf16_native_r1(job, m, panel, p * QPANEL); return;
        }
    }
#endif
    bf16_portable(job, m, rows, panel, p * QPANEL);
}

/* y [M, N] = bf16(x) [M, K] W^T (+ bias) for W as `tl_pack_bf16` laid it out. Returns 0, or -1
 * where the scratch memory could not be allocated. */
int tl_matmul_bf16(const float *x, int64_t M, int64_t K, const uint16_t *panels, int64_t N, const float *bias,
                   float *y) {
#if BF16_AMX
    if (M >= AMX_MIN_ROWS && K % 32 == 0 && tl_bf16_amx()) {
        const int64_t Mp = (M + 31) / 32 * 32;
        uint16_t *xb = aligned_alloc(64, (size_t)(Mp * K) * sizeof(uint16_t));
        if (xb == NULL) return -1;
        round_rows_bf16(x, M, K, xb, K);
        memset(xb + M * K, 0, (size_t)((Mp - M) * K) * sizeof(uint16_t));
        const int64_t n_pairs = ((N + QPANEL - 1) / QPANEL + 1) / 2;
        const amx_job job = {xb, M, Mp, K, N, panels, bias, y};
        tl_run_tasks(amx_task, &job, n_pairs);
        free(xb);
        return 0;
    }
#endif
    const int64_t Kp = (K + 1) / 2 * 2;
    uint32_t *xb = malloc((size_t)(M * Kp / 2) * sizeof(uint32_t) + 4);
    if (xb == NULL) return -1;
    round_rows_bf16(x, M, K, (uint16_t *)xb, Kp);
    const bf16_job job = {xb, M, Kp, N, panels, bias, y, BF16_NATIVE && tl_quant_isa() >= 2};
    sweep(&job, bf16_panel, NULL, M, N, Kp * QPANEL * 2, QMAX_ROWS);
    free(xb);
    return 0;
}
