// PLAID centroid-only approximate score (plaid_approx_score):
//     score[b] = sum_s max_{t < len_b} qcs[codes[b, t], s]
// One warp per document. The per-centroid query scores qcs [C, Lq] are small
// (8 MB at C = 65 536, Lq = 32) and stay in L2, so the kernel is bound by the
// gathers of qcs rows (one 128-byte row per token at Lq = 32). Two kernels:
//  - plaid_rows: Lq a multiple of 4 up to 64 (groups of G = 4, 8 or 16 lanes,
//    the first Lq / 4 of which cover a row with 16-byte loads; R = 32 / G rows
//    per load instruction). Lean: no load needs a predicate or a default
//    value (see score_doc), a row address is one IMAD.WIDE, and a document's
//    length and first 32 codes are loaded together. At Lq 32 it takes 1.04x
//    the time of a bare gather of the same rows (54 vs 52 us, H200, 100 000
//    documents of 1..=64 codes, 65 536 centroids; bench/micro/plaid_gather.cu).
//  - plaid_approx: any Lq, in chunks of G * VEC query tokens.
//
// Invalid input never causes an out-of-bounds read: a document length above
// Ld is clamped to Ld; an out-of-range code reads row 0 in plaid_rows (the
// host runs it only when C > 0) and is skipped in plaid_approx.
// Either sets `*bad` (a flag in page-locked host memory, so the host reads it
// after the stream sync without a copy); the host then finds and reports the
// first bad value as the CPU op does.
#include "reduce.cuh"

#define PLAID_WARPS 8
#define PLAID_ROWS_WARPS 4
#define PLAID_BAD_CODE 0xffffffffu

// Mirrors `Params` in src/cuda/plaid_approx.rs (same field order, C layout).
struct PlaidApproxParams {
    const float* qcs;          // [C, lq]
    const void* codes;         // [b, ld] uint32_t or int64_t
    const uint32_t* doc_lens;  // [b]
    float* out;                // [b]
    unsigned int* bad;         // set to 1 on an invalid length or code
    int64_t n_centroids;
    int32_t b, ld, lq;
};

__device__ __forceinline__ uint32_t checked_code(uint32_t c, int64_t n) {
    return (int64_t)c < n ? c : PLAID_BAD_CODE;
}
__device__ __forceinline__ uint32_t checked_code(int64_t c, int64_t n) {
    return c >= 0 && c < n ? (uint32_t)c : PLAID_BAD_CODE;
}

// Codes are read once: stream them past L1 and mark them first to evict from
// L2, which keeps the score table there.
__device__ __forceinline__ uint32_t load_code_streaming(const uint32_t* p) { return __ldcs(p); }
__device__ __forceinline__ int64_t load_code_streaming(const int64_t* p) {
    return (int64_t)__ldcs(reinterpret_cast<const long long*>(p));
}

// Scores one document with Lq <= 4 * G against the score rows at `qcs`
// (row c of query token s at qcs + c * stride + s sizeof(S) bytes: [C, Lq] rows of
// one query, or a query's Lq columns of a [C, Nq·Lq] table). `c0`: lane l
// holds code l of the document as loaded (unchecked; any value where
// l >= min(len, 32)). Returns the score on every lane.
// Tokens are gathered 32 codes at a time: lane l of the warp holds code l,
// and load u of a batch has group r (lanes r*G .. r*G+G-1) gather the row of
// token j0 + u*R + r, G lanes of 16 bytes. Lanes past the document's end
// gather a copy of its last token (max is idempotent, and the copy is in the
// same load instruction, so it costs no L2 traffic); loads wholly past the end
// are skipped by a warp-uniform test. Lanes g >= Lq / 4 of a group load the
// group's last 16 bytes again (the same instruction again) and are left out
// of the sum. So no load is predicated per lane and no register needs a
// default value. With SKIP_EMPTY a query token whose max is -inf (every row
// of the document pruned) adds 0.
template <typename S> struct QcsRow;
// Four F32 scores: 16 bytes.
template <> struct QcsRow<float> {
    using V = float4;
    static __device__ __forceinline__ V load(const char* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
    static __device__ __forceinline__ V lowest() {
        return make_float4(MAXSIM_NEG_INF, MAXSIM_NEG_INF, MAXSIM_NEG_INF, MAXSIM_NEG_INF);
    }
    static __device__ __forceinline__ void max_into(V& m, const V& x) {
        m.x = fmaxf(m.x, x.x), m.y = fmaxf(m.y, x.y), m.z = fmaxf(m.z, x.z), m.w = fmaxf(m.w, x.w);
    }
    static __device__ __forceinline__ float4 to_float4(const V& m) { return m; }
};
// Four F16 scores: 8 bytes (half the gather traffic of F32, the same values
// where the table was computed in F16 and widened).
template <> struct QcsRow<__half> {
    using V = uint2;
    static __device__ __forceinline__ V load(const char* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
    static __device__ __forceinline__ V lowest() { return make_uint2(0xfc00fc00u, 0xfc00fc00u); }
    static __device__ __forceinline__ __half2 h2(uint32_t u) { return *reinterpret_cast<const __half2*>(&u); }
    static __device__ __forceinline__ uint32_t u32(__half2 h) { return *reinterpret_cast<const uint32_t*>(&h); }
    static __device__ __forceinline__ void max_into(V& m, const V& x) {
        m.x = u32(__hmax2(h2(m.x), h2(x.x)));
        m.y = u32(__hmax2(h2(m.y), h2(x.y)));
    }
    static __device__ __forceinline__ float4 to_float4(const V& m) {
        const float2 a = __half22float2(h2(m.x)), b = __half22float2(h2(m.y));
        return make_float4(a.x, a.y, b.x, b.y);
    }
};

template <typename Code, int G, bool FULL, bool SKIP_EMPTY, typename S = float>
__device__ __forceinline__ float score_doc(const S* qcs, uint32_t stride, int lq, const Code* codes, int len,
                                           Code c0, int64_t n_centroids, unsigned int* bad) {
    constexpr int R = 32 / G;             // rows per load instruction
    constexpr int U = R * 8 <= 32 ? 8 : 32 / R;  // loads in flight per lane
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    // FULL: Lq = 4 * G, every lane of a group has its own 16 bytes (the common
    // Lq 16 / 32 / 64: no clamp, no select).
    const int g = lane % G, r = lane / G, nv = FULL ? G : lq / 4;
    using Q = QcsRow<S>;
    const char* base = reinterpret_cast<const char*>(qcs) + (FULL ? g : min(g, nv - 1)) * 4 * sizeof(S);
    asm("mov.b64 %0, %0;" : "+l"(base));  // opaque, so a row address is one IMAD.WIDE on it
    typename Q::V mv = Q::lowest();
    for (int t0 = 0; t0 < len; t0 += 32) {
        const int n = min(32, len - t0);
        Code raw = c0;
        if (t0 > 0 && lane < n) raw = load_code_streaming(codes + t0 + lane);
        uint32_t c = 0;
        if (lane < n) {
            c = checked_code(raw, n_centroids);
            if (c == PLAID_BAD_CODE) {
                *bad = 1u;
                c = 0;
            }
        }
        c = __shfl_sync(full, c, min(lane, n - 1));
        for (int j0 = 0; j0 < n; j0 += U * R) {
            uint32_t cu[U];
#pragma unroll
            for (int u = 0; u < U; ++u) cu[u] = __shfl_sync(full, c, (j0 + u * R + r) & 31);
            typename Q::V x[U];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (j0 + u * R < n) x[u] = Q::load(base + (size_t)cu[u] * stride);
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (j0 + u * R < n) Q::max_into(mv, x[u]);
        }
    }
    const float4 mf = Q::to_float4(mv);
    float m0 = mf.x, m1 = mf.y, m2 = mf.z, m3 = mf.w;
    // Merge the R row groups, then sum the query tokens over the G lanes of a group.
    m0 = lane_max<32 - G>(m0), m1 = lane_max<32 - G>(m1), m2 = lane_max<32 - G>(m2), m3 = lane_max<32 - G>(m3);
    if (SKIP_EMPTY) {
        m0 = m0 > MAXSIM_NEG_INF ? m0 : 0.f, m1 = m1 > MAXSIM_NEG_INF ? m1 : 0.f;
        m2 = m2 > MAXSIM_NEG_INF ? m2 : 0.f, m3 = m3 > MAXSIM_NEG_INF ? m3 : 0.f;
    }
    return lane_sum<G>(FULL || g < nv ? (m0 + m1) + (m2 + m3) : 0.f);
}

// One document per warp; its length and its first 32 codes (all of them up to
// Ld, whatever the length) are loaded together, so the gathers wait on one
// DRAM round trip, not two.
template <typename Code, int G, bool FULL>
__device__ __forceinline__ void plaid_rows(const PlaidApproxParams& p) {
    const int lane = threadIdx.x & 31;
    const int doc = blockIdx.x * PLAID_ROWS_WARPS + (threadIdx.x >> 5);
    if (doc >= p.b) return;  // warp-uniform, like every branch around the shuffles
    const Code* codes = static_cast<const Code*>(p.codes) + (size_t)doc * p.ld;
    Code c0 = 0;
    if (lane < p.ld) c0 = load_code_streaming(codes + lane);
    const uint32_t raw_len = p.doc_lens[doc];
    const int len = (int)min(raw_len, (uint32_t)p.ld);
    if (raw_len > (uint32_t)p.ld) *p.bad = 1u;
    // FULL: a constant row stride (Lq = 4 * G floats).
    const uint32_t stride = FULL ? G * 16 : (uint32_t)p.lq * 4;
    const float total = score_doc<Code, G, FULL, false>(p.qcs, stride, p.lq, codes, len, c0, p.n_centroids, p.bad);
    if (lane == 0) p.out[doc] = len > 0 ? total : 0.f;
}

#define PLAID_ROWS_K(NAME, CODE, G, FULL)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * PLAID_ROWS_WARPS) NAME(const PlaidApproxParams p) { \
        plaid_rows<CODE, G, FULL>(p);                                                                    \
    }
#define PLAID_ROWS(CNAME, CODE, G)                                                                       \
    PLAID_ROWS_K(plaid_rows_##CNAME##_g##G, CODE, G, true)                                               \
    PLAID_ROWS_K(plaid_rows_##CNAME##_g##G##_part, CODE, G, false)
PLAID_ROWS(u32, uint32_t, 4)
PLAID_ROWS(u32, uint32_t, 8)
PLAID_ROWS(u32, uint32_t, 16)
PLAID_ROWS(i64, int64_t, 4)
PLAID_ROWS(i64, int64_t, 8)
PLAID_ROWS(i64, int64_t, 16)

// VEC consecutive query tokens of one qcs row: a masked load (-inf when not
// `ok`) and a running max. Loads and maxes are separate steps so that a lane
// issues all its loads of a step before it waits for any of them.
template <int VEC> struct Row;
template <> struct Row<4> {
    using V = float4;
    static __device__ __forceinline__ V load(const float* row, int v, bool ok) {
        V x = make_float4(MAXSIM_NEG_INF, MAXSIM_NEG_INF, MAXSIM_NEG_INF, MAXSIM_NEG_INF);
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
        return ok ? __ldg(row + v) : MAXSIM_NEG_INF;
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
    if (raw_len > (uint32_t)p.ld) *p.bad = 1u;
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
        for (int i = 0; i < VEC; ++i) m[i] = MAXSIM_NEG_INF;
        for (int t0 = 0; t0 < len; t0 += 32) {
            // 32 codes per coalesced load, validated once, broadcast by shuffles.
            const int t = t0 + lane;
            uint32_t c = PLAID_BAD_CODE;
            if (t < len) {
                c = checked_code(codes[t], p.n_centroids);
                if (c == PLAID_BAD_CODE) *p.bad = 1u;
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
        for (int i = 0; i < VEC; ++i) m[i] = lane_max<32 - G>(m[i]);
        if (active && r == 0)
#pragma unroll
            for (int i = 0; i < VEC; ++i) total += m[i];
    }
    total = warp_sum(total);
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

// ---------------------------------------------------------------------------
// The candidate stage of a PLAID search over a packed index (documents are
// row ranges cu_d[j] .. cu_d[j+1] of the codes), for a batch of queries:
//  - plaid_candidates: for each (query, probed centroid), the documents of
//    the centroid's inverted list become the query's candidates, bits of a
//    [nq, words] bitmap (zeroed by the host);
//  - plaid_approx_candidates: the approximate score of every candidate
//    against its query's columns of one [C, nq * lq] score table, -inf for
//    every other document, as a dense [nq, nd] matrix for topk_rows.
// Malformed inverted files, offsets, codes or candidate ids never cause an
// out-of-bounds access: they are clamped or skipped and set `*bad` to the
// number of the argument at fault (PLAID_BAD_* below).
// ---------------------------------------------------------------------------

#define PLAID_BAD_PROBES 1u
#define PLAID_BAD_IVF_OFFSETS 2u
#define PLAID_BAD_IVF 3u
#define PLAID_BAD_CODES 4u
#define PLAID_BAD_CU_D 5u
#define PLAID_BAD_CANDIDATES 6u
#define PLAID_BAD_DOCS 7u

// Mirrors `CandParams` in src/cuda/plaid_approx.rs (same field order, C layout).
struct PlaidCandParams {
    const uint32_t* probes;  // [nq, n_probe] centroid ids (0xffffffff: none)
    const uint32_t* ivf;     // [n_ivf] document ids, the lists back to back
    const uint32_t* ivf_off; // [n_centroids + 1] list offsets
    const void* qcs;         // [n_centroids, nq * lq] float or __half
    const void* codes;       // [n_codes] uint32_t or int64_t
    const uint32_t* cu_d;    // [nd + 1] document offsets into the codes
    uint32_t* bitmap;        // [nq, words] candidates
    const uint32_t* mask;    // [mask_rows, words] documents allowed, or null: all
    float* out;              // [nq, nd]
    unsigned int* bad;
    long long n_centroids, n_ivf, n_codes;
    int32_t nq, n_probe, nd, words, lq, mask_rows;
};

extern "C" __global__ void plaid_candidates(const PlaidCandParams p) {
    const int lane = threadIdx.x & 31;
    const long long nw = (long long)gridDim.x * blockDim.x / 32;
    for (long long task = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; task < (long long)p.nq * p.n_probe;
         task += nw) {
        const int i = (int)(task / p.n_probe);
        const uint32_t c = p.probes[task];
        if (c == 0xffffffffu) continue; // NO_CENTROID: nothing probed (warp-uniform)
        if ((long long)c >= p.n_centroids) {
            if (lane == 0) *p.bad = PLAID_BAD_PROBES;
            continue;
        }
        const long long lo = min((long long)p.ivf_off[c], p.n_ivf);
        const long long hi = min(max((long long)p.ivf_off[c + 1], lo), p.n_ivf);
        if (lane == 0 && (hi != (long long)p.ivf_off[c + 1] || lo != (long long)p.ivf_off[c]))
            *p.bad = PLAID_BAD_IVF_OFFSETS;
        uint32_t* row = p.bitmap + (size_t)i * p.words;
        for (long long e = lo + lane; e < hi; e += 32) {
            const uint32_t d = p.ivf[e];
            if (d < (uint32_t)p.nd) atomicOr(row + d / 32, 1u << (d % 32));
            else *p.bad = PLAID_BAD_IVF;
        }
    }
}

// plaid_subset_centroids: the centroids the tokens of the listed documents
// use, as an [n_centroids] byte mask (zeroed by the host), for a filtered
// search to probe only those (fast-plaid's subset rule). A warp per listed
// document; racing stores all write 1.
// Mirrors `SubsetParams` in src/cuda/plaid_approx.rs (same field order, C layout).
struct PlaidSubsetParams {
    const uint32_t* docs;  // [n_docs] document ids, any order
    const uint32_t* cu_d;  // [nd + 1] document offsets into the codes (checked by the host)
    const uint32_t* codes; // [n_codes]
    uint8_t* mask;         // [n_centroids]
    unsigned int* bad;
    long long n_centroids, n_codes;
    int32_t n_docs, nd;
};

extern "C" __global__ void plaid_subset_centroids(const PlaidSubsetParams p) {
    const int lane = threadIdx.x & 31;
    const long long nw = (long long)gridDim.x * blockDim.x / 32;
    for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; i < p.n_docs; i += nw) {
        const uint32_t d = p.docs[i];
        if (d >= (uint32_t)p.nd) {
            if (lane == 0) *p.bad = PLAID_BAD_DOCS;
            continue;
        }
        const long long lo = min((long long)p.cu_d[d], p.n_codes);
        const long long hi = min((long long)p.cu_d[d + 1], p.n_codes);
        for (long long t = lo + lane; t < hi; t += 32) {
            const uint32_t c = p.codes[t];
            if ((long long)c < p.n_centroids) p.mask[c] = 1;
            else *p.bad = PLAID_BAD_CODES;
        }
    }
}

// A warp per 32-document word of one query's bitmap; the candidates of the
// word in turn, each scored by score_doc on the query's columns of qcs.
template <typename Code, int G, bool FULL, typename S>
__device__ __forceinline__ void plaid_approx_candidates(const PlaidCandParams& p) {
    const int lane = threadIdx.x & 31;
    const long long nw = (long long)gridDim.x * blockDim.x / 32;
    const uint32_t stride = (uint32_t)p.nq * p.lq * sizeof(S);
    for (long long task = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; task < (long long)p.nq * p.words;
         task += nw) {
        const int i = (int)(task / p.words), w = (int)(task % p.words);
        uint32_t bits = p.bitmap[task];
        if (p.mask) bits &= p.mask[(size_t)(p.mask_rows == 1 ? 0 : i) * p.words + w];
        float* out = p.out + (size_t)i * p.nd;
        const int j0 = w * 32;
        if (j0 + lane < p.nd && !((bits >> lane) & 1u)) out[j0 + lane] = MAXSIM_NEG_INF;
        const S* qcs = static_cast<const S*>(p.qcs) + (size_t)i * p.lq;
        while (bits) {
            const int j = j0 + __ffs(bits) - 1;
            bits &= bits - 1;
            if (j >= p.nd) {
                if (lane == 0) *p.bad = PLAID_BAD_CANDIDATES;
                continue;
            }
            const long long start = min((long long)p.cu_d[j], p.n_codes);
            const long long end = min(max((long long)p.cu_d[j + 1], start), p.n_codes);
            if (lane == 0 && (end != (long long)p.cu_d[j + 1] || start != (long long)p.cu_d[j])) *p.bad = PLAID_BAD_CU_D;
            const int len = (int)min(end - start, (long long)INT32_MAX);
            const Code* codes = static_cast<const Code*>(p.codes) + start;
            Code c0 = 0;
            if (lane < len) c0 = load_code_streaming(codes + lane);
            unsigned int code_bad = 0u;
            const float total =
                score_doc<Code, G, FULL, true, S>(qcs, stride, p.lq, codes, len, c0, p.n_centroids, &code_bad);
            if (code_bad) *p.bad = PLAID_BAD_CODES;
            if (lane == 0) out[j] = len > 0 ? total : 0.f;
        }
    }
}

#define PLAID_CAND_K(NAME, CODE, G, FULL, S)                                                              \
    extern "C" __global__ void __launch_bounds__(256) NAME(const PlaidCandParams p) {                       \
        plaid_approx_candidates<CODE, G, FULL, S>(p);                                                       \
    }
#define PLAID_CAND(CNAME, CODE, G)                                                                        \
    PLAID_CAND_K(plaid_approx_candidates_##CNAME##_g##G, CODE, G, true, float)                            \
    PLAID_CAND_K(plaid_approx_candidates_##CNAME##_g##G##_part, CODE, G, false, float)                    \
    PLAID_CAND_K(plaid_approx_candidates_f16_##CNAME##_g##G, CODE, G, true, __half)                       \
    PLAID_CAND_K(plaid_approx_candidates_f16_##CNAME##_g##G##_part, CODE, G, false, __half)
PLAID_CAND(u32, uint32_t, 4)
PLAID_CAND(u32, uint32_t, 8)
PLAID_CAND(u32, uint32_t, 16)
PLAID_CAND(i64, int64_t, 4)
PLAID_CAND(i64, int64_t, 8)
PLAID_CAND(i64, int64_t, 16)
