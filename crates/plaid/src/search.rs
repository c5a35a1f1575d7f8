//! The PLAID search pipeline (the steps are in the crate docs).

use crate::index::{query_rows, PlaidIndex};
use candle_core::{bail, DType, Device, Result, Shape, Tensor};
use candle_maxsim::{
    nn::{topk_rows, TOPK_MAX_K},
    plaid::{deferred_checks, plaid_approx_candidates, plaid_candidates, plaid_subset_centroids, NO_CENTROID},
    residual::{maxsim_residual_pairs, maxsim_residual_pairs_offsets, NO_DOCUMENT},
};

/// Parameters of [`PlaidIndex::search`] (fast-plaid's names and defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct SearchParams {
    /// Results per query.
    pub top_k: usize,
    /// Centroids probed per query token.
    pub n_ivf_probe: usize,
    /// Candidates kept by approximate score; the best quarter of them is
    /// scored exactly (at most [`TOPK_MAX_K`]).
    pub n_full_scores: usize,
    /// PLAID's centroid pruning: a centroid whose best score against the
    /// query's tokens is below this does not count in approximate scores
    /// (`None`, the default as in fast-plaid: no pruning).
    pub centroid_score_threshold: Option<f32>,
    /// Queries per device batch (0: as many as fit in a memory budget).
    pub batch_size: usize,
}

impl Default for SearchParams {
    fn default() -> Self {
        Self { top_k: 10, n_ivf_probe: 8, n_full_scores: 4096, centroid_score_threshold: None, batch_size: 0 }
    }
}

/// Documents a search may return.
#[derive(Clone, Copy, Debug)]
pub enum Subset<'a> {
    /// The same ids for every query.
    Shared(&'a [u32]),
    /// One list of ids per query.
    PerQuery(&'a [Vec<u32>]),
}

/// Per query, its results: `(document id, score)`, best first (equal scores:
/// lower id first); fewer than `top_k` when there are fewer candidates.
pub type SearchResults = Vec<Vec<(u32, f32)>>;

/// Batch shapes whose constant tensors a search keeps (the most recent).
const SEARCH_CONSTS_KEPT: usize = 8;

/// Device memory one batch may take for its query-centroid tables (two
/// `[C, Lq]` tables per query).
const BATCH_BYTES: usize = 1 << 30;

impl PlaidIndex {
    /// PLAID search of the queries `q [Nq, Lq, dim]` (rows of zeros are
    /// padding: they are not probed and add nothing); see the [module
    /// docs](crate#search). Queries are scored as fast-plaid scores them: the exact
    /// score of a document is MaxSim against its decompressed, L2-normalized
    /// tokens (queries are normalized too; ColBERT queries already are unit
    /// vectors). `Lq` may be at most 64. On a GPU, pass F16 or BF16 queries:
    /// F32 ones are scored exactly through a host path, tens of milliseconds
    /// per batch at tens of millions of tokens.
    pub fn search(&self, q: &Tensor, params: &SearchParams, subset: Option<Subset>) -> Result<SearchResults> {
        self.search_marked(q, params, subset, &mut |_| Ok(()))
    }

    /// [`Self::search`] and the time of each stage of the pipeline (summed
    /// over batches), the device synchronized after each: slower than
    /// `search`, for breaking a search down.
    pub fn search_profiled(
        &self,
        q: &Tensor,
        params: &SearchParams,
        subset: Option<Subset>,
    ) -> Result<(SearchResults, Vec<(&'static str, std::time::Duration)>)> {
        let mut times: Vec<(&'static str, std::time::Duration)> = Vec::new();
        let dev = self.device().clone();
        dev.synchronize()?;
        let mut last = std::time::Instant::now();
        let res = self.search_marked(q, params, subset, &mut |stage| {
            dev.synchronize()?;
            let now = std::time::Instant::now();
            match times.iter_mut().find(|t| t.0 == stage) {
                Some(t) => t.1 += now - last,
                None => times.push((stage, now - last)),
            }
            last = now;
            Ok(())
        })?;
        Ok((res, times))
    }

    fn search_marked(
        &self,
        q: &Tensor,
        params: &SearchParams,
        subset: Option<Subset>,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<SearchResults> {
        self.check_queries(q)?;
        let (nq, lq, _) = q.dims3()?;
        if params.top_k == 0 || params.n_ivf_probe == 0 || params.n_full_scores == 0 {
            bail!("params: top_k, n_ivf_probe and n_full_scores must be at least 1, got {params:?}")
        }
        if lq > 64 {
            bail!("q: at most 64 tokens per query, got {lq}")
        }
        if self.ivf.is_none() {
            bail!("dir: {} has no inverted file (ivf.npy): use search_exact", self.dir.display())
        }
        if let Some(Subset::PerQuery(s)) = subset {
            if s.len() != nq {
                bail!("subset: {} lists for {nq} queries", s.len())
            }
        }
        let n_c = self.num_centroids();
        let lqp = lq.div_ceil(4) * 4;
        // Two [C, Lq] score tables per query, its approximate scores and bitmap.
        let per_query = 2 * n_c * lqp * self.table_dtype().size_in_bytes() + self.num_documents() * 8;
        let batch = match params.batch_size {
            0 => (BATCH_BYTES / per_query.max(1)).clamp(1, 1024),
            b => b,
        };
        let real = query_rows(q)?;
        mark("query check")?;
        let mut out = Vec::with_capacity(nq);
        for start in (0..nq).step_by(batch) {
            let n = batch.min(nq - start);
            let sub = match subset {
                Some(Subset::PerQuery(s)) => Some(Subset::PerQuery(&s[start..start + n])),
                s => s,
            };
            let real = &real[start * lq..(start + n) * lq];
            // The ops' input checks wait for the batch's end (one device sync, not four).
            let res = deferred_checks(|| self.search_batch(&q.narrow(0, start, n)?, real, params, sub, mark))?;
            out.extend(res);
        }
        Ok(out)
    }

    /// One batch of queries; `real`: whether each of its `Nq·Lq` query rows
    /// is a token (not padding).
    fn search_batch(
        &self,
        q: &Tensor,
        real: &[bool],
        params: &SearchParams,
        subset: Option<Subset>,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<SearchResults> {
        let (nq, lq, dim) = q.dims3()?;
        let dev = self.device();
        let (ivf, ivf_off) = self.ivf.as_ref().expect("checked by search");
        let n_c = self.num_centroids();
        let nd = self.num_documents();
        // Queries padded to a multiple of 4 tokens with zero rows (they add 0).
        let lqp = lq.div_ceil(4) * 4;
        let q = if lqp > lq {
            Tensor::cat(&[q, &Tensor::zeros((nq, lqp - lq, dim), q.dtype(), dev)?], 1)?
        } else {
            q.clone()
        };
        let m = nq * lqp;
        // 1. Query-centroid scores in the centroids' dtype (F16, as fast-plaid):
        // [C, M] for the approximate scores (F16 on a GPU: half the gathered
        // bytes; F32 on the host) and [M, C] to pick each token's probes.
        let cents = &self.codec.centroids;
        let qf = q.reshape((m, dim))?.to_dtype(cents.dtype())?;
        let qcs = cents.matmul(&qf.t()?)?.to_dtype(self.table_dtype())?; // [C, M]
        mark("query-centroid table")?;
        let probe_scores = qf.matmul(&cents.t()?)?; // [M, C]
        let probe_scores = match probe_scores.dtype() {
            DType::F16 | DType::BF16 | DType::F32 => probe_scores,
            _ => probe_scores.to_dtype(DType::F32)?,
        };
        // Centroids a subset's documents do not use are never probed (fast-plaid's subset rule).
        let allowed = self.allowed(subset, nq)?;
        let probe_scores = match &allowed {
            Some(a) => self.mask_probes(&probe_scores, a, nq, lqp)?,
            None => probe_scores,
        };
        let qcs = match params.centroid_score_threshold {
            Some(t) => prune(&qcs, nq, lqp, t)?,
            None => qcs,
        };
        mark("probe scores")?;
        // 2. The probed centroids of every real token (padding rows and -inf
        // scores, i.e. centroids outside a subset: none).
        let n_probe = params.n_ivf_probe.min(n_c);
        let (pv, probes) = topk_rows(&probe_scores, n_probe)?;
        let padded = lqp > lq || real.iter().any(|&r| !r);
        let probes = if padded || allowed.is_some() {
            let mut keep = pv.gt(f64::NEG_INFINITY)?;
            if padded {
                let rows: Vec<u8> = (0..m).map(|r| (r % lqp < lq && real[r / lqp * lq + r % lqp]) as u8).collect();
                keep = keep.broadcast_mul(&Tensor::from_vec(rows, (m, 1), dev)?)?;
            }
            keep.where_cond(&probes, &Tensor::full(NO_CENTROID, probes.shape(), dev)?)?
        } else {
            probes
        };
        let probes = probes.reshape((nq, lqp * n_probe))?;
        mark("probe")?;
        // 3-4. Candidates and their approximate scores.
        let mut cand = plaid_candidates(&probes, ivf, ivf_off, nd)?;
        if let Some((delta, delta_off)) = &self.delta_ivf {
            // The delta lists hold other documents than the base ones: the
            // two bitmaps have no bit in common, so their sum is their union.
            cand = (cand + plaid_candidates(&probes, delta, delta_off, nd)?)?;
        }
        mark("candidates")?;
        let mask = match (&allowed, &self.live) {
            (Some(Allowed { docs, .. }), _) => Some(docs.clone()),
            (None, Some(live)) => Some(live.clone()),
            (None, None) => None,
        };
        let approx = plaid_approx_candidates(&qcs, lqp, &self.codes, &self.cu, &cand, mask.as_ref())?;
        mark("approximate scores")?;
        let k1 = (params.n_full_scores / 4).clamp(1, TOPK_MAX_K).min(nd.max(1));
        let (av, ai) = topk_rows(&approx, k1)?;
        let SearchConsts { pair_q, none, neg_inf, .. } = self.search_consts(nq, k1)?;
        let ai = av.gt(&neg_inf.broadcast_as(av.shape())?)?.where_cond(&ai, &none)?;
        mark("candidate top-k")?;
        // 5. Exact scores of those, and the best top_k.
        let exact = if self.host_residuals {
            // Residuals in host memory: only the candidates' rows travel, and
            // the pairs name the candidates' places among them.
            let ids: Vec<u32> = ai.flatten_all()?.to_vec1()?;
            let mut docs: Vec<u32> = ids.iter().copied().filter(|&d| d != NO_DOCUMENT).collect();
            docs.sort_unstable();
            docs.dedup();
            let (codes, residuals, cu, max_len) = self.gather_docs(&docs)?;
            let at: Vec<u32> = ids
                .iter()
                .map(|&d| if d == NO_DOCUMENT { d } else { docs.binary_search(&d).map_or(NO_DOCUMENT, |i| i as u32) })
                .collect();
            let (n, m) = (at.len(), cu.len());
            let pair_d = Tensor::from_vec(at, n, dev)?;
            let cu = Tensor::from_vec(cu, m, dev)?;
            let pq = pair_q.flatten_all()?;
            maxsim_residual_pairs(&q, &codes, &residuals, &cu, max_len, &pq, &pair_d, &self.codec, true)?
        } else {
            let (pq, pd) = (pair_q.flatten_all()?, ai.flatten_all()?);
            let (codes, res) = (&self.codes, &self.residuals);
            maxsim_residual_pairs_offsets(&q, codes, res, &self.doc_offsets, &pq, &pd, &self.codec, true)?
        }
        .reshape((nq, k1))?;
        mark("exact scores")?;
        let (ev, ei) = topk_rows(&exact, params.top_k.min(k1))?;
        let ids = ai.gather(&ei.contiguous()?, 1)?;
        let (ev, ids): (Vec<Vec<f32>>, Vec<Vec<u32>>) = (ev.to_vec2()?, ids.to_vec2()?);
        mark("top-k")?;
        Ok(ev
            .into_iter()
            .zip(ids)
            .map(|(s, i)| i.into_iter().zip(s).filter(|&(d, s)| d != NO_DOCUMENT && s > f32::NEG_INFINITY).collect())
            .collect())
    }

    /// The constant tensors of a batch of `nq` queries with `k1` candidates
    /// each, made once per shape (the last few shapes kept): each launch saved is ~10 µs of a
    /// single-query search's ~0.34 ms, most of which is the host launching.
    fn search_consts(&self, nq: usize, k1: usize) -> Result<SearchConsts> {
        let dev = self.device();
        let mut c = self.search_consts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = c.iter().position(|s| (s.nq, s.k1) == (nq, k1) && s.pair_q.device().same_device(dev)) {
            // Most recent last: a service's batch sizes vary, the few shapes
            // it repeats stay.
            let s = c.remove(i);
            c.push(s.clone());
            return Ok(s);
        }
        let s = SearchConsts {
            nq,
            k1,
            pair_q: Tensor::arange(0u32, nq as u32, dev)?.unsqueeze(1)?.broadcast_as((nq, k1))?.contiguous()?,
            none: Tensor::full(NO_DOCUMENT, (nq, k1), dev)?,
            neg_inf: Tensor::new(f32::NEG_INFINITY, dev)?,
        };
        // Large batches amortize them; small ones are kept (≤ 512 KB each).
        if nq * k1 <= 1 << 16 {
            if c.len() == SEARCH_CONSTS_KEPT {
                c.remove(0);
            }
            c.push(s.clone());
        }
        Ok(s)
    }

    /// The dtype of the query-centroid score tables: F16 on a GPU with F16
    /// centroids (the approximate scores gather half the bytes), else F32.
    fn table_dtype(&self) -> DType {
        if self.device().is_cuda() && self.codec.centroids.dtype() == DType::F16 {
            DType::F16
        } else {
            DType::F32
        }
    }

    /// The documents each query may return (subset, less the deleted), and
    /// the centroids those documents use; `None`: every live document.
    fn allowed(&self, subset: Option<Subset>, nq: usize) -> Result<Option<Allowed>> {
        let Some(subset) = subset else { return Ok(None) };
        let nd = self.num_documents();
        let lists: Vec<&[u32]> = match subset {
            Subset::Shared(s) => vec![s],
            Subset::PerQuery(s) => s.iter().map(Vec::as_slice).collect(),
        };
        let words = nd.div_ceil(32);
        let n_c = self.num_centroids();
        let dev = self.device();
        let mut docs = vec![0u32; lists.len() * words];
        let mut cents = Vec::with_capacity(lists.len());
        for (i, list) in lists.iter().enumerate() {
            let mut live = Vec::with_capacity(list.len());
            for (p, &d) in list.iter().enumerate() {
                if d as usize >= nd {
                    bail!("subset: entry {p} of list {i} is {d}, out of range for {nd} documents")
                }
                if self.deleted.binary_search(&d).is_ok() {
                    continue;
                }
                docs[i * words + d as usize / 32] |= 1 << (d % 32);
                live.push(d);
            }
            // The centroids the subset's tokens use, found where the codes
            // are: the tokens never travel (10 M ids and codes each way for
            // 1 % of a 1 B-token index).
            let n = live.len();
            cents.push(plaid_subset_centroids(&self.codes, &self.doc_offsets, &Tensor::from_vec(live, n, dev)?, n_c)?);
        }
        let rows = lists.len();
        let _ = nq;
        Ok(Some(Allowed { docs: Tensor::from_vec(docs, (rows, words), dev)?, centroids: Tensor::stack(&cents, 0)? }))
    }

    /// Probe scores of centroids a query's subset does not use set to -inf.
    fn mask_probes(&self, scores: &Tensor, a: &Allowed, nq: usize, lqp: usize) -> Result<Tensor> {
        let n_c = self.num_centroids();
        let rows = a.centroids.dim(0)?;
        // [rows, C] -> [Nq, Lqp, C] -> [M, C]
        let mask = a.centroids.unsqueeze(1)?.broadcast_as((rows, lqp, n_c))?;
        let mask = if rows == 1 { mask.broadcast_as((nq, lqp, n_c))? } else { mask };
        let mask = mask.contiguous()?.reshape((nq * lqp, n_c))?;
        mask.where_cond(scores, &neg_inf(scores.shape(), scores.dtype(), scores.device())?)
    }
}

/// [`PlaidIndex::search_consts`]: for `nq` queries of `k1` candidates, the
/// query of each candidate pair `[nq, k1]` U32, `[nq, k1]` of
/// [`NO_DOCUMENT`], and -inf (an F32 scalar).
#[derive(Clone, Debug)]
pub(crate) struct SearchConsts {
    nq: usize,
    k1: usize,
    pair_q: Tensor,
    none: Tensor,
    neg_inf: Tensor,
}

/// The subset of [`PlaidIndex::allowed`]: `[1 or Nq, ⌈Nd/32⌉]` U32 document
/// bitmaps and `[1 or Nq, C]` U8 centroid masks.
struct Allowed {
    docs: Tensor,
    centroids: Tensor,
}

/// `qcs [C, Nq·Lq]` with the rows of centroids whose best score against a
/// query's tokens is below `t` set to -inf for that query (PLAID's pruning).
fn prune(qcs: &Tensor, nq: usize, lq: usize, t: f32) -> Result<Tensor> {
    let n_c = qcs.dim(0)?;
    let best = qcs.reshape((n_c, nq, lq))?.max_keepdim(2)?; // [C, Nq, 1]
    let keep = best.ge(t as f64)?.broadcast_as((n_c, nq, lq))?.contiguous()?.reshape((n_c, nq * lq))?;
    keep.where_cond(qcs, &neg_inf(qcs.shape(), qcs.dtype(), qcs.device())?)
}

/// A tensor of -inf.
fn neg_inf(shape: &Shape, dtype: DType, dev: &Device) -> Result<Tensor> {
    match dtype {
        DType::F16 => Tensor::full(half::f16::NEG_INFINITY, shape, dev),
        DType::BF16 => Tensor::full(half::bf16::NEG_INFINITY, shape, dev),
        _ => Tensor::full(f32::NEG_INFINITY, shape, dev)?.to_dtype(dtype),
    }
}
