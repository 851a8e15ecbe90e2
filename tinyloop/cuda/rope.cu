// RoPE applied to q and k (tinyloop/model/layers.py, Rope and Attention.project), with the
// optional q/k bias added first (Huginn): x = x + bias; x = x * cos + rotate(x) * sin.
//
// q is [tokens, q_heads, D] and k [tokens, kv_heads, D] with any token and head strides (views
// into the fused qkv projection), D contiguous; the results go to q_out and k_out, each with
// strides of its own: the same pointers and strides rotate in place. cos and sin are float32
// [tokens, D] (one table row per token: its position's). style 0 "half" rotates halves
// (rotate(x)_i = -x_{i+D/2} for i < D/2, x_{i-D/2} after), style 1 "interleaved" adjacent pairs
// (-x_{2j+1}, x_{2j}). compute_f32 1: rotate in float32, round once (rope_compute="float32");
// 0: as torch in T, the tables rounded to T and each product and the sum rounded.
//
// Grid (tokens, q_heads + kv_heads); each thread owns one rotation pair: it reads the pair, then
// writes it, so in place is safe.

template <typename T>
__device__ __forceinline__ float tl_rope_one(float x, float partner_signed, float c, float s, int compute_f32) {
    // _rn intrinsics: no FMA contraction, each product rounded as torch's separate ops round it
    if (compute_f32) return __fadd_rn(__fmul_rn(x, c), __fmul_rn(partner_signed, s));
    return tl_round<T>(__fadd_rn(tl_round<T>(__fmul_rn(x, tl_round<T>(c))),
                                 tl_round<T>(__fmul_rn(partner_signed, tl_round<T>(s)))));
}

template <typename T>
__device__ void rope_apply(const T* q, T* q_out, const T* k, T* k_out, const float* __restrict__ cos,
                           const float* __restrict__ sin, const T* __restrict__ q_bias,
                           const T* __restrict__ k_bias, int q_heads, int head_dim, long long q_token_stride,
                           long long q_head_stride, long long k_token_stride, long long k_head_stride,
                           long long qo_token_stride, long long qo_head_stride, long long ko_token_stride,
                           long long ko_head_stride, int style, int compute_f32) {
    const long long token = blockIdx.x;
    int head = blockIdx.y;
    const T* x;
    T* y;
    const T* bias;
    if (head < q_heads) {
        x = q + token * q_token_stride + head * q_head_stride;
        y = q_out + token * qo_token_stride + head * qo_head_stride;
        bias = q_bias ? q_bias + (long long)head * head_dim : nullptr;
    } else {
        head -= q_heads;
        x = k + token * k_token_stride + head * k_head_stride;
        y = k_out + token * ko_token_stride + head * ko_head_stride;
        bias = k_bias ? k_bias + (long long)head * head_dim : nullptr;
    }
    const float* c = cos + token * head_dim;
    const float* s = sin + token * head_dim;
    const int half = head_dim / 2;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        const int i0 = style == 0 ? j : 2 * j;          // the first of the pair
        const int i1 = style == 0 ? j + half : 2 * j + 1;  // its partner
        float x0 = tl_load(x + i0), x1 = tl_load(x + i1);
        if (bias) {
            x0 = tl_round<T>(x0 + tl_load(bias + i0));
            x1 = tl_round<T>(x1 + tl_load(bias + i1));
        }
        y[i0] = tl_cast<T>(tl_rope_one<T>(x0, -x1, c[i0], s[i0], compute_f32));
        y[i1] = tl_cast<T>(tl_rope_one<T>(x1, x0, c[i1], s[i1], compute_f32));
    }
}

#define TL_ROPE(T, SUFFIX)                                                                             \
    extern "C" __global__ void rope_##SUFFIX(                                                          \
        const T* q, T* q_out, const T* k, T* k_out, const float* cos, const float* sin, const T* q_bias,\
        const T* k_bias, int q_heads, int head_dim, long long q_token_stride, long long q_head_stride,  \
        long long k_token_stride, long long k_head_stride, long long qo_token_stride,                  \
        long long qo_head_stride, long long ko_token_stride, long long ko_head_stride, int style,      \
        int compute_f32) {                                                                             \
        rope_apply<T>(q, q_out, k, k_out, cos, sin, q_bias, k_bias, q_heads, head_dim, q_token_stride, \
                      q_head_stride, k_token_stride, k_head_stride, qo_token_stride, qo_head_stride,   \
                      ko_token_stride, ko_head_stride, style, compute_f32);                            \
    }
TL_INSTANTIATE(TL_ROPE)
