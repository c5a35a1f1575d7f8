// The MaxSim forward's warp-specialized Hopper mainloop (sm_90a): a TMA
// producer warp and consumer warpgroups running wgmma, overlapped across
// tiles and documents.
#pragma once
#include "maxsim_fwd_load.cuh"
#include "maxsim_fwd_epilogue.cuh"

#if __CUDA_ARCH__ >= 750
#ifdef MAXSIM_HOPPER

// ---------------------------------------------------------------------------
// Hopper, warp-specialized (FlashAttention-3's split of mainloop, epilogue
// and scheduler): a producer warp fills a ring of STAGES document tiles by
// TMA, each stage signalled on its `full` mbarrier (1 + 32 arrivals: the TMA
// issue with its bytes, then each producer lane after storing its masks and,
// lane 0, the step's StepInfo, while the copy runs; 8-bit tiles: + 32, each
// lane's cp.async of its token scales landing, so that no load latency
// stalls the producer); the consumer warpgroups (64 query rows each) wait
// on it, issue the tile's wgmma, run
// the previous tile's epilogue while it is in flight (two accumulator sets),
// and release the stage on its `empty` mbarrier, every consumer thread after
// its own mask and scale reads (a lane-0 arrival after __syncwarp orders the
// same accesses, but compute-sanitizer's racecheck reports it as a hazard).
// There is no block-wide barrier per tile: the consumers meet on a named
// barrier only at a document's end, to sum its rows. Persistent: block b walks the work items
// b, b + gridDim.x, ... (block_work's order) and the ring runs on across
// documents, query chunks and work items without draining. Each query chunk
// starts at slot 0 (each slot keeps its own barrier phase bit), so that the
// consumers' loop, unrolled by STAGES, sees every slot as a constant.
// ---------------------------------------------------------------------------
template <typename C> struct WsConfig {
    static constexpr int CONSUMERS = C::NTHREADS;     // 64 query rows per consumer warpgroup
    static constexpr int CWG = C::NWARPS / 4;
    static constexpr int NTHREADS = CONSUMERS + 128;  // + the producer warpgroup (one warp issues)
    static constexpr int PANELS = C::DPAD * (int)sizeof(typename C::Elem) / 128;
    static constexpr uint32_t STAGE_BYTES = C::TILE_ELEMS * sizeof(typename C::Elem);
    // Two consumer warpgroups need more than the 168 registers a 384-thread
    // block gets: the producer warpgroup gives its share back (40 for its
    // step walk and mask stores; FA3's TMA-only producer keeps 24).
    static constexpr bool REALLOC = CWG == 2;
    static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
    // setmaxnreg.inc blocks until the registers exist: what the producer
    // frees must cover what the consumers take (168 each at launch).
    static_assert(!REALLOC || 128 * (65536 / NTHREADS / 8 * 8 - PRODUCER_REGS) >=
                                  CONSUMERS * (CONSUMER_REGS - 65536 / NTHREADS / 8 * 8),
                  "register reallocation");
    static_assert(C::HOPPER && C::STAGES >= 3, "a tile in the MMA, one pending its epilogue, one loading");
};

template <typename C, typename T, bool ARGMAX>
__device__ __forceinline__ void maxsim_fwd_ws(const MaxSimParams& p, const TmaMap* dmap) {
    using W = WsConfig<C>;
    using Epilogue = RowMax<C, T, ARGMAX>;
    using Acc = typename Frag<T>::Acc;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // Aligned by an offset from smem_raw (not an integer cast), so that the
    // compiler keeps the shared address space: LDS / STS for the masks and
    // scales, not generic loads.
    unsigned char* base = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    T* sd0 = reinterpret_cast<T*>(base);
    uint8_t* smask = base + C::STAGES * C::TILE_ELEMS * sizeof(T);
    float* sscale = reinterpret_cast<float*>(smask + C::MASK_BYTES);
    __shared__ __align__(8) uint64_t full[C::STAGES], empty[C::STAGES];
    __shared__ StepInfo sstep[C::STAGES];
    __shared__ float rowval[2][C::BQ]; // a document's row maxima, double-buffered across documents
    __shared__ int row_q[C::BQ], row_s[C::BQ];
    __shared__ ChunkQuery cq[C::BQ];
    __shared__ float row_scale[C::SCALED ? C::BQ : 1];
    {   // src/cuda/maxsim_fwd.rs sizes this layout from kernels/tiles.def; a mismatch must fail loudly.
        uint32_t dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        const unsigned char* end = C::SCALED ? (const unsigned char*)(sscale + C::STAGES * C::BD) : smask + C::STAGES * C::BD;
        if (end > smem_raw + dyn) __trap();
    }
    const int tid = threadIdx.x, lane = tid % 32;
    if (tid == 0) {
        for (int s = 0; s < C::STAGES; ++s)
            mbar_init(&full[s], 1 + 32 + (C::SCALED ? 32 : 0)), mbar_init(&empty[s], W::CONSUMERS);
        mbar_init_fence();
    }
    __syncthreads();
    const int nwork = p.pair_q ? p.n_pairs : p.n_groups * ((p.nd + p.docs_per_block - 1) / p.docs_per_block);
    // The query-row chunks of a work item.
    auto chunks = [&](const BlockWork& w, int& grow0) {
        grow0 = q_rows(p, w.q_begin).begin;
        return (q_rows(p, w.q_end - 1).end - grow0 + C::BQ - 1) / C::BQ;
    };

    if (tid >= W::CONSUMERS) {
        // ---- Producer: one warp walks the consumers' sequence of steps.
        if constexpr (W::REALLOC) regs_decrease<W::PRODUCER_REGS>();
        if (tid - W::CONSUMERS >= 32) return;
        if (lane == 0) tma_prefetch(dmap);
        uint32_t phase = ~0u; // bit s: the parity of slot s's next `empty` wait (a fresh barrier passes 1)
        for (int b = blockIdx.x; b < nwork; b += gridDim.x) {
            const BlockWork w = block_work(p, b);
            int grow0;
            const int nch = chunks(w, grow0);
            for (int ch = 0; ch < nch; ++ch) {
                int stage = 0; // every query chunk starts at slot 0, as the consumers expect
                for (DocSteps<C> s(p, w.d_begin, w.d_end); s.more(); stage = stage + 1 == C::STAGES ? 0 : stage + 1) {
                    mbar_wait(&empty[stage], (phase >> stage) & 1);
                    phase ^= 1u << stage;
                    int start, n;
                    s.rows(p, start, n);
                    const int j = s.j, col0 = s.k * C::BD;
                    s.advance(p);
                    // The tile's TMA first, then its step, masks and scales
                    // (global loads the copy need not wait for), then each
                    // lane's arrival.
                    if (lane == 0) {
                        mbar_arrive_tx(&full[stage], W::STAGE_BYTES);
                        T* tile = sd0 + stage * C::TILE_ELEMS;
#pragma unroll
                        for (int pn = 0; pn < W::PANELS; ++pn)
                            tma_load_2d(tile + pn * C::BD * (128 / sizeof(T)), dmap, &full[stage],
                                        pn * (128 / (int)sizeof(T)), start);
                        sstep[stage] = StepInfo{j, col0, n,
                                                (s.j != j ? STEP_DOC_LAST : 0u) | (s.more() ? 0u : STEP_CHUNK_LAST)};
                    }
                    if (p.d_valid || n < C::BD)
                        for (int r = lane; r < C::BD; r += 32)
                            smask[stage * C::BD + r] = r < n && (!p.d_valid || p.d_valid[start + r]);
                    mbar_arrive(&full[stage]);
                    if constexpr (C::SCALED) {
                        for (int r = lane; r < C::BD; r += 32) {
                            const bool ok = r < n;
                            cp_async4(sscale + stage * C::BD + r, p.d_scales + (ok ? start + r : 0), ok ? 4 : 0);
                        }
                        mbar_arrive_cp_async(&full[stage]);
                    }
                }
            }
        }
        return;
    }

    // ---- Consumers.
    if constexpr (W::REALLOC) regs_increase<W::CONSUMER_REGS>();
    const T* Q = static_cast<const T*>(p.q);
    const int warp = tid / 32, g = lane / 4, c = lane % 4;
    auto consumers_sync = [] { named_barrier(1, W::CONSUMERS); };
    const uint32_t full_addr = smem_u32(full), empty_addr = smem_u32(empty), desc_lo = wgmma_desc_lo(smem_u32(sd0));
    uint32_t phase = 0; // bit s: the parity of slot s's next `full` wait
    int buf = 0;
    for (int b = blockIdx.x; b < nwork; b += gridDim.x) {
        const BlockWork w = block_work(p, b);
        zero_outputs(p, w, tid, W::CONSUMERS);
        int grow0;
        const int nch = chunks(w, grow0), grow1 = q_rows(p, w.q_end - 1).end;
        for (int ch = 0; ch < nch; ++ch) {
            const int r0 = grow0 + ch * C::BQ, r1 = min(r0 + C::BQ, grow1);
            consumers_sync(); // the previous chunk's row metadata is read
            for (int r = tid; r < C::BQ; r += W::CONSUMERS) row_q[r] = -1;
            consumers_sync();
            chunk_rows<C::SCALED>(p, w, r0, r1, tid, W::CONSUMERS, row_q, row_s, cq, row_scale);
            // This warp's A fragments (rows 16 * warp + g, + 8).
            uint32_t a[1][C::KSTEPS][Frag<T>::AREGS];
            q_frags(a[0], Q, r0 + warp * 16 + g, r1, c, p);
            consumers_sync(); // the row metadata is written

            Epilogue epi;
            epi.reset(0, 0), epi.reset(0, 1);
            const uint32_t keep = p.dim >= 0 ? ~(uint32_t)Epilogue::PLOW : 0u;
            // Waits for slot s's tile, issues its wgmma and returns its step.
            // The slot is a constant wherever the loop below calls this, so
            // its barrier, StepInfo and descriptors are fixed offsets from
            // the kernel's bases.
            auto issue = [&](Acc (&acc)[1][C::NT][4], const int s) {
                mbar_wait(full_addr + s * 8, (phase >> s) & 1);
                phase ^= 1u << s;
                const StepInfo st = sstep[s];
                auto* d = &acc[0][0][0];
                const uint32_t lo = desc_lo + s * (W::STAGE_BYTES >> 4);
                wgmma_start_biased<T, C::NT * 4>(d);
#pragma unroll
                for (int ks = 0; ks < C::KSTEPS; ++ks)
                    Wgmma<T, C::BD>::run(d, a[0][ks], wgmma_desc_sw128_lo(lo + ((ks / 4) * C::BD * 128 + (ks % 4) * 32) / 16),
                                         ks > 0 || Frag<T>::INT);
                wgmma_commit();
                return st;
            };
            // 8-bit: this thread's document-token scales of slot s, read
            // before the wait for its wgmma (in the SASS, ptxas keeps shared
            // loads after the WARPGROUP.DEPBAR, and the epilogue then stalls
            // on their latency: short scoreboard 1.33 cycles per issued
            // instruction at ColPali in-batch for e4m3).
            using Scales = float2[C::SCALED ? C::NT : 1];
            auto load_scales = [&](Scales& sc, const int s) {
                if constexpr (C::SCALED) {
                    const float* at_col = sscale + s * C::BD + 2 * c;
#pragma unroll
                    for (int nt = 0; nt < C::NT; ++nt) sc[nt] = *reinterpret_cast<const float2*>(at_col + nt * 8);
                }
            };
            // The epilogue of the step in slot s, its accumulators complete;
            // at its document's last tile the rows' maxima, then (after the
            // one barrier) the per-query sums.
            auto consume = [&](Acc (&acc)[1][C::NT][4], const StepInfo& st, const int s, const Scales& scales) {
                const int col0 = st.col0 + 2 * c, tcol = s * C::BD + 2 * c;
                const bool full_tile = st.n == C::BD && !p.d_valid;
                if constexpr (C::SCALED) {
                    // In place: the set becomes its F32 similarities (a
                    // second array spills beside the two sets).
                    auto& sim = reinterpret_cast<float(&)[1][C::NT][4]>(acc);
#pragma unroll
                    for (int nt = 0; nt < C::NT; ++nt) {
                        const float2 sc = scales[nt];
                        const float b0 = Dot8<T>::bias(sc.x), b1 = Dot8<T>::bias(sc.y);
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            sim[0][nt][e] = Dot8<T>::biased(acc[0][nt][e], e % 2 ? sc.y : sc.x, e % 2 ? b1 : b0);
                    }
                    epi.update(sim, col0, full_tile, smask + tcol, keep);
                } else {
                    epi.update(acc, col0, full_tile, smask + tcol, keep, p.lazy_cols > 0 && st.col0 >= p.lazy_cols);
                }
                mbar_arrive(empty_addr + s * 8); // this thread is done with the slot
                if (!(st.flags & STEP_DOC_LAST)) return;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float mv = epi.m[0][h];
                    int iv = epi.idx[0][h];
                    quad_max<ARGMAX>(mv, iv);
                    const int r = warp * 16 + h * 8 + g, qa = row_q[r];
                    const bool has = mv > MAXSIM_NEG_INF;
                    if constexpr (C::SCALED) {
                        mv *= row_scale[r];
                    }
                    if (c == 0) {
                        rowval[buf][r] = qa >= 0 && has ? mv : 0.f;
                        if (ARGMAX && qa >= 0 && has)
                            argmax_store(p, (size_t)out_index(p, w, qa, st.j) * p.max_lq + row_s[r], iv);
                    }
                    epi.reset(0, h);
                }
                consumers_sync();
                doc_scores<C::NWARPS>(p, w, cq, rowval[buf], st.j, warp, lane);
                buf ^= 1; // the next document's maxima go to the other buffer: no second barrier
            };
            if (!DocSteps<C>(p, w.d_begin, w.d_end).more()) continue; // no step in this chunk
            // Step i's wgmma runs while step i-1's epilogue does, with two
            // accumulator sets: the step in slot s uses set s % 2 (STAGES is
            // even). Each step is straight-line with its wgmma unconditional:
            // with the issue under a branch, ptxas 13.0 waits after every
            // wgmma (WARPGROUP.DEPBAR per HGMMA in the SASS) and nothing
            // overlaps.
            static_assert(C::STAGES % 2 == 0, "slots alternate the accumulator sets");
            Acc acc0[1][C::NT][4], acc1[1][C::NT][4];
            StepInfo pending = issue(acc0, 0);
            // The pending step (slot sp, set prev) is the chunk's last: its epilogue.
            auto drain = [&](Acc (&prev)[1][C::NT][4], const int sp) {
                Scales sc;
                load_scales(sc, sp);
                wgmma_wait<0>();
                fence_regs<C::NT * 4>(&prev[0][0][0]);
                consume(prev, pending, sp, sc);
            };
            // The next step's wgmma (slot s, set cur), then the pending one's epilogue.
            auto next = [&](Acc (&cur)[1][C::NT][4], Acc (&prev)[1][C::NT][4], const int s, const int sp) {
                Scales sc;
                load_scales(sc, sp);
                const StepInfo st = issue(cur, s);
                wgmma_wait<1>();
                fence_regs<C::NT * 4>(&prev[0][0][0]);
                consume(prev, pending, sp, sc);
                pending = st;
            };
            // Unrolled by STAGES: every slot a constant, so that its barrier,
            // StepInfo, masks, scales and wgmma descriptors are fixed offsets
            // from the kernel's bases (the descriptors in uniform registers,
            // no per-step slot arithmetic). The two sets stay two arrays
            // and the chunk's end a separate path per position: with one
            // [2] array and the end test inside a single step function,
            // ptxas 13.0 serialized every 8-bit wgmma (C7518).
            while (static_while<C::STAGES>([&](auto i_t) {
                constexpr int i = decltype(i_t)::value + 1, s = i % C::STAGES, sp = i - 1;
                auto& cur = i % 2 ? acc1 : acc0;
                auto& prev = i % 2 ? acc0 : acc1;
                if (pending.flags & STEP_CHUNK_LAST) {
                    drain(prev, sp);
                    return false;
                }
                next(cur, prev, s, sp);
                return true;
            })) {
            }
        }
    }
}

#endif // MAXSIM_HOPPER
#endif // __CUDA_ARCH__ >= 750
