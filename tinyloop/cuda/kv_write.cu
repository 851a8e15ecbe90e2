// The new tokens' K and V stored in the paged pool (tinyloop/model/kvstore.py, PlainBuffer.write
// for K and V together): row i of k and v ([n, kv_heads, D], any row and head strides, D
// contiguous: views into the fused projection) copied to pool row rows[i * rows_stride] of
// k_store and v_store ([pool_rows, kv_heads, D] contiguous, the same dtype: a copy, no rounding).
//
// Grid (n, kv_heads, 2): z 0 writes K, z 1 writes V; the block's threads stride over D.

template <typename T>
__device__ void kv_write(const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ k_store,
                         T* __restrict__ v_store, const long long* __restrict__ rows, long long rows_stride,
                         int kv_heads, int head_dim, long long k_row_stride, long long k_head_stride,
                         long long v_row_stride, long long v_head_stride) {
    const long long i = blockIdx.x;
    const int h = blockIdx.y;
    const T* src = blockIdx.z == 0 ? k + i * k_row_stride + h * k_head_stride : v + i * v_row_stride + h * v_head_stride;
    T* dst = (blockIdx.z == 0 ? k_store : v_store) + (rows[i * rows_stride] * kv_heads + h) * (long long)head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) dst[d] = src[d];
}

#define TL_KV_WRITE(T, SUFFIX)                                                                         \
    extern "C" __global__ void kv_write_##SUFFIX(const T* k, const T* v, T* k_store, T* v_store,        \
                                                 const long long* rows, long long rows_stride,         \
                                                 int kv_heads, int head_dim, long long k_row_stride,   \
                                                 long long k_head_stride, long long v_row_stride,      \
                                                 long long v_head_stride) {                            \
        kv_write<T>(k, v, k_store, v_store, rows, rows_stride, kv_heads, head_dim, k_row_stride,       \
                    k_head_stride, v_row_stride, v_head_stride);                                       \
    }
TL_INSTANTIATE(TL_KV_WRITE)
