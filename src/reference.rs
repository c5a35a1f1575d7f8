//! Naive, materializing implementations of every entry point in plain candle
//! ops: the ground truth of the tests and the baseline of the benchmarks.
//!
//! They build the full similarity tensor (`[Nq, Nd, Lq, Ld]` for the
//! cross product) in F32 (F64 for F64 inputs), mask it with -inf, take the
//! max over document tokens, zero empty documents and masked query tokens,
//! and sum. Autograd through them is candle's own.

use crate::{BitOrder, MaxSimOptions, ResidualCodec};
use candle_core::{bail, DType, Device, Result, Tensor, D};

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

/// Decompresses packed residual tokens to `[T, dim]` F32 with candle ops
/// (index_select of centroids and bucket weights). The bit unpacking is
/// written out independently of the fast decoder, straight from the spec.
pub fn decompress(codes: &Tensor, residuals: &Tensor, codec: &ResidualCodec) -> Result<Tensor> {
    let dim = codec.centroids.dim(1)?;
    let nbits = codec.nbits;
    let t = codes.elem_count();
    let bytes: Vec<u8> = residuals.flatten_all()?.to_vec1()?;
    let w = dim * nbits / 8;
    let mut buckets = Vec::with_capacity(t * dim);
    for tok in 0..t {
        for k in 0..dim {
            // Bit b (0 = LSB) of the bucket index of feature k.
            let mut v = 0u32;
            for b in 0..nbits {
                let bit_pos = k * nbits + b; // position in the token's bit stream
                let bit = match codec.bit_order {
                    // LSB-first within each byte.
                    BitOrder::Lsb => (bytes[tok * w + bit_pos / 8] >> (bit_pos % 8)) & 1,
                    // np.packbits (MSB-first) of the LSB-first bits of each index.
                    BitOrder::ColBert => (bytes[tok * w + bit_pos / 8] >> (7 - bit_pos % 8)) & 1,
                };
                v |= (bit as u32) << b;
            }
            buckets.push(v);
        }
    }
    let buckets = Tensor::from_vec(buckets, t * dim, codes.device())?;
    let codes = codes.flatten_all()?.to_dtype(DType::U32)?;
    let cents = codec.centroids.to_dtype(DType::F32)?.index_select(&codes, 0)?;
    let res = codec.bucket_weights.to_dtype(DType::F32)?.index_select(&buckets, 0)?.reshape((t, dim))?;
    cents + res
}

/// Naive [`crate::maxsim_residual`].
pub fn maxsim_residual(
    q: &Tensor,
    codes: &Tensor,
    residuals: &Tensor,
    doc_lens: &Tensor,
    codec: &ResidualCodec,
    normalize: bool,
) -> Result<Tensor> {
    let (nd, ld) = codes.dims2()?;
    let dim = q.dim(2)?;
    let lens: Vec<u32> = doc_lens.to_vec1()?;
    // Padding tokens may hold any code: decompress only with in-range codes.
    let mask: Vec<u8> = (0..nd * ld).map(|t| ((t % ld) < lens[t / ld] as usize) as u8).collect();
    let mask = Tensor::from_vec(mask, (nd, ld), q.device())?;
    let safe_codes = mask.to_dtype(codes.dtype())?.mul(codes)?;
    let d = decompress(&safe_codes, residuals, codec)?.reshape((nd, ld, dim))?;
    let opts = MaxSimOptions { normalize, ..Default::default() };
    maxsim_with(&q.to_dtype(work_dtype(q))?, &d.to_dtype(work_dtype(q))?, None, Some(&mask), &opts)
}

/// Naive [`crate::maxsim_residual_varlen`].
pub fn maxsim_residual_varlen(
    q: &Tensor,
    codes: &Tensor,
    residuals: &Tensor,
    cu_d: &Tensor,
    max_ld: usize,
    codec: &ResidualCodec,
    normalize: bool,
) -> Result<Tensor> {
    let d = decompress(codes, residuals, codec)?.to_dtype(work_dtype(q))?;
    let (dp, dm) = pad_packed(&d, cu_d, max_ld)?;
    let opts = MaxSimOptions { normalize, ..Default::default() };
    maxsim_with(&q.to_dtype(work_dtype(q))?, &dp, None, Some(&dm), &opts)
}

/// Naive [`crate::plaid_approx_score`].
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

/// Naive [`crate::topk_rows`]: a full sort of each row on the host (NaN
/// lowest, then larger value first, then the lower column).
pub fn topk_rows(x: &Tensor, k: usize) -> Result<(Tensor, Tensor)> {
    let rows: Vec<Vec<f32>> = x.to_vec2()?;
    let k = k.min(x.dim(1)?);
    let (mut vs, mut is) = (Vec::new(), Vec::new());
    for row in &rows {
        let mut idx: Vec<usize> = (0..row.len()).collect();
        idx.sort_by(|&a, &b| {
            let (x, y) = (row[a], row[b]);
            let by_value = match (x.is_nan(), y.is_nan()) {
                (true, true) => std::cmp::Ordering::Equal,
                (true, false) => std::cmp::Ordering::Greater,
                (false, true) => std::cmp::Ordering::Less,
                _ => y.total_cmp(&x),
            };
            by_value.then(a.cmp(&b))
        });
        for &j in &idx[..k] {
            vs.push(row[j]);
            is.push(j as u32);
        }
    }
    let r = rows.len();
    Ok((Tensor::from_vec(vs, (r, k), x.device())?, Tensor::from_vec(is, (r, k), x.device())?))
}

/// Naive [`crate::plaid_candidates`]: every inverted list of every probed
/// centroid, marked on the host.
pub fn plaid_candidates(probes: &Tensor, ivf: &Tensor, ivf_offsets: &Tensor, num_documents: usize) -> Result<Tensor> {
    let probes: Vec<Vec<u32>> = probes.to_vec2()?;
    let (ivf, off): (Vec<u32>, Vec<u32>) = (ivf.to_vec1()?, ivf_offsets.to_vec1()?);
    let words = num_documents.div_ceil(32);
    let mut bits = vec![0u32; probes.len() * words];
    for (i, row) in probes.iter().enumerate() {
        for &c in row.iter().filter(|&&c| c != crate::NO_CENTROID) {
            for &d in &ivf[off[c as usize] as usize..off[c as usize + 1] as usize] {
                bits[i * words + d as usize / 32] |= 1 << (d % 32);
            }
        }
    }
    Tensor::from_vec(bits, (probes.len(), words), ivf_offsets.device())
}

/// Naive [`crate::plaid_approx_candidates`]: every document's approximate
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

/// Naive [`crate::maxsim_residual_pairs`]: every query against every
/// document by [`maxsim_residual_varlen`], then the pairs picked on the host
/// (-inf for [`crate::NO_DOCUMENT`]).
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
    let all: Vec<Vec<f32>> = maxsim_residual_varlen(q, codes, residuals, cu_d, max_ld, codec, normalize)?.to_vec2()?;
    let (pq, pd): (Vec<u32>, Vec<u32>) = (pair_q.to_vec1()?, pair_d.to_vec1()?);
    let out: Vec<f32> = pq
        .iter()
        .zip(&pd)
        .map(|(&i, &j)| if j == crate::NO_DOCUMENT { f32::NEG_INFINITY } else { all[i as usize][j as usize] })
        .collect();
    Tensor::from_vec(out, pq.len(), q.device())
}

/// Naive [`crate::scatter_add_rows`]: candle's `index_add` in F32.
pub fn scatter_add_rows(src: &Tensor, idx: &Tensor, n_out: usize) -> Result<Tensor> {
    let src = src.to_dtype(DType::F32)?;
    Tensor::zeros((n_out, src.dim(1)?), DType::F32, src.device())?.index_add(idx, &src, 0)
}

/// Naive [`crate::nearest_centroids`]: the full `[T, C]` product in F32 (F64
/// for F64), then the first maximum of each row on the host.
pub fn nearest_centroids(x: &Tensor, centroids: &Tensor) -> Result<Tensor> {
    let wd = work_dtype(x);
    let s: Vec<Vec<f64>> = x.to_dtype(wd)?.matmul(&centroids.to_dtype(wd)?.t()?)?.to_dtype(DType::F64)?.to_vec2()?;
    let best: Vec<u32> = s
        .iter()
        .map(|row| {
            row.iter().enumerate().fold((0, f64::NEG_INFINITY), |b, (j, &v)| if v > b.1 { (j, v) } else { b }).0 as u32
        })
        .collect();
    let n = best.len();
    Tensor::from_vec(best, n, x.device())
}

/// Naive [`crate::attention_softmax`]: scale, bias and softmax as candle ops
/// in F64, rounded to `scores`' dtype (differentiable by candle's autograd).
pub fn attention_softmax(scores: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    let x = (scores.to_dtype(DType::F64)? * scale)?.broadcast_add(&bias.to_dtype(DType::F64)?)?;
    let e = x.broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?.to_dtype(scores.dtype())
}

/// Naive [`crate::layer_norm`]: mean, biased variance and the affine map as
/// candle ops in F64, rounded to `x`'s dtype (differentiable).
pub fn layer_norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    let x64 = x.to_dtype(DType::F64)?;
    let xc = x64.broadcast_sub(&x64.mean_keepdim(D::Minus1)?)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let mut y = xc.broadcast_div(&(var + eps)?.sqrt()?)?.broadcast_mul(&w.to_dtype(DType::F64)?)?;
    if let Some(b) = b {
        y = y.broadcast_add(&b.to_dtype(DType::F64)?)?;
    }
    y.to_dtype(x.dtype())
}

/// Naive [`crate::embedding`]: candle's `index_select` (differentiable).
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let mut shape = ids.dims().to_vec();
    shape.push(table.dim(1)?);
    table.index_select(&ids.flatten_all()?, 0)?.reshape(shape)
}

/// Naive [`crate::adamw_update`] as torch writes it, in F64, not in place:
/// the clip factor from `sum_sq` (the squared global gradient norm), then
/// the new `(p, m, v)`.
pub fn adamw_update(
    p: &Tensor,
    m: &Tensor,
    v: &Tensor,
    g: &Tensor,
    sum_sq: f64,
    s: &crate::AdamWStep,
) -> Result<(Tensor, Tensor, Tensor)> {
    let f = |t: &Tensor| t.to_dtype(DType::F64);
    let clip = if s.max_grad_norm > 0.0 { (s.max_grad_norm / (sum_sq.sqrt() + 1e-6)).min(1.0) } else { 1.0 };
    let g = (f(g)? * clip)?;
    let m = ((f(m)? * s.beta1)? + (&g * (1.0 - s.beta1))?)?;
    let v = ((f(v)? * s.beta2)? + (g.sqr()? * (1.0 - s.beta2))?)?;
    let t = s.t as i32;
    let (c1, c2) = (1.0 - s.beta1.powi(t), 1.0 - s.beta2.powi(t));
    let denom = ((&v / c2)?.sqrt()? + s.eps)?;
    let p = ((f(p)? * (1.0 - s.lr * s.weight_decay))? - ((&m / c1)? / denom)?.affine(s.lr, 0.0)?)?;
    Ok((p, m, v))
}

/// 8-bit embeddings as F64, `scale · value` exactly (I8 bytes read as I8;
/// e4m3 bytes decoded from their sign, exponent and mantissa fields).
pub fn dequantize_exact(x: &crate::Quantized) -> Result<Tensor> {
    let bytes = x.values().flatten_all()?.to_vec1::<u8>()?;
    let v: Vec<f64> = match x.format() {
        crate::QuantFormat::I8 => bytes.into_iter().map(|b| b as i8 as f64).collect(),
        crate::QuantFormat::E4m3 => bytes.into_iter().map(e4m3_value).collect(),
    };
    let v = Tensor::from_vec(v, x.values().shape(), x.values().device())?;
    v.broadcast_mul(&x.scales().to_dtype(DType::F64)?.unsqueeze(D::Minus1)?)
}

/// An e4m3 byte's value: (−1)^s · 2^(e−7) · (1 + m/8), or m · 2^−9 for e = 0;
/// 0x7F / 0xFF are NaN.
fn e4m3_value(b: u8) -> f64 {
    let (s, e, m) = (if b & 0x80 != 0 { -1.0 } else { 1.0 }, ((b >> 3) & 0xF) as i32, (b & 7) as f64);
    if b & 0x7F == 0x7F {
        f64::NAN
    } else if e == 0 {
        s * m / 512.0
    } else {
        s * (8.0 + m) / 8.0 * 2f64.powi(e - 7)
    }
}

/// MaxSim of 8-bit embeddings: [`maxsim`] of [`dequantize_exact`]'s rows.
pub fn maxsim_quantized(
    q: &crate::Quantized,
    d: &crate::Quantized,
    q_mask: Option<&Tensor>,
    d_mask: Option<&Tensor>,
) -> Result<Tensor> {
    maxsim(&dequantize_exact(q)?, &dequantize_exact(d)?, q_mask, d_mask)
}
