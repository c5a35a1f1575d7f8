// The MaxSim forward's pipelined mainloop: a block's query tile against
// its documents' tiles through a ring of STAGES shared-memory stages filled
// by a loader policy, mma.sync on sm_80+ (wgmma for the non-specialized
// Hopper tiles), every thread both loading and computing.
#pragma once
#include "maxsim_fwd_load.cuh"
#include "maxsim_fwd_epilogue.cuh"

#if __CUDA_ARCH__ >= 750

// ---------------------------------------------------------------------------
// The MMA step: S = Q_tile . D_tile^T into acc. Hopper: one wgmma per 16
// columns of dim (the first overwrites the accumulators), `overlap` run
// between issue and wait; mma.sync: `overlap` first, then the MMAs (A from
// `a`, or for A_SMEM tiles from the staged Q rows `sq`, this warp's from
// row 16 * MT * wm).
// ---------------------------------------------------------------------------
template <typename C, typename T, typename Overlap>
__device__ __forceinline__ void mma_step(typename Frag<T>::Acc (&acc)[C::MT][C::NT][4],
                                         const uint32_t (&a)[C::MT][C::AK][Frag<T>::AREGS], const T* sd, int wn,
                                         int lane, Overlap overlap, const T* sq, int wm) {
#ifdef MAXSIM_HOPPER
    if constexpr (C::HOPPER) {
        auto* d = &acc[0][0][0];
        const uint32_t sd_addr = (uint32_t)__cvta_generic_to_shared(sd);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < C::KSTEPS; ++ks)
            Wgmma<T, C::BD>::run(d, a[0][ks], wgmma_desc_sw128(sd_addr + (ks / 4) * C::BD * 128 + (ks % 4) * 32), ks > 0);
        wgmma_commit();
        overlap();
        wgmma_wait<0>();
        fence_regs<C::NT * 4>(d);
    } else
#endif
    {
    overlap();
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0;
#pragma unroll
    for (int ks = 0; ks < C::KSTEPS; ++ks) {
        uint32_t as[C::MT][Frag<T>::AREGS];
        if constexpr (C::A_SMEM) {
#pragma unroll
            for (int mt = 0; mt < C::MT; ++mt)
                Frag<T>::load_a(as[mt], sq, C::SROW, (wm * C::MT + mt) * 16 + lane / 4, ks * Frag<T>::K, lane % 4);
        }
#pragma unroll
        for (int nt = 0; nt < C::NT; nt += 2) {
            uint32_t b[4];
            const int mi = lane / 8;
            const int row = wn * C::NT * 8 + nt * 8 + (mi / 2) * 8 + lane % 8;
            ldmatrix_x4(b, sd + row * C::SROW + ks * Frag<T>::K + (mi % 2) * (Frag<T>::K / 2));
#pragma unroll
            for (int mt = 0; mt < C::MT; ++mt)
                Frag<T>::mma2(acc[mt][nt], acc[mt][nt + 1], C::A_SMEM ? as[mt] : a[mt][ks % C::AK], b);
        }
    }
    }
}

// ---------------------------------------------------------------------------
// The kernel: a block's query chunks against its documents, through the
// Loader's pipeline of STAGES tiles, mma_step, and the RowMax epilogue.
// ---------------------------------------------------------------------------
template <typename C, typename T, bool ARGMAX, template <typename, typename> class Loader>
__device__ __forceinline__ void maxsim_fwd_mma(const MaxSimParams& p) {
    using Epilogue = RowMax<C, T, ARGMAX>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* base = smem_raw;
    // An offset from smem_raw, not an integer cast: the compiler then keeps
    // the shared address space (LDS / STS for masks and scales).
    if (C::HOPPER) base = smem_raw + ((1024 - ((uint32_t)__cvta_generic_to_shared(smem_raw) & 1023)) & 1023);
    T* sbuf = reinterpret_cast<T*>(base);
    uint8_t* smask = base + (C::Q_ELEMS + C::STAGES * C::TILE_ELEMS) * sizeof(T);
    __shared__ float red_m[C::WN][C::BQ];
    __shared__ int red_i[ARGMAX ? C::WN : 1][C::BQ];
    __shared__ float rowval[C::BQ];
    __shared__ int row_q[C::BQ], row_s[C::BQ]; // query of each tile row (-1: padding or masked), position
    __shared__ ChunkQuery cq[C::BQ];           // rows of each query of the group
    __shared__ float row_scale[C::SCALED ? C::BQ : 1]; // 8-bit: each tile row's query-token scale
    T* sq = sbuf;               // [BQ, SROW] query staging (mma.sync only)
    T* sd0 = sbuf + C::Q_ELEMS; // STAGES document tiles
    float* sscale = reinterpret_cast<float*>(smask + C::MASK_BYTES); // 8-bit: [STAGES, BD] document-token scales
    // Loader state after the tiles' masks (and scales).
    Loader<C, T> loader(p, sd0, smask + C::MASK_BYTES + C::SCALE_BYTES);

    {   // src/cuda/maxsim_fwd.rs sizes this layout from kernels/tiles.def; a mismatch must fail loudly.
        uint32_t dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (loader.end() > smem_raw + dyn) __trap();
    }
    const T* Q = static_cast<const T*>(p.q);
    const BlockWork w = block_work(p, blockIdx.x);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int wm = warp / C::WN, wn = warp % C::WN;
    const int g = lane / 4, c = lane % 4;
    zero_outputs(p, w, tid, C::NTHREADS);
    loader.init();
    __syncthreads();
    const int grow0 = q_rows(p, w.q_begin).begin, grow1 = q_rows(p, w.q_end - 1).end;
    const int nchunks = (grow1 - grow0 + C::BQ - 1) / C::BQ;

    for (int ch = 0; ch < nchunks; ++ch) {
        const int r0 = grow0 + ch * C::BQ, r1 = min(r0 + C::BQ, grow1);
        // Row metadata of this chunk.
        for (int r = tid; r < C::BQ; r += C::NTHREADS) row_q[r] = -1;
        __syncthreads();
        chunk_rows<C::SCALED>(p, w, r0, r1, tid, C::NTHREADS, row_q, row_s, cq, row_scale);
        // A step's tile, and the validity of its columns (read by the epilogue
        // only for masked or partial tiles).
        auto issue = [&](int stage, const DocSteps<C>& s) {
            int start, n;
            s.rows(p, start, n);
            loader.issue(stage, start, n);
            // (Braced: nvcc 13.0 drops the statement after an unbraced
            // discarded `if constexpr` inside this lambda.)
            if constexpr (C::SCALED) {
                for (int r = tid; r < C::BD; r += C::NTHREADS) {
                    const bool ok = r < n;
                    cp_async4(sscale + stage * C::BD + r, p.d_scales + (ok ? start + r : 0), ok ? 4 : 0);
                }
            }
            if (p.d_valid || n < C::BD)
                for (int r = tid; r < C::BD; r += C::NTHREADS)
                    smask[stage * C::BD + r] = r < n && (!p.d_valid || p.d_valid[start + r]);
        };

        // Prologue: Q (group 0) and the first STAGES-1 document tiles in flight together.
        if (!C::HOPPER) load_rows<C, C::BQ>(sq, Q, r0, r1 - r0, p.dim, p.vec_ok);
        cp_async_commit();
        DocSteps<C> load_at(p, w.d_begin, w.d_end);
        loader.begin(load_at);
#pragma unroll
        for (int s = 0; s < C::STAGES - 1; ++s) {
            if (load_at.more()) issue(s, load_at), load_at.advance(p);
            cp_async_commit(); // possibly empty: keeps the group count uniform
            loader.issued();
        }
        uint32_t a[C::MT][C::AK][Frag<T>::AREGS];
        if (C::HOPPER) {
            // A fragments straight from global memory, while the first tiles load.
#pragma unroll
            for (int mt = 0; mt < C::MT; ++mt) q_frags(a[mt], Q, r0 + (wm * C::MT + mt) * 16 + g, r1, c, p);
        }
        loader.first_ready();
        __syncthreads();
        if (!C::HOPPER && !C::A_SMEM) {
#pragma unroll
            for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
                for (int ks = 0; ks < C::KSTEPS; ++ks)
                    Frag<T>::load_a(a[mt][ks], sq, C::SROW, (wm * C::MT + mt) * 16 + g, ks * Frag<T>::K, c);
        }

        Epilogue epi;
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) epi.reset(mt, h);
        const uint32_t keep = p.dim >= 0 ? ~(uint32_t)Epilogue::PLOW : 0u;

        DocSteps<C> at(p, w.d_begin, w.d_end);
        for (int it = 0; at.more(); ++it) {
            const int stage = it % C::STAGES, j = at.j, k = at.k;
            const Range dr = d_rows(p, j);
            const int ntiles = (dr.end - dr.begin + C::BD - 1) / C::BD;
            const int n = min(C::BD, dr.end - dr.begin - k * C::BD);
            cp_async_wait<Loader<C, T>::WAIT>(); // this step's tile has landed
#ifdef MAXSIM_HOPPER
            if (C::HOPPER) fence_proxy_async(); // ... and is visible to the tensor cores' reads
#endif
            __syncthreads();                // ... for every thread; and the stage refilled below is free
            // The copies STAGES-1 steps ahead run in the background.
            if (load_at.more()) issue((it + C::STAGES - 1) % C::STAGES, load_at), load_at.advance(p);
            cp_async_commit();
            loader.issued();

            typename Frag<T>::Acc acc[C::MT][C::NT][4];
            mma_step<C, T>(acc, a, sd0 + stage * C::TILE_ELEMS, wn, lane,
                           [&] { loader.prepare_next((it + 1) % C::STAGES); }, sq, wm);

            const int col0 = k * C::BD + wn * C::NT * 8 + 2 * c; // doc-local index of this thread's first column
            const int tcol = stage * C::BD + wn * C::NT * 8 + 2 * c; // ... and its slot in the stage's masks
            const bool full = n == C::BD && !p.d_valid;
            if constexpr (C::SCALED) {
                float sim[C::MT][C::NT][4];
                scale_similarities<C, T>(sim, acc, sscale + tcol);
                epi.update(sim, col0, full, smask + tcol, keep);
            } else {
                epi.update(acc, col0, full, smask + tcol, keep, p.lazy_cols > 0 && k * C::BD >= p.lazy_cols);
            }

            if (k == ntiles - 1) {
                // End of document j: rows reduced over the quad, then over the warps along N.
                epi.finish_doc(red_m, red_i, wm, wn, g, c);
                __syncthreads();
                for (int r = tid; r < C::BQ; r += C::NTHREADS) {
                    float mv = red_m[0][r];
                    int iv = ARGMAX ? red_i[0][r] : 0;
#pragma unroll
                    for (int x = 1; x < C::WN; ++x) {
                        if (ARGMAX) merge_max(mv, iv, red_m[x][r], red_i[x][r]);
                        else mv = fmaxf(mv, red_m[x][r]);
                    }
                    const bool has = mv > MAXSIM_NEG_INF;
                    const int qa = row_q[r];
                    if constexpr (C::SCALED) {
                        mv *= row_scale[r];
                    }
                    rowval[r] = (qa >= 0 && has) ? mv : 0.f;
                    if (ARGMAX && qa >= 0 && has)
                        argmax_store(p, (size_t)out_index(p, w, qa, j) * p.max_lq + row_s[r], iv);
                }
                __syncthreads();
                doc_scores<C::NWARPS>(p, w, cq, rowval, j, warp, lane);
            }
            at.advance(p);
        }
        cp_async_wait<0>();
        __syncthreads(); // the next chunk restages Q and the tiles
    }
}

#endif // __CUDA_ARCH__ >= 750
