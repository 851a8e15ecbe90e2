// SwiGLU on the fused gate/up projection (tinyloop/model/layers.py, MLP): fc = [gate; up] per
// row, out = silu(gate) * up, rounded as torch rounds it: silu(gate) to T, then the product.
// fc is [rows, 2 * inter] with row stride fc_stride; out [rows, inter] contiguous. 1-D grid over
// rows * inter elements.

template <typename T>
__device__ void swiglu(const T* __restrict__ fc, T* __restrict__ out, long long rows, int inter,
                       long long fc_stride) {
    const long long n = rows * inter;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const long long row = e / inter;
        const int i = (int)(e - row * inter);
        const float g = tl_load(fc + row * fc_stride + i);
        const float u = tl_load(fc + row * fc_stride + inter + i);
        const float act = tl_round<T>(g / (1.0f + expf(-g)));
        out[e] = tl_cast<T>(act * u);
    }
}

#define TL_SWIGLU(T, SUFFIX)                                                                           \
    extern "C" __global__ void swiglu_##SUFFIX(const T* fc, T* out, long long rows, int inter,          \
                                               long long fc_stride) {                                  \
        swiglu<T>(fc, out, rows, inter, fc_stride);                                                   \
    }
TL_INSTANTIATE(TL_SWIGLU)
