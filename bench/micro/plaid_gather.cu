// Microbenchmark for plaid_approx_score's gather bound: the floor that
// BENCHMARKS.md gives for plaid_approx (its output on an H200:
// bench/results/h200-2026-11-30/plaid_gather.jsonl, the "gather" lines).
// Standalone: nvcc -O3 -arch=sm_90a -std=c++17 bench/micro/plaid_gather.cu -o plaid_gather && ./plaid_gather
//
// Data as examples/bench.rs --plaid-approx: qcs [65 536, 32] f32, 100 000
// documents of 1..=64 u32 codes. Each kernel variant is checked against a CPU
// reference, then timed (L2 flushed by a 256 MB memset before each run,
// CUDA events, median of 30). A second family gathers rows from a flat list
// of the same codes with no per-document structure, at several row sizes and
// table sizes, to find what the L2 can deliver to random 32..128-byte rows.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <algorithm>
#include <vector>

#define CK(x)                                                                          \
    do {                                                                               \
        cudaError_t e = (x);                                                           \
        if (e != cudaSuccess) {                                                        \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

#define NEG_INF (__int_as_float(0xff800000))
#define BAD 0xffffffffu

struct P {
    const float* qcs;
    const uint32_t* codes;
    const uint32_t* lens;
    float* out;
    unsigned long long* err;
    int64_t n_centroids;
    int32_t b, ld, lq;
};

// ---- K0: an earlier version of kernels/plaid_approx.cu's kernel (u32, VEC 4, G 8) ----
__device__ __forceinline__ uint32_t checked_code(uint32_t c, int64_t n) { return (int64_t)c < n ? c : BAD; }

__global__ void __launch_bounds__(256) k0(const P p) {
    constexpr int G = 8, R = 4, U = 8, VEC = 4;
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    const long long doc = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (doc >= p.b) return;
    const uint32_t raw_len = p.lens[doc];
    const int len = (int)min(raw_len, (uint32_t)p.ld);
    if (raw_len > (uint32_t)p.ld && lane == 0) atomicMax(&p.err[0], ~(unsigned long long)doc);
    if (len == 0) {
        if (lane == 0) p.out[doc] = 0.f;
        return;
    }
    const uint32_t* codes = p.codes + doc * p.ld;
    const int nvec = p.lq / VEC;
    const int g = lane % G, r = lane / G;
    float total = 0.f;
    for (int v0 = 0; v0 < nvec; v0 += G) {
        const int v = v0 + g;
        const bool active = v < nvec;
        float m[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) m[i] = NEG_INF;
        for (int t0 = 0; t0 < len; t0 += 32) {
            const int t = t0 + lane;
            uint32_t c = BAD;
            if (t < len) {
                c = checked_code(codes[t], p.n_centroids);
                if (c == BAD && v0 == 0) atomicMax(&p.err[1], ~(unsigned long long)(doc * p.ld + t));
            }
            const int n = min(32, len - t0);
#pragma unroll
            for (int j0 = 0; j0 < 32; j0 += U * R) {
                if (j0 >= n) break;
                float4 x[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int j = j0 + u * R + r;
                    const uint32_t cj = __shfl_sync(full, c, j);
                    x[u] = make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
                    if (j < n && active && cj != BAD) x[u] = __ldg(reinterpret_cast<const float4*>(p.qcs + (size_t)cj * p.lq) + v);
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    m[0] = fmaxf(m[0], x[u].x);
                    m[1] = fmaxf(m[1], x[u].y);
                    m[2] = fmaxf(m[2], x[u].z);
                    m[3] = fmaxf(m[3], x[u].w);
                }
            }
        }
#pragma unroll
        for (int off = G; off < 32; off <<= 1)
#pragma unroll
            for (int i = 0; i < VEC; ++i) m[i] = fmaxf(m[i], __shfl_xor_sync(full, m[i], off));
        if (active && r == 0)
#pragma unroll
            for (int i = 0; i < VEC; ++i) total += m[i];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(full, total, off);
    if (lane == 0) p.out[doc] = total;
}

template <int HINT>
__device__ __forceinline__ float4 ld_row(const float4* p) {
    if (HINT & 2) {
        float4 v;
        asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0,%1,%2,%3}, [%4];"
                     : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
        return v;
    }
    return __ldg(p);
}

// ---- K1: lean, Lq = 32 fixed. Lanes past the end gather a copy of the last
// valid token's row (max is idempotent; the copy sits in the same load
// instruction, so it costs no extra L2 traffic); whole loads past the end are
// skipped by a warp-uniform test, so no load needs a predicate or a default.
// `c0`: lane l holds code l of the document (loaded by the caller, unchecked;
// any value where l >= min(len, 32)).
template <int G, int U, int HINT>
__device__ __forceinline__ void score_doc(const P& p, int doc, uint32_t raw_len, uint32_t c0) {
    constexpr int LQ = 32, VEC = LQ / G, R = 32 / G;  // G lanes x VEC floats per row, R rows per load
    static_assert(VEC == 4 || VEC == 8, "");
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    const int len = (int)min(raw_len, (uint32_t)p.ld);
    if (raw_len > (uint32_t)p.ld && lane == 0) atomicMax(&p.err[0], ~(unsigned long long)doc);
    const int g = lane % G, r = lane / G;
    const char* base = reinterpret_cast<const char*>(p.qcs) + g * VEC * 4;
    asm("mov.b64 %0, %0;" : "+l"(base));  // opaque: one IMAD.WIDE per row address
    const uint32_t* codes = p.codes + (size_t)doc * p.ld;
    float m[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) m[i] = NEG_INF;
    for (int t0 = 0; t0 < len; t0 += 32) {
        const int n = min(32, len - t0);
        uint32_t c = c0;
        if (t0 > 0 && lane < n) c = (HINT & 1) ? __ldcs(codes + t0 + lane) : __ldg(codes + t0 + lane);
        if (lane < n && (int64_t)c >= p.n_centroids) {
            atomicMax(&p.err[1], ~(unsigned long long)((size_t)doc * p.ld + t0 + lane));
            c = 0;
        }
        c = __shfl_sync(full, c, min(lane, n - 1));
        for (int j0 = 0; j0 < n; j0 += U * R) {
            float4 x[U][VEC / 4];
            uint32_t cu[U];
#pragma unroll
            for (int u = 0; u < U; ++u) cu[u] = __shfl_sync(full, c, (j0 + u * R + r) & 31);
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (j0 + u * R < n) {
                    const float4* row = reinterpret_cast<const float4*>(base + (size_t)cu[u] * (LQ * 4));
#pragma unroll
                    for (int k = 0; k < VEC / 4; ++k) x[u][k] = ld_row<HINT>(row + k);
                }
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (j0 + u * R < n)
#pragma unroll
                    for (int k = 0; k < VEC / 4; ++k) {
                        m[4 * k + 0] = fmaxf(m[4 * k + 0], x[u][k].x);
                        m[4 * k + 1] = fmaxf(m[4 * k + 1], x[u][k].y);
                        m[4 * k + 2] = fmaxf(m[4 * k + 2], x[u][k].z);
                        m[4 * k + 3] = fmaxf(m[4 * k + 3], x[u][k].w);
                    }
        }
    }
#pragma unroll
    for (int off = G; off < 32; off <<= 1)
#pragma unroll
        for (int i = 0; i < VEC; ++i) m[i] = fmaxf(m[i], __shfl_xor_sync(full, m[i], off));
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) total += m[i];
#pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) total += __shfl_xor_sync(full, total, off);
    if (lane == 0) p.out[doc] = len ? total : 0.f;
}

template <int HINT>
__device__ __forceinline__ uint32_t first_code(const P& p, int doc, uint32_t len_or_ld) {
    const int lane = threadIdx.x & 31;
    const uint32_t* codes = p.codes + (size_t)doc * p.ld;
    if ((uint32_t)lane < min(len_or_ld, (uint32_t)p.ld)) return (HINT & 1) ? __ldcs(codes + lane) : __ldg(codes + lane);
    return 0;
}

// One document per warp. HINT & 4: the first 32 codes are loaded together with
// the length (all of them up to Ld), not after it.
template <int G, int U, int WARPS, int HINT, int MINB = 1>
__global__ void __launch_bounds__(32 * WARPS, MINB) k1(const P p) {
    const int doc = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (doc >= p.b) return;
    uint32_t raw_len, c0;
    if (HINT & 4) {
        c0 = first_code<HINT>(p, doc, 32);
        raw_len = p.lens[doc];
    } else {
        raw_len = p.lens[doc];
        c0 = first_code<HINT>(p, doc, raw_len);
    }
    score_doc<G, U, HINT>(p, doc, raw_len, c0);
}

// Resident grid: warp w scores documents w, w + W, ...; the next document's
// length and first 32 codes are loaded before the current one's gathers.
template <int G, int U, int WARPS, int HINT>
__global__ void __launch_bounds__(32 * WARPS) k2(const P p) {
    const int stride = gridDim.x * WARPS;
    int doc = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (doc >= p.b) return;
    uint32_t len_n = p.lens[doc], c_n = first_code<HINT>(p, doc, 32);
    while (doc < p.b) {
        const uint32_t raw_len = len_n, c0 = c_n;
        const int next = doc + stride;
        if (next < p.b) {
            len_n = p.lens[next];
            c_n = first_code<HINT>(p, next, 32);
        }
        score_doc<G, U, HINT>(p, doc, raw_len, c0);
        doc = next;
    }
}

// ---- Pure gather: rows of RB bytes from a table of nrows, codes from a flat list.
template <int RB>
__global__ void __launch_bounds__(256) kg(const char* table, const uint32_t* codes, long long n, uint32_t mask, float* out) {
    constexpr int G = RB / 16, R = 32 / G, U = 32 / R;  // U loads cover the 32 codes
    const int lane = threadIdx.x & 31;
    const long long warp = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    const long long nw = (long long)gridDim.x * 8;
    const int g = lane % G, r = lane / G;
    float4 m = make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
    for (long long t0 = warp * 32; t0 < n; t0 += nw * 32) {
        const uint32_t c = t0 + lane < n ? (__ldg(codes + t0 + lane) & mask) : 0;
        float4 x[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t cj = __shfl_sync(0xffffffffu, c, u * R + r);
            x[u] = __ldg(reinterpret_cast<const float4*>(table + (size_t)cj * RB) + g);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            m.x = fmaxf(m.x, x[u].x);
            m.y = fmaxf(m.y, x[u].y);
            m.z = fmaxf(m.z, x[u].z);
            m.w = fmaxf(m.w, x[u].w);
        }
    }
    const float s = m.x + m.y + m.z + m.w;
    if (s == 12345.f) out[0] = s;  // keeps the loads alive
}

static void* g_flush;
template <typename F>
static float timeit(F&& launch) {
    // PG_ITERS=0 (for ncu): one launch per kernel, no timing.
    const int iters = getenv("PG_ITERS") ? atoi(getenv("PG_ITERS")) : 30;
    if (iters == 0) {
        launch();
        CK(cudaDeviceSynchronize());
        return 0.f;
    }
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> ts;
    for (int i = 0; i < iters + 3; ++i) {
        CK(cudaMemsetAsync(g_flush, i, 256 << 20));
        CK(cudaEventRecord(a));
        launch();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (i >= 3) ts.push_back(ms);
    }
    CK(cudaGetLastError());
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
}

int main(int argc, char** argv) {
    const int C = 65536, LQ = 32, B = 100000, LD = 64;
    uint64_t x = 12345;
    auto rnd = [&]() { x = x * 6364136223846793005ull + 1442695040888963407ull; return (uint32_t)(x >> 33); };
    std::vector<float> qcs((size_t)C * LQ);
    for (auto& v : qcs) v = ((rnd() & 0xffffff) / 16777216.f - 0.5f) * 4.f;
    std::vector<uint32_t> lens(B), codes((size_t)B * LD), flat;
    for (auto& l : lens) l = 1 + rnd() % LD;
    for (auto& c : codes) c = rnd() % C;
    for (int d = 0; d < B; ++d)
        for (uint32_t t = 0; t < lens[d]; ++t) flat.push_back(codes[(size_t)d * LD + t]);
    std::vector<float> ref(B);
    for (int d = 0; d < B; ++d) {
        double tot = 0;
        for (int s = 0; s < LQ; ++s) {
            float m = -INFINITY;
            for (uint32_t t = 0; t < lens[d]; ++t) m = std::max(m, qcs[(size_t)codes[(size_t)d * LD + t] * LQ + s]);
            tot += m;
        }
        ref[d] = (float)tot;
    }
    printf("{\"tokens\":%zu,\"row_bytes\":%zu}\n", flat.size(), flat.size() * 128);
    float *dq, *dout;
    uint32_t *dc, *dl, *df;
    unsigned long long* derr;
    char* dbig;
    CK(cudaMalloc(&dq, qcs.size() * 4));
    CK(cudaMalloc(&dc, codes.size() * 4));
    CK(cudaMalloc(&dl, B * 4));
    CK(cudaMalloc(&df, flat.size() * 4));
    CK(cudaMalloc(&dout, B * 4));
    CK(cudaMalloc(&derr, 16));
    CK(cudaMalloc(&dbig, 64 << 20));
    CK(cudaMemset(dbig, 0, 64 << 20));
    CK(cudaMalloc(&g_flush, 256 << 20));
    CK(cudaMemcpy(dq, qcs.data(), qcs.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dc, codes.data(), codes.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dl, lens.data(), B * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(df, flat.data(), flat.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(derr, 0, 16));
    P p{dq, dc, dl, dout, derr, C, B, LD, LQ};
    std::vector<float> got(B);
    auto check = [&](const char* name, float ms) {
        CK(cudaMemcpy(got.data(), dout, B * 4, cudaMemcpyDeviceToHost));
        double worst = 0;
        for (int d = 0; d < B; ++d) worst = std::max(worst, (double)fabsf(got[d] - ref[d]) / (fabsf(ref[d]) + 1e-3));
        printf("{\"kernel\":\"%s\",\"median_ms\":%.4f,\"max_rel_err\":%.2e}\n", name, ms, worst);
        CK(cudaMemset(dout, 0, B * 4));
    };
#define RUNDOC(NAME, KER, WARPS)                                                          \
    {                                                                                     \
        auto f = [&]() { KER<<<(B + WARPS - 1) / WARPS, 32 * WARPS>>>(p); };              \
        float ms = timeit(f);                                                             \
        check(NAME, ms);                                                                  \
    }
    RUNDOC("k0_current", k0, 8);
    RUNDOC("k1_g8_u8_w4", (k1<8, 8, 4, 0>), 4);
    RUNDOC("k1_g8_u4_w8", (k1<8, 4, 8, 0>), 8);
    RUNDOC("k1_g8_u4_w4", (k1<8, 4, 4, 0>), 4);
    RUNDOC("k1_g8_u4_w2", (k1<8, 4, 2, 0>), 2);
    RUNDOC("k1_g8_u8_w2", (k1<8, 8, 2, 0>), 2);
    RUNDOC("k1_g8_u4_w4_cs", (k1<8, 4, 4, 1>), 4);
    RUNDOC("k1_g8_u4_w4_par", (k1<8, 4, 4, 4>), 4);
    RUNDOC("k1_g8_u4_w4_par_cs", (k1<8, 4, 4, 5>), 4);
    RUNDOC("k1_g8_u8_w4_par_cs", (k1<8, 8, 4, 5>), 4);
    RUNDOC("k1_g8_u4_w4_par_cs_40w", (k1<8, 4, 4, 5, 10>), 4);
    RUNDOC("k1_g8_u4_w4_par_cs_48w", (k1<8, 4, 4, 5, 12>), 4);
    RUNDOC("k1_g8_u4_w4_par_cs_64w", (k1<8, 4, 4, 5, 16>), 4);
    RUNDOC("k1_g8_u2_w4_par_cs_64w", (k1<8, 2, 4, 5, 16>), 4);
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
#define RUNRES(NAME, KER, WARPS)                                                          \
    {                                                                                     \
        int per_sm;                                                                       \
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, KER, 32 * WARPS, 0));   \
        auto f = [&]() { KER<<<sms * per_sm, 32 * WARPS>>>(p); };                         \
        float ms = timeit(f);                                                             \
        check(NAME, ms);                                                                  \
    }
    RUNRES("k2_g8_u4_w4_cs", (k2<8, 4, 4, 1>), 4);
    RUNRES("k2_g8_u8_w4_cs", (k2<8, 8, 4, 1>), 4);
    RUNRES("k2_g8_u4_w8_cs", (k2<8, 4, 8, 1>), 8);
    RUNRES("k2_g8_u4_w2_cs", (k2<8, 4, 2, 1>), 2);
    RUNDOC("k0_current_again", k0, 8);
    RUNDOC("k1_g8_u8_w4_again", (k1<8, 8, 4, 0>), 4);
    const long long n = flat.size();
#define RUNG(RB, ROWS, BLOCKS)                                                                             \
    {                                                                                                      \
        auto f = [&]() { kg<RB><<<BLOCKS, 256>>>(ROWS == C ? (const char*)dq : dbig, df, n, ROWS - 1, dout); }; \
        float ms = timeit(f);                                                                              \
        printf("{\"gather\":true,\"row_bytes\":%d,\"table_mb\":%.1f,\"blocks\":%d,\"median_ms\":%.4f,\"TBps\":%.2f}\n", \
               RB, (double)ROWS * RB / 1e6, BLOCKS, ms, n * (double)RB / ms / 1e9);                        \
    }
    for (int bl : {sms * 4, sms * 8, sms * 32}) RUNG(128, C, bl);
    RUNG(64, 2 * C, sms * 4);
    RUNG(64, 2 * C, sms * 8);
    RUNG(32, 4 * C, sms * 4);
    RUNG(32, 4 * C, sms * 8);
    RUNG(128, 16384, sms * 4);
    RUNG(128, 262144, sms * 4);
    unsigned long long errs[2];
    CK(cudaMemcpy(errs, derr, 16, cudaMemcpyDeviceToHost));
    printf("{\"err\":[%llu,%llu]}\n", errs[0], errs[1]);
    return 0;
}
