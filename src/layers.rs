//! Layers mirroring the Sentence Transformers / PyLate scoring interface.

use crate::{maxsim, maxsim_pairs};
use candle_core::{DType, Result, Tensor, D};

/// Score every query against every document (`[Nq, Nd]`, or `[Nq, K]` for a
/// 4-D KD `d`). Unlike the functional API, a document with no valid token
/// scores -1e9, so it ranks last.
#[derive(Clone, Copy, Debug, Default)]
pub struct MaxSim;

/// Score query b against document b (`[B]`); empty documents score -1e9.
#[derive(Clone, Copy, Debug, Default)]
pub struct MaxSimPairwise;

/// Score given to documents with no valid token by the layers.
pub const EMPTY_DOC_SCORE: f32 = -1e9;

impl MaxSim {
    /// Scores `q [Nq, Lq, dim]` against `d [Nd, Ld, dim]` (`[Nq, Nd]`) or a
    /// KD `d [Nq, K, Ld, dim]` (`[Nq, K]`); empty documents score [`EMPTY_DOC_SCORE`].
    pub fn forward(&self, q: &Tensor, d: &Tensor, q_mask: Option<&Tensor>, d_mask: Option<&Tensor>) -> Result<Tensor> {
        let scores = maxsim(q, d, q_mask, d_mask)?;
        let empty = empty_docs(d, d_mask)?; // [Nd] or [Nq, K]
        let empty = if d.rank() == 4 { empty } else { empty.unsqueeze(0)? };
        mark_empty(&scores, &empty)
    }
}

impl MaxSimPairwise {
    /// Scores `q[b]` against `d[b]` (`[B]`); empty documents score [`EMPTY_DOC_SCORE`].
    pub fn forward(&self, q: &Tensor, d: &Tensor, q_mask: Option<&Tensor>, d_mask: Option<&Tensor>) -> Result<Tensor> {
        let scores = maxsim_pairs(q, d, q_mask, d_mask)?;
        mark_empty(&scores, &empty_docs(d, d_mask)?)
    }
}

/// U8 flag per document (all dims but the last two of `d`): no valid token.
fn empty_docs(d: &Tensor, d_mask: Option<&Tensor>) -> Result<Tensor> {
    let lead = &d.dims()[..d.rank() - 2];
    let ld = d.dim(d.rank() - 2)?;
    match d_mask {
        Some(m) if ld > 0 => m.max(D::Minus1)?.eq(0u8),
        _ => Tensor::full((ld == 0) as u8, lead, d.device()),
    }
}

fn mark_empty(scores: &Tensor, empty: &Tensor) -> Result<Tensor> {
    let empty = empty.broadcast_as(scores.shape())?;
    let fill = Tensor::full(EMPTY_DOC_SCORE, scores.shape(), scores.device())?.to_dtype(DType::F32)?;
    empty.where_cond(&fill, scores)
}
