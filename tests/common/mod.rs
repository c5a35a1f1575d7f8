//! Helpers shared by the CPU and GPU test targets.
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor};

pub mod normalize;
pub mod plaid_index;

/// max|out − ref| / max|ref| over all elements (both cast to F64).
pub fn rel_err(out: &Tensor, reference: &Tensor) -> Result<f64> {
    Ok(max_abs_diff(out, reference)? / max_abs(reference)?)
}

/// max|out − ref| over all elements, in F64.
fn max_abs_diff(out: &Tensor, reference: &Tensor) -> Result<f64> {
    assert_eq!(out.dims(), reference.dims(), "shape mismatch");
    let o = out.to_dtype(DType::F64)?.flatten_all()?;
    let r = reference.to_dtype(DType::F64)?.flatten_all()?;
    let diff = (o - r)?.abs()?.max(0)?.to_scalar::<f64>()?;
    assert!(diff.is_finite(), "non-finite difference");
    Ok(diff)
}

/// max|x| in F64, floored so that an all-zero tensor divides safely.
fn max_abs(x: &Tensor) -> Result<f64> {
    Ok(x.to_dtype(DType::F64)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?.max(1e-30))
}

pub fn assert_close(what: &str, out: &Tensor, reference: &Tensor, tol: f64) -> Result<()> {
    if out.elem_count() == 0 {
        assert_eq!(out.dims(), reference.dims(), "{what}: shape");
        return Ok(());
    }
    let e = rel_err(out, reference)?;
    assert!(e < tol, "{what}: rel err {e:e} >= {tol:e}");
    Ok(())
}

/// Like [`assert_close`], but the error is divided by `scale`'s largest entry
/// instead of the reference's: for a sum of terms of both signs this is
/// Σ|term|, the quantity the sum's rounding error is proportional to (a score
/// near 0 by cancellation has no meaningful relative error of its own).
pub fn assert_close_scaled(what: &str, out: &Tensor, reference: &Tensor, scale: &Tensor, tol: f64) -> Result<()> {
    if out.elem_count() == 0 {
        assert_eq!(out.dims(), reference.dims(), "{what}: shape");
        return Ok(());
    }
    let s = max_abs(scale)?;
    let e = max_abs_diff(out, reference)? / s;
    assert!(e < tol, "{what}: err {e:e} (of Σ|term| = {s:e}) >= {tol:e}");
    Ok(())
}

/// Tolerance of the scores for each input dtype (issue 2).
pub fn tol(dt: DType) -> f64 {
    match dt {
        DType::F16 => 5e-3,
        DType::BF16 => 2e-2,
        DType::F32 => 1e-5,
        _ => 1e-9,
    }
}

pub fn randn(shape: &[usize], dt: DType, dev: &Device) -> Result<Tensor> {
    Tensor::randn(0f32, 1f32, shape, dev)?.to_dtype(dt)
}

/// U8 mask with about `drop` of the entries 0.
pub fn rand_mask(shape: &[usize], drop: f32, dev: &Device) -> Result<Tensor> {
    Tensor::rand(0f32, 1f32, shape, dev)?.ge(drop)
}

/// `[n, l, dim]` with a non-contiguous layout (a transposed view).
pub fn randn_strided(n: usize, l: usize, dim: usize, dt: DType, dev: &Device) -> Result<Tensor> {
    let t = randn(&[n, dim, l], dt, dev)?.transpose(1, 2)?;
    assert!(!t.is_contiguous());
    Ok(t)
}

/// Offsets (U32 `[n+1]`) of random lengths in `0..=max`, some empty.
pub fn rand_offsets(n: usize, max: usize, seed: u64) -> (Vec<u32>, usize) {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut cu = vec![0u32];
    let mut longest = 0;
    for k in 0..n {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let len = if k % 5 == 3 { 0 } else { ((x >> 33) as usize) % (max + 1) };
        longest = longest.max(len);
        cu.push(cu.last().unwrap() + len as u32);
    }
    (cu, longest)
}

/// Two backward passes through one graph give bitwise the same gradients
/// (the first consumes the saved argmax, the second recomputes it).
pub fn second_backward_matches(dev: &Device, dt: DType) -> Result<()> {
    use candle_core::Var;
    let q = Var::from_tensor(&randn(&[3, 8, 64], dt, dev)?)?;
    let d = Var::from_tensor(&randn(&[4, 20, 64], dt, dev)?)?;
    // LowMem: bitwise deterministic (Unified's atomics may reorder the sums).
    let opts = candle_maxsim::MaxSimOptions { backward: candle_maxsim::Backward::LowMem, ..Default::default() };
    let loss = candle_maxsim::maxsim_with(q.as_tensor(), d.as_tensor(), None, None, &opts)?.sum_all()?;
    let (g1, g2) = (loss.backward()?, loss.backward()?);
    for v in [&q, &d] {
        let bits = |g: &candle_core::backprop::GradStore| -> Result<Vec<f32>> {
            g.get(v.as_tensor()).expect("gradient").to_dtype(DType::F32)?.flatten_all()?.to_vec1()
        };
        let (a, b) = (bits(&g1)?, bits(&g2)?);
        assert!(a.iter().any(|&x| x != 0.0), "{dt:?}: all-zero gradient");
        assert!(a == b, "{dt:?}: the second backward differs");
    }
    Ok(())
}

/// `maxsim_value_and_grads` equals candle autograd through `maxsim_with`
/// (same mode, LowMem: the same kernels and order, so equal values), in the
/// dense and KD layouts with masks, for a random loss gradient; its `dloss`
/// shape is checked.
pub fn value_and_grads_match_autograd(dev: &Device, dt: DType) -> Result<()> {
    use candle_core::Var;
    use candle_maxsim::{Backward, MaxSimOptions};
    let opts = MaxSimOptions { backward: Backward::LowMem, ..Default::default() };
    for kd in [false, true] {
        let q = randn(&[3, 8, 64], dt, dev)?;
        let d = if kd { randn(&[3, 2, 20, 64], dt, dev)? } else { randn(&[4, 20, 64], dt, dev)? };
        let qm = rand_mask(&[3, 8], 0.2, dev)?;
        let dm = rand_mask(&d.dims()[..d.rank() - 1], 0.2, dev)?;
        let gs = Tensor::randn(0f32, 1f32, if kd { (3, 2) } else { (3, 4) }, dev)?;
        let (s, gq, gd) = candle_maxsim::maxsim_value_and_grads(&q, &d, Some(&qm), Some(&dm), Backward::LowMem, |s| {
            assert_eq!(s.dims(), gs.dims());
            Ok(gs.clone())
        })?;
        let (qv, dv) = (Var::from_tensor(&q)?, Var::from_tensor(&d)?);
        let s2 = candle_maxsim::maxsim_with(qv.as_tensor(), dv.as_tensor(), Some(&qm), Some(&dm), &opts)?;
        let grads = (&s2 * &gs)?.sum_all()?.backward()?;
        let same = |a: &Tensor, b: &Tensor| -> Result<f64> {
            (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()
        };
        assert_eq!(same(&s, &s2)?, 0.0, "{dt:?} kd={kd}: scores");
        for (what, g, v) in [("grad_q", &gq, &qv), ("grad_d", &gd, &dv)] {
            let want = grads.get(v.as_tensor()).expect("gradient");
            assert_eq!(g.dims(), want.dims(), "{what}");
            assert!(want.abs()?.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()? > 0.0, "{what}: all zero");
            assert_eq!(same(g, want)?, 0.0, "{dt:?} kd={kd}: {what} differs from autograd");
        }
    }
    let (q, d) = (randn(&[2, 4, 16], dt, dev)?, randn(&[3, 5, 16], dt, dev)?);
    let e = candle_maxsim::maxsim_value_and_grads(&q, &d, None, None, Backward::Auto, |s| s.sum_all())
        .unwrap_err()
        .to_string();
    assert!(e.contains("dloss"), "{e}");
    Ok(())
}
