// AdamW on f32 parameters, in place, as torch.optim.AdamW (decoupled weight
// decay, bias-corrected moments) after torch's clip_grad_norm_: three
// elementwise kernels per parameter instead of a dozen candle ops, and the
// clip factor read on the device, so a step never waits for the host.
#include "common.cuh"

#define GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)

// *acc += sum(g^2): a sum per warp, one atomic per warp.
extern "C" __global__ void adamw_sum_sq(const float* g, float* acc, long long n) {
    float s = 0.f;
    GRID_STRIDE(i, n) s += g[i] * g[i];
    s = warp_sum(s);
    if (threadIdx.x % 32 == 0) atomicAdd(acc, s);
}

// m <- b1 m + (1 - b1) c g, v <- b2 v + (1 - b2) (c g)^2, mv = [m; v] [2, n],
// c = min(1, max_norm / (sqrt(*sum_sq) + 1e-6)) when max_norm > 0, else 1.
// 1 - b1 and 1 - b2 come from the host, rounded once from double (as torch's
// scalars): 1 - 0.999f in float is off by 1.3e-5.
extern "C" __global__ void adamw_moments(float* mv, const float* g, const float* sum_sq, long long n, float b1,
                                         float b2, float one_b1, float one_b2, float max_norm) {
    const float c = max_norm > 0.f ? fminf(1.f, max_norm / (sqrtf(*sum_sq) + 1e-6f)) : 1.f;
    GRID_STRIDE(i, n) {
        const float gi = c * g[i];
        mv[i] = b1 * mv[i] + one_b1 * gi;
        mv[n + i] = b2 * mv[n + i] + one_b2 * gi * gi;
    }
}

// p <- p (1 - lr wd) - lr (m / c1) / (sqrt(v / c2) + eps).
extern "C" __global__ void adamw_params(float* p, const float* mv, long long n, float lr, float decay, float c1,
                                        float c2, float eps) {
    GRID_STRIDE(i, n) p[i] = p[i] * (1.f - lr * decay) - lr * (mv[i] / c1) / (sqrtf(mv[n + i] / c2) + eps);
}
