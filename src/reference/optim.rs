//! Naive [`crate::optim`].

use candle_core::{DType, Result, Tensor};

/// Naive [`crate::optim::adamw_update`] as torch writes it, in F64, not in place:
/// the clip factor from `sum_sq` (the squared global gradient norm), then
/// the new `(p, m, v)`.
pub fn adamw_update(
    p: &Tensor,
    m: &Tensor,
    v: &Tensor,
    g: &Tensor,
    sum_sq: f64,
    s: &crate::optim::AdamWStep,
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
