// Row gather: out[r] = src[idx[r]], or a zero row where idx[r] >= n_src.
// For the projection head's backward (winning rows of H in, grad H out: each
// output row written once, zeros included). Rows are whole 16-byte vectors;
// a warp per row, a grid-stride loop over rows.
#include "common.cuh"

extern "C" __global__ void gather_rows_v16(const uint4* src, const uint32_t* idx, uint4* out, long long rows,
                                           int vecs, uint32_t n_src) {
    const int lane = threadIdx.x % 32;
    const long long nw = (long long)gridDim.x * blockDim.x / 32;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows; r += nw) {
        const uint32_t s = idx[r];
        const uint4* in = src + (size_t)s * vecs;
        uint4* o = out + (size_t)r * vecs;
        for (int v = lane; v < vecs; v += 32) o[v] = s < n_src ? __ldg(in + v) : make_uint4(0, 0, 0, 0);
    }
}

// y[r, c] = x[r, c] + bias[c] (bias in f32), rounded once. A broadcast add
// in candle indexes every element through the broadcast strides (several
// times slower than the bandwidth on [Nd·Ld, dout]).
template <typename T>
__device__ void add_bias(const T* x, const float* bias, T* y, long long rows, int cols) {
    const int lane = threadIdx.x % 32;
    const long long nw = (long long)gridDim.x * blockDim.x / 32;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows; r += nw)
        for (int c = lane; c < cols; c += 32)
            y[r * cols + c] = Elem<T>::from(Elem<T>::to_float(x[r * cols + c]) + bias[c]);
}
#define ADD_BIAS(NAME, T)                                                                                     \
    extern "C" __global__ void add_bias_##NAME(const T* x, const float* bias, T* y, long long rows, int cols) { \
        add_bias(x, bias, y, rows, cols);                                                                      \
    }
ADD_BIAS(f16, __half)
ADD_BIAS(bf16, __nv_bfloat16)
ADD_BIAS(f32, float)
