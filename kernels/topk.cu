// Top-k of each row of a float matrix (topk_rows): the k largest values and
// their column indices, best first, equal values in increasing column order,
// NaN below every number. One block per row:
//  1. radix select: four 8-bit passes over the row's order-preserving keys,
//     each a shared-memory histogram of the digit among the keys that match
//     the digits chosen so far, find the k-th largest key T and how many of
//     the keys equal to T belong to the top k (the lowest-indexed ones);
//  2. compaction: each thread owns a contiguous run of the row; two block
//     scans (keys equal to T, then selected keys) give every selected entry
//     its slot in column order;
//  3. a bitonic sort of the k (value, column) pairs in shared memory.
// Rows are read five times, from L2 for rows of up to a few MB.
#include "reduce.cuh"

#define TOPK_THREADS 1024
#define TOPK_MAX_K 4096

// Order-preserving key of a float: larger float, larger key; NaN is 0.
__device__ __forceinline__ uint32_t topk_key(float f) {
    const uint32_t u = __float_as_uint(f);
    if (f != f) return 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive block-wide prefix sum of one value per thread (TOPK_THREADS
// threads); `total` gets the sum. `warp_tot` holds 32 words of shared memory.
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t v, uint32_t* warp_tot, uint32_t& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint32_t x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_tot[warp] = x;
    __syncthreads();
    if (warp == 0) {
        uint32_t w = lane < TOPK_THREADS / 32 ? warp_tot[lane] : 0u;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const uint32_t y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        warp_tot[lane] = w; // inclusive sums of the warps
    }
    __syncthreads();
    const uint32_t before = (warp > 0 ? warp_tot[warp - 1] : 0u) + x - v;
    total = warp_tot[TOPK_THREADS / 32 - 1];
    __syncthreads();
    return before;
}

// Mirrors TopkParams in src/cuda/topk.rs.
struct TopkParams {
    const float* x;    // [rows, n] (row stride n)
    float* values;     // [rows, k], best first
    uint32_t* indices; // [rows, k]
    long long n;
    int k;             // <= min(n, TOPK_MAX_K)
};

extern "C" __global__ void __launch_bounds__(TOPK_THREADS) topk_rows(const TopkParams p) {
    const float* x = p.x;
    float* values = p.values;
    uint32_t* indices = p.indices;
    const long long n = p.n;
    const int k = p.k;
    __shared__ uint32_t hist[256];
    __shared__ uint32_t warp_tot[32];
    __shared__ unsigned long long pairs[TOPK_MAX_K];
    __shared__ uint32_t chosen[2]; // [0]: prefix digits of T; [1]: keys above the prefix still to take
    const float* row = x + (size_t)blockIdx.x * n;
    const int tid = threadIdx.x;

    // 1. The k-th largest key T, 8 bits at a time from the top.
    uint32_t prefix = 0, want = (uint32_t)k; // want: how many of the keys matching `prefix` are in the top k
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += TOPK_THREADS) hist[b] = 0u;
        __syncthreads();
        const uint32_t high = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
        for (long long t = tid; t < n; t += TOPK_THREADS) {
            const uint32_t key = topk_key(row[t]);
            // Warp-aggregated: one atomic per distinct digit of the warp (the
            // high digits of similar values all fall into a few bins).
            const uint32_t d = (key & high) == prefix ? (key >> shift) & 0xffu : 256u;
            const unsigned peers = __match_any_sync(__activemask(), d);
            if (d < 256u && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[d], (uint32_t)__popc(peers));
        }
        __syncthreads();
        if (tid == 0) {
            uint32_t above = 0;
            int d = 255;
            for (; d > 0; --d) {
                if (above + hist[d] >= want) break;
                above += hist[d];
            }
            chosen[0] = prefix | ((uint32_t)d << shift);
            chosen[1] = want - above;
        }
        __syncthreads();
        prefix = chosen[0];
        want = chosen[1];
        __syncthreads();
    }
    const uint32_t T = prefix; // `want` keys equal to T are in the top k, the lowest-indexed ones

    // 2. Each thread's contiguous run of the row, in column order.
    const long long per = (n + TOPK_THREADS - 1) / TOPK_THREADS;
    const long long a = min((long long)tid * per, n), b = min(a + per, n);
    uint32_t eq = 0, gt = 0;
    for (long long t = a; t < b; ++t) {
        const uint32_t key = topk_key(row[t]);
        gt += key > T;
        eq += key == T;
    }
    uint32_t tot;
    const uint32_t eq_before = block_exclusive_scan(eq, warp_tot, tot);
    const uint32_t eq_take = eq_before >= want ? 0u : min(eq, want - eq_before);
    uint32_t slot = block_exclusive_scan(gt + eq_take, warp_tot, tot);
    uint32_t eq_seen = 0;
    for (long long t = a; t < b; ++t) {
        const float v = row[t];
        const uint32_t key = topk_key(v);
        const bool take = key > T || (key == T && eq_seen++ < eq_take);
        // Sort key: larger value first, then the lower column (complemented).
        if (take) pairs[slot++] = ((unsigned long long)key << 32) | (0xffffffffu - (uint32_t)t);
    }
    int kp = 1;
    while (kp < k) kp <<= 1;
    for (int s = k + tid; s < kp; s += TOPK_THREADS) pairs[s] = 0ull; // below every real entry
    __syncthreads();

    // 3. Bitonic sort, descending.
    for (int size = 2; size <= kp; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int s = tid; s < kp / 2; s += TOPK_THREADS) {
                const int lo = 2 * s - (s & (stride - 1)), hi = lo + stride;
                const bool desc = (lo & size) == 0;
                const unsigned long long p = pairs[lo], q = pairs[hi];
                if ((p < q) == desc) {
                    pairs[lo] = q;
                    pairs[hi] = p;
                }
            }
            __syncthreads();
        }
    }
    for (int s = tid; s < k; s += TOPK_THREADS) {
        const unsigned long long p = pairs[s];
        const uint32_t col = 0xffffffffu - (uint32_t)p;
        values[(size_t)blockIdx.x * k + s] = row[col];
        indices[(size_t)blockIdx.x * k + s] = col;
    }
}
