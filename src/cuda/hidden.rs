//! Launch of kernels/hidden.cu: the fused projection head's forward
//! (hidden states → linear → normalize → MaxSim), Hopper only.

use super::device::device_info;
use super::launch::{blocks, kernel, kernel_params, launch, Module};
use super::memory::{aligned_ptr, alloc_out, storage_ptr, tensor_ptr};
use super::params::dtype_tag;
use super::tile_size::HIDDEN;
use candle_core::backend::BackendStorage;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Tensor};

/// Mirror of `HiddenParams` in kernels/hidden.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct HiddenParams {
    q: u64,
    h: u64,
    w: u64,
    bias: u64,
    d_valid: u64,
    out: u64,
    nq: i32,
    lq: i32,
    nd: i32,
    ld: i32,
    dmodel: i32,
    dout: i32,
    normalize: i32,
    q_chunk: i32,
}
kernel_params!(HiddenParams);

/// Dynamic shared memory of a block: stages, the projected chunk, bias,
/// running maxima of `q_chunk` query rows, 1024 B of alignment slack (and
/// BD spare bytes; the kernel traps if this does not cover its layout).
fn smem_bytes(dpad: usize, q_chunk: usize) -> usize {
    let (bd, bq, ks) = (HIDDEN.bd, HIDDEN.bq, HIDDEN.ks);
    let stage = ((bd + dpad) * ks).max(bq * dpad);
    1024 + (HIDDEN.stages * stage + bd * dpad) * 2 + dpad * 4 + q_chunk * 4 + bd
}

/// A contiguous copy of `t` whose data starts 16-byte aligned (cp.async).
fn aligned(t: &Tensor) -> Result<Tensor> {
    let t = t.contiguous()?;
    Ok(if tensor_ptr(&t)?.is_multiple_of(16) { t } else { t.copy()? })
}

/// The fused kernel's launch for one problem; [`FusedHeadPlan::new`] says
/// whether it applies.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedHeadPlan {
    dpad: usize,
    /// Query rows per block (whole queries).
    q_chunk: usize,
    /// Query chunks per document.
    chunks: usize,
    smem: usize,
}

impl FusedHeadPlan {
    /// The plan for `q [Nq, Lq, dout]` against `h [Nd, Ld, dmodel]` of
    /// `dtype` on `dev`, or `None` where the fused kernel does not apply: not
    /// compute capability 9.0, not F16/BF16, dout over 128 or not a multiple
    /// of 8, dmodel not a multiple of 8, empty or oversized shapes, or fewer
    /// projected document rows than query rows (materializing them then costs
    /// less than the queries themselves).
    pub(crate) fn new(
        dev: &CudaDevice,
        dtype: DType,
        (nq, lq, dout): (usize, usize, usize),
        (nd, ld, dmodel): (usize, usize, usize),
    ) -> Result<Option<Self>> {
        let info = device_info(dev)?;
        if info.cc != 90 || !matches!(dtype, DType::F16 | DType::BF16) {
            return Ok(None);
        }
        if dout == 0 || dout % 8 != 0 || dout > 128 || dmodel % 8 != 0 || dmodel == 0 || nq * lq * nd * ld == 0 {
            return Ok(None);
        }
        if nd * ld < nq * lq {
            return Ok(None);
        }
        // The kernel's row arithmetic is 32-bit, including a query chunk (under
        // 2^16 rows) or a document chunk past the last row.
        let limit = i32::MAX as usize - (1 << 16);
        if nd * ld > limit || nq * lq > limit || nd * nq > limit {
            return Ok(None);
        }
        let dpad = if dout <= 64 { 64 } else { 128 };
        // Whole queries per block, as many as the running maxima fit in shared
        // memory, spread evenly over the query chunks.
        let max_rows = info.smem_optin.saturating_sub(smem_bytes(dpad, 0)) / 4;
        let max_queries = max_rows / lq;
        if max_queries == 0 {
            return Ok(None);
        }
        // Fewer documents than SMs: split the queries over the idle SMs (each
        // query chunk projects its document again, cheap next to MaxSim), but
        // never into a second wave (one block per SM is resident).
        let spread = (info.sm_count as usize / nd).clamp(1, nq);
        let chunks = nq.div_ceil(max_queries).max(spread);
        let q_chunk = nq.div_ceil(chunks) * lq;
        let chunks = (nq * lq).div_ceil(q_chunk);
        Ok(Some(Self { dpad, q_chunk, chunks, smem: smem_bytes(dpad, q_chunk) }))
    }
}

/// Fused `[Nq·Nd]` F32 scores by the plan: `q` `[Nq, Lq, dout]` (contiguous),
/// `h` `[Nd, Ld, dmodel]`, `w` `[dout, dmodel]`, `b` `[dout]`, `d_mask`
/// `[Nd, Ld]`, validated by the caller.
pub(crate) fn from_hidden_fwd(
    plan: &FusedHeadPlan,
    q: (&CudaStorage, &Layout),
    h: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    d_mask: Option<&Tensor>,
    normalize: bool,
) -> Result<CudaStorage> {
    let dev = &q.0.device;
    let (nq, lq, dout) = q.1.shape().dims3()?;
    let (nd, ld, dmodel) = h.dims3()?;
    let (qp, _q_copy) = aligned_ptr(q, 16)?;
    let (h, w) = (aligned(h)?, aligned(w)?);
    let bias = b.map(|b| b.to_dtype(DType::F32)?.contiguous()).transpose()?;
    let valid = d_mask.map(|m| m.flatten_all()?.contiguous()).transpose()?;
    let out = alloc_out(dev, DType::F32, nq * nd)?;
    let params = HiddenParams {
        q: qp,
        h: tensor_ptr(&h)?,
        w: tensor_ptr(&w)?,
        bias: bias.as_ref().map(tensor_ptr).transpose()?.unwrap_or(0),
        d_valid: valid.as_ref().map(tensor_ptr).transpose()?.unwrap_or(0),
        out: storage_ptr(&out, &Layout::contiguous(nq * nd))?,
        nq: nq as i32,
        lq: lq as i32,
        nd: nd as i32,
        ld: ld as i32,
        dmodel: dmodel as i32,
        dout: dout as i32,
        normalize: normalize as i32,
        q_chunk: plan.q_chunk as i32,
    };
    let name = format!("maxsim_hidden_{}_d{}", dtype_tag(q.0.dtype()), plan.dpad);
    let func = kernel(dev, Module::Hidden, &name, plan.smem as u32)?;
    let cfg = blocks((nd * plan.chunks) as u32, HIDDEN.threads, plan.smem as u32);
    launch(dev, &func, cfg, &params)?;
    // The operands (and the temporary copies) are freed in stream order, after the launch.
    drop((h, w, bias, valid));
    Ok(out)
}
