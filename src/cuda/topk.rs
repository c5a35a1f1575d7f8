//! Launch of kernels/topk.cu: the top-k of each row.

use super::{alloc_out, load_func, storage_ptr, TOPK};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, DType, Layout, Result};

/// `TOPK_THREADS` in kernels/topk.cu.
const THREADS: u32 = 1024;

/// `(values [R, k] F32, indices [R, k] U32)` of `x [R, N]` (contiguous F32,
/// 1 ≤ k ≤ min(N, 4096), R ≥ 1): one block per row.
pub(crate) fn topk_rows(x: (&CudaStorage, &Layout), k: usize) -> Result<(CudaStorage, CudaStorage)> {
    let dev = &x.0.device;
    let (r, n) = x.1.shape().dims2()?;
    if r > u32::MAX as usize / 2 {
        bail!("x: {r} rows exceed one launch")
    }
    let values = alloc_out(dev, DType::F32, r * k)?;
    // SAFETY: the kernel writes every index.
    let idx = CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<u32>(r * k) }?, dev.clone());
    let func = load_func(dev, "topk_rows", 0, "topk", &TOPK)?;
    let cfg = LaunchConfig { grid_dim: (r as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    let (xp, vp, ip) = (
        storage_ptr(x.0, x.1)?,
        storage_ptr(&values, &Layout::contiguous(r * k))?,
        storage_ptr(&idx, &Layout::contiguous(r * k))?,
    );
    let (n64, k32) = (n as i64, k as i32);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&xp);
    b.arg(&n64);
    b.arg(&k32);
    b.arg(&vp);
    b.arg(&ip);
    // SAFETY: (const float*, long long, int, float*, uint32_t*) as in topk.cu; x holds r rows
    // of n floats, values and indices r rows of k.
    unsafe { b.launch(cfg) }.w()?;
    Ok((values, idx))
}
