//! Padded layouts: in-batch cross product, KD (each query its own K docs), pairs.

use super::maxsim::MaxSimOp;
use super::normalize::l2_normalize;
use crate::layout::{check_device, check_dim, check_float, check_mask, check_rank, Pairing, Problem, Seqs};
use crate::options::{Backward, MaxSimOptions};
use candle_core::{bail, Result, Tensor};

/// MaxSim scores with default options: `q [Nq, Lq, dim]` against
/// `d [Nd, Ld, dim]` → `[Nq, Nd]`, or `d [Nq, K, Ld, dim]` (KD) → `[Nq, K]`.
pub fn maxsim(q: &Tensor, d: &Tensor, q_mask: Option<&Tensor>, d_mask: Option<&Tensor>) -> Result<Tensor> {
    maxsim_with(q, d, q_mask, d_mask, &MaxSimOptions::default())
}

/// [`maxsim`] with options (normalization, backward mode).
pub fn maxsim_with(
    q: &Tensor,
    d: &Tensor,
    q_mask: Option<&Tensor>,
    d_mask: Option<&Tensor>,
    opts: &MaxSimOptions,
) -> Result<Tensor> {
    let dense = Dense::new(q, d, q_mask, d_mask, opts)?;
    let scores = MaxSimOp::new(dense.problem, dense.backward).apply(&dense.q, &dense.d)?;
    scores.reshape(dense.out_shape)
}

/// Scores and, for each (query, document, query token), the document token
/// that won the max (doc-local index; -1 for masked query tokens and empty
/// documents): `([Nq, Nd], [Nq, Nd, Lq] I32)`, or `[Nq, K]` / `[Nq, K, Lq]`
/// for the KD layout. No gradient. Useful to explain a match.
pub fn maxsim_with_argmax(
    q: &Tensor,
    d: &Tensor,
    q_mask: Option<&Tensor>,
    d_mask: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let dense = Dense::new(q, d, q_mask, d_mask, &MaxSimOptions::default())?;
    let lq = q.dim(1)?;
    let (scores, argmax) = MaxSimOp::new(dense.problem, dense.backward).run_with_argmax(&dense.q, &dense.d)?;
    let (a, b) = dense.out_shape;
    Ok((scores.reshape((a, b))?, argmax.reshape((a, b, lq))?))
}

/// Scores and the gradients of a loss of them, outside candle's autograd:
/// `dloss` maps the scores (`[Nq, Nd]` F32, or `[Nq, K]` for the KD layout)
/// to dLoss/dscores of the same shape (it may run candle autograd on that
/// small tensor, e.g. a cross-entropy). Returns `(scores, grad_q, grad_d)`;
/// each gradient is allocated once, in the inputs' dtype, by the `backward`
/// mode's kernels.
///
/// For training loops bound by memory: candle 0.11's `backward` files every
/// gradient as `zeros_like` + `add`, so three D-sized buffers exist while
/// grad_D is filed; here there is one (plus the argmax, freed on return).
/// The gradients are those of `maxsim` (no `normalize`: apply
/// [`crate::l2_normalize`] to the inputs' producers instead).
pub fn maxsim_value_and_grads(
    q: &Tensor,
    d: &Tensor,
    q_mask: Option<&Tensor>,
    d_mask: Option<&Tensor>,
    backward: Backward,
    dloss: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dense = Dense::new(q, d, q_mask, d_mask, &MaxSimOptions { normalize: false, backward })?;
    let (qc, dc) = (dense.q.contiguous()?, dense.d.contiguous()?);
    let op = MaxSimOp { save_argmax: true, ..MaxSimOp::new(dense.problem, dense.backward) };
    let scores = qc.apply_op2_no_bwd(&dc, &op)?.reshape(dense.out_shape)?;
    let g = dloss(&scores)?;
    if g.dims() != scores.dims() {
        bail!("dloss: returned shape {:?}, expected the scores' {:?}", g.dims(), scores.dims())
    }
    let g = g.to_device(q.device())?.flatten_all()?;
    let (gq, gd) = op.grads(&qc, &dc, &g)?;
    Ok((scores, gq, gd))
}

/// A dense call lowered to packed rows.
struct Dense {
    problem: Problem,
    backward: Backward,
    q: Tensor,
    d: Tensor,
    out_shape: (usize, usize),
}

impl Dense {
    fn new(
        q: &Tensor,
        d: &Tensor,
        q_mask: Option<&Tensor>,
        d_mask: Option<&Tensor>,
        opts: &MaxSimOptions,
    ) -> Result<Self> {
        check_rank("q", q, &[3], "rank 3 [Nq, Lq, dim]")?;
        check_rank("d", d, &[3, 4], "rank 3 [Nd, Ld, dim] or rank 4 [Nq, K, Ld, dim]")?;
        let (nq, lq, dim) = q.dims3()?;
        check_common(q, d, dim)?;
        if let Some(m) = q_mask {
            check_mask("q_mask", m, &[nq, lq], q.device())?;
        }
        let kd = d.rank() == 4;
        let (nd_total, ld, out_shape) = if kd {
            let (n, k, ld, _) = d.dims4()?;
            if n != nq {
                bail!("d: KD layout [Nq, K, Ld, dim] needs d.dim(0) = Nq = {nq}, got {n}")
            }
            if let Some(m) = d_mask {
                check_mask("d_mask", m, &[nq, k, ld], q.device())?;
            }
            (nq * k, ld, (nq, k))
        } else {
            let (nd, ld, _) = d.dims3()?;
            if let Some(m) = d_mask {
                check_mask("d_mask", m, &[nd, ld], q.device())?;
            }
            (nd, ld, (nq, nd))
        };
        let pairs = if kd {
            let k = out_shape.1;
            let pq = (0..nq * k).map(|p| (p / k) as u32).collect();
            let pd = (0..nq * k).map(|p| p as u32).collect();
            Pairing::list_from(pq, pd, q.device())?
        } else {
            Pairing::Cross { nq, nd: nd_total }
        };
        let (qn, dn) = maybe_normalize(q, d, opts.normalize)?;
        let problem = Problem {
            dim,
            q: Seqs::Uniform { n: nq, len: lq },
            d: Seqs::Uniform { n: nd_total, len: ld },
            q_valid: q_mask.map(|m| m.flatten_all()).transpose()?,
            d_valid: d_mask.map(|m| m.flatten_all()).transpose()?,
            pairs,
        };
        Ok(Self {
            problem,
            backward: opts.backward.resolve(kd, nq, nd_total, lq),
            // Handed to the op as they are (it reads any contiguous operand as
            // packed rows): a reshape here would cost a gradient-sized
            // zeros + add per operand in candle's backward.
            q: qn,
            d: dn,
            out_shape,
        })
    }
}

/// Pairwise scores: `q [B, Lq, dim]` against `d [B, Ld, dim]`, row b with row b → `[B]`.
pub fn maxsim_pairs(q: &Tensor, d: &Tensor, q_mask: Option<&Tensor>, d_mask: Option<&Tensor>) -> Result<Tensor> {
    maxsim_pairs_with(q, d, q_mask, d_mask, &MaxSimOptions::default())
}

/// [`maxsim_pairs`] with options.
pub fn maxsim_pairs_with(
    q: &Tensor,
    d: &Tensor,
    q_mask: Option<&Tensor>,
    d_mask: Option<&Tensor>,
    opts: &MaxSimOptions,
) -> Result<Tensor> {
    check_rank("q", q, &[3], "rank 3 [B, Lq, dim]")?;
    check_rank("d", d, &[3], "rank 3 [B, Ld, dim]")?;
    let (b, lq, dim) = q.dims3()?;
    check_common(q, d, dim)?;
    let (bd, ld, _) = d.dims3()?;
    if bd != b {
        bail!("d: pairs need as many documents as queries (B = {b}), got {bd}")
    }
    if let Some(m) = q_mask {
        check_mask("q_mask", m, &[b, lq], q.device())?;
    }
    if let Some(m) = d_mask {
        check_mask("d_mask", m, &[b, ld], q.device())?;
    }
    let idx: Vec<u32> = (0..b as u32).collect();
    let (q, d) = maybe_normalize(q, d, opts.normalize)?;
    let problem = Problem {
        dim,
        q: Seqs::Uniform { n: b, len: lq },
        d: Seqs::Uniform { n: b, len: ld },
        q_valid: q_mask.map(|m| m.flatten_all()).transpose()?,
        d_valid: d_mask.map(|m| m.flatten_all()).transpose()?,
        pairs: Pairing::list_from(idx.clone(), idx, q.device())?,
    };
    let backward = opts.backward.resolve(false, b, b, lq);
    MaxSimOp::new(problem, backward).apply(&q, &d)
}

/// dtype / device / dim agreement of q and d (ranks are checked by the caller).
pub(crate) fn check_common(q: &Tensor, d: &Tensor, dim: usize) -> Result<()> {
    check_float("q", q)?;
    check_float("d", d)?;
    check_device("d", d, q.device())?;
    check_dim(dim, "d", d.dim(candle_core::D::Minus1)?)?;
    if q.dtype() != d.dtype() {
        bail!("d: dtype {:?} differs from q's {:?}", d.dtype(), q.dtype())
    }
    Ok(())
}

pub(crate) fn maybe_normalize(q: &Tensor, d: &Tensor, normalize: bool) -> Result<(Tensor, Tensor)> {
    if normalize {
        Ok((l2_normalize(q)?, l2_normalize(d)?))
    } else {
        Ok((q.clone(), d.clone()))
    }
}
