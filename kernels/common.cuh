// Tile primitives shared by the MaxSim kernels: element types, the problem
// description every layout lowers to, tensor-core MMA and async copies.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#define MAXSIM_NEG_INF (__int_as_float(0xff800000))

// ---------------------------------------------------------------------------
// Element types
// ---------------------------------------------------------------------------
// to_float / from: to and from the accumulation type (f32; f64 for f64);
// bits: the 16-bit pattern of a rounded value, for packed stores.
template <typename T> struct Elem;
template <> struct Elem<__half> {
    using Acc = float;
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from(float x) { return __float2half(x); }
    static __device__ __forceinline__ uint32_t bits(float x) { return __half_as_ushort(__float2half(x)); }
};
template <> struct Elem<__nv_bfloat16> {
    using Acc = float;
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from(float x) { return __float2bfloat16(x); }
    static __device__ __forceinline__ uint32_t bits(float x) { return __bfloat16_as_ushort(__float2bfloat16(x)); }
};
template <> struct Elem<float> {
    using Acc = float;
    static __device__ __forceinline__ float to_float(float x) { return x; }
    static __device__ __forceinline__ float from(float x) { return x; }
};
template <> struct Elem<double> {
    using Acc = double;
    static __device__ __forceinline__ double to_float(double x) { return x; }
    static __device__ __forceinline__ double from(double x) { return x; }
};

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

// ---------------------------------------------------------------------------
// Async copies and tensor-core MMA. sm_80+ copies with cp.async; on sm_75
// (Turing: no cp.async) the same calls copy synchronously, so the kernels'
// pipelines still run, only without overlap.
// ---------------------------------------------------------------------------
#if __CUDA_ARCH__ >= 800
// 16 bytes global -> shared (zero-filled past src_bytes), L2 only; the
// shared-memory address already converted.
__device__ __forceinline__ void cp_async16_s(uint32_t smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_bytes));
}
// 4 bytes (zero-filled when src_bytes = 0), through L1.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
#elif __CUDA_ARCH__ >= 750
// src_bytes is 0 (zero fill) or the full size at every call site.
__device__ __forceinline__ void cp_async16_s(uint32_t smem, const void* gmem, int src_bytes) {
    const uint4 v = src_bytes ? *reinterpret_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(smem), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes) {
    *reinterpret_cast<uint32_t*>(smem) = src_bytes ? *reinterpret_cast<const uint32_t*>(gmem) : 0u;
}
__device__ __forceinline__ void cp_async_commit() {}
template <int N> __device__ __forceinline__ void cp_async_wait() {}
#endif

#if __CUDA_ARCH__ >= 750
template <typename T> struct Mma;
// D[16x8] += A[16x16] (row) * B[16x8] (col), f32 accumulators.
template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
#if __CUDA_ARCH__ >= 800
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
        // Turing has m16n8k8 only: the k16 fragments are two k8 halves.
#pragma unroll
        for (int h = 0; h < 2; ++h)
            asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
                         "{%0,%1,%2,%3};\n"
                         : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                         : "r"(a[2 * h]), "r"(a[2 * h + 1]), "r"(b[h]));
#endif
    }
};
#if __CUDA_ARCH__ >= 800
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
#endif

// ldmatrix: four 8x8 b16 matrices from shared memory, one row address per lane.
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* smem) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// Tensor-core operands of one element type, as the mma.sync kernels use
// them: K columns per MMA step, A registers per m16 x K fragment, the A
// fragment read from a row-major shared-memory tile, and the two n8 MMAs fed
// by one ldmatrix.x4 of B (rows = document tokens, K-major). ldmatrix reads
// 16-byte row pieces, so the same B addressing serves 2- and 4-byte elements.
template <typename T> struct Frag { // f16 / bf16: m16n8k16
    static constexpr int K = 16, AREGS = 4;
    static __device__ __forceinline__ void load_a(uint32_t* a, const T* s, int srow, int ra, int col0, int c) {
        const T* p = s + ra * srow + col0 + 2 * c;
        a[0] = *reinterpret_cast<const uint32_t*>(p);
        a[1] = *reinterpret_cast<const uint32_t*>(p + 8 * srow);
        a[2] = *reinterpret_cast<const uint32_t*>(p + 8);
        a[3] = *reinterpret_cast<const uint32_t*>(p + 8 * srow + 8);
    }
    static __device__ __forceinline__ void mma2(float* c0, float* c1, const uint32_t* a, const uint32_t* b) {
        Mma<T>::run(c0, a, b);
        Mma<T>::run(c1, a, b + 2);
    }
};

#if __CUDA_ARCH__ >= 800
// F32 on tensor cores, split precision ("3xTF32"): x = hi + lo with both
// parts TF32 (10-bit mantissa), and a.b ~ a_hi.b_hi + a_hi.b_lo + a_lo.b_hi.
// The dropped a_lo.b_lo term is ~2^-22 of the product: F32-grade scores (and
// argmax) at a third of the TF32 tensor-core rate, far above FMA units.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(hi) : "f"(x));
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(lo) : "f"(x - __uint_as_float(hi)));
}
__device__ __forceinline__ void mma_tf32(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> struct Frag<float> { // m16n8k8 tf32; A kept split: a[0..3] hi, a[4..7] lo
    static constexpr int K = 8, AREGS = 8;
    static __device__ __forceinline__ void load_a(uint32_t* a, const float* s, int srow, int ra, int col0, int c) {
        const float* p = s + ra * srow + col0 + c;
        const float x[4] = {p[0], p[8 * srow], p[4], p[8 * srow + 4]};
#pragma unroll
        for (int i = 0; i < 4; ++i) split_tf32(x[i], a[i], a[4 + i]);
    }
    static __device__ __forceinline__ void mma2(float* c0, float* c1, const uint32_t* a, const uint32_t* b) {
        uint32_t hi[4], lo[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) split_tf32(__uint_as_float(b[i]), hi[i], lo[i]);
        float* c[2] = {c0, c1};
#pragma unroll
        for (int n = 0; n < 2; ++n) { // small terms first
            mma_tf32(c[n], a + 4, hi + 2 * n);
            mma_tf32(c[n], a, lo + 2 * n);
            mma_tf32(c[n], a, hi + 2 * n);
        }
    }
};
#endif
#endif // __CUDA_ARCH__ >= 750

// ---------------------------------------------------------------------------
// Hopper warpgroup MMA (sm_90a only): wgmma.mma_async with A in registers
// (the same m16k16 fragment per warp as mma.sync) and B read by the tensor
// cores straight from a 128-byte-swizzled shared-memory tile.
// ---------------------------------------------------------------------------
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MAXSIM_HOPPER 1

// Swizzled tile of rows with 64 two-byte elements per 128-byte row (K-major
// B operand): 16-byte chunk c of row r sits at chunk c ^ (r % 8). Wider rows
// are stored as consecutive [rows, 64] panels. The tile base is 1024-aligned.
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t smem_addr) {
    uint64_t d = 0;
    d |= (uint64_t)((smem_addr & 0x3FFFF) >> 4);   // start address
    d |= (uint64_t)1 << 16;                         // leading byte offset (unused with swizzle)
    d |= (uint64_t)(1024 >> 4) << 32;               // stride byte offset: 8 rows x 128 B
    d |= (uint64_t)1 << 62;                         // 128-byte swizzle
    return d;
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Writes by the generic proxy (cp.async, st.shared) made visible to the tensor cores.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator accesses across wgmma issue/wait.
template <int N> __device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Operand lists: N/2 f32 accumulators, 4 A registers, the B descriptor, scale-d.
#define MAXSIM_WG_D8(o) "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), \
                        "+f"(d[o + 4]), "+f"(d[o + 5]), "+f"(d[o + 6]), "+f"(d[o + 7])
#define MAXSIM_WG_OPS_N64 MAXSIM_WG_D8(0), MAXSIM_WG_D8(8), MAXSIM_WG_D8(16), MAXSIM_WG_D8(24)
#define MAXSIM_WG_OPS_N128 MAXSIM_WG_OPS_N64, MAXSIM_WG_D8(32), MAXSIM_WG_D8(40), MAXSIM_WG_D8(48), MAXSIM_WG_D8(56)
#define MAXSIM_WG_REGS_N64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define MAXSIM_WG_TAIL_N64 "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
#define MAXSIM_WG_PRED_N64 "setp.ne.b32 p, %37, 0;\n"
#define MAXSIM_WG_REGS_N128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define MAXSIM_WG_TAIL_N128 "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
#define MAXSIM_WG_PRED_N128 "setp.ne.b32 p, %69, 0;\n"

// D[64 x N] (+)= A[64 x 16] (registers) * B[16 x N] (shared memory, K-major).
template <typename T, int N> struct Wgmma;
#define MAXSIM_WGMMA(T, TS, N)                                                                            \
    template <> struct Wgmma<T, N> {                                                                      \
        static __device__ __forceinline__ void run(float* d, const uint32_t* a, uint64_t desc, int acc) { \
            asm volatile("{\n.reg .pred p;\n" MAXSIM_WG_PRED_N##N                                          \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TS "." TS " "                  \
                         MAXSIM_WG_REGS_N##N ", " MAXSIM_WG_TAIL_N##N "}\n"                               \
                         : MAXSIM_WG_OPS_N##N                                                             \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));              \
        }                                                                                                 \
    };
// D[64 x N] (+)= A[64 x 16] * B[16 x N], both from 128-byte-swizzled K-major
// shared-memory tiles (the fused projection head stages both through cp.async).
template <typename T, int N> struct WgmmaSS;
#define MAXSIM_WG_SS_TAIL_N64 "%32, %33, p, 1, 1, 0, 0;\n"
#define MAXSIM_WG_SS_PRED_N64 "setp.ne.b32 p, %34, 0;\n"
#define MAXSIM_WG_SS_TAIL_N128 "%64, %65, p, 1, 1, 0, 0;\n"
#define MAXSIM_WG_SS_PRED_N128 "setp.ne.b32 p, %66, 0;\n"
#define MAXSIM_WGMMA_SS(T, TS, N)                                                                          \
    template <> struct WgmmaSS<T, N> {                                                                     \
        static __device__ __forceinline__ void run(float* d, uint64_t desc_a, uint64_t desc_b, int acc) { \
            asm volatile("{\n.reg .pred p;\n" MAXSIM_WG_SS_PRED_N##N                                       \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TS "." TS " "                   \
                         MAXSIM_WG_REGS_N##N ", " MAXSIM_WG_SS_TAIL_N##N "}\n"                            \
                         : MAXSIM_WG_OPS_N##N                                                              \
                         : "l"(desc_a), "l"(desc_b), "r"(acc));                                            \
        }                                                                                                  \
    };
MAXSIM_WGMMA_SS(__half, "f16", 64)
MAXSIM_WGMMA_SS(__half, "f16", 128)
MAXSIM_WGMMA_SS(__nv_bfloat16, "bf16", 64)
MAXSIM_WGMMA_SS(__nv_bfloat16, "bf16", 128)

MAXSIM_WGMMA(__half, "f16", 64)
MAXSIM_WGMMA(__half, "f16", 128)
MAXSIM_WGMMA(__nv_bfloat16, "bf16", 64)
MAXSIM_WGMMA(__nv_bfloat16, "bf16", 128)
#endif // __CUDA_ARCH_FEAT_SM90_ALL

// A similarity with its low mantissa bits replaced by `code` (`keep` clears
// them; passed in a register so that this is one LOP3 with `code` as the
// immediate). Max over packed values = the max over values truncated by those
// bits (a relative change under 2^-18), ties going to the larger code. Packing
// turns +-inf into NaN, which fmaxf skips: overflowed similarities are not ranked.
__device__ __forceinline__ float argmax_pack(float v, uint32_t keep, uint32_t code) {
    return __uint_as_float((__float_as_uint(v) & keep) | code);
}

// Running (max, argmax) merge: larger value wins, ties keep the lower index.
__device__ __forceinline__ void merge_max(float& m, int& idx, float om, int oidx) {
    if (om > m || (om == m && oidx >= 0 && (idx < 0 || oidx < idx))) {
        m = om;
        idx = oidx;
    }
}
