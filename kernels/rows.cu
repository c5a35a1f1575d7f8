// Row gather: out[r] = src[idx[r]], or a zero row where idx[r] >= n_src.
// For the projection head's backward (winning rows of H in, grad H out: each
// output row written once, zeros included). A row is `units` words of U
// (16-byte vectors where rows and base allow, else 2-byte halves: every
// float dtype is a whole number of them); a warp per row, a grid-stride
// loop over rows.
#include "common.cuh"

// Mirrors RowsParams in src/cuda/rows.rs; each kernel's comment says which
// fields it reads: rows [rows, cols] of x (and of g), a per-row index or a
// per-column bias `aux`, the output, a host-mapped error flag `bad`.
struct RowsParams {
    const void* x;
    const void* aux;
    const void* g;
    void* out;
    unsigned int* bad;
    long long rows;
    int cols;
    uint32_t n;
};

template <typename U>
__device__ void gather_rows(const U* src, const uint32_t* idx, U* out, long long rows, int units, uint32_t n_src) {
    const int lane = threadIdx.x % 32;
    const long long nw = (long long)gridDim.x * blockDim.x / 32;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows; r += nw) {
        const uint32_t s = idx[r];
        const U* in = src + (size_t)s * units;
        U* o = out + (size_t)r * units;
        for (int v = lane; v < units; v += 32) o[v] = s < n_src ? __ldg(in + v) : U{};
    }
}
// x: src, aux: idx, cols: words of U per row, n: rows of src.
#define GATHER_ROWS(NAME, U)                                                                           \
    extern "C" __global__ void gather_rows_##NAME(const RowsParams p) {                                \
        gather_rows(static_cast<const U*>(p.x), static_cast<const uint32_t*>(p.aux), static_cast<U*>(p.out), \
                    p.rows, p.cols, p.n);                                                              \
    }
GATHER_ROWS(v16, uint4)
GATHER_ROWS(b2, unsigned short)

// y[r, c] = act(x[r, c] + bias[c]) (bias in the accumulation type: f32,
// f64 for f64), rounded once; act is the identity or GELU with the exact
// erf. A broadcast add in candle indexes every element through the
// broadcast strides (several times slower than the bandwidth on
// [Nd·Ld, dout]), and its GELU is one more pass each way.
template <typename A> __device__ __forceinline__ A gelu_cdf(A z) { return A(0.5) * (A(1) + erf(z * A(0.70710678118654752440))); }
template <typename A> __device__ __forceinline__ A gelu_pdf(A z) { return exp(A(-0.5) * z * z) * A(0.39894228040143267794); }

// A warp per row, each lane 8 consecutive columns at a time (cols a
// multiple of 8): the elementwise kernels' 16-byte path for 16-bit types,
// where their one-element loop issues 2-byte loads.
template <typename F> __device__ __forceinline__ void rows8(long long rows, int cols, F&& f) {
    const int lane = threadIdx.x % 32;
    const long long nw = (long long)gridDim.x * blockDim.x / 32;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows; r += nw)
        for (int c = 8 * lane; c < cols; c += 256) f(r, c);
}

template <typename T, bool GELU>
__device__ void add_bias(const T* x, const typename Elem<T>::Acc* bias, T* y, long long rows, int cols) {
    using A = typename Elem<T>::Acc;
    if constexpr (sizeof(T) == 2) {
        if (cols % 8 == 0 && aligned16(x, bias, y)) { // launch-uniform
            rows8(rows, cols, [&](long long r, int c) {
                float z[8], b[8];
                load8(x + r * cols + c, z);
                load8f(bias + c, b);
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    z[k] += b[k];
                    if (GELU) z[k] *= gelu_cdf(z[k]);
                }
                store8(y + r * cols + c, z);
            });
            return;
        }
    }
    const int lane = threadIdx.x % 32;
    const long long nw = (long long)gridDim.x * blockDim.x / 32;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows; r += nw)
        for (int c = lane; c < cols; c += 32) {
            const A z = Elem<T>::to_float(x[r * cols + c]) + bias[c];
            y[r * cols + c] = Elem<T>::from(GELU ? z * gelu_cdf(z) : z);
        }
}

// dz[r, c] = g[r, c] * GELU'(x[r, c] + bias[c]): the backward of the GELU
// variant, recomputing the pre-activation instead of storing it.
template <typename T>
__device__ void gelu_bwd(const T* x, const typename Elem<T>::Acc* bias, const T* g, T* dz, long long rows, int cols) {
    using A = typename Elem<T>::Acc;
    if constexpr (sizeof(T) == 2) {
        if (cols % 8 == 0 && aligned16(x, bias, g, dz)) { // launch-uniform
            rows8(rows, cols, [&](long long r, int c) {
                float z[8], b[8], gr[8];
                load8(x + r * cols + c, z);
                load8f(bias + c, b);
                load8(g + r * cols + c, gr);
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    z[k] += b[k];
                    gr[k] *= gelu_cdf(z[k]) + z[k] * gelu_pdf(z[k]);
                }
                store8(dz + r * cols + c, gr);
            });
            return;
        }
    }
    const int lane = threadIdx.x % 32;
    const long long nw = (long long)gridDim.x * blockDim.x / 32;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows; r += nw)
        for (int c = lane; c < cols; c += 32) {
            const long long i = r * cols + c;
            const A z = Elem<T>::to_float(x[i]) + bias[c];
            dz[i] = Elem<T>::from(Elem<T>::to_float(g[i]) * (gelu_cdf(z) + z * gelu_pdf(z)));
        }
}
// x, aux: the bias (in Elem<T>::Acc), g (gelu_bwd only), out.
#define ADD_BIAS(NAME, T)                                                                                    \
    extern "C" __global__ void add_bias_##NAME(const RowsParams p) {                                         \
        add_bias<T, false>(static_cast<const T*>(p.x), static_cast<const typename Elem<T>::Acc*>(p.aux),      \
                           static_cast<T*>(p.out), p.rows, p.cols);                                          \
    }                                                                                                        \
    extern "C" __global__ void add_bias_gelu_##NAME(const RowsParams p) {                                    \
        add_bias<T, true>(static_cast<const T*>(p.x), static_cast<const typename Elem<T>::Acc*>(p.aux),       \
                          static_cast<T*>(p.out), p.rows, p.cols);                                           \
    }                                                                                                        \
    extern "C" __global__ void gelu_bwd_##NAME(const RowsParams p) {                                         \
        gelu_bwd(static_cast<const T*>(p.x), static_cast<const typename Elem<T>::Acc*>(p.aux),                \
                 static_cast<const T*>(p.g), static_cast<T*>(p.out), p.rows, p.cols);                        \
    }
ADD_BIAS(f16, __half)
ADD_BIAS(bf16, __nv_bfloat16)
ADD_BIAS(f32, float)
ADD_BIAS(f64, double)

// GeGLU: y[r, c] = GELU(a) * b with a = x[r, c], b = x[r, cols + c] (x is
// [rows, 2 cols]), and its backward dx = [g * b * GELU'(a), g * GELU(a)]:
// one pass each way where candle runs two column slices (each a zero-padded
// copy backward), GELU (six passes backward) and a product.
template <typename T, bool BWD>
__device__ void geglu(const T* x, const T* g, T* out, long long rows, int cols) {
    using A = typename Elem<T>::Acc;
    if constexpr (sizeof(T) == 2) {
        if (cols % 8 == 0 && aligned16(x, g, out)) { // launch-uniform
            rows8(rows, cols, [&](long long r, int c) {
                const long long i = r * 2 * cols + c;
                float a[8], b[8];
                load8(x + i, a);
                load8(x + i + cols, b);
                if (BWD) {
                    float gr[8], da[8];
                    load8(g + r * cols + c, gr);
#pragma unroll
                    for (int k = 0; k < 8; ++k) {
                        const float cdf = gelu_cdf(a[k]);
                        da[k] = gr[k] * b[k] * (cdf + a[k] * gelu_pdf(a[k]));
                        b[k] = gr[k] * a[k] * cdf; // db
                    }
                    store8(out + i, da);
                    store8(out + i + cols, b);
                } else {
#pragma unroll
                    for (int k = 0; k < 8; ++k) a[k] = a[k] * gelu_cdf(a[k]) * b[k];
                    store8(out + r * cols + c, a);
                }
            });
            return;
        }
    }
    const int lane = threadIdx.x % 32;
    const long long nw = (long long)gridDim.x * blockDim.x / 32;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows; r += nw)
        for (int c = lane; c < cols; c += 32) {
            const long long i = r * 2 * cols + c;
            const A a = Elem<T>::to_float(x[i]), b = Elem<T>::to_float(x[i + cols]);
            const A cdf = gelu_cdf(a);
            if (BWD) {
                const A gr = Elem<T>::to_float(g[r * cols + c]);
                out[i] = Elem<T>::from(gr * b * (cdf + a * gelu_pdf(a)));
                out[i + cols] = Elem<T>::from(gr * a * cdf);
            } else {
                out[r * cols + c] = Elem<T>::from(a * cdf * b);
            }
        }
}
// x, g (geglu_bwd only), out; cols: the output's (forward) or g's columns.
#define GEGLU(NAME, T)                                                                                       \
    extern "C" __global__ void geglu_##NAME(const RowsParams p) {                                            \
        geglu<T, false>(static_cast<const T*>(p.x), nullptr, static_cast<T*>(p.out), p.rows, p.cols);        \
    }                                                                                                        \
    extern "C" __global__ void geglu_bwd_##NAME(const RowsParams p) {                                        \
        geglu<T, true>(static_cast<const T*>(p.x), static_cast<const T*>(p.g), static_cast<T*>(p.out), p.rows, \
                       p.cols);                                                                              \
    }
GEGLU(f16, __half)
GEGLU(bf16, __nv_bfloat16)
GEGLU(f32, float)

// out[idx[r], c] += src[r, c] in f32 (out zeroed by the host): the per-row
// sums of a scatter, e.g. the new centroids of a k-means step. A warp per
// row; rows whose index is >= n_out are skipped and set *bad (if not null).
// The f32 atomics make the sums' rounding depend on the order rows land in.
template <typename T>
__device__ void scatter_add_rows(const T* src, const uint32_t* idx, float* out, long long rows, int cols,
                                 uint32_t n_out, unsigned int* bad) {
    const int lane = threadIdx.x % 32;
    const long long nw = (long long)gridDim.x * blockDim.x / 32;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows; r += nw) {
        const uint32_t d = idx[r];
        if (d >= n_out) {
            if (lane == 0 && bad) *bad = 1u;
            continue;
        }
        for (int c = lane; c < cols; c += 32) atomicAdd(out + (size_t)d * cols + c, (float)Elem<T>::to_float(src[r * cols + c]));
    }
}
// x: src, aux: idx, out: f32 sums, n: output rows, bad (may be null).
#define SCATTER_ADD_ROWS(NAME, T)                                                                      \
    extern "C" __global__ void scatter_add_rows_##NAME(const RowsParams p) {                           \
        scatter_add_rows(static_cast<const T*>(p.x), static_cast<const uint32_t*>(p.aux),              \
                         static_cast<float*>(p.out), p.rows, p.cols, p.n, p.bad);                      \
    }
SCATTER_ADD_ROWS(f16, __half)
SCATTER_ADD_ROWS(bf16, __nv_bfloat16)
SCATTER_ADD_ROWS(f32, float)

// Sums over rows of g[r, c] in f32: the gradient of a bias added to every
// row. Block (x, y) sums columns x*256 .. +255 over rows y, y + gridDim.y, ...
// (coalesced across the block's threads) into part y of out [gridDim.y,
// cols]; sum_parts adds the parts in order. No atomics: the same inputs give
// the same bits on every run. candle's sum over a leading axis reads one
// strided element per thread (milliseconds on [40 000, 1536]).
template <typename T>
__device__ void sum_rows(const T* g, float* out, long long rows, int cols) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float acc = 0.f;
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) acc += Elem<T>::to_float(g[r * cols + c]);
    out[(long long)blockIdx.y * cols + c] = acc;
}
// x: g, out: f32 column sums, one row of them per grid row.
#define SUM_ROWS(NAME, T)                                                                              \
    extern "C" __global__ void sum_rows_##NAME(const RowsParams p) {                                   \
        sum_rows(static_cast<const T*>(p.x), static_cast<float*>(p.out), p.rows, p.cols);              \
    }
SUM_ROWS(f16, __half)
SUM_ROWS(bf16, __nv_bfloat16)
SUM_ROWS(f32, float)

// out[c] = sum over p in order of x[p, c], f32 [rows, cols]: partial sums
// (one per block of a reduction) added in a fixed order. A thread per column.
extern "C" __global__ void sum_parts(const RowsParams p) {
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= p.cols) return;
    const float* x = static_cast<const float*>(p.x);
    float acc = 0.f;
    for (long long r = 0; r < p.rows; ++r) acc += x[r * p.cols + c];
    static_cast<float*>(p.out)[c] = acc;
}
