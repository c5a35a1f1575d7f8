// Top-k of each row of a matrix (topk_rows): the k largest values and their
// column indices, best first, equal values in increasing column order, NaN
// below every number. A block selects the top k of one segment of a row:
//  1. radix select: four 8-bit passes over the segment's order-preserving
//     keys, each a shared-memory histogram of the digit among the keys that
//     match the digits chosen so far, find the k-th largest key T and how
//     many of the keys equal to T belong to the top k (the lowest-indexed);
//  2. compaction: each thread owns a contiguous run of the segment; two
//     block scans (keys equal to T, then selected keys) give every selected
//     entry its slot in column order;
//  3. (`sort`) a bitonic sort of the k (value, column) pairs in shared memory.
// Long rows take two launches: segments of `chunk` columns each keep their
// top k unsorted, in column order (one block per segment, so a row of 136 000
// is read by 17 blocks instead of one), then one block per row selects and
// sorts the top k of those candidates, reading their columns from `cols`.
#include "reduce.cuh"

#define TOPK_THREADS 1024
#define TOPK_MAX_K 4096

// Order-preserving key of a float: larger float, larger key; NaN is 0.
__device__ __forceinline__ uint32_t topk_key(float f) {
    const uint32_t u = __float_as_uint(f);
    if (f != f) return 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
// The float of a key (its inverse; key 0 gives NaN).
__device__ __forceinline__ float topk_value(uint32_t key) {
    return key == 0u ? __int_as_float(0x7fffffff) : __uint_as_float((key & 0x80000000u) ? key & 0x7fffffffu : ~key);
}
// 16-bit types: the same order on their own 16 bits, in the top half of the
// key (the low half is 0), so two 8-bit radix passes decide it instead of four.
__device__ __forceinline__ uint32_t topk_key16(uint32_t u, bool nan) {
    return nan ? 0u : ((u & 0x8000u) ? ~u & 0xffffu : u | 0x8000u) << 16;
}
__device__ __forceinline__ uint32_t topk_key(__half h) { return topk_key16(__half_as_ushort(h), __hisnan(h)); }
__device__ __forceinline__ uint32_t topk_key(__nv_bfloat16 h) {
    return topk_key16(__bfloat16_as_ushort(h), __hisnan(h));
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
    const void* x;         // [rows, n] (row stride n)
    const uint32_t* cols;  // [rows, n] column of each entry of x; null: its position
    float* values;         // [rows, chunks, k]
    uint32_t* indices;     // [rows, chunks, k]
    long long n;
    long long chunk;       // columns per block
    int chunks;            // blocks per row: ceil(n / chunk)
    int k;                 // <= TOPK_MAX_K; a segment shorter than k keeps all of it
    int sort;              // 1: best first; 0: column order, NaN-padded to k
};

template <typename T> __device__ __forceinline__ void topk_block(const TopkParams& p) {
    __shared__ uint32_t hist[256];
    __shared__ uint32_t warp_tot[32];
    __shared__ unsigned long long pairs[TOPK_MAX_K];
    __shared__ uint32_t chosen[2]; // [0]: prefix digits of T; [1]: keys above the prefix still to take
    const int row_i = blockIdx.x / p.chunks, seg = blockIdx.x % p.chunks;
    const long long start = (long long)seg * p.chunk, n = min(p.chunk, p.n - start);
    const T* row = reinterpret_cast<const T*>(p.x) + (size_t)row_i * p.n + start;
    const uint32_t* cols = p.cols ? p.cols + (size_t)row_i * p.n + start : nullptr;
    const int k = (int)min((long long)p.k, n);
    const size_t out0 = (size_t)blockIdx.x * p.k;
    const int tid = threadIdx.x, lane = tid & 31;
    auto val = [&](long long t) { return Elem<T>::to_float(row[t]); };
    auto col = [&](long long t) { return cols ? cols[t] : (uint32_t)(start + t); };

    // 1. The k-th largest key T, 8 bits at a time from the top.
    uint32_t prefix = 0, want = (uint32_t)k; // want: how many of the keys matching `prefix` are in the top k
    constexpr int LAST = sizeof(T) == 2 ? 16 : 0; // 16-bit keys: the low digits are all 0
    for (int shift = 24; shift >= LAST; shift -= 8) {
        for (int b = tid; b < 256; b += TOPK_THREADS) hist[b] = 0u;
        __syncthreads();
        const uint32_t high = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
        for (long long t = tid; t < n; t += TOPK_THREADS) {
            const uint32_t key = topk_key(row[t]);
            // Warp-aggregated: one atomic per distinct digit of the warp (the
            // high digits of similar values all fall into a few bins); after
            // the first pass most warps have no key left under the prefix.
            const uint32_t d = (key & high) == prefix ? (key >> shift) & 0xffu : 256u;
            const unsigned active = __activemask();
            if (!__any_sync(active, d < 256u)) continue;
            const unsigned peers = __match_any_sync(active, d);
            if (d < 256u && lane == __ffs(peers) - 1) atomicAdd(&hist[d], (uint32_t)__popc(peers));
        }
        __syncthreads();
        // The digit d where the count of keys above it stays below `want`
        // and reaches it with d's: warp 0, 8 digits per lane from the top.
        if (tid < 32) {
            uint32_t h[8], s = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) s += h[j] = hist[255 - 8 * lane - j];
            uint32_t incl = s;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const uint32_t y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            uint32_t above = incl - s;
            if (above < want && (want <= incl || lane == 31)) {
                int j = 0;
                for (; j < 7 && above + h[j] < want; ++j) above += h[j];
                chosen[0] = prefix | ((uint32_t)(255 - 8 * lane - j) << shift);
                chosen[1] = want - above;
            }
        }
        __syncthreads();
        prefix = chosen[0];
        want = chosen[1];
        __syncthreads();
    }
    const uint32_t T_ = prefix; // `want` keys equal to T are in the top k, the lowest-indexed ones

    // 2. Each thread's contiguous run of the segment, in column order.
    const long long per = (n + TOPK_THREADS - 1) / TOPK_THREADS;
    const long long a = min((long long)tid * per, n), b = min(a + per, n);
    uint32_t eq = 0, gt = 0;
    for (long long t = a; t < b; ++t) {
        const uint32_t key = topk_key(row[t]);
        gt += key > T_;
        eq += key == T_;
    }
    uint32_t tot;
    const uint32_t eq_before = block_exclusive_scan(eq, warp_tot, tot);
    const uint32_t eq_take = eq_before >= want ? 0u : min(eq, want - eq_before);
    uint32_t slot = block_exclusive_scan(gt + eq_take, warp_tot, tot);
    uint32_t eq_seen = 0;
    for (long long t = a; t < b; ++t) {
        const uint32_t key = topk_key(row[t]);
        if (!(key > T_ || (key == T_ && eq_seen++ < eq_take))) continue;
        const float v = val(t);
        if (p.sort) {
            // Sort key: larger value first, then the lower column (complemented);
            // the float's key for every T, so that the value comes back from it.
            pairs[slot] = ((unsigned long long)topk_key(v) << 32) | (0xffffffffu - col(t));
        } else {
            p.values[out0 + slot] = v;
            p.indices[out0 + slot] = col(t);
        }
        ++slot;
    }
    if (!p.sort) {
        // A short last segment: padding that ranks below every entry of the
        // row (NaN, and last in column order).
        for (int s = k + tid; s < p.k; s += TOPK_THREADS) {
            p.values[out0 + s] = __int_as_float(0x7fffffff);
            p.indices[out0 + s] = 0xffffffffu;
        }
        return;
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
                const unsigned long long u = pairs[lo], w = pairs[hi];
                if ((u < w) == desc) {
                    pairs[lo] = w;
                    pairs[hi] = u;
                }
            }
            __syncthreads();
        }
    }
    for (int s = tid; s < k; s += TOPK_THREADS) {
        const unsigned long long q = pairs[s];
        p.values[out0 + s] = topk_value((uint32_t)(q >> 32));
        p.indices[out0 + s] = 0xffffffffu - (uint32_t)q;
    }
}

#define TOPK_KERNEL(NAME, T) \
    extern "C" __global__ void __launch_bounds__(TOPK_THREADS) topk_rows_##NAME(const TopkParams p) { topk_block<T>(p); }
TOPK_KERNEL(f32, float)
TOPK_KERNEL(f16, __half)
TOPK_KERNEL(bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------
// Small k (<= 32, e.g. the probed centroids of each query token): a warp per
// segment keeps its best k in registers, lane i holding the i-th as one
// 64-bit key (the value's key above the complemented column: unique, larger
// is better, so ties need no rule of their own and lists merge by the same
// insertion). Elements that beat the k-th (a ballot, rare once the list has
// filled) are inserted by a shift along the lanes. No shared memory and no
// block barrier: the radix kernel above spends its time in those at k = 8.
// Long rows take two launches: segments of TOPK_WARP_SEG columns write their
// lists, then a warp per row merges them (`pairs`).
// ---------------------------------------------------------------------------

#define TOPK_WARP_SEG 1024
#define TOPK_WARP_WARPS 8

// Mirrors TopkWarpParams in src/cuda/topk.rs.
struct TopkWarpParams {
    const void* x;        // [rows, n] values, or with `pairs` [rows, n] 64-bit keys
    unsigned long long* keys; // out: [rows, segs, k] 64-bit keys (not `last`)
    float* values;        // out (`last`): [rows, k]
    uint32_t* indices;    // out (`last`): [rows, k]
    long long n;
    int segs;             // segments per row: ceil(n / TOPK_WARP_SEG), 1 with `pairs`
    int k;                // <= 32
    int rows;
    int last;             // 1: write values and indices, best first
};

template <typename T, bool PAIRS> __device__ __forceinline__ void topk_warp(const TopkWarpParams& p) {
    const int lane = threadIdx.x & 31;
    const long long w = (long long)blockIdx.x * TOPK_WARP_WARPS + (threadIdx.x >> 5);
    if (w >= (long long)p.rows * p.segs) return; // warp-uniform
    const int row = (int)(w / p.segs), seg = (int)(w % p.segs);
    const long long start = PAIRS ? 0 : (long long)seg * TOPK_WARP_SEG;
    const long long n = PAIRS ? p.n : min((long long)TOPK_WARP_SEG, p.n - start);
    const unsigned full = 0xffffffffu;
    unsigned long long mine = 0ull, thr = 0ull; // lane i: the i-th best; thr: the k-th
    auto key_at = [&](long long t) -> unsigned long long {
        if (PAIRS) return reinterpret_cast<const unsigned long long*>(p.x)[(size_t)row * p.n + t];
        const float v = Elem<T>::to_float(reinterpret_cast<const T*>(p.x)[(size_t)row * p.n + start + t]);
        return ((unsigned long long)topk_key(v) << 32) | (0xffffffffu - (uint32_t)(start + t));
    };
    for (long long t0 = 0; t0 < n; t0 += 128) {
        unsigned long long x[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const long long t = t0 + u * 32 + lane;
            x[u] = t < n ? key_at(t) : 0ull;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            unsigned m = __ballot_sync(full, x[u] > thr);
            while (m) {
                const int src = __ffs(m) - 1;
                m &= m - 1;
                const unsigned long long v = __shfl_sync(full, x[u], src);
                if (v <= thr) continue; // the list rose past it meanwhile
                const int pos = __popc(__ballot_sync(full, mine > v));
                const unsigned long long up = __shfl_up_sync(full, mine, 1);
                mine = lane < pos ? mine : lane == pos ? v : up;
                if (lane >= p.k) mine = 0ull;
                thr = __shfl_sync(full, mine, p.k - 1);
            }
        }
    }
    if (!p.last) {
        if (lane < p.k) p.keys[(size_t)w * p.k + lane] = mine;
    } else if (lane < p.k) {
        p.values[(size_t)row * p.k + lane] = topk_value((uint32_t)(mine >> 32));
        p.indices[(size_t)row * p.k + lane] = 0xffffffffu - (uint32_t)mine;
    }
}

#define TOPK_WARP_KERNEL(NAME, T, PAIRS)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * TOPK_WARP_WARPS) topk_warp_##NAME(const TopkWarpParams p) { \
        topk_warp<T, PAIRS>(p);                                                                              \
    }
TOPK_WARP_KERNEL(f32, float, false)
TOPK_WARP_KERNEL(f16, __half, false)
TOPK_WARP_KERNEL(bf16, __nv_bfloat16, false)
TOPK_WARP_KERNEL(pairs, float, true)
