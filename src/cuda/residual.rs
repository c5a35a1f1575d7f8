//! PLAID residual documents on CUDA (kernels/residual.cu and the residual
//! tiles of kernels/maxsim_fwd.cu): the path decision and the fused scoring
//! (tokens decompressed straight into tensor-core fragments for queries of
//! up to 32 rows, inside the MaxSim tile loader otherwise; never written to
//! device memory), the code check the tile and decompression kernels rely
//! on, the standalone decompression (dense tokens for the gradient path) and
//! compression. Each entry point returns `None` where no kernel covers the
//! dtype / dim / nbits on this device: the caller then works on the host.

use super::device::{device_info, DeviceInfo};
use super::launch::{blocks, grid_stride, kernel, kernel_params, launch, Module};
use super::maxsim_fwd::{fwd_launch, Variant};
use super::memory::{aligned_ptr, alloc_out, storage_ptr, tensor_ptr, HostFlag};
use super::params::{dtype_tag, Params};
use super::tile_size::{decompress_supported, residual_supported};
use crate::layout::{Pairing, Problem, Seqs};
use candle_core::backend::BackendStorage;
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

/// Mirror of `CodesParams` in kernels/residual.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct CodesParams {
    codes: u64,
    valid: u64,
    out: u64,
    bad: u64,
    n: i64,
    n_centroids: i64,
    codes_i64: i32,
}

/// Mirror of `CompressParams` in kernels/residual.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct CompressParams {
    x: u64,
    codes: u64,
    cents: u64,
    cutoffs: u64,
    out: u64,
    n: i64,
    n_cut: i32,
    dim: i32,
    nbits: i32,
    colbert: i32,
}

/// Mirror of `DecompressParams` in kernels/residual.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct DecompressParams {
    f: Params,
    out: u64,
    n: i32,
}
kernel_params!(ResScoreParams, CodesParams, CompressParams, DecompressParams);

/// How the compressed documents' tokens are laid out for the warp kernel.
enum WarpDocs<'a> {
    /// Packed: the problem's `cu_d` offsets.
    Packed,
    /// Padded `[Nd, Ld]`: document j is rows `j·Ld ..`, `lens[j]` of them (U32, validated).
    Padded(&'a Tensor),
}

/// How residual scoring runs on a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ResidualPath {
    /// kernels/residual.cu: a warp per (query, document), tokens decoded
    /// straight into MMA fragments (short unmasked queries, dims 64 / 96 / 128).
    Warp,
    /// The MaxSim tile kernels with the residual loader.
    Tile,
}

/// The path of a residual scoring problem (no gradient: training scores
/// decompressed documents with the dense op), `None` where no kernel covers
/// it: the one place where each condition is written. `q_dtype`: the
/// queries' dtype; `codes_dtype`, `n_codes`, `n_centroids`: of the
/// compressed documents.
fn residual_path(
    info: &DeviceInfo,
    pb: &Problem,
    q_dtype: DType,
    nbits: usize,
    (codes_dtype, n_codes, n_centroids): (DType, usize, usize),
) -> Option<ResidualPath> {
    if !residual_supported(info, q_dtype, pb.dim, nbits) {
        return None;
    }
    let warp = match (&pb.q, &pb.pairs) {
        (Seqs::Uniform { n: nq, len: lq }, Pairing::Cross { nd, .. }) => {
            pb.q_valid.is_none()
                && nq * nd < i32::MAX as usize
                && warp_applies(pb.dim, *lq, codes_dtype, n_codes, n_centroids)
        }
        _ => false,
    };
    Some(if warp { ResidualPath::Warp } else { ResidualPath::Tile })
}

/// Whether kernels/residual.cu scores queries of `lq` rows (no mask) at `dim`
/// against `n_codes` tokens of `codes_dtype` codes, where
/// [`residual_supported`] holds (compute capability 8.0+, F16/BF16 queries).
fn warp_applies(dim: usize, lq: usize, codes_dtype: DType, n_codes: usize, n_centroids: usize) -> bool {
    !crate::knobs::knobs().residual_tile
        && matches!(codes_dtype, DType::U32 | DType::I64)
        && matches!(dim, 64 | 96 | 128)
        && (1..=32).contains(&lq)
        && n_codes < i32::MAX as usize
        // No centroids: every code is out of range, which the tile path reports.
        && n_centroids > 0
}

/// Which (query, document) pairs the warp kernel scores.
enum WarpTasks<'a> {
    /// Every query against every document: `[Nq·Nd]` scores.
    Cross,
    /// `[P]` U32 query and document indices on the device (document
    /// `u32::MAX`: no document, -inf); `[P]` scores. Checked by the kernel.
    Pairs(&'a Tensor, &'a Tensor),
}

/// A contiguous operand: its storage and layout.
type Operand<'a> = (&'a CudaStorage, &'a Layout);

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
fn codes_u32(codes: Operand, valid: Option<&Tensor>, n_centroids: usize) -> Result<CudaStorage> {
    let (cs, cl) = codes;
    let dev = &cs.device;
    let n = cl.shape().elem_count();
    let out = alloc_out_u32(dev, n)?;
    if n == 0 {
        return Ok(out);
    }
    let valid = valid.map(|v| v.flatten_all()?.contiguous()).transpose()?;
    let bad = HostFlag::new(dev)?;
    let p = CodesParams {
        codes: storage_ptr(cs, cl)?,
        valid: valid.as_ref().map(tensor_ptr).transpose()?.unwrap_or(0),
        out: storage_ptr(&out, &Layout::contiguous(n))?,
        bad: bad.dev_ptr(),
        n: n as i64,
        n_centroids: n_centroids as i64,
        codes_i64: (cs.dtype() == DType::I64) as i32,
    };
    let func = kernel(dev, Module::Residual, "residual_codes_u32", 0)?;
    launch(dev, &func, grid_stride(dev, n, 256, 256, 8)?, &p)?;
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
fn residual_scores_warp(
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
    let func = kernel(dev, Module::Residual, &name, 0)?;
    // A persistent grid: warps take (query, document) tasks from a counter.
    let per_sm = func.occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None).w()?.max(1) as usize;
    let n_blocks = (device_info(dev)?.sm_count as usize * per_sm).min(n_out.div_ceil(THREADS as usize / 32));
    launch(dev, &func, blocks(n_blocks.max(1) as u32, THREADS, 0), &params)?;
    bad.check(dev, move |f| match f {
        1 => format!("codes: a code of a scored token is out of range for {n_c} centroids"),
        _ => format!("pair_q: a pair's query or document index is out of range ({nq} queries, {nd} documents)"),
    })?;
    // Freed in stream order, after the kernel.
    drop((cents, buckets, cu, lens, work, pairs));
    Ok(out)
}

/// Fused residual scores `[n_pairs]` F32 of packed queries `q [Tq, dim]`
/// (contiguous, normalized by the caller if asked) against the compressed
/// documents laid out by `pb.d` (cross pairing): `codes [T]` U32 or I64,
/// `residuals [T, dim·nbits/8]`, and for the padded layout the `[Nd]` U32
/// document `lens` (validated; `pb.d_valid` marks the same slots). The warp
/// kernel for short unmasked queries, the tile kernels otherwise; `None`
/// where no kernel covers the dtype / dim / nbits on this device.
pub(crate) fn residual_scores(
    pb: &Problem,
    q: Operand,
    codes: Operand,
    residuals: Operand,
    codec: &CodecDev,
    lens: Option<&Tensor>,
) -> Result<Option<CudaStorage>> {
    let info = device_info(&q.0.device)?;
    let n_c = codec.centroids.dim(0)?;
    let docs = (codes.0.dtype(), codes.1.shape().elem_count(), n_c);
    Ok(match residual_path(&info, pb, q.0.dtype(), codec.nbits, docs) {
        None => None,
        Some(ResidualPath::Warp) => {
            let docs = lens.map_or(WarpDocs::Packed, WarpDocs::Padded);
            Some(residual_scores_warp(pb, q, codes, residuals, codec, docs, WarpTasks::Cross)?)
        }
        Some(ResidualPath::Tile) => {
            let codes = codes_u32(codes, pb.d_valid.as_ref(), n_c)?;
            Some(residual_scores_tile(pb, q, &codes, residuals, codec)?)
        }
    })
}

/// Fused residual scores `[P]` F32 of (query, document) pairs, `pair_q` /
/// `pair_d` `[P]` U32 on the device (document `u32::MAX`: no document,
/// -inf), read and checked by the warp kernel itself: `pb` as for
/// [`residual_scores`] with uniform queries and packed documents. `None`
/// where the warp kernel does not cover the queries.
#[allow(clippy::too_many_arguments)]
pub(crate) fn residual_pairs(
    pb: &Problem,
    q: Operand,
    codes: Operand,
    residuals: Operand,
    codec: &CodecDev,
    pair_q: &Tensor,
    pair_d: &Tensor,
) -> Result<Option<CudaStorage>> {
    let info = device_info(&q.0.device)?;
    let Seqs::Uniform { len: lq, .. } = pb.q else { return Ok(None) };
    let (t, n_c) = (codes.1.shape().elem_count(), codec.centroids.dim(0)?);
    if !residual_supported(&info, q.0.dtype(), pb.dim, codec.nbits)
        || !warp_applies(pb.dim, lq, codes.0.dtype(), t, n_c)
    {
        return Ok(None);
    }
    let tasks = WarpTasks::Pairs(pair_q, pair_d);
    Ok(Some(residual_scores_warp(pb, q, codes, residuals, codec, WarpDocs::Packed, tasks)?))
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
fn residual_scores_tile(
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

/// Dense `[n, dim]` tokens in `dtype` of `codes [n]` (U32 or I64; a token
/// whose `valid` byte is 0 is a zero row) and their residuals, normalized if
/// `codec.normalize`; `None` where no kernel covers this dtype / dim / nbits.
pub(crate) fn decompress_residual(
    codes: Operand,
    valid: Option<&Tensor>,
    residuals: Operand,
    codec: &CodecDev,
    dtype: DType,
    (n, dim): (usize, usize),
) -> Result<Option<CudaStorage>> {
    let dev = &codes.0.device;
    if !decompress_supported(&device_info(dev)?, dtype, dim, codec.nbits) {
        return Ok(None);
    }
    let codes = codes_u32(codes, valid, codec.centroids.dim(0)?)?;
    let out = alloc_out(dev, dtype, n * dim)?;
    if n == 0 {
        return Ok(Some(out));
    }
    let ops = codec.operands(dtype)?;
    let (rp, _r_copy) = aligned_ptr(residuals, 8)?;
    let p = DecompressParams {
        f: codec_params(dim, &codes, rp, codec, &ops)?,
        out: storage_ptr(&out, &Layout::contiguous(n * dim))?,
        n: n as i32,
    };
    let func = kernel(dev, Module::Residual, &format!("residual_decompress_{}", dtype_tag(dtype)), 0)?;
    // Each row spread over the lanes of its 8-feature chunks; 8 warps per block.
    let rows_per_warp = 32 / (dim / 8).next_power_of_two().min(32);
    launch(dev, &func, grid_stride(dev, n.div_ceil(rows_per_warp), 8, 256, 16)?, &p)?;
    drop(ops);
    Ok(Some(out))
}

/// Packed residual bytes `[n, dim·nbits/8]` of tokens `x [n, dim]`
/// (contiguous F16/BF16/F32) with centroid `codes [n]` (U32 or I64, checked)
/// and `cutoffs [2^nbits − 1]` F32, by kernels/residual.cu.
pub(crate) fn compress_residual(x: Operand, codes: Operand, codec: &CodecDev, cutoffs: &Tensor) -> Result<CudaStorage> {
    let dev = &x.0.device;
    let codes = &codes_u32(codes, None, codec.centroids.dim(0)?)?;
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
    let p = CompressParams {
        x: storage_ptr(x.0, x.1)?,
        codes: storage_ptr(codes, &Layout::contiguous(1))?,
        cents: tensor_ptr(&cents)?,
        cutoffs: tensor_ptr(&cutoffs)?,
        out: storage_ptr(&out, &Layout::contiguous(1))?,
        n: n as i64,
        n_cut: cutoffs.elem_count() as i32,
        dim: dim as i32,
        nbits: codec.nbits as i32,
        colbert: codec.colbert_order as i32,
    };
    // A thread per output byte.
    let func = kernel(dev, Module::Residual, &name, 0)?;
    launch(dev, &func, grid_stride(dev, n * w, 256, 256, 16)?, &p)?;
    drop((cents, cutoffs));
    Ok(out)
}
