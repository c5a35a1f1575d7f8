//! Launch of kernels/topk.cu: the top-k of each row.

use super::launch::{blocks, kernel, kernel_params, launch, Module};
use super::memory::{alloc_out, storage_ptr};
use candle_core::{bail, CudaStorage, DType, Layout, Result};

/// `TOPK_THREADS` in kernels/topk.cu.
const THREADS: u32 = 1024;

/// Mirror of `TopkParams` in kernels/topk.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct TopkParams {
    x: u64,
    values: u64,
    indices: u64,
    n: i64,
    k: i32,
}
kernel_params!(TopkParams);

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
    let p = TopkParams {
        x: storage_ptr(x.0, x.1)?,
        values: storage_ptr(&values, &Layout::contiguous(r * k))?,
        indices: storage_ptr(&idx, &Layout::contiguous(r * k))?,
        n: n as i64,
        k: k as i32,
    };
    let func = kernel(dev, Module::Topk, "topk_rows", 0)?;
    launch(dev, &func, blocks(r as u32, THREADS, 0), &p)?;
    Ok((values, idx))
}
