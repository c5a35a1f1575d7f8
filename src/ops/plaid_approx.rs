//! PLAID's centroid-only approximate score (the candidate filter of a PLAID
//! search): the CustomOp, its CPU implementation and its input checks.

use super::residual::DocOffsets;
use crate::cpu::storage::slice;
use crate::layout::{check_device, check_rank, Seqs};
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

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

/// A probe of [`plaid_candidates`] that probes nothing (a padding token's).
pub const NO_CENTROID: u32 = u32::MAX;

/// `f()` with the input checks of the CUDA ops of a PLAID search
/// ([`plaid_candidates`], [`plaid_approx_candidates`],
/// [`plaid_subset_centroids`],
/// [`maxsim_residual_pairs`](crate::residual::maxsim_residual_pairs)) made
/// once, when `f` returns, instead of after each op: each check waits for
/// the device, so a pipeline of these ops otherwise stalls the host once per
/// op. Errors are the same, the first in launch order (`f`'s own first);
/// the kernels clamp or skip what they flag, so nothing is read out of
/// bounds meanwhile. On the CPU, `f()`.
pub fn deferred_checks<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    #[cfg(feature = "cuda")]
    return crate::cuda::deferred_checks(f);
    #[cfg(not(feature = "cuda"))]
    f()
}

/// The candidates of a PLAID search: for each query, the documents of the
/// inverted lists of its probed centroids. `probes [Nq, P]` U32 (the probed
/// centroids of all of a query's tokens; repeats allowed, [`NO_CENTROID`]
/// skipped), the inverted file
/// `ivf [E]` U32 (document ids, each centroid's list back to back) with
/// `ivf_offsets [C + 1]` U32 (list `c` is `ivf[ivf_offsets[c]..ivf_offsets[c + 1]]`),
/// over `num_documents` documents → a bitmap `[Nq, ⌈num_documents / 32⌉]` U32
/// (document `j` of query `i`: bit `j % 32` of word `[i, j / 32]`).
pub fn plaid_candidates(probes: &Tensor, ivf: &Tensor, ivf_offsets: &Tensor, num_documents: usize) -> Result<Tensor> {
    for (arg, t, r) in [("probes", probes, 2), ("ivf", ivf, 1), ("ivf_offsets", ivf_offsets, 1)] {
        if t.dtype() != DType::U32 || t.rank() != r {
            bail!("{arg}: expected a rank-{r} U32 tensor, got {:?} {:?}", t.dtype(), t.dims())
        }
        check_device(arg, t, probes.device())?;
    }
    if ivf_offsets.dim(0)? == 0 {
        bail!("ivf_offsets: expected [C + 1] offsets, got an empty tensor")
    }
    if num_documents > u32::MAX as usize / 2 {
        bail!("num_documents: {num_documents} exceeds the 32-bit document ids")
    }
    let op = Candidates { num_documents };
    probes.contiguous()?.apply_op3_no_bwd(&ivf.contiguous()?, &ivf_offsets.contiguous()?, &op)
}

struct Candidates {
    num_documents: usize,
}

impl CustomOp3 for Candidates {
    fn name(&self) -> &'static str {
        "plaid_candidates"
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
        let (nq, n_probe) = l1.shape().dims2()?;
        let (probes, ivf, off) =
            (slice::<u32>("probes", s1, l1)?, slice::<u32>("ivf", s2, l2)?, slice::<u32>("ivf_offsets", s3, l3)?);
        let (nd, n_c, words) = (self.num_documents, off.len() - 1, self.num_documents.div_ceil(32));
        let mut bitmap = vec![0u32; nq * words];
        for (i, row) in bitmap.chunks_mut(words.max(1)).enumerate().take(nq) {
            for (p, &c) in probes[i * n_probe..(i + 1) * n_probe].iter().enumerate() {
                if c == NO_CENTROID {
                    continue;
                }
                if c as usize >= n_c {
                    bail!("probes: probes[{i}, {p}] = {c} is out of range for {n_c} centroids")
                }
                let (lo, hi) = (off[c as usize] as usize, off[c as usize + 1] as usize);
                if lo > hi || hi > ivf.len() {
                    bail!("ivf_offsets: list {c} spans {lo}..{hi}, outside the {} entries of ivf", ivf.len())
                }
                for (e, &d) in ivf[lo..hi].iter().enumerate() {
                    if d as usize >= nd {
                        bail!("ivf: ivf[{}] = {d} is out of range for {nd} documents", lo + e)
                    }
                    row[d as usize / 32] |= 1 << (d % 32);
                }
            }
        }
        Ok((CpuStorage::U32(bitmap), Shape::from((nq, words))))
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
        let nq = l1.shape().dims2()?.0;
        let out = crate::cuda::plaid_approx::candidates((s1, l1), (s2, l2), (s3, l3), self.num_documents)?;
        Ok((out, Shape::from((nq, self.num_documents.div_ceil(32)))))
    }
}

/// The centroids the tokens of documents `docs` use, for a search filtered
/// to those documents to probe only them (fast-plaid's subset rule):
/// `codes [T]` U32 (the index's centroid codes), `cu_d` its document
/// offsets (checked for `T` rows), `docs [n]` U32 document ids (any order,
/// repeats allowed) → `[num_centroids]` U8, 1 where some token of a listed
/// document has that code. Computed where the codes are: the subset's
/// tokens never travel to the host.
pub fn plaid_subset_centroids(
    codes: &Tensor,
    cu_d: &DocOffsets,
    docs: &Tensor,
    num_centroids: usize,
) -> Result<Tensor> {
    for (arg, t) in [("codes", codes), ("docs", docs)] {
        if t.dtype() != DType::U32 || t.rank() != 1 {
            bail!("{arg}: expected a rank-1 U32 tensor, got {:?} {:?}", t.dtype(), t.dims())
        }
        check_device(arg, t, codes.device())?;
    }
    let d = cu_d.seqs().clone();
    let Seqs::Packed { cu_dev, .. } = &d else { bail!("cu_d: internal error, not packed offsets") };
    let cu_dev = cu_dev.clone();
    check_device("cu_d", &cu_dev, codes.device())?;
    if d.rows() != codes.dim(0)? {
        bail!("cu_d: the offsets end at {} rows, but codes has {}", d.rows(), codes.dim(0)?)
    }
    if d.n() > i32::MAX as usize {
        bail!("cu_d: {} documents exceed the 32-bit document ids", d.n())
    }
    if docs.dim(0)? > i32::MAX as usize {
        bail!("docs: {} ids exceed one launch", docs.dim(0)?)
    }
    if num_centroids > u32::MAX as usize {
        bail!("num_centroids: {num_centroids} exceeds the 32-bit codes")
    }
    let op = SubsetCentroids { d, cu_dev, num_centroids };
    docs.contiguous()?.apply_op2_no_bwd(&codes.contiguous()?, &op)
}

struct SubsetCentroids {
    d: Seqs,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    cu_dev: Tensor,
    num_centroids: usize,
}

impl CustomOp2 for SubsetCentroids {
    fn name(&self) -> &'static str {
        "plaid_subset_centroids"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (docs, codes) = (slice::<u32>("docs", s1, l1)?, slice::<u32>("codes", s2, l2)?);
        let (nd, n_c) = (self.d.n(), self.num_centroids);
        let mut mask = vec![0u8; n_c];
        for (i, &d) in docs.iter().enumerate() {
            if d as usize >= nd {
                bail!("docs: docs[{i}] = {d} is out of range for {nd} documents")
            }
            let (a, b) = (self.d.start(d as usize), self.d.end(d as usize));
            for (t, &c) in codes[a..b].iter().enumerate() {
                if c as usize >= n_c {
                    bail!("codes: codes[{}] = {c} is out of range for {n_c} centroids", a + t)
                }
                mask[c as usize] = 1;
            }
        }
        Ok((CpuStorage::U8(mask), Shape::from(n_c)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (cu, nd, n_c) = (&self.cu_dev, self.d.n(), self.num_centroids);
        let out = crate::cuda::plaid_approx::subset_centroids((s1, l1), (s2, l2), cu, nd, n_c)?;
        Ok((out, Shape::from(self.num_centroids)))
    }
}

/// PLAID's approximate score of every candidate of [`plaid_candidates`]:
/// `qcs [C, Nq·Lq]` F32 or F16 (F16 gathers half the bytes; column `i·Lq + s`: query `i`'s token `s`, e.g.
/// `centroids · Qᵀ` for `Q [Nq·Lq, dim]`), `codes [T]` U32 or I64 with
/// `cu_d [Nd + 1]` U32 (document `j` is codes `cu_d[j]..cu_d[j + 1]`), the
/// candidate bitmap `candidates [Nq, ⌈Nd/32⌉]` U32, and optionally a `mask`
/// of the same width (`[1, W]` for every query, or `[Nq, W]`) of the
/// documents allowed → `[Nq, Nd]` F32: `Σ_s max_t qcs[codes[t], i·Lq + s]`
/// for candidates, `-inf` elsewhere. A query token whose max is `-inf` (rows
/// of `qcs` set to `-inf` prune centroids) adds 0; an empty document scores 0.
/// `Lq` must be a multiple of 4, at most 64 (pad queries with zero tokens:
/// their scores are 0 and add 0).
pub fn plaid_approx_candidates(
    qcs: &Tensor,
    lq: usize,
    codes: &Tensor,
    cu_d: &Tensor,
    candidates: &Tensor,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    if !matches!(qcs.dtype(), DType::F32 | DType::F16) || qcs.rank() != 2 {
        bail!("qcs: expected F32 or F16 [C, Nq·Lq], got {:?} {:?}", qcs.dtype(), qcs.dims())
    }
    // The host scores F32 tables (F16 widens exactly).
    let qcs = &if qcs.device().is_cpu() { qcs.to_dtype(DType::F32)? } else { qcs.clone() };
    if !lq.is_multiple_of(4) || !(4..=64).contains(&lq) {
        bail!("lq: must be a multiple of 4 in 4..=64 (pad queries with zero tokens), got {lq}")
    }
    check_rank("codes", codes, &[1], "rank 1 [T] (packed)")?;
    if !matches!(codes.dtype(), DType::U32 | DType::I64) {
        bail!("codes: expected U32 or I64 centroid codes, got {:?}", codes.dtype())
    }
    if cu_d.dtype() != DType::U32 || cu_d.rank() != 1 || cu_d.dim(0)? == 0 {
        bail!("cu_d: expected U32 [Nd + 1] offsets, got {:?} {:?}", cu_d.dtype(), cu_d.dims())
    }
    let nd = cu_d.dim(0)? - 1;
    let (nq, words) = (qcs.dim(1)? / lq, nd.div_ceil(32));
    if qcs.dim(1)? != nq * lq {
        bail!("qcs: {} columns are not a whole number of queries of lq = {lq} tokens", qcs.dim(1)?)
    }
    if candidates.dtype() != DType::U32 || candidates.dims() != [nq, words] {
        bail!("candidates: expected U32 [{nq}, {words}], got {:?} {:?}", candidates.dtype(), candidates.dims())
    }
    if let Some(m) = mask {
        if m.dtype() != DType::U32 || m.rank() != 2 || !(m.dim(0)? == 1 || m.dim(0)? == nq) || m.dim(1)? != words {
            bail!("mask: expected U32 [1, {words}] or [{nq}, {words}], got {:?} {:?}", m.dtype(), m.dims())
        }
    }
    if nq * lq >= 1 << 30 || nd >= 1 << 31 {
        bail!("qcs: {nq} queries against {nd} documents exceed the kernel's 32-bit sizes; split the batch")
    }
    for (arg, t) in [("codes", Some(codes)), ("cu_d", Some(cu_d)), ("candidates", Some(candidates)), ("mask", mask)] {
        if let Some(t) = t {
            check_device(arg, t, qcs.device())?;
        }
    }
    let op =
        ApproxCandidates { lq, mask: mask.map(|m| m.contiguous()).transpose()?, candidates: candidates.contiguous()? };
    qcs.contiguous()?.apply_op3_no_bwd(&codes.contiguous()?, &cu_d.contiguous()?, &op)
}

struct ApproxCandidates {
    lq: usize,
    candidates: Tensor,
    mask: Option<Tensor>,
}

impl CustomOp3 for ApproxCandidates {
    fn name(&self) -> &'static str {
        "plaid_approx_candidates"
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
        use rayon::prelude::*;
        let (n_c, m) = l1.shape().dims2()?;
        let (CpuStorage::F32(qcs), Some((qa, qb))) = (s1, l1.contiguous_offsets()) else {
            bail!("qcs: expected a contiguous F32 tensor")
        };
        let qcs = &qcs[qa..qb];
        let cu = slice::<u32>("cu_d", s3, l3)?;
        let Some((ca, cb)) = l2.contiguous_offsets() else { bail!("codes: expected a contiguous tensor") };
        let code = |t: usize| -> i64 {
            match s2 {
                CpuStorage::U32(v) => v[ca + t] as i64,
                CpuStorage::I64(v) => v[ca + t],
                _ => -1,
            }
        };
        let n_codes = cb - ca;
        let (lq, nd) = (self.lq, cu.len() - 1);
        let nq = m / lq;
        let words = nd.div_ceil(32);
        let bits: Vec<u32> = self.candidates.flatten_all()?.to_vec1()?;
        let mask: Option<Vec<u32>> = self.mask.as_ref().map(|t| t.flatten_all()?.to_vec1()).transpose()?;
        let mask_rows = self.mask.as_ref().map_or(0, |t| t.dims()[0]);
        for j in 0..nd {
            if cu[j] > cu[j + 1] || cu[j + 1] as usize > n_codes {
                bail!("cu_d: document {j} spans {}..{}, outside the {n_codes} codes", cu[j], cu[j + 1])
            }
        }
        let rows: Vec<Result<Vec<f32>>> = (0..nq)
            .into_par_iter()
            .map(|i| {
                let mut out = vec![f32::NEG_INFINITY; nd];
                let mut best = vec![f32::NEG_INFINITY; lq];
                for (w, &word) in bits[i * words..(i + 1) * words].iter().enumerate() {
                    let mut word = word;
                    if let Some(mk) = &mask {
                        word &= mk[if mask_rows == 1 { 0 } else { i } * words + w];
                    }
                    while word != 0 {
                        let j = w * 32 + word.trailing_zeros() as usize;
                        word &= word - 1;
                        if j >= nd {
                            bail!("candidates: candidates[{i}, {w}] marks document {j}, past the last of {nd}")
                        }
                        best.fill(f32::NEG_INFINITY);
                        for t in cu[j] as usize..cu[j + 1] as usize {
                            let c = code(t);
                            if c < 0 || c as usize >= n_c {
                                bail!("codes: codes[{t}] = {c} is out of range for {n_c} centroids")
                            }
                            let row = &qcs[c as usize * m + i * lq..][..lq];
                            for (b, &v) in best.iter_mut().zip(row) {
                                *b = b.max(v);
                            }
                        }
                        let empty = cu[j] == cu[j + 1];
                        out[j] = if empty {
                            0.0
                        } else {
                            best.iter().map(|&b| if b > f32::NEG_INFINITY { b } else { 0.0 }).sum()
                        };
                    }
                }
                Ok(out)
            })
            .collect();
        let mut out = Vec::with_capacity(nq * nd);
        for r in rows {
            out.extend(r?);
        }
        Ok((CpuStorage::F32(out), Shape::from((nq, nd))))
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
        fn cuda(s: &candle_core::Storage) -> Result<&candle_core::CudaStorage> {
            match s {
                candle_core::Storage::Cuda(c) => Ok(c),
                _ => bail!("candidates: expected a CUDA tensor"),
            }
        }
        let (cs, cl) = self.candidates.storage_and_layout();
        let mk = self.mask.as_ref().map(|m| m.storage_and_layout());
        let mask = match &mk {
            Some((s, l)) => Some((cuda(s)?, *l)),
            None => None,
        };
        let nd = l3.shape().elem_count() - 1;
        let out = dev::approx_candidates(dev::ApproxCandidates {
            qcs: (s1, l1),
            lq: self.lq,
            codes: (s2, l2),
            cu_d: (s3, l3),
            candidates: (cuda(&cs)?, cl),
            mask,
        })?;
        Ok((out, Shape::from((l1.shape().dims()[1] / self.lq, nd))))
    }
}
