// The new tokens' K and V stored in the paged pool (tinyloop/model/kvstore.py, PlainBuffer.write
// for K and V together): row i of k and v ([n, kv_heads, D], any row and head strides, D
// contiguous: views into the fused projection) copied to pool row rows[i * rows_stride] of
// k_store and v_store ([pool_rows, kv_heads, D] contiguous, the same dtype: a copy, no rounding).
//
// Grid (n, kv_heads, 2): z 0 writes K, z 1 writes V; the block's threads stride over D.
//
// kv_write_int4: the same rows into an int4 pool (kvstore.Int4Buffer.write: quantize_int4), each
// group of `group` consecutive values of a head quantized as torch computes it on the device:
// lo = clamp(min, +-65504), scale = min((max - lo) * (1/15), 65504) (torch multiplies by the
// reciprocal of a scalar divisor on CUDA), both rounded to fp16 (the meta: scale, minimum), then
// code = clamp(rint((x - m) / max(s, 1e-30)), 0, 15) against the rounded s and m; two codes a
// byte, the even index in the low nibble. codes [pool_rows, kv_heads, D/2] uint8, meta
// [pool_rows, kv_heads, D/group, 2] fp16, contiguous. Grid (n, 2): z as above on y; the block's
// threads stride over the row's kv_heads * D/group groups, a group each.

template <typename T>
__device__ void kv_write(const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ k_store,
                         T* __restrict__ v_store, const long long* __restrict__ rows, long long rows_stride,
                         int kv_heads, int head_dim, long long k_row_stride, long long k_head_stride,
                         long long v_row_stride, long long v_head_stride) {
    const long long i = blockIdx.x;
    const int h = blockIdx.y;
    const T* src = blockIdx.z == 0 ? k + i * k_row_stride + h * k_head_stride
                                   : v + i * v_row_stride + h * v_head_stride;
    T* dst = (blockIdx.z == 0 ? k_store : v_store) + (rows[i * rows_stride] * kv_heads + h) * (long long)head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) dst[d] = src[d];
}

template <typename T>
__device__ void kv_write_int4(const T* __restrict__ k, const T* __restrict__ v, unsigned char* __restrict__ k_codes,
                              __half* __restrict__ k_meta, unsigned char* __restrict__ v_codes,
                              __half* __restrict__ v_meta, const long long* __restrict__ rows, long long rows_stride,
                              int kv_heads, int head_dim, int group, long long k_row_stride, long long k_head_stride,
                              long long v_row_stride, long long v_head_stride) {
    const long long i = blockIdx.x;
    const bool is_v = blockIdx.y == 1;
    const long long row = rows[i * rows_stride];
    const int groups = head_dim / group;
    for (int e = threadIdx.x; e < kv_heads * groups; e += blockDim.x) {
        const int h = e / groups, gi = e - h * groups;
        const T* x = (is_v ? v + i * v_row_stride + h * v_head_stride : k + i * k_row_stride + h * k_head_stride)
                     + gi * group;
        const long long at = row * kv_heads + h;  // the pool row's head
        unsigned char* codes = (is_v ? v_codes : k_codes) + at * (head_dim / 2) + gi * (group / 2);
        __half* meta = (is_v ? v_meta : k_meta) + (at * groups + gi) * 2;
        float lo = tl_load(x), hi = lo;
        for (int j = 1; j < group; ++j) {
            const float y = tl_load(x + j);
            lo = fminf(lo, y);
            hi = fmaxf(hi, y);
        }
        lo = fminf(fmaxf(lo, -65504.0f), 65504.0f);
        const float scale = fminf(__fmul_rn(__fsub_rn(hi, lo), 1.0f / 15.0f), 65504.0f);
        const __half s16 = __float2half_rn(scale), m16 = __float2half_rn(lo);
        meta[0] = s16;
        meta[1] = m16;
        const float s = fmaxf(__half2float(s16), 1e-30f), m = __half2float(m16);
        for (int j = 0; j < group; j += 2) {
            const float c0 = fminf(fmaxf(rintf(__fdiv_rn(__fsub_rn(tl_load(x + j), m), s)), 0.0f), 15.0f);
            const float c1 = fminf(fmaxf(rintf(__fdiv_rn(__fsub_rn(tl_load(x + j + 1), m), s)), 0.0f), 15.0f);
            codes[j / 2] = (unsigned char)((unsigned int)c0 | ((unsigned int)c1 << 4));
        }
    }
}

#define TL_KV_WRITE(T, SUFFIX)                                                                         \
    extern "C" __global__ void kv_write_##SUFFIX(const T* k, const T* v, T* k_store, T* v_store,        \
                                                 const long long* rows, long long rows_stride,         \
                                                 int kv_heads, int head_dim, long long k_row_stride,   \
                                                 long long k_head_stride, long long v_row_stride,      \
                                                 long long v_head_stride) {                            \
        kv_write<T>(k, v, k_store, v_store, rows, rows_stride, kv_heads, head_dim, k_row_stride,       \
                    k_head_stride, v_row_stride, v_head_stride);                                       \
    }                                                                                                 \
    extern "C" __global__ void kv_write_int4_##SUFFIX(                                                 \
        const T* k, const T* v, unsigned char* k_codes, __half* k_meta, unsigned char* v_codes,         \
        __half* v_meta, const long long* rows, long long rows_stride, int kv_heads, int head_dim,      \
        int group, long long k_row_stride, long long k_head_stride, long long v_row_stride,            \
        long long v_head_stride) {                                                                     \
        kv_write_int4<T>(k, v, k_codes, k_meta, v_codes, v_meta, rows, rows_stride, kv_heads, head_dim,\
                         group, k_row_stride, k_head_stride, v_row_stride, v_head_stride);             \
    }
TL_INSTANTIATE(TL_KV_WRITE)
