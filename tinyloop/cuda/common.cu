// Helpers every TinyLoop kernel shares; the loader puts this file in front of each kernel's source.
//
// Element types: float (fp32), __half (fp16), __nv_bfloat16 (bf16). Each kernel is written once
// as a template over the element type T and instantiated per type as an extern "C" entry point
// with a _f32 / _f16 / _bf16 suffix, so NVRTC needs no name expressions. Arithmetic is in
// float; ROUND(x) rounds a float to T and back, where the torch reference rounds an intermediate
// result to the model dtype (an add, a product): the kernel then rounds at the same places.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float tl_load(const float* p) { return *p; }
__device__ __forceinline__ float tl_load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float tl_load(const __nv_bfloat16* p) { return __bfloat162float(*p); }

template <typename T> __device__ __forceinline__ T tl_cast(float x);
template <> __device__ __forceinline__ float tl_cast<float>(float x) { return x; }
template <> __device__ __forceinline__ __half tl_cast<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 tl_cast<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float tl_load_value(float x) { return x; }
__device__ __forceinline__ float tl_load_value(__half x) { return __half2float(x); }
__device__ __forceinline__ float tl_load_value(__nv_bfloat16 x) { return __bfloat162float(x); }

// x rounded to T, as float: torch's result of an op computed in float and stored in T.
template <typename T> __device__ __forceinline__ float tl_round(float x) { return tl_load_value(tl_cast<T>(x)); }

#define TL_NEG_INF __int_as_float(0xff800000)

// Sum of v over the block; every thread gets it. `scratch` holds one float per warp (<= 32).
__device__ __forceinline__ float tl_block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Max of v over the block; every thread gets it.
__device__ __forceinline__ float tl_block_max(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : TL_NEG_INF;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

#define TL_INSTANTIATE(MACRO) MACRO(float, f32) MACRO(__half, f16) MACRO(__nv_bfloat16, bf16)
