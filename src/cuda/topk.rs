//! Launch of kernels/topk.cu: the top-k of each row.

use super::launch::{blocks, kernel, kernel_params, launch, Module};
use super::memory::{alloc_out, storage_ptr};
use super::params::dtype_tag;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaStorage, DType, Layout, Result};

/// `TOPK_THREADS` in kernels/topk.cu.
const THREADS: u32 = 1024;

/// Mirror of `TopkParams` in kernels/topk.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct TopkParams {
    x: u64,
    cols: u64,
    values: u64,
    indices: u64,
    n: i64,
    chunk: i64,
    chunks: i32,
    k: i32,
    sort: i32,
}
kernel_params!(TopkParams);

/// Columns per block of a row's first pass: at least 8 192 (a block's
/// 1 024 threads then read 8 entries each per radix pass) and 4 k, so that
/// the second pass reads at most a quarter of the row.
fn chunk_for(k: usize) -> usize {
    (4 * k.next_power_of_two()).max(8192)
}

/// `(values [R, k] F32, indices [R, k] U32)` of `x [R, N]` (contiguous F32,
/// F16 or BF16; 1 ≤ k ≤ min(N, 4096), R ≥ 1). Rows of up to two chunks: one
/// block per row; longer ones: one block per chunk keeps its top k, then one
/// block per row picks from those.
pub(crate) fn topk_rows(x: (&CudaStorage, &Layout), k: usize) -> Result<(CudaStorage, CudaStorage)> {
    let dev = &x.0.device;
    let (r, n) = x.1.shape().dims2()?;
    let chunk = chunk_for(k);
    let chunks = if n > chunk { n.div_ceil(chunk) } else { 1 };
    if r.saturating_mul(chunks) > i32::MAX as usize || chunks * k > u32::MAX as usize / 2 {
        bail!("x: {r} rows of {n} exceed one launch")
    }
    let run = |x: u64, cols: u64, dt: DType, n: usize, chunk: usize, chunks: usize, sort: bool| {
        let m = r * chunks * k;
        let values = alloc_out(dev, DType::F32, m)?;
        // SAFETY: the kernel writes every index.
        let idx = CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<u32>(m) }?, dev.clone());
        let p = TopkParams {
            x,
            cols,
            values: storage_ptr(&values, &Layout::contiguous(m))?,
            indices: storage_ptr(&idx, &Layout::contiguous(m))?,
            n: n as i64,
            chunk: chunk as i64,
            chunks: chunks as i32,
            k: k as i32,
            sort: sort as i32,
        };
        let func = kernel(dev, Module::Topk, &format!("topk_rows_{}", dtype_tag(dt)), 0)?;
        launch(dev, &func, blocks((r * chunks) as u32, THREADS, 0), &p)?;
        Ok::<_, candle_core::Error>((values, idx))
    };
    let ptr = storage_ptr(x.0, x.1)?;
    if chunks == 1 {
        return run(ptr, 0, x.0.dtype(), n, n, 1, true);
    }
    let (v, i) = run(ptr, 0, x.0.dtype(), n, chunk, chunks, false)?;
    let m = chunks * k;
    let (vp, ip) = (storage_ptr(&v, &Layout::contiguous(r * m))?, storage_ptr(&i, &Layout::contiguous(r * m))?);
    run(vp, ip, DType::F32, m, m, 1, true)
}
