//! PLAID residual scoring on CUDA: the path decision, the fused forwards
//! (tokens decompressed straight into tensor-core fragments by
//! kernels/residual.cu for queries of up to 32 rows, inside the MaxSim tile
//! loader otherwise; never written to device memory), the code check the
//! tile and decompression kernels rely on, and the standalone decompression
//! kernel (dense tokens for the gradient path).

use super::maxsim_fwd::{fwd_launch, residual_supported, Variant};
use super::params::{dtype_tag, Params};
use super::{
    aligned_ptr, alloc_out, device_info, fwd_func, launch, load_func, storage_ptr, tensor_ptr, HostFlag, RESIDUAL,
};
use crate::layout::{Pairing, Problem, Seqs};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Tensor};

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
    pair_q: u64,
    pair_d: u64,
    n_pairs: i32,
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
    /// No kernel covers this dtype / dim / nbits on this device: the host decompresses.
    Host,
}

/// The path of a residual scoring problem (no gradient: training scores
/// decompressed documents with the dense op): the one place where each
/// condition is written. `q_dtype`: the queries' dtype; `codes_dtype`,
/// `n_codes`, `n_centroids`: of the compressed documents.
pub(crate) fn residual_path(
    dev: &CudaDevice,
    pb: &Problem,
    q_dtype: DType,
    nbits: usize,
    (codes_dtype, n_codes, n_centroids): (DType, usize, usize),
) -> Result<ResidualPath> {
    if !residual_supported(dev, q_dtype, pb.dim, nbits)? {
        return Ok(ResidualPath::Host);
    }
    let warp = match (&pb.q, &pb.pairs) {
        (Seqs::Uniform { n: nq, len: lq }, Pairing::Cross { nd, .. }) => {
            pb.q_valid.is_none()
                && nq * nd < i32::MAX as usize
                && warp_applies(pb.dim, *lq, codes_dtype, n_codes, n_centroids)
        }
        _ => false,
    };
    Ok(if warp { ResidualPath::Warp } else { ResidualPath::Tile })
}

/// Whether kernels/residual.cu scores queries of `lq` rows (no mask) at `dim`
/// against `n_codes` tokens of `codes_dtype` codes, where
/// [`residual_supported`] holds (compute capability 8.0+, F16/BF16 queries).
pub(crate) fn warp_applies(dim: usize, lq: usize, codes_dtype: DType, n_codes: usize, n_centroids: usize) -> bool {
    !crate::knobs::knobs().residual_tile
        && matches!(codes_dtype, DType::U32 | DType::I64)
        && matches!(dim, 64 | 96 | 128)
        && (1..=32).contains(&lq)
        && n_codes < i32::MAX as usize
        // No centroids: every code is out of range, which the tile path reports.
        && n_centroids > 0
}

/// Which (query, document) pairs the warp kernel scores.
pub(crate) enum WarpTasks<'a> {
    /// Every query against every document: `[Nq·Nd]` scores.
    Cross,
    /// `[P]` U32 query and document indices on the device (document
    /// `u32::MAX`: no document, -inf); `[P]` scores. Checked by the kernel.
    Pairs(&'a Tensor, &'a Tensor),
}

/// A contiguous operand: its storage and layout.
pub(crate) type Operand<'a> = (&'a CudaStorage, &'a Layout);

/// The codec as the kernels take it: centroids `[C, dim]` (in `dtype`, 16-byte
/// aligned), bucket weights `[2^nbits]` F32, and the decoding flags.
pub(crate) struct CodecDev<'a> {
    pub centroids: &'a Tensor,
    pub buckets: &'a Tensor,
    pub nbits: usize,
    pub colbert_order: bool,
    pub normalize: bool,
}

impl CodecDev<'_> {
    /// Centroids in `dtype` and F32 bucket weights, contiguous and aligned.
    fn operands(&self, dtype: DType) -> Result<(Tensor, Tensor)> {
        let cents = self.centroids.to_dtype(dtype)?.contiguous()?;
        let cents = if tensor_ptr(&cents)?.is_multiple_of(16) { cents } else { cents.copy()? };
        Ok((cents, self.buckets.to_dtype(DType::F32)?.contiguous()?))
    }
}

/// Validated U32 codes for the tile and decompression kernels, which index
/// the centroids unchecked: one launch (kernels/residual.cu) reads U32 or I64
/// codes, zeroes those of padding slots (`valid`), and flags out-of-range
/// codes of valid tokens; the flag is read after the stream syncs.
pub(crate) fn codes_u32(codes: Operand, valid: Option<&Tensor>, n_centroids: usize) -> Result<CudaStorage> {
    let (cs, cl) = codes;
    let dev = &cs.device;
    let n = cl.shape().elem_count();
    let out = alloc_out_u32(dev, n)?;
    if n == 0 {
        return Ok(out);
    }
    let valid = valid.map(|v| v.flatten_all()?.contiguous()).transpose()?;
    let bad = HostFlag::new(dev)?;
    let func = load_func(dev, "residual_codes_u32", 0, "residual", &RESIDUAL)?;
    let blocks = n.div_ceil(256).min(device_info(dev)?.sm_count as usize * 8).max(1) as u32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (cp, vp, op) = (
        storage_ptr(cs, cl)?,
        valid.as_ref().map(tensor_ptr).transpose()?.unwrap_or(0),
        storage_ptr(&out, &Layout::contiguous(n))?,
    );
    let (is_i64, n64, nc, bp) = ((cs.dtype() == DType::I64) as i32, n as i64, n_centroids as i64, bad.dev_ptr());
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&cp);
    b.arg(&is_i64);
    b.arg(&vp);
    b.arg(&n64);
    b.arg(&nc);
    b.arg(&op);
    b.arg(&bp);
    // SAFETY: (const void*, int, const uint8_t*, long long, long long, uint32_t*, unsigned*) as in
    // residual.cu; codes and out hold n elements, valid n bytes (or null).
    unsafe { b.launch(cfg) }.w()?;
    if bad.is_set(dev)? {
        bail!("codes: a code of a scored token is out of range for {n_centroids} centroids")
    }
    drop(valid);
    Ok(out)
}

fn alloc_out_u32(dev: &CudaDevice, n: usize) -> Result<CudaStorage> {
    // SAFETY: the codes kernel writes every element before anyone reads it.
    Ok(CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<u32>(n.max(1)) }?, dev.clone()))
}

/// Fused residual scores `[Nq·Nd]` F32 by kernels/residual.cu, where
/// [`residual_path`] chose [`ResidualPath::Warp`]. `q` `[Nq·Lq, dim]`
/// F16/BF16, normalized by the caller if asked; `codes` U32 or I64, one per
/// token row, checked against the centroid count by the kernel itself (one
/// 4-byte host-mapped flag, no separate pass over the codes).
pub(crate) fn residual_scores_warp(
    pb: &Problem,
    q: Operand,
    codes: Operand,
    residuals: Operand,
    codec: &CodecDev,
    docs: WarpDocs,
    tasks: WarpTasks,
) -> Result<CudaStorage> {
    let internal = || candle_core::Error::Msg("maxsim_residual: internal error, no warp-kernel problem".into());
    let dev = &q.0.device;
    let Seqs::Uniform { n: nq, len: lq } = &pb.q else { return Err(internal()) };
    let (nq, lq, nd, dim) = (*nq, *lq, pb.d.n(), pb.dim);
    let (pairs, n_out) = match &tasks {
        WarpTasks::Cross => (None, nq * nd),
        WarpTasks::Pairs(pq, pd) => {
            let (pq, pd) = (pq.contiguous()?, pd.contiguous()?);
            let n = pq.dim(0)?;
            (Some((pq, pd)), n)
        }
    };
    let (cu, lens, ld) = match (&docs, &pb.d) {
        (WarpDocs::Packed, Seqs::Packed { cu_dev, .. }) => (Some(cu_dev.contiguous()?), None, 0),
        (WarpDocs::Padded(l), Seqs::Uniform { len, .. }) => (None, Some(l.contiguous()?), *len),
        _ => return Err(internal()),
    };
    // Centroids in their own 16-bit dtype (no per-call cast); others in the query's.
    let cent_dtype = match codec.centroids.dtype() {
        dt @ (DType::F16 | DType::BF16) => dt,
        _ => q.0.dtype(),
    };
    let (cents, buckets) = codec.operands(cent_dtype)?;
    let (qp, _q_copy) = aligned_ptr(q, 8)?;
    let (rp, _r_copy) = aligned_ptr(residuals, 16)?;
    let out = alloc_out(dev, DType::F32, n_out)?;
    let work = Tensor::zeros(1, DType::U32, &candle_core::Device::Cuda(dev.clone()))?;
    let bad = HostFlag::new(dev)?;
    let n_c = cents.dim(0)?;
    let params = ResScoreParams {
        q: qp,
        centroids: tensor_ptr(&cents)?,
        buckets: tensor_ptr(&buckets)?,
        codes: storage_ptr(codes.0, codes.1)?,
        residuals: rp,
        cu_d: cu.as_ref().map(tensor_ptr).transpose()?.unwrap_or(0),
        d_lens: lens.as_ref().map(tensor_ptr).transpose()?.unwrap_or(0),
        out: storage_ptr(&out, &Layout::contiguous(1))?,
        work: tensor_ptr(&work)?,
        bad: bad.dev_ptr(),
        nq: nq as i32,
        nd: nd as i32,
        lq: lq as i32,
        ld: ld as i32,
        n_centroids: n_c.min(i32::MAX as usize) as i32,
        nbits: codec.nbits as i32,
        colbert_order: codec.colbert_order as i32,
        normalize: codec.normalize as i32,
        codes_i64: (codes.0.dtype() == DType::I64) as i32,
        pair_q: pairs.as_ref().map(|p| tensor_ptr(&p.0)).transpose()?.unwrap_or(0),
        pair_d: pairs.as_ref().map(|p| tensor_ptr(&p.1)).transpose()?.unwrap_or(0),
        n_pairs: n_out as i32,
    };
    if n_out == 0 {
        return Ok(out);
    }
    let name = format!("maxsim_res_{}_{}_d{dim}", dtype_tag(q.0.dtype()), dtype_tag(cent_dtype));
    let func = load_func(dev, &name, 0, "residual", &RESIDUAL)?;
    // A persistent grid: warps take (query, document) tasks from a counter.
    let per_sm = func.occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None).w()?.max(1) as usize;
    let blocks = (device_info(dev)?.sm_count as usize * per_sm).min(n_out.div_ceil(THREADS as usize / 32));
    launch(dev, &func, blocks.max(1) as u32, THREADS, 0, &params)?;
    match bad.value(dev)? {
        0 => {}
        1 => bail!("codes: a code of a scored token is out of range for {n_c} centroids"),
        _ => bail!("pair_q: a pair's query or document index is out of range ({nq} queries, {nd} documents)"),
    }
    drop((cents, buckets, cu, lens, work, pairs));
    Ok(out)
}

/// Threads per block of kernels/residual.cu (its launch bounds).
const THREADS: u32 = 128;

/// The `res_*` fields of the MaxSim params: validated U32 `codes`, the
/// residual bytes at `residuals`, the codec's operands.
fn codec_params(
    dim: usize,
    codes: &CudaStorage,
    residuals: u64,
    codec: &CodecDev,
    ops: &(Tensor, Tensor),
) -> Result<Params> {
    Ok(Params {
        dim: dim as i32,
        res_codes: storage_ptr(codes, &Layout::contiguous(1))?,
        res_residuals: residuals,
        res_centroids: tensor_ptr(&ops.0)?,
        res_buckets: tensor_ptr(&ops.1)?,
        res_nbits: codec.nbits as i32,
        res_colbert_order: codec.colbert_order as i32,
        res_normalize: codec.normalize as i32,
        ..Default::default()
    })
}

/// Fused residual scores `[n_pairs]` F32 of packed queries `q` `[Tq, dim]`
/// (contiguous) against the compressed documents laid out by `pb.d`, by the
/// MaxSim tile kernels with the residual loader; `codes` from [`codes_u32`].
pub(crate) fn residual_scores_tile(
    pb: &Problem,
    q: Operand,
    codes: &CudaStorage,
    residuals: Operand,
    codec: &CodecDev,
) -> Result<CudaStorage> {
    let ops = codec.operands(q.0.dtype())?;
    let (rp, _r_copy) = aligned_ptr(residuals, 8)?;
    let qp = storage_ptr(q.0, q.1)?;
    let vec_ok = (qp.is_multiple_of(16) && pb.dim.is_multiple_of(8)) as i32;
    let src = Params { q: qp, vec_ok, ..codec_params(pb.dim, codes, rp, codec, &ops)? };
    let (out, _) = fwd_launch(&q.0.device, pb, q.0.dtype(), src, Variant::Residual)?;
    drop(ops); // stream-ordered free, after the launch
    Ok(out)
}

/// Dense `[n, dim]` tokens in `dtype` (F16 or BF16, where
/// [`residual_supported`] holds), normalized if `codec.normalize`; `codes`
/// from [`codes_u32`].
pub(crate) fn decompress(
    codes: &CudaStorage,
    residuals: Operand,
    codec: &CodecDev,
    dtype: DType,
    (n, dim): (usize, usize),
) -> Result<CudaStorage> {
    let dev = &codes.device;
    let out = alloc_out(dev, dtype, n * dim)?;
    if n == 0 {
        return Ok(out);
    }
    let ops = codec.operands(dtype)?;
    let (rp, _r_copy) = aligned_ptr(residuals, 8)?;
    let p = codec_params(dim, codes, rp, codec, &ops)?;
    let ptr = storage_ptr(&out, &Layout::contiguous(n * dim))?;
    let func = fwd_func(dev, &format!("maxsim_decompress_{}", dtype_tag(dtype)), 0)?;
    let rows_per_warp = 32 / (dim / 8).next_power_of_two().min(32);
    let warps = n.div_ceil(rows_per_warp);
    let blocks = warps.div_ceil(8).min(device_info(dev)?.sm_count as usize * 16).max(1);
    let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    let n32 = n as i32;
    b.arg(&p);
    b.arg(&ptr);
    b.arg(&n32);
    // SAFETY: (MaxSimParams, T*, int) as declared in maxsim_fwd.cu; out holds n rows of dim.
    unsafe { b.launch(cfg) }.w()?;
    drop(ops);
    Ok(out)
}

/// Packed residual bytes `[n, dim·nbits/8]` of tokens `x [n, dim]`
/// (contiguous F16/BF16/F32) with validated U32 `codes` (from
/// [`codes_u32`]) and `cutoffs [2^nbits − 1]` F32, by kernels/residual.cu.
pub(crate) fn compress_residual(
    x: Operand,
    codes: &CudaStorage,
    codec: &CodecDev,
    cutoffs: &Tensor,
) -> Result<CudaStorage> {
    let dev = &x.0.device;
    let (n, dim) = x.1.shape().dims2()?;
    let w = dim * codec.nbits / 8;
    // SAFETY: the kernel writes every byte.
    let out = CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<u8>((n * w).max(1)) }?, dev.clone());
    if n * w == 0 {
        return Ok(out);
    }
    let cent_dtype = if codec.centroids.dtype() == DType::F16 { DType::F16 } else { DType::F32 };
    let cents = codec.centroids.to_dtype(cent_dtype)?.contiguous()?;
    let cutoffs = cutoffs.to_dtype(DType::F32)?.contiguous()?;
    let name = format!("residual_compress_{}_{}", dtype_tag(x.0.dtype()), dtype_tag(cent_dtype));
    let func = load_func(dev, &name, 0, "residual", &RESIDUAL)?;
    let blocks = (n * w).div_ceil(256).min(device_info(dev)?.sm_count as usize * 16).max(1) as u32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (xp, cp, cep, cup, op) = (
        storage_ptr(x.0, x.1)?,
        storage_ptr(codes, &Layout::contiguous(1))?,
        tensor_ptr(&cents)?,
        tensor_ptr(&cutoffs)?,
        storage_ptr(&out, &Layout::contiguous(1))?,
    );
    let (n_cut, n64, d32, nb, order) =
        (cutoffs.elem_count() as i32, n as i64, dim as i32, codec.nbits as i32, codec.colbert_order as i32);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&xp);
    b.arg(&cp);
    b.arg(&cep);
    b.arg(&cup);
    b.arg(&n_cut);
    b.arg(&n64);
    b.arg(&d32);
    b.arg(&nb);
    b.arg(&order);
    b.arg(&op);
    // SAFETY: (const T*, const uint32_t*, const CT*, const float*, int, long long, int, int, int,
    // uint8_t*) as in residual.cu; x holds n rows of dim, codes n entries (each < C), out n·w bytes.
    unsafe { b.launch(cfg) }.w()?;
    drop((cents, cutoffs));
    Ok(out)
}
