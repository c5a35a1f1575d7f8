//! Row scatter-add (src/ops/rows.rs) against `reference`.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_maxsim::{self as ms, reference as r};

/// Random rows and destinations (many rows per destination, some
/// destinations empty), every dtype; an out-of-range index is an error.
fn scatter_add_rows_match_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for (rows, cols, n_out) in [(50, 7, 9), (1000, 128, 37), (3, 1, 1)] {
        for dt in DTYPES {
            let src = randn(&[rows, cols], dt, &cpu)?;
            let idx = (Tensor::rand(0f32, 1., rows, &cpu)? * (n_out as f64 - 0.01))?.floor()?.to_dtype(DType::U32)?;
            let want = r::nn::scatter_add_rows(&src, &idx, n_out)?;
            let out = ms::nn::scatter_add_rows(&src.to_device(dev)?, &idx.to_device(dev)?, n_out)?;
            assert_close(&format!("scatter {rows}x{cols}->{n_out} {dt:?}"), &out, &want, 1e-5)?;
        }
    }
    let src = randn(&[4, 3], DType::F32, dev)?;
    expect_err(ms::nn::scatter_add_rows(&src, &Tensor::new(&[0u32, 1, 9, 2], dev)?, 5), "idx");
    Ok(())
}

test_device!(
    scatter_add_rows_match_reference,
    scatter_add_rows_match_reference_cpu,
    scatter_add_rows_match_reference_cuda
);

/// `add_bias` and `add_bias_gelu`, forward and both gradients, against
/// candle's broadcast add (and `gelu_erf`) in F64 (the bias gradient is a
/// column sum over more rows than the CUDA grid).
fn add_bias_matches_broadcast_add(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for gelu in [false, true] {
        for (dt, tol) in [(DType::F32, 1e-6), (DType::F16, 2e-3), (DType::BF16, 1e-2)] {
            for (r, c) in [(3, 5), (700, 37), (20_000, 300)] {
                let x = randn(&[r, c], dt, &cpu)?;
                let b = randn(&[c], DType::F32, &cpu)?;
                let up = randn(&[r, c], dt, &cpu)?.to_dtype(DType::F64)?;
                let (xv, bv) = (Var::from_tensor(&x.to_device(dev)?)?, Var::from_tensor(&b.to_device(dev)?)?);
                let y = if gelu {
                    ms::nn::add_bias_gelu(xv.as_tensor(), bv.as_tensor())?
                } else {
                    ms::nn::add_bias(xv.as_tensor(), bv.as_tensor())?
                };
                assert_eq!(y.dtype(), dt);
                let g = y.to_dtype(DType::F64)?.mul(&up.to_device(dev)?)?.sum_all()?.backward()?;
                let (xn, bn) =
                    (Var::from_tensor(&x.to_dtype(DType::F64)?)?, Var::from_tensor(&b.to_dtype(DType::F64)?)?);
                let mut yn = xn.as_tensor().broadcast_add(bn.as_tensor())?;
                if gelu {
                    yn = yn.gelu_erf()?;
                }
                let gn = yn.mul(&up)?.sum_all()?.backward()?;
                let what = format!("add_bias (gelu {gelu}) {r}x{c} {dt:?} on {dev:?}");
                assert_close(&format!("{what} forward"), &y, &yn, tol)?;
                let grad =
                    |g: &candle_core::backprop::GradStore, v: &Var| g.get(v.as_tensor()).expect("grad").to_device(&cpu);
                // The GELU's dx is rounded once to x's dtype; the identity's is exact.
                let dx_tol = if gelu { tol } else { 1e-12 };
                assert_close(&format!("{what} dx"), &grad(&g, &xv)?, &grad(&gn, &xn)?, dx_tol)?;
                if gelu {
                    // db sums r terms of both signs: its error is judged
                    // against the columns' largest Σ|up · GELU'(x + b)|.
                    let z = Var::from_tensor(&xn.as_tensor().broadcast_add(bn.as_tensor())?)?;
                    let slope = z.as_tensor().gelu_erf()?.sum_all()?.backward()?;
                    let terms = up.mul(slope.get(z.as_tensor()).expect("grad"))?.abs()?.sum(0)?;
                    assert_close_scaled(&format!("{what} db"), &grad(&g, &bv)?, &grad(&gn, &bn)?, &terms, tol)?;
                } else {
                    assert_close(&format!("{what} db"), &grad(&g, &bv)?, &grad(&gn, &bn)?, 1e-5)?;
                }
            }
        }
    }
    let x = randn(&[4, 3], DType::F32, dev)?;
    expect_err(ms::nn::add_bias_gelu(&x, &randn(&[4], DType::F32, dev)?), "b");
    expect_err(ms::nn::add_bias_gelu(&x.flatten_all()?, &randn(&[3], DType::F32, dev)?), "x");
    Ok(())
}

test_device!(add_bias_matches_broadcast_add, add_bias_matches_broadcast_add_cpu, add_bias_matches_broadcast_add_cuda);

/// `geglu`, forward and gradient, against the composed F64 reference on
/// fresh random rows (more rows than the CUDA grid); bad shapes name `x`.
/// Errors are relative to the natural scale of each output (|a·b| for y,
/// |g|·|b|·max(1, |a|) for dx, with the inputs' largest entries): a
/// one-element case whose output happens to be near 0 would otherwise be
/// judged against nothing.
fn geglu_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for (dt, tol) in [(DType::F32, 1e-6), (DType::F16, 2e-3), (DType::BF16, 1e-2)] {
        for (r, c) in [(1, 1), (70, 37), (20_000, 96)] {
            let x = (randn(&[r, 2 * c], dt, &cpu)? * 2.0)?.to_dtype(dt)?;
            let up = randn(&[r, c], dt, &cpu)?.to_dtype(DType::F64)?;
            let xv = Var::from_tensor(&x.to_device(dev)?)?;
            let y = ms::nn::geglu(xv.as_tensor())?;
            assert_eq!((y.dtype(), y.dims()), (dt, &[r, c][..]));
            let g = y.to_dtype(DType::F64)?.mul(&up.to_device(dev)?)?.sum_all()?.backward()?;
            let xn = Var::from_tensor(&x.to_dtype(DType::F64)?)?;
            let yn = ms::reference::nn::geglu(xn.as_tensor())?;
            let gn = yn.mul(&up)?.sum_all()?.backward()?;
            let what = format!("geglu {r}x{c} {dt:?} on {dev:?}");
            let xm = max_abs(&x)?;
            let check = |part: &str, got: &Tensor, want: &Tensor, scale: f64| -> Result<()> {
                let e = max_abs_diff(got, want)? / max_abs(want)?.max(scale);
                assert!(e < tol, "{what} {part}: error {e:e} >= {tol:e}");
                Ok(())
            };
            check("forward", &y, &yn, xm * xm)?;
            let dx = g.get(xv.as_tensor()).expect("grad").to_device(&cpu)?;
            check("dx", &dx, gn.get(xn.as_tensor()).expect("grad"), max_abs(&up)? * xm * xm.max(1.0))?;
        }
    }
    expect_err(ms::nn::geglu(&randn(&[4, 3], DType::F32, dev)?), "x");
    expect_err(ms::nn::geglu(&randn(&[4], DType::F32, dev)?), "x");
    Ok(())
}

test_device!(geglu_matches_reference, geglu_matches_reference_cpu, geglu_matches_reference_cuda);
