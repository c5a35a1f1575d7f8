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

/// Mirror of `TopkWarpParams` in kernels/topk.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct TopkWarpParams {
    x: u64,
    keys: u64,
    values: u64,
    indices: u64,
    n: i64,
    segs: i32,
    k: i32,
    rows: i32,
    last: i32,
}
kernel_params!(TopkWarpParams);

/// The largest k of the warp kernels (`topk_warp_*`: a list in the lanes of a warp).
const WARP_MAX_K: usize = 32;
/// `TOPK_WARP_SEG` and `TOPK_WARP_WARPS` in kernels/topk.cu.
const WARP_SEG: usize = 1024;
const WARP_WARPS: usize = 8;

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
        let (values, idx) = outputs(dev, m)?;
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
    if k <= WARP_MAX_K {
        return topk_warp(dev, ptr, x.0.dtype(), r, n, k);
    }
    if chunks == 1 {
        return run(ptr, 0, x.0.dtype(), n, n, 1, true);
    }
    let (v, i) = run(ptr, 0, x.0.dtype(), n, chunk, chunks, false)?;
    let m = chunks * k;
    let (vp, ip) = (storage_ptr(&v, &Layout::contiguous(r * m))?, storage_ptr(&i, &Layout::contiguous(r * m))?);
    run(vp, ip, DType::F32, m, m, 1, true)
}

/// `m` F32 values and `m` U32 indices, uninitialized: every top-k kernel
/// writes all of its outputs.
fn outputs(dev: &candle_core::CudaDevice, m: usize) -> Result<(CudaStorage, CudaStorage)> {
    let values = alloc_out(dev, DType::F32, m)?;
    // SAFETY: the kernels write every index.
    let idx = CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<u32>(m) }?, dev.clone());
    Ok((values, idx))
}

/// The warp kernels (k ≤ 32): segments of `WARP_SEG` columns each keep their
/// best k, then a warp per row merges them (one launch for short rows).
fn topk_warp(
    dev: &candle_core::CudaDevice,
    x: u64,
    dt: DType,
    r: usize,
    n: usize,
    k: usize,
) -> Result<(CudaStorage, CudaStorage)> {
    let segs = n.div_ceil(WARP_SEG);
    if r.saturating_mul(segs) > i32::MAX as usize {
        bail!("x: {r} rows of {n} exceed one launch")
    }
    let launch_warps = |name: &str, p: &TopkWarpParams, warps: usize| -> Result<()> {
        let func = kernel(dev, Module::Topk, name, 0)?;
        launch(dev, &func, blocks(warps.div_ceil(WARP_WARPS) as u32, 32 * WARP_WARPS as u32, 0), p)
    };
    let (values, idx) = outputs(dev, r * k)?;
    let last = TopkWarpParams {
        x,
        keys: 0,
        values: storage_ptr(&values, &Layout::contiguous(r * k))?,
        indices: storage_ptr(&idx, &Layout::contiguous(r * k))?,
        n: n as i64,
        segs: 1,
        k: k as i32,
        rows: r as i32,
        last: 1,
    };
    let name = format!("topk_warp_{}", dtype_tag(dt));
    if segs == 1 {
        launch_warps(&name, &last, r)?;
        return Ok((values, idx));
    }
    // SAFETY: the first launch writes every key (k per segment).
    let keys = unsafe { dev.alloc::<u64>(r * segs * k) }?;
    let kp = super::memory::slice_ptr(dev, &keys);
    launch_warps(&name, &TopkWarpParams { keys: kp, segs: segs as i32, last: 0, ..last }, r * segs)?;
    launch_warps("topk_warp_pairs", &TopkWarpParams { x: kp, n: (segs * k) as i64, ..last }, r)?;
    drop(keys); // freed in stream order, after the second launch
    Ok((values, idx))
}
