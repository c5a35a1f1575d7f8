//! `l2_normalize` (src/ops/normalize.rs: one op, closed-form backward)
//! against the same function written as plain candle ops in F64 on the
//! CPU, whose autograd gives the Jacobian.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use candle_maxsim as ms;

/// x / max(|x|, 1e-12) over the last axis, in F64, as plain candle ops.
fn naive(x: &Tensor) -> Result<Tensor> {
    let x = x.to_dtype(DType::F64)?;
    let n = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?;
    x.broadcast_div(&n)
}

/// Forward and gradient (of sum(w * y)) on `dev` against [`naive`] on the
/// CPU, for inputs of dtype `dt` and shape `[rows, 1, dim]`.
fn check(dev: &Device, rows: usize, dim: usize, dt: DType, tol: f64) -> Result<()> {
    let cpu = Device::Cpu;
    let x = randn(&[rows, 1, dim], dt, &cpu)?;
    // The upstream gradient reaches the op in `dt` (the backward of the cast
    // to F64 rounds it), so draw it in `dt`: both sides then see the same one.
    // Drawn in F64, its rounding (2^-11 for F16) is amplified where w is nearly
    // parallel to y, and the naive side never saw it.
    let w = randn(&[rows, 1, dim], dt, &cpu)?.to_dtype(DType::F64)?;
    let what = format!("l2_normalize {rows}x{dim} {dt:?} on {dev:?}");
    let xv = Var::from_tensor(&x.to_device(dev)?)?;
    let y = ms::l2_normalize(xv.as_tensor())?;
    assert_eq!(y.dtype(), dt);
    let g = y.to_dtype(DType::F64)?.mul(&w.to_device(dev)?)?.sum_all()?.backward()?;
    let gx = g.get(xv.as_tensor()).expect("grad of x").to_device(&cpu)?;
    assert_eq!(gx.dtype(), dt);
    let xn = Var::from_tensor(&x.to_dtype(DType::F64)?)?;
    let yn = naive(xn.as_tensor())?;
    let gn = yn.mul(&w)?.sum_all()?.backward()?.get(xn.as_tensor()).expect("grad").clone();
    assert_close(&format!("{what} forward"), &y, &yn, tol)?;
    // The gradient (w - y (y . w)) / |x| cancels where w is nearly parallel
    // to y: its rounding error is proportional to the terms, |w| + |y| |y . w|
    // over |x|, not to the difference (a small entry of the largest row's
    // gradient put F32's relative error at 1.02e-6 on random inputs).
    let yf = yn.detach();
    let norm = xn.as_tensor().sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?;
    let dot = yf.mul(&w)?.sum_keepdim(D::Minus1)?.abs()?;
    let terms = w.abs()?.add(&yf.abs()?.broadcast_mul(&dot)?)?.broadcast_div(&norm)?;
    assert_close_scaled(&format!("{what} grad"), &gx, &gn, &terms, tol)?;
    Ok(())
}

/// Every float dtype, dims within one and across several 32-lane passes of
/// the CUDA kernel, more rows than its grid has warps.
fn l2_normalize_matches_candle_ops(dev: &Device) -> Result<()> {
    for (dt, tol) in [(DType::F32, 1e-6), (DType::F64, 1e-12), (DType::F16, 2e-3), (DType::BF16, 1e-2)] {
        for (rows, dim) in [(37, 2), (37, 16), (37, 33), (37, 128), (5000, 128), (300, 768)] {
            check(dev, rows, dim, dt, tol)?;
        }
    }
    Ok(())
}

test_device!(
    l2_normalize_matches_candle_ops,
    l2_normalize_matches_candle_ops_cpu,
    l2_normalize_matches_candle_ops_cuda
);

/// Zero rows normalize to exactly 0 (the norm is floored at 1e-12); others to unit norm.
fn l2_normalize_maps_zero_rows_to_zero(dev: &Device) -> Result<()> {
    let x = Tensor::cat(&[randn(&[2, 8], DType::F32, dev)?, Tensor::zeros((1, 8), DType::F32, dev)?], 0)?;
    let y: Vec<Vec<f32>> = ms::l2_normalize(&x)?.to_vec2()?;
    assert!(y[2].iter().all(|&v| v == 0.0), "zero row: {:?}", y[2]);
    for row in &y[..2] {
        let norm: f32 = row.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-6, "unit norm: {norm}");
    }
    Ok(())
}

test_device!(
    l2_normalize_maps_zero_rows_to_zero,
    l2_normalize_maps_zero_rows_to_zero_cpu,
    l2_normalize_maps_zero_rows_to_zero_cuda
);
