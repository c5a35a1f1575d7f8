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
#include "common.cuh"
#include "residual.cuh"

template <typename T, int DPAD_, int WM_, int WN_, int MT_, int NT_, int STAGES_, bool HOPPER_ = false,
          int KDIM_ = DPAD_>
struct TileConfig {
    using Elem = T;
    static constexpr int DPAD = DPAD_;       // stored tile width (64, 128 or 256; 128 for 8-bit)
    static constexpr int WM = WM_, WN = WN_; // warps along query rows / document columns
    static constexpr int MT = MT_, NT = NT_; // m16 tiles and n8 tiles per warp
    static constexpr int NWARPS = WM * WN, NTHREADS = 32 * NWARPS;
    static constexpr int BQ = WM * MT * 16;  // query rows per block
    static constexpr int BD = WN * NT * 8;   // document rows per pipeline stage
    // Columns multiplied: DPAD, or less for dims 48 and 96 and 8-bit dims
    // 32 to 96 (their tiles are stored wider, the zero columns past KDIM
    // are skipped).
    static constexpr int KSTEPS = KDIM_ / Frag<T>::K;
    static_assert(KDIM_ % Frag<T>::K == 0 && KDIM_ <= DPAD_, "KDIM");
    // Dims over 256: the A fragments of all K steps would not fit in
    // registers; each K step reads its own from the staged Q rows instead.
    static constexpr bool A_SMEM = KDIM_ > 256;
    static constexpr int AK = A_SMEM ? 1 : KSTEPS; // K steps of A held in registers
    static constexpr int STAGES = STAGES_;   // cp.async pipeline depth (tiles in flight + 1)
    static constexpr bool HOPPER = HOPPER_;  // wgmma (sm_90a) instead of mma.sync
    // 8-bit: per-token scales (F32) staged with each document tile.
    static constexpr bool SCALED = sizeof(T) == 1;
    // Hopper tiles ask for two resident blocks per SM (registers capped at 128
    // for 256 threads), so one block's epilogue overlaps the other's wgmma.
    static constexpr int MIN_BLOCKS = HOPPER ? 2 : 1;
    // Tile rows: padded by 16 B (conflict-free ldmatrix), or for wgmma
    // panels of [BD, 128 bytes], 128-byte swizzled.
    static constexpr int EPC = 16 / (int)sizeof(T); // elements per 16-byte chunk
    static constexpr int SROW = DPAD + EPC;
    static constexpr int ROW_STEP = HOPPER ? 8 * EPC : SROW;
    static constexpr int TILE_ELEMS = HOPPER ? BD * DPAD : BD * SROW;
    // mma.sync stages Q in its own rows so that the first D tiles load while Q
    // does; the Hopper path loads Q fragments straight from global memory.
    static constexpr int Q_ELEMS = HOPPER ? 0 : BQ * SROW;
    static constexpr int ALIGN_SLACK = HOPPER ? 1024 : 0; // swizzled tiles start 1024-aligned
    // Then the stages' masks and, for 8-bit tiles, their scales (16-byte aligned).
    static constexpr int MASK_BYTES = (STAGES * BD + 15) & ~15;
    static constexpr int SCALE_BYTES = SCALED ? STAGES * BD * 4 : 0;
    static constexpr int SMEM_BYTES =
        ALIGN_SLACK + (Q_ELEMS + STAGES * TILE_ELEMS) * (int)sizeof(T) + MASK_BYTES + SCALE_BYTES;
    // Element offset of 16-byte chunk `ch` of tile row `r`.
    static __device__ __forceinline__ int offset(int r, int ch) {
        if (HOPPER) return swizzle128<BD, EPC>(r, ch);
        return r * SROW + ch * EPC;
    }
    static_assert(NT % 2 == 0, "ldmatrix.x4 loads two n8 tiles");
    static_assert(!(HOPPER && A_SMEM), "wgmma tiles hold A in registers");
    static_assert(!HOPPER || (sizeof(T) <= 2 && WN == 1 && MT == 1 && WM % 4 == 0 && (BD == 64 || BD == 128) &&
                              DPAD % (8 * EPC) == 0),
                  "wgmma tiles: warpgroups along the query rows, the whole tile along N");
};

#if __CUDA_ARCH__ >= 750

// Copies rows [row0, row0 + n) of a [*, dim] matrix into a smem tile laid out
// by C::offset, zero-filling the padding columns and the rows past n. Async (cp.async,
// 16 B per thread per row, each thread always the same column) when rows are
// 16-byte aligned, plain loads otherwise.
template <typename C, int ROWS, typename T>
__device__ __forceinline__ void load_rows(T* smem, const T* g, int row0, int n, int dim, bool vec_ok) {
    constexpr int CHUNKS = C::DPAD / C::EPC;     // 16-byte chunks per row
    constexpr int RPP = C::NTHREADS / CHUNKS;    // rows per pass
    static_assert(C::NTHREADS % CHUNKS == 0 && ROWS % RPP == 0, "tile shape");
    static_assert(!C::HOPPER || RPP % 8 == 0, "each thread keeps its swizzle phase");
    if (vec_ok) {
        const auto offset = [](int r, int ch) { return C::offset(r, ch); };
        cp_async_tile<C::NTHREADS, ROWS, CHUNKS, C::ROW_STEP>(smem, offset, g, dim, row0, n, 0, dim);
    } else {
        for (int k = threadIdx.x; k < ROWS * C::DPAD; k += C::NTHREADS) {
            const int r = k / C::DPAD, col = k % C::DPAD;
            T v = T(0.0f);
            if (r < n && col < dim) v = g[(size_t)(row0 + r) * dim + col];
            smem[C::offset(r, col / C::EPC) + col % C::EPC] = v;
        }
    }
}

// ---------------------------------------------------------------------------
// The pipeline's steps: (document, tile of BD rows) of a block's non-empty
// documents, in order.
// ---------------------------------------------------------------------------
template <typename C> struct DocSteps {
    int j, k;    // document, tile within it
    int end;     // one past the block's last document
    __device__ __forceinline__ DocSteps(const MaxSimParams& p, int begin, int end_) : k(0), end(end_) {
        j = nonempty(p, begin);
    }
    __device__ __forceinline__ bool more() const { return j < end; }
    __device__ __forceinline__ int nonempty(const MaxSimParams& p, int from) const {
        while (from < end) {
            const Range dr = d_rows(p, from);
            if (dr.end > dr.begin) break;
            ++from;
        }
        return from;
    }
    __device__ __forceinline__ void advance(const MaxSimParams& p) {
        const Range dr = d_rows(p, j);
        if (++k * C::BD >= dr.end - dr.begin) j = nonempty(p, j + 1), k = 0;
    }
    // The step's document rows: [start, start + n).
    __device__ __forceinline__ void rows(const MaxSimParams& p, int& start, int& n) const {
        const Range dr = d_rows(p, j);
        start = dr.begin + k * C::BD, n = min(C::BD, dr.end - start);
    }
};

// A step as the warp-specialized producer hands it to the consumers with its
// tile (one per ring stage, written before the stage's `full` arrival): the
// consumers read it instead of walking the documents' offsets themselves.
enum : uint32_t { STEP_DOC_LAST = 1, STEP_CHUNK_LAST = 2 };
struct __align__(16) StepInfo {
    int j, col0, n;  // document, its column of the tile's first row, valid rows
    uint32_t flags;  // STEP_DOC_LAST: the document's last tile; STEP_CHUNK_LAST: the query chunk's last step
};

// ---------------------------------------------------------------------------
// Loader policies: how a step's document tile reaches its pipeline stage. The
// mainloop calls, in order:
//   init()              block-wide setup before the kernel's first barrier
//   begin(steps)        prologue work before the first tile is issued
//   issue(stage, start, n) cp.async of the step's rows into a stage (then a commit)
//   issued()            after each issue and commit
//   first_ready()       the prologue's wait for the first tile
//   prepare_next(stage) work overlapped with a step's MMA
// end() is one past the last shared-memory byte it uses.
// and waits for a step's tile with WAIT cp.async groups still in flight.
// A new document format is a new loader.
// ---------------------------------------------------------------------------

// Dense [Td, dim] rows, copied by cp.async STAGES-1 steps ahead.
template <typename C, typename T> struct DenseLoader {
    static constexpr int WAIT = C::STAGES - 2;
    const MaxSimParams& p;
    T* tiles;
    unsigned char* after_masks;
    __device__ __forceinline__ DenseLoader(const MaxSimParams& p_, T* tiles_, unsigned char* after_masks_)
        : p(p_), tiles(tiles_), after_masks(after_masks_) {}
    __device__ __forceinline__ const unsigned char* end() const { return after_masks; }
    __device__ __forceinline__ void init() {}
    __device__ __forceinline__ void begin(const DocSteps<C>&) {}
    __device__ __forceinline__ void issue(int stage, int start, int n) {
        load_rows<C, C::BD>(tiles + stage * C::TILE_ELEMS, static_cast<const T*>(p.d), start, n, p.dim, p.vec_ok);
    }
    __device__ __forceinline__ void issued() {}
    __device__ __forceinline__ void first_ready() { cp_async_wait<C::STAGES - 1>(); }
    __device__ __forceinline__ void prepare_next(int) {}
};

// PLAID-compressed tiles (dim % 8 == 0, residual rows a multiple of 4 bytes)
// in three steps, each thread always on the same (row, 16-byte chunk) slots:
//   codes:   the tile's codes into registers (plain loads, STAGES steps ahead);
//   gather:  cp.async of each row's centroid chunk straight into the tile
//            slot and of its packed residual bytes into `sres` (STAGES-1 ahead);
//   finish:  once landed, centroid + bucket weight per feature in place,
//            optionally L2-normalized across the row's lanes (one step ahead,
//            overlapped with the current step's MMA on Hopper).
// The residual loader's bucket weights (a named shared array, so that its
// reads are LDS and only the residual kernels allocate it).
__shared__ float res_tile_buckets[256];

template <typename C, typename T> struct ResidualLoader {
    static constexpr int CHUNKS = C::DPAD / 8, RPP = C::NTHREADS / CHUNKS, IT = C::BD / RPP;
    static_assert(C::NTHREADS % CHUNKS == 0 && C::BD % RPP == 0 && 32 % CHUNKS == 0, "tile shape");
    static_assert(C::STAGES >= 3, "residual pipeline: gathers 2+ steps ahead, finish 1 ahead");
    static constexpr int WAIT = C::STAGES - 3; // the next step's gathers have landed too
    const MaxSimParams& p;
    T* tiles;
    uint8_t* sres;     // residual bytes of each stage
    uint32_t code[IT]; // codes of the next tile to gather
    DocSteps<C> codes_at, finish_at;

    __device__ __forceinline__ ResidualLoader(const MaxSimParams& p_, T* tiles_, unsigned char* after_masks)
        : p(p_), tiles(tiles_), sres(after_masks), codes_at(p_, 0, 0), finish_at(p_, 0, 0) {}
    // Residual bytes staged per tile: a row's reads stay within DPAD * nbits / 8.
    __device__ __forceinline__ int stage_bytes() const { return C::BD * C::DPAD * p.res_nbits / 8; }
    __device__ __forceinline__ const unsigned char* end() const { return sres + C::STAGES * stage_bytes(); }
    __device__ __forceinline__ void init() { stage_buckets(res_tile_buckets, p.res_buckets, p.res_nbits); }
    __device__ __forceinline__ void load_codes() {
        int start, n;
        codes_at.rows(p, start, n);
        const int r0 = threadIdx.x / CHUNKS;
#pragma unroll
        for (int i = 0; i < IT; ++i) code[i] = r0 + i * RPP < n ? __ldg(p.res_codes + start + r0 + i * RPP) : 0u;
        codes_at.advance(p);
    }
    __device__ __forceinline__ void begin(const DocSteps<C>& first) {
        codes_at = finish_at = first;
        if (codes_at.more()) load_codes();
    }
    __device__ __forceinline__ void issue(int stage, int start, int n) {
        T* tile = tiles + stage * C::TILE_ELEMS;
        const int ch = threadIdx.x % CHUNKS, col = ch * 8, r0 = threadIdx.x / CHUNKS;
        const T* cents = static_cast<const T*>(p.res_centroids);
        const uint32_t dst = (uint32_t)__cvta_generic_to_shared(tile + C::offset(r0, ch));
#pragma unroll
        for (int i = 0; i < IT; ++i) {
            const bool ok = col < p.dim && r0 + i * RPP < n;
            cp_async16_s(dst + i * RPP * C::ROW_STEP * (int)sizeof(T), ok ? cents + (size_t)code[i] * p.dim + col : cents,
                         ok ? 16 : 0);
        }
        const int w4 = p.dim * p.res_nbits / 32; // 4-byte words per residual row
        const uint32_t* res = reinterpret_cast<const uint32_t*>(p.res_residuals) + (size_t)start * w4;
        uint32_t* dres = reinterpret_cast<uint32_t*>(sres + stage * stage_bytes());
        for (int e = threadIdx.x; e < C::BD * w4; e += C::NTHREADS) {
            const bool ok = e < n * w4;
            cp_async4(dres + e, ok ? res + e : res, ok ? 4 : 0);
        }
    }
    __device__ __forceinline__ void issued() {
        if (codes_at.more()) load_codes();
    }
    __device__ __forceinline__ void finish(int stage) {
        int start, n;
        finish_at.rows(p, start, n);
        T* tile = tiles + stage * C::TILE_ELEMS;
        const uint8_t* sr = sres + stage * stage_bytes();
        const int ch = threadIdx.x % CHUNKS, col = ch * 8, r0 = threadIdx.x / CHUNKS;
        const int w = p.dim * p.res_nbits / 8, nb = p.res_nbits;
#pragma unroll
        for (int i = 0; i < IT; ++i) {
            const int r = r0 + i * RPP;
            const bool ok = col < p.dim && r < n;
            uint4* slot = reinterpret_cast<uint4*>(tile + C::offset(r, ch));
            // Rows past n and columns past dim read zero-filled or neighbouring
            // bytes (in bounds) and are zeroed by a select, not a branch.
            float v[8], ss = 0.f;
            decode8<T>(*slot, chunk_bits<false>(sr + r * w + ch * nb, nb), nb, p.res_colbert_order, res_tile_buckets, v);
#pragma unroll
            for (int f = 0; f < 8; ++f) {
                v[f] = ok ? v[f] : 0.f;
                ss += v[f] * v[f];
            }
            if (p.res_normalize) {
                const float inv = inv_l2norm(lane_sum<CHUNKS>(ss)); // the row's lanes
#pragma unroll
                for (int f = 0; f < 8; ++f) v[f] *= inv;
            }
            *slot = pack8<T>(v);
        }
        finish_at.advance(p);
    }
    __device__ __forceinline__ void first_ready() {
        cp_async_wait<0>();
        __syncthreads();
        if (finish_at.more()) finish(0);
    }
    __device__ __forceinline__ void prepare_next(int stage) {
        if (finish_at.more()) finish(stage);
    }
};

// The 4 bytes of consecutive elements from (row, col) of Q as one A-fragment
// register (2 of 16-bit, 4 of 8-bit types), zero past the chunk's rows and
// past dim.
template <typename T>
__device__ __forceinline__ uint32_t q_word(const T* Q, int row, int row_end, int col, int dim, bool vec_ok) {
    constexpr int E = 4 / (int)sizeof(T);
    if (row >= row_end || col >= dim) return 0u;
    const T* x = Q + (size_t)row * dim + col;
    if (vec_ok) return __ldg(reinterpret_cast<const unsigned int*>(x)); // 16-byte rows: col + E <= dim
    if constexpr (E == 2) {
        unsigned short lo, hi = 0;
        T v = x[0];
        memcpy(&lo, &v, 2);
        if (col + 1 < dim) v = x[1], memcpy(&hi, &v, 2);
        return (uint32_t)lo | ((uint32_t)hi << 16);
    } else {
        const uint8_t* b = reinterpret_cast<const uint8_t*>(x);
        uint32_t w = 0;
#pragma unroll
        for (int e = 0; e < E; ++e) w |= col + e < dim ? (uint32_t)b[e] << (8 * e) : 0u;
        return w;
    }
}

// A warpgroup's A fragments of rows ra and ra + 8 (chunk rows end at r1),
// KS K steps, straight from global memory: the wgmma tiles stage no Q.
template <int KS, typename T>
__device__ __forceinline__ void q_frags(uint32_t (&a)[KS][Frag<T>::AREGS], const T* Q, int ra, int r1, int c,
                                        const MaxSimParams& p) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        const int col = ks * Frag<T>::K + (4 / (int)sizeof(T)) * c;
        a[ks][0] = q_word(Q, ra, r1, col, p.dim, p.vec_ok);
        a[ks][1] = q_word(Q, ra + 8, r1, col, p.dim, p.vec_ok);
        a[ks][2] = q_word(Q, ra, r1, col + Frag<T>::K / 2, p.dim, p.vec_ok);
        a[ks][3] = q_word(Q, ra + 8, r1, col + Frag<T>::K / 2, p.dim, p.vec_ok);
    }
}

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
    // immediate), so that a pack is a single LOP3.
    __device__ __forceinline__ void update(float (&acc)[C::MT][C::NT][4], int col0, bool full, const uint8_t* sm,
                                           uint32_t keep) {
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
                epi.update(acc, col0, full, smask + tcol, keep);
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
#ifdef MAXSIM_HOPPER
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
                    epi.update(acc, col0, full_tile, smask + tcol, keep);
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
extern "C" __global__ void maxsim_fill_i32(int32_t* x, long long n, int32_t v) {
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < n; k += (long long)gridDim.x * blockDim.x)
        x[k] = v;
}

#if __CUDA_ARCH__ >= 800
// Decompresses tokens [0, n) to dense [n, dim] rows in the query dtype
// (dim % 8 == 0), L2-normalized if asked: for gradients, and for scoring with
// the dense kernels. Each row is spread over `lanes` lanes (a power of two,
// at most 32) that take its 8-feature chunks in turn.
template <typename T>
__device__ void maxsim_decompress(const MaxSimParams& p, T* out, int n) {
    __shared__ float buckets[256];
    stage_buckets(buckets, p.res_buckets, p.res_nbits);
    __syncthreads();
    const int chunks = p.dim / 8;
    int lanes = 1;
    while (lanes < chunks && lanes < 32) lanes *= 2;
    const int lane = threadIdx.x % 32, rows_per_warp = 32 / lanes;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, nwarps = gridDim.x * blockDim.x / 32;
    for (int r0 = warp * rows_per_warp; r0 < n; r0 += nwarps * rows_per_warp) {
        const int r = r0 + lane / lanes;
        const bool ok = r < n;
        const uint32_t code = ok ? p.res_codes[r] : 0u;
        float v[8], inv = 1.f;
        if (chunks <= lanes) { // one chunk per lane: decompress once, norm across the row's lanes
            const int c = lane % lanes;
            const bool has = ok && c < chunks;
            float ss = 0.f;
            if (has) decompress8<T>(p, buckets, code, r, c * 8, v);
#pragma unroll
            for (int f = 0; f < 8; ++f) ss += has ? v[f] * v[f] : 0.f;
            ss = lane_sum_dyn(ss, lanes);
            inv = p.res_normalize ? inv_l2norm(ss) : 1.f;
#pragma unroll
            for (int f = 0; f < 8; ++f) v[f] *= inv;
            if (has) *reinterpret_cast<uint4*>(out + (size_t)r * p.dim + c * 8) = pack8<T>(v);
            continue;
        }
        if (p.res_normalize) { // a first pass for the norm (rows longer than the lanes)
            float ss = 0.f;
            for (int c = lane % lanes; ok && c < chunks; c += lanes) {
                decompress8<T>(p, buckets, code, r, c * 8, v);
#pragma unroll
                for (int f = 0; f < 8; ++f) ss += v[f] * v[f];
            }
            inv = inv_l2norm(lane_sum_dyn(ss, lanes));
        }
        for (int c = lane % lanes; ok && c < chunks; c += lanes) {
            decompress8<T>(p, buckets, code, r, c * 8, v);
#pragma unroll
            for (int f = 0; f < 8; ++f) v[f] *= inv;
            *reinterpret_cast<uint4*>(out + (size_t)r * p.dim + c * 8) = pack8<T>(v);
        }
    }
}
extern "C" __global__ void maxsim_decompress_f16(const MaxSimParams p, __half* out, int n) { maxsim_decompress(p, out, n); }
extern "C" __global__ void maxsim_decompress_bf16(const MaxSimParams p, __nv_bfloat16* out, int n) {
    maxsim_decompress(p, out, n);
}
#endif

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
