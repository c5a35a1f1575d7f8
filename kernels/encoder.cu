// Layers of the transformer encoders that candle would otherwise run as a
// chain of elementwise passes and reductions: the attention softmax, the
// layer norm and rotary embeddings (one pass each way), each one kernel forward and one (two for the norm) backward,
// computed in f32 and rounded once to T. A warp per row, a grid-stride loop
// over rows; a row is read twice, the second time from cache, except on the
// norms' 16-byte path (NormRow8), which holds it in registers.
#include "common.cuh"
#include <type_traits>

// Mirrors SoftmaxParams in src/cuda/encoder.rs. Forward: scores x, bias,
// probabilities out. Backward: probabilities x, their gradient g, out.
struct SoftmaxParams {
    const void* x;
    const void* g;
    const float* bias;
    void* out;
    long long rows;
    long long bias_b;
    int lk, lq, heads, bias_i;
    float scale;
};

// Mirrors LayerNormParams in src/cuda/encoder.rs: rows [rows, c] of x (and
// dy for the backward), f32 weight w and bias b (may be null), out.
struct LayerNormParams {
    const void* x;
    const void* res; // a residual added to x before the norm, or null
    const void* dy;
    const float* w;
    const float* b;
    void* out;
    long long rows;
    int c;
    float eps;
};

// Mirrors RotaryParams in src/cuda/encoder.rs: rows [rows, 3 * heads * 2 *
// half] of x (q, k, v blocks of heads of 2 * half columns), f32 tables
// [rows, half], out like x; sign +1 rotates, -1 rotates back (the backward).
struct RotaryParams {
    const void* x;
    const float* cos;
    const float* sin;
    void* out;
    long long rows;
    int heads, half;
    float sign;
};

#define WARP_ROWS(r, rows)                                                        \
    const int lane = threadIdx.x % 32;                                            \
    const long long nw_ = (long long)gridDim.x * blockDim.x / 32;                 \
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows; r += nw_)

// p = softmax(scale * s + bias) over the last axis of s [B, H, Lq, Lk]; the
// f32 bias of row (b, h, i) starts at bias + b * bias_b + i * bias_i (0
// strides broadcast). Online max and sum in one pass, then the writes. A row
// whose every logit is -inf gets zeros.
template <typename T>
__device__ void attn_softmax_fwd(const T* s, const float* bias, T* p, long long rows, int lk, int lq, int heads,
                                 long long bias_b, int bias_i, float scale) {
    WARP_ROWS(r, rows) {
        const float* br = bias + (r / ((long long)heads * lq)) * bias_b + (long long)(r % lq) * bias_i;
        const T* sr = s + r * lk;
        float m = MAXSIM_NEG_INF, l = 0.f;
        for (int j = lane; j < lk; j += 32) {
            const float x = scale * Elem<T>::to_float(sr[j]) + br[j];
            if (x > m) {
                l = l * expf(m - x) + 1.f;
                m = x;
            } else if (x != MAXSIM_NEG_INF) {
                l += expf(x - m);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float om = __shfl_xor_sync(0xffffffffu, m, o), ol = __shfl_xor_sync(0xffffffffu, l, o);
            const float nm = fmaxf(m, om);
            l = (m == MAXSIM_NEG_INF ? 0.f : l * expf(m - nm)) + (om == MAXSIM_NEG_INF ? 0.f : ol * expf(om - nm));
            m = nm;
        }
        const float inv = (m == MAXSIM_NEG_INF || l == 0.f) ? 0.f : 1.f / l;
        T* pr = p + r * lk;
        for (int j = lane; j < lk; j += 32) {
            const float x = scale * Elem<T>::to_float(sr[j]) + br[j];
            pr[j] = Elem<T>::from(inv == 0.f ? 0.f : expf(x - m) * inv);
        }
    }
}

// ds = scale * p * (dp - sum(p * dp)) per row.
template <typename T>
__device__ void attn_softmax_bwd(const T* p, const T* dp, T* ds, long long rows, int lk, float scale) {
    WARP_ROWS(r, rows) {
        const T *pr = p + r * lk, *gr = dp + r * lk;
        float dot = 0.f;
        for (int j = lane; j < lk; j += 32) dot += Elem<T>::to_float(pr[j]) * Elem<T>::to_float(gr[j]);
        dot = warp_sum(dot);
        for (int j = lane; j < lk; j += 32)
            ds[r * lk + j] = Elem<T>::from(scale * Elem<T>::to_float(pr[j]) * (Elem<T>::to_float(gr[j]) - dot));
    }
}

// Row r of the normalized input: x, or x + res rounded to T as the separate
// add it replaces would round it (the residual connection before a norm).
template <typename T> struct NormRow {
    const T *x, *res;
    __device__ __forceinline__ NormRow(const void* x_, const void* res_, long long r, int c)
        : x(static_cast<const T*>(x_) + r * c), res(res_ ? static_cast<const T*>(res_) + r * c : nullptr) {}
    __device__ __forceinline__ float operator[](int j) const {
        const float v = Elem<T>::to_float(x[j]);
        return res ? Elem<T>::to_float(Elem<T>::from(v + Elem<T>::to_float(res[j]))) : v;
    }
};

// Mean and 1 / sqrt(biased variance + eps) of a row, every lane of the warp.
template <typename T>
__device__ __forceinline__ void row_stats(const NormRow<T>& xr, int c, int lane, float eps, float& mean, float& rstd) {
    float s = 0.f;
    for (int j = lane; j < c; j += 32) s += xr[j];
    mean = warp_sum(s) / c;
    float v = 0.f;
    for (int j = lane; j < c; j += 32) {
        const float d = xr[j] - mean;
        v += d * d;
    }
    rstd = 1.f / sqrtf(warp_sum(v) / c + eps);
}

// The 16-byte path of the norms for 16-bit T: a row of c <= 256 CH
// (a multiple of 8) read once into registers, 8 columns per lane per
// chunk, where the one-element path reads it 2-3 times, 2 bytes a load.
template <typename T, int CH> struct NormRow8 {
    float v[CH][8];
    // Row r of x (+ res, rounded to T as NormRow does); chunks past c are
    // left unset and never read.
    __device__ __forceinline__ NormRow8(const LayerNormParams& p, long long r, int lane) {
        const T* x = static_cast<const T*>(p.x) + r * p.c;
        const T* res = p.res ? static_cast<const T*>(p.res) + r * p.c : nullptr;
#pragma unroll
        for (int k = 0; k < CH; ++k) {
            const int j = 8 * (lane + 32 * k);
            if (j >= p.c) continue;
            load8(x + j, v[k]);
            if (res) {
                float t[8];
                load8(res + j, t);
#pragma unroll
                for (int e = 0; e < 8; ++e) v[k][e] = Elem<T>::to_float(Elem<T>::from(v[k][e] + t[e]));
            }
        }
    }
    // Mean and 1 / sqrt(biased variance + eps), every lane of the warp.
    __device__ __forceinline__ void stats(int c, int lane, float eps, float& mean, float& rstd) const {
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < CH; ++k)
            if (8 * (lane + 32 * k) < c)
#pragma unroll
                for (int e = 0; e < 8; ++e) s += v[k][e];
        mean = warp_sum(s) / c;
        float q = 0.f;
#pragma unroll
        for (int k = 0; k < CH; ++k)
            if (8 * (lane + 32 * k) < c)
#pragma unroll
                for (int e = 0; e < 8; ++e) q += (v[k][e] - mean) * (v[k][e] - mean);
        rstd = 1.f / sqrtf(warp_sum(q) / c + eps);
    }
};

// Chunks per lane of the 16-byte path for rows of c, or 0 where it does not
// apply (T not 16-bit, c not a multiple of 8 or over 1024, an unaligned
// pointer): launch-uniform.
template <typename T> __device__ __forceinline__ int norm_chunks(const LayerNormParams& p) {
    if (sizeof(T) != 2 || p.c % 8 != 0 || p.c > 1024 || !aligned16(p.x, p.res, p.dy, p.out) || !aligned16(p.w, p.b))
        return 0;
    return (p.c + 255) / 256;
}

// Runs f(std::integral_constant<int, CH>) for the 16-byte path's chunk
// count; false where the path does not apply.
template <typename T, typename F> __device__ __forceinline__ bool norm_path8(const LayerNormParams& p, F&& f) {
    switch (norm_chunks<T>(p)) {
    case 1: f(std::integral_constant<int, 1>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 3: f(std::integral_constant<int, 3>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    default: return false;
    }
}

template <typename T, int CH> __device__ void layer_norm_fwd8(const LayerNormParams& p) {
    const int c = p.c;
    T* y = static_cast<T*>(p.out);
    WARP_ROWS(r, p.rows) {
        const NormRow8<T, CH> xr(p, r, lane);
        float mean, rstd;
        xr.stats(c, lane, p.eps, mean, rstd);
#pragma unroll
        for (int k = 0; k < CH; ++k) {
            const int j = 8 * (lane + 32 * k);
            if (j >= c) continue;
            float w[8], b[8] = {}, o[8];
            load8f(p.w + j, w);
            if (p.b) load8f(p.b + j, b);
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = (xr.v[k][e] - mean) * rstd * w[e] + b[e];
            store8(y + r * c + j, o);
        }
    }
}

// y = (x - mean) * rstd * w + b over rows of c; w, b f32 (b may be null).
template <typename T> __device__ void layer_norm_fwd(const LayerNormParams& p) {
    if constexpr (sizeof(T) == 2) {
        if (norm_path8<T>(p, [&](auto ch) { layer_norm_fwd8<T, decltype(ch)::value>(p); })) return;
    }
    const int c = p.c;
    T* y = static_cast<T*>(p.out);
    WARP_ROWS(r, p.rows) {
        const NormRow<T> xr(p.x, p.res, r, c);
        float mean, rstd;
        row_stats(xr, c, lane, p.eps, mean, rstd);
        for (int j = lane; j < c; j += 32)
            y[r * c + j] = Elem<T>::from((xr[j] - mean) * rstd * p.w[j] + (p.b ? p.b[j] : 0.f));
    }
}

template <typename T, int CH> __device__ void layer_norm_bwd_x8(const LayerNormParams& p) {
    const int c = p.c;
    T* dx = static_cast<T*>(p.out);
    WARP_ROWS(r, p.rows) {
        const NormRow8<T, CH> xr(p, r, lane);
        const T* gr = static_cast<const T*>(p.dy) + r * c;
        float mean, rstd;
        xr.stats(c, lane, p.eps, mean, rstd);
        float dy[CH][8], w[CH][8], sg = 0.f, sgx = 0.f;
#pragma unroll
        for (int k = 0; k < CH; ++k) {
            const int j = 8 * (lane + 32 * k);
            if (j >= c) continue;
            load8(gr + j, dy[k]);
            load8f(p.w + j, w[k]);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float g = dy[k][e] * w[k][e];
                sg += g;
                sgx += g * (xr.v[k][e] - mean) * rstd;
            }
        }
        sg = warp_sum(sg) / c;
        sgx = warp_sum(sgx) / c;
#pragma unroll
        for (int k = 0; k < CH; ++k) {
            const int j = 8 * (lane + 32 * k);
            if (j >= c) continue;
            float o[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float xh = (xr.v[k][e] - mean) * rstd;
                o[e] = rstd * (dy[k][e] * w[k][e] - sg - xh * sgx);
            }
            store8(dx + r * c + j, o);
        }
    }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w.
template <typename T> __device__ void layer_norm_bwd_x(const LayerNormParams& p) {
    if constexpr (sizeof(T) == 2) {
        if (norm_path8<T>(p, [&](auto ch) { layer_norm_bwd_x8<T, decltype(ch)::value>(p); })) return;
    }
    const int c = p.c;
    const float* w = p.w;
    T* dx = static_cast<T*>(p.out);
    WARP_ROWS(r, p.rows) {
        const NormRow<T> xr(p.x, p.res, r, c);
        const T* gr = static_cast<const T*>(p.dy) + r * c;
        float mean, rstd;
        row_stats(xr, c, lane, p.eps, mean, rstd);
        float sg = 0.f, sgx = 0.f;
        for (int j = lane; j < c; j += 32) {
            const float g = Elem<T>::to_float(gr[j]) * w[j];
            sg += g;
            sgx += g * (xr[j] - mean) * rstd;
        }
        sg = warp_sum(sg) / c;
        sgx = warp_sum(sgx) / c;
        for (int j = lane; j < c; j += 32) {
            const float xh = (xr[j] - mean) * rstd;
            dx[r * c + j] = Elem<T>::from(rstd * (Elem<T>::to_float(gr[j]) * w[j] - sg - xh * sgx));
        }
    }
}

// Rows a block of layer_norm_bwd_wb takes at a time.
#define NORM_WB_CHUNK 32

// Part b of out [gridDim.x, 2c]: over the rows of block b's chunks (b,
// b + gridDim.x, ...), the sums of dy * xhat (the weight's gradient) in
// [0, c) and of dy (the bias's) in [c, 2c). The warps put a chunk's row
// statistics in shared memory, then each column's sums have one owner thread
// adding the rows in order, and the host adds the parts in order
// (sum_parts): the same bits on every run, where atomics would not be.
template <typename T> __device__ void layer_norm_bwd_wb(const LayerNormParams& p) {
    extern __shared__ float acc[]; // [2c] sums, then mean and rstd [2][NORM_WB_CHUNK]
    const int c = p.c, lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    float* stat = acc + 2 * c;
    const T* dy = static_cast<const T*>(p.dy);
    for (int j = threadIdx.x; j < 2 * c; j += blockDim.x) acc[j] = 0.f;
    for (long long r0 = (long long)blockIdx.x * NORM_WB_CHUNK; r0 < p.rows; r0 += (long long)gridDim.x * NORM_WB_CHUNK) {
        const int n = (int)min((long long)NORM_WB_CHUNK, p.rows - r0);
        __syncthreads(); // the previous chunk's statistics are read
        for (int i = warp; i < n; i += nwarps) {
            float mean, rstd;
            row_stats(NormRow<T>(p.x, p.res, r0 + i, c), c, lane, p.eps, mean, rstd);
            if (lane == 0) stat[i] = mean, stat[NORM_WB_CHUNK + i] = rstd;
        }
        __syncthreads();
        for (int j = threadIdx.x; j < c; j += blockDim.x) {
            float sw = acc[j], sb = acc[c + j];
            for (int i = 0; i < n; ++i) {
                const float g = Elem<T>::to_float(dy[(r0 + i) * c + j]);
                sw += g * (NormRow<T>(p.x, p.res, r0 + i, c)[j] - stat[i]) * stat[NORM_WB_CHUNK + i];
                sb += g;
            }
            acc[j] = sw, acc[c + j] = sb;
        }
    }
    __syncthreads();
    float* part = static_cast<float*>(p.out) + (long long)blockIdx.x * 2 * c;
    for (int j = threadIdx.x; j < 2 * c; j += blockDim.x) part[j] = acc[j];
}

// Rotary embeddings of the q and k blocks of a fused QKV row (rotate-half
// convention: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) per head), v
// copied: one pass over [T, 3 H dh] where candle's composition (slices,
// negation, concatenation, two broadcast products, a sum) is ten nodes, each
// a pass forward and one or more backward. One thread per element (8 on
// the 16-byte path, where a half head is a multiple of 8).
template <typename T>
__device__ void rotary_qk(const RotaryParams& p) {
    const T* x = static_cast<const T*>(p.x);
    T* out = static_cast<T*>(p.out);
    const int dh = 2 * p.half, qk = 2 * p.heads * dh, width = 3 * p.heads * dh;
    if constexpr (sizeof(T) == 2) {
        // 8 elements per thread (16 bytes) where a half head is a multiple of 8.
        if (p.half % 8 == 0 && aligned16(x, out, p.cos, p.sin)) { // launch-uniform
            const long long n8 = p.rows * width / 8;
            for (long long e8 = (long long)blockIdx.x * blockDim.x + threadIdx.x; e8 < n8;
                 e8 += (long long)gridDim.x * blockDim.x) {
                const long long e = 8 * e8, r = e / width;
                const int c = (int)(e - r * width);
                float a[8];
                load8(x + e, a);
                if (c < qk) {
                    const int j = c % dh, f = j % p.half;
                    const bool first = j < p.half;
                    float b[8], cs[8], sn[8];
                    load8(x + (first ? e + p.half : e - p.half), b);
                    load8f(p.cos + r * p.half + f, cs);
                    load8f(p.sin + r * p.half + f, sn);
#pragma unroll
                    for (int k = 0; k < 8; ++k) {
                        const float s = p.sign * sn[k];
                        a[k] = first ? a[k] * cs[k] - b[k] * s : a[k] * cs[k] + b[k] * s;
                    }
                }
                store8(out + e, a);
            }
            return;
        }
    }
    const long long n = p.rows * width;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const long long r = e / width;
        const int c = (int)(e - r * width);
        if (c >= qk) {
            out[e] = x[e];
            continue;
        }
        const int j = c % dh, f = j % p.half;
        const float cs = p.cos[r * p.half + f], sn = p.sign * p.sin[r * p.half + f];
        const float a = Elem<T>::to_float(x[e]);
        // First half: x1 cos - x2 sin; second half: x2 cos + x1 sin.
        const float y = j < p.half ? a * cs - Elem<T>::to_float(x[e + p.half]) * sn
                                   : a * cs + Elem<T>::to_float(x[e - p.half]) * sn;
        out[e] = Elem<T>::from(y);
    }
}

#define ENCODER_KERNELS(NAME, T)                                                                           \
    extern "C" __global__ void attn_softmax_fwd_##NAME(const SoftmaxParams p) {                             \
        attn_softmax_fwd(static_cast<const T*>(p.x), p.bias, static_cast<T*>(p.out), p.rows, p.lk, p.lq,   \
                         p.heads, p.bias_b, p.bias_i, p.scale);                                             \
    }                                                                                                      \
    extern "C" __global__ void attn_softmax_bwd_##NAME(const SoftmaxParams p) {                             \
        attn_softmax_bwd(static_cast<const T*>(p.x), static_cast<const T*>(p.g), static_cast<T*>(p.out),   \
                         p.rows, p.lk, p.scale);                                                            \
    }                                                                                                      \
    extern "C" __global__ void layer_norm_fwd_##NAME(const LayerNormParams p) { layer_norm_fwd<T>(p); }     \
    extern "C" __global__ void layer_norm_bwd_x_##NAME(const LayerNormParams p) { layer_norm_bwd_x<T>(p); } \
    extern "C" __global__ void layer_norm_bwd_wb_##NAME(const LayerNormParams p) { layer_norm_bwd_wb<T>(p); } \
    extern "C" __global__ void rotary_qk_##NAME(const RotaryParams p) { rotary_qk<T>(p); }
ENCODER_KERNELS(f16, __half)
ENCODER_KERNELS(bf16, __nv_bfloat16)
ENCODER_KERNELS(f32, float)
