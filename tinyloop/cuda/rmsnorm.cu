// RMSNorm fused with the residual add, per block style (tinyloop/model/layers.py, Block):
//
//   mode 0  pre_ln:    r = x + a;          y = N(r, w_out)            (x + attn, then the mlp norm)
//   mode 1  peri_ln:   r = x + N(a, w_in); y = N(r, w_out)            (post_ln: y skipped, norm_out null)
//   mode 2  sandwich:  r = N(x + a, w_in); y = N(r, w_out)
//   mode 3  norm only: y = N(x, w_out)                                 (r not written)
//
// N(v, w) = v * rsqrt(mean(v^2) + eps) * w in float, rounded to T (cast_first 0: the weight in
// float32), or rounded to T before the product with w (cast_first 1: the reference order).
// One block per row; r is written to res_out (which may alias x) and read back by the thread
// that wrote it. norm_out may be null (mode 1, post_ln).

template <typename T>
__device__ __forceinline__ float tl_norm_value(float v, float inv, const T* w, int i, int cast_first) {
    if (cast_first) return tl_round<T>(tl_round<T>(v * inv) * tl_load(w + i));
    return tl_round<T>(v * inv * tl_load(w + i));
}

template <typename T>
__device__ void residual_rmsnorm(const T* __restrict__ x, const T* __restrict__ a, const T* __restrict__ w_in,
                                 const T* __restrict__ w_out, T* res_out, T* __restrict__ norm_out, int hidden,
                                 long long x_stride, long long a_stride, long long out_stride, float eps,
                                 int mode, int cast_first) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const T* xr = x + row * x_stride;
    const T* ar = a + row * a_stride;
    T* rr = res_out + row * out_stride;
    T* yr = norm_out ? norm_out + row * out_stride : nullptr;
    float ss = 0.0f;
    if (mode == 1) {  // N(a, w_in) first
        float sa = 0.0f;
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) { float v = tl_load(ar + i); sa += v * v; }
        const float inv_a = rsqrtf(tl_block_sum(sa, scratch) / hidden + eps);
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
            float r = tl_round<T>(tl_load(xr + i) + tl_norm_value(tl_load(ar + i), inv_a, w_in, i, cast_first));
            rr[i] = tl_cast<T>(r);
            ss += r * r;
        }
    } else if (mode == 2) {  // N(x + a, w_in)
        float s2 = 0.0f;
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
            float s = tl_round<T>(tl_load(xr + i) + tl_load(ar + i));
            rr[i] = tl_cast<T>(s);
            s2 += s * s;
        }
        const float inv_s = rsqrtf(tl_block_sum(s2, scratch) / hidden + eps);
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
            float r = tl_norm_value(tl_load(rr + i), inv_s, w_in, i, cast_first);
            rr[i] = tl_cast<T>(r);
            ss += r * r;
        }
    } else if (mode == 0) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
            float r = tl_round<T>(tl_load(xr + i) + tl_load(ar + i));
            rr[i] = tl_cast<T>(r);
            ss += r * r;
        }
    } else {  // mode 3: normalise x itself
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) { float v = tl_load(xr + i); ss += v * v; }
    }
    const float total = tl_block_sum(ss, scratch);
    if (!yr) return;
    const float inv = rsqrtf(total / hidden + eps);
    const T* src = mode == 3 ? xr : rr;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        yr[i] = tl_cast<T>(tl_norm_value(tl_load(src + i), inv, w_out, i, cast_first));
}

#define TL_RMSNORM(T, SUFFIX)                                                                          \
    extern "C" __global__ void residual_rmsnorm_##SUFFIX(                                              \
        const T* x, const T* a, const T* w_in, const T* w_out, T* res_out, T* norm_out, int hidden,   \
        long long x_stride, long long a_stride, long long out_stride, float eps, int mode,            \
        int cast_first) {                                                                             \
        residual_rmsnorm<T>(x, a, w_in, w_out, res_out, norm_out, hidden, x_stride, a_stride,         \
                            out_stride, eps, mode, cast_first);                                       \
    }
TL_INSTANTIATE(TL_RMSNORM)
