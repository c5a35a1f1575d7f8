// Warp-level reductions, the L2 inverse norm, and the running (max, argmax)
// of the MaxSim epilogues.
#pragma once
#include "elem.cuh"

// Sum over groups of LANES consecutive lanes (LANES a power of two dividing
// 32); every lane of a group gets the group's sum.
template <int LANES, typename A> __device__ __forceinline__ A lane_sum(A x) {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
template <typename A> __device__ __forceinline__ A warp_sum(A x) { return lane_sum<32>(x); }
// lane_sum over groups of `lanes` lanes, a power of two known only at run time.
__device__ __forceinline__ float lane_sum_dyn(float x, int lanes) {
    for (int o = lanes / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// Max over the lanes whose index differs from this one's only in the bits of
// MASK (e.g. 3: the quad of an MMA fragment row; 28: the 8 token lanes of a column).
template <int MASK> __device__ __forceinline__ float lane_max(float x) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1)
        if (MASK & o) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// The floor of the norm l2_normalize (F.normalize) divides by.
constexpr double MAXSIM_L2_EPS = 1e-12;

// 1 / max(|x|, 1e-12) from the squared norm.
template <typename A> __device__ __forceinline__ A inv_l2norm(A sum_sq) {
    return A(1) / max(sqrt(sum_sq), A(MAXSIM_L2_EPS));
}

// A similarity with its low mantissa bits replaced by `code` (`keep` clears
// them; passed in a register so that this is one LOP3 with `code` as the
// immediate). Max over packed values = the max over values truncated by those
// bits (a relative change under 2^-18), ties going to the larger code. Packing
// turns +-inf into NaN, which fmaxf skips: overflowed similarities are not ranked.
__device__ __forceinline__ float argmax_pack(float v, uint32_t keep, uint32_t code) {
    return __uint_as_float((__float_as_uint(v) & keep) | code);
}

// Max over the N ints value(i) as a tree of 3-input maxima: sm_90's VIMNMX3
// (__vimax3_s32) does two maxima in one instruction, where FMNMX does one.
// On float bits it is the float max whenever that max is a non-negative,
// non-NaN float (such a value outranks every negative one as an int);
// callers check the result and fall back otherwise.
template <int N, typename F> __device__ __forceinline__ int int_max3(F value) {
    int v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = value(i);
#pragma unroll
    for (int w = 1; w < N; w *= 3)
#pragma unroll
        for (int i = 0; i < N; i += 3 * w) {
            if (i + 2 * w < N) v[i] = __vimax3_s32(v[i], v[i + w], v[i + 2 * w]);
            else if (i + w < N) v[i] = max(v[i], v[i + w]);
        }
    return v[0];
}

// Running (max, argmax) merge: larger value wins, ties keep the lower index.
__device__ __forceinline__ void merge_max(float& m, int& idx, float om, int oidx) {
    if (om > m || (om == m && oidx >= 0 && (idx < 0 || oidx < idx))) {
        m = om;
        idx = oidx;
    }
}

// (max, argmax) of an MMA fragment row over its quad (lanes differing in bits
// 0-1); the argmax only when ARGMAX.
template <bool ARGMAX> __device__ __forceinline__ void quad_max(float& m, int& idx) {
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        const float om = __shfl_xor_sync(0xffffffffu, m, off);
        if (ARGMAX) {
            const int oi = __shfl_xor_sync(0xffffffffu, idx, off);
            merge_max(m, idx, om, oi);
        } else {
            m = fmaxf(m, om);
        }
    }
}
