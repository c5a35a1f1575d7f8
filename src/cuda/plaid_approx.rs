//! Launch of kernels/plaid_approx.cu: PLAID's centroid-only approximate score.

use super::{launch, plaid_approx_func, slice_ptr, storage_ptr, HostFlag};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
use candle_core::{bail, CudaStorage, DType, Layout, Result};

/// Mirror of `PlaidApproxParams` in kernels/plaid_approx.cu (same field order, C layout).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Params {
    qcs: u64,
    codes: u64,
    doc_lens: u64,
    out: u64,
    bad: u64,
    n_centroids: i64,
    b: i32,
    ld: i32,
    lq: i32,
}
// SAFETY: plain old data with the layout of the C struct.
unsafe impl DeviceRepr for Params {}

/// Warps (documents) per block: `PLAID_WARPS` / `PLAID_ROWS_WARPS` in kernels/plaid_approx.cu.
const WARPS: u32 = 8;
const ROWS_WARPS: u32 = 4;

/// Device address of a contiguous operand, or 0 for an empty one (never read;
/// zero-size views need not have a buffer).
fn ptr_or_null(s: &CudaStorage, l: &Layout) -> Result<u64> {
    if l.shape().elem_count() == 0 {
        Ok(0)
    } else {
        storage_ptr(s, l)
    }
}

/// `plaid_approx_score` on CUDA: `qcs [C, Lq]` F32, `codes [B, Ld]` U32|I64,
/// `doc_lens [B]` U32, all contiguous (checked by the caller) → `[B]` F32.
/// Invalid lengths and codes set a host-mapped flag; only then are the inputs
/// copied back to find the first one.
pub(crate) fn plaid_approx(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
) -> Result<(CudaStorage, bool)> {
    let dev = s1.device.clone();
    let (n_c, lq) = l1.shape().dims2()?;
    let (b, ld) = l2.shape().dims2()?;
    let code = match s2.dtype() {
        DType::U32 => "u32",
        DType::I64 => "i64",
        dt => bail!("codes: expected U32 or I64 centroid codes, got {dt:?}"),
    };
    if b > i32::MAX as usize || ld > i32::MAX as usize || lq > i32::MAX as usize {
        bail!("codes: shape [{b}, {ld}] with Lq = {lq} exceeds the kernel's 32-bit sizes; split the batch")
    }
    if n_c >= u32::MAX as usize {
        bail!("query_centroid_scores: {n_c} centroids exceed the kernel's 32-bit codes")
    }
    if b == 0 {
        // CUDA allocations of 0 bytes fail: an empty output gets one spare element.
        return Ok((CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>(1)?, dev), false));
    }
    // SAFETY: the kernel writes every score (a warp per document, empty ones included).
    let out = unsafe { dev.alloc::<f32>(b) }?;
    let bad = HostFlag::new(&dev)?;
    let qcs = ptr_or_null(s1, l1)?;
    let params = Params {
        qcs,
        codes: ptr_or_null(s2, l2)?,
        doc_lens: storage_ptr(s3, l3)?,
        out: slice_ptr(&dev, &out),
        bad: bad.dev_ptr(),
        n_centroids: n_c as i64,
        b: b as i32,
        ld: ld as i32,
        lq: lq as i32,
    };
    // 16-byte row loads need rows that start on 16-byte boundaries.
    let aligned = qcs.is_multiple_of(16);
    // The row kernel reads row 0 in place of a bad code, so it needs one (C > 0).
    if aligned && n_c > 0 && lq.is_multiple_of(4) && (4..=64).contains(&lq) {
        let g = (lq / 4).next_power_of_two().max(4);
        let part = if g * 4 == lq { "" } else { "_part" };
        let func = plaid_approx_func(&dev, &format!("plaid_rows_{code}_g{g}{part}"))?;
        launch(&dev, &func, b.div_ceil(ROWS_WARPS as usize) as u32, 32 * ROWS_WARPS, 0, &params)?;
    } else {
        let vec = if lq.is_multiple_of(4) && aligned { 4 } else { 1 };
        let g = match lq / vec {
            0..=8 => 8,
            9..=16 => 16,
            _ => 32,
        };
        let func = plaid_approx_func(&dev, &format!("plaid_approx_{code}_v{vec}_g{g}"))?;
        launch(&dev, &func, b.div_ceil(WARPS as usize) as u32, 32 * WARPS, 0, &params)?;
    }
    // The one host sync: the caller looks for the first bad input only when the kernel flagged one.
    let bad = bad.is_set(&dev)?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), bad))
}

/// Host copies of `doc_lens [B]` and `codes [B, Ld]` (as I64), for the op's error report.
pub(crate) fn host_inputs(
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
) -> Result<(Vec<u32>, Vec<i64>)> {
    let dev = &s2.device;
    let (b, ld) = l2.shape().dims2()?;
    let lens = dev.clone_dtoh(&s3.as_cuda_slice::<u32>()?.slice(l3.start_offset()..l3.start_offset() + b))?;
    let (o, n) = (l2.start_offset(), b * ld);
    let codes: Vec<i64> = match s2.dtype() {
        DType::U32 => dev.clone_dtoh(&s2.as_cuda_slice::<u32>()?.slice(o..o + n))?.into_iter().map(i64::from).collect(),
        _ => dev.clone_dtoh(&s2.as_cuda_slice::<i64>()?.slice(o..o + n))?,
    };
    Ok((lens, codes))
}
