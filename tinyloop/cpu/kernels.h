/* What the C kernels' sources share: the helper threads (kernels.c) and fp16 conversions. */
#ifndef TINYLOOP_KERNELS_H
#define TINYLOOP_KERNELS_H
#include <math.h>
#include <stdint.h>

/* A kernel's work in tasks: fn(job, i) for i in [0, n), on the calling thread and whichever
 * helper threads join in (kernels.c). */
typedef void (*task_fn)(const void *job, int64_t task);
void tl_run_tasks(task_fn fn, const void *job, int64_t n);
int tl_threads(void);

/* The kernels one decoder block's decode step (block.c) runs in sequence. */
void tl_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t H, float eps);
void tl_swiglu_row(const float *gate, const float *up, float *out, int64_t I);
void tl_residual_rows(const float *x, const float *a, const float *w_in, const float *w_out, int64_t R, int64_t H,
                      int64_t style, float eps, float *r, float *y);
void tl_rope(const float *x, int64_t ldx, const float *cos, const float *sin, int64_t cs_rows, float *out, int64_t R,
             int64_t H, int64_t T, int64_t D, int half);
int tl_write_rows(const float *x, int64_t ldx, const int64_t *rows, int64_t n, float *dst, int64_t n_rows,
                  int64_t width);
void tl_quantize_int4_rows(const float *x, const int64_t *rows, int64_t n, uint8_t *codes, uint16_t *meta,
                           int64_t width, int64_t group);
int tl_decode_attention_int4(const float *q, int64_t ldq, const uint8_t *k_codes, const uint16_t *k_meta,
                             const uint8_t *v_codes, const uint16_t *v_meta, const int64_t *rows,
                             const int64_t *n_keys, float *out, int64_t R, int64_t HQ, int64_t KVH, int64_t D,
                             int64_t L, int64_t T, int64_t group, float scale);
int tl_decode_attention(const float *q, int64_t ldq, const float *k, const float *v, const int64_t *rows,
                        const int64_t *n_keys, float *out, int64_t R, int64_t HQ, int64_t KVH, int64_t D, int64_t L,
                        int64_t T, float scale);
void tl_max_rows(const float *x, int64_t B, int64_t V, int64_t *index, int8_t *usable);
int tl_panel_matmul(const float *x, int64_t M, int64_t K, const float *panels, int64_t N, const float *bias,
                    float *y);
int tl_matmul_q8(const float *x, int64_t M, int64_t K, const uint8_t *panels, int64_t N, const float *scales,
                 int64_t group, const float *bias, float *y, int64_t terms);
int tl_matmul_q4(const float *x, int64_t M, int64_t K, const uint8_t *panels, int64_t N, int64_t group,
                 const float *bias, float *y, int64_t terms);
int tl_matmul_bf16(const float *x, int64_t M, int64_t K, const uint16_t *panels, int64_t N, const float *bias,
                   float *y);

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

#endif
