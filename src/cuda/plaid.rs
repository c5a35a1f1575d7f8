//! Launch of kernels/plaid.cu: PLAID's centroid-only approximate score.

use super::{launch, plaid_func, slice_ptr, storage_ptr};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result};

/// Mirror of `PlaidApproxParams` in kernels/plaid.cu (same field order, C layout).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Params {
    qcs: u64,
    codes: u64,
    doc_lens: u64,
    out: u64,
    err: u64,
    n_centroids: i64,
    b: i32,
    ld: i32,
    lq: i32,
}
// SAFETY: plain old data with the layout of the C struct.
unsafe impl DeviceRepr for Params {}

/// Warps (documents) per block, `PLAID_WARPS` in kernels/plaid.cu.
const WARPS: u32 = 8;

/// Device address of a contiguous operand, or 0 for an empty one (never read;
/// zero-size views need not have a buffer).
fn ptr_or_null(s: &CudaStorage, l: &Layout) -> Result<u64> {
    if l.shape().elem_count() == 0 {
        Ok(0)
    } else {
        storage_ptr(s, l)
    }
}

/// Element `k` (counted from the layout's start) of a U32 or I64 operand, for error messages.
fn read_int(dev: &CudaDevice, s: &CudaStorage, l: &Layout, k: usize) -> Result<i64> {
    let k = l.start_offset() + k;
    Ok(match s.dtype() {
        DType::U32 => dev.clone_dtoh(&s.as_cuda_slice::<u32>()?.slice(k..k + 1))?[0] as i64,
        _ => dev.clone_dtoh(&s.as_cuda_slice::<i64>()?.slice(k..k + 1))?[0],
    })
}

/// `plaid_approx_score` on CUDA: `qcs [C, Lq]` F32, `codes [B, Ld]` U32|I64,
/// `doc_lens [B]` U32, all contiguous (checked by the caller) → `[B]` F32.
/// Invalid lengths and codes are found on the device and read back once (8 bytes each).
pub(crate) fn plaid_approx(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
) -> Result<CudaStorage> {
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
        return Ok(CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>(1)?, dev));
    }
    // SAFETY: the kernel writes every score (a warp per document, empty ones included).
    let out = unsafe { dev.alloc::<f32>(b) }?;
    let err = dev.alloc_zeros::<u64>(2)?;
    let qcs = ptr_or_null(s1, l1)?;
    // 16-byte row loads need rows that start on 16-byte boundaries.
    let vec = if lq.is_multiple_of(4) && qcs.is_multiple_of(16) { 4 } else { 1 };
    let g = match lq / vec {
        0..=8 => 8,
        9..=16 => 16,
        _ => 32,
    };
    let params = Params {
        qcs,
        codes: ptr_or_null(s2, l2)?,
        doc_lens: storage_ptr(s3, l3)?,
        out: slice_ptr(&dev, &out),
        err: slice_ptr(&dev, &err),
        n_centroids: n_c as i64,
        b: b as i32,
        ld: ld as i32,
        lq: lq as i32,
    };
    let func = plaid_func(&dev, &format!("plaid_approx_{code}_v{vec}_g{g}"))?;
    launch(&dev, &func, b.div_ceil(WARPS as usize) as u32, 32 * WARPS, 0, &params)?;
    // The one host sync: the lowest bad document and the lowest bad code, as the CPU op reports them.
    let flags = dev.clone_dtoh(&err)?;
    let (bad_len, bad_code) = (!flags[0] as usize, !flags[1] as usize);
    if flags[0] != 0 && (flags[1] == 0 || bad_len <= bad_code / ld.max(1)) {
        let len = read_int(&dev, s3, l3, bad_len)?;
        bail!("doc_lens: doc_lens[{bad_len}] = {len} exceeds Ld = {ld}")
    }
    if flags[1] != 0 {
        let c = read_int(&dev, s2, l2, bad_code)?;
        bail!("codes: codes[{}, {}] = {c} is out of range for {n_c} centroids", bad_code / ld, bad_code % ld)
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
