//! GPU tests: the CUDA ops against `reference` and the CPU op on random
//! inputs. Each test is skipped (with a message, not failed) where no CUDA
//! device is available, e.g. in CI.

#[path = "../common/mod.rs"]
mod common;

use candle_core::{DType, Device, IndexOp, Result, Tensor, Var};
use candle_maxsim::{self as ms, reference as r};
use common::*;

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

/// Issue 3 tolerances for the CUDA forward.
fn gpu_tol(dt: DType) -> f64 {
    match dt {
        DType::F16 => 5e-3,
        DType::BF16 => 2e-2,
        _ => 1e-3,
    }
}

const DTYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

/// Runs the dense op on the GPU; checks it against reference (CPU, upcast) and the CPU op.
#[allow(clippy::too_many_arguments)]
fn dense_check(
    dev: &Device,
    nq: usize,
    nd: usize,
    lq: usize,
    ld: usize,
    dim: usize,
    dt: DType,
    masks: bool,
    strided: bool,
) -> Result<()> {
    let cpu = Device::Cpu;
    let (q, d) = if strided {
        (randn_strided(nq, lq, dim, dt, &cpu)?, randn_strided(nd, ld, dim, dt, &cpu)?)
    } else {
        (randn(&[nq, lq, dim], dt, &cpu)?, randn(&[nd, ld, dim], dt, &cpu)?)
    };
    let qm = masks.then(|| rand_mask(&[nq, lq], 0.2, &cpu)).transpose()?;
    let dm = masks.then(|| rand_mask(&[nd, ld], 0.2, &cpu)).transpose()?;
    let qg = q.to_device(dev)?;
    let dg = d.to_device(dev)?;
    let qmg = qm.as_ref().map(|m| m.to_device(dev)).transpose()?;
    let dmg = dm.as_ref().map(|m| m.to_device(dev)).transpose()?;
    let out = ms::maxsim(&qg, &dg, qmg.as_ref(), dmg.as_ref())?.to_device(&cpu)?;
    let what = format!("gpu dense {nq}x{nd} lq{lq} ld{ld} d{dim} {dt:?} masks={masks} strided={strided}");
    let want = r::maxsim(&q, &d, qm.as_ref(), dm.as_ref())?;
    assert_close(&format!("{what} vs reference"), &out, &want, gpu_tol(dt))?;
    let cpu_out = ms::maxsim(&q, &d, qm.as_ref(), dm.as_ref())?;
    assert_close(&format!("{what} vs cpu op"), &out, &cpu_out, gpu_tol(dt))?;
    Ok(())
}

#[test]
fn dense_dims_dtypes() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dt in DTYPES {
        for dim in [16, 33, 48, 72, 96, 128, 250, 768] {
            dense_check(&dev, 5, 7, 32, 300, dim, dt, true, false)?;
        }
    }
    Ok(())
}

#[test]
fn dense_lengths() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dt in DTYPES {
        for (lq, ld) in [(1, 300), (32, 1), (128, 1024), (600, 300), (32, 8192), (7, 13)] {
            dense_check(&dev, 3, 4, lq, ld, 128, dt, true, false)?;
        }
        dense_check(&dev, 40, 33, 32, 256, 128, dt, false, false)?; // many query groups and doc chunks
        dense_check(&dev, 1, 300, 32, 300, 128, dt, false, false)?; // rerank-like
        dense_check(&dev, 3, 5, 20, 40, 96, dt, true, true)?; // non-contiguous
        dense_check(&dev, 3, 5, 20, 40, 33, dt, true, true)?; // unaligned rows
    }
    Ok(())
}

#[test]
fn masked_and_empty() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dt in DTYPES {
        let q = randn(&[3, 5, 64], dt, &dev)?.abs()?;
        let d = (randn(&[4, 6, 64], dt, &dev)?.abs()? * -1.0)?;
        let mut qm = vec![1u8; 15];
        qm[5..10].fill(0);
        let mut dm = vec![1u8; 24];
        dm[12..18].fill(0);
        dm[0] = 0;
        let qm = Tensor::from_vec(qm, (3, 5), &dev)?;
        let dm = Tensor::from_vec(dm, (4, 6), &dev)?;
        let v: Vec<Vec<f32>> = ms::maxsim(&q, &d, Some(&qm), Some(&dm))?.to_vec2()?;
        for (i, row) in v.iter().enumerate() {
            for (j, &s) in row.iter().enumerate() {
                if i == 1 || j == 2 {
                    assert_eq!(s, 0.0, "{dt:?} ({i},{j}) should be exactly 0");
                } else {
                    assert!(s < 0.0, "{dt:?} ({i},{j}) = {s}: masked tokens must not win");
                }
            }
        }
        // Empty batches (zero-size views: candle allocates no empty CUDA buffer): empty output, no crash.
        let e = ms::maxsim(&q.narrow(0, 0, 0)?, &d, None, None)?;
        assert_eq!(e.dims(), &[0, 4]);
        let e = ms::maxsim(&q, &d.narrow(0, 0, 0)?, None, None)?;
        assert_eq!(e.dims(), &[3, 0]);
        let (cu0, cu1) = (Tensor::new(&[0u32, 0], &dev)?, Tensor::new(&[0u32, 5, 5], &dev)?);
        let qp = randn(&[5, 64], dt, &dev)?;
        let e = ms::maxsim_varlen(&qp.narrow(0, 0, 0)?, &cu0, 0, &qp, &cu1, 5)?;
        assert_eq!(e.to_vec2::<f32>()?, vec![vec![0f32, 0.0]]);
    }
    Ok(())
}

#[test]
fn kd_pairs_varlen_packed_pairs() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    for dt in DTYPES {
        let tol = gpu_tol(dt);
        // KD layout.
        let q = randn(&[3, 32, 96], dt, &cpu)?;
        let d = randn(&[3, 5, 70, 96], dt, &cpu)?;
        let qm = rand_mask(&[3, 32], 0.2, &cpu)?;
        let dm = rand_mask(&[3, 5, 70], 0.2, &cpu)?;
        let out = ms::maxsim(
            &q.to_device(&dev)?,
            &d.to_device(&dev)?,
            Some(&qm.to_device(&dev)?),
            Some(&dm.to_device(&dev)?),
        )?;
        assert_close("gpu kd", &out.to_device(&cpu)?, &r::maxsim(&q, &d, Some(&qm), Some(&dm))?, tol)?;
        // Pairs.
        let d2 = randn(&[3, 50, 96], dt, &cpu)?;
        let out = ms::maxsim_pairs(&q.to_device(&dev)?, &d2.to_device(&dev)?, None, None)?;
        assert_close("gpu pairs", &out.to_device(&cpu)?, &r::maxsim_pairs(&q, &d2, None, None)?, tol)?;
        // Varlen with empty sequences, and a long query (chunked).
        let (mut cu_q, mut lq) = rand_offsets(6, 40, 3);
        let last = *cu_q.last().unwrap();
        cu_q.push(last + 600);
        lq = lq.max(600);
        let (cu_d, ld) = rand_offsets(11, 400, 4);
        let qp = randn(&[*cu_q.last().unwrap() as usize, 128], dt, &cpu)?;
        let dp = randn(&[*cu_d.last().unwrap() as usize, 128], dt, &cpu)?;
        let cu_q = Tensor::new(cu_q, &cpu)?;
        let cu_d = Tensor::new(cu_d, &cpu)?;
        let out = ms::maxsim_varlen(
            &qp.to_device(&dev)?,
            &cu_q.to_device(&dev)?,
            lq,
            &dp.to_device(&dev)?,
            &cu_d.to_device(&dev)?,
            ld,
        )?;
        let want = r::maxsim_varlen(&qp, &cu_q, lq, &dp, &cu_d, ld)?;
        assert_close("gpu varlen", &out.to_device(&cpu)?, &want, tol)?;
        let pq = Tensor::new(&[0u32, 6, 3, 3, 1, 5, 2], &cpu)?;
        let pd = Tensor::new(&[8u32, 0, 3, 10, 1, 8, 3], &cpu)?;
        let out = ms::score_pairs_packed(
            &qp.to_device(&dev)?,
            &cu_q.to_device(&dev)?,
            lq,
            &dp.to_device(&dev)?,
            &cu_d.to_device(&dev)?,
            ld,
            &pq.to_device(&dev)?,
            &pd.to_device(&dev)?,
        )?;
        let want = r::score_pairs_packed(&qp, &cu_q, lq, &dp, &cu_d, ld, &pq, &pd)?;
        assert_close("gpu packed pairs", &out.to_device(&cpu)?, &want, tol)?;
    }
    Ok(())
}

#[test]
fn retrieve_and_layers() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    let q = randn(&[4, 32, 128], DType::F32, &cpu)?;
    let d = randn(&[300, 64, 128], DType::F32, &cpu)?;
    let dm = rand_mask(&[300, 64], 0.2, &cpu)?;
    let (s, i) = ms::retrieve(&q.to_device(&dev)?, &d.to_device(&dev)?, None, Some(&dm.to_device(&dev)?), 10, 64)?;
    let (ws, wi) = r::retrieve(&q, &d, None, Some(&dm), 10)?;
    assert_eq!(i.to_device(&cpu)?.to_vec2::<u32>()?, wi.to_vec2::<u32>()?);
    assert_close("gpu retrieve", &s.to_device(&cpu)?, &ws, 1e-3)?;
    let mut m = vec![1u8; 300 * 64];
    m[64..128].fill(0);
    let dm = Tensor::from_vec(m, (300, 64), &dev)?;
    let l: Vec<Vec<f32>> = ms::MaxSim.forward(&q.to_device(&dev)?, &d.to_device(&dev)?, None, Some(&dm))?.to_vec2()?;
    assert!(l.iter().all(|row| row[1] == -1e9));
    Ok(())
}

/// The argmax saved by the CUDA kernel picks a maximal valid token, and the
/// reference's token wherever the best two are clearly apart.
#[test]
fn argmax_matches_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    for dt in DTYPES {
        let (nq, nd, lq, ld, dim) = (3, 4, 40, 200, 128);
        let q = randn(&[nq, lq, dim], dt, &cpu)?;
        let d = randn(&[nd, ld, dim], dt, &cpu)?;
        let dm = rand_mask(&[nd, ld], 0.2, &cpu)?;
        let (_, am) =
            ms::maxsim_with_argmax(&q.to_device(&dev)?, &d.to_device(&dev)?, None, Some(&dm.to_device(&dev)?))?;
        let am: Vec<i32> = am.to_device(&cpu)?.flatten_all()?.to_vec1()?;
        let sim = q
            .to_dtype(DType::F32)?
            .unsqueeze(1)?
            .broadcast_matmul(&d.to_dtype(DType::F32)?.transpose(1, 2)?.unsqueeze(0)?)?;
        let sim: Vec<f32> = sim.flatten_all()?.to_vec1()?;
        let dmv: Vec<u8> = dm.flatten_all()?.to_vec1()?;
        let mut exact = 0;
        for i in 0..nq {
            for j in 0..nd {
                for s in 0..lq {
                    let row = &sim[((i * nd + j) * lq + s) * ld..][..ld];
                    let mut vals: Vec<(f32, usize)> =
                        (0..ld).filter(|&t| dmv[j * ld + t] != 0).map(|t| (row[t], t)).collect();
                    vals.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                    let got = am[(i * nd + j) * lq + s];
                    assert!(got >= 0 && dmv[j * ld + got as usize] != 0, "{dt:?}: argmax {got} is not a valid token");
                    let scale = vals[0].0.abs().max(1.0);
                    assert!(row[got as usize] >= vals[0].0 - 2e-2 * scale, "{dt:?}: argmax value too small");
                    if vals[0].0 - vals[1].0 > 5e-2 * scale {
                        assert_eq!(got as usize, vals[0].1, "{dt:?}: ({i},{j},{s})");
                        exact += 1;
                    }
                }
            }
        }
        assert!(exact > nq * nd * lq / 2, "too few clear winners to check ({exact})");
    }
    Ok(())
}

/// Exact ties: documents built from a few repeated rows, so a query row's
/// best value occurs at many tokens, within one tile, across tiles and with
/// masked tokens between; the saved argmax is the first valid occurrence.
/// Document 1 scores negative everywhere (negative maxima order the packed
/// argmax bits the other way). Run under each `CANDLE_MAXSIM_TILE` on the GPU.
#[test]
fn argmax_ties_pick_lowest_index() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    for dt in DTYPES {
        for &(nq, nd, lq, ld, dim) in &[(3, 4, 40, 300, 128), (8, 4, 128, 520, 96), (2, 3, 20, 70, 64)] {
            let pool_n = 5;
            // Query rows lean on feature 0; document 1's rows point away from it.
            let lean = Tensor::from_vec((0..dim).map(|k| if k == 0 { 8f32 } else { 0. }).collect(), dim, &cpu)?;
            let q = randn(&[nq, lq, dim], DType::F32, &cpu)?.broadcast_add(&lean)?;
            let pool = randn(&[nd, pool_n, dim], DType::F32, &cpu)?;
            let sign = Tensor::new(&[1f32, -1., 1., 1.][..nd], &cpu)?.reshape((nd, 1, 1))?;
            let pool = pool.broadcast_add(&lean.broadcast_mul(&sign)?)?;
            // Token t repeats pool row pick(j, t): rows 0..3 early, all five past ld / 2.
            let pick = |j: usize, t: usize| {
                let h = (t * 2654435761 + j * 40503) >> 7;
                if t < ld / 2 {
                    h % 3
                } else {
                    h % pool_n
                }
            };
            let idx: Vec<u32> = (0..nd).flat_map(|j| (0..ld).map(move |t| (j * pool_n + pick(j, t)) as u32)).collect();
            let d = pool
                .reshape((nd * pool_n, dim))?
                .index_select(&Tensor::from_vec(idx, nd * ld, &cpu)?, 0)?
                .reshape((nd, ld, dim))?;
            let (q, d) = (q.to_dtype(dt)?, d.to_dtype(dt)?);
            let dm = rand_mask(&[nd, ld], 0.1, &cpu)?;
            let (_, am) =
                ms::maxsim_with_argmax(&q.to_device(&dev)?, &d.to_device(&dev)?, None, Some(&dm.to_device(&dev)?))?;
            let am: Vec<i32> = am.to_device(&cpu)?.flatten_all()?.to_vec1()?;
            // Similarities of each query row with the pool rows, from the same rounded inputs.
            let pool_r = pool.to_dtype(dt)?.to_dtype(DType::F32)?;
            let sim =
                q.to_dtype(DType::F32)?.reshape((nq * lq, dim))?.matmul(&pool_r.reshape((nd * pool_n, dim))?.t()?)?;
            let sim: Vec<Vec<f32>> = sim.to_vec2()?;
            let dmv: Vec<u8> = dm.flatten_all()?.to_vec1()?;
            let (mut checked, mut negative, mut late) = (0, 0, 0);
            for i in 0..nq {
                for j in 0..nd {
                    let valid: Vec<usize> = (0..ld).filter(|&t| dmv[j * ld + t] != 0).collect();
                    for s in 0..lq {
                        let row = &sim[i * lq + s][j * pool_n..][..pool_n];
                        let mut present: Vec<usize> = valid.iter().map(|&t| pick(j, t)).collect();
                        present.sort();
                        present.dedup();
                        present.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                        let got = am[(i * nd + j) * lq + s];
                        if present.len() > 1
                            && row[present[0]] - row[present[1]] < 1e-2 * row[present[0]].abs().max(1.0)
                        {
                            continue; // two pool rows too close to call
                        }
                        let want = *valid.iter().find(|&&t| pick(j, t) == present[0]).unwrap();
                        assert_eq!(got, want as i32, "{dt:?} {nq}x{nd} lq{lq} ld{ld}: ({i},{j},{s})");
                        checked += 1;
                        negative += (row[present[0]] < 0.0) as usize;
                        late += (want >= ld / 2) as usize;
                    }
                }
            }
            let rows = nq * nd * lq;
            assert!(
                checked > rows * 3 / 4 && negative > nq * lq / 2 && late > 0,
                "{checked} / {negative} / {late} of {rows}"
            );
        }
    }
    Ok(())
}

/// Autograd through the CUDA forward (argmax saved on the device).
#[test]
fn gradients_through_cuda_forward() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    let q = randn(&[4, 32, 64], DType::F32, &cpu)?;
    let d = randn(&[5, 100, 64], DType::F32, &cpu)?;
    let w = randn(&[4, 5], DType::F32, &cpu)?;
    let grads = |dev: &Device| -> Result<(Tensor, Tensor)> {
        let (qv, dv) = (Var::from_tensor(&q.to_device(dev)?)?, Var::from_tensor(&d.to_device(dev)?)?);
        let s = ms::maxsim(qv.as_tensor(), dv.as_tensor(), None, None)?;
        let g = (s * w.to_device(dev)?)?.sum_all()?.backward()?;
        Ok((g.get(qv.as_tensor()).unwrap().to_device(&cpu)?, g.get(dv.as_tensor()).unwrap().to_device(&cpu)?))
    };
    let (gq, gd) = grads(&dev)?;
    let (cq, cd) = grads(&cpu)?;
    assert_close("gpu grad q", &gq, &cq, 1e-4)?;
    assert_close("gpu grad d", &gd, &cd, 1e-4)?;
    let _ = gd.i(0)?;
    Ok(())
}

/// Inputs on a coarse grid (multiples of 0.5): every similarity is exact in
/// f32 on both devices, so both pick the same winners (ties included) and
/// the gradients can be compared point by point.
fn grid(shape: &[usize], dt: DType) -> Result<Tensor> {
    ((Tensor::randn(0f32, 1., shape, &Device::Cpu)? * 2.0)?.round()? * 0.5)?.to_dtype(dt)
}

/// Gradient tolerances of issue 4.
fn grad_tol(dt: DType) -> f64 {
    match dt {
        DType::F16 => 1e-2,
        DType::BF16 => 2e-2,
        _ => 1e-4,
    }
}

type ScoreFn<'a> = dyn Fn(&Tensor, &Tensor) -> Result<Tensor> + 'a;

/// (grad_q, grad_d) of sum(w * f(q, d)) on `dev`, returned on the CPU.
fn grads_on(dev: &Device, q: &Tensor, d: &Tensor, w: &Tensor, f: &ScoreFn) -> Result<(Tensor, Tensor)> {
    let cpu = Device::Cpu;
    let (qv, dv) = (Var::from_tensor(&q.to_device(dev)?)?, Var::from_tensor(&d.to_device(dev)?)?);
    let s = f(qv.as_tensor(), dv.as_tensor())?;
    let g = s.to_dtype(DType::F32)?.broadcast_mul(&w.to_device(dev)?)?.sum_all()?.backward()?;
    Ok((g.get(qv.as_tensor()).unwrap().to_device(&cpu)?, g.get(dv.as_tensor()).unwrap().to_device(&cpu)?))
}

fn check_grads(what: &str, dev: &Device, q: &Tensor, d: &Tensor, w: &Tensor, dt: DType, f: &ScoreFn) -> Result<()> {
    let (gq, gd) = grads_on(dev, q, d, w, f)?;
    let (cq, cd) = grads_on(&Device::Cpu, q, d, w, f)?;
    assert_eq!(gq.dtype(), dt);
    assert_close(&format!("{what} {dt:?} grad q"), &gq, &cq, grad_tol(dt))?;
    assert_close(&format!("{what} {dt:?} grad d"), &gd, &cd, grad_tol(dt))?;
    Ok(())
}

#[test]
fn cuda_backward_all_layouts() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    for dt in DTYPES {
        // Dense with masks (one fully masked document), and normalize.
        let q = grid(&[5, 33, 64], dt)?;
        let d = grid(&[6, 150, 64], dt)?;
        let qm = rand_mask(&[5, 33], 0.2, &cpu)?;
        let mut dmv: Vec<u8> = rand_mask(&[6, 150], 0.2, &cpu)?.flatten_all()?.to_vec1()?;
        dmv[150..300].fill(0);
        let dm = Tensor::from_vec(dmv, (6, 150), &cpu)?;
        let w = randn(&[5, 6], DType::F32, &cpu)?;
        let (qmd, dmd) = (qm.to_device(&dev)?, dm.to_device(&dev)?);
        let masked = |q: &Tensor, d: &Tensor| {
            let (qm, dm) = if q.device().is_cuda() { (&qmd, &dmd) } else { (&qm, &dm) };
            ms::maxsim(q, d, Some(qm), Some(dm))
        };
        check_grads("dense masked", &dev, &q, &d, &w, dt, &masked)?;
        let (gq, gd) = grads_on(&dev, &q, &d, &w, &masked)?;
        let zq = gq.to_dtype(DType::F32)?.broadcast_mul(&qm.eq(0u8)?.to_dtype(DType::F32)?.unsqueeze(2)?)?;
        assert_eq!(zq.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0, "masked query rows get no gradient");
        let zd = gd.to_dtype(DType::F32)?.broadcast_mul(&dm.eq(0u8)?.to_dtype(DType::F32)?.unsqueeze(2)?)?;
        assert_eq!(zd.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0, "masked doc rows get no gradient");
        let opts = candle_maxsim::MaxSimOptions { normalize: true, ..Default::default() };
        let qn = randn(&[4, 20, 64], DType::F32, &cpu)?.to_dtype(dt)?;
        let dn = randn(&[3, 30, 64], DType::F32, &cpu)?.to_dtype(dt)?;
        if dt == DType::F32 {
            check_grads("normalize", &dev, &qn, &dn, &randn(&[4, 3], DType::F32, &cpu)?, dt, &|q, d| {
                ms::maxsim_with(q, d, None, None, &opts)
            })?;
        }
        // KD and pairs.
        let dk = grid(&[5, 3, 40, 64], dt)?;
        check_grads("kd", &dev, &q, &dk, &randn(&[5, 3], DType::F32, &cpu)?, dt, &|q, d| ms::maxsim(q, d, None, None))?;
        let dp = grid(&[5, 70, 64], dt)?;
        check_grads("pairs", &dev, &q, &dp, &randn(&[5], DType::F32, &cpu)?, dt, &|q, d| {
            ms::maxsim_pairs(q, d, None, None)
        })?;
        // Varlen and packed pairs (with empty sequences and a 600-token query).
        let (mut cu_q, mut lq) = rand_offsets(5, 40, 7);
        let last = *cu_q.last().unwrap();
        cu_q.push(last + 600);
        lq = lq.max(600);
        let (cu_d, ld) = rand_offsets(8, 200, 8);
        let qp = grid(&[*cu_q.last().unwrap() as usize, 96], dt)?;
        let dpk = grid(&[*cu_d.last().unwrap() as usize, 96], dt)?;
        let (cqc, cdc) = (Tensor::new(cu_q.clone(), &cpu)?, Tensor::new(cu_d.clone(), &cpu)?);
        let (cqg, cdg) = (cqc.to_device(&dev)?, cdc.to_device(&dev)?);
        let pick = |t: &Tensor, a: &Tensor, b: &Tensor| if t.device().is_cuda() { b.clone() } else { a.clone() };
        check_grads("varlen", &dev, &qp, &dpk, &randn(&[6, 8], DType::F32, &cpu)?, dt, &|q, d| {
            ms::maxsim_varlen(q, &pick(q, &cqc, &cqg), lq, d, &pick(q, &cdc, &cdg), ld)
        })?;
        let pq = Tensor::new(&[0u32, 5, 3, 3, 1, 5, 2, 0], &cpu)?;
        let pd = Tensor::new(&[7u32, 0, 3, 6, 1, 7, 3, 7], &cpu)?;
        let (pqg, pdg) = (pq.to_device(&dev)?, pd.to_device(&dev)?);
        check_grads("packed pairs", &dev, &qp, &dpk, &randn(&[8], DType::F32, &cpu)?, dt, &|q, d| {
            ms::score_pairs_packed(
                q,
                &pick(q, &cqc, &cqg),
                lq,
                d,
                &pick(q, &cdc, &cdg),
                ld,
                &pick(q, &pq, &pqg),
                &pick(q, &pd, &pdg),
            )
        })?;
    }
    Ok(())
}

/// Bitwise identical gradients across runs, and a hot bucket: every query
/// token of every query picks the same document token.
#[test]
fn cuda_backward_deterministic_and_hot_bucket() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    let opts = candle_maxsim::MaxSimOptions { normalize: false, backward: candle_maxsim::Backward::LowMem };
    let q = randn(&[64, 32, 128], DType::F32, &cpu)?.abs()?.to_dtype(DType::BF16)?;
    let mut d = randn(&[16, 100, 128], DType::F32, &cpu)?;
    // Token 7 of every document: a large all-positive vector, the winner for all.
    let hot = Tensor::ones((16, 1, 128), DType::F32, &cpu)?.affine(5.0, 0.0)?;
    d = d.slice_assign(&[0..16, 7..8, 0..128], &hot)?.to_dtype(DType::BF16)?;
    let w = randn(&[64, 16], DType::F32, &cpu)?;
    let f = |q: &Tensor, d: &Tensor| ms::maxsim_with(q, d, None, None, &opts);
    let mut first: Option<(Vec<f32>, Vec<f32>)> = None;
    for _ in 0..3 {
        let (gq, gd) = grads_on(&dev, &q, &d, &w, &f)?;
        let cur =
            (gq.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?, gd.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?);
        match &first {
            None => first = Some(cur),
            Some(f0) => assert!(f0 == &cur, "LowMem gradients differ between runs"),
        }
    }
    check_grads("hot bucket", &dev, &q, &d, &w, DType::BF16, &f)?;
    let (_, gd) = grads_on(&dev, &q, &d, &w, &f)?;
    let per_token = gd.to_dtype(DType::F32)?.abs()?.sum(2)?.sum(0)?; // [100]
    let v: Vec<f32> = per_token.to_vec1()?;
    assert!(v[7] > 0.0 && v.iter().enumerate().all(|(t, &x)| t == 7 || x == 0.0), "only token 7 wins");
    Ok(())
}

/// Operands on different devices are an `Err` naming the argument.
#[test]
fn device_mismatch_is_an_error() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    let q = randn(&[2, 4, 32], DType::F32, &dev)?;
    let d = randn(&[3, 5, 32], DType::F32, &cpu)?;
    let e = ms::maxsim(&q, &d, None, None).unwrap_err().to_string();
    assert!(e.contains("d:"), "{e}");
    let dm = Tensor::ones((3, 5), DType::U8, &cpu)?;
    let e = ms::maxsim(&q, &d.to_device(&dev)?, None, Some(&dm)).unwrap_err().to_string();
    assert!(e.contains("d_mask"), "{e}");
    Ok(())
}

/// `plaid_approx_score` on CUDA vs `reference` and the CPU op: U32 and I64
/// codes, empty and full documents, query lengths that take every kernel
/// variant (the row kernel with full and partial lane groups; the general
/// kernel's 16-byte and scalar row loads, 8/16/32 lanes per row, chunks of
/// query tokens), non-contiguous codes, padding codes that are never read.
#[test]
fn plaid_approx_cuda() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    for (n_c, lq, b, ld) in [
        (300, 32, 67, 64),
        (50, 7, 33, 20),
        (1000, 128, 40, 100),
        (200, 64, 50, 40),
        (64, 33, 21, 5),
        (9, 1, 10, 3),
        // The row kernel with lanes left out of each group (Lq / 4 = 1, 3, 5, 15).
        (100, 4, 30, 33),
        (500, 12, 40, 70),
        (70, 20, 25, 40),
        (100, 60, 30, 40),
    ] {
        for (lq, misaligned) in [(lq, false), (lq, true), (lq + 68, false)] {
            // A view that starts one element into its buffer: rows are not 16-byte aligned.
            let qcs = if misaligned {
                randn(&[n_c * lq + 1], DType::F32, &cpu)?.narrow(0, 1, n_c * lq)?.reshape((n_c, lq))?
            } else {
                randn(&[n_c, lq], DType::F32, &cpu)?
            };
            let mut lens: Vec<u32> = (0..b as u32).map(|i| (i * 7919) % (ld as u32 + 1)).collect();
            lens[0] = 0;
            lens[1] = ld as u32;
            let codes = Tensor::rand(0f32, n_c as f32, (b, ld), &cpu)?.to_dtype(DType::U32)?;
            // I64 codes with -1 past each length (fast-plaid's padding): never read.
            let padded: Vec<i64> = codes
                .flatten_all()?
                .to_vec1::<u32>()?
                .iter()
                .enumerate()
                .map(|(k, &c)| if (k % ld) as u32 >= lens[k / ld] { -1 } else { c as i64 })
                .collect();
            let codes64 = Tensor::from_vec(padded, (b, ld), &cpu)?;
            let lens = Tensor::new(lens, &cpu)?;
            let what = format!("plaid approx C{n_c} lq{lq} b{b} ld{ld} misaligned={misaligned}");
            let want = r::plaid_approx_score(&qcs, &codes, &lens)?;
            for c in [&codes, &codes64] {
                let out = ms::plaid_approx_score(&qcs.to_device(&dev)?, &c.to_device(&dev)?, &lens.to_device(&dev)?)?;
                let out = out.to_device(&cpu)?;
                assert_close(&format!("{what} {:?} vs reference", c.dtype()), &out, &want, 1e-4)?;
                assert_close(
                    &format!("{what} {:?} vs cpu op", c.dtype()),
                    &out,
                    &ms::plaid_approx_score(&qcs, c, &lens)?,
                    1e-4,
                )?;
                assert_eq!(out.to_vec1::<f32>()?[0], 0.0, "{what}: an empty document scores exactly 0");
            }
            // Non-contiguous codes: a transposed view.
            let ct = codes.t()?.contiguous()?.t()?;
            let out = ms::plaid_approx_score(&qcs.to_device(&dev)?, &ct.to_device(&dev)?, &lens.to_device(&dev)?)?;
            assert_close(&format!("{what} transposed codes"), &out.to_device(&cpu)?, &want, 1e-4)?;
        }
    }
    // The benchmark shape (65 536 centroids, Lq 32, 100 000 documents of up to 64 codes) vs the CPU op.
    let (n_c, lq, b, ld) = (65536, 32, 100_000, 64);
    let qcs = randn(&[n_c, lq], DType::F32, &cpu)?;
    let codes = Tensor::rand(0f32, n_c as f32, (b, ld), &cpu)?.to_dtype(DType::U32)?.to_dtype(DType::I64)?;
    let lens = Tensor::rand(0f32, ld as f32 + 1.0, b, &cpu)?.to_dtype(DType::U32)?.clamp(0u32, ld as u32)?;
    let out = ms::plaid_approx_score(&qcs.to_device(&dev)?, &codes.to_device(&dev)?, &lens.to_device(&dev)?)?;
    assert_close(
        "plaid approx bench shape",
        &out.to_device(&cpu)?,
        &ms::plaid_approx_score(&qcs, &codes, &lens)?,
        1e-4,
    )?;
    // Empty batch.
    let e = ms::plaid_approx_score(
        &qcs.to_device(&dev)?,
        &codes.narrow(0, 0, 0)?.to_device(&dev)?,
        &lens.narrow(0, 0, 0)?.to_device(&dev)?,
    )?;
    assert_eq!(e.dims(), &[0]);
    Ok(())
}

/// `plaid_approx_score` on CUDA on inputs full of near-ties: many scores a
/// hair apart, exact ties, repeated codes, documents of up to 200 codes,
/// query lengths from 16 to 520, a table of one value, and a table whose
/// range overflows f32 (in a row no document uses). Session 6 used it to
/// check an exact byte-filter strategy (BENCHMARKS.md, note 32); it stays as
/// a harder parity test of the gather kernel.
#[test]
fn plaid_approx_cuda_ties() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    for (n_c, lq, b, ld) in [
        (40, 16, 300, 200),
        (64, 20, 200, 64),
        (50, 40, 100, 130),
        (30, 100, 60, 33),
        (20, 300, 20, 9),
        (16, 520, 10, 7),
    ] {
        // Few levels, each with nearby distinct values: the same byte, different floats.
        let levels = (randn(&[n_c, lq], DType::F32, &cpu)? * 2.0)?.round()?;
        let jitter = (randn(&[n_c, lq], DType::F32, &cpu)? * 1e-3)?;
        let ties = Tensor::rand(0f32, 1., (n_c, lq), &cpu)?.ge(0.5)?.to_dtype(DType::F32)?;
        let tables = [
            ("levels", (&levels + jitter.mul(&ties)?)?),
            ("one value", Tensor::full(0.25f32, (n_c, lq), &cpu)?),
            ("overflowing range", levels.slice_assign(&[0..1, 0..2], &Tensor::new(&[[3e38f32, -3e38]], &cpu)?)?),
        ];
        let lens: Vec<u32> = (0..b as u32).map(|i| 1 + (i * 7919) % ld as u32).collect();
        let lens = Tensor::new(lens, &cpu)?;
        // Few centroids for many tokens: repeated codes. Code 0 is never used.
        let codes = Tensor::rand(1f32, n_c as f32, (b, ld), &cpu)?.to_dtype(DType::U32)?.clamp(1u32, n_c as u32 - 1)?;
        for (what, qcs) in &tables {
            let want = ms::plaid_approx_score(qcs, &codes, &lens)?;
            for c in [codes.clone(), codes.to_dtype(DType::I64)?] {
                let out = ms::plaid_approx_score(&qcs.to_device(&dev)?, &c.to_device(&dev)?, &lens.to_device(&dev)?)?;
                assert_close(
                    &format!("filter {what} C{n_c} lq{lq} b{b} ld{ld} {:?}", c.dtype()),
                    &out.to_device(&cpu)?,
                    &want,
                    1e-4,
                )?;
            }
        }
    }
    Ok(())
}

/// Out-of-range codes and lengths are an `Err` naming the argument (found on
/// the device, never read out of bounds), the first one in document order as
/// the CPU op reports it; the device stays usable.
#[test]
fn plaid_approx_cuda_errors() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let qcs = randn(&[10, 32], DType::F32, &dev)?;
    let lens = Tensor::new(&[3u32, 2, 3], &dev)?;
    let err_for = |qcs: &Tensor, codes: Tensor, lens: &Tensor| -> String {
        let e = ms::plaid_approx_score(qcs, &codes, lens).unwrap_err().to_string();
        let cpu = Device::Cpu;
        let e_cpu = ms::plaid_approx_score(
            &qcs.to_device(&cpu).unwrap(),
            &codes.to_device(&cpu).unwrap(),
            &lens.to_device(&cpu).unwrap(),
        )
        .unwrap_err()
        .to_string();
        // The message, without the backtrace candle may append.
        let first = |s: &str| s.lines().next().unwrap_or_default().to_string();
        let (e, e_cpu) = (first(&e), first(&e_cpu));
        assert_eq!(e, e_cpu, "CUDA and CPU report the same error");
        e
    };
    let err = |codes: Tensor, lens: &Tensor| err_for(&qcs, codes, lens);
    let e = err(Tensor::new(&[[1u32, 2, 3], [4, 5, 6], [7, 10, 99]], &dev)?, &lens);
    assert!(e.contains("codes[2, 1] = 10"), "{e}");
    let e = err(Tensor::new(&[[1i64, 2, 3], [4, -5, 6], [7, 10, 99]], &dev)?, &lens);
    assert!(e.contains("codes[1, 1] = -5"), "{e}");
    // Past doc_lens[1] = 2: codes[1, 2] is padding and never read.
    let ok = ms::plaid_approx_score(&qcs, &Tensor::new(&[[1i64, 2, 3], [4, 5, -1], [7, 8, 9]], &dev)?, &lens)?;
    assert_eq!(ok.dims(), &[3]);
    let e = err(Tensor::new(&[[1u32, 2, 3], [4, 5, 6], [7, 10, 99]], &dev)?, &Tensor::new(&[3u32, 4, 3], &dev)?);
    assert!(e.contains("doc_lens[1] = 4"), "{e}");
    let e = err(Tensor::new(&[[1u32, 2, 3], [4, 5, 6], [7, 8, 9]], &dev)?, &Tensor::new(&[3u32, 4, 3], &dev)?);
    assert!(e.contains("doc_lens"), "{e}");
    // Past a document's first 32 codes (the row kernel's second chunk), for
    // the row kernel's query lengths and the general kernel's, and with C = 0.
    for (n_c, lq) in [(10, 16), (10, 32), (10, 64), (10, 20), (0, 32)] {
        let qcs = randn(&[n_c, lq], DType::F32, &dev)?;
        let mut codes = vec![1i64; 3 * 40];
        codes[40 + 35] = 10;
        codes[2 * 40 + 39] = -3;
        let codes = Tensor::from_vec(codes, (3, 40), &dev)?;
        let e = err_for(&qcs, codes.clone(), &Tensor::new(&[0u32, 36, 40], &dev)?);
        let want = if n_c == 0 { "codes[1, 0] = 1" } else { "codes[1, 35] = 10" };
        assert!(e.contains(want), "C{n_c} lq{lq}: {e}");
        if n_c > 0 {
            let e = err_for(&qcs, codes.to_dtype(DType::U32)?, &Tensor::new(&[0u32, 35, 40], &dev)?);
            assert!(e.contains("codes[2, 39] = 4294967293"), "lq{lq}: {e}");
            let e = err_for(&qcs, codes, &Tensor::new(&[0u32, 35, 41], &dev)?);
            assert!(e.contains("doc_lens[2] = 41"), "lq{lq}: {e}");
        }
    }
    // Still usable.
    let ok = ms::plaid_approx_score(&qcs, &Tensor::new(&[[1u32, 2, 3], [4, 5, 6], [7, 8, 9]], &dev)?, &lens)?;
    assert_eq!(ok.dims(), &[3]);
    Ok(())
}

/// Random compressed documents: (codec, codes [Nd, Ld] U32 with garbage past
/// each length, residual bytes [Nd, Ld, w], doc_lens [Nd] with 0 and Ld).
fn residual_docs(
    nd: usize,
    ld: usize,
    dim: usize,
    nbits: usize,
    order: ms::BitOrder,
    seed: u64,
) -> Result<(ms::ResidualCodec, Tensor, Tensor, Tensor)> {
    let cpu = Device::Cpu;
    let n_c = 97;
    let bw: Vec<f32> = (0..1 << nbits).map(|k| (k as f32 - (1 << nbits) as f32 / 2.0) * 0.04).collect();
    let codec = ms::ResidualCodec {
        centroids: randn(&[n_c, dim], DType::F16, &cpu)?,
        bucket_weights: Tensor::new(bw, &cpu)?,
        nbits,
        bit_order: order,
    };
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) as u32
    };
    let lens: Vec<u32> = (0..nd)
        .map(|j| {
            if j == 1 {
                0
            } else if j == 2 {
                ld as u32
            } else {
                next() % (ld as u32 + 1)
            }
        })
        .collect();
    let codes: Vec<u32> = (0..nd * ld)
        .map(|t| if (t % ld) < lens[t / ld] as usize { next() % n_c as u32 } else { 4_000_000_000 })
        .collect();
    let w = dim * nbits / 8;
    let bytes: Vec<u8> = (0..nd * ld * w).map(|_| next() as u8).collect();
    Ok((
        codec,
        Tensor::from_vec(codes, (nd, ld), &cpu)?,
        Tensor::from_vec(bytes, (nd, ld, w), &cpu)?,
        Tensor::from_vec(lens, nd, &cpu)?,
    ))
}

fn codec_on(c: &ms::ResidualCodec, dev: &Device) -> Result<ms::ResidualCodec> {
    Ok(ms::ResidualCodec {
        centroids: c.centroids.to_device(dev)?,
        bucket_weights: c.bucket_weights.to_device(dev)?,
        nbits: c.nbits,
        bit_order: c.bit_order,
    })
}

/// Fused residual scoring on the GPU (padded and varlen, both bit orders,
/// nbits 2/4/8, with and without normalize, U32 and I64 codes) against
/// `reference`; the gradient path against the CPU op; bad codes.
#[test]
fn residual_cuda() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    // Queries of up to 32 rows at dims 64 / 96 / 128 take the warp kernel
    // (kernels/residual.cu); 40 rows and dim 48 the tile kernels.
    for (dim, nq, lq, nd, ld) in
        [(128, 3, 32, 40, 150), (64, 2, 20, 33, 70), (96, 1, 32, 25, 300), (48, 4, 8, 9, 64), (128, 2, 40, 20, 90)]
    {
        for nbits in [2usize, 4, 8] {
            for order in [ms::BitOrder::ColBert, ms::BitOrder::Lsb] {
                let (c, codes, res, lens) = residual_docs(nd, ld, dim, nbits, order, (dim * nbits) as u64)?;
                let cg = codec_on(&c, &dev)?;
                for dt in [DType::BF16, DType::F16] {
                    let q = randn(&[nq, lq, dim], dt, &cpu)?;
                    for normalize in [false, true] {
                        let what = format!("residual d{dim} nb{nbits} {order:?} {dt:?} norm={normalize}");
                        let want = r::maxsim_residual(&q, &codes, &res, &lens, &c, normalize)?;
                        let tol = if normalize { 3e-2 } else { gpu_tol(dt) };
                        for codes_t in [codes.clone(), codes.to_dtype(DType::I64)?] {
                            let out = ms::maxsim_residual(
                                &q.to_device(&dev)?,
                                &codes_t.to_device(&dev)?,
                                &res.to_device(&dev)?,
                                &lens.to_device(&dev)?,
                                &cg,
                                normalize,
                            )?;
                            assert_close(&what, &out.to_device(&cpu)?, &want, tol)?;
                        }
                    }
                    // Varlen: the valid tokens packed, cu_d from the lengths (one empty doc).
                    let lv: Vec<u32> = lens.to_vec1()?;
                    let keep: Vec<u32> =
                        (0..nd * ld).filter(|t| (t % ld) < lv[t / ld] as usize).map(|t| t as u32).collect();
                    let keep = Tensor::new(keep, &cpu)?;
                    let pcodes = codes.flatten_all()?.index_select(&keep, 0)?;
                    let pres = res.reshape((nd * ld, dim * nbits / 8))?.index_select(&keep, 0)?;
                    let mut cu = vec![0u32];
                    for l in &lv {
                        cu.push(cu.last().unwrap() + l);
                    }
                    let cu = Tensor::new(cu, &cpu)?;
                    let want = r::maxsim_residual_varlen(&q, &pcodes, &pres, &cu, ld, &c, true)?;
                    let out = ms::maxsim_residual_varlen(
                        &q.to_device(&dev)?,
                        &pcodes.to_device(&dev)?,
                        &pres.to_device(&dev)?,
                        &cu.to_device(&dev)?,
                        ld,
                        &cg,
                        true,
                    )?;
                    assert_close(
                        &format!("varlen d{dim} nb{nbits} {order:?} {dt:?}"),
                        &out.to_device(&cpu)?,
                        &want,
                        3e-2,
                    )?;
                }
            }
        }
    }
    // Gradient to q (decompression kernel + dense op) against the CPU op.
    let (c, codes, res, lens) = residual_docs(12, 80, 128, 4, ms::BitOrder::ColBert, 7)?;
    let cg = codec_on(&c, &dev)?;
    let q = randn(&[3, 16, 128], DType::F32, &cpu)?.to_dtype(DType::F16)?;
    let grad_on = |d: &Device, c: &ms::ResidualCodec| -> Result<Tensor> {
        let v = Var::from_tensor(&q.to_device(d)?)?;
        let s = ms::maxsim_residual(
            v.as_tensor(),
            &codes.to_device(d)?,
            &res.to_device(d)?,
            &lens.to_device(d)?,
            c,
            false,
        )?;
        let g = s.sum_all()?.backward()?;
        g.get(v.as_tensor()).expect("grad of q").to_device(&Device::Cpu)?.to_dtype(DType::F32)
    };
    let (gg, gc) = (grad_on(&dev, &cg)?, grad_on(&cpu, &c)?);
    assert_close("residual grad q (cuda vs cpu op)", &gg, &gc, 1e-2)?;
    // Out-of-range codes inside a document: an Err naming codes.
    let bad = codes.to_dtype(DType::I64)?;
    let bad = bad.slice_assign(&[0..1, 0..1], &Tensor::new(&[[-5i64]], &cpu)?)?;
    let e = ms::maxsim_residual(
        &q.to_device(&dev)?,
        &bad.to_device(&dev)?,
        &res.to_device(&dev)?,
        &lens.ones_like()?.to_device(&dev)?,
        &cg,
        false,
    )
    .expect_err("negative code");
    assert!(e.to_string().contains("codes"), "{e}");
    // The same through the warp kernel's own check: a U32 code past the
    // centroids in a packed document, and in a padded one.
    let pcodes = Tensor::new(&[3u32, 97, 5], &cpu)?;
    let pres = res.reshape((12 * 80, 64))?.narrow(0, 0, 3)?;
    let e = ms::maxsim_residual_varlen(
        &q.to_device(&dev)?,
        &pcodes.to_device(&dev)?,
        &pres.to_device(&dev)?,
        &Tensor::new(&[0u32, 1, 3], &cpu)?.to_device(&dev)?,
        2,
        &cg,
        false,
    )
    .expect_err("code 97 of 97 centroids");
    assert!(e.to_string().contains("codes"), "{e}");
    let e = ms::maxsim_residual(
        &q.to_device(&dev)?,
        &codes.to_dtype(DType::U32)?.slice_assign(&[3..4, 0..1], &Tensor::new(&[[200u32]], &cpu)?)?.to_device(&dev)?,
        &res.to_device(&dev)?,
        // Only document 3's first token is scored.
        &Tensor::new(&[0u32, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0], &cpu)?.to_device(&dev)?,
        &cg,
        false,
    )
    .expect_err("code 200 of 97 centroids");
    assert!(e.to_string().contains("codes"), "{e}");
    Ok(())
}

// ---------------------------------------------------------------------------
// Backward modes (issue 4): Unified and LowMem each tested explicitly.
// ---------------------------------------------------------------------------

type ModeFn<'a> = dyn Fn(&Tensor, &Tensor, ms::Backward) -> Result<Tensor> + 'a;

fn opts_for(backward: ms::Backward) -> ms::MaxSimOptions {
    ms::MaxSimOptions { normalize: false, backward }
}

/// Raw bits of a gradient (F16 / BF16 / F32 widen exactly), for bitwise comparisons.
fn grad_bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

/// Unified vs LowMem grad_D: f32 sums in another order can flip the last bit
/// of an F16 / BF16 output element (2^-7 of it in BF16).
fn mode_tol(dt: DType) -> f64 {
    match dt {
        DType::BF16 => 1e-2,
        _ => 2e-3,
    }
}

/// Both modes on the GPU against the CPU op, Unified against LowMem, LowMem
/// bitwise identical over 3 runs. Returns the LowMem gradients.
#[allow(clippy::too_many_arguments)]
fn check_modes(
    what: &str,
    dev: &Device,
    q: &Tensor,
    d: &Tensor,
    w: &Tensor,
    dt: DType,
    f: &ModeFn,
) -> Result<(Tensor, Tensor)> {
    let with = |m: ms::Backward| move |q: &Tensor, d: &Tensor| f(q, d, m);
    let (cq, cd) = grads_on(&Device::Cpu, q, d, w, &with(ms::Backward::LowMem))?;
    let (lq, ld) = grads_on(dev, q, d, w, &with(ms::Backward::LowMem))?;
    let (uq, ud) = grads_on(dev, q, d, w, &with(ms::Backward::Unified))?;
    for (m, gq, gd) in [("lowmem", &lq, &ld), ("unified", &uq, &ud)] {
        assert_eq!(gq.dtype(), dt);
        assert_eq!(gd.dtype(), dt);
        assert_close(&format!("{what} {dt:?} {m} grad q"), gq, &cq, grad_tol(dt))?;
        assert_close(&format!("{what} {dt:?} {m} grad d"), gd, &cd, grad_tol(dt))?;
    }
    assert_close(&format!("{what} {dt:?} unified vs lowmem grad q"), &uq, &lq, 1e-5)?;
    assert_close(&format!("{what} {dt:?} unified vs lowmem grad d"), &ud, &ld, mode_tol(dt))?;
    let (bq, bd) = (grad_bits(&lq)?, grad_bits(&ld)?);
    for run in 0..2 {
        let (rq, rd) = grads_on(dev, q, d, w, &with(ms::Backward::LowMem))?;
        assert!(grad_bits(&rq)? == bq, "{what} {dt:?}: LowMem grad q differs in run {}", run + 2);
        assert!(grad_bits(&rd)? == bd, "{what} {dt:?}: LowMem grad d differs in run {}", run + 2);
    }
    Ok((lq, ld))
}

/// Sum of |x| over the rows of `g` (`[rows, dim]` after flattening) where `keep` is 0.
fn masked_mass(g: &Tensor, keep: &Tensor) -> Result<f32> {
    let rows = keep.elem_count();
    let g = g.to_dtype(DType::F32)?.reshape((rows, ()))?;
    let off = keep.flatten_all()?.eq(0u8)?.to_dtype(DType::F32)?.unsqueeze(1)?;
    g.abs()?.broadcast_mul(&off)?.sum_all()?.to_scalar::<f32>()
}

/// Dense in-batch with query and document masks (one document fully masked),
/// dims 33 / 128 / 250 (scalar and 16-byte paths), every dtype.
#[test]
fn cuda_backward_modes_dense_masked() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    for dim in [33, 128, 250] {
        for dt in DTYPES {
            let (nq, lq, nd, ld) = (5, 19, 6, 70);
            let q = grid(&[nq, lq, dim], dt)?;
            let d = grid(&[nd, ld, dim], dt)?;
            let qm = rand_mask(&[nq, lq], 0.2, &cpu)?;
            let mut dmv: Vec<u8> = rand_mask(&[nd, ld], 0.2, &cpu)?.flatten_all()?.to_vec1()?;
            dmv[2 * ld..3 * ld].fill(0);
            let dm = Tensor::from_vec(dmv, (nd, ld), &cpu)?;
            let (qmd, dmd) = (qm.to_device(&dev)?, dm.to_device(&dev)?);
            let w = randn(&[nq, nd], DType::F32, &cpu)?;
            let f = |q: &Tensor, d: &Tensor, m: ms::Backward| {
                let (qm, dm) = if q.device().is_cuda() { (&qmd, &dmd) } else { (&qm, &dm) };
                ms::maxsim_with(q, d, Some(qm), Some(dm), &opts_for(m))
            };
            let what = format!("dense masked d{dim}");
            let (gq, gd) = check_modes(&what, &dev, &q, &d, &w, dt, &f)?;
            assert_eq!(masked_mass(&gq, &qm)?, 0.0, "{what}: masked query rows get no gradient");
            assert_eq!(masked_mass(&gd, &dm)?, 0.0, "{what}: masked doc rows get no gradient");
            // Unified too.
            let uf = |q: &Tensor, d: &Tensor| f(q, d, ms::Backward::Unified);
            let (uq, ud) = grads_on(&dev, &q, &d, &w, &uf)?;
            assert_eq!(masked_mass(&uq, &qm)?, 0.0, "{what}: unified, masked query rows");
            assert_eq!(masked_mass(&ud, &dm)?, 0.0, "{what}: unified, masked doc rows");
        }
    }
    Ok(())
}

/// List mode: KD (each query its own K documents) and pairs, both modes.
#[test]
fn cuda_backward_modes_kd_and_pairs() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    for dim in [33, 128, 250] {
        for dt in DTYPES {
            let q = grid(&[6, 21, dim], dt)?;
            let dk = grid(&[6, 3, 45, dim], dt)?;
            let w = randn(&[6, 3], DType::F32, &cpu)?;
            check_modes(&format!("kd d{dim}"), &dev, &q, &dk, &w, dt, &|q, d, m| {
                ms::maxsim_with(q, d, None, None, &opts_for(m))
            })?;
            let dp = grid(&[6, 80, dim], dt)?;
            let dm = rand_mask(&[6, 80], 0.3, &cpu)?;
            let dmd = dm.to_device(&dev)?;
            let w = randn(&[6], DType::F32, &cpu)?;
            check_modes(&format!("pairs d{dim}"), &dev, &q, &dp, &w, dt, &|q, d, m| {
                let dm = if q.device().is_cuda() { &dmd } else { &dm };
                ms::maxsim_pairs_with(q, d, None, Some(dm), &opts_for(m))
            })?;
        }
    }
    Ok(())
}

/// Hot buckets: in half of the documents token 7 wins for every query token
/// (2048 winners on one row: the block-per-row path), the other documents
/// are ordinary (the warp-per-row path), one document is fully masked.
#[test]
fn cuda_backward_modes_hot_bucket() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    for dim in [33, 128, 250] {
        for dt in DTYPES {
            let (nq, lq, nd, ld) = (64, 32, 6, 100);
            // Grid values: exact similarities, so CPU and GPU pick the same winners.
            let q = grid(&[nq, lq, dim], DType::F32)?.abs()?.to_dtype(dt)?;
            let mut d = grid(&[nd, ld, dim], DType::F32)?;
            let hot = Tensor::ones((nd / 2, 1, dim), DType::F32, &cpu)?.affine(5.0, 0.0)?;
            d = d.slice_assign(&[0..nd / 2, 7..8, 0..dim], &hot)?.to_dtype(dt)?;
            let mut dmv = vec![1u8; nd * ld];
            dmv[(nd - 1) * ld..].fill(0);
            let dm = Tensor::from_vec(dmv, (nd, ld), &cpu)?;
            let dmd = dm.to_device(&dev)?;
            let w = randn(&[nq, nd], DType::F32, &cpu)?;
            let f = |q: &Tensor, d: &Tensor, m: ms::Backward| {
                let dm = if q.device().is_cuda() { &dmd } else { &dm };
                ms::maxsim_with(q, d, None, Some(dm), &opts_for(m))
            };
            let (_, gd) = check_modes(&format!("hot bucket d{dim}"), &dev, &q, &d, &w, dt, &f)?;
            let per_token: Vec<f32> = gd.to_dtype(DType::F32)?.abs()?.sum(2)?.i(0..nd / 2)?.sum(0)?.to_vec1()?;
            assert!(per_token[7] > 0.0, "d{dim} {dt:?}: token 7 wins");
            assert!(per_token.iter().enumerate().all(|(t, &x)| t == 7 || x == 0.0), "d{dim} {dt:?}: only token 7");
            assert_eq!(masked_mass(&gd, &dm)?, 0.0, "d{dim} {dt:?}: masked document");
        }
    }
    Ok(())
}

/// Packed (varlen) in-batch with empty sequences. 256 x 256 with short
/// queries resolves Auto to LowMem; a small batch resolves to Unified.
#[test]
fn cuda_backward_modes_varlen() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    for (nq, nd, mq, md, seed) in [(256, 256, 12, 30, 11), (7, 9, 40, 130, 12)] {
        for (dim, dt) in [(33, DType::F32), (128, DType::BF16), (250, DType::F16)] {
            let (cu_q, lq) = rand_offsets(nq, mq, seed);
            let (cu_d, ld) = rand_offsets(nd, md, seed + 1);
            let q = grid(&[*cu_q.last().unwrap() as usize, dim], dt)?;
            let d = grid(&[*cu_d.last().unwrap() as usize, dim], dt)?;
            let (cqc, cdc) = (Tensor::new(cu_q.clone(), &cpu)?, Tensor::new(cu_d.clone(), &cpu)?);
            let (cqg, cdg) = (cqc.to_device(&dev)?, cdc.to_device(&dev)?);
            let f = |q: &Tensor, d: &Tensor| {
                let (cq, cd) = if q.device().is_cuda() { (&cqg, &cdg) } else { (&cqc, &cdc) };
                ms::maxsim_varlen(q, cq, lq, d, cd, ld)
            };
            let w = randn(&[nq, nd], DType::F32, &cpu)?;
            let what = format!("varlen {nq}x{nd} d{dim}");
            check_grads(&what, &dev, &q, &d, &w, dt, &f)?;
            let (gq, gd) = grads_on(&dev, &q, &d, &w, &f)?;
            let (gq2, gd2) = grads_on(&dev, &q, &d, &w, &f)?;
            if nq >= 256 {
                assert!(grad_bits(&gq)? == grad_bits(&gq2)?, "{what}: LowMem grad q differs between runs");
                assert!(grad_bits(&gd)? == grad_bits(&gd2)?, "{what}: LowMem grad d differs between runs");
            }
        }
    }
    Ok(())
}

/// Every kernel variant: 16-byte paths with 8 / 16 / 32 lanes per row and
/// 2 chunks per lane, scalar paths, several column passes, in both modes.
#[test]
fn cuda_backward_modes_dims() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    let f64_dims = [33, 128, 250];
    for dim in [1, 8, 16, 24, 33, 64, 96, 128, 200, 250, 256, 300, 512, 768] {
        let f64_too = f64_dims.contains(&dim).then_some(DType::F64);
        for dt in DTYPES.into_iter().chain(f64_too) {
            let q = grid(&[3, 9, dim], dt)?;
            let d = grid(&[4, 23, dim], dt)?;
            let w = randn(&[3, 4], DType::F32, &cpu)?;
            check_modes(&format!("dims d{dim}"), &dev, &q, &d, &w, dt, &|q, d, m| {
                ms::maxsim_with(q, d, None, None, &opts_for(m))
            })?;
        }
    }
    Ok(())
}

/// Documents longer than one shared-memory count chunk (2048 tokens), and a
/// q whose device address is not 16-byte aligned (the scalar path at dim 128).
#[test]
fn cuda_backward_modes_long_docs_and_unaligned() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    for dt in DTYPES {
        let q = grid(&[3, 16, 40], dt)?;
        let d = grid(&[2, 5000, 40], dt)?;
        let dm = rand_mask(&[2, 5000], 0.1, &cpu)?;
        let dmd = dm.to_device(&dev)?;
        let w = randn(&[3, 2], DType::F32, &cpu)?;
        check_modes("long docs", &dev, &q, &d, &w, dt, &|q, d, m| {
            let dm = if q.device().is_cuda() { &dmd } else { &dm };
            ms::maxsim_with(q, d, None, Some(dm), &opts_for(m))
        })?;
        // Past 32767 rows per document the saved argmax stays I32 (I16 below).
        let q = grid(&[2, 8, 16], dt)?;
        let d = grid(&[2, 33000, 16], dt)?;
        let w = randn(&[2, 2], DType::F32, &cpu)?;
        check_modes("docs over 32767 rows", &dev, &q, &d, &w, dt, &|q, d, m| {
            ms::maxsim_with(q, d, None, None, &opts_for(m))
        })?;
        // q viewed one element into a fresh buffer: contiguous, 2-4 bytes off 16-byte alignment.
        let q = grid(&[4, 10, 128], dt)?;
        let d = grid(&[5, 30, 128], dt)?;
        let w = randn(&[4, 5], DType::F32, &cpu)?;
        check_modes("unaligned q", &dev, &q, &d, &w, dt, &|q, d, m| {
            let pad = Tensor::zeros(1, q.dtype(), q.device())?;
            let shifted =
                Tensor::cat(&[&pad, &q.flatten_all()?], 0)?.narrow(0, 1, q.elem_count())?.reshape(q.shape())?;
            assert!(shifted.is_contiguous());
            ms::maxsim_with(&shifted, d, None, None, &opts_for(m))
        })?;
    }
    Ok(())
}

/// The normalization op on the GPU: forward and closed-form backward against
/// plain candle ops in F64, dims within one and across several 32-lane passes, more
/// rows than the grid has warps.
#[test]
fn l2_normalize_cuda() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for (dt, tol) in [(DType::F32, 1e-6), (DType::F64, 1e-12), (DType::F16, 2e-3), (DType::BF16, 1e-2)] {
        for (rows, dim) in [(37, 2), (37, 33), (5000, 128), (300, 768)] {
            normalize::check(&dev, rows, dim, dt, tol)?;
        }
    }
    normalize::zero_rows(&dev)
}

/// The backward consumes the argmax the forward saved; a second backward
/// through the same graph recomputes it on the device and agrees bitwise.
#[test]
fn second_backward_recomputes_argmax() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dt in DTYPES {
        second_backward_matches(&dev, dt)?;
    }
    Ok(())
}

/// `maxsim_value_and_grads` equals candle autograd through the same kernels.
#[test]
fn value_and_grads_cuda() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dt in DTYPES {
        value_and_grads_match_autograd(&dev, dt)?;
    }
    Ok(())
}

/// The fused projection head (Hopper) against `reference` in F32 on the same
/// rounded inputs: partial 128-row chunks, dmodel not a multiple of 64, dout
/// 48 / 96 / 128, masks with an all-masked document, no bias, and enough
/// queries to need two query chunks per document.
#[test]
fn from_hidden_cuda() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cpu = Device::Cpu;
    let cc90 = {
        let (q, h, w) = (
            randn(&[1, 2, 64], DType::BF16, &dev)?,
            randn(&[1, 2, 64], DType::BF16, &dev)?,
            randn(&[64, 64], DType::BF16, &dev)?,
        );
        ms::maxsim_from_hidden_fused(&q, &h, &w, None, None, false)?.is_some()
    };
    //        nq  nd  lq   ld  dmodel dout normalize mask  bias
    let cases = [
        (3, 5, 7, 300, 136, 128, true, true, true),
        (2, 4, 32, 128, 768, 96, false, false, true),
        (5, 3, 9, 70, 64, 48, true, true, false),
        (600, 3, 32, 64, 64, 128, true, false, true),
        (1, 9, 32, 257, 256, 64, false, true, true),
    ];
    for dt in [DType::BF16, DType::F16] {
        for &(nq, nd, lq, ld, dmodel, dout, normalize, mask, bias) in &cases {
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
            let g = |t: &Tensor| t.to_device(&dev);
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
            let out = ms::maxsim_from_hidden(&qg, &hg, &wg, bg.as_ref(), dmg.as_ref(), normalize)?.to_device(&cpu)?;
            assert_close(&what, &out, &want, gpu_tol(dt))?;
            if mask {
                let empty = out.i((.., 1))?.abs()?.sum_all()?.to_scalar::<f32>()?;
                assert_eq!(empty, 0.0, "{what}: an all-masked document scores 0");
            }
            let fused = ms::maxsim_from_hidden_fused(&qg, &hg, &wg, bg.as_ref(), dmg.as_ref(), normalize)?;
            assert_eq!(fused.is_some(), cc90, "{what}: the fused kernel runs exactly on compute capability 9.0");
            if let Some(f) = fused {
                assert_close(&format!("{what} fused"), &f.to_device(&cpu)?, &want, gpu_tol(dt))?;
            }
            // Training takes the argmax forward; its scores agree.
            let wv = Var::from_tensor(&wg)?;
            let tr = ms::maxsim_from_hidden(&qg, &hg, wv.as_tensor(), bg.as_ref(), dmg.as_ref(), normalize)?;
            assert_close(&format!("{what} training forward"), &tr.to_device(&cpu)?, &want, gpu_tol(dt))?;
        }
    }
    // The closed-form backward (winners gathered into slots in cases 1, 2, 3
    // and 5, every row in case 4) against autograd through `reference`, F32.
    for &(nq, nd, lq, ld, dmodel, dout, normalize, mask, bias) in &cases {
        let what = format!("from_hidden grads {nq}x{nd} lq{lq} ld{ld} dmodel{dmodel} dout{dout} norm={normalize}");
        let ins = [
            randn(&[nq, lq, dout], DType::F32, &cpu)?,
            randn(&[nd, ld, dmodel], DType::F32, &cpu)?,
            (randn(&[dout, dmodel], DType::F32, &cpu)? * (1.0 / (dmodel as f64).sqrt()))?,
            randn(&[dout], DType::F32, &cpu)?,
        ];
        let dm = mask.then(|| rand_mask(&[nd, ld], 0.3, &cpu)).transpose()?;
        let w8 = randn(&[nq, nd], DType::F32, &cpu)?;
        let grads = |d: &Device, ours: bool| -> Result<Vec<Tensor>> {
            let v: Vec<Var> = ins.iter().map(|x| Var::from_tensor(&x.to_device(d)?)).collect::<Result<_>>()?;
            let t: Vec<Tensor> = v.iter().map(|v| v.as_tensor().clone()).collect();
            let b = bias.then_some(&t[3]);
            let m = dm.as_ref().map(|m| m.to_device(d)).transpose()?;
            let s = if ours {
                ms::maxsim_from_hidden(&t[0], &t[1], &t[2], b, m.as_ref(), normalize)?
            } else {
                r::maxsim_from_hidden(&t[0], &t[1], &t[2], b, m.as_ref(), normalize)?
            };
            let g = (s * &w8.to_device(d)?)?.sum_all()?.backward()?;
            let n = if bias { 4 } else { 3 };
            t[..n].iter().map(|x| g.get(x).expect("a gradient").to_device(&Device::Cpu)).collect()
        };
        let (got, want) = (grads(&dev, true)?, grads(&cpu, false)?);
        for (k, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_close(&format!("{what}: grad of input {k}"), a, b, 2e-2)?;
        }
        // The same outside autograd.
        let g = |t: &Tensor| t.to_device(&dev);
        let bg = if bias { Some(g(&ins[3])?) } else { None };
        let dmg = dm.as_ref().map(g).transpose()?;
        let w8g = g(&w8)?;
        let (_, vg) = ms::maxsim_from_hidden_value_and_grads(
            &g(&ins[0])?,
            &g(&ins[1])?,
            &g(&ins[2])?,
            bg.as_ref(),
            dmg.as_ref(),
            normalize,
            |_| Ok(w8g.clone()),
        )?;
        let vg = [Some(vg.q), Some(vg.h_d), Some(vg.w), vg.b];
        for (k, (a, b)) in vg.iter().flatten().zip(&want).enumerate() {
            assert_close(&format!("{what}: value_and_grads grad of input {k}"), &a.to_device(&cpu)?, b, 2e-2)?;
        }
    }
    // Bad input is an Err naming the argument.
    let (q, h, w) = (
        randn(&[2, 4, 64], DType::BF16, &dev)?,
        randn(&[3, 5, 64], DType::BF16, &dev)?,
        randn(&[64, 64], DType::BF16, &dev)?,
    );
    let bad_mask = Tensor::ones((3, 6), DType::U8, &dev)?;
    let e = ms::maxsim_from_hidden(&q, &h, &w, None, Some(&bad_mask), true).unwrap_err().to_string();
    assert!(e.contains("d_mask"), "{e}");
    let e = ms::maxsim_from_hidden_fused(&q, &h, &randn(&[64, 32], DType::BF16, &dev)?, None, None, true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("w"), "{e}");
    Ok(())
}
