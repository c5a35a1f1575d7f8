// PLAID centroid-only approximate score (plaid_approx_score):
//     score[b] = sum_s max_{t < len_b} qcs[codes[b, t], s]
// One warp per document. The per-centroid query scores qcs [C, Lq] are small
// (8 MB at C = 65 536, Lq = 32) and stay in L2, so the kernel is bound by the
// gathers of qcs rows: each lane loads VEC consecutive query tokens of a row
// (16-byte loads when VEC = 4), G lanes cover G * VEC query tokens of one row,
// and the warp gathers R = 32 / G rows per load instruction. The running max
// per query token stays in registers; the R row groups are merged by shuffles
// and the query tokens summed by a warp reduction. Query lengths beyond
// G * VEC are processed in chunks of that many tokens.
//
// Invalid input never causes an out-of-bounds read: a document length above
// Ld is clamped to Ld and an out-of-range code is skipped; both are reported
// through `err` (read back once by the host, which turns them into an Err).
#include <stdint.h>

#define PLAID_NEG_INF (__int_as_float(0xff800000))
#define PLAID_WARPS 8
#define PLAID_BAD_CODE 0xffffffffu

// Mirrors `Params` in src/cuda/plaid.rs (same field order, C layout).
struct PlaidApproxParams {
    const float* qcs;          // [C, lq]
    const void* codes;         // [b, ld] uint32_t or int64_t
    const uint32_t* doc_lens;  // [b]
    float* out;                // [b]
    // err[0]: ~(first document whose length exceeds ld); err[1]: ~(first flat
    // index b * ld + t of an out-of-range code); 0 = no error. atomicMax of the
    // complement keeps the lowest index, which is the error the CPU op reports.
    unsigned long long* err;
    int64_t n_centroids;
    int32_t b, ld, lq;
};

__device__ __forceinline__ uint32_t checked_code(uint32_t c, int64_t n) {
    return (int64_t)c < n ? c : PLAID_BAD_CODE;
}
__device__ __forceinline__ uint32_t checked_code(int64_t c, int64_t n) {
    return c >= 0 && c < n ? (uint32_t)c : PLAID_BAD_CODE;
}

// VEC consecutive query tokens of one qcs row: a masked load (-inf when not
// `ok`) and a running max. Loads and maxes are separate steps so that a lane
// issues all its loads of a step before it waits for any of them.
template <int VEC> struct Row;
template <> struct Row<4> {
    using V = float4;
    static __device__ __forceinline__ V load(const float* row, int v, bool ok) {
        V x = make_float4(PLAID_NEG_INF, PLAID_NEG_INF, PLAID_NEG_INF, PLAID_NEG_INF);
        if (ok) x = __ldg(reinterpret_cast<const float4*>(row) + v);
        return x;
    }
    static __device__ __forceinline__ void max_into(float (&m)[4], const V& x) {
        m[0] = fmaxf(m[0], x.x);
        m[1] = fmaxf(m[1], x.y);
        m[2] = fmaxf(m[2], x.z);
        m[3] = fmaxf(m[3], x.w);
    }
};
template <> struct Row<1> {
    using V = float;
    static __device__ __forceinline__ V load(const float* row, int v, bool ok) {
        return ok ? __ldg(row + v) : PLAID_NEG_INF;
    }
    static __device__ __forceinline__ void max_into(float (&m)[1], const V& x) { m[0] = fmaxf(m[0], x); }
};

template <typename Code, int VEC, int G>
__device__ __forceinline__ void plaid_approx(const PlaidApproxParams& p) {
    constexpr int R = 32 / G;  // rows per warp-wide load
    constexpr int U = 8;       // loads in flight per lane: U * R tokens per step
    static_assert(U * R <= 32 && 32 % (U * R) == 0, "a step covers part of the 32 codes held by the warp");
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    const long long doc = (long long)blockIdx.x * PLAID_WARPS + (threadIdx.x >> 5);
    if (doc >= p.b) return;  // warp-uniform, like every branch around the shuffles below
    const uint32_t raw_len = p.doc_lens[doc];
    const int len = (int)min(raw_len, (uint32_t)p.ld);
    if (raw_len > (uint32_t)p.ld && lane == 0) atomicMax(&p.err[0], ~(unsigned long long)doc);
    if (len == 0) {
        if (lane == 0) p.out[doc] = 0.f;
        return;
    }
    const Code* codes = static_cast<const Code*>(p.codes) + doc * p.ld;
    const int nvec = p.lq / VEC;  // the host picks VEC = 4 only when lq % 4 == 0
    const int g = lane % G, r = lane / G;
    float total = 0.f;
    for (int v0 = 0; v0 < nvec; v0 += G) {
        const int v = v0 + g;
        const bool active = v < nvec;
        float m[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) m[i] = PLAID_NEG_INF;
        for (int t0 = 0; t0 < len; t0 += 32) {
            // 32 codes per coalesced load, validated once, broadcast by shuffles.
            const int t = t0 + lane;
            uint32_t c = PLAID_BAD_CODE;
            if (t < len) {
                c = checked_code(codes[t], p.n_centroids);
                if (c == PLAID_BAD_CODE && v0 == 0) atomicMax(&p.err[1], ~(unsigned long long)(doc * p.ld + t));
            }
            const int n = min(32, len - t0);
#pragma unroll
            for (int j0 = 0; j0 < 32; j0 += U * R) {
                if (j0 >= n) break;
                typename Row<VEC>::V x[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int j = j0 + u * R + r;
                    const uint32_t cj = __shfl_sync(full, c, j);
                    x[u] = Row<VEC>::load(p.qcs + (size_t)cj * p.lq, v, j < n && active && cj != PLAID_BAD_CODE);
                }
#pragma unroll
                for (int u = 0; u < U; ++u) Row<VEC>::max_into(m, x[u]);
            }
        }
        // Merge the R row groups: afterwards every group holds the max over all tokens.
#pragma unroll
        for (int off = G; off < 32; off <<= 1)
#pragma unroll
            for (int i = 0; i < VEC; ++i) m[i] = fmaxf(m[i], __shfl_xor_sync(full, m[i], off));
        if (active && r == 0)
#pragma unroll
            for (int i = 0; i < VEC; ++i) total += m[i];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(full, total, off);
    if (lane == 0) p.out[doc] = total;
}

#define PLAID_APPROX(CNAME, CODE, VEC, G)                                                               \
    extern "C" __global__ void __launch_bounds__(32 * PLAID_WARPS)                                       \
        plaid_approx_##CNAME##_v##VEC##_g##G(const PlaidApproxParams p) {                                \
        plaid_approx<CODE, VEC, G>(p);                                                                   \
    }
#define PLAID_APPROX_G(CNAME, CODE, VEC)                                                                 \
    PLAID_APPROX(CNAME, CODE, VEC, 8)                                                                    \
    PLAID_APPROX(CNAME, CODE, VEC, 16)                                                                   \
    PLAID_APPROX(CNAME, CODE, VEC, 32)

PLAID_APPROX_G(u32, uint32_t, 4)
PLAID_APPROX_G(u32, uint32_t, 1)
PLAID_APPROX_G(i64, int64_t, 4)
PLAID_APPROX_G(i64, int64_t, 1)
