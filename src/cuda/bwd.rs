//! Backward launch of kernels/maxsim_bwd.cu: grad_Q by a warp per query row,
//! grad_D by a block per (document, row chunk), both destination-owned and
//! deterministic, written in the input dtype.

use super::fwd::{dtype_tag, layout_params, Params};
use super::{bwd_func, launch, slice_ptr, storage_ptr, tensor_ptr};
use crate::layout::{Pairing, Problem};
use crate::Backward;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};

/// Mirror of `BwdParams` in kernels/maxsim_bwd.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct BwdParams {
    f: Params,
    g: u64,
    gq: u64,
    gd: u64,
    by_q_off: u64,
    by_q: u64,
    by_d_off: u64,
    by_d: u64,
    tq: i32,
    tc: i32,
    d_chunks: i32,
    cols: i32,
}
// SAFETY: plain old data with the layout of the C struct.
unsafe impl DeviceRepr for BwdParams {}

const WARPS: u32 = 4;
const COLS: usize = 256;

/// Pairs grouped by a key (query or document), ascending pair order within a group.
fn csr(n: usize, keys: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let mut off = vec![0u32; n + 1];
    for &k in keys {
        off[k as usize + 1] += 1;
    }
    for i in 0..n {
        off[i + 1] += off[i];
    }
    let mut fill = off.clone();
    let mut items = vec![0u32; keys.len()];
    for (pair, &k) in keys.iter().enumerate() {
        items[fill[k as usize] as usize] = pair as u32;
        fill[k as usize] += 1;
    }
    (off, items)
}

/// An uninitialized output of `n` elements of `dtype` (every element is written by the kernels).
fn alloc_out(dev: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    let n = n.max(1);
    // SAFETY: the kernels write every element before anyone reads it.
    Ok(unsafe {
        match dtype {
            DType::F16 => CudaStorage::wrap_cuda_slice(dev.alloc::<half::f16>(n)?, dev.clone()),
            DType::BF16 => CudaStorage::wrap_cuda_slice(dev.alloc::<half::bf16>(n)?, dev.clone()),
            DType::F32 => CudaStorage::wrap_cuda_slice(dev.alloc::<f32>(n)?, dev.clone()),
            DType::F64 => CudaStorage::wrap_cuda_slice(dev.alloc::<f64>(n)?, dev.clone()),
            dt => bail!("maxsim: unsupported dtype {dt:?} in the backward"),
        }
    })
}

/// `(grad_q, grad_d)` from the saved argmax. Every `Backward` mode runs the
/// destination-owned kernels (LowMem semantics: deterministic, no atomics).
pub(crate) fn maxsim_bwd(
    pb: &Problem,
    _mode: Backward,
    q: &Tensor,
    d: &Tensor,
    argmax: &Tensor,
    grad: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let dev = match q.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("maxsim: internal error, expected a CUDA device"),
    };
    let dtype = q.dtype();
    let (tq, td) = (q.dim(0)?, d.dim(0)?);
    if pb.n_out() == 0 || pb.dim == 0 {
        // Nothing was scored: zero gradients.
        return Ok((q.zeros_like()?, d.zeros_like()?));
    }
    let gq = alloc_out(&dev, dtype, tq * pb.dim)?;
    let gd = alloc_out(&dev, dtype, td * pb.dim)?;
    let g = grad.to_dtype(DType::F32)?.contiguous()?;
    let argmax = argmax.contiguous()?;
    let mut p = BwdParams {
        f: Params { q: tensor_ptr(q)?, d: tensor_ptr(d)?, argmax: tensor_ptr(&argmax)?, ..layout_params(pb)? },
        g: tensor_ptr(&g)?,
        gq: storage_ptr(&gq, &Layout::contiguous(1))?,
        gd: storage_ptr(&gd, &Layout::contiguous(1))?,
        tq: tq as i32,
        ..Default::default()
    };
    // List mode: the pairs of each query and of each document, built on the host once.
    let mut keep: Vec<CudaSlice<u32>> = Vec::new();
    if let Pairing::List { pq, pd, .. } = &pb.pairs {
        let (qo, qi) = csr(pb.q.n(), pq);
        let (doff, di) = csr(pb.d.n(), pd);
        for v in [qo, qi, doff, di] {
            keep.push(dev.clone_htod(&v)?);
        }
        p.by_q_off = slice_ptr(&dev, &keep[0]);
        p.by_q = slice_ptr(&dev, &keep[1]);
        p.by_d_off = slice_ptr(&dev, &keep[2]);
        p.by_d = slice_ptr(&dev, &keep[3]);
    }
    let acc_bytes = if dtype == DType::F64 { 8 } else { 4 };
    let cols = pb.dim.next_multiple_of(32).clamp(32, COLS);
    p.cols = cols as i32;
    p.tc = (48 * 1024 / (WARPS as usize * cols * acc_bytes)) as i32;
    p.d_chunks = pb.d.max_len().div_ceil(p.tc as usize).max(1) as i32;
    let tag = dtype_tag(dtype);
    if tq > 0 {
        let f = bwd_func(&dev, &format!("maxsim_bwd_dq_{tag}"), 0)?;
        launch(&dev, &f, tq.div_ceil(WARPS as usize) as u32, 32 * WARPS, 0, &p)?;
    }
    let d_blocks = pb.d.n() * p.d_chunks as usize;
    if td > 0 && d_blocks > 0 {
        let f = bwd_func(&dev, &format!("maxsim_bwd_dd_{tag}"), 0)?;
        launch(&dev, &f, d_blocks as u32, 32 * WARPS, (48 * 1024) as u32, &p)?;
    }
    drop(keep); // stream-ordered free, after the launches
    let gq = Tensor::from((Storage::Cuda(gq), q.shape().clone()));
    let gd = Tensor::from((Storage::Cuda(gd), d.shape().clone()));
    Ok((gq, gd))
}
