//! PLAID residual scoring on CUDA: the fused forwards (tokens decompressed
//! straight into tensor-core fragments by kernels/residual.cu for queries of
//! up to 32 rows, inside the MaxSim tile loader otherwise; never written to
//! device memory) and a standalone decompression kernel for the gradient path.

use super::maxsim_fwd::{fwd_launch, residual_supported, Variant};
use super::params::{dtype_tag, Params};
use super::{alloc_out, device_info, fwd_func, launch, load_func, storage_ptr, tensor_ptr, HostFlag, RESIDUAL};
use crate::layout::{Pairing, Problem, Seqs};
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};

/// Mirror of `ResScoreParams` in kernels/residual.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ResScoreParams {
    q: u64,
    centroids: u64,
    buckets: u64,
    codes: u64,
    residuals: u64,
    cu_d: u64,
    d_lens: u64,
    out: u64,
    work: u64,
    bad: u64,
    nq: i32,
    nd: i32,
    lq: i32,
    ld: i32,
    n_centroids: i32,
    nbits: i32,
    colbert_order: i32,
    normalize: i32,
    codes_i64: i32,
}
// SAFETY: plain old data with the layout of the C struct.
unsafe impl DeviceRepr for ResScoreParams {}

/// How the compressed documents' tokens are laid out for the warp kernel.
pub(crate) enum WarpDocs<'a> {
    /// Packed: the problem's `cu_d` offsets.
    Packed,
    /// Padded `[Nd, Ld]`: document j is rows `j·Ld ..`, `lens[j]` of them (U32, validated).
    Padded(&'a Tensor),
}

/// How residual scoring runs on a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ResidualPath {
    /// kernels/residual.cu: a warp per (query, document), tokens decoded
    /// straight into MMA fragments (short unmasked queries, dims 64 / 96 / 128).
    Warp,
    /// The MaxSim tile kernels with the residual loader.
    Tile,
    /// The decompression kernel, then the dense MaxSim op (a gradient to q).
    Dense,
    /// No kernel covers this dtype / dim / nbits on this device: the host decompresses.
    Host,
}

/// The path of a residual scoring problem: the one place where each
/// condition is written. `q_dtype`: the queries' dtype; `grad`: q needs a
/// gradient; `codes_dtype`, `n_centroids`: of the compressed documents;
/// `padded`: documents laid out `[Nd, Ld]` with lengths (else packed by `pb.d`).
pub(crate) fn residual_path(
    dev: &CudaDevice,
    pb: &Problem,
    q_dtype: DType,
    nbits: usize,
    grad: bool,
    (codes_dtype, n_codes, n_centroids): (DType, usize, usize),
) -> Result<ResidualPath> {
    if !residual_supported(dev, q_dtype, pb.dim, nbits)? {
        return Ok(ResidualPath::Host);
    }
    if grad {
        return Ok(ResidualPath::Dense);
    }
    let warp = match (&pb.q, &pb.pairs) {
        (Seqs::Uniform { n: nq, len: lq }, Pairing::Cross { nd, .. }) => {
            // (compute capability 8.0+ and F16/BF16 queries: residual_supported above)
            !crate::knobs::knobs().residual_tile
                && pb.q_valid.is_none()
                && matches!(codes_dtype, DType::U32 | DType::I64)
                && matches!(pb.dim, 64 | 96 | 128)
                && (1..=32).contains(lq)
                && nq * nd < i32::MAX as usize
                && n_codes < i32::MAX as usize
                // No centroids: every code is out of range, which the tile path reports.
                && n_centroids > 0
        }
        _ => false,
    };
    Ok(if warp { ResidualPath::Warp } else { ResidualPath::Tile })
}

/// Fused residual scores `[Nq·Nd]` F32 by kernels/residual.cu, where
/// [`residual_path`] chose [`ResidualPath::Warp`]. `q` `[Nq·Lq, dim]`
/// F16/BF16, normalized by the caller if asked; `codes` U32 or I64 (any
/// shape, one per token row), checked against the centroid count by the
/// kernel itself (one 4-byte read-back, no separate pass over the codes).
#[allow(clippy::too_many_arguments)]
pub(crate) fn residual_scores_warp(
    pb: &Problem,
    q: &Tensor,
    codes: &Tensor,
    residuals: &Tensor,
    centroids: &Tensor,
    buckets: &Tensor,
    (nbits, colbert_order, normalize): (usize, bool, bool),
    docs: WarpDocs,
) -> Result<Tensor> {
    let internal = || candle_core::Error::Msg("maxsim_residual: internal error, no warp-kernel problem".into());
    let candle_core::Device::Cuda(dev) = q.device() else { return Err(internal()) };
    let (Seqs::Uniform { n: nq, len: lq }, Pairing::Cross { nd, .. }) = (&pb.q, &pb.pairs) else {
        return Err(internal());
    };
    let (nq, lq, nd, dim) = (*nq, *lq, *nd, pb.dim);
    let (cu, lens, ld) = match (&docs, &pb.d) {
        (WarpDocs::Packed, Seqs::Packed { cu_dev, .. }) => (Some(cu_dev.contiguous()?), None, 0),
        (WarpDocs::Padded(l), Seqs::Uniform { len, .. }) => (None, Some(l.contiguous()?), *len),
        _ => return Err(internal()),
    };
    let aligned = |t: &Tensor, a: u64| -> Result<Tensor> {
        let t = t.contiguous()?;
        Ok(if tensor_ptr(&t)? % a == 0 { t } else { t.copy()? })
    };
    // Centroids in their own 16-bit dtype (no per-call cast); others in the query's.
    let cents = match centroids.dtype() {
        DType::F16 | DType::BF16 => aligned(centroids, 16)?,
        _ => aligned(&centroids.to_dtype(q.dtype())?, 16)?,
    };
    let q = aligned(q, 8)?;
    let codes = codes.flatten_all()?.contiguous()?;
    let residuals = aligned(&residuals.flatten_all()?, 16)?;
    let buckets = buckets.to_dtype(DType::F32)?.contiguous()?;
    let out = alloc_out(dev, DType::F32, nq * nd)?;
    let work = Tensor::zeros(1, DType::U32, q.device())?;
    let bad = HostFlag::new(dev)?;
    let n_c = cents.dim(0)?;
    let params = ResScoreParams {
        q: tensor_ptr(&q)?,
        centroids: tensor_ptr(&cents)?,
        buckets: tensor_ptr(&buckets)?,
        codes: tensor_ptr(&codes)?,
        residuals: tensor_ptr(&residuals)?,
        cu_d: cu.as_ref().map(tensor_ptr).transpose()?.unwrap_or(0),
        d_lens: lens.as_ref().map(tensor_ptr).transpose()?.unwrap_or(0),
        out: storage_ptr(&out, &Layout::contiguous(nq * nd))?,
        work: tensor_ptr(&work)?,
        bad: bad.dev_ptr(),
        nq: nq as i32,
        nd: nd as i32,
        lq: lq as i32,
        ld: ld as i32,
        n_centroids: n_c.min(i32::MAX as usize) as i32,
        nbits: nbits as i32,
        colbert_order: colbert_order as i32,
        normalize: normalize as i32,
        codes_i64: (codes.dtype() == DType::I64) as i32,
    };
    let name = format!("maxsim_res_{}_{}_d{dim}", dtype_tag(q.dtype()), dtype_tag(cents.dtype()));
    let func = load_func(dev, &name, 0, "residual", &RESIDUAL)?;
    // A persistent grid: warps take (query, document) tasks from a counter.
    let per_sm = func.occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None).w()?.max(1) as usize;
    let blocks = (device_info(dev)?.sm_count as usize * per_sm).min((nq * nd).div_ceil(THREADS as usize / 32));
    launch(dev, &func, blocks.max(1) as u32, THREADS, 0, &params)?;
    if bad.is_set(dev)? {
        bail!("codes: a code of a scored token is out of range for {n_c} centroids")
    }
    drop((q, codes, residuals, cents, buckets, cu, lens));
    Ok(Tensor::from((Storage::Cuda(out), nq * nd)))
}

/// Threads per block of kernels/residual.cu (its launch bounds).
const THREADS: u32 = 128;

/// Compressed documents on the device, validated by the caller: `codes`
/// `[T]` U32 (every code < the number of centroids), `residuals` `[T, dim·nbits/8]`
/// U8, `centroids` `[C, dim]` in the query dtype, `buckets` `[2^nbits]` F32.
pub(crate) struct ResidualDev {
    pub codes: Tensor,
    pub residuals: Tensor,
    pub centroids: Tensor,
    pub buckets: Tensor,
    pub nbits: usize,
    pub colbert_order: bool,
    pub normalize: bool,
}

impl ResidualDev {
    /// Contiguous operands with the alignment the kernels' vector loads need.
    fn prepared(&self) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let aligned = |t: &Tensor, a: u64| -> Result<Tensor> {
            let t = t.contiguous()?;
            Ok(if tensor_ptr(&t)? % a == 0 { t } else { t.copy()? })
        };
        Ok((
            self.codes.contiguous()?,
            aligned(&self.residuals, 8)?,
            aligned(&self.centroids, 16)?,
            self.buckets.contiguous()?,
        ))
    }

    fn params(&self, dim: usize, ops: &(Tensor, Tensor, Tensor, Tensor)) -> Result<Params> {
        Ok(Params {
            dim: dim as i32,
            res_codes: tensor_ptr(&ops.0)?,
            res_residuals: tensor_ptr(&ops.1)?,
            res_centroids: tensor_ptr(&ops.2)?,
            res_buckets: tensor_ptr(&ops.3)?,
            res_nbits: self.nbits as i32,
            res_colbert_order: self.colbert_order as i32,
            res_normalize: self.normalize as i32,
            ..Default::default()
        })
    }
}

/// Fused residual scores `[n_pairs]` F32 of packed queries `q` `[Tq, dim]`
/// against the compressed documents laid out by `pb.d`.
pub(crate) fn residual_scores(pb: &Problem, q: &Tensor, r: &ResidualDev) -> Result<Tensor> {
    let q = q.contiguous()?;
    let ops = r.prepared()?;
    let (qs, ql) = q.storage_and_layout();
    let Storage::Cuda(cs) = &*qs else { bail!("maxsim_residual: internal error, expected a CUDA tensor") };
    let qp = storage_ptr(cs, ql)?;
    let src =
        Params { q: qp, vec_ok: (qp.is_multiple_of(16) && pb.dim.is_multiple_of(8)) as i32, ..r.params(pb.dim, &ops)? };
    let (out, _) = fwd_launch(&cs.device, pb, q.dtype(), src, Variant::Residual)?;
    drop(ops); // stream-ordered free, after the launch
    Ok(Tensor::from((Storage::Cuda(out), pb.n_out())))
}

/// Dense `[T, dim]` tokens in `dtype` (F16 or BF16), normalized if `r.normalize`.
pub(crate) fn decompress(r: &ResidualDev, dtype: DType, dim: usize) -> Result<Tensor> {
    let n = r.codes.dim(0)?;
    let dev = match r.codes.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("maxsim_residual: internal error, expected a CUDA tensor"),
    };
    let ops = r.prepared()?;
    let p = r.params(dim, &ops)?;
    // SAFETY: the kernel writes every element (n rows of dim).
    let (out, ptr) = unsafe {
        match dtype {
            DType::F16 => {
                let s = dev.alloc::<half::f16>((n * dim).max(1))?;
                let ptr = super::slice_ptr(&dev, &s);
                (CudaStorage::wrap_cuda_slice(s, dev.clone()), ptr)
            }
            DType::BF16 => {
                let s = dev.alloc::<half::bf16>((n * dim).max(1))?;
                let ptr = super::slice_ptr(&dev, &s);
                (CudaStorage::wrap_cuda_slice(s, dev.clone()), ptr)
            }
            dt => bail!("maxsim_residual: internal error, no decompression kernel for {dt:?}"),
        }
    };
    if n > 0 {
        let name = format!("maxsim_decompress_{}", dtype_tag(dtype));
        let func = fwd_func(&dev, &name, 0)?;
        let rows_per_warp = 32 / (dim / 8).next_power_of_two().min(32);
        let warps = n.div_ceil(rows_per_warp);
        let blocks = warps.div_ceil(8).min(device_info(&dev)?.sm_count as usize * 16).max(1);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        let n32 = n as i32;
        b.arg(&p);
        b.arg(&ptr);
        b.arg(&n32);
        // SAFETY: (MaxSimParams, T*, int) as declared in maxsim_fwd.cu.
        unsafe { b.launch(cfg) }.w()?;
    }
    drop(ops);
    Ok(Tensor::from((Storage::Cuda(out), (n, dim))))
}
