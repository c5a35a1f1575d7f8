use crate::common::*;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_maxsim::{self as ms, reference as r, Backward, MaxSimOptions};

/// A value and a bound on its rounding error.
type Rounded = (f64, f64);

/// Central finite differences of `f` (a scalar of the F64 inputs) at a few
/// entries of input `which`, against the analytic gradient `grad`; false when
/// kinks outnumber half the smooth points (a near-tie: the caller redraws). `f` returns
/// its value and a bound on that value's rounding error: scores are F32 even
/// for F64 inputs (API.md), so the difference quotient carries up to
/// `noise / eps` of rounding, which neither a slope error nor a kink is.
fn check_fd(
    f: &dyn Fn(&[Tensor]) -> Result<Rounded>,
    inputs: &[Tensor],
    which: usize,
    grad: &Tensor,
    what: &str,
) -> Result<bool> {
    let x: Vec<f64> = inputs[which].flatten_all()?.to_vec1()?;
    let g: Vec<f64> = grad.flatten_all()?.to_vec1()?;
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
fn weighted_sum(s: &Tensor, w: &Tensor) -> Result<(f64, f64)> {
    let sw = (s.to_dtype(DType::F64)? * w.to_dtype(DType::F64)?)?;
    let noise = sw.abs()?.sum_all()?.to_scalar::<f64>()? * 2f64.powi(-24);
    Ok((sw.sum_all()?.to_scalar()?, noise))
}

fn weights(shape: &[usize]) -> Result<Tensor> {
    randn(shape, DType::F32, &Device::Cpu)
}

/// Upstream gradient weights in [0.5, 1.5). The bias gradient of
/// `maxsim_from_hidden` is (Σ_j w[i,j]) · Σ_s q[i,s] per query: with signed
/// weights the Σ_j of a 4-document row can cancel to ~0, and then every entry
/// is rounding noise with no meaningful relative error (1 run in 40 failed so).
fn positive_weights(shape: &[usize]) -> Result<Tensor> {
    Tensor::rand(0f32, 1f32, shape, &Device::Cpu)? + 0.5
}

#[test]
fn finite_differences_dense_kd_normalize() -> Result<()> {
    let dev = Device::Cpu;
    for (kd, normalize) in [(false, false), (false, true), (true, false), (true, true)] {
        let what = format!("kd={kd} normalize={normalize}");
        with_redraws(&what, || {
            let qm = rand_mask(&[3, 4], 0.2, &dev)?;
            let q = randn(&[3, 4, 8], DType::F64, &dev)?;
            let (d, dm) = if kd {
                (randn(&[3, 2, 5, 8], DType::F64, &dev)?, rand_mask(&[3, 2, 5], 0.2, &dev)?)
            } else {
                (randn(&[4, 5, 8], DType::F64, &dev)?, rand_mask(&[4, 5], 0.2, &dev)?)
            };
            let opts = MaxSimOptions { normalize, ..Default::default() };
            let w = weights(if kd { &[3, 2] } else { &[3, 4] })?;
            let f = |ins: &[Tensor]| -> Result<(f64, f64)> {
                weighted_sum(&ms::maxsim_with(&ins[0], &ins[1], Some(&qm), Some(&dm), &opts)?, &w)
            };
            let (qv, dv) = (Var::from_tensor(&q)?, Var::from_tensor(&d)?);
            let s = ms::maxsim_with(qv.as_tensor(), dv.as_tensor(), Some(&qm), Some(&dm), &opts)?;
            let grads = (s * &w)?.sum_all()?.backward()?;
            let smooth_q = check_fd(&f, &[q.clone(), d.clone()], 0, grads.get(qv.as_tensor()).unwrap(), &what)?;
            Ok(smooth_q & check_fd(&f, &[q, d], 1, grads.get(dv.as_tensor()).unwrap(), &what)?)
        })?;
    }
    Ok(())
}

#[test]
fn finite_differences_from_hidden() -> Result<()> {
    let dev = Device::Cpu;
    with_redraws("from_hidden", || {
        let ins = [
            randn(&[2, 3, 6], DType::F64, &dev)?,
            randn(&[3, 4, 10], DType::F64, &dev)?,
            randn(&[6, 10], DType::F64, &dev)?,
            randn(&[6], DType::F64, &dev)?,
        ];
        let dm = rand_mask(&[3, 4], 0.2, &dev)?;
        let w8 = weights(&[2, 3])?;
        let f = |x: &[Tensor]| -> Result<(f64, f64)> {
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

/// Gradients of the fused op and of `reference` under candle autograd.
fn grads_of(
    fused: bool,
    q: &Tensor,
    d: &Tensor,
    qm: Option<&Tensor>,
    dm: Option<&Tensor>,
    w: &Tensor,
    opts: &MaxSimOptions,
) -> Result<(Tensor, Tensor)> {
    let (qv, dv) = (Var::from_tensor(q)?, Var::from_tensor(d)?);
    let s = if fused {
        ms::maxsim_with(qv.as_tensor(), dv.as_tensor(), qm, dm, opts)?
    } else {
        r::maxsim_with(qv.as_tensor(), dv.as_tensor(), qm, dm, opts)?
    };
    let g = (s * w)?.sum_all()?.backward()?;
    Ok((g.get(qv.as_tensor()).unwrap().clone(), g.get(dv.as_tensor()).unwrap().clone()))
}

#[test]
fn autograd_matches_reference() -> Result<()> {
    let dev = Device::Cpu;
    for (kd, normalize) in [(false, false), (true, false), (false, true)] {
        for backward in [Backward::Auto, Backward::Unified, Backward::LowMem] {
            let q = randn(&[4, 9, 32], DType::F32, &dev)?;
            let (d, dm) = if kd {
                (randn(&[4, 3, 13, 32], DType::F32, &dev)?, rand_mask(&[4, 3, 13], 0.2, &dev)?)
            } else {
                (randn(&[5, 13, 32], DType::F32, &dev)?, rand_mask(&[5, 13], 0.2, &dev)?)
            };
            let qm = rand_mask(&[4, 9], 0.2, &dev)?;
            let w = weights(if kd { &[4, 3] } else { &[4, 5] })?;
            let opts = MaxSimOptions { normalize, backward };
            let (gq, gd) = grads_of(true, &q, &d, Some(&qm), Some(&dm), &w, &opts)?;
            let (rq, rd) = grads_of(false, &q, &d, Some(&qm), Some(&dm), &w, &opts)?;
            assert_close("grad q", &gq, &rq, 1e-4)?;
            assert_close("grad d", &gd, &rd, 1e-4)?;
            // Masked positions get exactly zero gradient.
            let zq = gq.broadcast_mul(&qm.eq(0u8)?.to_dtype(DType::F32)?.unsqueeze(2)?)?;
            assert_eq!(zq.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
            let zd = gd.broadcast_mul(&dm.eq(0u8)?.to_dtype(DType::F32)?.unsqueeze(dm.rank())?)?;
            assert_eq!(zd.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
        }
    }
    Ok(())
}

#[test]
fn half_precision_grads() -> Result<()> {
    let dev = Device::Cpu;
    for (dt, t) in [(DType::F16, 1e-2), (DType::BF16, 2e-2)] {
        let q = randn(&[3, 6, 32], dt, &dev)?;
        let d = randn(&[4, 10, 32], dt, &dev)?;
        let w = weights(&[3, 4])?;
        let opts = MaxSimOptions::default();
        let (gq, gd) = grads_of(true, &q, &d, None, None, &w, &opts)?;
        assert_eq!(gq.dtype(), dt);
        let (rq, rd) = grads_of(false, &q, &d, None, None, &w, &opts)?;
        assert_close("half grad q", &gq, &rq, t)?;
        assert_close("half grad d", &gd, &rd, t)?;
    }
    Ok(())
}

#[test]
fn backward_modes_identical() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[6, 8, 16], DType::F32, &dev)?;
    let d = randn(&[7, 12, 16], DType::F32, &dev)?;
    let w = weights(&[6, 7])?;
    let mut first: Option<(Vec<f32>, Vec<f32>)> = None;
    for backward in [Backward::Unified, Backward::LowMem, Backward::Auto, Backward::LowMem] {
        let (gq, gd) = grads_of(true, &q, &d, None, None, &w, &MaxSimOptions { normalize: false, backward })?;
        let cur = (gq.flatten_all()?.to_vec1()?, gd.flatten_all()?.to_vec1()?);
        match &first {
            None => first = Some(cur),
            Some(f) => assert_eq!(f, &cur, "{backward:?} differs bitwise"),
        }
    }
    Ok(())
}

#[test]
fn varlen_equals_padded_with_mask() -> Result<()> {
    let dev = Device::Cpu;
    let (cu_q, lq) = rand_offsets(4, 9, 11);
    let (cu_d, ld) = rand_offsets(6, 14, 12);
    let q = randn(&[*cu_q.last().unwrap() as usize, 24], DType::F32, &dev)?;
    let d = randn(&[*cu_d.last().unwrap() as usize, 24], DType::F32, &dev)?;
    let (cu_q, cu_d) = (Tensor::new(cu_q, &dev)?, Tensor::new(cu_d, &dev)?);
    let w = weights(&[4, 6])?;
    // Packed.
    let (qv, dv) = (Var::from_tensor(&q)?, Var::from_tensor(&d)?);
    let s = ms::maxsim_varlen(qv.as_tensor(), &cu_q, lq, dv.as_tensor(), &cu_d, ld)?;
    let g = (&s * &w)?.sum_all()?.backward()?;
    // Padded + mask, through the same pad as the reference (differentiable).
    let (qv2, dv2) = (Var::from_tensor(&q)?, Var::from_tensor(&d)?);
    let (qp, qm) = r::pad_packed(qv2.as_tensor(), &cu_q, lq)?;
    let (dp, dm) = r::pad_packed(dv2.as_tensor(), &cu_d, ld)?;
    let s2 = ms::maxsim(&qp, &dp, Some(&qm), Some(&dm))?;
    let g2 = (&s2 * &w)?.sum_all()?.backward()?;
    assert_close("varlen scores", &s, &s2, 1e-6)?;
    assert_close("varlen grad q", g.get(qv.as_tensor()).unwrap(), g2.get(qv2.as_tensor()).unwrap(), 1e-6)?;
    assert_close("varlen grad d", g.get(dv.as_tensor()).unwrap(), g2.get(dv2.as_tensor()).unwrap(), 1e-6)?;
    Ok(())
}

#[test]
fn pairs_and_packed_pairs_grads() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[4, 6, 16], DType::F32, &dev)?;
    let d = randn(&[4, 9, 16], DType::F32, &dev)?;
    let w = weights(&[4])?;
    let run = |fused: bool| -> Result<(Tensor, Tensor)> {
        let (qv, dv) = (Var::from_tensor(&q)?, Var::from_tensor(&d)?);
        let s = if fused {
            ms::maxsim_pairs(qv.as_tensor(), dv.as_tensor(), None, None)?
        } else {
            r::maxsim_pairs(qv.as_tensor(), dv.as_tensor(), None, None)?
        };
        let g = (s * &w)?.sum_all()?.backward()?;
        Ok((g.get(qv.as_tensor()).unwrap().clone(), g.get(dv.as_tensor()).unwrap().clone()))
    };
    let (a, b) = (run(true)?, run(false)?);
    assert_close("pairs grad q", &a.0, &b.0, 1e-5)?;
    assert_close("pairs grad d", &a.1, &b.1, 1e-5)?;
    Ok(())
}

#[test]
fn residual_grad_to_q() -> Result<()> {
    use candle_maxsim::{BitOrder, ResidualCodec};
    let dev = Device::Cpu;
    let codec = ResidualCodec {
        centroids: randn(&[10, 16], DType::F32, &dev)?,
        bucket_weights: Tensor::new(&[-0.1f32, -0.03, 0.03, 0.1], &dev)?,
        nbits: 2,
        bit_order: BitOrder::ColBert,
    };
    let codes = Tensor::new(&[[1u32, 4, 9, 0], [3, 3, 7, 2]], &dev)?;
    let res = Tensor::rand(0f32, 255., (2, 4, 4), &dev)?.to_dtype(DType::U8)?;
    let lens = Tensor::new(&[4u32, 2], &dev)?;
    let q = randn(&[2, 5, 16], DType::F32, &dev)?;
    let w = weights(&[2, 2])?;
    let grad = |fused: bool| -> Result<Tensor> {
        let qv = Var::from_tensor(&q)?;
        let s = if fused {
            ms::maxsim_residual(qv.as_tensor(), &codes, &res, &lens, &codec, true)?
        } else {
            r::maxsim_residual(qv.as_tensor(), &codes, &res, &lens, &codec, true)?
        };
        Ok((s * &w)?.sum_all()?.backward()?.get(qv.as_tensor()).unwrap().clone())
    };
    assert_close("residual grad q", &grad(true)?, &grad(false)?, 1e-4)
}

#[test]
fn second_backward_recomputes_argmax() -> candle_core::Result<()> {
    crate::common::second_backward_matches(&candle_core::Device::Cpu, candle_core::DType::F32)
}

#[test]
fn value_and_grads_without_autograd() -> candle_core::Result<()> {
    for dt in [candle_core::DType::F32, candle_core::DType::F64] {
        crate::common::value_and_grads_match_autograd(&candle_core::Device::Cpu, dt)?;
    }
    Ok(())
}

/// `maxsim_from_hidden`'s closed-form backward against autograd through
/// `reference` (plain candle ops), F32 and random (tie-free) inputs: with the
/// winners gathered into slots (few query rows) and with every row, with and
/// without bias, normalization and a document mask.
#[test]
fn from_hidden_closed_form_backward() -> Result<()> {
    let dev = Device::Cpu;
    //         nq nd lq ld dmodel dout
    for (nq, nd, lq, ld, dmodel, dout) in [(2, 3, 4, 20, 12, 8), (3, 2, 5, 6, 10, 6), (1, 4, 3, 9, 16, 16)] {
        for (bias, normalize, mask) in
            [(true, true, true), (false, false, false), (true, false, true), (false, true, false)]
        {
            let what = format!("from_hidden {nq}x{nd} lq{lq} ld{ld} bias={bias} norm={normalize} mask={mask}");
            let ins = [
                randn(&[nq, lq, dout], DType::F32, &dev)?,
                randn(&[nd, ld, dmodel], DType::F32, &dev)?,
                randn(&[dout, dmodel], DType::F32, &dev)?,
                randn(&[dout], DType::F32, &dev)?,
            ];
            let dm = if mask { Some(rand_mask(&[nd, ld], 0.3, &dev)?) } else { None };
            let w8 = positive_weights(&[nq, nd])?;
            let grads = |fused: bool| -> Result<Vec<Tensor>> {
                let v: Vec<Var> = ins.iter().map(Var::from_tensor).collect::<Result<_>>()?;
                let t: Vec<Tensor> = v.iter().map(|v| v.as_tensor().clone()).collect();
                let b = bias.then_some(&t[3]);
                let s = if fused {
                    ms::maxsim_from_hidden(&t[0], &t[1], &t[2], b, dm.as_ref(), normalize)?
                } else {
                    r::maxsim_from_hidden(&t[0], &t[1], &t[2], b, dm.as_ref(), normalize)?
                };
                let g = (s * &w8)?.sum_all()?.backward()?;
                let n = if bias { 4 } else { 3 };
                Ok(t[..n].iter().map(|x| g.get(x).expect("a gradient").clone()).collect())
            };
            let (got, want) = (grads(true)?, grads(false)?);
            for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_close(&format!("{what}: grad of input {k}"), a, b, 1e-4)?;
            }
            // The same gradients outside autograd.
            let b = bias.then_some(&ins[3]);
            let (s, g) =
                ms::maxsim_from_hidden_value_and_grads(&ins[0], &ins[1], &ins[2], b, dm.as_ref(), normalize, |s| {
                    Ok(w8.broadcast_as(s.shape())?.clone())
                })?;
            let want_s = r::maxsim_from_hidden(&ins[0], &ins[1], &ins[2], b, dm.as_ref(), normalize)?;
            assert_close(&format!("{what}: value_and_grads scores"), &s, &want_s, 1e-5)?;
            let vg = [Some(g.q), Some(g.h_d), Some(g.w), g.b];
            for (k, (a, b)) in vg.iter().flatten().zip(&want).enumerate() {
                assert_close(&format!("{what}: value_and_grads grad of input {k}"), a, b, 1e-4)?;
            }
            assert_eq!(vg.iter().flatten().count(), want.len(), "{what}: one gradient per input");
        }
    }
    // A frozen encoder: h_d tracks no gradient, so none is computed for it;
    // q's and w's still match the reference.
    let (q, h, w) =
        (randn(&[2, 3, 4], DType::F32, &dev)?, randn(&[3, 9, 6], DType::F32, &dev)?, randn(&[4, 6], DType::F32, &dev)?);
    let w8 = positive_weights(&[2, 3])?;
    let frozen = |ours: bool| -> Result<(Tensor, Tensor, bool)> {
        let (qv, wv) = (Var::from_tensor(&q)?, Var::from_tensor(&w)?);
        let s = if ours {
            ms::maxsim_from_hidden(qv.as_tensor(), &h, wv.as_tensor(), None, None, true)?
        } else {
            r::maxsim_from_hidden(qv.as_tensor(), &h, wv.as_tensor(), None, None, true)?
        };
        let g = (s * &w8)?.sum_all()?.backward()?;
        Ok((g.get(qv.as_tensor()).unwrap().clone(), g.get(wv.as_tensor()).unwrap().clone(), g.get(&h).is_some()))
    };
    let ((gq, gw, has_h), (rq, rw, _)) = (frozen(true)?, frozen(false)?);
    assert!(!has_h, "no gradient for a frozen h_d");
    assert_close("frozen h_d: grad q", &gq, &rq, 1e-4)?;
    assert_close("frozen h_d: grad w", &gw, &rw, 1e-4)?;
    let e = ms::maxsim_from_hidden_value_and_grads(
        &randn(&[2, 3, 4], DType::F32, &dev)?,
        &randn(&[3, 5, 6], DType::F32, &dev)?,
        &randn(&[4, 6], DType::F32, &dev)?,
        None,
        None,
        true,
        |s| s.sum_keepdim(1),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("dloss"), "{e}");
    Ok(())
}
