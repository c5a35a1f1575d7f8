//! Entry points, one family per file; all of them lower to one custom op (`core::MaxSimOp`).

pub(crate) mod core;
pub mod dense;
pub mod hidden;
pub mod residual;
pub mod retrieve;
pub mod varlen;

use candle_core::{DType, Result, Tensor, D};

/// `x / max(‖x‖₂, 1e-12)` over the last dim, computed in F32 (F64 for F64)
/// and returned in `x`'s dtype. Plain candle ops, so autograd applies the
/// exact Jacobian of the normalization.
pub fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    let dt = x.dtype();
    let work = if dt == DType::F64 { DType::F64 } else { DType::F32 };
    let xf = x.to_dtype(work)?;
    let norm = xf.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?;
    xf.broadcast_div(&norm)?.to_dtype(dt)
}
