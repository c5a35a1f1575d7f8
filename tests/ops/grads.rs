//! Gradients of the MaxSim op (dense, KD, pairs, packed): finite
//! differences, autograd against autograd through `reference` on the CPU in
//! F64, both backward modes, the saved and the recomputed argmax, and the
//! value-and-grads form.

use crate::common::*;
use candle_core::{DType, Device, IndexOp, Result, Tensor, Var};
use candle_maxsim::{self as ms, reference as r, Backward, MaxSimOptions};

/// A value and a bound on its rounding error.
type Rounded = (f64, f64);

/// Central finite differences of `f` (a scalar of the F64 inputs, on the
/// CPU) at a few entries of input `which`, against the analytic gradient
/// `grad`; false when kinks outnumber half the smooth points (a near-tie:
/// the caller redraws). `f` returns its value and a bound on that value's
/// rounding error: scores are F32 even for F64 inputs (as documented), so the
/// difference quotient carries up to `noise / eps` of rounding, which
/// neither a slope error nor a kink is.
fn check_fd(
    f: &dyn Fn(&[Tensor]) -> Result<Rounded>,
    inputs: &[Tensor],
    which: usize,
    grad: &Tensor,
    what: &str,
) -> Result<bool> {
    let x: Vec<f64> = inputs[which].flatten_all()?.to_vec1()?;
    let g: Vec<f64> = grad.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?;
    let scale = g.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-6);
    let eps = 1e-3;
    let (mut checked, mut kinks) = (0, 0);
    for k in (0..x.len()).step_by((x.len() / 23).max(1)) {
        let eval = |delta: f64| -> Result<(f64, f64)> {
            let mut xv = x.clone();
            xv[k] += delta;
            let mut ins = inputs.to_vec();
            ins[which] = Tensor::from_vec(xv, inputs[which].shape(), &Device::Cpu)?;
            f(&ins)
        };
        let ((fp, np), (f0, n0), (fm, nm)) = (eval(eps)?, eval(0.0)?, eval(-eps)?);
        let noise = np.max(n0).max(nm) / eps;
        // MaxSim is piecewise smooth: where the winner changes inside [x-eps, x+eps]
        // the one-sided slopes disagree, and a central difference means nothing.
        let jump = ((fp - f0) / eps - (f0 - fm) / eps).abs();
        if jump > 1e-2 * scale + 4.0 * noise {
            kinks += 1;
            continue;
        }
        // A winner change too small to skip moves the central difference
        // away from the slope at x by exactly half the one-sided jump.
        let fd = (fp - fm) / (2.0 * eps);
        assert!(
            (fd - g[k]).abs() < 2e-3 * scale + 0.5 * jump + noise,
            "{what}: d/dx[{k}] fd {fd} vs analytic {} (one-sided jump {jump}, rounding {noise})",
            g[k]
        );
        checked += 1;
    }
    Ok(checked > 2 * kinks)
}

/// Runs `attempt` (fresh random inputs, every check_fd of a test) until one
/// draw has enough smooth points. A mismatch at a smooth point fails at once:
/// only a draw with a near-tie, where a difference quotient means nothing, is
/// redrawn.
fn with_redraws(what: &str, mut attempt: impl FnMut() -> Result<bool>) -> Result<()> {
    for _ in 0..8 {
        if attempt()? {
            return Ok(());
        }
    }
    panic!("{what}: near-ties in 8 random draws");
}

/// Σ s·w in F64 for F32 scores `s`, with the bound on its rounding error:
/// each score was rounded to F32 once (relative error ≤ 2⁻²⁴).
fn weighted_sum(s: &Tensor, w: &Tensor) -> Result<Rounded> {
    let s = s.to_device(&Device::Cpu)?;
    let sw = (s.to_dtype(DType::F64)? * w.to_dtype(DType::F64)?)?;
    let noise = sw.abs()?.sum_all()?.to_scalar::<f64>()? * 2f64.powi(-24);
    Ok((sw.sum_all()?.to_scalar()?, noise))
}

/// Upstream gradient weights: standard normal, F32, on the CPU.
fn weights(shape: &[usize]) -> Result<Tensor> {
    randn(shape, DType::F32, &Device::Cpu)
}

/// Finite differences of the op on `dev` (F64 inputs) against its own
/// autograd there: in-batch and KD, with and without normalization, masks.
fn finite_differences_match_dense_and_kd_grads(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for (kd, normalize) in [(false, false), (false, true), (true, false), (true, true)] {
        let what = format!("kd={kd} normalize={normalize} on {dev:?}");
        with_redraws(&what, || {
            let qm = rand_mask(&[3, 4], 0.2, &cpu)?;
            let q = randn(&[3, 4, 8], DType::F64, &cpu)?;
            let (d, dm) = if kd {
                (randn(&[3, 2, 5, 8], DType::F64, &cpu)?, rand_mask(&[3, 2, 5], 0.2, &cpu)?)
            } else {
                (randn(&[4, 5, 8], DType::F64, &cpu)?, rand_mask(&[4, 5], 0.2, &cpu)?)
            };
            let (qmg, dmg) = (qm.to_device(dev)?, dm.to_device(dev)?);
            let opts = MaxSimOptions { normalize, ..Default::default() };
            let w = weights(if kd { &[3, 2] } else { &[3, 4] })?;
            let f = |ins: &[Tensor]| -> Result<Rounded> {
                let (q, d) = (ins[0].to_device(dev)?, ins[1].to_device(dev)?);
                weighted_sum(&ms::maxsim_with(&q, &d, Some(&qmg), Some(&dmg), &opts)?, &w)
            };
            let (qv, dv) = (Var::from_tensor(&q.to_device(dev)?)?, Var::from_tensor(&d.to_device(dev)?)?);
            let s = ms::maxsim_with(qv.as_tensor(), dv.as_tensor(), Some(&qmg), Some(&dmg), &opts)?;
            let grads = (s * w.to_device(dev)?)?.sum_all()?.backward()?;
            let smooth_q = check_fd(&f, &[q.clone(), d.clone()], 0, grads.get(qv.as_tensor()).unwrap(), &what)?;
            Ok(smooth_q & check_fd(&f, &[q, d], 1, grads.get(dv.as_tensor()).unwrap(), &what)?)
        })?;
    }
    Ok(())
}

test_device!(
    finite_differences_match_dense_and_kd_grads,
    finite_differences_match_dense_and_kd_grads_cpu,
    finite_differences_match_dense_and_kd_grads_cuda
);

/// Finite differences of `maxsim_from_hidden` (F64, which the crate supports
/// on the CPU) against its closed-form backward, for q, h_d, w and b.
#[test]
fn finite_differences_match_from_hidden_grads_cpu() -> Result<()> {
    let cpu = Device::Cpu;
    with_redraws("from_hidden", || {
        let ins = [
            randn(&[2, 3, 6], DType::F64, &cpu)?,
            randn(&[3, 4, 10], DType::F64, &cpu)?,
            randn(&[6, 10], DType::F64, &cpu)?,
            randn(&[6], DType::F64, &cpu)?,
        ];
        let dm = rand_mask(&[3, 4], 0.2, &cpu)?;
        let w8 = weights(&[2, 3])?;
        let f = |x: &[Tensor]| -> Result<Rounded> {
            weighted_sum(&ms::maxsim_from_hidden(&x[0], &x[1], &x[2], Some(&x[3]), Some(&dm), true)?, &w8)
        };
        let vars: Vec<Var> = ins.iter().map(Var::from_tensor).collect::<Result<_>>()?;
        let t: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let s = ms::maxsim_from_hidden(&t[0], &t[1], &t[2], Some(&t[3]), Some(&dm), true)?;
        let g = (s * &w8)?.sum_all()?.backward()?;
        let mut smooth = true;
        for (k, tk) in t.iter().enumerate() {
            smooth &= check_fd(&f, &ins, k, g.get(tk).unwrap(), &format!("from_hidden input {k}"))?;
        }
        Ok(smooth)
    })
}

/// In-batch, KD and normalized, under every backward mode, F32 random
/// inputs: with masks (masked positions get exactly zero gradient), and 4
/// queries of 32 tokens against documents of 100 tokens without.
fn autograd_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    //                 nq lq nd  ld  K dim masks
    for (nq, lq, nd, ld, k, dim, masks) in [(4, 9, 5, 13, 3, 32, true), (4, 32, 5, 100, 3, 64, false)] {
        for (kd, normalize) in [(false, false), (true, false), (false, true)] {
            for backward in [Backward::Auto, Backward::Unified, Backward::LowMem] {
                let what = format!("{nq}x{nd} lq{lq} ld{ld} d{dim} kd={kd} norm={normalize} {backward:?}");
                let q = randn(&[nq, lq, dim], DType::F32, &cpu)?;
                let dshape: &[usize] = if kd { &[nq, k, ld] } else { &[nd, ld] };
                let d = randn(&[dshape, &[dim]].concat(), DType::F32, &cpu)?;
                let qm = masks.then(|| rand_mask(&[nq, lq], 0.2, &cpu)).transpose()?;
                let dm = masks.then(|| rand_mask(dshape, 0.2, &cpu)).transpose()?;
                let w = if kd { weights(&[nq, k])? } else { weights(&[nq, nd])? };
                let opts = MaxSimOptions { normalize, backward };
                let (qmg, dmg) = (opt_to(dev, qm.as_ref())?, opt_to(dev, dm.as_ref())?);
                let f = |q: &Tensor, d: &Tensor| ms::maxsim_with(q, d, qmg.as_ref(), dmg.as_ref(), &opts);
                let fr = |q: &Tensor, d: &Tensor| r::maxsim_with(q, d, qm.as_ref(), dm.as_ref(), &opts);
                let (gq, gd) = check_grads(&what, dev, &q, &d, &w, Ties::Absent, &f, &fr)?;
                if let (Some(qm), Some(dm)) = (&qm, &dm) {
                    assert_eq!(masked_mass(&gq, qm)?, 0.0, "{what}: masked query tokens get no gradient");
                    assert_eq!(masked_mass(&gd, dm)?, 0.0, "{what}: masked document tokens get no gradient");
                }
            }
        }
    }
    Ok(())
}

test_device!(autograd_matches_reference, autograd_matches_reference_cpu, autograd_matches_reference_cuda);

/// F16 and BF16 inputs: gradients in the inputs' dtype.
fn half_precision_grads_match_reference(dev: &Device) -> Result<()> {
    for dt in [DType::F16, DType::BF16] {
        let q = randn(&[3, 6, 32], dt, &Device::Cpu)?;
        let d = randn(&[4, 10, 32], dt, &Device::Cpu)?;
        let w = weights(&[3, 4])?;
        let f = |q: &Tensor, d: &Tensor| ms::maxsim(q, d, None, None);
        let fr = |q: &Tensor, d: &Tensor| r::maxsim(q, d, None, None);
        check_grads(&format!("half {dt:?}"), dev, &q, &d, &w, Ties::Absent, &f, &fr)?;
    }
    Ok(())
}

test_device!(
    half_precision_grads_match_reference,
    half_precision_grads_match_reference_cpu,
    half_precision_grads_match_reference_cuda
);

/// Every document token identical (grid values: exact ties on every
/// device): the gradient lands on token 0 only.
fn tied_tokens_send_gradient_to_lowest_index(dev: &Device) -> Result<()> {
    let q = Var::from_tensor(&grid(&[1, 2, 8], DType::F32)?.to_device(dev)?)?;
    let row = grid(&[1, 1, 8], DType::F32)?;
    let d = Var::from_tensor(&row.repeat((1, 4, 1))?.to_device(dev)?)?;
    let s = ms::maxsim(q.as_tensor(), d.as_tensor(), None, None)?;
    let g = s.sum_all()?.backward()?;
    let gd = g.get(d.as_tensor()).unwrap();
    let per_token: Vec<f32> = gd.abs()?.sum(2)?.i(0)?.to_vec1()?;
    assert!(per_token[0] > 0.0 && per_token[1..].iter().all(|&x| x == 0.0), "{per_token:?}");
    Ok(())
}

test_device!(
    tied_tokens_send_gradient_to_lowest_index,
    tied_tokens_send_gradient_to_lowest_index_cpu,
    tied_tokens_send_gradient_to_lowest_index_cuda
);

/// Packed sequences and the same padded with masks (through the reference's
/// differentiable pad) give the same scores and gradients.
fn varlen_grads_equal_padded_with_mask(dev: &Device) -> Result<()> {
    let (cu_q, lq) = rand_offsets(4, 9, 11);
    let (cu_d, ld) = rand_offsets(6, 14, 12);
    let q = randn(&[*cu_q.last().unwrap() as usize, 24], DType::F32, dev)?;
    let d = randn(&[*cu_d.last().unwrap() as usize, 24], DType::F32, dev)?;
    let (cu_q, cu_d) = (Tensor::new(cu_q, dev)?, Tensor::new(cu_d, dev)?);
    let w = weights(&[4, 6])?.to_device(dev)?;
    // The same kernels on the CPU; on CUDA the padded batch may take other tiles.
    let (ts, t) = if dev.is_cuda() { (gpu_tol(DType::F32), grad_tol(DType::F32)) } else { (1e-6, 1e-6) };
    let (qv, dv) = (Var::from_tensor(&q)?, Var::from_tensor(&d)?);
    let s = ms::maxsim_varlen(qv.as_tensor(), &cu_q, lq, dv.as_tensor(), &cu_d, ld)?;
    let g = (&s * &w)?.sum_all()?.backward()?;
    let (qv2, dv2) = (Var::from_tensor(&q)?, Var::from_tensor(&d)?);
    let (qp, qm) = r::pad_packed(qv2.as_tensor(), &cu_q, lq)?;
    let (dp, dm) = r::pad_packed(dv2.as_tensor(), &cu_d, ld)?;
    let s2 = ms::maxsim(&qp, &dp, Some(&qm), Some(&dm))?;
    let g2 = (&s2 * &w)?.sum_all()?.backward()?;
    assert_close("varlen scores", &s, &s2, ts)?;
    assert_close("varlen grad q", g.get(qv.as_tensor()).unwrap(), g2.get(qv2.as_tensor()).unwrap(), t)?;
    assert_close("varlen grad d", g.get(dv.as_tensor()).unwrap(), g2.get(dv2.as_tensor()).unwrap(), t)?;
    Ok(())
}

test_device!(
    varlen_grads_equal_padded_with_mask,
    varlen_grads_equal_padded_with_mask_cpu,
    varlen_grads_equal_padded_with_mask_cuda
);

/// `maxsim_pairs`' gradients.
fn pairs_grads_match_reference(dev: &Device) -> Result<()> {
    let q = randn(&[4, 6, 16], DType::F32, &Device::Cpu)?;
    let d = randn(&[4, 9, 16], DType::F32, &Device::Cpu)?;
    let f = |q: &Tensor, d: &Tensor| ms::maxsim_pairs(q, d, None, None);
    let fr = |q: &Tensor, d: &Tensor| r::maxsim_pairs(q, d, None, None);
    check_grads("pairs", dev, &q, &d, &weights(&[4])?, Ties::Absent, &f, &fr)?;
    Ok(())
}

test_device!(pairs_grads_match_reference, pairs_grads_match_reference_cpu, pairs_grads_match_reference_cuda);

/// The backward consumes the argmax the forward saved; a second backward
/// through the same graph recomputes it on the device and agrees bitwise.
fn second_backward_recomputes_argmax(dev: &Device) -> Result<()> {
    for dt in DTYPES {
        second_backward_matches(dev, dt)?;
    }
    Ok(())
}

test_device!(
    second_backward_recomputes_argmax,
    second_backward_recomputes_argmax_cpu,
    second_backward_recomputes_argmax_cuda
);

/// `maxsim_value_and_grads` equals candle autograd through the same kernels.
fn value_and_grads_equal_autograd(dev: &Device) -> Result<()> {
    for dt in DTYPES.into_iter().chain([DType::F64]) {
        value_and_grads_match_autograd(dev, dt)?;
    }
    Ok(())
}

test_device!(value_and_grads_equal_autograd, value_and_grads_equal_autograd_cpu, value_and_grads_equal_autograd_cuda);

/// Grid inputs in every layout: in-batch with masks (one document fully
/// masked; masked positions get exactly zero gradient), KD, pairs, packed
/// in-batch and packed pairs with empty sequences; normalized (F32, random
/// inputs). On CUDA the packed queries include one of 600 tokens.
fn grid_grads_match_reference_in_every_layout(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let q0 = grid(&[5, 33, 64], DType::F32)?;
    let d0 = grid(&[6, 150, 64], DType::F32)?;
    let dk0 = grid(&[5, 3, 40, 64], DType::F32)?;
    let dp0 = grid(&[5, 70, 64], DType::F32)?;
    let qm = rand_mask(&[5, 33], 0.2, &cpu)?;
    let mut dmv: Vec<u8> = rand_mask(&[6, 150], 0.2, &cpu)?.flatten_all()?.to_vec1()?;
    dmv[150..300].fill(0);
    let dm = Tensor::from_vec(dmv, (6, 150), &cpu)?;
    let (qmg, dmg) = (qm.to_device(dev)?, dm.to_device(dev)?);
    let (w, wk, wp) = (weights(&[5, 6])?, weights(&[5, 3])?, weights(&[5])?);
    let masked = |q: &Tensor, d: &Tensor| ms::maxsim(q, d, Some(&qmg), Some(&dmg));
    let masked_r = |q: &Tensor, d: &Tensor| r::maxsim(q, d, Some(&qm), Some(&dm));
    let plain = |q: &Tensor, d: &Tensor| ms::maxsim(q, d, None, None);
    let plain_r = |q: &Tensor, d: &Tensor| r::maxsim(q, d, None, None);
    let pairs = |q: &Tensor, d: &Tensor| ms::maxsim_pairs(q, d, None, None);
    let pairs_r = |q: &Tensor, d: &Tensor| r::maxsim_pairs(q, d, None, None);
    // Packed, with empty sequences.
    let (mut cu_q, mut lq) = rand_offsets(5, 40, 7);
    if gpu_cases(dev) {
        cu_q.push(cu_q.last().unwrap() + 600);
        lq = lq.max(600);
    }
    let nq = cu_q.len() - 1;
    let (cu_d, ld) = rand_offsets(8, 200, 8);
    let qp0 = grid(&[*cu_q.last().unwrap() as usize, 96], DType::F32)?;
    let dpk0 = grid(&[*cu_d.last().unwrap() as usize, 96], DType::F32)?;
    let (cqc, cdc) = (Tensor::new(cu_q, &cpu)?, Tensor::new(cu_d, &cpu)?);
    let (cqg, cdg) = (cqc.to_device(dev)?, cdc.to_device(dev)?);
    let wv = weights(&[nq, 8])?;
    let varlen = |q: &Tensor, d: &Tensor| ms::maxsim_varlen(q, &cqg, lq, d, &cdg, ld);
    let varlen_r = |q: &Tensor, d: &Tensor| r::maxsim_varlen(q, &cqc, lq, d, &cdc, ld);
    let last = nq as u32 - 1; // the long query on CUDA
    let pq = Tensor::new(&[0u32, last, 3, 3, 1, last, 2, 0], &cpu)?;
    let pd = Tensor::new(&[7u32, 0, 3, 6, 1, 7, 3, 7], &cpu)?;
    let (pqg, pdg) = (pq.to_device(dev)?, pd.to_device(dev)?);
    let wpp = weights(&[8])?;
    let packed_pairs = |q: &Tensor, d: &Tensor| ms::score_pairs_packed(q, &cqg, lq, d, &cdg, ld, &pqg, &pdg);
    let packed_pairs_r = |q: &Tensor, d: &Tensor| r::score_pairs_packed(q, &cqc, lq, d, &cdc, ld, &pq, &pd);
    let want = [
        reference_grads(&q0, &d0, &w, Ties::Exact, &masked_r)?,
        reference_grads(&q0, &dk0, &wk, Ties::Exact, &plain_r)?,
        reference_grads(&q0, &dp0, &wp, Ties::Exact, &pairs_r)?,
        reference_grads(&qp0, &dpk0, &wv, Ties::Exact, &varlen_r)?,
        reference_grads(&qp0, &dpk0, &wpp, Ties::Exact, &packed_pairs_r)?,
    ];
    for dt in DTYPES {
        let c = |t: &Tensor| t.to_dtype(dt);
        let (q, d, dk, dp, qp, dpk) = (c(&q0)?, c(&d0)?, c(&dk0)?, c(&dp0)?, c(&qp0)?, c(&dpk0)?);
        let layouts: [(&str, &Tensor, &Tensor, &Tensor, &ScoreFn); 5] = [
            ("dense masked", &q, &d, &w, &masked),
            ("kd", &q, &dk, &wk, &plain),
            ("pairs", &q, &dp, &wp, &pairs),
            ("varlen", &qp, &dpk, &wv, &varlen),
            ("packed pairs", &qp, &dpk, &wpp, &packed_pairs),
        ];
        for ((what, q, d, w, f), (rq, rd)) in layouts.into_iter().zip(&want) {
            let (gq, gd) = grads_on(dev, q, d, w, f)?;
            assert_eq!((gq.dtype(), gd.dtype()), (dt, dt), "{what}: gradient dtypes");
            assert_close(&format!("{what} {dt:?} grad q"), &gq, rq, grad_tol(dt))?;
            assert_close(&format!("{what} {dt:?} grad d"), &gd, rd, grad_tol(dt))?;
            if what == "dense masked" {
                assert_eq!(masked_mass(&gq, &qm)?, 0.0, "{dt:?}: masked query tokens get no gradient");
                assert_eq!(masked_mass(&gd, &dm)?, 0.0, "{dt:?}: masked document tokens get no gradient");
            }
        }
    }
    let opts = MaxSimOptions { normalize: true, ..Default::default() };
    let (qn, dn) = (randn(&[4, 20, 64], DType::F32, &cpu)?, randn(&[3, 30, 64], DType::F32, &cpu)?);
    let f = |q: &Tensor, d: &Tensor| ms::maxsim_with(q, d, None, None, &opts);
    let fr = |q: &Tensor, d: &Tensor| r::maxsim_with(q, d, None, None, &opts);
    check_grads("normalize", dev, &qn, &dn, &weights(&[4, 3])?, Ties::Absent, &f, &fr)?;
    Ok(())
}

test_device!(
    grid_grads_match_reference_in_every_layout,
    grid_grads_match_reference_in_every_layout_cpu,
    grid_grads_match_reference_in_every_layout_cuda
);

/// A score function of (q, d) under a backward mode.
type ModeFn<'a> = dyn Fn(&Tensor, &Tensor, Backward) -> Result<Tensor> + 'a;

fn opts_for(backward: Backward) -> MaxSimOptions {
    MaxSimOptions { normalize: false, backward }
}

/// Raw bits of a gradient (F16 / BF16 / F32 widen exactly), for bitwise comparisons.
fn grad_bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

/// Unified vs LowMem grad_D on CUDA: f32 sums in another order can flip the
/// last bit of an F16 / BF16 output element (2^-7 of it in BF16).
fn mode_tol(dt: DType) -> f64 {
    match dt {
        DType::BF16 => 1e-2,
        _ => 2e-3,
    }
}

/// Both backward modes on `dev` against the reference gradients `want`;
/// Unified against LowMem (bitwise on the CPU, whose modes and Auto share
/// one summation order; within [`mode_tol`] on CUDA, whose Unified sums by
/// atomics); LowMem bitwise identical over 3 runs. Returns the LowMem
/// gradients.
fn check_modes(
    what: &str,
    dev: &Device,
    (q, d, w): (&Tensor, &Tensor, &Tensor),
    want: &(Tensor, Tensor),
    f: &ModeFn,
) -> Result<(Tensor, Tensor)> {
    let dt = q.dtype();
    let with = |m: Backward| move |q: &Tensor, d: &Tensor| f(q, d, m);
    let (lq, ld) = grads_on(dev, q, d, w, &with(Backward::LowMem))?;
    let (uq, ud) = grads_on(dev, q, d, w, &with(Backward::Unified))?;
    for (m, gq, gd) in [("lowmem", &lq, &ld), ("unified", &uq, &ud)] {
        assert_eq!((gq.dtype(), gd.dtype()), (dt, dt), "{what} {m}: gradient dtypes");
        assert_close(&format!("{what} {dt:?} {m} grad q"), gq, &want.0, grad_tol(dt))?;
        assert_close(&format!("{what} {dt:?} {m} grad d"), gd, &want.1, grad_tol(dt))?;
    }
    let (bq, bd) = (grad_bits(&lq)?, grad_bits(&ld)?);
    if dev.is_cuda() {
        assert_close(&format!("{what} {dt:?} unified vs lowmem grad q"), &uq, &lq, 1e-5)?;
        assert_close(&format!("{what} {dt:?} unified vs lowmem grad d"), &ud, &ld, mode_tol(dt))?;
    } else {
        let (aq, ad) = grads_on(dev, q, d, w, &with(Backward::Auto))?;
        for (m, gq, gd) in [("unified", &uq, &ud), ("auto", &aq, &ad)] {
            assert!(grad_bits(gq)? == bq && grad_bits(gd)? == bd, "{what} {dt:?}: {m} differs from lowmem bitwise");
        }
    }
    for run in 0..2 {
        let (rq, rd) = grads_on(dev, q, d, w, &with(Backward::LowMem))?;
        assert!(grad_bits(&rq)? == bq, "{what} {dt:?}: LowMem grad q differs in run {}", run + 2);
        assert!(grad_bits(&rd)? == bd, "{what} {dt:?}: LowMem grad d differs in run {}", run + 2);
    }
    Ok((lq, ld))
}

/// Random (tie-free) F32 inputs, in-batch, no masks.
fn backward_modes_agree_on_random_inputs(dev: &Device) -> Result<()> {
    let (q, d) = (randn(&[6, 8, 16], DType::F32, &Device::Cpu)?, randn(&[7, 12, 16], DType::F32, &Device::Cpu)?);
    let w = weights(&[6, 7])?;
    let want = reference_grads(&q, &d, &w, Ties::Absent, &|q, d| r::maxsim(q, d, None, None))?;
    check_modes("random", dev, (&q, &d, &w), &want, &|q, d, m| ms::maxsim_with(q, d, None, None, &opts_for(m)))?;
    Ok(())
}

test_device!(
    backward_modes_agree_on_random_inputs,
    backward_modes_agree_on_random_inputs_cpu,
    backward_modes_agree_on_random_inputs_cuda
);

/// In-batch with query and document masks (one document fully masked),
/// dims 33 / 128 / 250 (the scalar and 16-byte paths), every dtype; masked
/// positions get exactly zero gradient in both modes.
fn backward_modes_match_reference_with_masks(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for dim in [33, 128, 250] {
        let (nq, lq, nd, ld) = (5, 19, 6, 70);
        let (q0, d0) = (grid(&[nq, lq, dim], DType::F32)?, grid(&[nd, ld, dim], DType::F32)?);
        let qm = rand_mask(&[nq, lq], 0.2, &cpu)?;
        let mut dmv: Vec<u8> = rand_mask(&[nd, ld], 0.2, &cpu)?.flatten_all()?.to_vec1()?;
        dmv[2 * ld..3 * ld].fill(0);
        let dm = Tensor::from_vec(dmv, (nd, ld), &cpu)?;
        let (qmd, dmd) = (qm.to_device(dev)?, dm.to_device(dev)?);
        let w = weights(&[nq, nd])?;
        let want = reference_grads(&q0, &d0, &w, Ties::Exact, &|q, d| r::maxsim(q, d, Some(&qm), Some(&dm)))?;
        let f = |q: &Tensor, d: &Tensor, m: Backward| ms::maxsim_with(q, d, Some(&qmd), Some(&dmd), &opts_for(m));
        for dt in DTYPES {
            let (q, d) = (q0.to_dtype(dt)?, d0.to_dtype(dt)?);
            let what = format!("dense masked d{dim}");
            let (gq, gd) = check_modes(&what, dev, (&q, &d, &w), &want, &f)?;
            assert_eq!(masked_mass(&gq, &qm)?, 0.0, "{what} {dt:?}: masked query rows get no gradient");
            assert_eq!(masked_mass(&gd, &dm)?, 0.0, "{what} {dt:?}: masked doc rows get no gradient");
            let (uq, ud) = grads_on(dev, &q, &d, &w, &|q, d| f(q, d, Backward::Unified))?;
            assert_eq!(masked_mass(&uq, &qm)?, 0.0, "{what} {dt:?}: unified, masked query rows");
            assert_eq!(masked_mass(&ud, &dm)?, 0.0, "{what} {dt:?}: unified, masked doc rows");
        }
    }
    Ok(())
}

test_device!(
    backward_modes_match_reference_with_masks,
    backward_modes_match_reference_with_masks_cpu,
    backward_modes_match_reference_with_masks_cuda
);

/// List layouts: KD (each query its own K documents) and pairs with a
/// document mask, both modes.
fn backward_modes_match_reference_kd_and_pairs(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for dim in [33, 128, 250] {
        let q0 = grid(&[6, 21, dim], DType::F32)?;
        let dk0 = grid(&[6, 3, 45, dim], DType::F32)?;
        let dp0 = grid(&[6, 80, dim], DType::F32)?;
        let dm = rand_mask(&[6, 80], 0.3, &cpu)?;
        let dmd = dm.to_device(dev)?;
        let (wk, wp) = (weights(&[6, 3])?, weights(&[6])?);
        let want_kd = reference_grads(&q0, &dk0, &wk, Ties::Exact, &|q, d| r::maxsim(q, d, None, None))?;
        let want_p = reference_grads(&q0, &dp0, &wp, Ties::Exact, &|q, d| r::maxsim_pairs(q, d, None, Some(&dm)))?;
        for dt in DTYPES {
            let (q, dk, dp) = (q0.to_dtype(dt)?, dk0.to_dtype(dt)?, dp0.to_dtype(dt)?);
            check_modes(&format!("kd d{dim}"), dev, (&q, &dk, &wk), &want_kd, &|q, d, m| {
                ms::maxsim_with(q, d, None, None, &opts_for(m))
            })?;
            check_modes(&format!("pairs d{dim}"), dev, (&q, &dp, &wp), &want_p, &|q, d, m| {
                ms::maxsim_pairs_with(q, d, None, Some(&dmd), &opts_for(m))
            })?;
        }
    }
    Ok(())
}

test_device!(
    backward_modes_match_reference_kd_and_pairs,
    backward_modes_match_reference_kd_and_pairs_cpu,
    backward_modes_match_reference_kd_and_pairs_cuda
);

/// Hot tokens: in half of the documents token 7 wins for every query token
/// (on CUDA 64 queries of 32 tokens: 2048 winners on one row, the
/// block-per-row path), the other documents are ordinary (the warp-per-row
/// path), one document is fully masked.
fn backward_modes_match_reference_with_hot_tokens(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let nq = if gpu_cases(dev) { 64 } else { 8 };
    for dim in [33, 128, 250] {
        let (lq, nd, ld) = (32, 6, 100);
        let q0 = grid(&[nq, lq, dim], DType::F32)?.abs()?;
        let hot = Tensor::full(5f32, (nd / 2, 1, dim), &cpu)?;
        let d0 = grid(&[nd, ld, dim], DType::F32)?.slice_assign(&[0..nd / 2, 7..8, 0..dim], &hot)?;
        let mut dmv = vec![1u8; nd * ld];
        dmv[(nd - 1) * ld..].fill(0);
        let dm = Tensor::from_vec(dmv, (nd, ld), &cpu)?;
        let dmd = dm.to_device(dev)?;
        let w = weights(&[nq, nd])?;
        let want = reference_grads(&q0, &d0, &w, Ties::Exact, &|q, d| r::maxsim(q, d, None, Some(&dm)))?;
        for dt in DTYPES {
            let (q, d) = (q0.to_dtype(dt)?, d0.to_dtype(dt)?);
            let f = |q: &Tensor, d: &Tensor, m: Backward| ms::maxsim_with(q, d, None, Some(&dmd), &opts_for(m));
            let (_, gd) = check_modes(&format!("hot tokens d{dim}"), dev, (&q, &d, &w), &want, &f)?;
            let per_token: Vec<f32> = gd.to_dtype(DType::F32)?.abs()?.sum(2)?.i(0..nd / 2)?.sum(0)?.to_vec1()?;
            assert!(per_token[7] > 0.0, "d{dim} {dt:?}: token 7 wins");
            assert!(per_token.iter().enumerate().all(|(t, &x)| t == 7 || x == 0.0), "d{dim} {dt:?}: only token 7");
            assert_eq!(masked_mass(&gd, &dm)?, 0.0, "d{dim} {dt:?}: masked document");
        }
    }
    Ok(())
}

test_device!(
    backward_modes_match_reference_with_hot_tokens,
    backward_modes_match_reference_with_hot_tokens_cpu,
    backward_modes_match_reference_with_hot_tokens_cuda
);

/// Packed in-batch with empty sequences: a small batch resolves Auto to
/// Unified; on CUDA also 256 x 256 short queries, which resolve it to
/// LowMem (bitwise identical over runs).
fn varlen_backward_matches_reference(dev: &Device) -> Result<()> {
    let mut cases = vec![(7, 9, 40, 130, 12)];
    if gpu_cases(dev) {
        cases.insert(0, (256, 256, 12, 30, 11));
    }
    for (nq, nd, mq, md, seed) in cases {
        for (dim, dt) in [(33, DType::F32), (128, DType::BF16), (250, DType::F16)] {
            let (cu_q, lq) = rand_offsets(nq, mq, seed);
            let (cu_d, ld) = rand_offsets(nd, md, seed + 1);
            let q = grid(&[*cu_q.last().unwrap() as usize, dim], dt)?;
            let d = grid(&[*cu_d.last().unwrap() as usize, dim], dt)?;
            let (cqc, cdc) = (Tensor::new(cu_q, &Device::Cpu)?, Tensor::new(cu_d, &Device::Cpu)?);
            let (cqg, cdg) = (cqc.to_device(dev)?, cdc.to_device(dev)?);
            let f = |q: &Tensor, d: &Tensor| ms::maxsim_varlen(q, &cqg, lq, d, &cdg, ld);
            let fr = |q: &Tensor, d: &Tensor| r::maxsim_varlen(q, &cqc, lq, d, &cdc, ld);
            let w = weights(&[nq, nd])?;
            let what = format!("varlen {nq}x{nd} d{dim}");
            let (gq, gd) = check_grads(&what, dev, &q, &d, &w, Ties::Exact, &f, &fr)?;
            if nq >= 256 {
                let (gq2, gd2) = grads_on(dev, &q, &d, &w, &f)?;
                assert!(grad_bits(&gq)? == grad_bits(&gq2)?, "{what}: LowMem grad q differs between runs");
                assert!(grad_bits(&gd)? == grad_bits(&gd2)?, "{what}: LowMem grad d differs between runs");
            }
        }
    }
    Ok(())
}

test_device!(
    varlen_backward_matches_reference,
    varlen_backward_matches_reference_cpu,
    varlen_backward_matches_reference_cuda
);

/// Every kernel variant of the CUDA backward: 16-byte paths with 8 / 16 /
/// 32 lanes per row and 2 chunks per lane, scalar paths, several column
/// passes, in both modes (F64 too at dims 33 / 128 / 250).
fn backward_modes_match_reference_across_dims(dev: &Device) -> Result<()> {
    for dim in [1, 8, 16, 24, 33, 64, 96, 128, 200, 250, 256, 300, 512, 768] {
        let (q0, d0) = (grid(&[3, 9, dim], DType::F32)?, grid(&[4, 23, dim], DType::F32)?);
        let w = weights(&[3, 4])?;
        let want = reference_grads(&q0, &d0, &w, Ties::Exact, &|q, d| r::maxsim(q, d, None, None))?;
        let f64_too = [33, 128, 250].contains(&dim).then_some(DType::F64);
        for dt in DTYPES.into_iter().chain(f64_too) {
            let (q, d) = (q0.to_dtype(dt)?, d0.to_dtype(dt)?);
            check_modes(&format!("dims d{dim}"), dev, (&q, &d, &w), &want, &|q, d, m| {
                ms::maxsim_with(q, d, None, None, &opts_for(m))
            })?;
        }
    }
    Ok(())
}

test_device!(
    backward_modes_match_reference_across_dims,
    backward_modes_match_reference_across_dims_cpu,
    backward_modes_match_reference_across_dims_cuda
);

/// Documents longer than one shared-memory count chunk (2048 tokens) and
/// past 32767 rows (the saved argmax stays I32; I16 below), and a q whose
/// device address is not 16-byte aligned (the scalar path at dim 128).
fn backward_modes_match_reference_on_long_docs_and_unaligned_q(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let (q0, d0) = (grid(&[3, 16, 40], DType::F32)?, grid(&[2, 5000, 40], DType::F32)?);
    let dm = rand_mask(&[2, 5000], 0.1, &cpu)?;
    let dmd = dm.to_device(dev)?;
    let w = weights(&[3, 2])?;
    let want = reference_grads(&q0, &d0, &w, Ties::Exact, &|q, d| r::maxsim(q, d, None, Some(&dm)))?;
    let (q1, d1) = (grid(&[2, 8, 16], DType::F32)?, grid(&[2, 33000, 16], DType::F32)?);
    let w1 = weights(&[2, 2])?;
    let want1 = reference_grads(&q1, &d1, &w1, Ties::Exact, &|q, d| r::maxsim(q, d, None, None))?;
    let (q2, d2) = (grid(&[4, 10, 128], DType::F32)?, grid(&[5, 30, 128], DType::F32)?);
    let w2 = weights(&[4, 5])?;
    let want2 = reference_grads(&q2, &d2, &w2, Ties::Exact, &|q, d| r::maxsim(q, d, None, None))?;
    for dt in DTYPES {
        let c = |t: &Tensor| t.to_dtype(dt);
        check_modes("long docs", dev, (&c(&q0)?, &c(&d0)?, &w), &want, &|q, d, m| {
            ms::maxsim_with(q, d, None, Some(&dmd), &opts_for(m))
        })?;
        check_modes("docs over 32767 rows", dev, (&c(&q1)?, &c(&d1)?, &w1), &want1, &|q, d, m| {
            ms::maxsim_with(q, d, None, None, &opts_for(m))
        })?;
        // q viewed one element into a fresh buffer: contiguous, 2-4 bytes off 16-byte alignment.
        check_modes("unaligned q", dev, (&c(&q2)?, &c(&d2)?, &w2), &want2, &|q, d, m| {
            let pad = Tensor::zeros(1, q.dtype(), q.device())?;
            let shifted =
                Tensor::cat(&[&pad, &q.flatten_all()?], 0)?.narrow(0, 1, q.elem_count())?.reshape(q.shape())?;
            assert!(shifted.is_contiguous());
            ms::maxsim_with(&shifted, d, None, None, &opts_for(m))
        })?;
    }
    Ok(())
}

test_device!(
    backward_modes_match_reference_on_long_docs_and_unaligned_q,
    backward_modes_match_reference_on_long_docs_and_unaligned_q_cpu,
    backward_modes_match_reference_on_long_docs_and_unaligned_q_cuda
);

/// LowMem gradients are bitwise identical over runs, and a hot token
/// (token 7 of every document, a large all-positive vector) wins for every
/// query token of every query: only it gets gradient. On CUDA 64 queries
/// of 32 tokens against 16 documents at dim 128, BF16.
fn lowmem_grads_repeat_bitwise_with_a_hot_token(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let (nq, nd) = if gpu_cases(dev) { (64, 16) } else { (8, 4) };
    let opts = MaxSimOptions { normalize: false, backward: Backward::LowMem };
    let q = randn(&[nq, 32, 128], DType::F32, &cpu)?.abs()?.to_dtype(DType::BF16)?;
    let hot = Tensor::full(5f32, (nd, 1, 128), &cpu)?;
    let d =
        randn(&[nd, 100, 128], DType::F32, &cpu)?.slice_assign(&[0..nd, 7..8, 0..128], &hot)?.to_dtype(DType::BF16)?;
    let w = weights(&[nq, nd])?;
    let f = |q: &Tensor, d: &Tensor| ms::maxsim_with(q, d, None, None, &opts);
    let fr = |q: &Tensor, d: &Tensor| r::maxsim(q, d, None, None);
    let (gq, gd) = check_grads("hot token", dev, &q, &d, &w, Ties::Absent, &f, &fr)?;
    let bits = (grad_bits(&gq)?, grad_bits(&gd)?);
    for run in 0..2 {
        let (rq, rd) = grads_on(dev, &q, &d, &w, &f)?;
        assert!((grad_bits(&rq)?, grad_bits(&rd)?) == bits, "LowMem gradients differ in run {}", run + 2);
    }
    let v: Vec<f32> = gd.to_dtype(DType::F32)?.abs()?.sum(2)?.sum(0)?.to_vec1()?; // [100]
    assert!(v[7] > 0.0 && v.iter().enumerate().all(|(t, &x)| t == 7 || x == 0.0), "only token 7 wins");
    Ok(())
}

test_device!(
    lowmem_grads_repeat_bitwise_with_a_hot_token,
    lowmem_grads_repeat_bitwise_with_a_hot_token_cpu,
    lowmem_grads_repeat_bitwise_with_a_hot_token_cuda
);
