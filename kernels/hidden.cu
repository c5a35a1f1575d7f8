// Fused D-side projection head (sm_90a wgmma):
//   score[i, j] = sum_s max_t <Q[i, s], normalize?(H[j, t] . W^T + b)>
// without writing the projected documents anywhere but shared memory.
//
// A block owns one document (and a chunk of whole queries). For each chunk of
// BD = 128 document rows it projects H[rows, dmodel] . W^T on tensor cores
// (both operands staged per 64 columns of dmodel), adds the bias, normalizes
// each row and stores the chunk as a swizzled wgmma B tile; then every query
// tile of its chunk passes over that one projection (each document row is
// projected once, not once per query block). The running max of each query
// row over the document's chunks lives in shared memory; at the end the block
// sums them per query and writes its column of scores.
//
// Both phases share one cp.async ring of stages, so the next chunk's hidden
// states load while the last query tiles of this chunk are scored.
#include "common.cuh"

// Mirrors HiddenParams in src/cuda/hidden.rs.
struct HiddenParams {
    const void* q;          // [Nq * Lq, dout] query rows (already projected)
    const void* h;          // [Nd * Ld, dmodel] document hidden states
    const void* w;          // [dout, dmodel]
    const float* bias;      // [dout], or null
    const uint8_t* d_valid; // [Nd * Ld] row validity, or null
    float* out;             // [Nq, Nd]
    int32_t nq, lq, nd, ld, dmodel, dout;
    int32_t normalize;
    int32_t q_chunk; // query rows per block (whole queries); grid = Nd x ceil(Nq * Lq / q_chunk)
};

#ifdef MAXSIM_HOPPER

// The HIDDEN_TILE row of kernels/tiles.def.
#define HIDDEN_TILE(BD_, BQ_, KS_, STAGES_, THREADS_)                                  \
    struct HiddenTile {                                                                 \
        static constexpr int BD = BD_, BQ = BQ_, KS = KS_, STAGES = STAGES_, NTHREADS = THREADS_; \
    };
#include "tiles.def"
#undef HIDDEN_TILE

template <typename T, int DPAD_> struct HiddenConfig {
    static constexpr int DPAD = DPAD_;           // dout padded: projection N, MaxSim K
    static constexpr int BD = HiddenTile::BD;    // document rows per chunk (64 per warpgroup in the projection)
    static constexpr int BQ = HiddenTile::BQ;    // query rows per MaxSim step (64 per warpgroup)
    static constexpr int KS = HiddenTile::KS;    // dmodel columns per projection step: one 128-byte swizzled panel
    static constexpr int STAGES = HiddenTile::STAGES;
    static constexpr int LOOK = STAGES - 2; // steps loaded ahead (MaxSim tiles are read one step late)
    static constexpr int NTHREADS = HiddenTile::NTHREADS;
    static constexpr int PROJ_ELEMS = (BD + DPAD) * KS; // H slice, then W slice
    static constexpr int STAGE_ELEMS = PROJ_ELEMS > BQ * DPAD ? PROJ_ELEMS : BQ * DPAD;
    static constexpr int DCHUNK_ELEMS = BD * DPAD;
    static_assert((STAGE_ELEMS * sizeof(T)) % 1024 == 0, "stages stay 1024-aligned for the swizzle");
};

// cp.async of rows [row0, row0 + ROWS) x columns [col0, col0 + 8 * NCH) of a
// row-major [*, stride] matrix into a 128-byte swizzled tile; rows >= nrows
// and columns >= ncols are zero-filled (ncols % 8 == 0).
template <typename C, int ROWS, int NCH, typename T>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int stride, int row0, int nrows, int col0, int ncols) {
    static_assert((C::NTHREADS / NCH) % 8 == 0, "each thread keeps its swizzle phase");
    const auto swz = [](int r, int ch) { return swizzle128<ROWS>(r, ch); };
    cp_async_tile<C::NTHREADS, ROWS, NCH, 64>(dst, swz, src, stride, row0, nrows, col0, ncols);
}

// Bulk prefetch of `bytes` (a multiple of 16) at byte offset `off` of `base` into L2.
template <typename T> __device__ __forceinline__ void prefetch_l2(const T* base, size_t off, size_t bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(reinterpret_cast<const char*>(base) + off),
                 "r"((uint32_t)bytes)
                 : "memory");
}

template <typename C, typename T>
__device__ __forceinline__ void hidden_fwd(const HiddenParams& p) {
    constexpr int BD = C::BD, BQ = C::BQ, KS = C::KS, DPAD = C::DPAD, STAGES = C::STAGES;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // An offset from smem_raw, not an integer cast: the compiler then keeps
    // the shared address space (LDS / STS for the maxima, bias and chunk).
    unsigned char* base = smem_raw + ((1024 - ((uint32_t)__cvta_generic_to_shared(smem_raw) & 1023)) & 1023);
    T* stages = reinterpret_cast<T*>(base);
    T* dchunk = stages + STAGES * C::STAGE_ELEMS;                   // projected chunk, [BD, DPAD] swizzled
    float* sbias = reinterpret_cast<float*>(dchunk + C::DCHUNK_ELEMS); // [DPAD]
    float* runmax = sbias + DPAD;                                    // [q_chunk] running max per query row

    {   // The host sizes this layout (src/cuda/hidden.rs); a mismatch must fail loudly, not corrupt memory.
        uint32_t dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if ((unsigned char*)(runmax + p.q_chunk) > smem_raw + dyn) __trap();
    }
    const T* Q = static_cast<const T*>(p.q);
    const T* H = static_cast<const T*>(p.h);
    const T* W = static_cast<const T*>(p.w);
    const int j = blockIdx.x % p.nd, qc = blockIdx.x / p.nd;
    const int qr0 = qc * p.q_chunk, qr1 = min(qr0 + p.q_chunk, p.nq * p.lq);
    const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
    const int g = lane / 4, c = lane % 4;
    const int psteps = (p.dmodel + KS - 1) / KS, qsteps = (qr1 - qr0 + BQ - 1) / BQ;
    const int per_chunk = psteps + qsteps;
    const int total = (p.ld + BD - 1) / BD * per_chunk; // steps
    const int drow0 = j * p.ld;
    const int ksteps = (p.dout + 15) / 16;

    for (int k = tid; k < DPAD; k += C::NTHREADS) sbias[k] = p.bias && k < p.dout ? p.bias[k] : 0.f;
    for (int r = tid; r < qr1 - qr0; r += C::NTHREADS) runmax[r] = MAXSIM_NEG_INF;

    // Step it: projection step s < psteps of chunk it / per_chunk (64 columns
    // of H and W), or query tile s - psteps scored against that chunk.
    auto load_step = [&](int it) {
        T* st = stages + (it % STAGES) * C::STAGE_ELEMS;
        const int ci = it / per_chunk, s = it % per_chunk;
        if (s < psteps) {
            const int r0 = ci * BD;
            load_tile<C, BD, KS / 8>(st, H, p.dmodel, drow0 + r0, min(BD, p.ld - r0), s * KS, p.dmodel);
            load_tile<C, DPAD, KS / 8>(st + BD * KS, W, p.dmodel, 0, p.dout, s * KS, p.dmodel);
        } else {
            const int q0 = qr0 + (s - psteps) * BQ;
            load_tile<C, BQ, DPAD / 8>(st, Q, p.dout, q0, qr1 - q0, 0, p.dout);
        }
    };
#pragma unroll
    for (int s = 0; s < C::LOOK; ++s) {
        if (s < total) load_step(s);
        cp_async_commit();
    }

    // Each step: its tile landed and is visible to the tensor cores; the
    // stage LOOK steps ahead is refilled (its last reader, step it - 2, has
    // completed: every step waits for the wgmma group before its own, and
    // each phase drains its groups at its end).
    auto begin_step = [&](int it) {
        cp_async_wait<C::LOOK - 1>();
        fence_proxy_async(); // this thread's copies and chunk stores, visible to the tensor cores
        __syncthreads();     // ... of every thread
        if (it + C::LOOK < total) load_step(it + C::LOOK);
        cp_async_commit();
        return (uint32_t)__cvta_generic_to_shared(stages + (it % STAGES) * C::STAGE_ELEMS);
    };
    // Row maxima of a finished S tile (MaxSim step qs) into the running
    // maxima; bit 2k + e of `valid`: this thread's column 8k + 2c + e is a
    // valid row (`full`: all are, in every thread). Four independent max
    // chains: with two warps per scheduler, a single chain's latency shows.
    auto reduce_tile = [&](const float* acc, int qs, uint32_t valid, bool full) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float m4[4] = {MAXSIM_NEG_INF, MAXSIM_NEG_INF, MAXSIM_NEG_INF, MAXSIM_NEG_INF};
            if (full) {
#pragma unroll
                for (int k = 0; k < BD / 8; ++k)
#pragma unroll
                    for (int e = 0; e < 2; ++e) m4[(2 * k + e) % 4] = fmaxf(m4[(2 * k + e) % 4], acc[4 * k + 2 * h + e]);
            } else {
#pragma unroll
                for (int k = 0; k < BD / 8; ++k)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        m4[(2 * k + e) % 4] = (valid >> (2 * k + e)) & 1u ? fmaxf(m4[(2 * k + e) % 4], acc[4 * k + 2 * h + e])
                                                                          : m4[(2 * k + e) % 4];
            }
            const float m = lane_max<3>(fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3])));
            const int rl = qs * BQ + wg * 64 + warp * 16 + h * 8 + g;
            if (c == 0 && qr0 + rl < qr1) runmax[rl] = fmaxf(runmax[rl], m);
        }
    };
    // MaxSim step qs: S = Q[64 query rows of this warpgroup] . chunk^T issued
    // into `acc`; the previous step's tile (in `prev`) reduced while it runs.
    const uint32_t chunk_addr = (uint32_t)__cvta_generic_to_shared(dchunk);
    auto maxsim_step = [&](float* acc, float* prev, int it, int qs, uint32_t valid, bool full) {
        const uint32_t a_addr = begin_step(it) + wg * 64 * 128;
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < DPAD / 16; ++ks)
            if (ks < ksteps) // zero columns past dout are skipped
                WgmmaSS<T, BD>::run(acc, wgmma_desc_sw128(a_addr + (ks / 4) * BQ * 128 + (ks % 4) * 32),
                                    wgmma_desc_sw128(chunk_addr + (ks / 4) * BD * 128 + (ks % 4) * 32), ks > 0);
        wgmma_commit();
        if (qs > 0) {
            wgmma_wait<1>();
            fence_regs<BD / 2>(prev);
            reduce_tile(prev, qs - 1, valid, full);
        }
    };

    int it = 0;
    const int nchunks = (p.ld + BD - 1) / BD;
    for (int ci = 0; ci < nchunks; ++ci) {
        const int r0 = ci * BD;
        // The next chunk's hidden states (contiguous rows) stream into L2
        // while this chunk is projected and scored (the first chunk's too, at the start).
        for (int pc = ci == 0 ? 0 : ci + 1; pc <= ci + 1 && pc < nchunks; ++pc)
            if (tid < 16) {
                const size_t bytes = (size_t)min(BD, p.ld - pc * BD) * p.dmodel * sizeof(T);
                const size_t piece = (bytes + 255) / 256 * 16, off = tid * piece;
                if (off < bytes) prefetch_l2(H + (size_t)(drow0 + pc * BD) * p.dmodel, off, min(piece, bytes - off));
            }
        // Accumulators are zeroed where their lifetime starts: the wgmma asm
        // reads them ("+f"), which would otherwise keep them live across phases.
        float pacc[DPAD / 2]; // projection of this warpgroup's 64 chunk rows (m64 x DPAD)
#pragma unroll
        for (int k = 0; k < DPAD / 2; ++k) pacc[k] = 0.f;
        for (int s = 0; s < psteps; ++s, ++it) {
            // pacc (+)= H[64 rows of this warpgroup, 64 cols] . W[DPAD, 64 cols]^T
            const uint32_t st_addr = begin_step(it);
            const uint32_t a_addr = st_addr + wg * 64 * 128, b_addr = st_addr + BD * KS * (int)sizeof(T);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < KS / 16; ++kk)
                WgmmaSS<T, DPAD>::run(pacc, wgmma_desc_sw128(a_addr + kk * 32), wgmma_desc_sw128(b_addr + kk * 32),
                                      s > 0 || kk > 0);
            wgmma_commit();
            // The next step's wgmmas queue behind these (same accumulators, in
            // order): only the group before is waited for, whose stage is refilled next.
            wgmma_wait<1>();
        }
        wgmma_wait<0>();
        fence_regs<DPAD / 2>(pacc);
        // Bias, L2 norm of each row (its DPAD columns sit on one quad), rounded
        // once into the chunk tile. The previous chunk's MaxSim steps are done.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = wg * 64 + warp * 16 + h * 8 + g;
            float ss = 0.f;
#pragma unroll
            for (int k = 0; k < DPAD / 8; ++k)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float v = pacc[4 * k + 2 * h + e] + sbias[8 * k + 2 * c + e];
                    pacc[4 * k + 2 * h + e] = v;
                    ss += v * v;
                }
            ss = lane_sum<4>(ss);
            const float inv = p.normalize ? inv_l2norm(ss) : 1.f;
#pragma unroll
            for (int k = 0; k < DPAD / 8; ++k)
                *reinterpret_cast<uint32_t*>(dchunk + swizzle128<BD>(row, k) + 2 * c) =
                    pack2<T>(pacc[4 * k + 2 * h] * inv, pacc[4 * k + 2 * h + 1] * inv);
        }
        static_assert(BD / 8 * 2 == 32, "one bit per column of this thread");
        uint32_t valid = 0;
#pragma unroll
        for (int k = 0; k < BD / 8; ++k)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int t = r0 + 8 * k + 2 * c + e;
                const bool ok = t < p.ld && (!p.d_valid || p.d_valid[drow0 + t]);
                valid |= (uint32_t)ok << (2 * k + e);
            }
        const bool full = __all_sync(0xffffffffu, valid == 0xffffffffu) != 0; // block-uniform in practice

        // MaxSim steps in pairs, so that both accumulators stay in registers.
        float acc0[BD / 2], acc1[BD / 2];
#pragma unroll
        for (int k = 0; k < BD / 2; ++k) acc0[k] = acc1[k] = 0.f;
        int qs = 0;
        for (; qs + 1 < qsteps; qs += 2, it += 2) {
            maxsim_step(acc0, acc1, it, qs, valid, full);
            maxsim_step(acc1, acc0, it + 1, qs + 1, valid, full);
        }
        if (qs < qsteps) maxsim_step(acc0, acc1, it++, qs++, valid, full);
        wgmma_wait<0>();
        fence_regs<BD / 2>(acc0);
        fence_regs<BD / 2>(acc1);
        if ((qsteps - 1) % 2) reduce_tile(acc1, qsteps - 1, valid, full);
        else reduce_tile(acc0, qsteps - 1, valid, full);
    }
    cp_async_wait<0>();
    __syncthreads();
    // Scores of the block's queries against document j: one warp per query;
    // rows that met no valid document row add 0.
    for (int qi = qr0 / p.lq + tid / 32; qi < qr1 / p.lq; qi += C::NTHREADS / 32) {
        float sum = 0.f;
        for (int r = lane; r < p.lq; r += 32) {
            const float v = runmax[qi * p.lq - qr0 + r];
            sum += v > MAXSIM_NEG_INF ? v : 0.f;
        }
        sum = warp_sum(sum);
        if (lane == 0) p.out[(size_t)qi * p.nd + j] = sum;
    }
}

// Entry points: maxsim_hidden_<dtype>_d<DPAD> (dout <= DPAD, dout % 8 == 0, dmodel % 8 == 0).
#define MAXSIM_HIDDEN(TNAME, T, DPAD)                                                                          \
    extern "C" __global__ void __launch_bounds__(HiddenConfig<T, DPAD>::NTHREADS, 1)                          \
        maxsim_hidden_##TNAME##_d##DPAD(const HiddenParams p) {                                               \
        hidden_fwd<HiddenConfig<T, DPAD>, T>(p);                                                               \
    }
MAXSIM_HIDDEN(f16, __half, 64)
MAXSIM_HIDDEN(f16, __half, 128)
MAXSIM_HIDDEN(bf16, __nv_bfloat16, 64)
MAXSIM_HIDDEN(bf16, __nv_bfloat16, 128)

#endif // MAXSIM_HOPPER
