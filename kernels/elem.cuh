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
