// FlashAttention-2 over packed variable-length sequences: bidirectional
// attention within each sequence (cu_seqlens), optionally limited to a
// sliding window |i - j| <= window. f16 / bf16 in, f32 accumulation on
// mma.sync m16n8k16 tensor cores (sm_80+; the sm_75 module has empty bodies
// and the host never launches them there). On sm_90a the forward at head
// dims 64 and 128 and the backward's dQ and dK dV at 64 run the wgmma
// versions of flash_attn_hopper.cuh instead (same outputs, same semantics).
//
// Forward: a block owns BM = 64 query rows of one (sequence, head), a warp
// one m16 tile of them; key / value tiles of BN rows stream through two
// cp.async stages while an online softmax (log2 domain, scale folded into
// exp2) keeps the running max and sum in registers. The probabilities stay
// in registers: the accumulator layout of two n8 tiles is the A operand of
// the P V MMA. It saves the log-sum-exp per row, never [L, L].
//
// Backward: delta = rowsum(dO . O) first (flash_delta), then two kernels
// that recompute P = exp2(scale_log2 s - lse) from the saved log-sum-exp:
// flash_bwd_dq over query blocks (dQ = scale dS K) and flash_bwd_dkdv over
// key blocks, a warp owning 16 keys (dV = P^T dO, dK = scale dS^T Q). Each
// gradient row is written by one warp: no atomics, the same bits every run.
// Operand tiles are row-major in shared memory with rows D + 8 elements apart
// (16 bytes of padding: ldmatrix row addresses hit distinct banks).
#include "common.cuh"

// Mirrors FlashParams in src/cuda/flash_attn.rs.
struct FlashParams {
    const void* q;      // rows q_row elements apart; head h at columns [h D, h D + D)
    const void* k;      // rows k_row apart
    const void* v;      // rows v_row apart
    const void* o;      // backward: the forward's output [T, H D]
    const void* dout;   // backward: dO [T, H D]
    void* out;          // forward: O [T, H D]; flash_bwd_dq: dQ [T, H D]
    void* dk;           // flash_bwd_dkdv: dK [T, H D]
    void* dv;           // flash_bwd_dkdv: dV [T, H D]
    float* lse;         // [H, T] log2-domain log-sum-exp of scale_log2 s (forward writes it)
    float* delta;       // [H, T] rowsum(dO . O)
    const uint32_t* cu; // [batch + 1] first row of each sequence
    long long q_row, k_row, v_row;
    int batch, heads, total, window; // window < 0: unlimited
    float scale_log2;                // softmax scale * log2(e)
    float scale;
};

#if __CUDA_ARCH__ >= 800
// Rows [row0, row0 + ROWS) of a sequence starting at global row `start`,
// columns [col0, col0 + D) of a row-major matrix with rows `stride` apart,
// into a shared tile with rows D + 8 apart; rows at or past `len` zero-filled.
template <int ROWS, int D, typename T>
__device__ __forceinline__ void fa_load(T* s, const T* g, long long stride, int start, int row0, int len, int col0) {
    constexpr int CH = D / 8, LD = D + 8;
    static_assert(ROWS * CH % 128 == 0, "whole passes of the 4 warps");
#pragma unroll
    for (int it = 0; it < ROWS * CH / 128; ++it) {
        const int i = threadIdx.x + it * 128, r = i / CH, c = i % CH;
        const bool ok = row0 + r < len;
        const T* src = ok ? g + (long long)(start + row0 + r) * stride + col0 + c * 8 : g;
        cp_async16_s((uint32_t)__cvta_generic_to_shared(s + r * LD + c * 8), src, ok ? 16 : 0);
    }
}

// The A fragment (m16 x k16) at (row0, k0) of a row-major tile.
template <int LD, typename T> __device__ __forceinline__ void fa_a(uint32_t* a, const T* s, int row0, int k0) {
    const int l = threadIdx.x % 32;
    ldmatrix_x4(a, s + (row0 + (l & 15)) * LD + k0 + (l >> 4) * 8);
}
// B fragments of the n8 tiles n0 and n0 + 8 (b[0..1], b[2..3]) at k0, from a
// tile whose rows are the n index (K-major: keys for Q K^T).
template <int LD, typename T> __device__ __forceinline__ void fa_b(uint32_t* b, const T* s, int n0, int k0) {
    const int l = threadIdx.x % 32;
    ldmatrix_x4(b, s + (n0 + (l & 7) + ((l >> 4) << 3)) * LD + k0 + ((l >> 3) & 1) * 8);
}
// The same from a tile whose rows are the k index (values for P V).
template <int LD, typename T> __device__ __forceinline__ void fa_bt(uint32_t* b, const T* s, int k0, int n0) {
    const int l = threadIdx.x % 32;
    ldmatrix_x4_trans(b, s + (k0 + (l & 7) + ((l >> 3) & 1) * 8) * LD + n0 + (l >> 4) * 8);
}
// The A fragment of columns [16 kk, 16 kk + 16) of a row of n8 accumulator tiles.
template <typename T> __device__ __forceinline__ void fa_acc_a(uint32_t* a, const float (*c)[4], int kk) {
    a[0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);
    a[1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);
    a[2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}
// acc[MT m16 tiles][N] += tile A (rows a_row0 + 16 m.., K = D) * tile B^T
// (rows n = 0..N, K-major). Each B fragment feeds all MT tiles: shared-memory
// reads per MMA fall as MT grows (at MT = 1 ldmatrix bandwidth caps the MMAs).
template <typename T, int D, int N, int LD, int MT>
__device__ __forceinline__ void fa_gemm_nt(float (*acc)[N / 8][4], const T* A, int a_row0, const T* B) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) fa_a<LD>(a[m], A, a_row0 + 16 * m, kk * 16);
#pragma unroll
        for (int nn = 0; nn < N / 16; ++nn) {
            uint32_t b[4];
            fa_b<LD>(b, B, nn * 16, kk * 16);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                Mma<T>::run(acc[m][2 * nn], a[m], b);
                Mma<T>::run(acc[m][2 * nn + 1], a[m], b + 2);
            }
        }
    }
}
// acc[MT][D] += P[MT m16 tiles][K] (accumulator registers) * tile B (rows k = 0..K, N-major).
template <typename T, int D, int K, int LD, int MT>
__device__ __forceinline__ void fa_gemm_pn(float (*acc)[D / 8][4], float (*p)[K / 8][4], const T* B) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) fa_acc_a<T>(a[m], p[m], kk);
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
            uint32_t b[4];
            fa_bt<LD>(b, B, kk * 16, dn * 16);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                Mma<T>::run(acc[m][2 * dn], a[m], b);
                Mma<T>::run(acc[m][2 * dn + 1], a[m], b + 2);
            }
        }
    }
}
// 2^x as one MUFU.EX2, results below 2^-126 flushed to 0 (exp2f without
// fast math wraps it in a 3-instruction range fix-up; at dh 64 the
// forward's issue slots, not its tensor cores, are what bound it).
__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// Whether query i sees key j of a sequence of len rows.
__device__ __forceinline__ bool fa_visible(int i, int j, int len, int window) {
    return j < len && (window < 0 || abs(i - j) <= window);
}
// The block range [first, end) of the other side that rows [r0, r0 + R) of
// a sequence see, starting at a multiple of B.
template <int R, int B> __device__ __forceinline__ int2 fa_range(int r0, int len, int window) {
    int lo = 0, hi = len;
    if (window >= 0) {
        lo = max(0, r0 - window);
        hi = min(len, r0 + R + window);
    }
    return make_int2(lo / B * B, hi);
}
// Rows of n8 accumulator tiles written to a [*, H D] row-major T matrix:
// this lane's rows row0 + g and row0 + g + 8 of the sequence (those < len).
template <typename T, int D>
__device__ __forceinline__ void fa_store(void* out, const float (*acc)[4], float mul0, float mul1, int start, int row0,
                                         int len, int hd, int col0) {
    const int l = threadIdx.x % 32, g = l / 4, c = l % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = row0 + g + 8 * r;
        if (i >= len) continue;
        const float m = r ? mul1 : mul0;
        uint32_t* dst = reinterpret_cast<uint32_t*>(reinterpret_cast<T*>(out) + (long long)(start + i) * hd + col0 + 2 * c);
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) dst[dt * 4] = pack2<T>(acc[dt][2 * r] * m, acc[dt][2 * r + 1] * m);
    }
}
#endif

// Tiles: MT m16 tiles of rows per warp, 4 warps: blocks of BM = 64 MT rows
// (queries in the forward and dQ, keys in dK dV); N rows of the other side
// per pipeline step, two cp.async stages. The host picks MT per launch
// (src/cuda/flash_attn.rs) and mirrors these sizes.
template <int D, int MT> struct FaTile {
    static constexpr int LD = D + 8, BM = 64 * MT;
    // Forward: 64-row key steps; 32 at D = 128 with MT = 2 (o and s in 255 registers).
    static constexpr int FWD_N = D == 128 && MT == 2 ? 32 : 64;
    // Backward: 32-row steps at D = 128 (four accumulator sets in 255 registers).
    static constexpr int BWD_N = D == 128 ? 32 : 64;
};

template <typename T, int D, int MT> __device__ __forceinline__ void flash_fwd(const FlashParams& p) {
#if __CUDA_ARCH__ >= 800
    using Tr = FaTile<D, MT>;
    constexpr int BM = Tr::BM, BN = Tr::FWD_N, LD = Tr::LD;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    T* Qs = reinterpret_cast<T*>(fa_smem);
    T* Ks = Qs + BM * LD;
    T* Vs = Ks + 2 * BN * LD;
    const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
    const int start = p.cu[b], len = p.cu[b + 1] - start;
    if (m0 >= len) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const T *q = (const T*)p.q, *k = (const T*)p.k, *v = (const T*)p.v;
    const int2 kr = fa_range<BM, BN>(m0, len, p.window);
    const int nblk = (kr.y - kr.x + BN - 1) / BN;
    fa_load<BM, D>(Qs, q, p.q_row, start, m0, len, h * D);
    fa_load<BN, D>(Ks, k, p.k_row, start, kr.x, len, h * D);
    fa_load<BN, D>(Vs, v, p.v_row, start, kr.x, len, h * D);
    cp_async_commit();
    float o[MT][D / 8][4] = {};
    float mrow[MT][2], lrow[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) mrow[m][0] = mrow[m][1] = MAXSIM_NEG_INF, lrow[m][0] = lrow[m][1] = 0.f;
    const int row0 = m0 + warp * 16 * MT; // this warp's first row; lane rows row0 + 16 m + g (+ 8)
    for (int t = 0; t < nblk; ++t) {
        const int n0 = kr.x + t * BN;
        if (t + 1 < nblk) {
            const int st = (t + 1) & 1;
            fa_load<BN, D>(Ks + st * BN * LD, k, p.k_row, start, n0 + BN, len, h * D);
            fa_load<BN, D>(Vs + st * BN * LD, v, p.v_row, start, n0 + BN, len, h * D);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const T* Kt = Ks + (t & 1) * BN * LD;
        const T* Vt = Vs + (t & 1) * BN * LD;
        float s[MT][BN / 8][4] = {};
        fa_gemm_nt<T, D, BN, LD, MT>(s, Qs, warp * 16 * MT, Kt);
        const bool edge = n0 + BN > len || p.window >= 0;
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float x = s[m][nt][e] * p.scale_log2;
                    const int i = row0 + 16 * m + g + (e >> 1) * 8, j = n0 + nt * 8 + 2 * c + (e & 1);
                    s[m][nt][e] = edge && !fa_visible(i, j, len, p.window) ? MAXSIM_NEG_INF : x;
                }
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = MAXSIM_NEG_INF;
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[m][nt][2 * r], s[m][nt][2 * r + 1]));
                const float mnew = fmaxf(mrow[m][r], lane_max<3>(mx));
                const float base = mnew == MAXSIM_NEG_INF ? 0.f : mnew; // no visible key yet: every p is 0
                const float alpha = fa_exp2(mrow[m][r] - base);
                mrow[m][r] = mnew;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt) {
                    s[m][nt][2 * r] = fa_exp2(s[m][nt][2 * r] - base);
                    s[m][nt][2 * r + 1] = fa_exp2(s[m][nt][2 * r + 1] - base);
                    sum += s[m][nt][2 * r] + s[m][nt][2 * r + 1];
                }
                lrow[m][r] = lrow[m][r] * alpha + sum;
#pragma unroll
                for (int dt = 0; dt < D / 8; ++dt) {
                    o[m][dt][2 * r] *= alpha;
                    o[m][dt][2 * r + 1] *= alpha;
                }
            }
        fa_gemm_pn<T, D, BN, LD, MT>(o, s, Vt);
        __syncthreads();
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = lane_sum<4>(lrow[m][r]);
            inv[r] = l > 0.f ? 1.f / l : 0.f;
            const int i = row0 + 16 * m + g + 8 * r;
            if (c == 0 && i < len)
                p.lse[(long long)h * p.total + start + i] = l > 0.f ? mrow[m][r] + log2f(l) : INFINITY;
        }
        fa_store<T, D>(p.out, o[m], inv[0], inv[1], start, row0 + 16 * m, len, p.heads * D, h * D);
    }
#endif
}

#include "flash_attn_hopper.cuh"

// delta[h, t] = sum_d dO[t, h D + d] O[t, h D + d] in f32: a warp per (row, head).
template <typename T, int D> __device__ __forceinline__ void flash_delta(const FlashParams& p) {
    const int lane = threadIdx.x % 32;
    const long long n = (long long)p.total * p.heads, nw = (long long)gridDim.x * blockDim.x / 32;
    const T *o = (const T*)p.o, *dout = (const T*)p.dout;
    for (long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; w < n; w += nw) {
        const long long t = w / p.heads, h = w % p.heads, base = t * p.heads * D + h * D;
        float acc = 0.f;
#pragma unroll
        for (int d = lane; d < D; d += 32) acc += Elem<T>::to_float(o[base + d]) * Elem<T>::to_float(dout[base + d]);
        acc = warp_sum(acc);
        if (lane == 0) p.delta[h * p.total + t] = acc;
    }
}

template <typename T, int D, int MT> __device__ __forceinline__ void flash_bwd_dq(const FlashParams& p) {
#if __CUDA_ARCH__ >= 800
    using Tr = FaTile<D, MT>;
    constexpr int BM = Tr::BM, BN = Tr::BWD_N, LD = Tr::LD;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    T* Qs = reinterpret_cast<T*>(fa_smem);
    T* dOs = Qs + BM * LD;
    T* Ks = dOs + BM * LD;
    T* Vs = Ks + 2 * BN * LD;
    const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
    const int start = p.cu[b], len = p.cu[b + 1] - start;
    if (m0 >= len) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int hd = p.heads * D;
    const T *q = (const T*)p.q, *k = (const T*)p.k, *v = (const T*)p.v, *dout = (const T*)p.dout;
    const int2 kr = fa_range<BM, BN>(m0, len, p.window);
    const int nblk = (kr.y - kr.x + BN - 1) / BN;
    fa_load<BM, D>(Qs, q, p.q_row, start, m0, len, h * D);
    fa_load<BM, D>(dOs, dout, hd, start, m0, len, h * D);
    fa_load<BN, D>(Ks, k, p.k_row, start, kr.x, len, h * D);
    fa_load<BN, D>(Vs, v, p.v_row, start, kr.x, len, h * D);
    cp_async_commit();
    const int row0 = m0 + warp * 16 * MT;
    float lse[MT][2], delta[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = row0 + 16 * m + g + 8 * r;
            const long long at = (long long)h * p.total + start + i;
            lse[m][r] = i < len ? p.lse[at] : INFINITY; // rows past the sequence: p = 0
            delta[m][r] = i < len ? p.delta[at] : 0.f;
        }
    float dq[MT][D / 8][4] = {};
    for (int t = 0; t < nblk; ++t) {
        const int n0 = kr.x + t * BN;
        if (t + 1 < nblk) {
            const int st = (t + 1) & 1;
            fa_load<BN, D>(Ks + st * BN * LD, k, p.k_row, start, n0 + BN, len, h * D);
            fa_load<BN, D>(Vs + st * BN * LD, v, p.v_row, start, n0 + BN, len, h * D);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const T* Kt = Ks + (t & 1) * BN * LD;
        const T* Vt = Vs + (t & 1) * BN * LD;
        float s[MT][BN / 8][4] = {}, dp[MT][BN / 8][4] = {};
        fa_gemm_nt<T, D, BN, LD, MT>(s, Qs, warp * 16 * MT, Kt);
        fa_gemm_nt<T, D, BN, LD, MT>(dp, dOs, warp * 16 * MT, Vt);
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1;
                    const bool vis = fa_visible(row0 + 16 * m + g + 8 * r, n0 + nt * 8 + 2 * c + (e & 1), len, p.window);
                    const float pr = vis ? fa_exp2(fmaf(s[m][nt][e], p.scale_log2, -lse[m][r])) : 0.f;
                    s[m][nt][e] = pr * (dp[m][nt][e] - delta[m][r]);
                }
        fa_gemm_pn<T, D, BN, LD, MT>(dq, s, Kt);
        __syncthreads();
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) fa_store<T, D>(p.out, dq[m], p.scale, p.scale, start, row0 + 16 * m, len, hd, h * D);
#endif
}

template <typename T, int D, int MT> __device__ __forceinline__ void flash_bwd_dkdv(const FlashParams& p) {
#if __CUDA_ARCH__ >= 800
    using Tr = FaTile<D, MT>;
    constexpr int BK = Tr::BM, BQ = Tr::BWD_N, LD = Tr::LD;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    T* Ks = reinterpret_cast<T*>(fa_smem);
    T* Vs = Ks + BK * LD;
    T* Qs = Vs + BK * LD;
    T* dOs = Qs + 2 * BQ * LD;
    float* lse_s = reinterpret_cast<float*>(dOs + 2 * BQ * LD); // [2][BQ]
    float* delta_s = lse_s + 2 * BQ;                             // [2][BQ]
    const int b = blockIdx.z, h = blockIdx.y, n0 = blockIdx.x * BK;
    const int start = p.cu[b], len = p.cu[b + 1] - start;
    if (n0 >= len) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int hd = p.heads * D;
    const T *q = (const T*)p.q, *k = (const T*)p.k, *v = (const T*)p.v, *dout = (const T*)p.dout;
    const int2 qr = fa_range<BK, BQ>(n0, len, p.window);
    const int nblk = (qr.y - qr.x + BQ - 1) / BQ;
    // Stage st's query rows [m0, m0 + BQ): Q, dO (cp.async), lse and delta (plain stores).
    auto load_q = [&](int st, int m0) {
        fa_load<BQ, D>(Qs + st * BQ * LD, q, p.q_row, start, m0, len, h * D);
        fa_load<BQ, D>(dOs + st * BQ * LD, dout, hd, start, m0, len, h * D);
        if (threadIdx.x < BQ) {
            const int i = m0 + threadIdx.x;
            const long long at = (long long)h * p.total + start + i;
            lse_s[st * BQ + threadIdx.x] = i < len ? p.lse[at] : INFINITY;
            delta_s[st * BQ + threadIdx.x] = i < len ? p.delta[at] : 0.f;
        }
    };
    fa_load<BK, D>(Ks, k, p.k_row, start, n0, len, h * D);
    fa_load<BK, D>(Vs, v, p.v_row, start, n0, len, h * D);
    load_q(0, qr.x);
    cp_async_commit();
    const int row0 = n0 + warp * 16 * MT; // this warp's first key; lane keys row0 + 16 m + g (+ 8)
    float dk[MT][D / 8][4] = {}, dv[MT][D / 8][4] = {};
    for (int t = 0; t < nblk; ++t) {
        const int m0 = qr.x + t * BQ;
        if (t + 1 < nblk) {
            load_q((t + 1) & 1, m0 + BQ);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int st = t & 1;
        const T* Qt = Qs + st * BQ * LD;
        const T* dOt = dOs + st * BQ * LD;
        const float* lse = lse_s + st * BQ;
        const float* delta = delta_s + st * BQ;
        float s[MT][BQ / 8][4] = {}, dp[MT][BQ / 8][4] = {};
        fa_gemm_nt<T, D, BQ, LD, MT>(s, Ks, warp * 16 * MT, Qt); // S^T: keys x queries
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = nt * 8 + 2 * c + (e & 1), j = row0 + 16 * m + g + 8 * (e >> 1);
                    const bool vis = p.window < 0 || abs(m0 + col - j) <= p.window;
                    s[m][nt][e] = vis ? fa_exp2(fmaf(s[m][nt][e], p.scale_log2, -lse[col])) : 0.f; // P^T
                }
        fa_gemm_pn<T, D, BQ, LD, MT>(dv, s, dOt);
        fa_gemm_nt<T, D, BQ, LD, MT>(dp, Vs, warp * 16 * MT, dOt); // dP^T
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[m][nt][e] *= dp[m][nt][e] - delta[nt * 8 + 2 * c + (e & 1)]; // dS^T
        fa_gemm_pn<T, D, BQ, LD, MT>(dk, s, Qt);
        __syncthreads();
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        fa_store<T, D>(p.dk, dk[m], p.scale, p.scale, start, row0 + 16 * m, len, hd, h * D);
        fa_store<T, D>(p.dv, dv[m], 1.f, 1.f, start, row0 + 16 * m, len, hd, h * D);
    }
#endif
}

// Entry points: flash_<kernel>_<dtype>_d<D>_m<MT>.
#define FLASH_KERNEL(KERNEL, T, NAME, D, MT)                                                          \
    extern "C" __global__ void __launch_bounds__(128) flash_##KERNEL##_##NAME##_d##D##_m##MT(const FlashParams p) { \
        flash_##KERNEL<T, D, MT>(p);                                                                  \
    }
#define FLASH_KERNELS(T, NAME, D)                                                                          \
    FLASH_KERNEL(fwd, T, NAME, D, 1)                                                                       \
    FLASH_KERNEL(fwd, T, NAME, D, 2)                                                                       \
    FLASH_KERNEL(bwd_dq, T, NAME, D, 1)                                                                    \
    FLASH_KERNEL(bwd_dkdv, T, NAME, D, 1)                                                                  \
    extern "C" __global__ void flash_delta_##NAME##_d##D(const FlashParams p) { flash_delta<T, D>(p); }

FLASH_KERNELS(__half, f16, 32)
FLASH_KERNELS(__half, f16, 64)
FLASH_KERNELS(__half, f16, 128)
FLASH_KERNELS(__nv_bfloat16, bf16, 32)
FLASH_KERNELS(__nv_bfloat16, bf16, 64)
FLASH_KERNELS(__nv_bfloat16, bf16, 128)
#ifdef MAXSIM_HOPPER
// The sm_90a module's wgmma kernels (flash_attn_hopper.cuh): flash_fwd_wg_<dtype>_d<D>,
// flash_bwd_dq_wg_<dtype>_d64, flash_bwd_dkdv_wg_<dtype>_d64.
#define FLASH_WG(T, NAME)                                                                               \
    extern "C" __global__ void __launch_bounds__(fa_wg::THREADS, fa_wg::FwdTile<64>::MIN_BLOCKS)       \
        flash_fwd_wg_##NAME##_d64(const FlashParams p) {                                                \
        if (p.scale_log2 < 0.f) /* see fa_wg::fwd */                                                    \
            fa_wg::fwd<T, 64, true>(p);                                                                 \
        else                                                                                            \
            fa_wg::fwd<T, 64, false>(p);                                                                \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(fa_wg::THREADS, fa_wg::FwdTile<128>::MIN_BLOCKS)      \
        flash_fwd_wg_##NAME##_d128(const FlashParams p) {                                               \
        if (p.scale_log2 < 0.f) /* see fa_wg::fwd */                                                    \
            fa_wg::fwd<T, 128, true>(p);                                                                \
        else                                                                                            \
            fa_wg::fwd<T, 128, false>(p);                                                               \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(fa_wg::THREADS, fa_wg::BwdTile::DQ_MIN_BLOCKS)        \
        flash_bwd_dq_wg_##NAME##_d64(const FlashParams p) {                                             \
        fa_wg::bwd_dq<T>(p);                                                                             \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(fa_wg::THREADS, fa_wg::BwdTile::DKDV_MIN_BLOCKS)      \
        flash_bwd_dkdv_wg_##NAME##_d64(const FlashParams p) {                                           \
        fa_wg::bwd_dkdv<T>(p);                                                                           \
    }
FLASH_WG(__half, f16)
FLASH_WG(__nv_bfloat16, bf16)
#endif
// dQ with 32 rows per warp up to D = 64 (at 128 its accumulators spill).
FLASH_KERNEL(bwd_dq, __half, f16, 32, 2)
FLASH_KERNEL(bwd_dq, __half, f16, 64, 2)
FLASH_KERNEL(bwd_dq, __nv_bfloat16, bf16, 32, 2)
FLASH_KERNEL(bwd_dq, __nv_bfloat16, bf16, 64, 2)
