// The varlen attention kernels on Hopper warpgroup MMA (sm_90a): the
// forward, dQ and dK dV of kernels/flash_attn.cu with the same semantics
// and outputs, for head dims 64 and 128 (the forward) and 64 (the
// backward). Included by flash_attn.cu after its tile helpers.
//
// A block is NWG = 2 warpgroups, each owning 64 rows of the block's side
// (queries, or keys in dK dV). Every operand tile is 128-byte swizzled
// [rows, 64] panels (copy.cuh's swizzle128) loaded by cp.async. Products
// whose both operands are row tiles (S = Q K^T, dP = dO V^T and their
// transposes) read both from shared memory; products with a probability
// tile (O += P V, dV += P^T dO, dK += dS^T Q, dQ += dS K) take it from the
// registers it was computed in (a warp's accumulator rows are its A
// fragment, as with mma.sync) and the other operand as an N-major B, one
// wgmma per 64-column panel.
//
// The streamed side (keys for the forward and dQ, queries for dK dV) runs
// through pipeline: AHEAD tiles in flight, one barrier per tile, and a
// step's last products left running over the next step's barrier and
// loads where registers allow (dK dV's; the forward's P V is issued in the
// next step, after its S); they are waited for within the next step,
// before their accumulators are touched, so a slot is refilled two steps
// after its tile was used (SLOTS = AHEAD + 2).
#pragma once

#ifdef MAXSIM_HOPPER
namespace fa_wg {

constexpr int NWG = 2, THREADS = 128 * NWG, BM = 64 * NWG; // block rows: 64 per warpgroup
constexpr int BN = 64;                                     // streamed rows per step

// Rows [row0, row0 + ROWS) of a sequence (rows at or past len zero-filled),
// D columns from `src` (the sequence's first row, its head's first column),
// into a swizzled tile of ROWS rows.
template <int ROWS, int D, typename T>
__device__ __forceinline__ void load(T* tile, const T* src, long long stride, int row0, int len) {
    const auto swz = [](int r, int ch) { return swizzle128<ROWS>(r, ch); };
    cp_async_tile<THREADS, ROWS, D / 8, 64>(tile, swz, src, (size_t)stride, row0, len - row0, 0, D);
}

// acc[64 x N] = A . B^T over D columns: A the 64 rows at a_addr of a tile
// of AROWS rows, B the N rows of a tile at b_addr (both K-major panels).
template <typename T, int N, int D, int AROWS>
__device__ __forceinline__ void gemm_nt(float* acc, uint32_t a_addr, uint32_t b_addr) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        WgmmaSS<T, N>::run(acc, wgmma_desc_sw128(a_addr + (kk / 4) * AROWS * 128 + (kk % 4) * 32),
                           wgmma_desc_sw128(b_addr + (kk / 4) * N * 128 + (kk % 4) * 32), kk > 0);
}

// acc[64 x D] (+)= P . B: P[64 x K] as A fragments, B the K rows of a tile
// at b_addr (N-major panels of K rows). `accumulate` false: acc is
// overwritten (its registers need no zeroing).
template <typename T, int D, int K>
__device__ __forceinline__ void gemm_pn(float* acc, const uint32_t (*a)[4], uint32_t b_addr, bool accumulate) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
#pragma unroll
        for (int pn = 0; pn < D / 64; ++pn)
            WgmmaNB<T, 64>::run(acc + 32 * pn, a[kk], wgmma_desc_sw128_mn(b_addr + pn * K * 128 + kk * 16 * 128),
                                accumulate || kk > 0);
}

// The A fragments of a [64 x K] accumulator tile (rounded to T).
template <typename T, int K> __device__ __forceinline__ void frags(uint32_t (*a)[4], const float* acc) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) fa_acc_a<T>(a[kk], reinterpret_cast<const float(*)[4]>(acc), kk);
}

// Accumulator element i of a warp's m64 x N tile: row (of the warp's 16)
// and column.
__device__ __forceinline__ int acc_row(int i, int g) { return 8 * ((i >> 1) & 1) + g; }
__device__ __forceinline__ int acc_col(int i, int c) { return 8 * (i >> 2) + 2 * c + (i & 1); }

// `steps` tiles through SLOTS = AHEAD + 2 slots: load(t, slot) issues tile
// t's copies (the caller's fixed tiles, issued before, join tile 0's
// group), step(t, slot) its products; the last step's are waited for here.
template <int AHEAD, typename Load, typename Step>
__device__ __forceinline__ void pipeline(int steps, Load&& load_tile, Step&& step) {
    constexpr int SLOTS = AHEAD + 2;
#pragma unroll
    for (int t = 0; t < AHEAD; ++t) {
        if (t < steps) load_tile(t, t);
        cp_async_commit();
    }
    for (int t = 0; t < steps; ++t) {
        cp_async_wait<AHEAD - 1>(); // tile t's group landed
        fence_proxy_async();        // visible to the tensor cores
        __syncthreads();            // ... from every thread; tile t - 2's products are done
        if (t + AHEAD < steps) load_tile(t + AHEAD, (t + AHEAD) % SLOTS);
        cp_async_commit();
        step(t, t % SLOTS);
    }
    wgmma_wait<0>();
}

// The block's dynamic shared memory, 1024-aligned for the swizzle; traps
// when the launch gave less than `bytes` (the host mirrors the layouts).
__device__ __forceinline__ unsigned char* smem_base(unsigned char* raw, uint32_t bytes) {
    uint32_t dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < bytes) __trap();
    return raw + ((1024 - (smem_u32(raw) & 1023)) & 1023);
}

// Forward: dh 64 keeps S, O and P in 128 registers (two blocks per SM
// overlap each other's softmax with their products) and 4 slots; dh 128
// takes one block per SM and 3 slots of 32 KB.
template <int D> struct FwdTile {
    static constexpr int AHEAD = D == 64 ? 2 : 1, SLOTS = AHEAD + 2, MIN_BLOCKS = D == 64 ? 2 : 1;
    static constexpr int SMEM = 1024 + 2 * (BM * D + 2 * SLOTS * BN * D); // mirrored in src/cuda/flash_attn.rs
};

// Backward (dh 64): Q and dO (dQ) or K and V (dK dV) of the block's 128
// rows fixed, the other side's two tiles and their log-sum-exp and delta
// streamed through 4 slots. dQ runs two blocks per SM in 122 registers,
// its dQ product waited for within its step: left running into the next
// step's S and dP it needs more than 128, and ptxas then serializes every
// wgmma of the kernel (C7512; even so two blocks beat one, H200, 32 x 512
// x 12 x 64: 119 us against 131). dK dV's four accumulators take 187, one
// block.
struct BwdTile {
    static constexpr int AHEAD = 2, SLOTS = AHEAD + 2, DQ_MIN_BLOCKS = 2, DKDV_MIN_BLOCKS = 1;
    static constexpr int SLOT_BYTES = (2 * 2 * BN * 64 + 2 * BN * 4 + 1023) / 1024 * 1024; // tiles stay 1024-aligned
    static constexpr int SMEM = 1024 + 2 * 2 * BM * 64 + SLOTS * SLOT_BYTES; // mirrored in src/cuda/flash_attn.rs
};

// Row r's (of two) N / 4 entries of a warp's m64 x N accumulator tile
// (acc_row), reduced by `op` as a tree: the compiler keeps a chain of float
// operations in its written order, and a chain of N / 4 dependent ones per
// row was the forward's softmax critical path.
template <int W, typename Op> __device__ __forceinline__ void tree_reduce(float* v, Op op) {
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = op(v[k], v[k + W]);
    if constexpr (W > 1) tree_reduce<W / 2>(v, op);
}
template <int N, typename Op> __device__ __forceinline__ float row_reduce(const float* s, int r, Op op) {
    float v[N / 4];
#pragma unroll
    for (int k = 0; k < N / 4; ++k) v[k] = s[4 * (k / 2) + 2 * r + k % 2];
    tree_reduce<N / 8>(v, op);
    return v[0];
}

// NEG: the scale is negative (the kernel entry picks the instance; a
// run-time sign test between the two rows kept them from interleaving).
template <typename T, int D, bool NEG> __device__ __forceinline__ void fwd(const FlashParams& p) {
    using Tr = FwdTile<D>;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    T* Qs = reinterpret_cast<T*>(smem_base(fa_smem, Tr::SMEM));
    T* Ks = Qs + BM * D; // SLOTS x [BN, D]
    T* Vs = Ks + Tr::SLOTS * BN * D;
    const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
    const int start = p.cu[b], len = p.cu[b + 1] - start;
    if (m0 >= len) return;
    const int wg = threadIdx.x / 128, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const T* k = (const T*)p.k + (long long)start * p.k_row + h * D;
    const T* v = (const T*)p.v + (long long)start * p.v_row + h * D;
    load<BM, D>(Qs, (const T*)p.q + (long long)start * p.q_row + h * D, p.q_row, m0, len);
    const int2 kr = fa_range<BM, BN>(m0, len, p.window);
    const int row0 = m0 + 64 * wg + 16 * warp; // this warp's first row; lane rows row0 + g (+ 8)
    const uint32_t q_addr = smem_u32(Qs) + wg * 64 * 128;
    float o[D / 2], s[BN / 2]; // m64 x D and m64 x BN accumulators (acc_row, acc_col)
    wgmma_undef<D / 2>(o);     // the first S and P V overwrite them
    wgmma_undef<BN / 2>(s);
    float mrow[2] = {MAXSIM_NEG_INF, MAXSIM_NEG_INF}, lrow[2] = {0.f, 0.f};
    auto load_kv = [&](int t, int slot) {
        const int n0 = kr.x + t * BN;
        load<BN, D>(Ks + slot * BN * D, k, p.k_row, n0, len);
        load<BN, D>(Vs + slot * BN * D, v, p.v_row, n0, len);
    };
    uint32_t a[BN / 16][4]; // P of the previous tile, read by its P V product
    // Tile t: S_t = Q K_t^T is issued ahead of the previous tile's O += P V
    // and its softmax runs while that product does (FlashAttention-3's
    // intra-warpgroup overlap); o is rescaled once the product is done.
    auto step = [&](int t, int slot) {
        const int n0 = kr.x + t * BN;
        wgmma_fence();
        gemm_nt<T, BN, D, BM>(s, q_addr, smem_u32(Ks + slot * BN * D));
        wgmma_commit();
        if (t > 0) {
            gemm_pn<T, D, BN>(o, a, smem_u32(Vs + (t - 1) % Tr::SLOTS * BN * D), t > 1);
            wgmma_commit();
            wgmma_wait<1>(); // S_t; P V still running
        } else {
            wgmma_wait<0>();
        }
        fence_regs<BN / 2>(s);
        // p = 2^(scale_log2 s - max) as one FFMA and one MUFU.EX2 per entry:
        // the max is taken over the unscaled scores (their min for a negative
        // scale), a tile with masked keys scaled first (masked: -inf). Both
        // rows' reductions are trees and run side by side.
        const auto hi = [](float x, float y) { return fmaxf(x, y); };
        const auto lo = [](float x, float y) { return fminf(x, y); };
        float sc = p.scale_log2, mx[2];
        if (n0 + BN > len || p.window >= 0) { // block-uniform: most tiles have no masked key
#pragma unroll
            for (int i = 0; i < BN / 2; ++i)
                s[i] = fa_visible(row0 + acc_row(i, g), n0 + acc_col(i, c), len, p.window) ? s[i] * sc : MAXSIM_NEG_INF;
            sc = 1.f;
            mx[0] = row_reduce<BN>(s, 0, hi);
            mx[1] = row_reduce<BN>(s, 1, hi);
        } else {
            mx[0] = NEG ? row_reduce<BN>(s, 0, lo) : row_reduce<BN>(s, 0, hi);
            mx[1] = NEG ? row_reduce<BN>(s, 1, lo) : row_reduce<BN>(s, 1, hi);
        }
        float alpha[2], base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float mnew = fmaxf(mrow[r], lane_max<3>(mx[r] * sc));
            base[r] = mnew == MAXSIM_NEG_INF ? 0.f : mnew; // no visible key yet: every p is 0
            alpha[r] = fa_exp2(mrow[r] - base[r]);
            mrow[r] = mnew;
        }
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) s[i] = fa_exp2(fmaf(s[i], sc, -base[(i >> 1) & 1]));
#pragma unroll
        for (int r = 0; r < 2; ++r)
            lrow[r] = lrow[r] * alpha[r] + row_reduce<BN>(s, r, [](float x, float y) { return x + y; });
        wgmma_wait<0>(); // the previous P V: o and a are free
        fence_regs<D / 2>(o);
        if (t > 0) // before the first product o holds nothing
#pragma unroll
            for (int j = 0; j < D / 8; ++j)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    o[4 * j + 2 * r] *= alpha[r];
                    o[4 * j + 2 * r + 1] *= alpha[r];
                }
        frags<T, BN>(a, s);
    };
    const int steps = (kr.y - kr.x + BN - 1) / BN; // >= 1: the block's own rows
    pipeline<Tr::AHEAD>(steps, load_kv, step);
    wgmma_fence();
    gemm_pn<T, D, BN>(o, a, smem_u32(Vs + (steps - 1) % Tr::SLOTS * BN * D), steps > 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<D / 2>(o);
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = lane_sum<4>(lrow[r]);
        inv[r] = l > 0.f ? 1.f / l : 0.f;
        const int i = row0 + 8 * r + g;
        if (c == 0 && i < len) p.lse[(long long)h * p.total + start + i] = l > 0.f ? mrow[r] + log2f(l) : INFINITY;
    }
    fa_store<T, D>(p.out, reinterpret_cast<const float(*)[4]>(o), inv[0], inv[1], start, row0, len, p.heads * D, h * D);
}

// dQ = scale dS K over the block's 128 query rows, dS = P (dP - delta),
// P = exp2(scale_log2 S - lse), dP = dO V^T.
template <typename T> __device__ __forceinline__ void bwd_dq(const FlashParams& p) {
    constexpr int D = 64;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    T* Qs = reinterpret_cast<T*>(smem_base(fa_smem, BwdTile::SMEM));
    T* dOs = Qs + BM * D;
    unsigned char* slots = reinterpret_cast<unsigned char*>(dOs + BM * D); // SLOTS x (K, V)
    const int b = blockIdx.z, h = blockIdx.y, m0 = blockIdx.x * BM;
    const int start = p.cu[b], len = p.cu[b + 1] - start;
    if (m0 >= len) return;
    const int wg = threadIdx.x / 128, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int hd = p.heads * D;
    const T* k = (const T*)p.k + (long long)start * p.k_row + h * D;
    const T* v = (const T*)p.v + (long long)start * p.v_row + h * D;
    load<BM, D>(Qs, (const T*)p.q + (long long)start * p.q_row + h * D, p.q_row, m0, len);
    load<BM, D>(dOs, (const T*)p.dout + (long long)start * hd + h * D, hd, m0, len);
    const int2 kr = fa_range<BM, BN>(m0, len, p.window);
    const int row0 = m0 + 64 * wg + 16 * warp;
    float lse[2], delta[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = row0 + 8 * r + g;
        const long long at = (long long)h * p.total + start + i;
        lse[r] = i < len ? p.lse[at] : INFINITY; // rows past the sequence: p = 0
        delta[r] = i < len ? p.delta[at] : 0.f;
    }
    const uint32_t q_addr = smem_u32(Qs) + wg * 64 * 128, do_addr = smem_u32(dOs) + wg * 64 * 128;
    auto kv = [&](int slot) { return reinterpret_cast<T*>(slots + slot * BwdTile::SLOT_BYTES); }; // K, then V
    float dq[D / 2], s[BN / 2], dp[BN / 2];
    wgmma_undef<D / 2>(dq);
    wgmma_undef<BN / 2>(s);
    wgmma_undef<BN / 2>(dp);
    auto load_kv = [&](int t, int slot) {
        const int n0 = kr.x + t * BN;
        load<BN, D>(kv(slot), k, p.k_row, n0, len);
        load<BN, D>(kv(slot) + BN * D, v, p.v_row, n0, len);
    };
    auto step = [&](int t, int slot) {
        const int n0 = kr.x + t * BN;
        const uint32_t k_addr = smem_u32(kv(slot));
        wgmma_fence();
        gemm_nt<T, BN, D, BM>(s, q_addr, k_addr);
        wgmma_commit();
        gemm_nt<T, BN, D, BM>(dp, do_addr, k_addr + BN * D * 2);
        wgmma_commit();
        wgmma_wait<1>(); // S; P runs under dP
        fence_regs<BN / 2>(s);
        fence_regs<D / 2>(dq);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) s[i] = fa_exp2(fmaf(s[i], p.scale_log2, -lse[(i >> 1) & 1]));
        // Masks behind one block-uniform test (a test per entry became a
        // branch per entry, taken on every tile).
        if (n0 + BN > len || p.window >= 0)
#pragma unroll
            for (int i = 0; i < BN / 2; ++i)
                if (!fa_visible(row0 + acc_row(i, g), n0 + acc_col(i, c), len, p.window)) s[i] = 0.f;
        wgmma_wait<0>();
        fence_regs<BN / 2>(dp);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) s[i] *= dp[i] - delta[(i >> 1) & 1];
        uint32_t a[BN / 16][4];
        frags<T, BN>(a, s);
        wgmma_fence();
        gemm_pn<T, D, BN>(dq, a, k_addr, t > 0);
        wgmma_commit();
        wgmma_wait<0>(); // within the step: see BwdTile
    };
    pipeline<BwdTile::AHEAD>((kr.y - kr.x + BN - 1) / BN, load_kv, step);
    fence_regs<D / 2>(dq);
    fa_store<T, D>(p.out, reinterpret_cast<const float(*)[4]>(dq), p.scale, p.scale, start, row0, len, hd, h * D);
}

// dV = P^T dO and dK = scale dS^T Q over the block's 128 keys, from the
// transposed products S^T = K Q^T and dP^T = V dO^T of each query tile.
template <typename T> __device__ __forceinline__ void bwd_dkdv(const FlashParams& p) {
    constexpr int D = 64;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    T* Ks = reinterpret_cast<T*>(smem_base(fa_smem, BwdTile::SMEM));
    T* Vs = Ks + BM * D;
    unsigned char* slots = reinterpret_cast<unsigned char*>(Vs + BM * D); // SLOTS x (Q, dO, lse, delta)
    const int b = blockIdx.z, h = blockIdx.y, n0 = blockIdx.x * BM;
    const int start = p.cu[b], len = p.cu[b + 1] - start;
    if (n0 >= len) return;
    const int wg = threadIdx.x / 128, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int hd = p.heads * D;
    const T* q = (const T*)p.q + (long long)start * p.q_row + h * D;
    const T* dout = (const T*)p.dout + (long long)start * hd + h * D;
    load<BM, D>(Ks, (const T*)p.k + (long long)start * p.k_row + h * D, p.k_row, n0, len);
    load<BM, D>(Vs, (const T*)p.v + (long long)start * p.v_row + h * D, p.v_row, n0, len);
    const int2 qr = fa_range<BM, BN>(n0, len, p.window);
    const int row0 = n0 + 64 * wg + 16 * warp; // this warp's first key
    const uint32_t k_addr = smem_u32(Ks) + wg * 64 * 128, v_addr = smem_u32(Vs) + wg * 64 * 128;
    auto tile = [&](int slot) { return reinterpret_cast<T*>(slots + slot * BwdTile::SLOT_BYTES); }; // Q, then dO
    auto stats = [&](int slot) { return reinterpret_cast<float*>(tile(slot) + 2 * BN * D); };      // lse, then delta
    float dk[D / 2], dv[D / 2], s[BN / 2], dp[BN / 2];
    wgmma_undef<D / 2>(dk);
    wgmma_undef<D / 2>(dv);
    wgmma_undef<BN / 2>(s);
    wgmma_undef<BN / 2>(dp);
    auto load_q = [&](int t, int slot) {
        const int m0 = qr.x + t * BN;
        load<BN, D>(tile(slot), q, p.q_row, m0, len);
        load<BN, D>(tile(slot) + BN * D, dout, hd, m0, len);
        if (threadIdx.x < BN) { // queries past the sequence get 0: their Q and dO rows are 0, so are their terms
            const int i = m0 + threadIdx.x, ok = i < len ? 4 : 0;
            const long long at = (long long)h * p.total + start + (ok ? i : 0);
            cp_async4(stats(slot) + threadIdx.x, p.lse + at, ok);
            cp_async4(stats(slot) + BN + threadIdx.x, p.delta + at, ok);
        }
    };
    auto step = [&](int t, int slot) {
        const int m0 = qr.x + t * BN;
        const uint32_t q_addr = smem_u32(tile(slot)), do_addr = q_addr + BN * D * 2;
        const float* lse = stats(slot);
        wgmma_fence();
        gemm_nt<T, BN, D, BM>(s, k_addr, q_addr); // S^T: keys x queries
        wgmma_commit();
        gemm_nt<T, BN, D, BM>(dp, v_addr, do_addr); // dP^T
        wgmma_commit();
        wgmma_wait<1>(); // S^T and the previous step's dV and dK products; P^T runs under dP^T
        fence_regs<BN / 2>(s);
        fence_regs<D / 2>(dk);
        fence_regs<D / 2>(dv);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) s[i] = fa_exp2(fmaf(s[i], p.scale_log2, -lse[acc_col(i, c)])); // P^T
        if (p.window >= 0) // block-uniform, as dQ's masks
#pragma unroll
            for (int i = 0; i < BN / 2; ++i)
                if (abs(m0 + acc_col(i, c) - (row0 + acc_row(i, g))) > p.window) s[i] = 0.f;
        wgmma_wait<0>();
        fence_regs<BN / 2>(dp);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) dp[i] = s[i] * (dp[i] - lse[BN + acc_col(i, c)]); // dS^T
        uint32_t ap[BN / 16][4], ads[BN / 16][4]; // both read by products in flight together
        frags<T, BN>(ap, s);
        frags<T, BN>(ads, dp);
        wgmma_fence();
        gemm_pn<T, D, BN>(dv, ap, do_addr, t > 0);
        gemm_pn<T, D, BN>(dk, ads, q_addr, t > 0);
        wgmma_commit();
    };
    pipeline<BwdTile::AHEAD>((qr.y - qr.x + BN - 1) / BN, load_q, step);
    fence_regs<D / 2>(dk);
    fence_regs<D / 2>(dv);
    fa_store<T, D>(p.dk, reinterpret_cast<const float(*)[4]>(dk), p.scale, p.scale, start, row0, len, hd, h * D);
    fa_store<T, D>(p.dv, reinterpret_cast<const float(*)[4]>(dv), 1.f, 1.f, start, row0, len, hd, h * D);
}

} // namespace fa_wg
#endif // MAXSIM_HOPPER
