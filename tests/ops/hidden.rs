//! The fused D-side projection head (src/ops/hidden.rs):
//! `maxsim_from_hidden` and `maxsim_from_hidden_value_and_grads` against
//! `reference` on the CPU, forward and closed-form backward.

use crate::common::*;
use candle_core::{DType, Device, IndexOp, Result, Tensor, Var};
use candle_maxsim::{self as ms, reference as r};

/// One problem: (nq, nd, lq, ld, dmodel, dout, normalize, mask, bias).
type HeadCase = (usize, usize, usize, usize, usize, usize, bool, bool, bool);

/// The CUDA cases, each fused on compute capability 9.0 (`Nd·Ld ≥ Nq·Lq`):
/// partial 128-row chunks, dmodel not a multiple of 64, dout 48 / 96 / 128,
/// masks with an all-masked document, no bias, and more query rows than one
/// block's shared memory holds maxima for (two query chunks per document).
const CUDA_CASES: [HeadCase; 5] = [
    (3, 5, 7, 300, 136, 128, true, true, true),
    (2, 4, 32, 128, 768, 96, false, false, true),
    (5, 3, 9, 70, 64, 48, true, true, false),
    (300, 2, 32, 4800, 64, 128, true, false, true),
    (1, 9, 32, 257, 256, 64, false, true, true),
];

/// Every dtype with and without normalization, bias and a document mask;
/// the training forward (w tracks a gradient) gives the same scores. On
/// CUDA also [`CUDA_CASES`] in F16 / BF16 against the reference on the same
/// rounded inputs in F32 and an all-masked document scoring 0 (where the
/// fused kernel runs: the unit test of src/ops/hidden.rs).
fn from_hidden_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let g = |t: &Tensor| t.to_device(dev);
    for dt in DTYPES {
        for normalize in [false, true] {
            let q = randn(&[3, 5, 24], dt, &cpu)?;
            let h = randn(&[4, 9, 40], dt, &cpu)?;
            let w = (randn(&[24, 40], dt, &cpu)? * 0.2)?;
            let b = randn(&[24], dt, &cpu)?;
            let dm = rand_mask(&[4, 9], 0.2, &cpu)?;
            let what = format!("from_hidden {dt:?} norm={normalize}");
            let want = r::maxsim_from_hidden(&q, &h, &w, Some(&b), Some(&dm), normalize)?;
            // Half precision rounds the projected tokens: allow for the extra rounding.
            let tol = if dt == DType::F32 { score_tol(dev, dt).max(1e-5) } else { 3e-2 };
            let (qg, hg, wg, bg, dmg) = (g(&q)?, g(&h)?, g(&w)?, g(&b)?, g(&dm)?);
            let out = ms::maxsim_from_hidden(&qg, &hg, &wg, Some(&bg), Some(&dmg), normalize)?;
            assert_close(&what, &out, &want, tol)?;
            let wv = Var::from_tensor(&wg)?;
            let tr = ms::maxsim_from_hidden(&qg, &hg, wv.as_tensor(), Some(&bg), Some(&dmg), normalize)?;
            assert_close(&format!("{what} training forward"), &tr, &want, tol)?;
        }
    }
    if gpu_cases(dev) {
        cuda_cases_match_reference(dev)?;
    }
    Ok(())
}

test_device!(from_hidden_matches_reference, from_hidden_matches_reference_cpu, from_hidden_matches_reference_cuda);

fn cuda_cases_match_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for dt in [DType::BF16, DType::F16] {
        for &(nq, nd, lq, ld, dmodel, dout, normalize, mask, bias) in &CUDA_CASES {
            let q = randn(&[nq, lq, dout], dt, &cpu)?;
            let h = randn(&[nd, ld, dmodel], dt, &cpu)?;
            let w = (randn(&[dout, dmodel], dt, &cpu)? * (1.0 / (dmodel as f64).sqrt()))?;
            let b = bias.then(|| randn(&[dout], dt, &cpu)).transpose()?;
            let dm = if mask {
                // Document 1 entirely masked: scores 0.
                let m = rand_mask(&[nd, ld], 0.3, &cpu)?;
                Some(Tensor::cat(&[&m.i(..1)?, &m.i(1..2)?.zeros_like()?, &m.i(2..)?], 0)?)
            } else {
                None
            };
            let g = |t: &Tensor| t.to_device(dev);
            let (qg, hg, wg) = (g(&q)?, g(&h)?, g(&w)?);
            let bg = b.as_ref().map(g).transpose()?;
            let dmg = dm.as_ref().map(g).transpose()?;
            let what = format!("from_hidden {nq}x{nd} lq{lq} ld{ld} dmodel{dmodel} dout{dout} {dt:?} norm={normalize}");
            let f32c = |t: &Tensor| t.to_dtype(DType::F32);
            let want = r::maxsim_from_hidden(
                &f32c(&q)?,
                &f32c(&h)?,
                &f32c(&w)?,
                b.as_ref().map(f32c).transpose()?.as_ref(),
                dm.as_ref(),
                normalize,
            )?;
            let out = ms::maxsim_from_hidden(&qg, &hg, &wg, bg.as_ref(), dmg.as_ref(), normalize)?;
            assert_close(&what, &out, &want, gpu_tol(dt))?;
            if mask {
                let empty = out.i((.., 1))?.abs()?.sum_all()?.to_scalar::<f32>()?;
                assert_eq!(empty, 0.0, "{what}: an all-masked document scores 0");
            }
            // Training takes the argmax forward; its scores agree.
            let wv = Var::from_tensor(&wg)?;
            let tr = ms::maxsim_from_hidden(&qg, &hg, wv.as_tensor(), bg.as_ref(), dmg.as_ref(), normalize)?;
            assert_close(&format!("{what} training forward"), &tr, &want, gpu_tol(dt))?;
        }
    }
    Ok(())
}

/// Gradients of Σ w8 ⊙ scores for (q, h_d, w[, b]), on the CPU: the op on
/// `dev` (`ours`) or autograd through `reference` on the CPU.
fn head_grads(
    dev: &Device,
    ours: bool,
    ins: &[Tensor; 4],
    (bias, normalize): (bool, bool),
    dm: Option<&Tensor>,
    w8: &Tensor,
) -> Result<Vec<Tensor>> {
    let dev = if ours { dev } else { &Device::Cpu };
    let v: Vec<Var> = ins.iter().map(|x| Var::from_tensor(&x.to_device(dev)?)).collect::<Result<_>>()?;
    let t: Vec<Tensor> = v.iter().map(|v| v.as_tensor().clone()).collect();
    let b = bias.then_some(&t[3]);
    let m = opt_to(dev, dm)?;
    let s = if ours {
        ms::maxsim_from_hidden(&t[0], &t[1], &t[2], b, m.as_ref(), normalize)?
    } else {
        r::maxsim_from_hidden(&t[0], &t[1], &t[2], b, m.as_ref(), normalize)?
    };
    let g = (s * w8.to_device(dev)?)?.sum_all()?.backward()?;
    let n = if bias { 4 } else { 3 };
    t[..n].iter().map(|x| g.get(x).expect("a gradient").to_device(&Device::Cpu)).collect()
}

/// 1 for each (query, document) pair whose query tokens all have a best
/// document token ahead of the second best by more than 1e-4 of the largest
/// similarity, else 0 (`[nq, nd]` F32, the similarities recomputed in F32 on
/// the CPU). Random inputs at 10 000 query rows against 4 800-token
/// documents hold a few near-ties that rounding may break either way, and a
/// different winner changes a gradient row entirely: a loss weighted by this
/// does not depend on how they are broken.
fn tie_free_pairs(ins: &[Tensor; 4], bias: bool, normalize: bool, dm: Option<&Tensor>) -> Result<Tensor> {
    let (nq, lq, dout) = ins[0].dims3()?;
    let (nd, ld, _) = ins[1].dims3()?;
    let mut d = ins[1].broadcast_matmul(&ins[2].t()?)?;
    if bias {
        d = d.broadcast_add(&ins[3])?;
    }
    if normalize {
        d = d.broadcast_div(&d.sqr()?.sum_keepdim(2)?.sqrt()?)?;
    }
    let sims = ins[0].reshape((nq * lq, dout))?.matmul(&d.reshape((nd * ld, dout))?.t()?)?;
    let sims = sims.reshape((nq * lq, nd, ld))?;
    let delta = 1e-4 * sims.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let neg = Tensor::full(f32::NEG_INFINITY, sims.shape(), sims.device())?;
    let sims = match dm {
        Some(m) => m.reshape((1, nd, ld))?.broadcast_as(sims.shape())?.where_cond(&sims, &neg)?,
        None => sims,
    };
    let best = sims.max_keepdim(2)?;
    let second = sims.broadcast_ge(&best)?.where_cond(&neg, &sims)?.max_keepdim(2)?;
    // A row with one valid token (gap +inf) or none (NaN) has no tie to break.
    let gap = (best - second)?.reshape((nq, lq, nd))?;
    let free = gap.ge(delta as f64)?.maximum(&gap.ne(&gap)?)?;
    free.min(1)?.to_dtype(DType::F32)
}

/// The closed-form backward against autograd through `reference` in F32,
/// on random (tie-free) inputs: with the winners gathered into slots (few
/// query rows) and with every row, with and without bias, normalization and
/// a document mask; the same gradients outside autograd
/// (`maxsim_from_hidden_value_and_grads`); a frozen encoder (h_d tracks no
/// gradient) gets none. On CUDA also [`CUDA_CASES`].
fn from_hidden_backward_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let tol = if dev.is_cuda() { 2e-2 } else { 1e-4 };
    let mut cases: Vec<HeadCase> = Vec::new();
    //          nq nd lq ld dmodel dout
    for (nq, nd, lq, ld, dmodel, dout) in [(2, 3, 4, 20, 12, 8), (3, 2, 5, 6, 10, 6), (1, 4, 3, 9, 16, 16)] {
        for (bias, normalize, mask) in
            [(true, true, true), (false, false, false), (true, false, true), (false, true, false)]
        {
            cases.push((nq, nd, lq, ld, dmodel, dout, normalize, mask, bias));
        }
    }
    let n_small = cases.len();
    if gpu_cases(dev) {
        cases.extend(CUDA_CASES);
    }
    for (k, &(nq, nd, lq, ld, dmodel, dout, normalize, mask, bias)) in cases.iter().enumerate() {
        let what = format!(
            "from_hidden grads {nq}x{nd} lq{lq} ld{ld} d{dmodel}->{dout} bias={bias} norm={normalize} mask={mask}"
        );
        let ins = [
            randn(&[nq, lq, dout], DType::F32, &cpu)?,
            randn(&[nd, ld, dmodel], DType::F32, &cpu)?,
            (randn(&[dout, dmodel], DType::F32, &cpu)? * (1.0 / (dmodel as f64).sqrt()))?,
            randn(&[dout], DType::F32, &cpu)?,
        ];
        let dm = mask.then(|| rand_mask(&[nd, ld], 0.3, &cpu)).transpose()?;
        // Upstream weights in [0.5, 1.5): the bias gradient is (Σ_j w8[i,j]) ·
        // Σ_s q[i,s] per query, and with signed weights the Σ_j of a short row
        // can cancel to rounding noise, which has no relative error to check.
        // The CUDA cases keep signed weights (their rows are longer).
        let w8 = if k < n_small {
            (Tensor::rand(0f32, 1f32, (nq, nd), &cpu)? + 0.5)?
        } else {
            randn(&[nq, nd], DType::F32, &cpu)?
        };
        let free = tie_free_pairs(&ins, bias, normalize, dm.as_ref())?;
        let kept = free.sum_all()?.to_scalar::<f32>()? as usize;
        // About one pair in ten at the largest case: the check must stay a check.
        assert!(kept * 2 >= nq * nd, "{what}: near-ties in {} of {} pairs", nq * nd - kept, nq * nd);
        let w8 = (w8 * free)?;
        let got = head_grads(dev, true, &ins, (bias, normalize), dm.as_ref(), &w8)?;
        let want = head_grads(dev, false, &ins, (bias, normalize), dm.as_ref(), &w8)?;
        for (k, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_close(&format!("{what}: grad of input {k}"), a, b, tol)?;
        }
        // The same gradients outside autograd.
        let g = |t: &Tensor| t.to_device(dev);
        let bg = if bias { Some(g(&ins[3])?) } else { None };
        let dmg = opt_to(dev, dm.as_ref())?;
        let w8g = g(&w8)?;
        let (s, vg) = ms::maxsim_from_hidden_value_and_grads(
            &g(&ins[0])?,
            &g(&ins[1])?,
            &g(&ins[2])?,
            bg.as_ref(),
            dmg.as_ref(),
            normalize,
            |s| Ok(w8g.broadcast_as(s.shape())?.clone()),
        )?;
        let b = bias.then_some(&ins[3]);
        let want_s = r::maxsim_from_hidden(&ins[0], &ins[1], &ins[2], b, dm.as_ref(), normalize)?;
        assert_close(&format!("{what}: value_and_grads scores"), &s, &want_s, score_tol(dev, DType::F32).max(1e-5))?;
        let vg = [Some(vg.q), Some(vg.h_d), Some(vg.w), vg.b];
        for (k, (a, b)) in vg.iter().flatten().zip(&want).enumerate() {
            assert_close(&format!("{what}: value_and_grads grad of input {k}"), a, b, tol)?;
        }
        assert_eq!(vg.iter().flatten().count(), want.len(), "{what}: one gradient per input");
    }
    // A frozen encoder: h_d tracks no gradient, so none is computed for it;
    // q's and w's still match the reference.
    let (q, h, w) =
        (randn(&[2, 3, 4], DType::F32, &cpu)?, randn(&[3, 9, 6], DType::F32, &cpu)?, randn(&[4, 6], DType::F32, &cpu)?);
    let w8 = (Tensor::rand(0f32, 1f32, (2, 3), &cpu)? + 0.5)?;
    let frozen = |ours: bool| -> Result<(Tensor, Tensor, bool)> {
        let d = if ours { dev } else { &cpu };
        let (qv, wv, h) = (Var::from_tensor(&q.to_device(d)?)?, Var::from_tensor(&w.to_device(d)?)?, h.to_device(d)?);
        let s = if ours {
            ms::maxsim_from_hidden(qv.as_tensor(), &h, wv.as_tensor(), None, None, true)?
        } else {
            r::maxsim_from_hidden(qv.as_tensor(), &h, wv.as_tensor(), None, None, true)?
        };
        let g = (s * w8.to_device(d)?)?.sum_all()?.backward()?;
        let get = |t: &Tensor| g.get(t).expect("a gradient").to_device(&Device::Cpu);
        Ok((get(qv.as_tensor())?, get(wv.as_tensor())?, g.get(&h).is_some()))
    };
    let ((gq, gw, has_h), (rq, rw, _)) = (frozen(true)?, frozen(false)?);
    assert!(!has_h, "no gradient for a frozen h_d");
    assert_close("frozen h_d: grad q", &gq, &rq, tol)?;
    assert_close("frozen h_d: grad w", &gw, &rw, tol)?;
    Ok(())
}

test_device!(
    from_hidden_backward_matches_reference,
    from_hidden_backward_matches_reference_cpu,
    from_hidden_backward_matches_reference_cuda
);
