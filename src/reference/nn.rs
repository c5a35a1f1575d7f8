//! Naive [`crate::nn`]: the encoder ops as composed candle ops in F64.

use candle_core::{DType, Result, Tensor, D};

/// Naive [`crate::nn::topk_rows`]: a full sort of each row on the host (NaN
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

/// Naive [`crate::nn::scatter_add_rows`]: candle's `index_add` in F32.
pub fn scatter_add_rows(src: &Tensor, idx: &Tensor, n_out: usize) -> Result<Tensor> {
    let src = src.to_dtype(DType::F32)?;
    Tensor::zeros((n_out, src.dim(1)?), DType::F32, src.device())?.index_add(idx, &src, 0)
}

/// Naive [`crate::nn::attention_softmax`]: scale, bias and softmax as candle ops
/// in F64, rounded to `scores`' dtype (differentiable by candle's autograd).
pub fn attention_softmax(scores: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    let x = (scores.to_dtype(DType::F64)? * scale)?.broadcast_add(&bias.to_dtype(DType::F64)?)?;
    let e = x.broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?.to_dtype(scores.dtype())
}

/// Naive [`crate::nn::attention`]: heads split out, [`attention_softmax`]
/// between two matmuls in F64, heads merged back, rounded to `q`'s dtype
/// (differentiable).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, heads: usize, scale: f64) -> Result<Tensor> {
    let (b, lq, hd) = q.dims3()?;
    let dh = hd / heads;
    let split = |t: &Tensor| -> Result<Tensor> {
        let l = t.dim(1)?;
        t.to_dtype(DType::F64)?.reshape((b, l, heads, dh))?.transpose(1, 2)?.contiguous()
    };
    let (qh, kh, vh) = (split(q)?, split(k)?, split(v)?);
    let p = attention_softmax(&qh.matmul(&kh.t()?.contiguous()?)?, bias, scale)?;
    p.matmul(&vh)?.transpose(1, 2)?.reshape((b, lq, hd))?.to_dtype(q.dtype())
}

/// Naive [`crate::nn::attention_varlen`]: each sequence of the packed rows
/// cut out, its heads split, `softmax(scale · q kᵀ + mask) v` in F64 (the
/// mask −∞ outside the window), the rows packed back, rounded to `q`'s
/// dtype (differentiable).
pub fn attention_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    heads: usize,
    scale: f64,
    window: Option<usize>,
) -> Result<Tensor> {
    let hd = q.dims2()?.1;
    let dh = hd / heads;
    let mut parts = Vec::new();
    for w in cu_seqlens.to_vec1::<u32>()?.windows(2) {
        let (s, l) = (w[0] as usize, (w[1] - w[0]) as usize);
        if l == 0 {
            continue;
        }
        let split = |x: &Tensor| x.narrow(0, s, l)?.to_dtype(DType::F64)?.reshape((l, heads, dh))?.transpose(0, 1);
        let (qh, kh, vh) = (split(q)?.contiguous()?, split(k)?.contiguous()?, split(v)?.contiguous()?);
        let mut x = (qh.matmul(&kh.t()?.contiguous()?)? * scale)?;
        if let Some(w) = window {
            let m: Vec<f64> =
                (0..l * l).map(|x| if (x / l).abs_diff(x % l) > w { f64::NEG_INFINITY } else { 0.0 }).collect();
            x = x.broadcast_add(&Tensor::from_vec(m, (1, l, l), q.device())?)?;
        }
        let e = x.broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        parts.push(p.matmul(&vh)?.transpose(0, 1)?.reshape((l, hd))?);
    }
    if parts.is_empty() {
        // Zeros that stay in the inputs' graphs, so that their gradients
        // exist. With no rows candle's ops pass an empty q through as it is,
        // which still carries q's gradient (k's and v's then have none).
        return (q.affine(0.0, 0.0)? + k.affine(0.0, 0.0)?)? + v.affine(0.0, 0.0)?;
    }
    Tensor::cat(&parts, 0)?.to_dtype(q.dtype())
}

/// Naive [`crate::nn::layer_norm`]: mean, biased variance and the affine map as
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

/// Naive [`crate::nn::rotary_qk`]: each head's halves of q and k rotated
/// by slices, products and a concatenation in F64, v passed through,
/// rounded to `qkv`'s dtype (differentiable).
pub fn rotary_qk(qkv: &Tensor, cos: &Tensor, sin: &Tensor, heads: usize) -> Result<Tensor> {
    let (t, w) = qkv.dims2()?;
    let half = w / (6 * heads);
    let x = qkv.to_dtype(DType::F64)?;
    let (c, s) = (cos.to_dtype(DType::F64)?, sin.to_dtype(DType::F64)?);
    let qk = x.narrow(1, 0, 4 * heads * half)?.reshape((t, 2 * heads, 2 * half))?;
    let (x1, x2) = (qk.narrow(2, 0, half)?, qk.narrow(2, half, half)?);
    let (c, s) = (c.unsqueeze(1)?, s.unsqueeze(1)?);
    let y1 = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
    let y2 = (x2.broadcast_mul(&c)? + x1.broadcast_mul(&s)?)?;
    let qk = Tensor::cat(&[&y1, &y2], 2)?.reshape((t, 4 * heads * half))?;
    Tensor::cat(&[&qk, &x.narrow(1, 4 * heads * half, 2 * heads * half)?], 1)?.to_dtype(qkv.dtype())
}

/// Naive [`crate::nn::geglu`]: column halves, `gelu_erf` and a product in
/// F64, rounded to `x`'s dtype (differentiable).
pub fn geglu(x: &Tensor) -> Result<Tensor> {
    let c = x.dim(1)? / 2;
    let x64 = x.to_dtype(DType::F64)?;
    (x64.narrow(1, 0, c)?.gelu_erf()? * x64.narrow(1, c, c)?)?.to_dtype(x.dtype())
}

/// Naive [`crate::nn::embedding`]: candle's `index_select` (differentiable).
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let mut shape = ids.dims().to_vec();
    shape.push(table.dim(1)?);
    table.index_select(&ids.flatten_all()?, 0)?.reshape(shape)
}

/// Naive [`crate::nn::linear`]: `x · wᵀ + b` by candle's matmul in F64,
/// rounded to `x`'s dtype (differentiable).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (x64, w64) = (x.to_dtype(DType::F64)?, w.to_dtype(DType::F64)?);
    let mut y = x64.broadcast_matmul(&w64.t()?)?;
    if let Some(b) = b {
        y = y.broadcast_add(&b.to_dtype(DType::F64)?)?;
    }
    y.to_dtype(x.dtype())
}

/// Naive [`crate::nn::linear_gelu`]: GELU (exact erf) of [`linear`] in F64,
/// rounded to `x`'s dtype (differentiable).
pub fn linear_gelu(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (x64, w64) = (x.to_dtype(DType::F64)?, w.to_dtype(DType::F64)?);
    x64.broadcast_matmul(&w64.t()?)?.broadcast_add(&b.to_dtype(DType::F64)?)?.gelu_erf()?.to_dtype(x.dtype())
}
