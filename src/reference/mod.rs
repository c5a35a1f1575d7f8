//! Naive, materializing implementations of every entry point in plain candle
//! ops: the ground truth of the tests and the baseline of the benchmarks.
//!
//! They build the full similarity tensor (`[Nq, Nd, Lq, Ld]` for the
//! cross product) in F32 (F64 for F64 inputs), mask it with -inf, take the
//! max over document tokens, zero empty documents and masked query tokens,
//! and sum. Autograd through them is candle's own. The submodules mirror
//! the crate's modules.

use crate::MaxSimOptions;
use candle_core::{bail, DType, Device, Result, Tensor, D};

pub mod nn;
pub mod optim;
pub mod plaid;
pub mod quantized;
pub mod residual;

fn work_dtype(t: &Tensor) -> DType {
    if t.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Masked max over the last dim of `sim [.., Lq, Ld]`, then the masked sum over Lq.
/// `dm` broadcasts to `[.., 1, Ld]`, `qm` to `[.., Lq]` (U8, non-zero = valid).
fn reduce(sim: &Tensor, qm: &Tensor, dm: &Tensor) -> Result<Tensor> {
    let ld = sim.dim(D::Minus1)?;
    let lead = &sim.dims()[..sim.rank() - 1];
    if ld == 0 || sim.elem_count() == 0 {
        return Tensor::zeros(&lead[..lead.len() - 1], DType::F32, sim.device());
    }
    let neg = Tensor::full(f64::NEG_INFINITY, sim.shape(), sim.device())?.to_dtype(sim.dtype())?;
    let sim = dm.broadcast_as(sim.shape())?.where_cond(sim, &neg)?;
    let mx = sim.max(D::Minus1)?; // [.., Lq]
    let zero = mx.zeros_like()?;
    // A document with no valid token contributes 0 (its max is -inf).
    let has_doc = dm.max(D::Minus1)?.broadcast_as(mx.shape())?;
    let mx = has_doc.where_cond(&mx, &zero)?;
    let mx = qm.broadcast_as(mx.shape())?.where_cond(&mx, &zero)?;
    mx.sum(D::Minus1)?.to_dtype(DType::F32)
}

fn ones_mask(dims: &[usize], dev: &Device) -> Result<Tensor> {
    Tensor::ones(dims, DType::U8, dev)
}

fn prep(x: &Tensor, normalize: bool) -> Result<Tensor> {
    let x = x.to_dtype(work_dtype(x))?;
    if normalize {
        let norm = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?;
        x.broadcast_div(&norm)
    } else {
        Ok(x)
    }
}

/// Naive [`crate::maxsim`].
pub fn maxsim(q: &Tensor, d: &Tensor, q_mask: Option<&Tensor>, d_mask: Option<&Tensor>) -> Result<Tensor> {
    maxsim_with(q, d, q_mask, d_mask, &MaxSimOptions::default())
}

/// Naive [`crate::maxsim_with`] (3-D `d`: cross product; 4-D `d`: KD layout).
pub fn maxsim_with(
    q: &Tensor,
    d: &Tensor,
    q_mask: Option<&Tensor>,
    d_mask: Option<&Tensor>,
    opts: &MaxSimOptions,
) -> Result<Tensor> {
    let (nq, lq, _) = q.dims3()?;
    let qf = prep(q, opts.normalize)?;
    let df = prep(d, opts.normalize)?;
    let qm = match q_mask {
        Some(m) => m.clone(),
        None => ones_mask(&[nq, lq], q.device())?,
    };
    match d.rank() {
        3 => {
            let (nd, ld, _) = d.dims3()?;
            let dm = match d_mask {
                Some(m) => m.clone(),
                None => ones_mask(&[nd, ld], q.device())?,
            };
            // [Nq, 1, Lq, dim] x [1, Nd, dim, Ld] -> [Nq, Nd, Lq, Ld]
            let sim = qf.unsqueeze(1)?.broadcast_matmul(&df.transpose(1, 2)?.unsqueeze(0)?)?;
            reduce(&sim, &qm.unsqueeze(1)?, &dm.unsqueeze(0)?.unsqueeze(2)?)
        }
        4 => {
            let (_, k, ld, _) = d.dims4()?;
            let dm = match d_mask {
                Some(m) => m.clone(),
                None => ones_mask(&[nq, k, ld], q.device())?,
            };
            // [Nq, 1, Lq, dim] x [Nq, K, dim, Ld] -> [Nq, K, Lq, Ld]
            let sim = qf.unsqueeze(1)?.broadcast_matmul(&df.transpose(2, 3)?)?;
            reduce(&sim, &qm.unsqueeze(1)?, &dm.unsqueeze(2)?)
        }
        r => bail!("d: expected rank 3 or 4, got {r}"),
    }
}

/// Naive [`crate::maxsim_pairs`].
pub fn maxsim_pairs(q: &Tensor, d: &Tensor, q_mask: Option<&Tensor>, d_mask: Option<&Tensor>) -> Result<Tensor> {
    let (b, lq, _) = q.dims3()?;
    let ld = d.dim(1)?;
    let qm = match q_mask {
        Some(m) => m.clone(),
        None => ones_mask(&[b, lq], q.device())?,
    };
    let dm = match d_mask {
        Some(m) => m.clone(),
        None => ones_mask(&[b, ld], q.device())?,
    };
    let sim = prep(q, false)?.matmul(&prep(d, false)?.transpose(1, 2)?.contiguous()?)?; // [B, Lq, Ld]
    reduce(&sim, &qm, &dm.unsqueeze(1)?)
}

/// Packed rows `cu[i]..cu[i+1]` padded to `[N, max_len, dim]`, with their mask.
pub fn pad_packed(x: &Tensor, cu: &Tensor, max_len: usize) -> Result<(Tensor, Tensor)> {
    let cu: Vec<u32> = cu.to_vec1()?;
    let dim = x.dim(1)?;
    let mut rows = Vec::new();
    let mut masks = Vec::new();
    for w in cu.windows(2) {
        let (a, len) = (w[0] as usize, (w[1] - w[0]) as usize);
        if len > max_len {
            bail!("max_len: {max_len} is smaller than a sequence of {len}")
        }
        let seq = x.narrow(0, a, len)?;
        let pad = Tensor::zeros((max_len - len, dim), x.dtype(), x.device())?;
        rows.push(Tensor::cat(&[&seq, &pad], 0)?);
        let m: Vec<u8> = (0..max_len).map(|t| (t < len) as u8).collect();
        masks.push(Tensor::from_vec(m, max_len, x.device())?);
    }
    if rows.is_empty() {
        return Ok((
            Tensor::zeros((0, max_len, dim), x.dtype(), x.device())?,
            Tensor::zeros((0, max_len), DType::U8, x.device())?,
        ));
    }
    Ok((Tensor::stack(&rows, 0)?, Tensor::stack(&masks, 0)?))
}

/// Naive [`crate::maxsim_varlen`]: pad, mask, score.
pub fn maxsim_varlen(
    q: &Tensor,
    cu_q: &Tensor,
    max_lq: usize,
    d: &Tensor,
    cu_d: &Tensor,
    max_ld: usize,
) -> Result<Tensor> {
    let (qp, qm) = pad_packed(q, cu_q, max_lq)?;
    let (dp, dm) = pad_packed(d, cu_d, max_ld)?;
    maxsim(&qp, &dp, Some(&qm), Some(&dm))
}

/// Naive [`crate::score_pairs_packed`]: pad, gather the pairs, score pairwise.
#[allow(clippy::too_many_arguments)]
pub fn score_pairs_packed(
    q: &Tensor,
    cu_q: &Tensor,
    max_lq: usize,
    d: &Tensor,
    cu_d: &Tensor,
    max_ld: usize,
    pair_q: &Tensor,
    pair_d: &Tensor,
) -> Result<Tensor> {
    let (qp, qm) = pad_packed(q, cu_q, max_lq)?;
    let (dp, dm) = pad_packed(d, cu_d, max_ld)?;
    maxsim_pairs(
        &qp.index_select(pair_q, 0)?,
        &dp.index_select(pair_d, 0)?,
        Some(&qm.index_select(pair_q, 0)?),
        Some(&dm.index_select(pair_d, 0)?),
    )
}

/// Naive [`crate::maxsim_from_hidden`]: project, (normalize), score.
pub fn maxsim_from_hidden(
    q: &Tensor,
    h_d: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    d_mask: Option<&Tensor>,
    normalize: bool,
) -> Result<Tensor> {
    let wd = work_dtype(q);
    let mut d = h_d.to_dtype(wd)?.broadcast_matmul(&w.to_dtype(wd)?.t()?)?;
    if let Some(b) = b {
        d = d.broadcast_add(&b.to_dtype(wd)?)?;
    }
    let d = prep(&d, normalize)?; // the documents only: q is already projected
    maxsim(&q.to_dtype(wd)?, &d, None, d_mask)
}

/// Naive [`crate::retrieve`]: score everything, sort on the host.
pub fn retrieve(
    q: &Tensor,
    d: &Tensor,
    q_mask: Option<&Tensor>,
    d_mask: Option<&Tensor>,
    top_k: usize,
) -> Result<(Tensor, Tensor)> {
    let s: Vec<Vec<f32>> = maxsim(q, d, q_mask, d_mask)?.to_vec2()?;
    let k = top_k.min(d.dim(0)?);
    let (mut vs, mut is) = (Vec::new(), Vec::new());
    for row in &s {
        let mut idx: Vec<usize> = (0..row.len()).collect();
        idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        for &j in &idx[..k] {
            vs.push(row[j]);
            is.push(j as u32);
        }
    }
    Ok((Tensor::from_vec(vs, (s.len(), k), q.device())?, Tensor::from_vec(is, (s.len(), k), q.device())?))
}
