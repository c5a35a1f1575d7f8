// Fused residual scoring for short queries (Lq <= 32), sm_80+ (mma.sync):
//   score[i, j] = sum_s max_t <Q[i, s], normalize?(centroids[code[t]] + buckets[bits(t)])>
// with the documents' tokens decompressed straight into tensor-core A
// fragments: no decompressed tile in shared memory, no block barrier.
//
// A warp owns one (query, document) task at a time, taken from a global
// counter (documents differ in length), and walks the document 16 tokens per
// step: m16n8k16 with the 16 tokens as A (M) and the query's 32 rows as B
// (N, held in registers for as long as the warp stays on one query).
//
// The fragment layout is what makes decoding cheap. Lane (g, c) of the A
// fragment holds tokens g and g + 8 at logical columns {2c, 2c+1, 2c+8, 2c+9}
// of each 16-column k-step. A dot product does not care about the order of
// the features as long as A and B agree, so logical column (ks, j) of quad
// lane c is mapped to stored feature c * DIM/4 + 4 * ks + j: each lane then
// decodes one contiguous quarter of each of its two tokens (16-byte centroid
// loads, one residual word or two), the quad together holds whole rows (the
// L2 norm is a two-step quad sum), and B is read with the same map.
//
// Normalization scales the S tile's rows by 1/|token| (f32) instead of the
// A elements: 16 multiplies per lane and step instead of 64. The A elements
// are the unnormalized decoded values rounded to the query dtype (the tile
// and decompression kernels round after normalizing): the same relative
// error at ColBERT magnitudes.
#include "residual.cuh"

// Mirrors ResScoreParams in src/cuda/residual.rs.
struct ResScoreParams {
    const void* q;            // [Nq * lq, dim] query rows (already normalized if asked)
    const void* centroids;    // [n_centroids, dim] in CT
    const float* buckets;     // [2^nbits] bucket weights
    const void* codes;        // [T] U32, or I64 when codes_i64
    const uint8_t* residuals; // [T, dim * nbits / 8] packed bucket indices
    const uint32_t* cu_d;     // [Nd + 1] packed documents, or null: padded
    const uint32_t* d_lens;   // padded: [Nd] tokens of document j (rows j * ld onward)
    float* out;               // [Nq, Nd]
    uint32_t* work;           // [1], zeroed by the host: the next task
    unsigned int* bad;        // host-mapped flag: set on an out-of-range code
    int32_t nq, nd, lq, ld;
    int32_t n_centroids, nbits, colbert_order, normalize, codes_i64;
    // Pair mode: task t scores query pair_q[t] against document pair_d[t]
    // into out[t] (pair_d[t] = 0xffffffff: no document, -inf); null: the
    // cross product, task i * nd + j.
    const uint32_t* pair_q;
    const uint32_t* pair_d;
    int32_t n_pairs;
};

#if __CUDA_ARCH__ >= 800

template <int BYTES> struct Vec;
template <> struct Vec<16> { using type = uint4; };
template <> struct Vec<8> { using type = uint2; };

// Geometry of one lane's share of a token (see the top of the file).
template <typename CT, int DIM, int NBITS> struct ResLane {
    static constexpr int KS = DIM / 16;          // k-steps
    static constexpr int F = DIM / 4;            // features per lane per token
    static constexpr int CB = F * 2;             // centroid bytes per lane per token
    static constexpr int CV = CB % 16 == 0 ? 16 : 8;
    static constexpr int NCV = CB / CV;          // centroid vector loads
    static constexpr int SB = F * NBITS / 8;     // residual bytes per lane per token
    static constexpr int RU = SB % 16 == 0 ? 16 : SB % 8 == 0 ? 8 : SB % 4 == 0 ? 4 : 2; // residual load unit
    static constexpr int RW = (SB + 3) / 4;      // residual words
    static constexpr int NT = 4;                 // 32 query rows: 4 n-tiles of 8
    using CVec = typename Vec<CV>::type;
    static_assert(sizeof(CT) == 2 && DIM % 16 == 0 && SB % 2 == 0, "lane geometry");
};

// The residual bytes [0, SB) of this lane's share into words, little-endian.
template <int SB, int RU, int RW>
__device__ __forceinline__ void load_res(uint32_t (&w)[RW], const uint8_t* src, bool ok) {
    if constexpr (RU >= 4) {
#pragma unroll
        for (int u = 0; u < SB / RU; ++u) {
            if constexpr (RU == 16) {
                const uint4 v = ok ? __ldg(reinterpret_cast<const uint4*>(src) + u) : make_uint4(0, 0, 0, 0);
                w[4 * u] = v.x, w[4 * u + 1] = v.y, w[4 * u + 2] = v.z, w[4 * u + 3] = v.w;
            } else if constexpr (RU == 8) {
                const uint2 v = ok ? __ldg(reinterpret_cast<const uint2*>(src) + u) : make_uint2(0, 0);
                w[2 * u] = v.x, w[2 * u + 1] = v.y;
            } else {
                w[u] = ok ? __ldg(reinterpret_cast<const unsigned int*>(src) + u) : 0u;
            }
        }
    } else { // 2-byte units (e.g. 6 bytes at dim 96, nbits 2)
#pragma unroll
        for (int k = 0; k < RW; ++k) w[k] = 0u;
#pragma unroll
        for (int u = 0; u < SB / 2; ++u) {
            const uint32_t v = ok ? __ldg(reinterpret_cast<const unsigned short*>(src) + u) : 0u;
            w[u / 2] |= v << (16 * (u % 2));
        }
    }
}

// `width` bits at bit `pos` of the words (pos % width == 0, width divides 32).
template <int RW> __device__ __forceinline__ uint32_t bits_at(const uint32_t (&w)[RW], int pos, int width) {
    return (w[pos / 32] >> (pos % 32)) & ((1u << width) - 1u);
}

template <typename T, typename CT, int DIM, int NBITS>
__device__ __forceinline__ void res_score(const ResScoreParams& p, const float2* pair_tab, const float* tab) {
    using L = ResLane<CT, DIM, NBITS>;
    using CVec = typename L::CVec;
    constexpr int KS = L::KS, F = L::F, NT = L::NT, VF = L::CV / 2; // VF: features per centroid vector
    const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const T* Q = static_cast<const T*>(p.q);
    const CT* cents = static_cast<const CT*>(p.centroids);
    const int ntasks = p.pair_q ? p.n_pairs : p.nq * p.nd;

    uint32_t b[NT][KS][2]; // the current query's B fragments
    int cur_q = -1;
    for (;;) {
        // Unsigned: the counter runs past ntasks by up to one fetch per warp.
        uint32_t task = 0;
        if (lane == 0) task = atomicAdd(p.work, 1u);
        task = __shfl_sync(0xffffffffu, task, 0);
        if (task >= (uint32_t)ntasks) break;
        int i, j;
        if (p.pair_q) { // warp-uniform: every lane holds the same task
            const uint32_t pq = __ldg(p.pair_q + task), pd = __ldg(p.pair_d + task);
            if (pq >= (uint32_t)p.nq || pd >= (uint32_t)p.nd) {
                if (lane == 0) {
                    if (pd != 0xffffffffu || pq >= (uint32_t)p.nq) *p.bad = 2u; // 2: a pair index out of range
                    p.out[task] = MAXSIM_NEG_INF;
                }
                continue;
            }
            i = (int)pq, j = (int)pd;
        } else {
            i = (int)(task / (uint32_t)p.nd), j = (int)(task % (uint32_t)p.nd);
        }
        if (i != cur_q) {
            cur_q = i;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int s = nt * 8 + g;
                const T* row = Q + ((size_t)i * p.lq + (s < p.lq ? s : 0)) * DIM + c * F;
#pragma unroll
                for (int ks = 0; ks < KS; ++ks) {
                    const uint2 v = s < p.lq ? __ldg(reinterpret_cast<const uint2*>(row + 4 * ks)) : make_uint2(0, 0);
                    b[nt][ks][0] = v.x, b[nt][ks][1] = v.y;
                }
            }
        }
        int start, len;
        if (p.cu_d) start = (int)p.cu_d[j], len = (int)p.cu_d[j + 1] - start;
        else start = j * p.ld, len = (int)p.d_lens[j];

        // Pipeline: codes two steps ahead, centroid vectors and residual
        // bits one step ahead, each reloaded in place as soon as this step
        // has decoded it. Rows past the document read centroid 0 / its first
        // row (in bounds) and are masked out of the max.
        auto code_of = [&](int t) -> uint32_t {
            if (t >= len) return 0u;
            const size_t row = (size_t)start + t;
            uint32_t code;
            if (p.codes_i64) {
                const unsigned long long c64 = __ldg(static_cast<const unsigned long long*>(p.codes) + row);
                code = c64 < (unsigned long long)p.n_centroids ? (uint32_t)c64 : 0xffffffffu;
            } else {
                code = __ldg(static_cast<const uint32_t*>(p.codes) + row);
            }
            if (code >= (uint32_t)p.n_centroids) { // reported to the host, scored as centroid 0
                if (c == 0) *p.bad = 1u;
                code = 0u;
            }
            return code;
        };
        auto cen_src = [&](uint32_t code) { return reinterpret_cast<const CVec*>(cents + (size_t)code * DIM + c * F); };
        auto res_src = [&](int t) {
            return p.residuals + ((size_t)start + (t < len ? t : 0)) * (DIM * NBITS / 8) + c * L::SB;
        };
        CVec cen[2][L::NCV];
        uint32_t res[2][L::RW], code_next[2];
        if (len > 0) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint32_t code = code_of(g + 8 * h);
#pragma unroll
                for (int v = 0; v < L::NCV; ++v) cen[h][v] = __ldg(cen_src(code) + v);
                load_res<L::SB, L::RU, L::RW>(res[h], res_src(g + 8 * h), true);
                code_next[h] = code_of(16 + g + 8 * h);
            }
        }

        float run[NT][2]; // running max of query rows nt * 8 + 2c + e
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) run[nt][0] = run[nt][1] = MAXSIM_NEG_INF;
        for (int t0 = 0; t0 < len; t0 += 16) {
            const bool more = t0 + 16 < len;
            uint32_t rw[2][L::RW], code_after[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int k = 0; k < L::RW; ++k)
                    rw[h][k] = p.colbert_order ? __byte_perm(__brev(res[h][k]), 0, 0x0123) : res[h][k];
                if (more) load_res<L::SB, L::RU, L::RW>(res[h], res_src(t0 + 16 + g + 8 * h), true);
                code_after[h] = code_of(t0 + 32 + g + 8 * h);
            }
            // Per k-step: decode this lane's 4 features of both tokens into
            // one A fragment and issue its MMAs (A is never whole in registers).
            float ss[2] = {0.f, 0.f}, acc[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                uint32_t a[4];
                const int v = 4 * ks / VF, off = 4 * ks % VF;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const CT* ce = reinterpret_cast<const CT*>(&cen[h][v]) + off;
                    float x[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) x[e] = Elem<CT>::to_float(ce[e]);
                    // nbits 2: one lookup per feature pair in a 16-entry table (a
                    // float2 per bank pair: conflict-free); wider indices look up
                    // each feature (a 256-entry pair table would serialize on banks).
                    if constexpr (NBITS == 2) {
#pragma unroll
                        for (int e = 0; e < 4; e += 2) {
                            const float2 w = pair_tab[bits_at(rw[h], (4 * ks + e) * NBITS, 2 * NBITS)];
                            x[e] += w.x, x[e + 1] += w.y;
                        }
                    } else {
#pragma unroll
                        for (int e = 0; e < 4; ++e) x[e] += tab[bits_at(rw[h], (4 * ks + e) * NBITS, NBITS)];
                    }
#pragma unroll
                    for (int e = 0; e < 4; ++e) ss[h] = fmaf(x[e], x[e], ss[h]);
                    a[h] = pack2<T>(x[0], x[1]);     // columns 2c, 2c+1
                    a[h + 2] = pack2<T>(x[2], x[3]); // columns 2c+8, 2c+9
                    // This vector is decoded: the next step's takes its registers.
                    if (off + 4 == VF && more) cen[h][v] = __ldg(cen_src(code_next[h]) + v);
                }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) Mma<T>::run(acc[nt], a, b[nt][ks]);
            }
            float inv[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float s = lane_sum<4>(ss[h]); // the quad holds the row's columns
                inv[h] = p.normalize ? inv_l2norm(s) : 1.f;
                code_next[h] = code_after[h];
            }
            // Rows past the document: -inf.
            const bool ok0 = t0 + g < len, ok1 = t0 + g + 8 < len;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float v0 = ok0 ? acc[nt][e] * inv[0] : MAXSIM_NEG_INF;
                    const float v1 = ok1 ? acc[nt][2 + e] * inv[1] : MAXSIM_NEG_INF;
                    run[nt][e] = fmaxf(run[nt][e], fmaxf(v0, v1));
                }
        }

        // Max over the 8 token lanes of each column, then the sum over query rows.
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float m = lane_max<28>(run[nt][e]);
                // Rows past lq, and every row of an empty document, add 0.
                sum += nt * 8 + 2 * c + e < p.lq && m > MAXSIM_NEG_INF ? m : 0.f;
            }
        sum = lane_sum<4>(sum);
        if (lane == 0) p.out[p.pair_q ? (size_t)task : (size_t)i * p.nd + j] = sum;
    }
}

template <typename T, typename CT, int DIM>
__device__ __forceinline__ void res_score_entry(const ResScoreParams& p) {
    // Bucket weights: per feature pair (nbits 2: index = low feature's bits |
    // high feature's bits << 2), and per feature.
    __shared__ float2 pair_tab[16];
    __shared__ float tab[256];
    stage_buckets(tab, p.buckets, p.nbits);
    if (p.nbits == 2)
        for (int k = threadIdx.x; k < 16; k += blockDim.x) pair_tab[k] = make_float2(p.buckets[k % 4], p.buckets[k / 4]);
    __syncthreads();
    switch (p.nbits) {
    case 2: res_score<T, CT, DIM, 2>(p, pair_tab, tab); break;
    case 4: res_score<T, CT, DIM, 4>(p, pair_tab, tab); break;
    default: res_score<T, CT, DIM, 8>(p, pair_tab, tab); break;
    }
}

// Entry points: maxsim_res_<query dtype>_<centroid dtype>_d<DIM>.
#define MAXSIM_RES_SCORE(QN, T, CN, CT, DIM)                                                    \
    extern "C" __global__ void __launch_bounds__(128, 3) maxsim_res_##QN##_##CN##_d##DIM(const ResScoreParams p) { \
        res_score_entry<T, CT, DIM>(p);                                                           \
    }
#define MAXSIM_RES_SCORE_DIMS(QN, T, CN, CT) \
    MAXSIM_RES_SCORE(QN, T, CN, CT, 64)      \
    MAXSIM_RES_SCORE(QN, T, CN, CT, 96)      \
    MAXSIM_RES_SCORE(QN, T, CN, CT, 128)
MAXSIM_RES_SCORE_DIMS(f16, __half, f16, __half)
MAXSIM_RES_SCORE_DIMS(f16, __half, bf16, __nv_bfloat16)
MAXSIM_RES_SCORE_DIMS(bf16, __nv_bfloat16, f16, __half)
MAXSIM_RES_SCORE_DIMS(bf16, __nv_bfloat16, bf16, __nv_bfloat16)

#endif // __CUDA_ARCH__ >= 800

// Codes of compressed tokens as uint32 for the tile and decompression
// kernels, which index the centroids with them unchecked: `codes` holds n
// U32 (or I64 when codes_i64) codes; a token whose `valid` byte is 0 (a
// padding slot of the padded layout, whose code may hold anything) reads 0;
// an out-of-range code of a valid token reads 0 and sets the host-mapped
// flag `bad`, so that one launch replaces a cast, a select and a reduction.
// Mirrors CodesParams in src/cuda/residual.rs.
struct CodesParams {
    const void* codes;
    const uint8_t* valid;
    uint32_t* out;
    unsigned int* bad;
    long long n;
    long long n_centroids;
    int codes_i64;
};
extern "C" __global__ void residual_codes_u32(const CodesParams p) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < p.n; t += stride) {
        const long long c = p.codes_i64 ? static_cast<const long long*>(p.codes)[t]
                                        : (long long)static_cast<const uint32_t*>(p.codes)[t];
        const bool ok = c >= 0 && c < p.n_centroids;
        if (!ok && (p.valid == nullptr || p.valid[t])) *p.bad = 1u;
        p.out[t] = ok && (p.valid == nullptr || p.valid[t]) ? (uint32_t)c : 0u;
    }
}

// Residual compression (ResidualCodec::compress): packed bucket indices of
// x - centroids[code] for tokens x [n, dim] (T: f16 / bf16 / f32), one
// thread per output byte (8 / nbits features). A feature's bucket is the
// number of cutoffs below its residual (torch.bucketize, right=False), the
// cutoffs sorted ascending in shared memory; bits packed LSB-first or, for
// the ColBERT order, as np.packbits of each index's LSB-first bits.
template <typename T, typename CT>
__device__ void residual_compress(const T* x, const uint32_t* codes, const CT* cents, const float* cutoffs, int n_cut,
                                  long long n, int dim, int nbits, int colbert, uint8_t* out) {
    __shared__ float cut[255];
    for (int k = threadIdx.x; k < n_cut; k += blockDim.x) cut[k] = cutoffs[k];
    __syncthreads();
    const int per = 8 / nbits, w = dim / per;
    const long long total = n * w;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
        const long long t = e / w;
        const int byte = (int)(e % w);
        const uint32_t c = codes[t];
        uint32_t packed = 0;
        for (int f = 0; f < per; ++f) {
            const int k = byte * per + f;
            const float r = Elem<T>::to_float(x[t * dim + k]) - Elem<CT>::to_float(cents[(size_t)c * dim + k]);
            int lo = 0, hi = n_cut; // the number of cutoffs < r, by bisection
            while (lo < hi) {
                const int mid = (lo + hi) / 2;
                if (cut[mid] < r) lo = mid + 1;
                else hi = mid;
            }
            const uint32_t b = (uint32_t)lo;
            if (colbert) {
                const uint32_t rev = __brev(b) >> (32 - nbits); // the index's bits, LSB first, MSB-first in the byte
                packed |= rev << (8 - nbits * (f + 1));
            } else {
                packed |= b << (f * nbits);
            }
        }
        out[e] = (uint8_t)packed;
    }
}
// Mirrors CompressParams in src/cuda/residual.rs.
struct CompressParams {
    const void* x;        // [n, dim] tokens in T
    const uint32_t* codes; // [n], each < the centroid count
    const void* cents;    // [C, dim] in CT
    const float* cutoffs; // [n_cut], ascending
    uint8_t* out;         // [n, dim * nbits / 8]
    long long n;
    int n_cut, dim, nbits, colbert;
};
#define RESIDUAL_COMPRESS(XN, T, CN, CT)                                                                      \
    extern "C" __global__ void residual_compress_##XN##_##CN(const CompressParams p) {                        \
        residual_compress(static_cast<const T*>(p.x), p.codes, static_cast<const CT*>(p.cents), p.cutoffs, p.n_cut, \
                          p.n, p.dim, p.nbits, p.colbert, p.out);                                              \
    }
RESIDUAL_COMPRESS(f16, __half, f16, __half)
RESIDUAL_COMPRESS(bf16, __nv_bfloat16, f16, __half)
RESIDUAL_COMPRESS(f32, float, f16, __half)
RESIDUAL_COMPRESS(f16, __half, f32, float)
RESIDUAL_COMPRESS(bf16, __nv_bfloat16, f32, float)
RESIDUAL_COMPRESS(f32, float, f32, float)

#if __CUDA_ARCH__ >= 800
// Decompresses tokens [0, n) to dense [n, dim] rows in the query dtype
// (dim % 8 == 0), L2-normalized if asked: for gradients, and for scoring with
// the dense kernels. Each row is spread over `lanes` lanes (a power of two,
// at most 32) that take its 8-feature chunks in turn.
template <typename T>
__device__ void residual_decompress(const MaxSimParams& p, T* out, int n) {
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
// Mirrors DecompressParams in src/cuda/residual.rs: the codec in `f`'s
// res_* fields (codes validated), tokens [0, n) into out [n, dim].
struct DecompressParams {
    MaxSimParams f;
    void* out;
    int n;
};
extern "C" __global__ void residual_decompress_f16(const DecompressParams p) {
    residual_decompress(p.f, static_cast<__half*>(p.out), p.n);
}
extern "C" __global__ void residual_decompress_bf16(const DecompressParams p) {
    residual_decompress(p.f, static_cast<__nv_bfloat16*>(p.out), p.n);
}
#endif
