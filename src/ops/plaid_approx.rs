//! PLAID's centroid-only approximate score (the candidate filter of a PLAID
//! search): the CustomOp, its CPU implementation and its input checks.

use crate::layout::{check_device, check_rank};
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

/// PLAID's centroid-only approximate score: `score[b] = Σ_s max_{t < len_b}
/// qcs[codes[b, t], s]` from per-centroid query scores `qcs [C, Lq]` F32,
/// `codes [B, Ld]`, `doc_lens [B]` U32 → `[B]` F32 (empty document → 0).
pub fn plaid_approx_score(query_centroid_scores: &Tensor, codes: &Tensor, doc_lens: &Tensor) -> Result<Tensor> {
    let qcs = query_centroid_scores;
    if qcs.dtype() != DType::F32 || qcs.rank() != 2 {
        bail!("query_centroid_scores: expected F32 [C, Lq], got {:?} {:?}", qcs.dtype(), qcs.dims())
    }
    check_rank("codes", codes, &[2], "rank 2 [B, Ld]")?;
    let (b, _) = codes.dims2()?;
    if doc_lens.dtype() != DType::U32 || doc_lens.dims() != [b] {
        bail!("doc_lens: expected U32 [{b}], got {:?} {:?}", doc_lens.dtype(), doc_lens.dims())
    }
    if !matches!(codes.dtype(), DType::U32 | DType::I64) {
        bail!("codes: expected U32 or I64 centroid codes, got {:?}", codes.dtype())
    }
    check_device("codes", codes, qcs.device())?;
    check_device("doc_lens", doc_lens, qcs.device())?;
    if qcs.device().is_cpu() || qcs.device().is_cuda() {
        return qcs.contiguous()?.apply_op3_no_bwd(&codes.contiguous()?, &doc_lens.contiguous()?, &PlaidApprox);
    }
    // Other devices (Metal): the CPU op on host copies.
    let cpu = candle_core::Device::Cpu;
    let out =
        qcs.to_device(&cpu)?.apply_op3_no_bwd(&codes.to_device(&cpu)?, &doc_lens.to_device(&cpu)?, &PlaidApprox)?;
    out.to_device(qcs.device())
}

struct PlaidApprox;

/// `plaid_approx_score`'s checks of one document, in the order the CPU op meets
/// them: its length, then its first `len` codes.
fn plaid_doc_check(bi: usize, len: usize, ld: usize, n_c: usize, code: impl Fn(usize) -> i64) -> Result<()> {
    if len > ld {
        bail!("doc_lens: doc_lens[{bi}] = {len} exceeds Ld = {ld}")
    }
    for t in 0..len {
        let c = code(t);
        if c < 0 || c as usize >= n_c {
            bail!("codes: codes[{bi}, {t}] = {c} is out of range for {n_c} centroids")
        }
    }
    Ok(())
}

/// The CUDA op's error path: the first invalid length or code in document
/// order (host copies of `doc_lens [B]` and `codes [B, ld]`), reported as the CPU op does.
#[cfg(feature = "cuda")]
pub(crate) fn plaid_first_error(lens: &[u32], codes: &[i64], ld: usize, n_c: usize) -> Result<()> {
    for (bi, &len) in lens.iter().enumerate() {
        plaid_doc_check(bi, len as usize, ld, n_c, |t| codes[bi * ld + t])?;
    }
    Ok(())
}

impl CustomOp3 for PlaidApprox {
    fn name(&self) -> &'static str {
        "plaid_approx_score"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n_c, lq) = l1.shape().dims2()?;
        let (b, ld) = l2.shape().dims2()?;
        let (CpuStorage::F32(qcs), CpuStorage::U32(lens)) = (s1, s3) else {
            bail!("plaid_approx_score: internal error, unexpected storage")
        };
        let qcs = &qcs[l1.start_offset()..];
        let lens = &lens[l3.start_offset()..];
        let code = |bi: usize, t: usize| -> i64 {
            let k = l2.start_offset() + bi * ld + t;
            match s2 {
                CpuStorage::U32(v) => v[k] as i64,
                CpuStorage::I64(v) => v[k],
                _ => -1,
            }
        };
        if !matches!(s2, CpuStorage::U32(_) | CpuStorage::I64(_)) {
            bail!("codes: expected U32 or I64")
        }
        let mut out = vec![0f32; b];
        let mut best = vec![f32::NEG_INFINITY; lq];
        for (bi, o) in out.iter_mut().enumerate() {
            let len = lens[bi] as usize;
            plaid_doc_check(bi, len, ld, n_c, |t| code(bi, t))?;
            if len == 0 {
                continue;
            }
            best.fill(f32::NEG_INFINITY);
            for t in 0..len {
                let row = &qcs[code(bi, t) as usize * lq..][..lq];
                for (m, &v) in best.iter_mut().zip(row) {
                    *m = m.max(v);
                }
            }
            *o = best.iter().sum();
        }
        Ok((CpuStorage::F32(out), Shape::from(b)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::plaid_approx as dev;
        let (out, bad) = dev::plaid_approx(s1, l1, s2, l2, s3, l3)?;
        if bad {
            // The kernel flagged a bad length or code: report the first one as the CPU op does.
            let (lens, codes) = dev::host_inputs(s2, l2, s3, l3)?;
            plaid_first_error(&lens, &codes, l2.shape().dims()[1], l1.shape().dims()[0])?;
            bail!("plaid_approx_score: internal error, the kernel flagged input the host finds valid")
        }
        Ok((out, Shape::from(l2.shape().dims()[0])))
    }
}
