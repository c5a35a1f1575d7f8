//! Launch of kernels/plaid.cu: PLAID's centroid-only approximate score.

use super::{device_info, launch, plaid_func, slice_ptr, storage_ptr};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result};

/// Mirror of `PlaidApproxParams` in kernels/plaid.cu (same field order, C layout).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Params {
    qcs: u64,
    qcs8: u64,
    codes: u64,
    doc_lens: u64,
    out: u64,
    err: u64,
    n_centroids: i64,
    b: i32,
    ld: i32,
    lq: i32,
    stride8: i32,
}
// SAFETY: plain old data with the layout of the C struct.
unsafe impl DeviceRepr for Params {}

/// Warps (documents) per block, `PLAID_WARPS` in kernels/plaid.cu.
const WARPS: u32 = 8;

/// Threads per block of the quantize kernel, `PLAID_PREP_THREADS`.
const PREP_THREADS: u32 = 256;

/// How the kernel reads the per-centroid scores (kernels/plaid.cu).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Strategy {
    /// Gather whole f32 rows per code.
    Gather,
    /// Quantize the table to a byte per score first (`lanes` 16-byte loads per
    /// row), take the max over bytes, and read the f32 scores of the tokens
    /// holding the max byte only.
    Filter { lanes: u32 },
}

impl Strategy {
    /// Filter on Hopper (its byte max is built on sm_90's 16-bit SIMD max;
    /// older GPUs would emulate it, not measured) when rows span more than one
    /// 32-byte sector in f32 (lq >= 16) and the batch gathers enough rows
    /// (b * ld >= 4 C) to repay reading the table twice to quantize it.
    /// `CANDLE_MAXSIM_PLAID_APPROX=gather|filter` pins one where it applies
    /// (benchmarks, tests).
    fn pick(cc: i32, n_c: usize, lq: usize, b: usize, ld: usize) -> Self {
        let lanes = lq.div_ceil(16).next_power_of_two() as u32;
        // The kernels index the table and the quantized table with 32-bit ints.
        let fits = lq <= 512 && n_c.saturating_mul(16 * lanes as usize) <= i32::MAX as usize;
        let filter = match std::env::var("CANDLE_MAXSIM_PLAID_APPROX").as_deref() {
            Ok("gather") => false,
            Ok("filter") => true,
            _ => lq >= 16 && b.saturating_mul(ld) >= 4 * n_c,
        };
        if filter && fits && n_c > 0 && cc == 90 {
            Strategy::Filter { lanes }
        } else {
            Strategy::Gather
        }
    }
}

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
    let mut params = Params {
        qcs: ptr_or_null(s1, l1)?,
        qcs8: 0,
        codes: ptr_or_null(s2, l2)?,
        doc_lens: storage_ptr(s3, l3)?,
        out: slice_ptr(&dev, &out),
        err: slice_ptr(&dev, &err),
        n_centroids: n_c as i64,
        b: b as i32,
        ld: ld as i32,
        lq: lq as i32,
        stride8: 0,
    };
    let blocks = b.div_ceil(WARPS as usize) as u32;
    match Strategy::pick(device_info(&dev)?.cc, n_c, lq, b, ld) {
        Strategy::Filter { lanes } => {
            // Workspace: the quantized table, every word written by the quantize kernel.
            params.stride8 = 16 * lanes as i32;
            let sm = device_info(&dev)?.sm_count.max(1) as usize;
            // SAFETY: as above.
            let qcs8 = unsafe { dev.alloc::<u32>(n_c * lanes as usize * 4) }?;
            params.qcs8 = slice_ptr(&dev, &qcs8);
            let words = n_c * lanes as usize * 4;
            // Two words per thread: enough loads in flight to stream the table from HBM,
            // while each block's range sample (4 loads per thread, from L2) stays a small share.
            let grid = words.div_ceil(PREP_THREADS as usize * 2).clamp(1, 16 * sm) as u32;
            launch(&dev, &plaid_func(&dev, "plaid_qcs_quantize")?, grid, PREP_THREADS, 0, &params)?;
            // 8 bytes of a row per lane, 16 when that would take more than a warp.
            let (g, w) = if lanes <= 16 { (2 * lanes, 2) } else { (32, 4 * lanes / 32) };
            let func = plaid_func(&dev, &format!("plaid_filter_{code}_g{g}_w{w}"))?;
            launch(&dev, &func, blocks, 32 * WARPS, WARPS * 4 * lq as u32, &params)?;
        }
        Strategy::Gather => {
            // 16-byte row loads need rows that start on 16-byte boundaries.
            let vec = if lq.is_multiple_of(4) && params.qcs.is_multiple_of(16) { 4 } else { 1 };
            let g = match lq / vec {
                0..=8 => 8,
                9..=16 => 16,
                _ => 32,
            };
            let func = plaid_func(&dev, &format!("plaid_approx_{code}_v{vec}_g{g}"))?;
            launch(&dev, &func, blocks, 32 * WARPS, 0, &params)?;
        }
    }
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
