//! Helpers shared by the CPU and GPU test targets: the workspace's generic
//! ones (`candle-maxsim-testing`) and checks of this crate's ops.
#![allow(dead_code, unused_imports)]

use candle_core::{DType, Device, Result, Tensor};
pub use candle_maxsim_testing::*;

pub mod normalize;

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
