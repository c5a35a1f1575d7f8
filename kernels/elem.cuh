// Element types of the kernels: conversions to and from the accumulation
// type, and packing of rounded 16-bit values.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#define MAXSIM_NEG_INF (__int_as_float(0xff800000))

// to_float / from: to and from the accumulation type (f32; f64 for f64).
template <typename T> struct Elem;
template <> struct Elem<__half> {
    using Acc = float;
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from(float x) { return __float2half(x); }
};
template <> struct Elem<__nv_bfloat16> {
    using Acc = float;
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from(float x) { return __float2bfloat16(x); }
};
template <> struct Elem<float> {
    using Acc = float;
    static __device__ __forceinline__ float to_float(float x) { return x; }
    static __device__ __forceinline__ float from(float x) { return x; }
};
template <> struct Elem<double> {
    using Acc = double;
    static __device__ __forceinline__ double to_float(double x) { return x; }
    static __device__ __forceinline__ double from(double x) { return x; }
};

// Two floats rounded to T (to nearest) and packed into one 32-bit word, a in
// the low half: one F2FP instruction.
template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// Eight floats rounded to T as one 16-byte chunk.
template <typename T> __device__ __forceinline__ uint4 pack8(const float v[8]) {
    return make_uint4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7]));
}

// Eight 16-bit T at p (16-byte aligned) as floats: one 16-byte load.
template <typename T> __device__ __forceinline__ void load8(const T* p, float v[8]) {
    static_assert(sizeof(T) == 2, "load8: 16-bit types");
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const T* h = reinterpret_cast<const T*>(&w[k]);
        v[2 * k] = Elem<T>::to_float(h[0]);
        v[2 * k + 1] = Elem<T>::to_float(h[1]);
    }
}

// Eight f32 at p (16-byte aligned).
__device__ __forceinline__ void load8f(const float* p, float v[8]) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// Eight floats rounded to T stored at p (16-byte aligned, global memory):
// one 16-byte store (a plain uint4 store was split into four 4-byte ones
// where the compiler's registers did not line up).
template <typename T> __device__ __forceinline__ void store8(T* p, const float v[8]) {
    const uint4 u = pack8<T>(v);
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(u.x), "r"(u.y), "r"(u.z), "r"(u.w) : "memory");
}

// Whether every pointer is 16-byte aligned (null ones count as aligned): with
// rows of a multiple of 8 16-bit elements, the condition of the 8-wide paths.
__device__ __forceinline__ bool aligned16(const void* a, const void* b = nullptr, const void* c = nullptr,
                                          const void* d = nullptr) {
    return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | reinterpret_cast<uintptr_t>(c) |
             reinterpret_cast<uintptr_t>(d)) &
            15) == 0;
}
