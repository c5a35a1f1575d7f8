//! Launch of kernels/plaid_approx.cu: PLAID's centroid-only approximate score.

use super::launch::{blocks, grid_stride, kernel, kernel_params, launch, Module};
use super::memory::{slice_ptr, storage_ptr, tensor_ptr, HostFlag};
use candle_core::backend::BackendStorage;
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
kernel_params!(Params);

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
        let func = kernel(&dev, Module::PlaidApprox, &format!("plaid_rows_{code}_g{g}{part}"), 0)?;
        launch(&dev, &func, blocks(b.div_ceil(ROWS_WARPS as usize) as u32, 32 * ROWS_WARPS, 0), &params)?;
    } else {
        let vec = if lq.is_multiple_of(4) && aligned { 4 } else { 1 };
        let g = match lq / vec {
            0..=8 => 8,
            9..=16 => 16,
            _ => 32,
        };
        let func = kernel(&dev, Module::PlaidApprox, &format!("plaid_approx_{code}_v{vec}_g{g}"), 0)?;
        launch(&dev, &func, blocks(b.div_ceil(WARPS as usize) as u32, 32 * WARPS, 0), &params)?;
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

/// Mirror of `PlaidCandParams` in kernels/plaid_approx.cu (same field order, C layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct CandParams {
    probes: u64,
    ivf: u64,
    ivf_off: u64,
    qcs: u64,
    codes: u64,
    cu_d: u64,
    bitmap: u64,
    mask: u64,
    out: u64,
    bad: u64,
    n_centroids: i64,
    n_ivf: i64,
    n_codes: i64,
    nq: i32,
    n_probe: i32,
    nd: i32,
    words: i32,
    lq: i32,
    mask_rows: i32,
}
kernel_params!(CandParams);

/// The argument a candidate kernel's flag names (`PLAID_BAD_*` in kernels/plaid_approx.cu).
fn bad_argument(flag: u32) -> &'static str {
    match flag {
        1 => "probes: a centroid id is out of range",
        2 => "ivf_offsets: the offsets are not non-decreasing within the inverted file",
        3 => "ivf: a document id is out of range",
        4 => "codes: a code of a candidate (or listed) document is out of range",
        5 => "cu_d: the document offsets are not non-decreasing within the codes",
        7 => "docs: a document id is out of range",
        _ => "candidates: a candidate bit past the last document is set",
    }
}

/// `plaid_candidates` on CUDA: the candidate bitmap `[nq, words]` U32 of
/// `probes [nq, n_probe]` against the inverted file (`ivf [E]`,
/// `ivf_off [C + 1]`, all U32, contiguous), `nd` documents.
pub(crate) fn candidates(
    probes: (&CudaStorage, &Layout),
    ivf: (&CudaStorage, &Layout),
    ivf_off: (&CudaStorage, &Layout),
    nd: usize,
) -> Result<CudaStorage> {
    let dev = probes.0.device.clone();
    let (nq, n_probe) = probes.1.shape().dims2()?;
    let words = nd.div_ceil(32);
    let bitmap = CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<u32>((nq * words).max(1))?, dev.clone());
    if nq * n_probe == 0 || nd == 0 {
        return Ok(bitmap);
    }
    let bad = HostFlag::new(&dev)?;
    let p = CandParams {
        probes: storage_ptr(probes.0, probes.1)?,
        ivf: ptr_or_null(ivf.0, ivf.1)?,
        ivf_off: storage_ptr(ivf_off.0, ivf_off.1)?,
        bitmap: storage_ptr(&bitmap, &Layout::contiguous(1))?,
        bad: bad.dev_ptr(),
        n_centroids: ivf_off.1.shape().elem_count() as i64 - 1,
        n_ivf: ivf.1.shape().elem_count() as i64,
        nq: nq as i32,
        n_probe: n_probe as i32,
        nd: nd as i32,
        words: words as i32,
        ..Default::default()
    };
    // A warp per (query, probe), 8 per block.
    let func = kernel(&dev, Module::PlaidApprox, "plaid_candidates", 0)?;
    launch(&dev, &func, grid_stride(&dev, nq * n_probe, 8, 256, 16)?, &p)?;
    bad.check(&dev, |f| bad_argument(f).to_string())?;
    Ok(bitmap)
}

/// Mirror of `PlaidSubsetParams` in kernels/plaid_approx.cu (same field order, C layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct SubsetParams {
    docs: u64,
    cu_d: u64,
    codes: u64,
    mask: u64,
    bad: u64,
    n_centroids: i64,
    n_codes: i64,
    n_docs: i32,
    nd: i32,
}
kernel_params!(SubsetParams);

/// `plaid_subset_centroids` on CUDA: the `[n_centroids]` U8 mask of the
/// centroids the tokens of `docs [n]` use, from `codes [T]` and the
/// document offsets `cu_d [nd + 1]` (checked by the caller), all U32 and
/// contiguous.
pub(crate) fn subset_centroids(
    docs: (&CudaStorage, &Layout),
    codes: (&CudaStorage, &Layout),
    cu_d: &candle_core::Tensor,
    nd: usize,
    n_centroids: usize,
) -> Result<CudaStorage> {
    let dev = docs.0.device.clone();
    let n_docs = docs.1.shape().elem_count();
    let mask = CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<u8>(n_centroids.max(1))?, dev.clone());
    if n_docs == 0 {
        return Ok(mask);
    }
    let bad = HostFlag::new(&dev)?;
    let p = SubsetParams {
        docs: storage_ptr(docs.0, docs.1)?,
        cu_d: tensor_ptr(cu_d)?,
        codes: ptr_or_null(codes.0, codes.1)?,
        mask: storage_ptr(&mask, &Layout::contiguous(1))?,
        bad: bad.dev_ptr(),
        n_centroids: n_centroids as i64,
        n_codes: codes.1.shape().elem_count() as i64,
        n_docs: n_docs as i32,
        nd: nd as i32,
    };
    // A warp per listed document, 8 per block.
    let func = kernel(&dev, Module::PlaidApprox, "plaid_subset_centroids", 0)?;
    launch(&dev, &func, grid_stride(&dev, n_docs, 8, 256, 16)?, &p)?;
    bad.check(&dev, |f| bad_argument(f).to_string())?;
    Ok(mask)
}

/// The operands of `plaid_approx_candidates` on CUDA, all contiguous.
pub(crate) struct ApproxCandidates<'a> {
    pub qcs: (&'a CudaStorage, &'a Layout),
    pub lq: usize,
    pub codes: (&'a CudaStorage, &'a Layout),
    pub cu_d: (&'a CudaStorage, &'a Layout),
    pub candidates: (&'a CudaStorage, &'a Layout),
    pub mask: Option<(&'a CudaStorage, &'a Layout)>,
}

/// `plaid_approx_candidates` on CUDA: `[nq, nd]` F32, -inf where not a candidate.
pub(crate) fn approx_candidates(a: ApproxCandidates) -> Result<CudaStorage> {
    let dev = a.qcs.0.device.clone();
    let (n_c, m) = a.qcs.1.shape().dims2()?;
    let (nq, words) = a.candidates.1.shape().dims2()?;
    let nd = a.cu_d.1.shape().elem_count() - 1;
    // SAFETY: the kernel writes every score (each word's warp writes its 32 documents).
    let out = CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f32>((nq * nd).max(1)) }?, dev.clone());
    if nq * nd == 0 {
        return Ok(out);
    }
    let code = match a.codes.0.dtype() {
        DType::U32 => "u32",
        _ => "i64",
    };
    let g = (a.lq / 4).next_power_of_two().max(4);
    let part = if g * 4 == a.lq { "" } else { "_part" };
    let bad = HostFlag::new(&dev)?;
    let p = CandParams {
        qcs: storage_ptr(a.qcs.0, a.qcs.1)?,
        codes: ptr_or_null(a.codes.0, a.codes.1)?,
        cu_d: storage_ptr(a.cu_d.0, a.cu_d.1)?,
        bitmap: storage_ptr(a.candidates.0, a.candidates.1)?,
        mask: a.mask.map(|(s, l)| storage_ptr(s, l)).transpose()?.unwrap_or(0),
        out: storage_ptr(&out, &Layout::contiguous(1))?,
        bad: bad.dev_ptr(),
        n_centroids: n_c as i64,
        n_codes: a.codes.1.shape().elem_count() as i64,
        nq: nq as i32,
        nd: nd as i32,
        words: words as i32,
        lq: a.lq as i32,
        mask_rows: a.mask.map_or(0, |(_, l)| l.shape().dims()[0] as i32),
        ..Default::default()
    };
    debug_assert_eq!(m, nq * a.lq);
    // A warp per (query, bitmap word), 8 per block.
    let s = if a.qcs.0.dtype() == DType::F16 { "f16_" } else { "" };
    let func = kernel(&dev, Module::PlaidApprox, &format!("plaid_approx_candidates_{s}{code}_g{g}{part}"), 0)?;
    launch(&dev, &func, grid_stride(&dev, nq * words, 8, 256, 16)?, &p)?;
    bad.check(&dev, |f| bad_argument(f).to_string())?;
    Ok(out)
}
