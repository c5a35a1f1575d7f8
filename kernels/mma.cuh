// Tensor-core MMA: mma.sync fragments (sm_75+), split-TF32 for F32 (sm_80+),
// and Hopper warpgroup MMA (sm_90a).
#pragma once
#include <type_traits>
#include "elem.cuh"

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
// D[16x8] += A[16x32] (row) * B[32x8] (col), s8 inputs, s32 accumulators.
template <> struct Mma<int8_t> {
    static __device__ __forceinline__ void run(int32_t* c, const uint32_t* a, const uint32_t* b) {
        asm volatile(
            "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
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

// The same, transposed: lane l gets elements (2c, 2c+1) of column g of each
// 8x8 matrix (the B operand of an MMA from a tile stored N-major).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* smem) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// Tensor-core operands of one element type, as the mma.sync kernels use
// them: K columns per MMA step, A registers per m16 x K fragment, the
// accumulator type, the A fragment read from a row-major shared-memory tile,
// and the two n8 MMAs fed by one ldmatrix.x4 of B (rows = document tokens,
// K-major). ldmatrix reads 16-byte row pieces, so the same B addressing
// serves 1-, 2- and 4-byte elements. f16 / bf16 (m16n8k16) and s8
// (m16n8k32) share the A layout: register i holds 4 bytes of row g (+8 for
// odd i) at column E * c (+K / 2 for i >= 2), E elements per register.
template <typename T> struct Frag {
    static constexpr int K = 32 / (int)sizeof(T), AREGS = 4;
    static constexpr bool INT = std::is_same<T, int8_t>::value;
    using Acc = typename std::conditional<INT, int32_t, float>::type;
    static __device__ __forceinline__ void load_a(uint32_t* a, const T* s, int srow, int ra, int col0, int c) {
        const T* p = s + ra * srow + col0 + (4 / (int)sizeof(T)) * c;
        a[0] = *reinterpret_cast<const uint32_t*>(p);
        a[1] = *reinterpret_cast<const uint32_t*>(p + 8 * srow);
        a[2] = *reinterpret_cast<const uint32_t*>(p + K / 2);
        a[3] = *reinterpret_cast<const uint32_t*>(p + 8 * srow + K / 2);
    }
    static __device__ __forceinline__ void mma2(Acc* c0, Acc* c1, const uint32_t* a, const uint32_t* b) {
        Mma<T>::run(c0, a, b);
        Mma<T>::run(c1, a, b + 2);
    }
};

// The similarity of an 8-bit dot product, s * dot (s the document token's
// scale), from a tile's accumulators:
//  scaled(acc, s): s32 accumulators converted exactly (|dot| < 2^24), one
//      I2FP and one FMUL; e4m3's F32 ones, one FMUL.
//  biased(acc, s, bias(s)): s32 accumulators that started at BIASED_ZERO,
//      the bits of the F32 1.5 * 2^23, end as the F32 1.5 * 2^23 + dot,
//      exactly while |dot| < 2^22 (dims up to 256 at |v| <= 128); one FFMA
//      with bias(s) = -1.5 * 2^23 * s gives s * dot without the I2FP, an
//      ALU op as the max's FMNMX is. bias(s) is exact, and the FFMA rounds
//      once as `scaled` does, when s has at most 22 significant bits
//      (quantize's scales); otherwise bias's rounding adds at most |s|. The
//      start value costs one IMAD.MOV per similarity (FMA pipe): the
//      warp-specialized tiles, whose epilogue is issue- and ALU-bound, take
//      it; the others convert.
template <typename T> struct Dot8;
template <> struct Dot8<int8_t> {
    static constexpr int32_t BIASED_ZERO = 0x4B400000;
    static __device__ __forceinline__ float scaled(int32_t acc, float s) { return (float)acc * s; }
    static __device__ __forceinline__ float bias(float s) { return -12582912.f * s; }
    static __device__ __forceinline__ float biased(int32_t acc, float s, float b) {
        return fmaf(__int_as_float(acc), s, b);
    }
};
template <> struct Dot8<__nv_fp8_e4m3> {
    static __device__ __forceinline__ float scaled(float acc, float s) { return acc * s; }
    static __device__ __forceinline__ float bias(float) { return 0.f; }
    static __device__ __forceinline__ float biased(float acc, float s, float) { return acc * s; }
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
    using Acc = float;
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
//
// Tiles and K steps within one region differ only in the start address, so
// a loop keeps the low word (start address >> 4, leading byte offset) and
// adds byte offsets >> 4 to it: 1 integer add per wgmma instead of the 3 of
// masking, shifting and or-ing an address (no carry: shared addresses are
// below 2^18).
__device__ __forceinline__ uint32_t wgmma_desc_lo(uint32_t smem_addr) {
    return ((smem_addr & 0x3FFFF) >> 4)   // start address
           | (1u << 16);                    // leading byte offset (unused with swizzle)
}
__device__ __forceinline__ uint64_t wgmma_desc_sw128_lo(uint32_t lo) {
    constexpr uint32_t HI = (1024 >> 4)    // stride byte offset: 8 rows x 128 B
                            | (1u << 30);   // 128-byte swizzle
    return (uint64_t)HI << 32 | lo;
}
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t smem_addr) {
    return wgmma_desc_sw128_lo(wgmma_desc_lo(smem_addr));
}
// An N-major B operand of 64 columns in the same swizzled [rows, 64] panel
// layout (rows = the K index, 128 bytes each): 8-row groups 1024 bytes apart
// (stride byte offset), as CUTLASS's canonical MN-major SW128 layout
// ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)) with m = 1 (the leading byte offset,
// between 64-column panels, unused: wider operands are one wgmma per panel).
__device__ __forceinline__ uint64_t wgmma_desc_sw128_mn(uint32_t smem_addr) { return wgmma_desc_sw128(smem_addr); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Before a tile's first wgmma, for Dot8::biased: the s8 accumulators' start
// value (the others are overwritten by the first wgmma), then the fence
// that orders register writes before the tensor cores read them.
template <typename T, int N, typename Acc> __device__ __forceinline__ void wgmma_start_biased(Acc* d) {
    if constexpr (Frag<T>::INT) {
#pragma unroll
        for (int i = 0; i < N; ++i) d[i] = Dot8<T>::BIASED_ZERO;
    }
    wgmma_fence();
}
// Writes by the generic proxy (cp.async, st.shared) made visible to the tensor cores.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator accesses across wgmma issue/wait.
template <int N> __device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void fence_regs(int32_t* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Accumulators whose first wgmma overwrites them (scale-d = 0), defined for
// the compiler without an instruction: zeroing them would be a non-wgmma
// write inside a pipeline stage of wgmmas still in flight (a P V of the
// previous tile), which makes ptxas serialize every wgmma (C7515).
template <int N> __device__ __forceinline__ void wgmma_undef(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "=f"(r[i]));
}

// Operand lists: N/2 f32 accumulators, 4 A registers, the B descriptor, scale-d.
// R: the accumulators' constraint, "+f" (f32) or "+r" (s32).
#define MAXSIM_WG_D8(R, o) R(d[o]), R(d[o + 1]), R(d[o + 2]), R(d[o + 3]), \
                           R(d[o + 4]), R(d[o + 5]), R(d[o + 6]), R(d[o + 7])
#define MAXSIM_WG_OPS_N64(R) MAXSIM_WG_D8(R, 0), MAXSIM_WG_D8(R, 8), MAXSIM_WG_D8(R, 16), MAXSIM_WG_D8(R, 24)
#define MAXSIM_WG_OPS_N128(R) MAXSIM_WG_OPS_N64(R), MAXSIM_WG_D8(R, 32), MAXSIM_WG_D8(R, 40), MAXSIM_WG_D8(R, 48), \
                              MAXSIM_WG_D8(R, 56)
#define MAXSIM_WG_F(x) "+f"(x)
#define MAXSIM_WG_S(x) "+r"(x)
#define MAXSIM_WG_REGS_N64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define MAXSIM_WG_TAIL_N64 "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
#define MAXSIM_WG_PRED_N64 "setp.ne.b32 p, %37, 0;\n"
#define MAXSIM_WG_REGS_N128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define MAXSIM_WG_TAIL_N128 "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
// The same with B N-major (imm-trans-b = 1): B rows are the K index, N contiguous.
#define MAXSIM_WG_TTAIL_N64 "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n"
// Integer wgmma takes no scale or transpose immediates.
#define MAXSIM_WG_ITAIL_N64 "{%32, %33, %34, %35}, %36, p;\n"
#define MAXSIM_WG_ITAIL_N128 "{%64, %65, %66, %67}, %68, p;\n"
#define MAXSIM_WG_PRED_N128 "setp.ne.b32 p, %69, 0;\n"
// FP8 wgmma takes the A and B scale immediates but no transpose.
#define MAXSIM_WG_F8TAIL_N64 "{%32, %33, %34, %35}, %36, p, 1, 1;\n"
#define MAXSIM_WG_F8TAIL_N128 "{%64, %65, %66, %67}, %68, p, 1, 1;\n"

// D[64 x N] (+)= A[64 x K] (registers) * B[K x N] (shared memory, K-major):
// K = 16 for f16 / bf16 (f32 accumulators), 32 for s8 (s32) and e4m3 (f32).
template <typename T, int N> struct Wgmma;
// The same for f16 / bf16 with B N-major, N = 64: a [K, 64] row-major panel
// (attention's values), 128-byte swizzled like the K-major tiles
// (wgmma_desc_sw128_mn).
template <typename T, int N> struct WgmmaNB;
#define MAXSIM_WGMMA_AS(NAME, T, ACC, R, SHAPE, TAIL, N)                                                 \
    template <> struct NAME<T, N> {                                                                      \
        static __device__ __forceinline__ void run(ACC* d, const uint32_t* a, uint64_t desc, int acc) { \
            asm volatile("{\n.reg .pred p;\n" MAXSIM_WG_PRED_N##N "wgmma.mma_async.sync.aligned.m64n" #N  \
                         SHAPE " " MAXSIM_WG_REGS_N##N ", " TAIL##N "}\n"                                 \
                         : MAXSIM_WG_OPS_N##N(R)                                                         \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));             \
        }                                                                                                \
    };
#define MAXSIM_WGMMA(T, TS, N) \
    MAXSIM_WGMMA_AS(Wgmma, T, float, MAXSIM_WG_F, "k16.f32." TS "." TS, MAXSIM_WG_TAIL_N, N)
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
                         : MAXSIM_WG_OPS_N##N(MAXSIM_WG_F)                                                 \
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
MAXSIM_WGMMA_AS(WgmmaNB, __half, float, MAXSIM_WG_F, "k16.f32.f16.f16", MAXSIM_WG_TTAIL_N, 64)
MAXSIM_WGMMA_AS(WgmmaNB, __nv_bfloat16, float, MAXSIM_WG_F, "k16.f32.bf16.bf16", MAXSIM_WG_TTAIL_N, 64)
MAXSIM_WGMMA_AS(Wgmma, int8_t, int32_t, MAXSIM_WG_S, "k32.s32.s8.s8", MAXSIM_WG_ITAIL_N, 64)
MAXSIM_WGMMA_AS(Wgmma, int8_t, int32_t, MAXSIM_WG_S, "k32.s32.s8.s8", MAXSIM_WG_ITAIL_N, 128)
MAXSIM_WGMMA_AS(Wgmma, __nv_fp8_e4m3, float, MAXSIM_WG_F, "k32.f32.e4m3.e4m3", MAXSIM_WG_F8TAIL_N, 64)
MAXSIM_WGMMA_AS(Wgmma, __nv_fp8_e4m3, float, MAXSIM_WG_F, "k32.f32.e4m3.e4m3", MAXSIM_WG_F8TAIL_N, 128)
#endif // __CUDA_ARCH_FEAT_SM90_ALL

