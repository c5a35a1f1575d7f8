// AdamW on f32 parameters, in place, as torch.optim.AdamW (decoupled weight
// decay, bias-corrected moments) after torch's clip_grad_norm_: three
// elementwise kernels per parameter instead of a dozen candle ops, and the
// clip factor read on the device, so a step never waits for the host.
#include "common.cuh"

// Mirrors AdamWParams in src/cuda/optim.rs: parameters p, moments mv [2, n],
// gradient g, the squared gradient norm sum_sq, and the step's scalars.
struct AdamWParams {
    float* p;
    float* mv;
    const float* g;
    float* sum_sq;
    long long n;
    float b1, b2, one_b1, one_b2, max_norm; // moments
    float lr, decay, c1, c2, eps;           // parameters
};

#define GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)

// *acc += sum(g^2): a sum per warp, one atomic per warp.
extern "C" __global__ void adamw_sum_sq(const AdamWParams p) {
    float s = 0.f;
    GRID_STRIDE(i, p.n) s += p.g[i] * p.g[i];
    s = warp_sum(s);
    if (threadIdx.x % 32 == 0) atomicAdd(p.sum_sq, s);
}

// m <- b1 m + (1 - b1) c g, v <- b2 v + (1 - b2) (c g)^2, mv = [m; v] [2, n],
// c = min(1, max_norm / (sqrt(*sum_sq) + 1e-6)) when max_norm > 0, else 1.
// 1 - b1 and 1 - b2 come from the host, rounded once from double (as torch's
// scalars): 1 - 0.999f in float is off by 1.3e-5.
extern "C" __global__ void adamw_moments(const AdamWParams p) {
    const float c = p.max_norm > 0.f ? fminf(1.f, p.max_norm / (sqrtf(*p.sum_sq) + 1e-6f)) : 1.f;
    float* mv = p.mv;
    const long long n = p.n;
    GRID_STRIDE(i, n) {
        const float gi = c * p.g[i];
        mv[i] = p.b1 * mv[i] + p.one_b1 * gi;
        mv[n + i] = p.b2 * mv[n + i] + p.one_b2 * gi * gi;
    }
}

// p <- p (1 - lr wd) - lr (m / c1) / (sqrt(v / c2) + eps).
extern "C" __global__ void adamw_params(const AdamWParams a) {
    float* p = a.p;
    const float* mv = a.mv;
    const long long n = a.n;
    GRID_STRIDE(i, n) p[i] = p[i] * (1.f - a.lr * a.decay) - a.lr * (mv[i] / a.c1) / (sqrtf(mv[n + i] / a.c2) + a.eps);
}
