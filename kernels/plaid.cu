// PLAID centroid-only approximate score (plaid_approx_score):
//     score[b] = sum_s max_{t < len_b} qcs[codes[b, t], s]
// One warp per document. The per-centroid query scores qcs [C, Lq] are small
// (8 MB at C = 65 536, Lq = 32) and stay in L2, so the work is the gathers of
// qcs rows by code. Two strategies:
//
// * gather: each lane loads VEC consecutive query tokens of a row (16-byte
//   loads when VEC = 4), G lanes cover G * VEC query tokens of one row, and
//   the warp gathers R = 32 / G rows per load instruction. The running max per
//   query token stays in registers; the R row groups are merged by shuffles and
//   the query tokens summed by a warp reduction. Query lengths beyond G * VEC
//   are processed in chunks of that many tokens.
//
// * filter (large batches): two small kernels first quantize qcs to one byte
//   per score with a monotone map (an affine map of the table's range, floored),
//   so a row is one 32-byte sector instead of four at Lq = 32. The warp takes
//   the byte-wise max per query token over the document (packed byte max), and
//   since the map is monotone the exact f32 max is the max over the tokens
//   whose byte equals that max: only those (about one per query token) are read
//   from the f32 table. The result is the f32 max itself, not an approximation.
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
    uint8_t* qcs8;             // filter: [C, stride8] quantized qcs, zero past lq
    const void* codes;         // [b, ld] uint32_t or int64_t
    const uint32_t* doc_lens;  // [b]
    float* out;                // [b]
    // err[0]: ~(first document whose length exceeds ld); err[1]: ~(first flat
    // index b * ld + t of an out-of-range code); 0 = no error. atomicMax of the
    // complement keeps the lowest index, which is the error the CPU op reports.
    unsigned long long* err;
    int64_t n_centroids;
    int32_t b, ld, lq;
    int32_t stride8;  // filter: bytes per quantized row, a multiple of 16
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

// ---------------------------------------------------------------- gather

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

// ---------------------------------------------------------------- filter

#define PLAID_POS_INF (__int_as_float(0x7f800000))
#define PLAID_FILTER_T 64  // most tokens per chunk of the filter kernel
#define PLAID_LIST 128     // hit slots per warp (about one hit per query token is typical)
#define PLAID_PREP_THREADS 256

// (min, max) over the block of each thread's (lo, hi); NaNs are ignored.
__device__ __forceinline__ float2 block_min_max(float lo, float hi) {
    __shared__ float2 part[PLAID_PREP_THREADS / 32];
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(full, lo, off));
        hi = fmaxf(hi, __shfl_xor_sync(full, hi, off));
    }
    if (lane == 0) part[warp] = make_float2(lo, hi);
    __syncthreads();
    float2 r = part[0];
    for (int w = 1; w < PLAID_PREP_THREADS / 32; ++w) r = make_float2(fminf(r.x, part[w].x), fmaxf(r.y, part[w].y));
    return r;
}

// A byte per score, monotone non-decreasing in x: each step (subtracting a
// constant, scaling by a non-negative constant, floor, clamp) is monotone
// under round-to-nearest, so a larger byte always means a larger score.
__device__ __forceinline__ uint32_t quantize(float x, float lo, float scale) {
    return (uint32_t)fminf(fmaxf(floorf((x - lo) * scale), 0.f), 255.f);
}

// Step 1: qcs8[c, s] = quantize(qcs[c, s]), 0 for s >= lq. Any monotone map
// keeps the scores exact; the map only decides how many tokens share the max
// byte and need an exact look. So the range is estimated from a fixed sample
// of the table (PLAID_SAMPLE values, the same in every block, served by L2)
// instead of a reduction over all of it: scores outside it clamp to 0 or
// 255, which only makes ties among the extremes more likely.
#define PLAID_SAMPLE 256
extern "C" __global__ void __launch_bounds__(PLAID_PREP_THREADS) plaid_qcs_quantize(const PlaidApproxParams p) {
    const int n = (int)p.n_centroids * p.lq;  // the host checks that it fits
    float lo = PLAID_POS_INF, hi = PLAID_NEG_INF;
    const int step = max(n / PLAID_SAMPLE, 1);
    for (int i = threadIdx.x; i < PLAID_SAMPLE && i * step < n; i += PLAID_PREP_THREADS) {
        const float x = __ldg(p.qcs + i * step);
        lo = fminf(lo, x);
        hi = fmaxf(hi, x);
    }
    const float2 r = block_min_max(lo, hi);
    float scale = 255.f / (r.y - r.x);
    // One distinct value, or a range beyond f32: every byte 0, every token a
    // candidate for the exact pass (correct, only slower).
    if (!(scale > 0.f && scale < PLAID_POS_INF)) scale = 0.f;
    const int words = p.stride8 / 4;
    const int total = (int)p.n_centroids * words;
    // Four scores per word: one 16-byte load when rows are 16-byte aligned.
    const bool vec = p.lq % 4 == 0 && (reinterpret_cast<uintptr_t>(p.qcs) & 15) == 0;
    for (int i = blockIdx.x * PLAID_PREP_THREADS + threadIdx.x; i < total; i += gridDim.x * PLAID_PREP_THREADS) {
        const int c = i / words, s0 = (i - c * words) * 4;
        const float* row = p.qcs + (size_t)c * p.lq + s0;
        uint32_t w = 0;
        if (vec) {
            if (s0 < p.lq) {
                const float4 x = __ldg(reinterpret_cast<const float4*>(row));
                w = quantize(x.x, r.x, scale) | quantize(x.y, r.x, scale) << 8 | quantize(x.z, r.x, scale) << 16 |
                    quantize(x.w, r.x, scale) << 24;
            }
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (s0 + k < p.lq) w |= quantize(__ldg(row + k), r.x, scale) << (8 * k);
        }
        reinterpret_cast<uint32_t*>(p.qcs8)[i] = w;
    }
}

// Float bits mapped to unsigned integers of the same order (0 below every float).
__device__ __forceinline__ uint32_t ordered_bits(float x) {
    const uint32_t u = __float_as_uint(x);
    return u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
}
__device__ __forceinline__ float from_ordered_bits(uint32_t u) {
    return __uint_as_float(u & 0x80000000u ? u ^ 0x80000000u : ~u);
}

// The bytes of a word that are zero, as their high bits (exact, no carries
// between bytes).
__device__ __forceinline__ uint32_t zero_bytes(uint32_t x) {
    return ~(((x & 0x7f7f7f7fu) + 0x7f7f7f7fu) | x | 0x7f7f7f7fu);
}

// Running byte-wise max of packed bytes with the native 16-bit SIMD max
// (there is no native 8-bit one): a u16x2 max compares the high byte of each
// half first, so `odd` (the raw words) keeps the max of bytes 1 and 3 and
// `even` (the words shifted up a byte) the max of bytes 0 and 2, each in the
// high byte of its half; the low bytes are don't-cares.
struct ByteMax {
    uint32_t even = 0, odd = 0;
    __device__ __forceinline__ static uint32_t max16x2(uint32_t a, uint32_t b) {
#if __CUDA_ARCH__ >= 900
        uint32_t d;
        asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
        return d;
#else
        return __vmaxu2(a, b);  // emulated; the host picks this kernel on sm_90 only
#endif
    }
    __device__ __forceinline__ void add(uint32_t w) {
        odd = max16x2(odd, w);
        even = max16x2(even, w << 8);
    }
    __device__ __forceinline__ void merge_xor(int off) {
        odd = max16x2(odd, __shfl_xor_sync(0xffffffffu, odd, off));
        even = max16x2(even, __shfl_xor_sync(0xffffffffu, even, off));
    }
    // The four max bytes in their own positions.
    __device__ __forceinline__ uint32_t packed() const { return __byte_perm(even, odd, 0x7351); }
};

// Row slice of one lane: W words (4 W bytes, 4 W query tokens).
template <int W> struct Slice;
template <> struct Slice<2> {
    uint32_t w[2];
    __device__ __forceinline__ void load(const uint8_t* p) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = v.x, w[1] = v.y;
    }
};
template <> struct Slice<4> {
    uint32_t w[4];
    __device__ __forceinline__ void load(const uint8_t* p) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    }
};

// Step 2: a warp per document. G lanes hold one quantized row, W words each;
// the warp loads R = 32 / G rows per instruction and a chunk of T = U * R
// tokens in U loads per lane (loads past the document's end are skipped
// warp-uniformly). A document of one chunk keeps its rows in registers
// between the byte max and the exact pass; longer ones load them again.
// The exact pass is branch-free until the hits: each lane marks its bytes
// equal to the document's max in a bitmap (bit 8 * byte + u of word w) and
// appends them to the warp's list; the lanes then share out the list: read
// the f32 score, atomic max into `best` (this warp's lq slots of shared
// memory). Codes go through `code_of` (T slots).
template <typename Code, int G, int W>
__device__ __forceinline__ void plaid_filter(const PlaidApproxParams& p, uint32_t* best, uint32_t* code_of,
                                             uint2* list) {
    constexpr int R = 32 / G;              // rows per warp-wide load
    constexpr int U = G >= 4 ? 8 : 2 * G;  // loads in flight per lane (<= 8: one bit per load per byte)
    constexpr int T = U * R;               // tokens per chunk
    constexpr int NC = (T + 31) / 32;      // code words per lane per chunk
    static_assert(U <= 8 && T <= PLAID_FILTER_T, "bitmap and code slots");
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
    if (p.lq <= 32) {
        if (lane < p.lq) best[lane] = 0;
    } else {
        for (int s = lane; s < p.lq; s += 32) best[s] = 0;
    }
    const Code* codes = static_cast<const Code*>(p.codes) + doc * p.ld;
    const int g = lane % G, r = lane / G;
    const int col0 = 4 * W * g;  // first query token of this lane's slice

    // Tokens t0 .. t0 + T: their codes (checked: PLAID_BAD_CODE past len or
    // out of range) into code_of, and this lane's slices of their quantized
    // rows (zero for a bad code).
    auto load = [&](int t0, Slice<W>(&row)[U], bool report) {
        const int n = len - t0;  // tokens left, > 0
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            const int t = 32 * k + lane;
            uint32_t c = PLAID_BAD_CODE;
            if (t < T && t < n) {
                c = checked_code(codes[t0 + t], p.n_centroids);
                if (c == PLAID_BAD_CODE && report) atomicMax(&p.err[1], ~(unsigned long long)(doc * p.ld + t0 + t));
            }
            if (t < T) code_of[t] = c;
        }
        __syncwarp();
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int w = 0; w < W; ++w) row[u].w[w] = 0;
            if (u * R >= n) continue;  // warp-uniform
            const uint32_t c = code_of[u * R + r];
            // Row 0 stands in for a bad code (no branch around the load); its bytes are dropped.
            const bool ok = c != PLAID_BAD_CODE;
            row[u].load(p.qcs8 + ((ok ? c : 0u) * (uint32_t)p.stride8 + col0));
            if (!ok)
#pragma unroll
                for (int w = 0; w < W; ++w) row[u].w[w] = 0;
        }
    };
    ByteMax mx[W];
    auto max_into = [&](const Slice<W>(&row)[U]) {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int w = 0; w < W; ++w) mx[w].add(row[u].w[w]);
    };
    uint32_t doc_max[W];
    auto merge = [&]() {
#pragma unroll
        for (int off = G; off < 32; off <<= 1)
#pragma unroll
            for (int w = 0; w < W; ++w) mx[w].merge_xor(off);
#pragma unroll
        for (int w = 0; w < W; ++w) doc_max[w] = mx[w].packed();
    };
    // Exact pass over tokens t0 .. t0 + T (codes in code_of, rows in `row`).
    auto exact = [&](int t0, const Slice<W>(&row)[U]) {
        const int n = len - t0;
#pragma unroll
        for (int w = 0; w < W; ++w) {
            uint32_t hits = 0;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (u * R >= n) break;  // warp-uniform
                // zero_bytes leaves bits 7, 15, 23, 31: moved to u, 8 + u, 16 + u, 24 + u.
                hits |= zero_bytes(row[u].w[w] ^ doc_max[w]) >> (7 - u);
            }
            // Hits of all lanes into this warp's list (`list`, 2 T slots), then
            // every lane takes entries: the exact loads go out together.
            const int n_hits = __popc(hits);
            int at = n_hits;  // inclusive prefix sum over the lanes
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const int x = __shfl_up_sync(full, at, off);
                if (lane >= off) at += x;
            }
            const int n_list = __shfl_sync(full, at, 31);
            at -= n_hits;
            while (hits) {
                const int bit = __ffs(hits) - 1;
                hits &= hits - 1;
                const int u = bit & 7, s = col0 + 4 * w + (bit >> 3);
                // Bad codes and padded columns have byte 0 and match a max of 0: skipped at use.
                const uint2 h = make_uint2(code_of[u * R + r], u * R + r < n && s < p.lq ? (uint32_t)s : ~0u);
                if (at < PLAID_LIST) {
                    list[at++] = h;
                } else if (h.x != PLAID_BAD_CODE && h.y != ~0u) {  // overflow (many ties): apply here
                    atomicMax(&best[h.y], ordered_bits(__ldg(p.qcs + (size_t)h.x * p.lq + h.y)));
                }
            }
            __syncwarp();
            for (int i = lane; i < min(n_list, PLAID_LIST); i += 32) {
                const uint2 h = list[i];
                if (h.x != PLAID_BAD_CODE && h.y != ~0u)
                    atomicMax(&best[h.y], ordered_bits(__ldg(p.qcs + (size_t)h.x * p.lq + h.y)));
            }
            __syncwarp();
        }
    };

    Slice<W> row[U];
    if (len <= T) {  // one chunk: its rows stay in registers for the exact pass
        load(0, row, true);
        max_into(row);
        merge();
        exact(0, row);
    } else {  // longer documents load their rows twice
        for (int t0 = 0; t0 < len; t0 += T) {
            load(t0, row, true);
            max_into(row);
            __syncwarp();  // code_of is rewritten by the next chunk
        }
        merge();
        for (int t0 = 0; t0 < len; t0 += T) {
            load(t0, row, false);
            exact(t0, row);
            __syncwarp();
        }
    }
    __syncwarp();
    float total = 0.f;
    if (p.lq <= 32) {
        if (lane < p.lq) total = from_ordered_bits(best[lane]);
    } else {
        for (int s = lane; s < p.lq; s += 32) total += from_ordered_bits(best[s]);
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

// plaid_filter_<codes>_g<lanes per row>_w<words per lane>: 8 bytes per lane (W = 2) up to 32
// lanes, 16 bytes (W = 4) for rows of 512 bytes.
#define PLAID_FILTER(CNAME, CODE, G, W)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * PLAID_WARPS)                                       \
        plaid_filter_##CNAME##_g##G##_w##W(const PlaidApproxParams p) {                                         \
        extern __shared__ uint32_t best[];                                                               \
        __shared__ uint32_t code_of[PLAID_WARPS][PLAID_FILTER_T];                                        \
        __shared__ uint2 list[PLAID_WARPS][PLAID_LIST];                                                  \
        const int warp = threadIdx.x >> 5;                                                               \
        plaid_filter<CODE, G, W>(p, best + warp * p.lq, code_of[warp], list[warp]);                     \
    }
#define PLAID_FILTER_G(CNAME, CODE)                                                                      \
    PLAID_FILTER(CNAME, CODE, 2, 2)                                                                      \
    PLAID_FILTER(CNAME, CODE, 4, 2)                                                                      \
    PLAID_FILTER(CNAME, CODE, 8, 2)                                                                      \
    PLAID_FILTER(CNAME, CODE, 16, 2)                                                                     \
    PLAID_FILTER(CNAME, CODE, 32, 2)                                                                     \
    PLAID_FILTER(CNAME, CODE, 32, 4)

PLAID_FILTER_G(u32, uint32_t)
PLAID_FILTER_G(i64, int64_t)
