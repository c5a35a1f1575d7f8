// The MaxSim forward's epilogue: each tile's row maxima (and argmax) in
// registers, the rows reduced at a document's end, the per-query sums into
// the output (owned and zeroed by the block), and the row metadata they
// need.
#pragma once
#include "maxsim_fwd_traits.cuh"

#if __CUDA_ARCH__ >= 750

// The block owns its outputs and zeroes them itself (no memset launch),
// threads [0, nthreads); empty queries and documents keep the 0.
__device__ __forceinline__ void zero_outputs(const MaxSimParams& p, const BlockWork& w, int tid, int nthreads) {
    if (w.pair >= 0) {
        if (tid == 0) p.out[w.pair] = 0.f;
        return;
    }
    const int nqg = w.q_end - w.q_begin, ndb = w.d_end - w.d_begin;
    for (int k = tid; k < nqg * ndb; k += nthreads)
        p.out[(size_t)(w.q_begin + k / ndb) * p.nd + w.d_begin + k % ndb] = 0.f;
}

// A query's rows within a query-row chunk: tile rows [lo, hi); `first`: the
// chunk holds its first row, and stores its sums (later chunks add to them).
struct ChunkQuery {
    int lo, hi;
    bool first;
};

// Row metadata of the block's query rows [r0, r1), by threads [0, nthreads)
// once row_q holds -1: each tile row's query (-1: masked; padding keeps the
// -1), its position in the query and, for 8-bit rows, its scale; each
// query's ChunkQuery.
template <bool SCALED>
__device__ __forceinline__ void chunk_rows(const MaxSimParams& p, const BlockWork& w, int r0, int r1, int tid,
                                           int nthreads, int* row_q, int* row_s, ChunkQuery* cq, float* row_scale) {
    for (int qi = tid; qi < w.q_end - w.q_begin; qi += nthreads) {
        const Range rr = q_rows(p, w.q_begin + qi);
        const int lo = max(rr.begin, r0) - r0, hi = max(min(rr.end, r1) - r0, lo);
        cq[qi] = ChunkQuery{lo, hi, rr.begin >= r0};
        for (int r = lo; r < hi; ++r) {
            const bool ok = !p.q_valid || p.q_valid[r0 + r];
            row_q[r] = ok ? w.q_begin + qi : -1;
            row_s[r] = r0 + r - rr.begin;
            if constexpr (SCALED) {
                row_scale[r] = p.q_scales[r0 + r];
            }
        }
    }
}

// End of document j: each query's sum of its row maxima `rowval` in this
// chunk, one warp per query, into its output. The query's first chunk stores
// it (no read of the output on the common path); later chunks add to it.
template <int NWARPS>
__device__ __forceinline__ void doc_scores(const MaxSimParams& p, const BlockWork& w, const ChunkQuery* cq,
                                           const float* rowval, int j, int warp, int lane) {
    for (int qi = warp; qi < w.q_end - w.q_begin; qi += NWARPS) {
        const ChunkQuery q = cq[qi];
        float s = 0.f;
        for (int r = q.lo + lane; r < q.hi; r += 32) s += rowval[r];
        s = warp_sum(s);
        if (lane == 0 && q.hi > q.lo) {
            float* o = p.out + out_index(p, w, w.q_begin + qi, j);
            if (q.first) *o = s;
            else *o += s;
        }
    }
}

// 8-bit tiles: the accumulators to F32 similarities, each times its
// document token's scale (`scale`: this thread's first column's), by Dot8.
template <typename C, typename T>
__device__ __forceinline__ void scale_similarities(float (&sim)[C::MT][C::NT][4],
                                                   const typename Frag<T>::Acc (&acc)[C::MT][C::NT][4],
                                                   const float* scale) {
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt) {
        const float2 s = *reinterpret_cast<const float2*>(scale + nt * 8);
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) sim[mt][nt][e] = Dot8<T>::scaled(acc[mt][nt][e], e % 2 ? s.y : s.x);
    }
}

// Max over a thread's 2 * NT values of one row of a tile, value(i) for
// i < 2 * NT, as a balanced tree: depth log2(2 * NT) instead of a dependent
// chain of 2 * NT, which the warp would wait out before the next barrier.
template <int NT, typename F> __device__ __forceinline__ float row_max(F value) {
    static_assert((NT & (NT - 1)) == 0, "a power of two");
    float v[2 * NT];
#pragma unroll
    for (int i = 0; i < 2 * NT; ++i) v[i] = value(i);
#pragma unroll
    for (int w = 1; w < 2 * NT; w *= 2)
#pragma unroll
        for (int i = 0; i + w < 2 * NT; i += 2 * w) v[i] = fmaxf(v[i], v[i + w]);
    return v[0];
}

// ---------------------------------------------------------------------------
// The epilogue of a tile: each thread's running (max, argmax) of its rows
// over the tile's valid columns. A partial or masked tile first sets its
// invalid similarities to -inf in place, then takes the full tile's path:
// one copy of each scan (the forward loops inline the epilogue at every
// unrolled step, and a scan per masked variant doubled their code).
// ---------------------------------------------------------------------------
template <typename C, typename T, bool ARGMAX> struct RowMax {
    // The argmax of 16-bit inputs rides in the similarities' low mantissa
    // bits (see argmax_pack); F32 keeps exact compare-and-select.
    static constexpr bool PACKED = ARGMAX && sizeof(T) == 2;
    static constexpr int PBITS = C::NT * 2 <= 8 ? 3 : C::NT * 2 <= 16 ? 4 : 5;
    static constexpr int PLOW = (1 << PBITS) - 1;
    static_assert(C::NT * 2 <= 32, "a thread's columns of a row fit in 5 bits");
    float m[C::MT][2];
    int idx[C::MT][2];

    __device__ __forceinline__ void reset(int mt, int h) { m[mt][h] = MAXSIM_NEG_INF, idx[mt][h] = -1; }

    // acc: the tile's similarities, overwritten where masked; col0:
    // doc-local index of this thread's first column; sm: its first column's
    // validity byte (read unless full); keep: ~PLOW in a register (not an
    // immediate), so that a pack is a single LOP3; lazy: the tile is far
    // enough into its document for the lazy scan (warp-uniform).
    __device__ __forceinline__ void update(float (&acc)[C::MT][C::NT][4], int col0, bool full, const uint8_t* sm,
                                           uint32_t keep, bool lazy = false) {
        // Before the masking, so that ptxas issues the vote (it depends on
        // the running maxima only) ahead of the wait for the tile's wgmma:
        // after the masking's branch, ColPali's argmax ran 10 % slower.
        bool above = true;
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) above &= m[mt][0] > 0.f && m[mt][1] > 0.f;
        [[maybe_unused]] const bool all_above = PACKED && __all_sync(0xffffffffu, above);
        if (!full) {
#pragma unroll
            for (int nt = 0; nt < C::NT; ++nt) {
                const bool ok0 = sm[nt * 8], ok1 = sm[nt * 8 + 1];
#pragma unroll
                for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[mt][nt][e] = (e % 2 ? ok1 : ok0) ? acc[mt][nt][e] : MAXSIM_NEG_INF;
            }
        }
        if constexpr (PACKED && C::HOPPER && C::NT >= 16) {
            // Long documents (nearest_centroids: every centroid a column of
            // one document): at a document's t-th tile a row's running
            // maximum rises with probability ~1/t, some row of the warp's 64
            // with ~64/t. Far enough in (`lazy`: MaxSimParams::lazy_cols),
            // one IMNMX3 per two similarities first asks whether any does
            // (as ints, exact: the running maxima are > 0, and a value that
            // does not exceed one as an int does not as a float, nor its
            // truncation); only then the packed scan. The same results.
            if (lazy && all_above) {
                bool rises = false;
#pragma unroll
                for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int run = __float_as_int(m[mt][h]);
                        rises |= int_max3<2 * C::NT + 1>([&](int i) {
                                     return i < 2 * C::NT ? __float_as_int(acc[mt][i / 2][h * 2 + i % 2]) : run;
                                 }) != run;
                    }
                if (!__any_sync(0xffffffffu, rises)) return;
            }
        }
        if constexpr (PACKED) {
            // One LOP3 + one FMNMX per similarity: the low PBITS mantissa
            // bits carry (PLOW - position among the thread's columns), so
            // the float max of a row's packed values is its first best
            // column (a masked -inf packs to a NaN, which the max skips).
            // A negative float orders those bits the other way (a larger
            // code is more negative), so this is exact only where a
            // negative maximum cannot matter: every row of the warp already
            // above zero, or holding a similarity >= 0 in this tile.
            // Otherwise compare and select on the truncated values.
            // Not yet above zero (a document's first tile): packing is
            // still exact unless some row's valid similarities are all
            // negative (or all masked: -inf), which an AND of their sign
            // bits finds cheaply.
            bool packable = all_above;
            if (!packable) {
                bool negative_row = false;
#pragma unroll
                for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        uint32_t all = ~0u;
#pragma unroll
                        for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
                            for (int e = 0; e < 2; ++e) all &= __float_as_uint(acc[mt][nt][h * 2 + e]);
                        negative_row |= (int)all < 0;
                    }
                packable = !__any_sync(0xffffffffu, negative_row);
            }
            if (packable) {
#pragma unroll
                for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const float pm = row_max<C::NT>(
                            [&](int i) { return argmax_pack(acc[mt][i / 2][h * 2 + i % 2], keep, PLOW - i); });
                        const uint32_t bits = __float_as_uint(pm);
                        const float tv = __uint_as_float(bits & keep);
                        const int pos = PLOW - (int)(bits & PLOW);
                        const bool u = tv > m[mt][h]; // strict: ties keep the earlier tile
                        m[mt][h] = u ? tv : m[mt][h];
                        idx[mt][h] = u ? col0 + (pos >> 1) * 8 + (pos & 1) : idx[mt][h];
                    }
            } else {
                scan_exact(acc, col0, keep);
            }
        } else if constexpr (!ARGMAX) {
            // Scores only: each row's tile max as a tree (log depth, not a
            // 2 * NT-long chain before the next barrier). Hopper tiles of
            // 128 columns: first as ints with the running max (int_max3),
            // exact unless a row's result is negative (all its values are:
            // a document's first tiles, masks), NaN or -0; the float tree
            // takes those tiles. Measured (H200, against the float tree):
            // scores 1.02-1.09x on 128-column tiles, 0.97x on 64-column ones
            // (8 maxima saved per row do not pay for the check and vote).
            // The packed argmax keeps FMNMX: as ints it measured 0.94-1.06x,
            // the spread of an unchanged kernel's reruns.
            constexpr bool INT_TREE = C::HOPPER && C::NT >= 16;
            bool exact = true;
            if constexpr (INT_TREE) {
                int r[C::MT][2];
#pragma unroll
                for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        r[mt][h] = int_max3<2 * C::NT + 1>([&](int i) {
                            return __float_as_int(i < 2 * C::NT ? acc[mt][i / 2][h * 2 + i % 2] : m[mt][h]);
                        });
                        exact &= (uint32_t)r[mt][h] <= 0x7f800000u;
                    }
                exact = __all_sync(0xffffffffu, exact);
                if (exact) {
#pragma unroll
                    for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
                        for (int h = 0; h < 2; ++h) m[mt][h] = __int_as_float(r[mt][h]);
                }
            }
            if (!INT_TREE || !exact) {
#pragma unroll
                for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        m[mt][h] =
                            fmaxf(m[mt][h], row_max<C::NT>([&](int i) { return acc[mt][i / 2][h * 2 + i % 2]; }));
            }
        } else {
            scan_exact(acc, col0, keep); // F32 argmax
        }
    }

    // Compare and select in column order (strict: ties keep the lower
    // index); 16-bit values truncated as packing truncates them, so that
    // both scans rank alike.
    __device__ __forceinline__ void scan_exact(const float (&acc)[C::MT][C::NT][4], int col0, uint32_t keep) {
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
            for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float v = PACKED ? __uint_as_float(__float_as_uint(acc[mt][nt][e]) & keep) : acc[mt][nt][e];
                    const bool u = v > m[mt][e / 2];
                    m[mt][e / 2] = u ? v : m[mt][e / 2];
                    idx[mt][e / 2] = u ? col0 + nt * 8 + e % 2 : idx[mt][e / 2];
                }
    }

    // End of a document: each row reduced over its quad into red_m / red_i
    // [WN][BQ] (this warp's slot along N), and the running values reset.
    __device__ __forceinline__ void finish_doc(float (*red_m)[C::BQ], int (*red_i)[C::BQ], int wm, int wn, int g, int c) {
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mv = m[mt][h];
                int iv = idx[mt][h];
                quad_max<ARGMAX>(mv, iv);
                if (c == 0) {
                    const int r = (wm * C::MT + mt) * 16 + h * 8 + g;
                    red_m[wn][r] = mv;
                    if (ARGMAX) red_i[wn][r] = iv;
                }
                reset(mt, h);
            }
    }
};

#endif // __CUDA_ARCH__ >= 750
