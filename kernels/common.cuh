// The problem every MaxSim kernel solves (mirrors src/layout.rs), and the
// small vocabulary the kernels are written in: element types (elem.cuh),
// reductions (reduce.cuh), copies and tile layouts (copy.cuh), tensor-core
// MMA (mma.cuh).
#pragma once
#include "elem.cuh"
#include "reduce.cuh"
#include "copy.cuh"
#include "mma.cuh"

// f(std::integral_constant<int, I>{}) for I = 0, ..., N - 1 while f returns
// true; whether all N did. An unrolled loop whose index is a constant
// expression (register arrays indexed by it stay in registers whatever the
// unroller decides) and whose early exit is a plain branch.
template <int I, int N> struct StaticWhile {
    template <typename F> static __device__ __forceinline__ bool run(F& f) {
        if constexpr (I < N) {
            if (!f(std::integral_constant<int, I>{})) return false;
            return StaticWhile<I + 1, N>::run(f);
        } else {
            return true;
        }
    }
};
template <int N, typename F> __device__ __forceinline__ bool static_while(F&& f) { return StaticWhile<0, N>::run(f); }

// ---------------------------------------------------------------------------
// The problem, identical for every layout (mirrors src/layout.rs):
// queries are row ranges of a packed Q [Tq, dim], documents row ranges of a
// packed D [Td, dim]; either the cross product of all queries and documents
// or an explicit list of pairs is scored. Passed by value to every kernel.
// ---------------------------------------------------------------------------
struct MaxSimParams {
    const void* q;            // [Tq, dim] packed rows
    const void* d;            // [Td, dim]
    const uint8_t* q_valid;   // [Tq] row validity, or null (all valid)
    const uint8_t* d_valid;   // [Td], or null
    const uint32_t* cu_q;     // [Nq+1] offsets, or null: uniform length lq
    const uint32_t* cu_d;     // [Nd+1] offsets, or null: uniform length ld
    const uint32_t* q_groups; // [n_groups+1] first query of each group, or null: uniform groups
    const uint32_t* pair_q;   // [P] (list mode), or null: cross product
    const uint32_t* pair_d;   // [P]
    float* out;               // [P] scores (cross: P = Nq * Nd, pair i*Nd + j)
    int32_t* argmax;          // [P, max_lq] winning doc-local token, -1 = none; or null
    int32_t nq, nd, lq, ld;
    int32_t dim, max_lq;
    int32_t n_groups, group_size; // query groups (uniform groups: group_size queries each)
    int32_t n_pairs;              // list mode: number of pairs
    int32_t docs_per_block;       // cross mode: documents per block
    int32_t vec_ok;               // rows are 16-byte aligned (dim % 8 == 0, aligned base)
    // PLAID-compressed documents (the *_res kernels; `d` unused): token t is
    // centroids[codes[t]] + bucket_weights[bucket(t, k)] per feature k.
    const void* res_centroids;    // [n_centroids, dim] in the query dtype
    const float* res_buckets;     // [2^nbits] bucket weights
    const uint32_t* res_codes;    // [Td] centroid of each token (validated on the host)
    const uint8_t* res_residuals; // [Td, dim * nbits / 8] packed bucket indices
    int32_t res_nbits;            // 2, 4 or 8
    int32_t res_colbert_order;    // 1: ColBERTv2 / fast-plaid bit order, 0: LSB-first
    int32_t res_normalize;        // L2-normalize each decompressed token
    int32_t argmax_i16;           // `argmax` holds int16 (every document under 32768 rows: half the bytes)
    // 8-bit rows (the maxsim_mma_i8 kernels): one F32 scale per token.
    const float* q_scales;        // [Tq]
    const float* d_scales;        // [Td]
    // Packed argmax on wgmma tiles: from this doc-local column on, a tile is
    // scanned only where some row's maximum rises (0: never).
    int32_t lazy_cols;
};

// The saved argmax, int16 or int32 (MaxSimParams::argmax_i16).
__device__ __forceinline__ void argmax_store(const MaxSimParams& p, size_t k, int v) {
    if (p.argmax_i16) reinterpret_cast<int16_t*>(p.argmax)[k] = (int16_t)v;
    else p.argmax[k] = v;
}
__device__ __forceinline__ int argmax_load(const MaxSimParams& p, size_t k) {
    return p.argmax_i16 ? (int)reinterpret_cast<const int16_t*>(p.argmax)[k] : p.argmax[k];
}

struct Range { int32_t begin, end; };

__device__ __forceinline__ Range q_rows(const MaxSimParams& p, int i) {
    if (p.cu_q) return {(int32_t)p.cu_q[i], (int32_t)p.cu_q[i + 1]};
    return {i * p.lq, (i + 1) * p.lq};
}
__device__ __forceinline__ Range d_rows(const MaxSimParams& p, int j) {
    if (p.cu_d) return {(int32_t)p.cu_d[j], (int32_t)p.cu_d[j + 1]};
    return {j * p.ld, (j + 1) * p.ld};
}

// The block's work: queries [q_begin, q_end) against its documents.
// Cross mode: a document chunk; list mode: one pair.
struct BlockWork {
    int32_t q_begin, q_end;
    int32_t d_begin, d_end; // cross: doc range; list: the pair's doc (d_begin, d_begin + 1)
    int32_t pair;           // list mode: the pair index; cross: -1
};

__device__ __forceinline__ BlockWork block_work(const MaxSimParams& p, int b) {
    BlockWork w;
    if (p.pair_q) {
        w.q_begin = p.pair_q[b];
        w.q_end = w.q_begin + 1;
        w.d_begin = p.pair_d[b];
        w.d_end = w.d_begin + 1;
        w.pair = b;
        return w;
    }
    // Chunk-major order: blocks running together share a document chunk (L2 reuse).
    const int g = b % p.n_groups, c = b / p.n_groups;
    if (p.q_groups) {
        w.q_begin = p.q_groups[g];
        w.q_end = p.q_groups[g + 1];
    } else {
        w.q_begin = g * p.group_size;
        w.q_end = min(w.q_begin + p.group_size, p.nq);
    }
    w.d_begin = c * p.docs_per_block;
    w.d_end = min(w.d_begin + p.docs_per_block, p.nd);
    w.pair = -1;
    return w;
}

__device__ __forceinline__ int out_index(const MaxSimParams& p, const BlockWork& w, int i, int j) {
    return w.pair >= 0 ? w.pair : i * p.nd + j;
}

