// Row-wise L2 normalization, y = x / max(|x|, 1e-12) (F.normalize), and its
// backward, dx = (g - y (y.g)) / |x| (g / 1e-12 where |x| <= 1e-12), one warp
// per row, accumulated in f32 (f64 for f64). Replaces a chain of seven
// elementwise / reduction ops forward and their autograd backward.
#include "common.cuh"

// Mirrors NormParams in src/cuda/normalize.rs: rows [rows, dim] of x (and
// the gradient g for the backward), written to out.
struct NormParams {
    const void* x;
    const void* g;
    void* out;
    long long rows;
    int dim;
};

// Rows [0, rows) of [rows, dim]; a grid-stride loop over warps.
template <typename T>
__device__ void l2norm_fwd(const T* x, T* y, long long rows, int dim) {
    using A = typename Elem<T>::Acc;
    const int lane = threadIdx.x % 32;
    const long long nw = (long long)gridDim.x * blockDim.x / 32;
    for (long long r = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32; r < rows; r += nw) {
        const T* xr = x + r * dim;
        A ss = 0;
        for (int k = lane; k < dim; k += 32) {
            const A v = Elem<T>::to_float(xr[k]);
            ss += v * v;
        }
        const A inv = inv_l2norm(warp_sum(ss));
        for (int k = lane; k < dim; k += 32) y[r * dim + k] = Elem<T>::from(Elem<T>::to_float(xr[k]) * inv);
    }
}

template <typename T>
__device__ void l2norm_bwd(const T* x, const T* g, T* dx, long long rows, int dim) {
    using A = typename Elem<T>::Acc;
    const int lane = threadIdx.x % 32;
    const long long nw = (long long)gridDim.x * blockDim.x / 32;
    for (long long r = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32; r < rows; r += nw) {
        const T* xr = x + r * dim;
        const T* gr = g + r * dim;
        A ss = 0, xg = 0;
        for (int k = lane; k < dim; k += 32) {
            const A v = Elem<T>::to_float(xr[k]);
            ss += v * v;
            xg += v * Elem<T>::to_float(gr[k]);
        }
        const A n = sqrt(warp_sum(ss));
        xg = warp_sum(xg);
        // Below eps the norm is the constant eps: no term through |x|.
        const bool tiny = n <= A(MAXSIM_L2_EPS);
        const A inv = A(1) / (tiny ? A(MAXSIM_L2_EPS) : n);
        const A proj = tiny ? A(0) : xg * inv * inv; // (y.g) / |x|
        for (int k = lane; k < dim; k += 32)
            dx[r * dim + k] =
                Elem<T>::from((Elem<T>::to_float(gr[k]) - Elem<T>::to_float(xr[k]) * proj) * inv);
    }
}

#define L2NORM(TNAME, T)                                                                          \
    extern "C" __global__ void l2norm_fwd_##TNAME(const NormParams p) {                           \
        l2norm_fwd(static_cast<const T*>(p.x), static_cast<T*>(p.out), p.rows, p.dim);            \
    }                                                                                             \
    extern "C" __global__ void l2norm_bwd_##TNAME(const NormParams p) {                           \
        l2norm_bwd(static_cast<const T*>(p.x), static_cast<const T*>(p.g), static_cast<T*>(p.out), \
                   p.rows, p.dim);                                                                \
    }
L2NORM(f16, __half)
L2NORM(bf16, __nv_bfloat16)
L2NORM(f32, float)
L2NORM(f64, double)
