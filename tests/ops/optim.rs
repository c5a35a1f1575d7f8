//! `adamw_sum_sq` and `adamw_update` (src/ops/optim.rs, in place) against
//! `reference::optim::adamw_update` (torch's formulas in F64) over several steps,
//! with and without clipping and weight decay.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{self as ms, optim::AdamWStep, reference};

fn adamw_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    // Two parameters sharing one global norm; sizes across several grid-stride passes.
    for (max_norm, wd) in [(0.0, 0.0), (1.0, 0.01), (1e3, 0.1)] {
        let sizes = [37usize, 70_001];
        let mut p: Vec<Tensor> = sizes.iter().map(|&n| randn(&[n], DType::F32, &cpu)).collect::<Result<_>>()?;
        let mut m: Vec<Tensor> = sizes.iter().map(|&n| Tensor::zeros(n, DType::F64, &cpu)).collect::<Result<_>>()?;
        let mut v = m.clone();
        // A copy: on the CPU `to_device` shares the storage, which the update writes in place.
        let pd: Vec<Tensor> = p.iter().map(|t| t.to_device(dev)?.copy()).collect::<Result<_>>()?;
        let mv: Vec<Tensor> = sizes.iter().map(|&n| Tensor::zeros((2, n), DType::F32, dev)).collect::<Result<_>>()?;
        for t in 1..=3 {
            let g: Vec<Tensor> = sizes.iter().map(|&n| randn(&[n], DType::F32, &cpu)).collect::<Result<_>>()?;
            let s = AdamWStep {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: wd,
                max_grad_norm: max_norm,
                t,
            };
            let sum_sq = Tensor::zeros(1, DType::F32, dev)?;
            let gd: Vec<Tensor> = g.iter().map(|t| t.to_device(dev)).collect::<Result<_>>()?;
            for x in &gd {
                ms::optim::adamw_sum_sq(&sum_sq, x)?;
            }
            let want: f64 =
                g.iter().map(|x| x.sqr()?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()).sum::<Result<f64>>()?;
            let got = sum_sq.to_vec1::<f32>()?[0] as f64;
            assert!((got - want).abs() <= 1e-5 * want, "sum_sq {got} vs {want} on {dev:?}");
            for i in 0..sizes.len() {
                ms::optim::adamw_update(&pd[i], &mv[i], &gd[i], &sum_sq, &s)?;
                let (np, nm, nv) = reference::optim::adamw_update(&p[i], &m[i], &v[i], &g[i], want, &s)?;
                let what = format!("adamw step {t} param {i} (clip {max_norm}, decay {wd}) on {dev:?}");
                assert_close(&format!("{what} p"), &pd[i], &np, 1e-5)?;
                assert_close(&format!("{what} m"), &mv[i].get(0)?, &nm, 1e-5)?;
                assert_close(&format!("{what} v"), &mv[i].get(1)?, &nv, 1e-5)?;
                (p[i], m[i], v[i]) = (np.to_dtype(DType::F32)?, nm, nv);
            }
        }
    }
    Ok(())
}

test_device!(adamw_matches_reference, adamw_matches_reference_cpu, adamw_matches_reference_cuda);

/// Wrong dtypes, sizes and a zero step count are errors naming the argument.
fn adamw_rejects_bad_input(dev: &Device) -> Result<()> {
    let p = Tensor::zeros(8, DType::F32, dev)?;
    let mv = Tensor::zeros((2, 8), DType::F32, dev)?;
    let sum_sq = Tensor::zeros(1, DType::F32, dev)?;
    let s = AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, max_grad_norm: 1.0, t: 1 };
    let err = |r: Result<()>| r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err(ms::optim::adamw_update(&p, &mv, &Tensor::zeros(7, DType::F32, dev)?, &sum_sq, &s)).starts_with("g:"));
    assert!(err(ms::optim::adamw_update(&p, &Tensor::zeros(8, DType::F32, dev)?, &p, &sum_sq, &s)).starts_with("mv:"));
    assert!(err(ms::optim::adamw_update(&p.to_dtype(DType::F16)?, &mv, &p, &sum_sq, &s)).starts_with("p:"));
    assert!(err(ms::optim::adamw_update(&p, &mv, &p, &sum_sq, &AdamWStep { t: 0, ..s })).starts_with("step:"));
    assert!(err(ms::optim::adamw_sum_sq(&p, &p)).starts_with("sum_sq:"));
    Ok(())
}

test_device!(adamw_rejects_bad_input, adamw_rejects_bad_input_cpu, adamw_rejects_bad_input_cuda);
