//! Helpers of the `ops` test target: the workspace's generic ones
//! (`candle-maxsim-testing`, re-exported), this crate's tolerances by device
//! and dtype, gradients on a device and through `reference`, and checks of
//! this crate's ops that several modules share.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use candle_maxsim::{self as ms, Backward, MaxSimOptions};
pub use candle_maxsim_testing::*;

/// The embedding dtypes every op takes on every device.
pub const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Tolerances of the CUDA forward by dtype (tensor-core products, F32 sums).
pub fn gpu_tol(dt: DType) -> f64 {
    match dt {
        DType::F16 => 5e-3,
        DType::BF16 => 2e-2,
        _ => 1e-3,
    }
}

/// Relative tolerance of scores computed on `dev` against `reference`:
/// [`gpu_tol`] on CUDA, the CPU op's [`tol`] on the CPU.
pub fn score_tol(dev: &Device, dt: DType) -> f64 {
    if dev.is_cuda() {
        gpu_tol(dt)
    } else {
        tol(dt)
    }
}

/// Relative tolerance of gradients in `dt` against an F64 reference.
pub fn grad_tol(dt: DType) -> f64 {
    match dt {
        DType::F16 => 1e-2,
        DType::BF16 => 2e-2,
        _ => 1e-4,
    }
}

/// Whether a check also runs its CUDA-specific cases (large shapes, every
/// kernel variant and tile, the benchmark shapes): on CUDA only. An
/// unoptimized CPU build takes minutes over them, and the CPU op has no
/// kernel variants for them to reach.
pub fn gpu_cases(dev: &Device) -> bool {
    dev.is_cuda()
}

/// An optional tensor (a mask) moved to `dev`.
pub fn opt_to(dev: &Device, t: Option<&Tensor>) -> Result<Option<Tensor>> {
    t.map(|t| t.to_device(dev)).transpose()
}

/// Random multiples of 0.5 (|x| ≲ 4): every similarity of such inputs is a
/// multiple of 0.25 computed exactly in F32 in any order, so every device
/// and the reference pick the same winners, exact ties included.
pub fn grid(shape: &[usize], dt: DType) -> Result<Tensor> {
    ((Tensor::randn(0f32, 1., shape, &Device::Cpu)? * 2.0)?.round()? * 0.5)?.to_dtype(dt)
}

/// A score function of (q, d).
pub type ScoreFn<'a> = dyn Fn(&Tensor, &Tensor) -> Result<Tensor> + 'a;

/// (grad_q, grad_d) of Σ w ⊙ f(q, d) by candle autograd, with q, d and w
/// moved to `dev` (f runs there); returned on the CPU.
pub fn grads_on(dev: &Device, q: &Tensor, d: &Tensor, w: &Tensor, f: &ScoreFn) -> Result<(Tensor, Tensor)> {
    let (qv, dv) = (Var::from_tensor(&q.to_device(dev)?)?, Var::from_tensor(&d.to_device(dev)?)?);
    let s = f(qv.as_tensor(), dv.as_tensor())?;
    let g = s.to_dtype(DType::F32)?.broadcast_mul(&w.to_device(dev)?)?.sum_all()?.backward()?;
    let get = |v: &Var| g.get(v.as_tensor()).expect("a gradient").to_device(&Device::Cpu);
    Ok((get(&qv)?, get(&dv)?))
}

/// How the reference settles exact ties between document tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ties {
    /// Random inputs: exact ties do not occur.
    Absent,
    /// [`grid`] inputs: exact ties occur. Candle's max backward gives every
    /// tied token the gradient; the op gives it to the lowest index. The
    /// reference then sees one more feature, 1 for query tokens and
    /// −r·2⁻¹⁹ for document row r (rows in order, r < 2¹⁷): below the
    /// similarities' 0.25 spacing, it orders exactly the tied tokens, lowest
    /// index first, and adds nothing to the gradients of the real features.
    Exact,
}

/// (grad_q, grad_d) of Σ w ⊙ fr(q, d) by candle autograd through
/// `reference` (`fr`) on the CPU in F64, ties settled as `ties` says.
pub fn reference_grads(q: &Tensor, d: &Tensor, w: &Tensor, ties: Ties, fr: &ScoreFn) -> Result<(Tensor, Tensor)> {
    let cpu = Device::Cpu;
    let f64_on_cpu = |t: &Tensor| t.to_device(&cpu)?.to_dtype(DType::F64);
    let (qv, dv) = (Var::from_tensor(&f64_on_cpu(q)?)?, Var::from_tensor(&f64_on_cpu(d)?)?);
    let (qi, di) = match ties {
        Ties::Absent => (qv.as_tensor().clone(), dv.as_tensor().clone()),
        Ties::Exact => {
            let (q, d) = (qv.as_tensor(), dv.as_tensor());
            let lead = |t: &Tensor| -> Vec<usize> { t.dims()[..t.rank() - 1].iter().copied().chain([1]).collect() };
            let rows = d.elem_count() / d.dim(D::Minus1)?;
            assert!(rows < 1 << 17, "{rows} document rows: the tie-breaking feature would reach the 0.25 spacing");
            let one = Tensor::ones(lead(q), DType::F64, &cpu)?;
            let order = Tensor::arange(0f64, rows as f64, &cpu)?.affine(-(2f64.powi(-19)), 0.)?.reshape(lead(d))?;
            (Tensor::cat(&[q, &one], D::Minus1)?, Tensor::cat(&[d, &order], D::Minus1)?)
        }
    };
    let s = fr(&qi, &di)?;
    let g = s.to_dtype(DType::F64)?.broadcast_mul(&f64_on_cpu(w)?)?.sum_all()?.backward()?;
    let get = |v: &Var| g.get(v.as_tensor()).expect("a reference gradient").clone();
    Ok((get(&qv), get(&dv)))
}

/// Asserts that the op's gradients on `dev` (`f`) are in the inputs' dtype
/// and equal the reference's (`fr`, see [`reference_grads`]) within
/// [`grad_tol`]; returns the op's, on the CPU.
#[allow(clippy::too_many_arguments)]
pub fn check_grads(
    what: &str,
    dev: &Device,
    q: &Tensor,
    d: &Tensor,
    w: &Tensor,
    ties: Ties,
    f: &ScoreFn,
    fr: &ScoreFn,
) -> Result<(Tensor, Tensor)> {
    let dt = q.dtype();
    let (gq, gd) = grads_on(dev, q, d, w, f)?;
    let (rq, rd) = reference_grads(q, d, w, ties, fr)?;
    assert_eq!((gq.dtype(), gd.dtype()), (dt, dt), "{what}: gradient dtypes");
    assert_close(&format!("{what} {dt:?} grad q"), &gq, &rq, grad_tol(dt))?;
    assert_close(&format!("{what} {dt:?} grad d"), &gd, &rd, grad_tol(dt))?;
    Ok((gq, gd))
}

/// Σ|g| over the rows of `g` (`[rows, dim]` once flattened) where `keep` is 0.
pub fn masked_mass(g: &Tensor, keep: &Tensor) -> Result<f32> {
    let rows = keep.elem_count();
    let g = g.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.reshape((rows, ()))?;
    let off = keep.to_device(&Device::Cpu)?.flatten_all()?.eq(0u8)?.to_dtype(DType::F32)?.unsqueeze(1)?;
    g.abs()?.broadcast_mul(&off)?.sum_all()?.to_scalar::<f32>()
}

/// Two backward passes through one graph give bitwise the same gradients
/// (the first consumes the saved argmax, the second recomputes it).
pub fn second_backward_matches(dev: &Device, dt: DType) -> Result<()> {
    let q = Var::from_tensor(&randn(&[3, 8, 64], dt, dev)?)?;
    let d = Var::from_tensor(&randn(&[4, 20, 64], dt, dev)?)?;
    // LowMem: bitwise deterministic (Unified's atomics may reorder the sums).
    let opts = MaxSimOptions { backward: Backward::LowMem, ..Default::default() };
    let loss = ms::maxsim_with(q.as_tensor(), d.as_tensor(), None, None, &opts)?.sum_all()?;
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
/// dense and KD layouts with masks, for a random loss gradient; a `dloss`
/// of the wrong shape is an error naming it.
pub fn value_and_grads_match_autograd(dev: &Device, dt: DType) -> Result<()> {
    let opts = MaxSimOptions { backward: Backward::LowMem, ..Default::default() };
    for kd in [false, true] {
        let q = randn(&[3, 8, 64], dt, dev)?;
        let d = if kd { randn(&[3, 2, 20, 64], dt, dev)? } else { randn(&[4, 20, 64], dt, dev)? };
        let qm = rand_mask(&[3, 8], 0.2, dev)?;
        let dm = rand_mask(&d.dims()[..d.rank() - 1], 0.2, dev)?;
        let gs = Tensor::randn(0f32, 1f32, if kd { (3, 2) } else { (3, 4) }, dev)?;
        let (s, gq, gd) = ms::maxsim_value_and_grads(&q, &d, Some(&qm), Some(&dm), Backward::LowMem, |s| {
            assert_eq!(s.dims(), gs.dims());
            Ok(gs.clone())
        })?;
        let (qv, dv) = (Var::from_tensor(&q)?, Var::from_tensor(&d)?);
        let s2 = ms::maxsim_with(qv.as_tensor(), dv.as_tensor(), Some(&qm), Some(&dm), &opts)?;
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
    expect_err(ms::maxsim_value_and_grads(&q, &d, None, None, Backward::Auto, |s| s.sum_all()), "dloss");
    Ok(())
}
