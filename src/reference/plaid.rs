//! Naive [`crate::plaid`]: every document scored, candidates marked on the host.

use super::{ones_mask, pad_packed, reduce};
use candle_core::{DType, Result, Tensor};

/// Naive [`crate::plaid::plaid_approx_score`].
pub fn plaid_approx_score(qcs: &Tensor, codes: &Tensor, doc_lens: &Tensor) -> Result<Tensor> {
    let (b, ld) = codes.dims2()?;
    let lq = qcs.dim(1)?;
    let lens: Vec<u32> = doc_lens.to_vec1()?;
    let mask: Vec<u8> = (0..b * ld).map(|t| ((t % ld) < lens[t / ld] as usize) as u8).collect();
    let mask = Tensor::from_vec(mask, (b, ld), qcs.device())?;
    let safe_codes = mask.to_dtype(codes.dtype())?.mul(codes)?.flatten_all()?.to_dtype(DType::U32)?;
    // [B, Ld, Lq] -> [B, Lq, Ld] so that reduce() takes the max over tokens.
    let sim = qcs.index_select(&safe_codes, 0)?.reshape((b, ld, lq))?.transpose(1, 2)?;
    reduce(&sim, &ones_mask(&[b, lq], qcs.device())?, &mask.unsqueeze(1)?)
}

/// Naive [`crate::plaid::plaid_candidates`]: every inverted list of every probed
/// centroid, marked on the host.
pub fn plaid_candidates(probes: &Tensor, ivf: &Tensor, ivf_offsets: &Tensor, num_documents: usize) -> Result<Tensor> {
    let probes: Vec<Vec<u32>> = probes.to_vec2()?;
    let (ivf, off): (Vec<u32>, Vec<u32>) = (ivf.to_vec1()?, ivf_offsets.to_vec1()?);
    let words = num_documents.div_ceil(32);
    let mut bits = vec![0u32; probes.len() * words];
    for (i, row) in probes.iter().enumerate() {
        for &c in row.iter().filter(|&&c| c != crate::plaid::NO_CENTROID) {
            for &d in &ivf[off[c as usize] as usize..off[c as usize + 1] as usize] {
                bits[i * words + d as usize / 32] |= 1 << (d % 32);
            }
        }
    }
    Tensor::from_vec(bits, (probes.len(), words), ivf_offsets.device())
}

/// Naive [`crate::plaid::plaid_approx_candidates`]: every document's approximate
/// score against every query (gathered rows of `qcs`, masked max, a query
/// token whose max is -inf adds 0), then -inf where a document is not a
/// candidate or is masked out.
pub fn plaid_approx_candidates(
    qcs: &Tensor,
    lq: usize,
    codes: &Tensor,
    cu_d: &Tensor,
    candidates: &Tensor,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let nq = qcs.dim(1)? / lq;
    let cu: Vec<u32> = cu_d.to_vec1()?;
    let nd = cu.len() - 1;
    let max_ld = cu.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0).max(1);
    let bits: Vec<Vec<u32>> = candidates.to_vec2()?;
    let mask: Option<Vec<Vec<u32>>> = mask.map(|m| m.to_vec2()).transpose()?;
    let codes = codes.to_dtype(DType::U32)?;
    let mut out = Vec::with_capacity(nq * nd);
    for i in 0..nq {
        // [T, lq] this query's score of every token, padded to [Nd, max_ld, lq].
        let rows = qcs.narrow(1, i * lq, lq)?.contiguous()?.index_select(&codes, 0)?;
        let (padded, dm) = pad_packed(&rows, cu_d, max_ld)?;
        let neg = Tensor::full(f32::NEG_INFINITY, padded.shape(), qcs.device())?;
        let dm3 = dm.unsqueeze(2)?.broadcast_as(padded.shape())?;
        let mx = dm3.where_cond(&padded, &neg)?.max(1)?; // [Nd, lq]
        let mx = mx.ge(f32::MIN)?.where_cond(&mx, &mx.zeros_like()?)?; // -inf adds 0
        let s: Vec<f32> = mx.sum(1)?.to_vec1()?;
        for (j, &v) in s.iter().enumerate() {
            let mut word = bits[i][j / 32];
            if let Some(m) = &mask {
                word &= m[if m.len() == 1 { 0 } else { i }][j / 32];
            }
            let empty = cu[j] == cu[j + 1];
            out.push(if (word >> (j % 32)) & 1 == 0 {
                f32::NEG_INFINITY
            } else if empty {
                0.0
            } else {
                v
            });
        }
    }
    Tensor::from_vec(out, (nq, nd), qcs.device())
}
