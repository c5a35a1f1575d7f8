// Decompression of PLAID / ColBERTv2 residual-compressed document tokens,
// 8 features (one 16-byte chunk of the decompressed row) at a time. Shared by
// the fused MaxSim loader and the standalone decompression kernel.
#pragma once
#include "common.cuh"

// Bucket index of feature f (0..7) of a chunk whose packed bits, nbits bytes,
// are the little-endian word `bits`.
__device__ __forceinline__ int bucket_of(uint64_t bits, int f, int nbits, bool colbert) {
    const uint32_t mask = (1u << nbits) - 1;
    if (!colbert) return (int)((bits >> (f * nbits)) & mask); // LSB-first: feature f at bit f * nbits
    // ColBERTv2: np.packbits of LSB-first index bits: feature 0 in the top bits
    // of each byte, each field bit-reversed.
    const int per = 8 / nbits, field = f % per;
    const uint32_t byte = (uint32_t)(bits >> (8 * (f / per))) & 0xffu;
    const uint32_t raw = (byte >> (8 - nbits * (field + 1))) & mask;
    return (int)(__brev(raw) >> (32 - nbits));
}

// Features [k0, k0 + 8) of compressed token `tok`, in f32 (dim % 8 == 0).
// `buckets` may point to shared memory.
template <typename T>
__device__ __forceinline__ void decompress8(const MaxSimParams& p, const float* buckets, uint32_t code, int tok, int k0,
                                            float v[8]) {
    const uint4 c = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.res_centroids) + (size_t)code * p.dim + k0));
    const T* ce = reinterpret_cast<const T*>(&c);
    const uint8_t* r = p.res_residuals + (size_t)tok * (p.dim * p.res_nbits / 8) + k0 * p.res_nbits / 8;
    uint64_t bits;
    if (p.res_nbits == 2) bits = __ldg(reinterpret_cast<const unsigned short*>(r));
    else if (p.res_nbits == 4) bits = __ldg(reinterpret_cast<const unsigned int*>(r));
    else bits = __ldg(reinterpret_cast<const unsigned long long*>(r));
#pragma unroll
    for (int f = 0; f < 8; ++f)
        v[f] = Elem<T>::to_float(ce[f]) + buckets[bucket_of(bits, f, p.res_nbits, p.res_colbert_order)];
}

// Sum over the `LANES` consecutive lanes holding one row (LANES divides 32).
template <int LANES> __device__ __forceinline__ float row_sum(float x) {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

template <typename T> __device__ __forceinline__ uint4 pack8(const float v[8]);
template <> __device__ __forceinline__ uint4 pack8<__half>(const float v[8]) {
    uint4 o;
    __half2* h = reinterpret_cast<__half2*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
    return o;
}
template <> __device__ __forceinline__ uint4 pack8<__nv_bfloat16>(const float v[8]) {
    uint4 o;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    return o;
}
