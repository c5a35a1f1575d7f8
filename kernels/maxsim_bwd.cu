// MaxSim backward from the argmax the forward saved: only the winning
// document token of each (pair, query token) receives gradient.
//
//   grad_Q[i,s] = sum_j g[i,j] * D[j, argmax[i,j,s]]
//   grad_D[j,t] = sum over (i,s) with argmax[i,j,s] = t of g[i,j] * Q[i,s]
//
// Both are weighted gathers of rows. A warp owns one output row and walks
// its items (pairs for grad_Q, winners for grad_D) 32 at a time: the lanes
// resolve 32 items at once (one load per lane instead of a serial chain),
// then G lanes cover a row with 16-byte loads, 32/G items per warp step and
// U steps issued before any is used, so 8 rows are in flight per warp.
//
// LowMem: grad_Q by maxsim_bwd_q; grad_D by maxsim_bwd_dd, a block per
// (document, chunk of rows) with the chunk's accumulators in shared memory
// (see below). Destination-owned, fixed order, no atomics, no global scratch.
// Unified: maxsim_bwd_u, a warp per query row reads Q[i,s] once, gathers
// grad_Q as above and adds g * Q[i,s] into grad_D by f32 (f64) atomics,
// vector reductions on sm_90; f16 / bf16 accumulate in an f32 buffer that
// maxsim_bwd_cast narrows at the end.
#include "common.cuh"
#include <type_traits>

#define BWD_FULL 0xffffffffu

struct BwdParams {
    MaxSimParams f;           // the forward's problem (f.argmax: the saved argmax)
    const float* g;           // [P] gradient of the scores
    void* gq;                 // [Tq, dim] out
    void* gd;                 // [Td, dim] out
    float* gd_acc;            // Unified f16/bf16: [Td, dim] f32 accumulator (null: atomics go to gd)
    const uint32_t* by_q_off; // list mode: pairs of each query, CSR (null in cross mode)
    const uint32_t* by_q;
    const uint32_t* by_d_off; // list mode: pairs of each document, CSR
    const uint32_t* by_d;
    int64_t n_cast;           // elements narrowed by maxsim_bwd_cast
    int32_t tq;               // query rows
    int32_t tc;               // LowMem grad_D: document rows per block
    int32_t d_chunks;         // LowMem grad_D: blocks per document
    int32_t list_off;         // LowMem grad_D: byte offset of the hit lists in shared memory
};

constexpr int BWD_WARPS = 8; // warps per block of the query-row kernels

// ---------------------------------------------------------------------------
// Problem helpers
// ---------------------------------------------------------------------------

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
__device__ __forceinline__ int query_of_pair(const MaxSimParams& p, int pair) {
    return p.pair_q ? (int)p.pair_q[pair] : pair / p.nd;
}
__device__ __forceinline__ int doc_of_pair(const MaxSimParams& p, int pair) {
    return p.pair_d ? (int)p.pair_d[pair] : pair % p.nd;
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

// ---------------------------------------------------------------------------
// Row chunks: a lane holds C chunks of VEC consecutive columns of a row.
// VEC * sizeof(T) == 16 (one 16-byte load) on the vector path, VEC == 1 on
// the scalar path (dims that are not a multiple of 16 bytes, unaligned bases).
// ---------------------------------------------------------------------------
template <typename T> struct Bits;
template <> struct Bits<__half> { using type = unsigned short; };
template <> struct Bits<__nv_bfloat16> { using type = unsigned short; };
template <> struct Bits<float> { using type = float; };
template <> struct Bits<double> { using type = double; };

template <typename T, int VEC> struct RawOf { using type = uint4; };
template <typename T> struct RawOf<T, 1> { using type = typename Bits<T>::type; };

template <typename T, int VEC>
__device__ __forceinline__ typename RawOf<T, VEC>::type load_raw(const T* p) {
    using R = typename RawOf<T, VEC>::type;
    return __ldg(reinterpret_cast<const R*>(p));
}

// Element v of a raw chunk as Acc (v is a compile-time constant after unrolling).
template <typename T, typename Acc> struct Unpack;
template <> struct Unpack<__half, float> {
    static __device__ __forceinline__ float one(unsigned short x, int) { return __half2float(__ushort_as_half(x)); }
    static __device__ __forceinline__ float vec(const uint4& u, int v) {
        const uint32_t word = (v >> 1) == 0 ? u.x : (v >> 1) == 1 ? u.y : (v >> 1) == 2 ? u.z : u.w;
        return __half2float(__ushort_as_half((unsigned short)((v & 1) ? word >> 16 : word & 0xffffu)));
    }
};
template <> struct Unpack<__nv_bfloat16, float> {
    static __device__ __forceinline__ float one(unsigned short x, int) { return __uint_as_float((uint32_t)x << 16); }
    static __device__ __forceinline__ float vec(const uint4& u, int v) {
        const uint32_t word = (v >> 1) == 0 ? u.x : (v >> 1) == 1 ? u.y : (v >> 1) == 2 ? u.z : u.w;
        return __uint_as_float((v & 1) ? word & 0xffff0000u : word << 16);
    }
};
template <> struct Unpack<float, float> {
    static __device__ __forceinline__ float one(float x, int) { return x; }
    static __device__ __forceinline__ float vec(const uint4& u, int v) {
        return __uint_as_float(v == 0 ? u.x : v == 1 ? u.y : v == 2 ? u.z : u.w);
    }
};
template <> struct Unpack<double, double> {
    static __device__ __forceinline__ double one(double x, int) { return x; }
    static __device__ __forceinline__ double vec(const uint4& u, int v) {
        return v == 0 ? __hiloint2double((int)u.y, (int)u.x) : __hiloint2double((int)u.w, (int)u.z);
    }
};

template <typename T, typename Acc, int VEC>
__device__ __forceinline__ Acc unpack(const typename RawOf<T, VEC>::type& r, int v) {
    if constexpr (VEC == 1) return Unpack<T, Acc>::one(r, v);
    else return Unpack<T, Acc>::vec(r, v);
}

// Stores VEC accumulators as one chunk of T.
template <typename T, typename Acc, int VEC>
__device__ __forceinline__ void store_chunk(T* p, const Acc (&a)[VEC]) {
    if constexpr (VEC == 1) {
        *p = Elem<T>::from(a[0]);
    } else if constexpr (sizeof(T) == 2) {
        uint32_t w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = pack2<T>(a[2 * k], a[2 * k + 1]);
        *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    } else if constexpr (sizeof(T) == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(a[0], a[1], a[2], a[3]);
    } else {
        *reinterpret_cast<double2*>(p) = make_double2(a[0], a[1]);
    }
}

// dst[0..VEC) += x atomically (Unified grad_D); dst 16-byte aligned when VEC % 4 == 0.
template <int VEC>
__device__ __forceinline__ void red_add(float* dst, const float (&x)[VEC]) {
#if __CUDA_ARCH__ >= 900
    constexpr bool V4 = VEC % 4 == 0;
#else
    constexpr bool V4 = false;
#endif
    if constexpr (V4) {
#pragma unroll
        for (int k = 0; k < VEC; k += 4)
            asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst + k), "f"(x[k]), "f"(x[k + 1]),
                         "f"(x[k + 2]), "f"(x[k + 3])
                         : "memory");
    } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) atomicAdd(dst + k, x[k]);
    }
}
template <int VEC>
__device__ __forceinline__ void red_add(double* dst, const double (&x)[VEC]) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) atomicAdd(dst + k, x[k]);
}

// Lane layout of a row kernel: lane = h * G + c; h picks the item of a warp
// step (R = 32 / G of them), c the chunks c, c + G, ..., c + (C-1) G of the
// current column pass of COLS columns.
template <typename T_, typename Acc_, int VEC_, int G_, int C_>
struct Cfg {
    using T = T_;
    using Acc = Acc_;
    using Raw = typename RawOf<T_, VEC_>::type;
    static constexpr int VEC = VEC_, G = G_, C = C_;
    static constexpr int R = 32 / G_;
    // Items in flight per warp: 8 rows of 16-byte chunks (fewer chunks per item: more items).
    static constexpr int U = VEC_ == 1 ? (C_ <= 2 ? 8 : 4) : (C_ == 1 ? 8 / R : 4);
    static constexpr int COLS = G_ * C_ * VEC_;
};

// acc += sum over items k of w_k * X[row_k, pass columns], for the items in
// batches of 32 at first, first + step, ... (< n). res(k, row, w) resolves
// one item (leaves row < 0 when it contributes nothing); the lanes resolve
// a batch together and compact the live items into s_row / s_w (this warp's
// 32 slots). Fixed order for fixed inputs: each lane's sums and the final
// cross-slot reduction depend on the item list only.
// SCATTER (Unified): also gacc[row_k, pass columns] += w_k * qv atomically.
template <class K, bool SCATTER, class Res>
__device__ __forceinline__ void gather(const typename K::T* __restrict__ X, int dim, int col0, int first, int step,
                                       int n, const Res& res, typename K::Acc (&acc)[K::C][K::VEC], int* s_row,
                                       typename K::Acc* s_w, typename K::Acc* gacc,
                                       const typename K::Acc (&qv)[K::C][K::VEC]) {
    using Acc = typename K::Acc;
    const int lane = threadIdx.x % 32;
    const int h = lane / K::G, c = lane % K::G;
    for (int b0 = first; b0 < n; b0 += step) {
        int row = -1;
        Acc w = 0;
        if (b0 + lane < n) res(b0 + lane, row, w);
        const unsigned live = __ballot_sync(BWD_FULL, row >= 0);
        if (row >= 0) {
            const int pos = __popc(live & ((1u << lane) - 1));
            s_row[pos] = row;
            s_w[pos] = w;
        }
        __syncwarp();
        const int cnt = __popc(live);
        for (int e0 = 0; e0 < cnt; e0 += K::R * K::U) {
            typename K::Raw raw[K::U][K::C];
            int rr[K::U];
            Acc wv[K::U];
#pragma unroll
            for (int u = 0; u < K::U; ++u) {
                const int e = e0 + u * K::R + h;
                rr[u] = e < cnt ? s_row[e] : -1;
                wv[u] = e < cnt ? s_w[e] : Acc(0);
#pragma unroll
                for (int q = 0; q < K::C; ++q) {
                    const int col = col0 + (c + q * K::G) * K::VEC;
                    if (rr[u] >= 0 && col < dim) raw[u][q] = load_raw<typename K::T, K::VEC>(X + (size_t)rr[u] * dim + col);
                    else raw[u][q] = typename K::Raw{};
                }
            }
#pragma unroll
            for (int u = 0; u < K::U; ++u) {
                if (rr[u] < 0) continue;
#pragma unroll
                for (int q = 0; q < K::C; ++q) {
                    const int col = col0 + (c + q * K::G) * K::VEC;
                    if (col >= dim) continue;
#pragma unroll
                    for (int v = 0; v < K::VEC; ++v)
                        acc[q][v] += wv[u] * unpack<typename K::T, Acc, K::VEC>(raw[u][q], v);
                    if constexpr (SCATTER) {
                        Acc x[K::VEC];
#pragma unroll
                        for (int v = 0; v < K::VEC; ++v) x[v] = wv[u] * qv[q][v];
                        red_add<K::VEC>(gacc + (size_t)rr[u] * dim + col, x);
                    }
                }
            }
        }
        __syncwarp(); // the slots are rewritten by the next batch
    }
}

// Sums the R item slots of a warp (fixed butterfly: every lane gets the same bits).
template <class K>
__device__ __forceinline__ void reduce_slots(typename K::Acc (&acc)[K::C][K::VEC]) {
#pragma unroll
    for (int o = K::G; o < 32; o <<= 1)
#pragma unroll
        for (int q = 0; q < K::C; ++q)
#pragma unroll
            for (int v = 0; v < K::VEC; ++v) acc[q][v] += __shfl_xor_sync(BWD_FULL, acc[q][v], o);
}

// Lanes of slot 0 write the pass's columns of an output row.
template <class K>
__device__ __forceinline__ void store_row(typename K::T* out, int dim, int col0,
                                          const typename K::Acc (&acc)[K::C][K::VEC]) {
    const int lane = threadIdx.x % 32;
    if (lane >= K::G) return;
#pragma unroll
    for (int q = 0; q < K::C; ++q) {
        const int col = col0 + (lane + q * K::G) * K::VEC;
        if (col < dim) store_chunk<typename K::T, typename K::Acc, K::VEC>(out + col, acc[q]);
    }
}

template <class K>
__device__ __forceinline__ void zero_acc(typename K::Acc (&acc)[K::C][K::VEC]) {
#pragma unroll
    for (int q = 0; q < K::C; ++q)
#pragma unroll
        for (int v = 0; v < K::VEC; ++v) acc[q][v] = 0;
}

// ---------------------------------------------------------------------------
// grad_Q (LowMem) and the fused Unified kernel: one warp per query row r.
// ---------------------------------------------------------------------------
template <class K, bool UNIFIED>
__device__ void bwd_qrow(const BwdParams& b) {
    using T = typename K::T;
    using Acc = typename K::Acc;
    __shared__ int s_row[BWD_WARPS][32];
    __shared__ Acc s_w[BWD_WARPS][32];
    const MaxSimParams& p = b.f;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r = blockIdx.x * BWD_WARPS + warp;
    if (r >= b.tq) return; // warp-uniform; no block barrier below
    const T* D = static_cast<const T*>(p.d);
    const T* Q = static_cast<const T*>(p.q);
    T* GQ = static_cast<T*>(b.gq);
    Acc* gacc = UNIFIED ? (b.gd_acc ? reinterpret_cast<Acc*>(b.gd_acc) : static_cast<Acc*>(b.gd)) : nullptr;
    const int i = query_of_row(p, r);
    const int s = r - q_rows(p, i).begin;
    const int np = n_pairs_of_q(b, i);
    const auto res = [&](int k, int& row, Acc& w) {
        const int pair = pair_of_q(b, i, k);
        const int t = argmax_load(p, (size_t)pair * p.max_lq + s);
        if (t < 0) return;
        const Range dr = d_rows(p, doc_of_pair(p, pair));
        if (t >= dr.end - dr.begin) return;
        row = dr.begin + t;
        w = (Acc)b.g[pair];
    };
    const int c = lane % K::G;
    for (int col0 = 0; col0 < p.dim; col0 += K::COLS) {
        Acc acc[K::C][K::VEC], qv[K::C][K::VEC];
        zero_acc<K>(acc);
        zero_acc<K>(qv);
        if constexpr (UNIFIED) {
#pragma unroll
            for (int q = 0; q < K::C; ++q) {
                const int col = col0 + (c + q * K::G) * K::VEC;
                if (col >= p.dim) continue;
                const typename K::Raw raw = load_raw<T, K::VEC>(Q + (size_t)r * p.dim + col);
#pragma unroll
                for (int v = 0; v < K::VEC; ++v) qv[q][v] = unpack<T, Acc, K::VEC>(raw, v);
            }
        }
        gather<K, UNIFIED>(D, p.dim, col0, 0, 32, np, res, acc, s_row[warp], s_w[warp], gacc, qv);
        reduce_slots<K>(acc);
        store_row<K>(GQ + (size_t)r * p.dim, p.dim, col0, acc);
    }
}

// ---------------------------------------------------------------------------
// LowMem grad_D: one block per (document j, chunk of tc rows), accumulators
// for the chunk in shared memory ([tc][dim]), no global scratch. Rounds of:
//  fill:    warp w scans its contiguous share of the document's argmax
//           entries ((pair, s) order) and appends the hits (winner in the
//           chunk) to its own list, until the list is nearly full;
//  process: every warp walks all lists in warp order, stages the hits on
//           the rows it owns (row % DD_WARPS) and applies them 32 at a time,
//           one hit at a time across the row's columns (Q chunks of 8 hits
//           loaded together, every batch full).
// Each accumulator row is owned by one warp and updated in list order: bitwise
// deterministic, no atomics, and hot rows (many winners on one token) cost
// no more than cold ones.
// ---------------------------------------------------------------------------
constexpr int DD_WARPS = 8;
constexpr int DD_LIST = 512; // hits per warp list
constexpr int DD_FILL = 8;   // 32-entry steps whose loads are issued together

// Lane layout of the chunk kernel: a warp updates whole rows, lane l the
// columns l * VEC + 32 * VEC * k (VEC elements = 8 bytes on the vector path,
// 1 on the scalar path); U hits have their Q chunks loaded together.
template <typename T_, typename Acc_, int VEC_>
struct DCfg {
    using T = T_;
    using Acc = Acc_;
    static constexpr int VEC = VEC_, U = 8;
    // VEC accumulators of a row as one shared-memory access (conflict-free across the warp).
    struct alignas(sizeof(Acc_) * VEC_) Pack { Acc_ v[VEC_]; };
    struct alignas(sizeof(T_) * VEC_) Chunk { T_ v[VEC_]; };
};

// The raw type of a K::Chunk (8, 4 or 2 bytes), so that it moves as one access.
template <class K>
using ChunkBits = typename std::conditional<sizeof(typename K::Chunk) == 8, uint2,
                                            typename std::conditional<sizeof(typename K::Chunk) == 4, uint32_t,
                                                                      unsigned short>::type>::type;

// Shared-memory load / store of a 4-, 8- or 16-byte accumulator pack at a
// 32-bit shared address (held in a register, not recomputed per access).
// Volatile with a memory clobber: a batch may update the same row twice, so
// each store must land before the next load.
template <class P> __device__ __forceinline__ P lds(uint32_t a) {
    static_assert(sizeof(P) == 4 || sizeof(P) == 8 || sizeof(P) == 16, "pack size");
    P v;
    if constexpr (sizeof(P) == 16) {
        uint4 r;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a) : "memory");
        memcpy(&v, &r, 16);
    } else if constexpr (sizeof(P) == 8) {
        uint2 r;
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "r"(a) : "memory");
        memcpy(&v, &r, 8);
    } else {
        uint32_t r;
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(a) : "memory");
        memcpy(&v, &r, 4);
    }
    return v;
}
template <class P> __device__ __forceinline__ void sts(uint32_t a, const P& v) {
    if constexpr (sizeof(P) == 16) {
        uint4 r;
        memcpy(&r, &v, 16);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(r.x), "r"(r.y), "r"(r.z), "r"(r.w) : "memory");
    } else if constexpr (sizeof(P) == 8) {
        uint2 r;
        memcpy(&r, &v, 8);
        asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(a), "r"(r.x), "r"(r.y) : "memory");
    } else {
        uint32_t r;
        memcpy(&r, &v, 4);
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(a), "r"(r) : "memory");
    }
}

// One chunk of VEC elements of Q through the read-only path.
template <class K>
__device__ __forceinline__ typename K::Chunk load_chunk(const typename K::T* p) {
    const ChunkBits<K> r = __ldg(reinterpret_cast<const ChunkBits<K>*>(p));
    typename K::Chunk c;
    memcpy(&c, &r, sizeof(c));
    return c;
}
template <class K> __device__ __forceinline__ void store_chunk(typename K::T* p, const typename K::Chunk& c) {
    ChunkBits<K> r;
    memcpy(&r, &c, sizeof(c));
    *reinterpret_cast<ChunkBits<K>*>(p) = r;
}

// Entry (k, s) of document j (its k-th pair, query row s): the argmax slot,
// or -1 past the end of a packed query. Entries are counted in int (x =
// k * max_lq + s): the host checks that a document has fewer than 2^31.
__device__ __forceinline__ long long doc_entry(const BwdParams& b, int j, int k, int s) {
    const MaxSimParams& p = b.f;
    const int pair = pair_of_d(b, j, k);
    if (p.cu_q) {
        const int i = query_of_pair(p, pair);
        if (s >= (int)(p.cu_q[i + 1] - p.cu_q[i])) return -1;
    }
    return (long long)pair * p.max_lq + s;
}

template <class K>
__device__ void bwd_dchunk(const BwdParams& b) {
    using T = typename K::T;
    using Acc = typename K::Acc;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ int s_len[DD_WARPS];
    __shared__ uint2 s_stage[DD_WARPS][64]; // each warp's own hits awaiting a full batch
    const MaxSimParams& p = b.f;
    const int dim = p.dim, astride = p.dim;
    Acc* acc = reinterpret_cast<Acc*>(smem_raw);                     // [tc][dim]
    uint2* lists = reinterpret_cast<uint2*>(smem_raw + b.list_off); // [DD_WARPS][DD_LIST]: (row in chunk, entry)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned below = (1u << lane) - 1;
    const int j = blockIdx.x / b.d_chunks;
    const Range dr = d_rows(p, j);
    const int ld = dr.end - dr.begin;
    const int t0 = (blockIdx.x % b.d_chunks) * b.tc;
    const int tn = min(b.tc, ld - t0);
    if (tn <= 0) return; // block-uniform
    const T* Q = static_cast<const T*>(p.q);
    T* GD = static_cast<T*>(b.gd);
    for (int e = threadIdx.x; e < tn * astride; e += blockDim.x) acc[e] = 0;
    const int64_t n_entries = (int64_t)n_pairs_of_d(b, j) * p.max_lq;
    int x = (int)(n_entries * warp / DD_WARPS);
    const int x_end = (int)(n_entries * (warp + 1) / DD_WARPS);
    uint2* mine = lists + warp * DD_LIST;
    // This lane's columns of a row: lane_col + c * 32 * VEC for c < col_passes.
    const int lane_col = lane * K::VEC;
    const int col_passes = lane_col < dim ? (dim - lane_col + 32 * K::VEC - 1) / (32 * K::VEC) : 0;
    const uint32_t acc_lane = (uint32_t)__cvta_generic_to_shared(acc) + lane_col * (uint32_t)sizeof(Acc);
    bool more = true;
    while (more) {
        // Fill (the loop bounds are warp-uniform).
        int n = 0;
        while (x < x_end && n + 32 * DD_FILL <= DD_LIST) {
            int tv[DD_FILL]; // all loads first, then the tests: DD_FILL loads in flight
            // Entry x + lane as (pair k, row s), stepped by 32 without a division per entry.
            int k = (x + lane) / p.max_lq, sq = x + lane - k * p.max_lq;
#pragma unroll
            for (int u = 0; u < DD_FILL; ++u) {
                const int xx = x + u * 32 + lane;
                const long long a = xx < x_end ? doc_entry(b, j, k, sq) : -1;
                tv[u] = a >= 0 ? argmax_load(p, (size_t)a) : -1;
                sq += 32;
                if (sq >= p.max_lq) {
                    const int w = sq / p.max_lq;
                    k += w;
                    sq -= w * p.max_lq;
                }
            }
#pragma unroll
            for (int u = 0; u < DD_FILL; ++u) {
                // t0 + tn <= ld: a winner in the chunk is a valid document row.
                const int key = tv[u] >= t0 && tv[u] < t0 + tn ? tv[u] - t0 : -1;
                const unsigned live = __ballot_sync(BWD_FULL, key >= 0);
                if (key >= 0) mine[n + __popc(live & below)] = make_uint2(key, (uint32_t)(x + u * 32 + lane));
                n += __popc(live);
            }
            x += 32 * DD_FILL;
        }
        if (lane == 0) s_len[warp] = n;
        more = __syncthreads_or(x < x_end);
        // Process: all lists in warp order; warp w applies the hits on its
        // rows (row % DD_WARPS == w), one hit at a time across its columns,
        // so each accumulator row is updated by one warp in list order. The
        // warp's own hits are staged first and applied 32 at a time, so
        // every batch of U row loads is full (a 32-entry step of the lists
        // holds only ~32 / DD_WARPS of them, and each batch waits on its loads).
        uint2* stage = s_stage[warp];
        const uint32_t stage_s = (uint32_t)__cvta_generic_to_shared(stage);
        const uint32_t lists_lane = (uint32_t)__cvta_generic_to_shared(lists) + lane * (uint32_t)sizeof(uint2);
        int staged = 0;
        for (int w2 = 0; w2 <= DD_WARPS; ++w2) {
            const int len = w2 < DD_WARPS ? s_len[w2] : 0;
            const uint32_t list_s = lists_lane + w2 * DD_LIST * (uint32_t)sizeof(uint2);
            for (int b0 = 0; b0 < len || (w2 == DD_WARPS && staged > 0); b0 += 32) {
                if (w2 < DD_WARPS) {
                    uint2 h = make_uint2(0, 0);
                    if (b0 + lane < len) h = lds<uint2>(list_s + b0 * (uint32_t)sizeof(uint2));
                    const bool mine = b0 + lane < len && (h.x & (DD_WARPS - 1)) == (uint32_t)warp;
                    const unsigned own = __ballot_sync(BWD_FULL, mine);
                    if (mine) sts(stage_s + (staged + __popc(own & below)) * (uint32_t)sizeof(uint2), h);
                    staged += __popc(own);
                    __syncwarp();
                    if (staged < 32) continue;  // warp-uniform
                }
                // Apply stage[0 .. min(staged, 32)) in order. Lane l first
                // resolves hit l (its Q row, accumulator row and weight), so a
                // batch of U hits is U shuffles of ready operands.
                const int n_apply = min(staged, 32);
                const T* qp = Q;   // the hit's Q row
                uint32_t arow = 0; // byte offset of its accumulator row
                Acc gw = 0;
                if (lane < n_apply) {
                    const uint2 h = lds<uint2>(stage_s + lane * (uint32_t)sizeof(uint2));
                    const uint32_t k = h.y / (uint32_t)p.max_lq, s = h.y - k * (uint32_t)p.max_lq;
                    const int pair = pair_of_d(b, j, (int)k);
                    qp = Q + (size_t)(q_rows(p, query_of_pair(p, pair)).begin + (int)s) * dim;
                    arow = h.x * (uint32_t)(astride * sizeof(Acc));
                    gw = (Acc)b.g[pair];
                }
                // Keep the rest (fewer than 32) at the front of the stage.
                const int rest = staged - n_apply;
                const uint2 keep = lane < rest ? lds<uint2>(stage_s + (32 + lane) * (uint32_t)sizeof(uint2)) : make_uint2(0, 0);
                __syncwarp();
                if (lane < rest) sts(stage_s + lane * (uint32_t)sizeof(uint2), keep);
                staged = rest;
                __syncwarp();
                for (int u0 = 0; u0 < n_apply; u0 += K::U) { // warp-uniform
                    const T* rp[K::U];
                    uint32_t ra[K::U];
                    Acc rw[K::U];
#pragma unroll
                    for (int u = 0; u < K::U; ++u) { // u0 + u < 32: n_apply <= 32, U divides 32
                        rp[u] = reinterpret_cast<const T*>(
                                    __shfl_sync(BWD_FULL, reinterpret_cast<unsigned long long>(qp), u0 + u)) +
                                lane_col;
                        ra[u] = __shfl_sync(BWD_FULL, arow, u0 + u) + acc_lane;
                        rw[u] = __shfl_sync(BWD_FULL, gw, u0 + u);
                    }
                    const int nu = min(K::U, n_apply - u0);
                    for (int c = 0; c < col_passes; ++c) {
                        const int off = c * 32 * K::VEC; // elements past the lane's first column
                        typename K::Chunk x[K::U];
#pragma unroll
                        for (int u = 0; u < K::U; ++u)
                            if (u < nu) x[u] = load_chunk<K>(rp[u] + off);
#pragma unroll
                        for (int u = 0; u < K::U; ++u) {
                            if (u >= nu) break;
                            const uint32_t sa = ra[u] + off * (uint32_t)sizeof(Acc);
                            typename K::Pack v = lds<typename K::Pack>(sa);
#pragma unroll
                            for (int e = 0; e < K::VEC; ++e) v.v[e] += rw[u] * Elem<T>::to_float(x[u].v[e]);
                            sts(sa, v);
                        }
                    }
                }
            }
        }
        __syncthreads(); // lists are refilled
    }
    // Each warp writes whole rows, a lane its VEC-element chunks.
    for (int r = warp; r < tn; r += DD_WARPS) {
        T* grow = GD + (size_t)(dr.begin + t0 + r) * dim + lane_col;
        const uint32_t arow = acc_lane + (uint32_t)(r * astride * sizeof(Acc));
        for (int c = 0; c < col_passes; ++c) {
            const int off = c * 32 * K::VEC;
            const typename K::Pack v = lds<typename K::Pack>(arow + off * (uint32_t)sizeof(Acc));
            typename K::Chunk o;
#pragma unroll
            for (int e = 0; e < K::VEC; ++e) o.v[e] = Elem<T>::from(v.v[e]);
            store_chunk<K>(grow + off, o);
        }
    }
}

// Unified f16 / bf16: the f32 accumulator narrowed to the output dtype.
template <typename T>
__device__ void bwd_cast(const BwdParams& b) {
    const float* src = b.gd_acc;
    T* dst = static_cast<T*>(b.gd);
    const int64_t n = b.n_cast, n4 = n / 4;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t k = tid; k < n4; k += stride) {
        const float4 v = reinterpret_cast<const float4*>(src)[k];
        reinterpret_cast<uint2*>(dst)[k] = make_uint2(pack2<T>(v.x, v.y), pack2<T>(v.z, v.w));
    }
    for (int64_t k = 4 * n4 + tid; k < n; k += stride) dst[k] = Elem<T>::from(src[k]);
}

// ---------------------------------------------------------------------------
// Entry points. Query-row kernels maxsim_bwd_<q|u>_<dtype>_<variant>:
// vG / v64 read 16-byte chunks (G lanes per row, v64 = 32 lanes x 2 chunks),
// s2 / s8 single elements (32 lanes x 2 or 8 columns per pass). Chunk
// kernels maxsim_bwd_dd_<dtype>_<variant>: v = 8-byte chunks of Q per lane
// (dim a multiple of 8 bytes' elements, Q 8-byte aligned), s = single
// elements. The host picks from dim and alignment.
// ---------------------------------------------------------------------------
#define MAXSIM_BWD_QROW(TNAME, VNAME, T, ACC, VEC, G, C)                                                       \
    extern "C" __global__ void __launch_bounds__(32 * BWD_WARPS) maxsim_bwd_q_##TNAME##_##VNAME(               \
        const BwdParams b) {                                                                                   \
        bwd_qrow<Cfg<T, ACC, VEC, G, C>, false>(b);                                                            \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * BWD_WARPS) maxsim_bwd_u_##TNAME##_##VNAME(               \
        const BwdParams b) {                                                                                   \
        bwd_qrow<Cfg<T, ACC, VEC, G, C>, true>(b);                                                             \
    }
#define MAXSIM_BWD_DCHUNK(TNAME, VNAME, T, ACC, VEC)                                                           \
    extern "C" __global__ void __launch_bounds__(32 * DD_WARPS, 2) maxsim_bwd_dd_##TNAME##_##VNAME(               \
        const BwdParams b) {                                                                                   \
        bwd_dchunk<DCfg<T, ACC, VEC>>(b);                                                                      \
    }

#define MAXSIM_BWD_DTYPE(TNAME, T, ACC)                                  \
    MAXSIM_BWD_QROW(TNAME, v8, T, ACC, (16 / sizeof(T)), 8, 1)           \
    MAXSIM_BWD_QROW(TNAME, v16, T, ACC, (16 / sizeof(T)), 16, 1)         \
    MAXSIM_BWD_QROW(TNAME, v32, T, ACC, (16 / sizeof(T)), 32, 1)         \
    MAXSIM_BWD_QROW(TNAME, v64, T, ACC, (16 / sizeof(T)), 32, 2)         \
    MAXSIM_BWD_QROW(TNAME, s2, T, ACC, 1, 32, 2)                         \
    MAXSIM_BWD_QROW(TNAME, s8, T, ACC, 1, 32, 8)                         \
    MAXSIM_BWD_DCHUNK(TNAME, v, T, ACC, (8 / sizeof(T)))                 \
    MAXSIM_BWD_DCHUNK(TNAME, s, T, ACC, 1)

MAXSIM_BWD_DTYPE(f16, __half, float)
MAXSIM_BWD_DTYPE(bf16, __nv_bfloat16, float)
MAXSIM_BWD_DTYPE(f32, float, float)
MAXSIM_BWD_DTYPE(f64, double, double)

extern "C" __global__ void __launch_bounds__(256) maxsim_bwd_cast_f16(const BwdParams b) { bwd_cast<__half>(b); }
extern "C" __global__ void __launch_bounds__(256) maxsim_bwd_cast_bf16(const BwdParams b) {
    bwd_cast<__nv_bfloat16>(b);
}
