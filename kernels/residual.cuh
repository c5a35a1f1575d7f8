// Decompression of PLAID / ColBERTv2 residual-compressed document tokens,
// 8 features (one 16-byte chunk of the decompressed row) at a time. Shared by
// the fused MaxSim loader and the standalone decompression kernel.
#pragma once
#include "common.cuh"

// The packed bucket indices of one 8-feature chunk (nbits bytes, the
// little-endian word `bits`) in LSB-first order: feature f at bits
// [f * nbits, (f + 1) * nbits). ColBERTv2 / fast-plaid bytes are np.packbits
// of LSB-first index bits (feature 0 in the top bits of each byte, each field
// bit-reversed): reversing the bits of every byte gives LSB-first order. Once
// per chunk, so that the per-feature work is a shift and a mask.
__device__ __forceinline__ uint64_t lsb_first(uint64_t bits, bool colbert) {
    if (!colbert) return bits;
    const uint32_t lo = __byte_perm(__brev((uint32_t)bits), 0, 0x0123);
    const uint32_t hi = __byte_perm(__brev((uint32_t)(bits >> 32)), 0, 0x0123);
    return ((uint64_t)hi << 32) | lo;
}

// Centroid chunk (8 elements of T) plus the bucket weight of each feature, in f32.
template <typename T>
__device__ __forceinline__ void decode8(uint4 centroid, uint64_t bits, int nbits, bool colbert, const float* buckets,
                                        float v[8]) {
    const T* ce = reinterpret_cast<const T*>(&centroid);
    const uint64_t b = lsb_first(bits, colbert);
    if (nbits <= 4) { // 32-bit shifts
        const uint32_t w = (uint32_t)b, mask = (1u << nbits) - 1;
#pragma unroll
        for (int f = 0; f < 8; ++f) v[f] = Elem<T>::to_float(ce[f]) + buckets[(w >> (f * nbits)) & mask];
    } else {
#pragma unroll
        for (int f = 0; f < 8; ++f) v[f] = Elem<T>::to_float(ce[f]) + buckets[(uint32_t)(b >> (8 * f)) & 0xffu];
    }
}

// The packed bits of one chunk: nbits bytes at `r` (aligned to their size).
template <bool GLOBAL>
__device__ __forceinline__ uint64_t chunk_bits(const uint8_t* r, int nbits) {
    if (nbits == 2) return GLOBAL ? __ldg(reinterpret_cast<const unsigned short*>(r)) : *reinterpret_cast<const unsigned short*>(r);
    if (nbits == 4) return GLOBAL ? __ldg(reinterpret_cast<const unsigned int*>(r)) : *reinterpret_cast<const unsigned int*>(r);
    return GLOBAL ? __ldg(reinterpret_cast<const unsigned long long*>(r)) : *reinterpret_cast<const unsigned long long*>(r);
}

// Features [k0, k0 + 8) of compressed token `tok`, in f32 (dim % 8 == 0).
// `buckets` may point to shared memory.
template <typename T>
__device__ __forceinline__ void decompress8(const MaxSimParams& p, const float* buckets, uint32_t code, int tok, int k0,
                                            float v[8]) {
    const uint4 c = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.res_centroids) + (size_t)code * p.dim + k0));
    const uint8_t* r = p.res_residuals + (size_t)tok * (p.dim * p.res_nbits / 8) + k0 * p.res_nbits / 8;
    decode8<T>(c, chunk_bits<true>(r, p.res_nbits), p.res_nbits, p.res_colbert_order, buckets, v);
}

// The 2^nbits bucket weights into shared memory, by the whole block (the
// caller synchronizes before reading them).
__device__ __forceinline__ void stage_buckets(float* dst, const float* src, int nbits) {
    for (int k = threadIdx.x; k < (1 << nbits); k += blockDim.x) dst[k] = src[k];
}
