// MaxSim forward: score[pair] = sum over valid query rows of the max over
// valid document rows of <Q[s], D[t]>, never writing the similarity tensor.
//
// maxsim_fwd_mma: tensor cores (mma.sync m16n8k16, f16/bf16, sm_80+). A block
// holds a tile of BQ query rows (whole short queries, or a 128-row chunk of a
// long one) as A fragments in registers and streams its documents' rows
// through a double-buffered shared-memory tile of BD rows (cp.async). Each
// thread keeps a running (max, argmax) for its rows; at the end of a
// document the rows are reduced across the quad and the warps along N, and
// the per-query sums are added to the output (owned and zeroed by this block).
//
// On sm_90a the same kernel runs with Hopper tiles (HOPPER configs): each
// warpgroup of 4 warps owns 64 query rows, loads its Q fragments straight from
// global memory, and multiplies them by the whole document tile with one
// wgmma per 16 columns of dim, B read from a 128-byte-swizzled tile.
//
// 8-bit inputs (the symmetric per-token quantization of src/ops/quantize.rs)
// run the same kernel: int8_t on s8 tensor cores (mma.sync m16n8k32, wgmma
// k32 on sm_90a) with s32 accumulators, __nv_fp8_e4m3 on e4m3 wgmma (sm_90a)
// with f32 ones. Each document token's scale, staged with its tile,
// multiplies its similarities before the max (Dot8); each query token's
// scale multiplies the row's max after it.
//
// maxsim_fwd_simt: plain FMA fallback for F64, for GPUs without the MMA path
// (sm_75), for F32 dims over 256 and 16-bit dims over 512.
//
// The pieces live in headers, FlashAttention-3's split: kernel traits
// (maxsim_fwd_traits.cuh), the in-block scheduler (maxsim_fwd_scheduler.cuh),
// loaders (maxsim_fwd_load.cuh), the pipelined mainloop
// (maxsim_fwd_mainloop.cuh), the warp-specialized Hopper mainloop
// (maxsim_fwd_ws.cuh) and the epilogue (maxsim_fwd_epilogue.cuh). This file
// instantiates them for every row of kernels/tiles.def and holds the SIMT
// path.
#include "maxsim_fwd_mainloop.cuh"
#include "maxsim_fwd_ws.cuh"

#if __CUDA_ARCH__ >= 750

#ifdef MAXSIM_HOPPER
// Entry points: maxsim_mma_<dtype>_<config>_d<width>_<nograd|argmax> of the
// warp-specialized tiles (the D operand's tensor map as a second parameter).
#define MAXSIM_WS_KERNEL(NAME, T, ARGMAX, ...)                                                                  \
    extern "C" __global__ void __launch_bounds__(WsConfig<TileConfig<T, __VA_ARGS__>>::NTHREADS, 1)             \
        NAME(const __grid_constant__ MaxSimParams p, const __grid_constant__ TmaMap dmap) {                     \
        maxsim_fwd_ws<TileConfig<T, __VA_ARGS__>, T, ARGMAX>(p, &dmap);                                         \
    }
#define MAXSIM_WS_ENTRY(NAME, T, ...)                            \
    MAXSIM_WS_KERNEL(NAME##_nograd, T, false, __VA_ARGS__)       \
    MAXSIM_WS_KERNEL(NAME##_argmax, T, true, __VA_ARGS__)
#define MAXSIM_WS_WIDTHS(NAME, T, WM, WN, MT, NT, ST)                        \
    MAXSIM_WS_ENTRY(NAME##_d48, T, 64, WM, WN, MT, NT, ST, true, 48)         \
    MAXSIM_WS_ENTRY(NAME##_d64, T, 64, WM, WN, MT, NT, ST, true, 64)         \
    MAXSIM_WS_ENTRY(NAME##_d96, T, 128, WM, WN, MT, NT, ST, true, 96)        \
    MAXSIM_WS_ENTRY(NAME##_d128, T, 128, WM, WN, MT, NT, ST, true, 128)
// 8-bit scores (TAG i8 or e4m3) at width 128, multiplying KDIM = dim rounded up to 32.
#define MAXSIM_WS_8BIT_WIDTH(TAG, T, NAME, W, WM, WN, MT, NT, ST) \
    MAXSIM_WS_KERNEL(maxsim_mma_##TAG##_##NAME##_d##W##_nograd, T, false, 128, WM, WN, MT, NT, ST, true, W)
#define MAXSIM_WS_8BIT(TAG, T, NAME, ...)                                                              \
    MAXSIM_WS_8BIT_WIDTH(TAG, T, NAME, 32, __VA_ARGS__) MAXSIM_WS_8BIT_WIDTH(TAG, T, NAME, 64, __VA_ARGS__) \
    MAXSIM_WS_8BIT_WIDTH(TAG, T, NAME, 96, __VA_ARGS__) MAXSIM_WS_8BIT_WIDTH(TAG, T, NAME, 128, __VA_ARGS__)
#endif // MAXSIM_HOPPER

// Entry points: maxsim_mma_<dtype>_<config>_d<width>_<nograd|argmax|res>, one per
// row of kernels/tiles.def, dtype and width.
#define MAXSIM_MMA_KERNEL(NAME, T, ARGMAX, LOADER, ...)                                           \
    extern "C" __global__ void __launch_bounds__(TileConfig<T, __VA_ARGS__>::NTHREADS,           \
                                                 TileConfig<T, __VA_ARGS__>::MIN_BLOCKS)         \
        NAME(const MaxSimParams p) {                                                              \
        maxsim_fwd_mma<TileConfig<T, __VA_ARGS__>, T, ARGMAX, LOADER>(p);                        \
    }
#define MAXSIM_MMA_ENTRY(NAME, T, ...)                                        \
    MAXSIM_MMA_KERNEL(NAME##_nograd, T, false, DenseLoader, __VA_ARGS__)      \
    MAXSIM_MMA_KERNEL(NAME##_argmax, T, true, DenseLoader, __VA_ARGS__)
// Residual-compressed documents (inference): maxsim_mma_<dtype>_<config>_d<DPAD>_res.
#define MAXSIM_RES_ENTRY(NAME, T, ...) MAXSIM_MMA_KERNEL(NAME##_res, T, false, ResidualLoader, __VA_ARGS__)
// One config at every width: d<W> = DPAD 64 / 128 with KDIM 48 / 64 / 96 / 128.
#define MAXSIM_MMA_WIDTHS(NAME, T, WM, WN, MT, NT, ST, HOP)                    \
    MAXSIM_MMA_ENTRY(NAME##_d48, T, 64, WM, WN, MT, NT, ST, HOP, 48)           \
    MAXSIM_MMA_ENTRY(NAME##_d64, T, 64, WM, WN, MT, NT, ST, HOP, 64)           \
    MAXSIM_MMA_ENTRY(NAME##_d96, T, 128, WM, WN, MT, NT, ST, HOP, 96)          \
    MAXSIM_MMA_ENTRY(NAME##_d128, T, 128, WM, WN, MT, NT, ST, HOP, 128)
// Residual kernels at the stored widths 64 and 128 (a thread decompresses 8 rows per tile).
#define MAXSIM_RES_WIDTHS(NAME, T, WM, WN, MT, NT, ST, HOP)          \
    MAXSIM_RES_ENTRY(NAME##_d64, T, 64, WM, WN, MT, NT, ST, HOP)     \
    MAXSIM_RES_ENTRY(NAME##_d128, T, 128, WM, WN, MT, NT, ST, HOP)
#define MAXSIM_RES_STAGES_0(NAME, T, WM, WN, MT, NT, HOP)
#define MAXSIM_RES_STAGES_3(NAME, T, WM, WN, MT, NT, HOP) MAXSIM_RES_WIDTHS(NAME, T, WM, WN, MT, NT, 3, HOP)
#define MAXSIM_RES_STAGES_4(NAME, T, WM, WN, MT, NT, HOP) MAXSIM_RES_WIDTHS(NAME, T, WM, WN, MT, NT, 4, HOP)
// A 16-bit configuration for f16 and bf16: dense kernels, and residual ones where RES > 0.
#define MAXSIM_TILE_16(NAME, WM, WN, MT, NT, ST, RES, HOP)                                            \
    MAXSIM_MMA_WIDTHS(maxsim_mma_f16_##NAME, __half, WM, WN, MT, NT, ST, HOP)                          \
    MAXSIM_MMA_WIDTHS(maxsim_mma_bf16_##NAME, __nv_bfloat16, WM, WN, MT, NT, ST, HOP)                  \
    MAXSIM_RES_STAGES_##RES(maxsim_mma_f16_##NAME, __half, WM, WN, MT, NT, HOP)                        \
    MAXSIM_RES_STAGES_##RES(maxsim_mma_bf16_##NAME, __nv_bfloat16, WM, WN, MT, NT, HOP)

// 8-bit scores at width 128 (one 128-byte swizzle panel), multiplying KDIM
// = dim rounded up to 32: maxsim_mma_<i8|e4m3>_<config>_d<KDIM>_nograd.
#define MAXSIM_8BIT_WIDTH(TAG, T, NAME, W, ...) \
    MAXSIM_MMA_KERNEL(maxsim_mma_##TAG##_##NAME##_d##W##_nograd, T, false, DenseLoader, 128, __VA_ARGS__, W)
#define MAXSIM_8BIT(TAG, T, NAME, ...)                                                           \
    MAXSIM_8BIT_WIDTH(TAG, T, NAME, 32, __VA_ARGS__) MAXSIM_8BIT_WIDTH(TAG, T, NAME, 64, __VA_ARGS__) \
    MAXSIM_8BIT_WIDTH(TAG, T, NAME, 96, __VA_ARGS__) MAXSIM_8BIT_WIDTH(TAG, T, NAME, 128, __VA_ARGS__)

// kernels/tiles.def, instantiated by family in the module that can run it.
#if __CUDA_ARCH__ >= 800
#define MAXSIM_FAMILY_mma16(NAME, WM, WN, MT, NT, ST, RES) \
    MAXSIM_TILE_16(NAME, WM, WN, MT, NT, ST, RES, false) MAXSIM_8BIT(i8, int8_t, NAME, WM, WN, MT, NT, ST, false)
#define MAXSIM_FAMILY_wide16(NAME, WM, WN, MT, NT, ST, RES)                              \
    MAXSIM_MMA_ENTRY(maxsim_mma_f16_##NAME##_d256, __half, 256, WM, WN, MT, NT, ST)      \
    MAXSIM_MMA_ENTRY(maxsim_mma_bf16_##NAME##_d256, __nv_bfloat16, 256, WM, WN, MT, NT, ST)
#define MAXSIM_FAMILY_xwide16(NAME, WM, WN, MT, NT, ST, RES)                                  \
    MAXSIM_MMA_ENTRY(maxsim_mma_f16_##NAME##_d384, __half, 512, WM, WN, MT, NT, ST, false, 384)      \
    MAXSIM_MMA_ENTRY(maxsim_mma_f16_##NAME##_d512, __half, 512, WM, WN, MT, NT, ST)                  \
    MAXSIM_MMA_ENTRY(maxsim_mma_bf16_##NAME##_d384, __nv_bfloat16, 512, WM, WN, MT, NT, ST, false, 384) \
    MAXSIM_MMA_ENTRY(maxsim_mma_bf16_##NAME##_d512, __nv_bfloat16, 512, WM, WN, MT, NT, ST)
#define MAXSIM_FAMILY_f32(NAME, WM, WN, MT, NT, ST, RES) \
    MAXSIM_MMA_WIDTHS(maxsim_mma_f32_##NAME, float, WM, WN, MT, NT, ST, false)
#define MAXSIM_FAMILY_turing(NAME, WM, WN, MT, NT, ST, RES)
#else // sm_75 module: F16 only (Turing has no BF16 / TF32 MMA)
#define MAXSIM_FAMILY_mma16(NAME, WM, WN, MT, NT, ST, RES)
#define MAXSIM_FAMILY_wide16(NAME, WM, WN, MT, NT, ST, RES)
#define MAXSIM_FAMILY_xwide16(NAME, WM, WN, MT, NT, ST, RES)
#define MAXSIM_FAMILY_f32(NAME, WM, WN, MT, NT, ST, RES)
#define MAXSIM_FAMILY_turing(NAME, WM, WN, MT, NT, ST, RES) \
    MAXSIM_MMA_WIDTHS(maxsim_mma_f16_##NAME, __half, WM, WN, MT, NT, ST, false)
#endif
#ifdef MAXSIM_HOPPER
#define MAXSIM_FAMILY_hopper(NAME, WM, WN, MT, NT, ST, RES)                    \
    MAXSIM_TILE_16(NAME, WM, WN, MT, NT, ST, RES, true)                       \
    MAXSIM_8BIT(i8, int8_t, NAME, WM, WN, MT, NT, ST, true)                   \
    MAXSIM_8BIT(e4m3, __nv_fp8_e4m3, NAME, WM, WN, MT, NT, ST, true)
#define MAXSIM_FAMILY_hopperws(NAME, WM, WN, MT, NT, ST, RES)                  \
    MAXSIM_WS_WIDTHS(maxsim_mma_f16_##NAME, __half, WM, WN, MT, NT, ST)         \
    MAXSIM_WS_WIDTHS(maxsim_mma_bf16_##NAME, __nv_bfloat16, WM, WN, MT, NT, ST) \
    MAXSIM_WS_8BIT(i8, int8_t, NAME, WM, WN, MT, NT, ST)                        \
    MAXSIM_WS_8BIT(e4m3, __nv_fp8_e4m3, NAME, WM, WN, MT, NT, ST)
#else
#define MAXSIM_FAMILY_hopper(NAME, WM, WN, MT, NT, ST, RES)
#define MAXSIM_FAMILY_hopperws(NAME, WM, WN, MT, NT, ST, RES)
#endif
#define MAXSIM_TILE(NAME, FAMILY, WM, WN, MT, NT, ST, RES) MAXSIM_FAMILY_##FAMILY(NAME, WM, WN, MT, NT, ST, RES)
#include "tiles.def"
#undef MAXSIM_TILE

#endif // __CUDA_ARCH__ >= 750

// ---------------------------------------------------------------------------
// SIMT fallback: one block per pair, one thread per query row.
// ---------------------------------------------------------------------------
constexpr int SIMT_THREADS = 128;
constexpr int SIMT_ROWS = 16; // document rows per shared-memory tile (fewer for large dims)
// Dynamic tile bytes: 47 KB, so that with the static reduction buffer the
// block stays under the 48 KB a launch gets without opting in.
constexpr int SIMT_SMEM = 47 * 1024;

template <typename T, typename Acc, bool ARGMAX>
__device__ void maxsim_fwd_simt(const MaxSimParams& p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Acc* sd = reinterpret_cast<Acc*>(smem_raw);          // [SIMT_ROWS, dim]
    __shared__ Acc partial[SIMT_THREADS / 32];
    const T* Q = static_cast<const T*>(p.q);
    const T* D = static_cast<const T*>(p.d);
    const int b = blockIdx.x;
    int i, j;
    if (p.pair_q) i = p.pair_q[b], j = p.pair_d[b];
    else i = b / p.nd, j = b % p.nd;
    const Range qr = q_rows(p, i), dr = d_rows(p, j);
    const int tile_rows = min(SIMT_ROWS, SIMT_SMEM / (p.dim * (int)sizeof(Acc)));
    Acc sum = 0;
    for (int s0 = 0; s0 < qr.end - qr.begin; s0 += SIMT_THREADS) {
        const int s = s0 + threadIdx.x;
        const int row = qr.begin + s;
        const bool active = row < qr.end && (!p.q_valid || p.q_valid[row]);
        Acc m = 0;
        int idx = -1;
        for (int t0 = dr.begin; t0 < dr.end; t0 += tile_rows) {
            const int n = min(tile_rows, dr.end - t0);
            __syncthreads();
            for (int k = threadIdx.x; k < n * p.dim; k += SIMT_THREADS)
                sd[k] = Elem<T>::to_float(D[(size_t)t0 * p.dim + k]);
            __syncthreads();
            if (!active) continue;
            for (int t = 0; t < n; ++t) {
                if (p.d_valid && !p.d_valid[t0 + t]) continue;
                Acc dot = 0;
                const T* qrow = Q + (size_t)row * p.dim;
                for (int k = 0; k < p.dim; ++k) dot += Elem<T>::to_float(qrow[k]) * sd[t * p.dim + k];
                if (idx < 0 || dot > m) m = dot, idx = t0 + t - dr.begin;
            }
        }
        if (active && idx >= 0) {
            sum += m;
            if (ARGMAX) argmax_store(p, (size_t)b * p.max_lq + s, idx);
        }
    }
    // Fixed-order block reduction (deterministic).
    sum = warp_sum(sum);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        Acc total = 0;
        for (int k = 0; k < SIMT_THREADS / 32; ++k) total += partial[k];
        p.out[b] = (float)total;
    }
}

// Fills an int32 buffer (argmax = -1 before the forward writes the winners).
// Mirrors FillParams in src/cuda/memory.rs.
struct FillParams {
    int32_t* x;
    long long n;
    int32_t v;
};
extern "C" __global__ void maxsim_fill_i32(const FillParams p) {
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < p.n; k += (long long)gridDim.x * blockDim.x)
        p.x[k] = p.v;
}

#define MAXSIM_SIMT(NAME, T, ACC)                                                                          \
    extern "C" __global__ void __launch_bounds__(SIMT_THREADS) NAME##_nograd(const MaxSimParams p) {  \
        maxsim_fwd_simt<T, ACC, false>(p);                                                               \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(SIMT_THREADS) NAME##_argmax(const MaxSimParams p) {  \
        maxsim_fwd_simt<T, ACC, true>(p);                                                                \
    }
MAXSIM_SIMT(maxsim_simt_f16, __half, float)
MAXSIM_SIMT(maxsim_simt_bf16, __nv_bfloat16, float)
MAXSIM_SIMT(maxsim_simt_f32, float, float)
MAXSIM_SIMT(maxsim_simt_f64, double, double)
