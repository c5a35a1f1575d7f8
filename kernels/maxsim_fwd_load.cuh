// The MaxSim forward's loaders: query rows and fragments from global
// memory, and the document-tile loader policies of the pipelined mainloop
// (dense rows by cp.async; PLAID-compressed rows decompressed in shared
// memory).
#pragma once
#include "maxsim_fwd_scheduler.cuh"
#include "residual.cuh"

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

#endif // __CUDA_ARCH__ >= 750
