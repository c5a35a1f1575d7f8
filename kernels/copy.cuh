// Global-to-shared copies: cp.async, the 128-byte swizzled tile layout of
// wgmma operands, and the one tile loader every kernel uses.
#pragma once
#include "elem.cuh"

// sm_80+ copies with cp.async; on sm_75 (Turing: no cp.async) the same calls
// copy synchronously, so the kernels' pipelines still run, only without overlap.
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


// Element offset of 16-byte chunk `ch` of row `r` in a tile of ROWS rows
// stored as [ROWS, 128 bytes] panels (EPC elements per chunk), 128-byte
// swizzled: chunk c of row r sits at chunk c ^ (r % 8) of its panel row
// (wgmma_desc_sw128's layout).
template <int ROWS, int EPC = 8> __device__ __forceinline__ int swizzle128(int r, int ch) {
    return (ch / 8) * (ROWS * 8 * EPC) + r * 8 * EPC + ((ch % 8) ^ (r % 8)) * EPC;
}

#if __CUDA_ARCH__ >= 750
// cp.async of a tile of ROWS rows x CHUNKS 16-byte chunks: rows [row0, row0 +
// nrows) and element columns [col0, col0 + CHUNKS * EPC) of a row-major
// [*, stride] matrix, rows past nrows and columns past ncols zero-filled.
// Thread t always copies chunk t % CHUNKS of rows t / CHUNKS + i * RPP, so
// each copy is two adds past the first: tile row r's chunk ch lands at
// element offset(r, ch), and rows RPP apart sit RPP * ROW_STEP elements apart
// (a swizzled tile keeps that when RPP % 8 == 0).
template <int NTHREADS, int ROWS, int CHUNKS, int ROW_STEP, typename T, typename Offset>
__device__ __forceinline__ void cp_async_tile(T* tile, Offset offset, const T* src, size_t stride, int row0, int nrows,
                                              int col0, int ncols) {
    constexpr int EPC = 16 / (int)sizeof(T), RPP = NTHREADS / CHUNKS;
    static_assert(NTHREADS % CHUNKS == 0 && ROWS % RPP == 0, "tile shape");
    const int ch = threadIdx.x % CHUNKS, r = threadIdx.x / CHUNKS, col = col0 + ch * EPC;
    const bool col_ok = col < ncols;
    const T* g = src + ((size_t)row0 + r) * stride + col;
    const size_t step = (size_t)RPP * stride;
    const uint32_t dst = (uint32_t)__cvta_generic_to_shared(tile + offset(r, ch));
#pragma unroll
    for (int i = 0; i < ROWS / RPP; ++i, g += step) {
        const bool ok = col_ok && r + i * RPP < nrows;
        cp_async16_s(dst + i * RPP * ROW_STEP * (int)sizeof(T), ok ? g : src, ok ? 16 : 0);
    }
}
#endif

// ---------------------------------------------------------------------------
// Hopper (sm_90a): shared-memory transaction barriers (mbarrier) and TMA
// tile loads, for the warp-specialized forward's producer/consumer ring.
// ---------------------------------------------------------------------------
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A CUtensorMap (cuda.h's layout, without including it): built on the host
// by cuTensorMapEncodeTiled, passed as a __grid_constant__ kernel parameter.
struct alignas(64) TmaMap {
    uint64_t opaque[16];
};
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// Barrier inits visible to the other threads and to the async proxy (TMA).
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
}
// The barrier by its shared address as well as by pointer: a loop over a
// ring of barriers adds stage * 8 to the ring's base address.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) { mbar_arrive(smem_u32(bar)); }
// One arrival, made when this thread's earlier cp.async copies have landed
// (not when it executes): the barrier's count must include it.
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// One arrival that also expects `bytes` of TMA transactions before the phase completes.
__device__ __forceinline__ void mbar_arrive_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}
// Waits until the phase of parity `parity` has completed (a fresh barrier's
// phase of parity 1 counts as completed).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) { mbar_wait(smem_u32(bar), parity); }
__device__ __forceinline__ void tma_prefetch(const TmaMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// Box (x, y) of a 2-D tensor map (x: element column, y: row) into shared
// memory, completing `bytes` of transactions on `bar`; rows and columns out
// of the tensor are zero-filled.
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaMap* map, uint64_t* bar, int x, int y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_u32(bar))
        : "memory");
}
// Named barrier `id` among `threads` threads (a subset of the block).
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Register reallocation between warpgroups (all warps of a warpgroup execute it).
template <int N> __device__ __forceinline__ void regs_increase() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void regs_decrease() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
#endif
