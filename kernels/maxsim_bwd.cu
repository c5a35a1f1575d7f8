// MaxSim backward from the argmax the forward saved: only the winning
// document token of each (pair, query token) receives gradient.
//
//   grad_Q[i,s] = sum_j g[i,j] * D[j, argmax[i,j,s]]
//   grad_D[j,t] = sum over (i,s) with argmax[i,j,s] = t of g[i,j] * Q[i,s]
//
// Both kernels are destination-owned: every output row is reduced by the one
// warp or block that owns it, in a fixed order, with f32 (f64 for f64)
// accumulators in registers / shared memory, and written once in the input
// dtype. No atomics, no full-size f32 buffer, bitwise deterministic.
#include "common.cuh"

template <typename T> struct Store;
template <> struct Store<__half> {
    static __device__ __forceinline__ __half from(float x) { return __float2half(x); }
};
template <> struct Store<__nv_bfloat16> {
    static __device__ __forceinline__ __nv_bfloat16 from(float x) { return __float2bfloat16(x); }
};
template <> struct Store<float> {
    static __device__ __forceinline__ float from(float x) { return x; }
};
template <> struct Store<double> {
    static __device__ __forceinline__ double from(double x) { return x; }
};

struct BwdParams {
    MaxSimParams f;           // the forward's problem (f.argmax: the saved argmax)
    const float* g;           // [P] gradient of the scores
    void* gq;                 // [Tq, dim] out
    void* gd;                 // [Td, dim] out
    const uint32_t* by_q_off; // list mode: pairs of each query, CSR (null in cross mode)
    const uint32_t* by_q;
    const uint32_t* by_d_off; // list mode: pairs of each document, CSR
    const uint32_t* by_d;
    int32_t tq, tc;           // query rows; document rows per grad_D block
    int32_t d_chunks;         // grad_D blocks per document
    int32_t cols;             // grad_D columns per pass: dim rounded up to 32, at most BWD_COLS
};

constexpr int BWD_WARPS = 4;
constexpr int BWD_COLS = 256;                // columns per pass (8 per lane)
// grad_D accumulators: BWD_WARPS x tc x cols in shared memory, 48 KB (tc =
// 24 for dim 128 with f32 accumulation), so no opt-in is needed.
constexpr int BWD_PER_LANE = BWD_COLS / 32;

// Query of packed row r: uniform arithmetic, or a binary search of cu_q.
__device__ __forceinline__ int query_of_row(const MaxSimParams& p, int r) {
    if (!p.cu_q) return r / p.lq;
    int lo = 0, hi = p.nq; // cu_q[lo] <= r < cu_q[hi]
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if ((int)p.cu_q[mid] <= r) lo = mid;
        else hi = mid;
    }
    return lo;
}

// The k-th pair (ascending) of query i / of document j, and how many there are.
__device__ __forceinline__ int n_pairs_of_q(const BwdParams& b, int i) {
    return b.by_q_off ? (int)(b.by_q_off[i + 1] - b.by_q_off[i]) : b.f.nd;
}
__device__ __forceinline__ int pair_of_q(const BwdParams& b, int i, int k) {
    return b.by_q_off ? (int)b.by_q[b.by_q_off[i] + k] : i * b.f.nd + k;
}
__device__ __forceinline__ int n_pairs_of_d(const BwdParams& b, int j) {
    return b.by_d_off ? (int)(b.by_d_off[j + 1] - b.by_d_off[j]) : b.f.nq;
}
__device__ __forceinline__ int pair_of_d(const BwdParams& b, int j, int k) {
    return b.by_d_off ? (int)b.by_d[b.by_d_off[j] + k] : k * b.f.nd + j;
}

// grad_Q: one warp per query row, lanes across the embedding columns.
template <typename T, typename Acc>
__device__ void maxsim_bwd_dq(const BwdParams& b) {
    const MaxSimParams& p = b.f;
    const T* D = static_cast<const T*>(p.d);
    T* GQ = static_cast<T*>(b.gq);
    const int lane = threadIdx.x % 32;
    const int r = blockIdx.x * BWD_WARPS + threadIdx.x / 32;
    if (r >= b.tq) return;
    const int i = query_of_row(p, r);
    const int s = r - q_rows(p, i).begin;
    const int np = n_pairs_of_q(b, i);
    for (int k0 = 0; k0 < p.dim; k0 += BWD_COLS) {
        Acc acc[BWD_PER_LANE];
#pragma unroll
        for (int u = 0; u < BWD_PER_LANE; ++u) acc[u] = 0;
        for (int k = 0; k < np; ++k) {
            const int pair = pair_of_q(b, i, k);
            const int t = p.argmax[(size_t)pair * p.max_lq + s];
            if (t < 0) continue;
            const int j = p.pair_d ? (int)p.pair_d[pair] : pair % p.nd;
            const Acc gv = b.g[pair];
            const T* row = D + (size_t)(d_rows(p, j).begin + t) * p.dim + k0;
#pragma unroll
            for (int u = 0; u < BWD_PER_LANE; ++u) {
                const int col = lane + 32 * u;
                if (k0 + col < p.dim) acc[u] += gv * (Acc)Elem<T>::to_float(row[col]);
            }
        }
#pragma unroll
        for (int u = 0; u < BWD_PER_LANE; ++u) {
            const int col = k0 + lane + 32 * u;
            if (col < p.dim) GQ[(size_t)r * p.dim + col] = Store<T>::from(acc[u]);
        }
    }
}

// grad_D: one block per (document, chunk of tc rows). Warp w scans its share
// of the document's pairs 32 query tokens at a time; hits (winners inside the
// chunk) are found by ballot and added, whole warp across the columns, into
// the warp's own shared-memory accumulator; the warps' accumulators are then
// summed in order. Fixed order everywhere: deterministic.
template <typename T, typename Acc>
__device__ void maxsim_bwd_dd(const BwdParams& b) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Acc* acc = reinterpret_cast<Acc*>(smem_raw); // [BWD_WARPS][tc][cols]
    const MaxSimParams& p = b.f;
    const T* Q = static_cast<const T*>(p.q);
    T* GD = static_cast<T*>(b.gd);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int j = blockIdx.x / b.d_chunks;
    const Range dr = d_rows(p, j);
    const int t0 = (blockIdx.x % b.d_chunks) * b.tc;
    const int rows = min(b.tc, dr.end - dr.begin - t0);
    if (rows <= 0) return;
    const int np = n_pairs_of_d(b, j);
    const int C = b.cols;
    Acc* mine = acc + (size_t)warp * b.tc * C;
    for (int k0 = 0; k0 < p.dim; k0 += C) {
        const int kn = min(C, p.dim - k0);
        for (int e = threadIdx.x; e < BWD_WARPS * b.tc * C; e += blockDim.x) acc[e] = 0;
        __syncthreads();
        for (int k = warp; k < np; k += BWD_WARPS) {
            const int pair = pair_of_d(b, j, k);
            const int i = p.pair_q ? (int)p.pair_q[pair] : pair / p.nd;
            const Range qr = q_rows(p, i);
            const Acc gv = b.g[pair];
            for (int s0 = 0; s0 < qr.end - qr.begin; s0 += 32) {
                const int s = s0 + lane;
                const int t = s < qr.end - qr.begin ? p.argmax[(size_t)pair * p.max_lq + s] : -1;
                unsigned hits = __ballot_sync(0xffffffffu, t >= t0 && t < t0 + rows);
                while (hits) {
                    const int l = __ffs(hits) - 1;
                    hits &= hits - 1;
                    const int tt = __shfl_sync(0xffffffffu, t, l) - t0;
                    const T* qrow = Q + (size_t)(qr.begin + s0 + l) * p.dim + k0;
                    for (int col = lane; col < kn; col += 32)
                        mine[tt * C + col] += gv * (Acc)Elem<T>::to_float(qrow[col]);
                }
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < rows * C; e += blockDim.x) {
            const int rr = e / C, col = e % C;
            if (col >= kn) continue;
            Acc v = 0;
#pragma unroll
            for (int w = 0; w < BWD_WARPS; ++w) v += acc[((size_t)w * b.tc + rr) * C + col];
            GD[(size_t)(dr.begin + t0 + rr) * p.dim + k0 + col] = Store<T>::from(v);
        }
        __syncthreads();
    }
}

#define MAXSIM_BWD(TNAME, T, ACC)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * BWD_WARPS) maxsim_bwd_dq_##TNAME(const BwdParams b) {  \
        maxsim_bwd_dq<T, ACC>(b);                                                                            \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * BWD_WARPS) maxsim_bwd_dd_##TNAME(const BwdParams b) {  \
        maxsim_bwd_dd<T, ACC>(b);                                                                            \
    }
MAXSIM_BWD(f16, __half, float)
MAXSIM_BWD(bf16, __nv_bfloat16, float)
MAXSIM_BWD(f32, float, float)
MAXSIM_BWD(f64, double, double)
