//! Backward launch of kernels/maxsim_bwd.cu, gradients written in the input dtype.
//!
//! - `LowMem`: grad_Q by a warp per query row; grad_D by a block per
//!   (document, chunk of rows) accumulating the chunk in shared memory.
//!   No atomics, no global scratch (list mode uploads the pair CSR),
//!   bitwise deterministic.
//! - `Unified`: one fused kernel, a warp per query row: grad_Q, and grad_D by
//!   atomics into a zeroed f32 buffer `[Td, dim]` (the output itself for
//!   F32 / F64), narrowed to F16 / BF16 at the end.

use super::device::device_info;
use super::launch::{blocks, grid_stride, kernel, kernel_params, launch, Module};
use super::memory::{alloc_out, slice_ptr, storage_ptr, tensor_ptr};
use super::params::{dtype_tag, layout_params, Params};
use crate::layout::{Pairing, Problem};
use crate::options::Backward;
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};

/// Mirror of `BwdParams` in kernels/maxsim_bwd.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct BwdParams {
    f: Params,
    g: u64,
    gq: u64,
    gd: u64,
    gd_acc: u64,
    by_q_off: u64,
    by_q: u64,
    by_d_off: u64,
    by_d: u64,
    n_cast: i64,
    tq: i32,
    tc: i32,
    d_chunks: i32,
    list_off: i32,
}
kernel_params!(BwdParams);

/// Warps per block of the query-row kernels (`BWD_WARPS`).
const WARPS: usize = 8;
/// Warps per block of the grad_D chunk kernel (`DD_WARPS`) and hits per warp list (`DD_LIST`).
const DD_WARPS: usize = 8;
const DD_LIST: usize = 512;

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

/// A zeroed F32 / F64 buffer (Unified accumulates grad_D into it in place).
fn alloc_zeroed(dev: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    let n = n.max(1);
    Ok(match dtype {
        DType::F32 => CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>(n)?, dev.clone()),
        DType::F64 => CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f64>(n)?, dev.clone()),
        dt => bail!("maxsim: internal error, no in-place accumulation in {dt:?}"),
    })
}

/// Query-row kernel variant (`maxsim_bwd_q` / `maxsim_bwd_u`): `vG` / `v64`
/// read 16-byte chunks (G lanes per row, v64 = 32 lanes x 2 chunks), `s2` /
/// `s8` single elements (32 lanes x 2 or 8 columns per pass) where rows are
/// not 16-byte multiples or a base is unaligned.
fn row_variant(dtype: DType, dim: usize, aligned: bool) -> &'static str {
    let vec = 16 / dtype.size_in_bytes();
    if aligned && dim.is_multiple_of(vec) {
        match dim / vec {
            0..=8 => "v8",
            9..=16 => "v16",
            17..=32 => "v32",
            _ => "v64",
        }
    } else if dim <= 64 {
        "s2"
    } else {
        "s8"
    }
}

/// grad_D chunk kernel variant (`maxsim_bwd_dd`): `v` loads Q in 8-byte
/// chunks (dim a multiple of the chunk, Q 8-byte aligned), `s` element by element.
fn chunk_variant(dtype: DType, dim: usize, q_ptr: u64) -> &'static str {
    let vec = (8 / dtype.size_in_bytes()).max(1);
    if q_ptr.is_multiple_of(8) && dim.is_multiple_of(vec) {
        "v"
    } else {
        "s"
    }
}

/// Rows per block of the grad_D chunk kernel and its dynamic shared memory:
/// `[tc][dim]` accumulators, then the warps' hit lists. Sized for two
/// blocks per SM where the device allows it; one block with all of the
/// opt-in memory for wide rows.
fn chunk_plan(dtype: DType, dim: usize, max_ld: usize, optin: usize) -> Result<(usize, usize, usize)> {
    let row = dim * if dtype == DType::F64 { 8 } else { 4 };
    let lists = DD_WARPS * DD_LIST * 8;
    // Static shared memory (the warps' hit stages and list lengths, `s_stage`
    // and `s_len`) and the per-block reservation come on top.
    let fixed = DD_WARPS * 64 * 8 + DD_WARPS * 4 + 1024;
    let cap = optin.saturating_sub(fixed);
    let target = (optin / 2).saturating_sub(fixed).max(48 * 1024).min(cap);
    let mut tc = target.saturating_sub(lists) / row;
    if tc == 0 {
        tc = cap.saturating_sub(lists) / row;
    }
    if tc == 0 {
        bail!("maxsim: dim {dim} is too wide for the LowMem backward's shared memory; use Backward::Unified")
    }
    let chunks = max_ld.div_ceil(tc.min(max_ld)).max(1);
    let tc = max_ld.div_ceil(chunks).max(1);
    let list_off = (tc * row).next_multiple_of(16);
    Ok((tc, chunks, list_off + lists))
}

/// `(grad_q, grad_d)` from the saved argmax `[n_pairs, max_lq]` (I32 or I16).
pub(crate) fn maxsim_bwd(
    pb: &Problem,
    mode: Backward,
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
    let (n_out, max_lq, dim) = (pb.n_out(), pb.q.max_len(), pb.dim);
    // Operands of any rank, read as packed rows [rows, dim].
    let (tq, td) = (q.elem_count() / dim.max(1), d.elem_count() / dim.max(1));
    if n_out == 0 || dim == 0 || tq == 0 || td == 0 || max_lq == 0 {
        // Nothing was scored: zero gradients.
        return Ok((q.zeros_like()?, d.zeros_like()?));
    }
    if tq != pb.q.rows() || td != pb.d.rows() {
        bail!("maxsim: internal error, packed operands do not match the problem's rows")
    }
    let argmax_i16 = argmax.dtype() == DType::I16;
    if !matches!(argmax.dtype(), DType::I32 | DType::I16)
        || argmax.elem_count() != n_out * max_lq
        || grad.elem_count() != n_out
    {
        bail!("maxsim: internal error, saved argmax / score gradient do not match the problem")
    }
    let too_big = || candle_core::Error::Msg("maxsim: backward too large for 32-bit indices; split the batch".into());
    if tq > i32::MAX as usize || td > i32::MAX as usize || dim > i32::MAX as usize {
        return Err(too_big());
    }
    let mode = mode.resolve(false, pb.q.n(), pb.d.n(), pb.q.max_len());
    let g = grad.to_dtype(DType::F32)?.contiguous()?;
    let argmax = argmax.contiguous()?;
    let (qp, dp) = (tensor_ptr(q)?, tensor_ptr(d)?);
    let (q_al, d_al) = (qp.is_multiple_of(16), dp.is_multiple_of(16));
    let mut p = BwdParams {
        f: Params { q: qp, d: dp, argmax: tensor_ptr(&argmax)?, argmax_i16: argmax_i16 as i32, ..layout_params(pb)? },
        g: tensor_ptr(&g)?,
        tq: tq as i32,
        ..Default::default()
    };
    let tag = dtype_tag(dtype);
    // The same variant in both modes: grad_Q is summed in the same order by LowMem and Unified.
    let row_var = row_variant(dtype, dim, q_al && d_al);
    let row_blocks = (tq.div_ceil(WARPS)) as u32;
    let threads = (32 * WARPS) as u32;

    // List mode: the pairs of each query (and for LowMem of each document), built on the host.
    let mut host: Vec<u32> = Vec::new();
    let mut at = [None; 4];
    let mut most_pairs_per_doc = pb.q.n(); // cross mode: every query
    if let Pairing::List { pq, pd, .. } = &pb.pairs {
        let (qo, qi) = csr(pb.q.n(), pq);
        let mut parts = vec![qo, qi];
        if mode == Backward::LowMem {
            let (doff, di) = csr(pb.d.n(), pd);
            most_pairs_per_doc = doff.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
            parts.extend([doff, di]);
        }
        for (k, v) in parts.iter().enumerate() {
            at[k] = Some(host.len());
            host.extend_from_slice(v);
        }
    }
    let idx_dev: Option<CudaSlice<u32>> = if host.is_empty() { None } else { Some(dev.clone_htod(&host)?) };
    if let Some(buf) = &idx_dev {
        let base = slice_ptr(&dev, buf);
        let ptr = |k: usize| at[k].map_or(0, |o: usize| base + 4 * o as u64);
        (p.by_q_off, p.by_q, p.by_d_off, p.by_d) = (ptr(0), ptr(1), ptr(2), ptr(3));
    }

    let gq = alloc_out(&dev, dtype, tq * dim)?;
    p.gq = storage_ptr(&gq, &Layout::contiguous(1))?;
    let gd = if mode == Backward::LowMem {
        // The chunk kernel indexes a document's entries (pairs x max_lq) in 32 bits.
        if most_pairs_per_doc * max_lq > (i32::MAX as usize) - 1024 {
            return Err(too_big());
        }
        let gd = alloc_out(&dev, dtype, td * dim)?;
        p.gd = storage_ptr(&gd, &Layout::contiguous(1))?;
        let f = kernel(&dev, Module::MaxsimBwd, &format!("maxsim_bwd_q_{tag}_{row_var}"), 0)?;
        launch(&dev, &f, blocks(row_blocks, threads, 0), &p)?;
        let info = device_info(&dev)?;
        let (tc, chunks, smem) = chunk_plan(dtype, dim, pb.d.max_len(), info.smem_optin)?;
        let n_blocks = pb.d.n() * chunks;
        if n_blocks > i32::MAX as usize {
            return Err(too_big());
        }
        (p.tc, p.d_chunks, p.list_off) = (tc as i32, chunks as i32, (smem - DD_WARPS * DD_LIST * 8) as i32);
        let var = chunk_variant(dtype, dim, qp);
        let f = kernel(&dev, Module::MaxsimBwd, &format!("maxsim_bwd_dd_{tag}_{var}"), smem as u32)?;
        launch(&dev, &f, blocks(n_blocks as u32, (32 * DD_WARPS) as u32, smem as u32), &p)?;
        gd
    } else {
        // Unified: one fused kernel; F16 / BF16 accumulate in F32, then narrow.
        let half = matches!(dtype, DType::F16 | DType::BF16);
        let gd = if half { alloc_out(&dev, dtype, td * dim)? } else { alloc_zeroed(&dev, dtype, td * dim)? };
        p.gd = storage_ptr(&gd, &Layout::contiguous(1))?;
        let acc: Option<CudaSlice<f32>> = if half { Some(dev.alloc_zeros::<f32>(td * dim)?) } else { None };
        if let Some(a) = &acc {
            p.gd_acc = slice_ptr(&dev, a);
            p.n_cast = (td * dim) as i64;
        }
        let f = kernel(&dev, Module::MaxsimBwd, &format!("maxsim_bwd_u_{tag}_{row_var}"), 0)?;
        launch(&dev, &f, blocks(row_blocks, threads, 0), &p)?;
        if acc.is_some() {
            // 4 elements per thread.
            let f = kernel(&dev, Module::MaxsimBwd, &format!("maxsim_bwd_cast_{tag}"), 0)?;
            launch(&dev, &f, grid_stride(&dev, td * dim, 4 * 256, 256, 8)?, &p)?;
        }
        drop(acc); // stream-ordered free, after the launches
        gd
    };
    drop(idx_dev);
    let gq = Tensor::from((Storage::Cuda(gq), q.shape().clone()));
    let gd = Tensor::from((Storage::Cuda(gd), d.shape().clone()));
    Ok((gq, gd))
}
