/* The CPU's C kernels: decode attention over the paged KV pool read in place, 4-bit KV writes,
 * RMSNorm, and the float32 matrix products of a few rows (decode, a speculative verify).
 *
 * Decode attention: each row's new query tokens attend to the keys its row's pool rows name,
 * with no gathered copy of K and V.
 *
 *   q      [R, HQ, T, D] float32, each row's T new tokens' queries (RoPE applied): one token
 *                        in decode, a few in a speculative chain's verify; row r's at q + r * ldq
 *                        (a slice of a batch's fused projections: no copy)
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
 * the sums differs from it. The rows are shared among the kernel threads (`tl_run_tasks`): each
 * row's result is the same whichever thread computes it.
 *
 * Also here: a prefill's first chunk's causal attention (`tl_causal_attention`, at the end), RoPE,
 * RMSNorm, SwiGLU and the residual joins, and the float32 panel products.
 */
#define _GNU_SOURCE /* pthreads, sched_yield and clock_gettime under -std=c11 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "kernels.h"

/* Helper threads. A kernel splits its work into tasks (column groups of a product, rows of an
 * attention) and runs them with `tl_run_tasks`: the calling thread publishes the job, then claims
 * tasks itself, one at a time, while the helpers claim them too, until none is left. Nothing
 * waits for a helper that is late (busy elsewhere, or asleep): the caller does what the helpers
 * do not, and waits only for the tasks a helper has already begun. So on a machine whose other
 * cores are busy (the server's event loop) a kernel is never slower than alone by more than the
 * publishing, and where a core is free it takes part. A helper spins for the next job for
 * HELPER_SPIN_NS (a decode step's products come a few tens of microseconds apart), yielding its
 * core to any other runnable thread, then sleeps until woken. One job at a time: a second
 * caller (another engine's thread) runs its tasks alone. A forked child starts with no helpers
 * (`pool_after_fork`). */
#define MAX_HELPERS 63
#define HELPER_SPIN_NS 200000
#define TICKET_CLOSED 0xffffffffu /* a ticket's task index past any job's tasks */

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int started;                /* helper threads made (only grows; under `lock`) */
    _Atomic int wanted;         /* of them, how many take part (tl_set_threads - 1) */
    _Atomic int sleeping;       /* helpers waiting on `wake` */
    atomic_flag busy;           /* a job is running */
    _Atomic uint64_t ticket;    /* the job's generation << 32 | its next unclaimed task */
    _Atomic int64_t done;       /* tasks of the current job finished */
    _Atomic(task_fn) fn;        /* the current job, written before its ticket is published */
    _Atomic(const void *) job;
    _Atomic int64_t n_tasks;
    _Atomic int64_t shared_tasks, helped_tasks; /* tasks of jobs published to the helpers; of them, run by one */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, ATOMIC_FLAG_INIT, 0, 0, NULL, NULL, 0, 0, 0};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claim and run tasks of generation `gen` until none is left (or a newer job replaced it). A
 * task is claimed by moving the ticket from (gen, i) to (gen, i + 1); while a claimed task runs
 * its job cannot end, so the job's fields read after the claim are that job's. */
static void work_on(uint64_t gen, int is_helper) {
    for (;;) {
        uint64_t t = atomic_load(&pool.ticket);
        const int64_t n = atomic_load_explicit(&pool.n_tasks, memory_order_relaxed);
        if ((t >> 32) != gen || (int64_t)(t & 0xffffffffu) >= n) return;
        if (!atomic_compare_exchange_weak(&pool.ticket, &t, t + 1)) continue;
        atomic_load_explicit(&pool.fn, memory_order_relaxed)(atomic_load_explicit(&pool.job, memory_order_relaxed),
                                                             (int64_t)(t & 0xffffffffu));
        if (is_helper) atomic_fetch_add_explicit(&pool.helped_tasks, 1, memory_order_relaxed);
        atomic_fetch_add(&pool.done, 1);
    }
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void *helper(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint64_t seen = atomic_load(&pool.ticket) >> 32;
    for (;;) {
        const int64_t until = now_ns() + HELPER_SPIN_NS;
        uint64_t gen;
        for (int spins = 1; (gen = atomic_load(&pool.ticket) >> 32) == seen; ++spins) {
            cpu_relax();
            if (spins % 64 == 0) {
                sched_yield();
                if (now_ns() > until) { /* no job for a while: sleep until one comes */
                    pthread_mutex_lock(&pool.lock);
                    atomic_fetch_add(&pool.sleeping, 1);
                    while ((atomic_load(&pool.ticket) >> 32) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
                    atomic_fetch_sub(&pool.sleeping, 1);
                    pthread_mutex_unlock(&pool.lock);
                }
            }
        }
        seen = gen;
        if (index < atomic_load(&pool.wanted)) work_on(gen, 1);
    }
    return NULL;
}

/* A forked child has none of the helpers (only the forking thread lives on), and one of them may
 * have held the lock at the fork: the child starts over with none, on one thread. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.started = 0;
    atomic_store(&pool.wanted, 0);
    atomic_store(&pool.sleeping, 0);
    atomic_flag_clear(&pool.busy);
}

/* Use `threads` threads in all (the caller and threads - 1 helpers, made on first need); 1 runs
 * every kernel on its caller's thread alone. Returns the number now in use. */
int tl_set_threads(int threads) {
    static int fork_handled;
    int helpers = threads < 1 ? 0 : threads - 1;
    helpers = helpers > MAX_HELPERS ? MAX_HELPERS : helpers;
    pthread_mutex_lock(&pool.lock);
    if (!fork_handled && helpers > 0) fork_handled = pthread_atfork(NULL, NULL, pool_after_fork) == 0;
    while (pool.started < helpers) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, helper, (void *)(intptr_t)pool.started);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.started += 1;
    }
    helpers = helpers < pool.started ? helpers : pool.started;
    atomic_store(&pool.wanted, helpers);
    pthread_mutex_unlock(&pool.lock);
    return helpers + 1;
}

int tl_threads(void) { return atomic_load(&pool.wanted) + 1; }

/* Tasks of the jobs shared with the helpers so far, and how many of them the helpers ran. */
void tl_task_counts(int64_t *out) {
    out[0] = atomic_load(&pool.shared_tasks);
    out[1] = atomic_load(&pool.helped_tasks);
}

/* fn(job, i) for i in [0, n), on this thread and whichever helpers join in. */
void tl_run_tasks(task_fn fn, const void *job, int64_t n) {
    if (n < 2 || atomic_load(&pool.wanted) == 0 || atomic_flag_test_and_set(&pool.busy)) {
        for (int64_t i = 0; i < n; ++i) fn(job, i);
        return;
    }
    /* Close the last job first: a helper that read its ticket (gen, i) before this call and this
     * job's n_tasks after the store below would otherwise pass `i < n_tasks` and claim task i of
     * a job whose fields are now this one's, running it outside `done`'s count (the job could then
     * end, its struct leave the stack, while the task still runs). Its CAS now fails. */
    const uint64_t last = atomic_load(&pool.ticket) >> 32;
    atomic_store(&pool.ticket, (last << 32) | TICKET_CLOSED);
    atomic_store_explicit(&pool.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool.job, job, memory_order_relaxed);
    atomic_store_explicit(&pool.n_tasks, n, memory_order_relaxed);
    atomic_store(&pool.done, 0);
    const uint64_t gen = (last + 1) & 0xffffffffu;
    atomic_store(&pool.ticket, gen << 32);
    if (atomic_load(&pool.sleeping) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    atomic_fetch_add_explicit(&pool.shared_tasks, n, memory_order_relaxed);
    work_on(gen, 0);
    while (atomic_load(&pool.done) < n) cpu_relax();
    atomic_flag_clear(&pool.busy);
}

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

/* Elements [lo, lo + n) of row `row` of field `f`: the pool's own memory, or `scratch`
 * dequantized (4-bit: lo and n whole groups). */
static inline const float *row_part(const field_t *f, int64_t row, int64_t lo, int64_t n, float *scratch) {
    if (f->plain != NULL) return f->plain + row * f->width + lo;
    const uint8_t *codes = f->codes + row * (f->width / 2) + lo / 2;
    const uint16_t *meta = f->meta + row * (f->width / f->group) * 2 + (lo / f->group) * 2;
#pragma omp simd
    for (int64_t i = 0; i < n / 2; ++i) {
        scratch[2 * i] = (float)(codes[i] & 15u);
        scratch[2 * i + 1] = (float)(codes[i] >> 4);
    }
    for (int64_t g = 0; g < n / f->group; ++g) {
        const float s = half_to_float(meta[2 * g]), minimum = half_to_float(meta[2 * g + 1]);
        float *x = scratch + g * f->group;
        for (int64_t i = 0; i < f->group; ++i) x[i] *= s; /* two loops: rounded as torch rounds */
        for (int64_t i = 0; i < f->group; ++i) x[i] += minimum;
    }
    return scratch;
}

static inline void prefetch_part(const field_t *f, int64_t row, int64_t lo, int64_t n) {
    if (f->plain != NULL) {
        prefetch(f->plain + row * f->width + lo, n * 4);
    } else {
        prefetch(f->codes + row * (f->width / 2) + lo / 2, n / 2);
        prefetch(f->meta + row * (f->width / f->group) * 2 + (lo / f->group) * 2, n / f->group * 4);
    }
}

typedef struct {
    const float *q; /* row r's [HQ, T, D] at q + r * ldq */
    const field_t *k, *v;
    const int64_t *rows, *n_keys;
    float *out;
    int64_t ldq, HQ, KVH, D, L, T;
    int64_t parts; /* tasks a row: its KV heads split in `parts` runs */
    float scale;
    _Atomic int failed;
} attend_job;

/* One row's attention for a run of its KV heads (and their query heads): task
 * r * parts + part of an `attend_job`. */
static void attend_row(const void *job_, int64_t task) {
    attend_job *job = (attend_job *)job_;
    const float *q = job->q, scale = job->scale;
    const field_t *k = job->k, *v = job->v;
    const int64_t *rows = job->rows, *n_keys = job->n_keys;
    float *out = job->out;
    const int64_t HQ = job->HQ, KVH = job->KVH, D = job->D, L = job->L, T = job->T;
    const int64_t G = HQ / KVH, head = T * D; /* q and out [R, HQ, T, D]: a head's stride */
    const int64_t r = task / job->parts, part = task % job->parts;
    const int64_t h0 = KVH * part / job->parts, h1 = KVH * (part + 1) / job->parts; /* KV heads [h0, h1) */
    const int64_t q0 = h0 * G, q1 = h1 * G, lo = h0 * D, width = (h1 - h0) * D;
    /* [HQ, L] scores, then 1 / sum per head, then a scratch row for a 4-bit key */
    float *scores = malloc(sizeof(float) * (size_t)(HQ * L + HQ + k->width));
    if (scores == NULL) {
        atomic_store(&job->failed, 1);
        return;
    }
    float *inv = scores + HQ * L, *scratch = inv + HQ;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t n = n_keys[r] + t; /* query t sees the keys before it and itself */
        const int64_t *key_rows = rows + r * L;
        const float *qr = q + r * job->ldq + t * D;
        float *out_r = out + r * HQ * head + t * D;
        /* scores: one pass over the keys' K rows, every head of a key while its row is in cache */
        for (int64_t j = 0; j < n; ++j) {
            if (j + AHEAD < n) prefetch_part(k, key_rows[j + AHEAD], lo, width);
            const float *kj = row_part(k, key_rows[j], lo, width, scratch); /* head h0 first */
            for (int64_t h = h0, hq = q0; h < h1; ++h) {
                const float *kh = kj + (h - h0) * D;
                for (int64_t g = 0; g < G; ++g, ++hq) {
                    const float *qh = qr + hq * head;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
                    scores[hq * L + j] = s * scale;
                }
            }
        }
        for (int64_t hq = q0; hq < q1; ++hq) { /* softmax per query head: float32, max first */
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
        for (int64_t hq = q0; hq < q1; ++hq)
            for (int64_t d = 0; d < D; ++d) out_r[hq * head + d] = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
            if (j + AHEAD < n) prefetch_part(v, key_rows[j + AHEAD], lo, width);
            const float *vj = row_part(v, key_rows[j], lo, width, scratch);
            for (int64_t h = h0, hq = q0; h < h1; ++h) {
                const float *vh = vj + (h - h0) * D;
                for (int64_t g = 0; g < G; ++g, ++hq) {
                    const float p = scores[hq * L + j];
                    float *oh = out_r + hq * head;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) oh[d] += p * vh[d];
                }
            }
        }
        for (int64_t hq = q0; hq < q1; ++hq)
            for (int64_t d = 0; d < D; ++d) out_r[hq * head + d] *= inv[hq];
    }
    free(scores);
}

/* Every row's attention, the rows shared among the kernel threads. Returns 0, or 1 where a
 * scratch buffer could not be allocated. */
static int attend(const float *q, int64_t ldq, const field_t *k, const field_t *v, const int64_t *rows,
                  const int64_t *n_keys, float *out, int64_t R, int64_t HQ, int64_t KVH, int64_t D, int64_t L,
                  int64_t T, float scale) {
    /* Few rows (batch 1) would leave threads idle: each row's KV heads are split among about
     * two tasks a thread (a 4-bit row in whole groups). Each head's result is the same either way. */
    int64_t parts = 1;
    const int64_t want = 2 * (int64_t)tl_threads();
    if (R < want && (k->plain != NULL || (D % k->group == 0 && D % v->group == 0)))
        parts = (want + R - 1) / R < KVH ? (want + R - 1) / R : KVH;
    attend_job job = {q, k, v, rows, n_keys, out, ldq, HQ, KVH, D, L, T, parts, scale, 0};
    tl_run_tasks(attend_row, &job, R * parts);
    return atomic_load(&job.failed);
}

int tl_decode_attention(const float *q, int64_t ldq, const float *k, const float *v, const int64_t *rows,
                        const int64_t *n_keys, float *out, int64_t R, int64_t HQ, int64_t KVH,
                        int64_t D, int64_t L, int64_t T, float scale) {
    const field_t kf = {k, NULL, NULL, KVH * D, 1}, vf = {v, NULL, NULL, KVH * D, 1};
    return attend(q, ldq, &kf, &vf, rows, n_keys, out, R, HQ, KVH, D, L, T, scale);
}

int tl_decode_attention_int4(const float *q, int64_t ldq, const uint8_t *k_codes, const uint16_t *k_meta,
                             const uint8_t *v_codes, const uint16_t *v_meta, const int64_t *rows,
                             const int64_t *n_keys, float *out, int64_t R, int64_t HQ, int64_t KVH,
                             int64_t D, int64_t L, int64_t T, int64_t group, float scale) {
    const field_t kf = {NULL, k_codes, k_meta, KVH * D, group}, vf = {NULL, v_codes, v_meta, KVH * D, group};
    return attend(q, ldq, &kf, &vf, rows, n_keys, out, R, HQ, KVH, D, L, T, scale);
}

/* RoPE: out [R, H, T, D] = x * cos + rotate(x) * sin, row r of x at x + r * ldx ([H, T, D]
 * contiguous), cos and sin [cs_rows, T, D] (cs_rows R, or 1 for every row); `half`: rotate(x) =
 * cat(-x2, x1) of x's halves, else each pair (x0, x1) becomes (-x1, x0). Each product and the sum
 * rounded on its own, as torch's separate ops round them (no contraction into a fused
 * multiply-add: separate statements), so the result is torch's to the bit. */
void tl_rope(const float *x, int64_t ldx, const float *cos, const float *sin, int64_t cs_rows, float *out,
             int64_t R, int64_t H, int64_t T, int64_t D, int half) {
    const int64_t h2 = D / 2;
    for (int64_t r = 0; r < R; ++r)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t t = 0; t < T; ++t) {
                const float *xr = x + r * ldx + (h * T + t) * D;
                const int64_t table = ((cs_rows == 1 ? 0 : r) * T + t) * D;
                const float *c = cos + table, *sn = sin + table;
                float *o = out + ((r * H + h) * T + t) * D;
                if (half) {
#pragma omp simd
                    for (int64_t d = 0; d < h2; ++d) {
                        const float straight = xr[d] * c[d];
                        const float rotated = -xr[d + h2] * sn[d];
                        o[d] = straight + rotated;
                    }
#pragma omp simd
                    for (int64_t d = h2; d < D; ++d) {
                        const float straight = xr[d] * c[d];
                        const float rotated = xr[d - h2] * sn[d];
                        o[d] = straight + rotated;
                    }
                } else {
                    for (int64_t d = 0; d < D; d += 2) {
                        const float straight0 = xr[d] * c[d], rotated0 = -xr[d + 1] * sn[d];
                        const float straight1 = xr[d + 1] * c[d + 1], rotated1 = xr[d] * sn[d + 1];
                        o[d] = straight0 + rotated0;
                        o[d + 1] = straight1 + rotated1;
                    }
                }
            }
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

#if defined(__AVX512F__)
/* exp of 16 floats: Cephes' expf (2^n times a degree-6 polynomial of the rest, ln 2 split in
 * two), within 1-2 ulp of libm's; NaN stays NaN, large inputs give inf and 0 as expf does. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), _mm512_min_ps(_mm512_set1_ps(89.0f), x)); /* (NaN: x) */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

/* SwiGLU of one row: out = silu(gate) * up = gate / (1 + exp(-gate)) * up, as torch computes it
 * (its exp vectorised too: the two agree to a few ulp). Scalar expf took ~10 us a row at
 * intermediate 3072, a tenth of a small model's block. */
void tl_swiglu_row(const float *gate, const float *up, float *out, int64_t I) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= I; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), _mm512_loadu_ps(up + i)));
    }
#endif
    for (; i < I; ++i) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}


typedef struct {
    const float *x, *cos, *sin;
    float *out;
    int64_t ldx, cs_rows, R, H, T, D;
    int half;
} rope_job;

static void rope_task(const void *job_, int64_t task) { /* one (row, head): its T positions */
    const rope_job *j = job_;
    const int64_t r = task / j->H, h = task % j->H, table = (j->cs_rows == 1 ? 0 : r) * j->T * j->D;
    tl_rope(j->x + r * j->ldx + h * j->T * j->D, 0, j->cos + table, j->sin + table, 1,
            j->out + (r * j->H + h) * j->T * j->D, 1, 1, j->T, j->D, j->half);
}

/* `tl_rope` with its (row, head) pairs shared among the threads: a prefill's. */
void tl_rope_threaded(const float *x, int64_t ldx, const float *cos, const float *sin, int64_t cs_rows, float *out,
                      int64_t R, int64_t H, int64_t T, int64_t D, int half) {
    const rope_job job = {x, cos, sin, out, ldx, cs_rows, R, H, T, D, half};
    tl_run_tasks(rope_task, &job, R * H);
}

/* Rows of a prefill: a task a run of rows, every row's result as one row alone gives it. */
#define ROWS_PER_TASK 16

typedef struct {
    const float *fc;
    float *out;
    int64_t R, I;
} swiglu_job;

static void swiglu_task(const void *job_, int64_t task) {
    const swiglu_job *j = job_;
    const int64_t r1 = (task + 1) * ROWS_PER_TASK < j->R ? (task + 1) * ROWS_PER_TASK : j->R;
    for (int64_t r = task * ROWS_PER_TASK; r < r1; ++r)
        tl_swiglu_row(j->fc + r * 2 * j->I, j->fc + r * 2 * j->I + j->I, j->out + r * j->I, j->I);
}

/* out [R, I] = SwiGLU of fc [R, 2I] = [gate; up] per row, the rows shared among the threads. */
void tl_swiglu_rows(const float *fc, int64_t R, int64_t I, float *out) {
    const swiglu_job job = {fc, out, R, I};
    tl_run_tasks(swiglu_task, &job, (R + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
}

typedef struct {
    const float *x, *a, *w_in, *w_out;
    float *r, *y;
    int64_t R, H, style;
    float eps;
} residual_job;

/* `Backend.residual_norm` of R rows x and a [R, H] into r (style 0 pre_ln: x + a; 1 sandwich:
 * n(x + a); 2 peri_ln and post_ln: x + n(a)), and the next norm of r into y where w_out is given:
 * the same adds and norms (`tl_rms_norm`) as the op-by-op path, on the calling thread. */
void tl_residual_rows(const float *x, const float *a, const float *w_in, const float *w_out, int64_t R, int64_t H,
                      int64_t style, float eps, float *r, float *y) {
    const int64_t n = R * H;
    if (style == 2) {
        tl_rms_norm(a, w_in, r, R, H, eps);
        for (int64_t i = 0; i < n; ++i) r[i] = x[i] + r[i];
    } else {
        for (int64_t i = 0; i < n; ++i) r[i] = x[i] + a[i];
        if (style == 1) tl_rms_norm(r, w_in, r, R, H, eps); /* (in place: each row's sum read first) */
    }
    if (w_out != NULL) tl_rms_norm(r, w_out, y, R, H, eps);
}

static void residual_task(const void *job_, int64_t task) {
    const residual_job *j = job_;
    const int64_t r0 = task * ROWS_PER_TASK, rows = (r0 + ROWS_PER_TASK < j->R ? r0 + ROWS_PER_TASK : j->R) - r0;
    const int64_t at = r0 * j->H;
    tl_residual_rows(j->x + at, j->a + at, j->w_in, j->w_out, rows, j->H, j->style, j->eps, j->r + at,
                     j->y == NULL ? NULL : j->y + at);
}

/* `tl_residual_rows` with the rows shared among the threads: a prefill's. */
void tl_residual_norm(const float *x, const float *a, const float *w_in, const float *w_out, int64_t R, int64_t H,
                      int64_t style, float eps, float *r, float *y) {
    const residual_job job = {x, a, w_in, w_out, r, y, R, H, style, eps};
    tl_run_tasks(residual_task, &job, (R + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
}

/* `n` rows of `width` float32 values (row i at x + i * ldx) into pool rows `rows` of `dst`
 * ([n_rows, width]): a K or V write, one copy per row. Returns 0, or -1 (nothing written) where a
 * row is outside the pool. */
int tl_write_rows(const float *x, int64_t ldx, const int64_t *rows, int64_t n, float *dst, int64_t n_rows,
                  int64_t width) {
    for (int64_t i = 0; i < n; ++i)
        if (rows[i] < 0 || rows[i] >= n_rows) return -1;
    for (int64_t i = 0; i < n; ++i) memcpy(dst + rows[i] * width, x + i * ldx, (size_t)width * sizeof(float));
    return 0;
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

/* Matrix products of a few rows: y [M, N] = x [M, K] W^T (+ bias [N]), W [N, K] float32 (the
 * quantised weights' products are qmatmul.c's).
 *
 * A decode step multiplies a handful of rows (its batch, or a verify's few tokens) by every
 * weight matrix: too few rows for a general GEMM's blocking to pay, too many bytes of weights
 * for them to stay in cache between steps. So the weight is laid out once in panels of 16 output
 * columns, panel p holding W[16p .. 16p + 15, k] for k = 0 .. K - 1 consecutively (16 values a
 * k, the last panel zero-padded): one sequential stream through memory, prefetched ahead. For
 * each panel, up to 16 rows keep one 16-wide accumulator each in registers; each k loads the
 * panel's 16 weights once and adds x[m, k] times them to every
 * row's accumulator (x is transposed first, so a k's values for the rows are adjacent). Past 16
 * rows (a prefill), each chunk of panels stays in L2 while every block of 16 rows passes over it.
 * Each output is sum_k x[m, k] W[n, k] with fused multiply-adds (in k order from 4 rows up; as 4
 * or 2 interleaved partial sums for 1 or 2 rows): float32 rounding differs from torch's (another
 * order) at the last bits. */
#define PANEL 16
/* bytes: prefetch this far ahead along the panel stream, with `prefetcht1` (locality 2): on an
 * Intel Xeon (AMX, 2 MB L2) `prefetchnta` kept the lines out of L2, so a prefill's chunk of panels
 * was fetched again for every block of rows (fp32 product at 512 rows 42 -> 119 GFLOP/s a thread)
 * and a decode step's stream ran 1.5-1.9x slower (bench/LOG.md, 2026-12-02 afternoon). */
#define PANEL_AHEAD 2048
#define ROW_BLOCK 16
#define PANEL_CHUNK_BYTES (512 * 1024) /* panels every block of rows reuses from L2 (256 kB: 10% slower on a 2 MB L2) */

#if defined(__AVX512F__)
typedef __m512 vec16;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(acc, s, w) _mm512_fmadd_ps(_mm512_set1_ps(s), (w), (acc))
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VMAX(a, b) _mm512_max_ps((a), (b))
#define VMUL(a, b) _mm512_mul_ps((a), (b))
#define VSTORE(p, v) _mm512_storeu_ps((p), (v))
#else /* the compiler's generic vectors: the same sums (fused where it contracts them) */
typedef float vec16 __attribute__((vector_size(64)));
#define VZERO() ((vec16){0})
#define VLOAD(p) ({ vec16 v_; memcpy(&v_, (p), sizeof v_); v_; })
#define VFMA(acc, s, w) ((acc) + (s) * (w))
#define VADD(a, b) ((a) + (b))
#define VMAX(a, b) ({ vec16 a_ = (a), b_ = (b); a_ > b_ ? a_ : b_; })
#define VMUL(a, b) ((a) * (b))
#define VSTORE(p, v) do { vec16 v_ = (v); memcpy((p), &v_, sizeof v_); } while (0)
#endif

/* R rows (x transposed: xt[k * ldx + r]) times one panel of TYPE (loaded by LOAD) into y (row
 * stride ldy), `cols` of the panel's 16 columns kept (the last panel of an N that 16 does not
 * divide), each times its scale where there are scales, plus its bias where there is one. KS
 * independent sums per row over k = s mod KS, added at the end: a row's sum is a chain of
 * dependent multiply-adds, so with one or two rows KS > 1 keeps the vector unit busy between
 * them. */
#define PANEL_ROWS(NAME, TYPE, LOAD, R, KS)                                                            \
    static void NAME##_##R(const float *xt, int64_t ldx, const TYPE *panel, int64_t K,                \
                           const float *scales, const float *bias, float *y, int64_t ldy, int64_t cols) { \
        vec16 acc[KS][R];                                                                              \
        for (int s = 0; s < KS; ++s)                                                                   \
            for (int r = 0; r < R; ++r) acc[s][r] = VZERO();                                           \
        int64_t k = 0;                                                                                 \
        for (; k + KS <= K; k += KS)                                                                   \
            for (int s = 0; s < KS; ++s) {                                                             \
                const vec16 w = LOAD(panel + PANEL * (k + s));                                         \
                __builtin_prefetch((const char *)(panel + PANEL * (k + s)) + PANEL_AHEAD, 0, 2);       \
                for (int r = 0; r < R; ++r) acc[s][r] = VFMA(acc[s][r], xt[(k + s) * ldx + r], w);    \
            }                                                                                          \
        for (; k < K; ++k) {                                                                           \
            const vec16 w = LOAD(panel + PANEL * k);                                                   \
            for (int r = 0; r < R; ++r) acc[0][r] = VFMA(acc[0][r], xt[k * ldx + r], w);              \
        }                                                                                              \
        for (int s = 1; s < KS; ++s)                                                                   \
            for (int r = 0; r < R; ++r) acc[0][r] = VADD(acc[0][r], acc[s][r]);                        \
        float out[PANEL], b[PANEL] = {0}, sc[PANEL] = {0};                                             \
        if (bias != NULL) memcpy(b, bias, (size_t)cols * sizeof(float));                               \
        if (scales != NULL) memcpy(sc, scales, (size_t)cols * sizeof(float));                          \
        for (int r = 0; r < R; ++r) {                                                                  \
            VSTORE(out, VADD(scales != NULL ? VMUL(acc[0][r], VLOAD(sc)) : acc[0][r], VLOAD(b)));      \
            memcpy(y + r * ldy, out, (size_t)cols * sizeof(float));                                    \
        }                                                                                              \
    }

/* 8 rows times two panels at once (a batch of 8, or a prefill's 16-row blocks in two halves): two panel loads
 * and 8 broadcasts a k for 16 multiply-adds, where one panel's 16 rows take 17 loads for 16. On
 * a CPU with two 512-bit FMA units (Intel Xeon) that halves the loads the FMAs wait on; each
 * output's sum runs in k order as the one-panel kernel's. */
#define PANEL_PAIR8(NAME, TYPE, LOAD)                                                                  \
    static void NAME##_pair8(const float *xt, int64_t ldx, const TYPE *panel, int64_t K,               \
                             const float *bias, float *y, int64_t ldy, int64_t cols) {                \
        vec16 acc[2][8];                                                                               \
        for (int h = 0; h < 2; ++h)                                                                    \
            for (int r = 0; r < 8; ++r) acc[h][r] = VZERO();                                           \
        const TYPE *second = panel + PANEL * K;                                                        \
        for (int64_t k = 0; k < K; ++k) {                                                              \
            const vec16 w0 = LOAD(panel + PANEL * k), w1 = LOAD(second + PANEL * k);                   \
            __builtin_prefetch((const char *)(panel + PANEL * k) + PANEL_AHEAD, 0, 2);                 \
            __builtin_prefetch((const char *)(second + PANEL * k) + PANEL_AHEAD, 0, 2);                \
            for (int r = 0; r < 8; ++r) {                                                              \
                const float xv = xt[k * ldx + r];                                                      \
                acc[0][r] = VFMA(acc[0][r], xv, w0);                                                   \
                acc[1][r] = VFMA(acc[1][r], xv, w1);                                                   \
            }                                                                                          \
        }                                                                                              \
        float out[PANEL], b[2][PANEL] = {{0}};                                                         \
        if (bias != NULL) memcpy(b, bias, (size_t)(PANEL + cols) * sizeof(float));                     \
        for (int r = 0; r < 8; ++r) {                                                                  \
            VSTORE(y + r * ldy, VADD(acc[0][r], VLOAD(b[0])));                                         \
            VSTORE(out, VADD(acc[1][r], VLOAD(b[1])));                                                 \
            memcpy(y + r * ldy + PANEL, out, (size_t)cols * sizeof(float));                            \
        }                                                                                              \
    }

/* A product's work split among threads: task t computes the columns of panels
 * [t * per_task, (t + 1) * per_task) for every row. */
typedef struct {
    const float *xt;     /* x transposed in blocks of up to 16 rows: block b holds rows 16b.. as xt[k * rows + r] */
    int64_t M, K, N, per_task, chunk; /* chunk: panels every block of rows passes over while they sit in L2 */
    const void *panels;
    const float *scales, *bias;
    float *y;
} panel_job;

/* Products of at least PARALLEL_ROWS rows and PARALLEL_WORK multiply-adds run on the helper threads
 * too, and so do products of fewer rows whose weights are PARALLEL_BYTES or more: one core does
 * not draw the memory's whole bandwidth (a decode step's one-row products streamed 20 GB/s on one
 * thread, 27 GB/s on two: bench/LOG.md 2026-12-02), while a smaller product ends before a
 * helper joins. In about TASKS_PER_THREAD tasks a thread, so a late helper leaves little to wait
 * for. */
#define PARALLEL_ROWS 4
#define PARALLEL_WORK (1 << 19)
#define PARALLEL_BYTES (256 * 1024)
#define TASKS_PER_THREAD 4

/* Panels a task of an M x N x K product covers: all of them (one task) where the product stays on
 * its caller's thread, else about TASKS_PER_THREAD tasks a thread. */
static int64_t panels_per_task(int64_t M, int64_t N, int64_t K) {
    const int64_t n_panels = (N + PANEL - 1) / PANEL, threads = tl_threads();
    const int wide = N * K * (int64_t)sizeof(float) >= PARALLEL_BYTES;
    if (threads < 2 || (M < PARALLEL_ROWS ? !wide : M * N * K < PARALLEL_WORK)) return n_panels;
    return (n_panels + threads * TASKS_PER_THREAD - 1) / (threads * TASKS_PER_THREAD);
}

/* The rows the next call of a panel's row kernels takes: 16, 8, 4, 2 or 1 of the `left`. */
static inline int64_t row_step(int64_t left) {
    return left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

/* The rows of one panel in blocks of 16, 8, 4, 2, 1, and the matrix product over every panel. */
#define PANEL_MATMUL(NAME, TYPE, LOAD)                                                                 \
    PANEL_ROWS(NAME, TYPE, LOAD, 1, 4)                                                                 \
    PANEL_ROWS(NAME, TYPE, LOAD, 2, 2)                                                                 \
    PANEL_ROWS(NAME, TYPE, LOAD, 4, 1)                                                                 \
    PANEL_ROWS(NAME, TYPE, LOAD, 8, 1)                                                                 \
    PANEL_ROWS(NAME, TYPE, LOAD, 16, 1)                                                                \
    PANEL_PAIR8(NAME, TYPE, LOAD)                                                                      \
    static void NAME##_task(const void *job_, int64_t task) {                                          \
        const panel_job *job = job_;                                                                   \
        const int64_t M = job->M, K = job->K, N = job->N;                                              \
        const int64_t first = task * job->per_task * PANEL, last = first + job->per_task * PANEL;      \
        const TYPE *panels = job->panels;                                                              \
        for (int64_t c0 = first; c0 < N && c0 < last; c0 += job->chunk)                                \
            for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {                                            \
                const int64_t rows = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;                          \
                const float *xb = job->xt + m0 * K;                                                    \
                for (int64_t n0 = c0; n0 < N && n0 < c0 + job->chunk && n0 < last; n0 += PANEL) {      \
                    const TYPE *panel = panels + n0 * K;                                               \
                    const float *s = job->scales != NULL ? job->scales + n0 : NULL;                    \
                    const float *b = job->bias != NULL ? job->bias + n0 : NULL;                        \
                    const int64_t cols = N - n0 < PANEL ? N - n0 : PANEL;                              \
                    const int64_t next = n0 + PANEL;                                                   \
                    if ((rows == ROW_BLOCK || rows == 8) && s == NULL && next < N && next < c0 + job->chunk \
                        && next < last) {                                                              \
                        const int64_t cols2 = N - next < PANEL ? N - next : PANEL;                     \
                        NAME##_pair8(xb, rows, panel, K, b, job->y + m0 * N + n0, N, cols2);           \
                        if (rows == ROW_BLOCK)                                                         \
                            NAME##_pair8(xb + 8, rows, panel, K, b, job->y + (m0 + 8) * N + n0, N, cols2); \
                        n0 = next; /* (and the loop's step: two panels) */                            \
                        continue;                                                                      \
                    }                                                                                  \
                    for (int64_t r = 0; r < rows;) {                                                   \
                        const float *xr = xb + r;                                                      \
                        float *yr = job->y + (m0 + r) * N + n0;                                        \
                        const int64_t step = row_step(rows - r);                                       \
                        switch (step) {                                                                \
                        case 16: NAME##_16(xr, rows, panel, K, s, b, yr, N, cols); break;              \
                        case 8: NAME##_8(xr, rows, panel, K, s, b, yr, N, cols); break;                \
                        case 4: NAME##_4(xr, rows, panel, K, s, b, yr, N, cols); break;                \
                        case 2: NAME##_2(xr, rows, panel, K, s, b, yr, N, cols); break;                \
                        default: NAME##_1(xr, rows, panel, K, s, b, yr, N, cols); break;               \
                        }                                                                              \
                        r += step;                                                                     \
                    }                                                                                  \
                }                                                                                      \
            }                                                                                          \
    }                                                                                                  \
    static int NAME(const float *x, int64_t M, int64_t K, const TYPE *panels, int64_t N,               \
                    const float *scales, const float *bias, float *y) {                                \
        float *xt = malloc((size_t)M * (size_t)K * sizeof(float));                                     \
        if (xt == NULL) return -1;                                                                     \
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {                                                \
            const int64_t rows = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;                              \
            float *xb = xt + m0 * K;                                                                   \
            for (int64_t k = 0; k < K; ++k)                                                            \
                for (int64_t r = 0; r < rows; ++r) xb[k * rows + r] = x[(m0 + r) * K + k];            \
        }                                                                                              \
        const int64_t n_panels = (N + PANEL - 1) / PANEL;                                              \
        int64_t chunk = PANEL_CHUNK_BYTES / (K * PANEL * (int64_t)sizeof(TYPE));                       \
        chunk = chunk < 1 ? 1 : chunk;                                                                 \
        int64_t per_task = panels_per_task(M, N, K);                                                   \
        if (per_task < n_panels && per_task > chunk) per_task -= per_task % chunk; /* whole L2 chunks */ \
        const panel_job job = {xt, M, K, N, per_task, (chunk < per_task ? chunk : per_task) * PANEL, panels, scales, bias, y}; \
        tl_run_tasks(NAME##_task, &job, (n_panels + per_task - 1) / per_task);                            \
        free(xt);                                                                                      \
        return 0;                                                                                      \
    }
PANEL_MATMUL(matmul_f32, float, VLOAD)

/* W [N, K] (row stride ldw) into panels [ceil(N / 16), K, 16] (`panels` holds that many values). */
#define PACK_PANELS(NAME, TYPE)                                                                        \
    void NAME(const TYPE *w, int64_t ldw, int64_t N, int64_t K, TYPE *panels) {                        \
        const int64_t n_panels = (N + PANEL - 1) / PANEL;                                              \
        for (int64_t p = 0; p < n_panels; ++p)                                                         \
            for (int64_t k = 0; k < K; ++k)                                                            \
                for (int64_t j = 0; j < PANEL; ++j) {                                                  \
                    const int64_t n = p * PANEL + j;                                                   \
                    panels[(p * K + k) * PANEL + j] = n < N ? w[n * ldw + k] : (TYPE)0;                \
                }                                                                                      \
    }
PACK_PANELS(tl_pack_panels, float)

/* y [M, N] = x [M, K] W^T + bias (bias may be NULL), W as `tl_pack_panels` laid it out; x and y
 * contiguous. Returns 0, or -1 where it could not allocate its transposed rows. */
int tl_panel_matmul(const float *x, int64_t M, int64_t K, const float *panels, int64_t N, const float *bias,
                    float *y) {
    return matmul_f32(x, M, K, panels, N, NULL, bias, y);
}

/* Each row of x [B, V] float32: the index of its first maximum (as torch's argmax picks it) and
 * whether the row can be sampled from (no NaN, no +inf, some finite value: its maximum finite).
 * One pass; the sampler's check and its greedy pick together. */
void tl_max_rows(const float *x, int64_t B, int64_t V, int64_t *index, int8_t *usable) {
    for (int64_t b = 0; b < B; ++b) {
        const float *row = x + b * V;
        float top = -INFINITY;
        int64_t at = 0, v = 0;
        int nan = 0;
#if defined(__AVX512F__)
        if (V >= 16) { /* per lane: its first maximum (updated only on a strictly greater value) */
            __m512 best = _mm512_set1_ps(-INFINITY);
            __m512i where = _mm512_setzero_si512(), lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                                12, 13, 14, 15);
            __mmask16 unordered = 0;
            for (; v + 16 <= V; v += 16) {
                const __m512 xv = _mm512_loadu_ps(row + v);
                unordered |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
                const __mmask16 greater = _mm512_cmp_ps_mask(xv, best, _CMP_GT_OQ);
                best = _mm512_mask_mov_ps(best, greater, xv);
                where = _mm512_mask_mov_epi32(where, greater, _mm512_add_epi32(lanes, _mm512_set1_epi32((int)v)));
            }
            nan = unordered != 0;
            float lane_best[16];
            int32_t lane_at[16];
            _mm512_storeu_ps(lane_best, best);
            _mm512_storeu_si512(lane_at, where);
            at = -1;
            for (int l = 0; l < 16; ++l) /* the greatest value; among equal ones the first index */
                if (at < 0 || lane_best[l] > top || (lane_best[l] == top && lane_at[l] < at)) {
                    top = lane_best[l];
                    at = lane_at[l];
                }
        }
#endif
        for (; v < V; ++v) {
            const float value = row[v];
            if (value != value) nan = 1;
            else if (value > top) {
                top = value;
                at = v;
            }
        }
        index[b] = at;
        usable[b] = !nan && top > -INFINITY && top < INFINITY;
    }
}

/* ---- Causal attention of a prefill's first chunk ----
 *
 * q [R, HQ, T, D] over k, v [R, KVH, T, D] (each with its own row, head and token strides, D
 * contiguous: slices of the fused projection, no copy), query t over keys 0..t; out [R, T, HQ, D]
 * contiguous (the output projection's input as it is). Grouped-query: head h reads KV head
 * h / (HQ / KVH). torch's SDPA took 16-18% of a base100m float32 prefill of 512 tokens.
 *
 * A task is one (row, head): its keys are laid out once in panels of ATT_KEYS keys (K^T: D
 * values of 16 keys side by side, as a weight panel), then each block of ATT_QROWS queries keeps
 * its scores for a panel in ATT_QROWS 16-wide registers (one broadcast query value times a panel
 * row per multiply-add), softmaxes them online (running maximum and sum, the block's earlier
 * sums rescaled when the maximum grows) and adds the weighted values to its output rows, kept
 * in L1. Keys past a query's own are masked to -inf (the diagonal panels only); every query sees
 * key 0 in the first panel, so no row's maximum stays -inf. Float32 throughout; the order of the
 * sums differs from torch's (a few ulp on the output). D a multiple of 16, at most
 * ATT_MAX_D (the caller checks). */
#define ATT_KEYS PANEL /* keys a panel: K laid out as a weight (`tl_pack_panels`) */
#define ATT_QROWS 8
#define ATT_MAX_D 256

typedef struct {
    const float *q, *k, *v;
    int64_t q_sr, q_sh, q_st, k_sr, k_sh, k_st, v_sr, v_sh, v_st;
    int64_t HQ, KVH, T, D;
    float scale;
    float *out;
    _Atomic int failed;
} causal_job;

static inline float hmax16(vec16 x) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps(x);
#else
    float lanes[16], m;
    VSTORE(lanes, x);
    m = lanes[0];
    for (int i = 1; i < 16; ++i) m = lanes[i] > m ? lanes[i] : m;
    return m;
#endif
}

static inline float hsum16(vec16 x) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps(x);
#else
    float lanes[16], s = 0.0f;
    VSTORE(lanes, x);
    for (int i = 0; i < 16; ++i) s += lanes[i];
    return s;
#endif
}

/* exp(x - m) of 16 scores (-inf gives 0). */
static inline vec16 exp_shifted16(vec16 x, float m) {
#if defined(__AVX512F__)
    return exp16(_mm512_sub_ps(x, _mm512_set1_ps(m)));
#else
    float lanes[16];
    VSTORE(lanes, x);
    for (int i = 0; i < 16; ++i) lanes[i] = expf(lanes[i] - m);
    return VLOAD(lanes);
#endif
}

/* One block of ATT_QROWS queries from t0 (`rows` of them real) over keys 0 .. t0 + rows - 1: every
 * score into `sc` [ATT_QROWS][keys rounded up to a panel], each row's maximum over them, exp and
 * sum, then the weighted values (three passes: no running rescale, one reduction a row). */
static void causal_block(const causal_job *j, const float *q, const float *kt, const float *v, int64_t t0, int rows,
                         float *sc, int64_t ldsc, float *out) {
    const int64_t D = j->D, keys = t0 + rows, last = (keys - 1) / ATT_KEYS;
    float qs[ATT_QROWS][ATT_MAX_D], l[ATT_QROWS];
    for (int i = 0; i < ATT_QROWS; ++i) { /* (rows past the real ones repeat the last: computed, not kept) */
        const float *src = q + (t0 + (i < rows ? i : rows - 1)) * j->q_st;
        for (int64_t d = 0; d < D; ++d) qs[i][d] = src[d] * j->scale;
    }
    float lowest[16];
    for (int i = 0; i < 16; ++i) lowest[i] = -INFINITY;
    vec16 top[ATT_QROWS];
    for (int i = 0; i < ATT_QROWS; ++i) top[i] = VLOAD(lowest);
    for (int64_t p = 0; p <= last; ++p) {
        const float *panel = kt + p * D * ATT_KEYS;
        vec16 s[ATT_QROWS];
        for (int i = 0; i < ATT_QROWS; ++i) s[i] = VZERO();
        for (int64_t d = 0; d < D; ++d) {
            const vec16 w = VLOAD(panel + d * ATT_KEYS);
            for (int i = 0; i < ATT_QROWS; ++i) s[i] = VFMA(s[i], qs[i][d], w);
        }
        for (int i = 0; i < ATT_QROWS; ++i) {
            float *row = sc + i * ldsc + p * ATT_KEYS;
            VSTORE(row, s[i]);
            const int64_t seen = t0 + (i < rows ? i : rows - 1) - p * ATT_KEYS + 1; /* keys of the panel it sees */
            for (int64_t key = seen < 0 ? 0 : seen; key < ATT_KEYS; ++key) row[key] = -INFINITY;
            top[i] = VMAX(top[i], VLOAD(row));
        }
    }
    const int64_t padded = (last + 1) * ATT_KEYS;
    for (int i = 0; i < ATT_QROWS; ++i) {
        const float m = hmax16(top[i]); /* finite: every query sees key 0 */
        float *row = sc + i * ldsc;
        vec16 sum = VZERO();
        for (int64_t key = 0; key < padded; key += ATT_KEYS) {
            const vec16 e = exp_shifted16(VLOAD(row + key), m);
            VSTORE(row + key, e);
            sum = VADD(sum, e);
        }
        l[i] = hsum16(sum);
    }
    for (int64_t d = 0; d < D; d += 16) {
        vec16 o[ATT_QROWS];
        for (int i = 0; i < ATT_QROWS; ++i) o[i] = VZERO();
        for (int64_t key = 0; key < keys; ++key) {
            const vec16 vv = VLOAD(v + key * j->v_st + d);
            for (int i = 0; i < ATT_QROWS; ++i) o[i] = VFMA(o[i], sc[i * ldsc + key], vv);
        }
        for (int i = 0; i < rows; ++i) VSTORE(out + (t0 + i) * j->HQ * D + d, VFMA(VZERO(), 1.0f / l[i], o[i]));
    }
}

static void causal_task(const void *job_, int64_t task) {
    const causal_job *j = job_;
    const int64_t r = task / j->HQ, h = task % j->HQ, kvh = h / (j->HQ / j->KVH), D = j->D, T = j->T;
    const int64_t panels = (T + ATT_KEYS - 1) / ATT_KEYS;
    float *kt = malloc((size_t)(panels * D * ATT_KEYS) * sizeof(float));
    float *sc = malloc((size_t)(ATT_QROWS * panels * ATT_KEYS) * sizeof(float));
    if (kt == NULL || sc == NULL) {
        free(kt);
        free(sc);
        atomic_store(&((causal_job *)j)->failed, 1);
        return;
    }
    const float *k = j->k + r * j->k_sr + kvh * j->k_sh;
    tl_pack_panels(k, j->k_st, T, D, kt); /* K^T in panels of ATT_KEYS (= PANEL) keys, zero past T */
    const float *q = j->q + r * j->q_sr + h * j->q_sh, *v = j->v + r * j->v_sr + kvh * j->v_sh;
    float *out = j->out + r * T * j->HQ * D + h * D;
    for (int64_t t0 = 0; t0 < T; t0 += ATT_QROWS)
        causal_block(j, q, kt, v, t0, T - t0 < ATT_QROWS ? (int)(T - t0) : ATT_QROWS, sc, panels * ATT_KEYS, out);
    free(kt);
    free(sc);
}

/* Causal attention of T queries over their own T keys (see above); the (row, head) pairs shared
 * among the threads. Returns 0, or -1 where scratch memory could not be allocated (or D is not
 * a multiple of 16 up to ATT_MAX_D, or HQ not a multiple of KVH). */
int tl_causal_attention(const float *q, const int64_t *q_strides, const float *k, const int64_t *k_strides,
                        const float *v, const int64_t *v_strides, int64_t R, int64_t HQ, int64_t KVH, int64_t T,
                        int64_t D, float scale, float *out) {
    if (D % 16 != 0 || D > ATT_MAX_D || KVH < 1 || HQ % KVH != 0) return -1;
    causal_job job = {q, k, v, q_strides[0], q_strides[1], q_strides[2], k_strides[0], k_strides[1], k_strides[2],
                      v_strides[0], v_strides[1], v_strides[2], HQ, KVH, T, D, scale, out, 0};
    tl_run_tasks(causal_task, &job, R * HQ);
    return atomic_load(&job.failed) ? -1 : 0;
}
