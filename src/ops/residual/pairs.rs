//! Exact MaxSim of arbitrary (query, document) pairs against packed
//! compressed documents: a search's candidates, scored without a pass over
//! the others.

#[cfg(feature = "cuda")]
use super::codec::codec_dev;
use super::codec::ResidualCodec;
use super::{check_packed, score, Docs};
use crate::layout::{check_device, Pairing, Problem, Seqs};
use crate::ops::normalize::l2_normalize;
use candle_core::{backend::BackendStorage, bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// The document index of [`maxsim_residual_pairs`] that stands for "no
/// document" (a pair scored `-inf`): the padding of candidate lists shorter
/// than asked for.
pub const NO_DOCUMENT: u32 = u32::MAX;

/// Exact MaxSim of arbitrary (query, document) pairs against packed
/// compressed documents, as [`maxsim_residual_varlen`](super::maxsim_residual_varlen) scores them: `q [Nq,
/// Lq, dim]`, `codes [T]`, `residuals [T, dim·nbits/8]`, `cu_d [Nd+1]`,
/// `pair_q [P]` / `pair_d [P]` U32 → `[P]` F32, pair `p` being query
/// `pair_q[p]` against document `pair_d[p]`. A pair whose document is
/// [`NO_DOCUMENT`] scores `-inf`; any other out-of-range index is an `Err`.
/// No gradient.
///
/// On CUDA, where the warp kernel covers the queries (F16/BF16, at most 32
/// rows, dims 64 / 96 / 128), the pairs are read by the kernel itself: no
/// host copy, so a search can feed it candidates it selected on the device.
/// Elsewhere the pairs are read on the host and only the documents they
/// name are gathered and scored.
///
/// `cu_d` is copied to the host and checked on every call; a caller that
/// scores the same documents again and again checks them once with
/// [`DocOffsets`] and calls [`maxsim_residual_pairs_offsets`].
#[allow(clippy::too_many_arguments)]
pub fn maxsim_residual_pairs(
    q: &Tensor,
    codes: &Tensor,
    residuals: &Tensor,
    cu_d: &Tensor,
    max_ld: usize,
    pair_q: &Tensor,
    pair_d: &Tensor,
    codec: &ResidualCodec,
    normalize: bool,
) -> Result<Tensor> {
    check_device("cu_d", cu_d, q.device())?;
    let d = DocOffsets::new(cu_d, codes.dim(0)?, max_ld)?;
    maxsim_residual_pairs_offsets(q, codes, residuals, &d, pair_q, pair_d, codec, normalize)
}

/// The document offsets `cu_d [Nd + 1]` U32 of packed documents, checked
/// once (they start at 0, never decrease and end at the number of packed
/// rows; no document is longer than `max_ld`) and held on the host and on
/// their device, for [`maxsim_residual_pairs_offsets`] calls on the same
/// documents: a search scores candidates of one index many times, and
/// copying 8 million offsets back for each search cost more than the search.
#[derive(Clone, Debug)]
pub struct DocOffsets(Seqs);

impl DocOffsets {
    /// `cu_d` checked for `rows` packed rows (copied to the host once).
    pub fn new(cu_d: &Tensor, rows: usize, max_ld: usize) -> Result<Self> {
        Ok(Self(Seqs::packed("cu_d", cu_d, rows, "max_ld", max_ld)?))
    }

    /// Offsets held on the host as `host` and on a device as `cu_d`, checked
    /// on the host only (no copy back).
    ///
    /// # Safety
    /// `cu_d` must hold exactly the values of `host` (rank 1, U32): the
    /// kernels read `cu_d` and trust the check made on `host`.
    pub unsafe fn from_parts(host: std::sync::Arc<Vec<u32>>, cu_d: Tensor, rows: usize, max_ld: usize) -> Result<Self> {
        if cu_d.dtype() != DType::U32 || cu_d.dims() != [host.len()] {
            bail!("cu_d: expected U32 [{}] offsets, got {:?} {:?}", host.len(), cu_d.dtype(), cu_d.dims())
        }
        Ok(Self(Seqs::packed_host("cu_d", host, cu_d, rows, "max_ld", max_ld)?))
    }

    /// The number of documents.
    pub fn len(&self) -> usize {
        self.0.n()
    }

    /// Whether there are no documents.
    pub fn is_empty(&self) -> bool {
        self.0.n() == 0
    }

    /// The checked offsets.
    pub(crate) fn seqs(&self) -> &Seqs {
        &self.0
    }
}

/// [`maxsim_residual_pairs`] against documents whose offsets were checked
/// once ([`DocOffsets`]): no host copy, so the call only launches kernels.
#[allow(clippy::too_many_arguments)]
pub fn maxsim_residual_pairs_offsets(
    q: &Tensor,
    codes: &Tensor,
    residuals: &Tensor,
    cu_d: &DocOffsets,
    pair_q: &Tensor,
    pair_d: &Tensor,
    codec: &ResidualCodec,
    normalize: bool,
) -> Result<Tensor> {
    let Seqs::Packed { cu_dev, .. } = &cu_d.0 else { bail!("cu_d: internal error, not packed offsets") };
    let (nq, lq, dim, t) = check_packed(q, codes, residuals, cu_dev, codec)?;
    if cu_d.0.rows() != t {
        bail!("cu_d: the offsets end at {} rows, but codes has {t}", cu_d.0.rows())
    }
    for (arg, p) in [("pair_q", pair_q), ("pair_d", pair_d)] {
        check_device(arg, p, q.device())?;
    }
    for (arg, p) in [("pair_q", pair_q), ("pair_d", pair_d)] {
        if p.dtype() != DType::U32 || p.rank() != 1 {
            bail!("{arg}: expected a rank-1 U32 tensor, got {:?} {:?}", p.dtype(), p.dims())
        }
    }
    if pair_q.dim(0)? != pair_d.dim(0)? {
        bail!("pair_d: length {} differs from pair_q's {}", pair_d.dim(0)?, pair_q.dim(0)?)
    }
    let d = cu_d.0.clone();
    let q = if normalize { l2_normalize(&q.detach())? } else { q.detach() };
    let op = ResidualPairs {
        lq,
        d,
        codes: codes.contiguous()?,
        residuals: residuals.contiguous()?,
        pair_q: pair_q.contiguous()?,
        pair_d: pair_d.contiguous()?,
        codec: codec.clone(),
        normalize,
    };
    q.reshape((nq * lq, dim))?.contiguous()?.apply_op1_no_bwd(&op)
}

/// [`maxsim_residual_pairs`] over packed queries `[Nq·Lq, dim]` (normalized
/// if asked); the documents and pairs are held by the op (no gradient).
struct ResidualPairs {
    lq: usize,
    d: Seqs,
    codes: Tensor,
    residuals: Tensor,
    pair_q: Tensor,
    pair_d: Tensor,
    codec: ResidualCodec,
    normalize: bool,
}

impl ResidualPairs {
    /// Pairs read on the host: the documents they name gathered, scored as
    /// a pair list by [`score`], `-inf` scattered back for [`NO_DOCUMENT`].
    fn on_host_pairs(&self, q: &Tensor) -> Result<Tensor> {
        let (nq, nd) = (q.dim(0)? / self.lq.max(1), self.d.n());
        let pq: Vec<u32> = self.pair_q.to_vec1()?;
        let pd: Vec<u32> = self.pair_d.to_vec1()?;
        let mut slot = vec![u32::MAX; nd];
        let (mut docs, mut vq, mut vd, mut keep) = (vec![], vec![], vec![], vec![]);
        for (p, (&i, &j)) in pq.iter().zip(&pd).enumerate() {
            if i as usize >= nq {
                bail!("pair_q: pair_q[{p}] = {i} is out of range for {nq} queries")
            }
            if j == NO_DOCUMENT {
                continue;
            }
            if j as usize >= nd {
                bail!("pair_d: pair_d[{p}] = {j} is out of range for {nd} documents")
            }
            if slot[j as usize] == u32::MAX {
                slot[j as usize] = docs.len() as u32;
                docs.push(j);
            }
            vq.push(i);
            vd.push(slot[j as usize]);
            keep.push(p);
        }
        let dev = q.device();
        let mut out = vec![f32::NEG_INFINITY; pq.len()];
        if !keep.is_empty() {
            let mut cu = vec![0u32];
            let mut rows = vec![];
            let mut max_len = 0;
            for &j in &docs {
                let (a, b) = (self.d.start(j as usize), self.d.end(j as usize));
                rows.extend(a as u32..b as u32);
                cu.push(rows.len() as u32);
                max_len = max_len.max(b - a);
            }
            let n_rows = rows.len();
            let ds = if n_rows == 0 {
                // Only empty documents: no rows to gather (a zero-size view).
                (self.codes.narrow(0, 0, 0)?, self.residuals.narrow(0, 0, 0)?)
            } else {
                let rows = Tensor::from_vec(rows, n_rows, dev)?;
                (self.codes.index_select(&rows, 0)?, self.residuals.index_select(&rows, 0)?)
            };
            let n_docs = docs.len();
            let cu = Tensor::from_vec(cu, n_docs + 1, dev)?;
            let problem = Problem {
                dim: q.dim(1)?,
                q: Seqs::Uniform { n: nq, len: self.lq },
                d: Seqs::packed("cu_d", &cu, n_rows, "max_ld", max_len)?,
                q_valid: None,
                d_valid: None,
                pairs: Pairing::list_from(vq, vd, dev)?,
            };
            let docs =
                Docs { codes: &ds.0, residuals: &ds.1, codec: &self.codec, normalize: self.normalize, lens: None };
            let scores: Vec<f32> = score(q, docs, problem)?.to_vec1()?;
            for (&p, s) in keep.iter().zip(scores) {
                out[p] = s;
            }
        }
        Tensor::from_vec(out, pq.len(), dev)
    }

    /// The query rows of a copied storage (the whole buffer) at layout `l`.
    fn rows(s: candle_core::Storage, l: &Layout) -> Result<Tensor> {
        let n = s_elems(&s)?;
        let all = Tensor::from((s, n));
        all.narrow(0, l.start_offset(), l.shape().elem_count())?.reshape(l.shape())
    }
}

/// Elements of a storage's whole buffer.
fn s_elems(s: &candle_core::Storage) -> Result<usize> {
    Ok(match s {
        candle_core::Storage::Cpu(c) => match c {
            CpuStorage::F16(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            c => bail!("q: unsupported dtype {:?}", c.dtype()),
        },
        #[cfg(feature = "cuda")]
        candle_core::Storage::Cuda(c) => match c.dtype() {
            DType::F16 => c.as_cuda_slice::<half::f16>()?.len(),
            DType::BF16 => c.as_cuda_slice::<half::bf16>()?.len(),
            DType::F32 => c.as_cuda_slice::<f32>()?.len(),
            DType::F64 => c.as_cuda_slice::<f64>()?.len(),
            dt => bail!("q: unsupported dtype {dt:?}"),
        },
        _ => bail!("q: unsupported device"),
    })
}

impl CustomOp1 for ResidualPairs {
    fn name(&self) -> &'static str {
        "maxsim_residual_pairs"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = self.on_host_pairs(&Self::rows(candle_core::Storage::Cpu(s.clone()), l)?)?;
        match crate::ops::owned_storage(&out)? {
            candle_core::Storage::Cpu(c) => Ok((c, out.shape().clone())),
            _ => bail!("maxsim_residual_pairs: internal error, scores are not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (tq, dim) = l.shape().dims2()?;
        let n_pairs = self.pair_q.dim(0)?;
        let nq = tq / self.lq.max(1);
        let problem = Problem {
            dim,
            q: Seqs::Uniform { n: nq, len: self.lq },
            d: self.d.clone(),
            q_valid: None,
            d_valid: None,
            pairs: Pairing::Cross { nq, nd: self.d.n() },
        };
        let (cs, cl) = self.codes.storage_and_layout();
        let (rs, rl) = self.residuals.storage_and_layout();
        let (candle_core::Storage::Cuda(cs), candle_core::Storage::Cuda(rs)) = (&*cs, &*rs) else {
            bail!("codes: expected a CUDA tensor")
        };
        let codec = codec_dev(&self.codec, self.normalize);
        let (pq, pd) = (&self.pair_q, &self.pair_d);
        if let Some(out) = crate::cuda::residual_pairs(&problem, (s, l), (cs, cl), (rs, rl), &codec, pq, pd)? {
            return Ok((out, Shape::from(n_pairs)));
        }
        // Other queries: a copy of them (small) as a tensor, the pairs on the host.
        use candle_core::backend::BackendStorage;
        let out = self.on_host_pairs(&Self::rows(candle_core::Storage::Cuda(s.try_clone(l)?), l)?)?;
        match crate::ops::owned_storage(&out)? {
            candle_core::Storage::Cuda(c) => Ok((c, out.shape().clone())),
            _ => bail!("maxsim_residual_pairs: internal error, scores are not on the GPU"),
        }
    }
}
