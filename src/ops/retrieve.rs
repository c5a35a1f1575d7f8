//! Top-k retrieval over a large corpus, streaming documents in chunks.

use super::dense::maxsim;
use crate::layout::check_rank;
use candle_core::{bail, Result, Tensor};

/// Top-k documents per query, best first: `(scores [Nq, k] F32, indices [Nq, k] U32)`
/// with k = min(top_k, Nd). Documents are scored `chunk` at a time so memory
/// stays O(Nq · (chunk + k)); equal scores keep the lower document index first.
pub fn retrieve(
    q: &Tensor,
    d: &Tensor,
    q_mask: Option<&Tensor>,
    d_mask: Option<&Tensor>,
    top_k: usize,
    chunk: usize,
) -> Result<(Tensor, Tensor)> {
    check_chunking(top_k, chunk)?;
    check_rank("d", d, &[3], "rank 3 [Nd, Ld, dim]")?;
    check_rank("q", q, &[3], "rank 3 [Nq, Lq, dim]")?;
    let nq = q.dim(0)?;
    let (nd, ld) = (d.dim(0)?, d.dim(1)?);
    if let Some(m) = d_mask {
        crate::layout::check_mask("d_mask", m, &[nd, ld], q.device())?;
    }
    // Validate shapes even when there are no documents.
    if nd == 0 {
        maxsim(q, d, q_mask, d_mask)?;
    }
    chunked_top_k(nq, nd, top_k, chunk, q.device(), |start, len| {
        let dm = d_mask.map(|m| m.narrow(0, start, len)).transpose()?;
        maxsim(q, &d.narrow(0, start, len)?, q_mask, dm.as_ref())
    })
}

/// `Err` unless `top_k` and `chunk` are at least 1 (checked first, before the operands).
pub(crate) fn check_chunking(top_k: usize, chunk: usize) -> Result<()> {
    if top_k == 0 {
        bail!("top_k: must be at least 1")
    }
    if chunk == 0 {
        bail!("chunk: must be at least 1")
    }
    Ok(())
}

/// The streaming top-k of `retrieve` and its 8-bit twin (arguments checked by
/// [`check_chunking`]): `score(start, len)`
/// gives the `[nq, len]` scores of documents `start..start + len`, taken
/// `chunk` at a time and merged into the best `min(top_k, nd)` per query.
pub(crate) fn chunked_top_k(
    nq: usize,
    nd: usize,
    top_k: usize,
    chunk: usize,
    device: &candle_core::Device,
    mut score: impl FnMut(usize, usize) -> Result<Tensor>,
) -> Result<(Tensor, Tensor)> {
    let mut top = TopK::new(nq, top_k.min(nd));
    let mut start = 0;
    while start < nd {
        let len = chunk.min(nd - start);
        top.push(&score(start, len)?, |j| (start + j) as u32)?;
        start += len;
    }
    top.finish(device)
}

/// A streaming top-k: the best `k` (score, id) pairs per query seen so far,
/// best first; equal scores keep the lower id first and NaN ranks last.
/// [`retrieve`] merges its chunks with it; an index that scores its
/// documents chunk by chunk (or shard by shard) can do the same.
#[derive(Clone, Debug)]
pub struct TopK {
    k: usize,
    best: Vec<Vec<(f32, u32)>>,
}

impl TopK {
    /// An empty top-`k` for `nq` queries.
    pub fn new(nq: usize, k: usize) -> Self {
        TopK { k, best: vec![Vec::with_capacity(2 * k); nq] }
    }

    /// Merges a chunk of scores `[Nq, n]` whose column `j` belongs to id `id(j)`.
    pub fn push(&mut self, scores: &Tensor, id: impl Fn(usize) -> u32) -> Result<()> {
        let s: Vec<Vec<f32>> = scores.to_vec2()?;
        for (row, top) in s.iter().zip(self.best.iter_mut()) {
            top.extend(row.iter().enumerate().map(|(j, &v)| (v, id(j))));
            top.sort_by(|a, b| {
                b.0.partial_cmp(&a.0).unwrap_or_else(|| a.0.is_nan().cmp(&b.0.is_nan())).then(a.1.cmp(&b.1))
            });
            top.truncate(self.k);
        }
        Ok(())
    }

    /// `(scores [Nq, k'] F32, ids [Nq, k'] U32)` on `device`, where `k'` is
    /// `k` or, if fewer ids were pushed, their number.
    pub fn finish(self, device: &candle_core::Device) -> Result<(Tensor, Tensor)> {
        // Every row saw the same ids, so every row holds the same count.
        let nq = self.best.len();
        let k = self.best.first().map_or(self.k, |t| t.len().min(self.k));
        if k == 0 || nq == 0 {
            // Empty results as zero-size views (CUDA allocates no empty
            // buffer, and launches no kernel over one: no cast of them).
            let empty = |dt| Tensor::zeros((nq.max(1), k.max(1)), dt, device)?.narrow(0, 0, nq)?.narrow(1, 0, k);
            return Ok((empty(candle_core::DType::F32)?, empty(candle_core::DType::U32)?));
        }
        let scores: Vec<f32> = self.best.iter().flat_map(|t| t.iter().map(|x| x.0)).collect();
        let ids: Vec<u32> = self.best.iter().flat_map(|t| t.iter().map(|x| x.1)).collect();
        Ok((Tensor::from_vec(scores, (nq, k), device)?, Tensor::from_vec(ids, (nq, k), device)?))
    }
}
