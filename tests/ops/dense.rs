//! Padded layouts (src/ops/dense.rs): `maxsim`, `maxsim_with`,
//! `maxsim_pairs` and `maxsim_with_argmax`, in-batch and KD, against
//! `reference` on the CPU.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{self as ms, reference as r, MaxSimOptions};

/// In-batch scores on `dev` against `reference` on the CPU, on fresh random
/// inputs (transposed views if `strided`) with random masks if `masks`.
#[allow(clippy::too_many_arguments)]
fn dense_case(
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
    let (qmg, dmg) = (opt_to(dev, qm.as_ref())?, opt_to(dev, dm.as_ref())?);
    let out = ms::maxsim(&q.to_device(dev)?, &d.to_device(dev)?, qmg.as_ref(), dmg.as_ref())?;
    assert_eq!(out.dtype(), DType::F32);
    assert!(out.device().same_device(dev));
    let want = r::maxsim(&q, &d, qm.as_ref(), dm.as_ref())?;
    let what = format!("dense {nq}x{nd} lq{lq} ld{ld} d{dim} {dt:?} masks={masks} strided={strided} on {dev:?}");
    assert_close(&what, &out, &want, score_tol(dev, dt))
}

/// Every dtype (F64 too) and dims that are and are not multiples of the
/// vector widths, and one past the CPU's BF16 widening kernel (1024); on
/// CUDA also dims up to 768 at 32 x 300 tokens.
fn dense_matches_reference(dev: &Device) -> Result<()> {
    for dt in DTYPES {
        for dim in [16, 33, 96, 128, 250] {
            dense_case(dev, 3, 5, 7, 19, dim, dt, true, false)?;
        }
        dense_case(dev, 2, 3, 5, 9, 1040, dt, true, false)?;
    }
    dense_case(dev, 3, 4, 6, 11, 20, DType::F64, true, false)?;
    if gpu_cases(dev) {
        for dt in DTYPES {
            for dim in [16, 33, 48, 72, 96, 128, 250, 300, 384, 512, 768] {
                dense_case(dev, 5, 7, 32, 300, dim, dt, true, false)?;
            }
        }
    }
    Ok(())
}

test_device!(dense_matches_reference, dense_matches_reference_cpu, dense_matches_reference_cuda);

/// One-token queries and documents, queries past 512 tokens (chunked),
/// documents over several tiles, many small items; on CUDA also long
/// documents (8192 tokens), many query groups and document chunks, and a
/// rerank-like single query against 300 documents.
fn dense_edge_lengths_match_reference(dev: &Device) -> Result<()> {
    for dt in DTYPES {
        dense_case(dev, 4, 3, 1, 9, 32, dt, false, false)?; // Lq = 1
        dense_case(dev, 4, 3, 8, 1, 32, dt, false, false)?; // Ld = 1
        dense_case(dev, 2, 3, 600, 40, 64, dt, true, false)?; // Lq > 512: 128-token chunks
        dense_case(dev, 3, 9, 40, 700, 16, dt, true, false)?; // Ld spans several document tiles
        dense_case(dev, 70, 40, 5, 30, 24, dt, true, false)?; // many small items
        dense_case(dev, 5, 6, 20, 23, 32, dt, true, false)?; // Ld 23: the CPU kernels' longest token-group tails
        if gpu_cases(dev) {
            for (lq, ld) in [(1, 300), (32, 1), (128, 1024), (600, 300), (32, 8192), (7, 13)] {
                dense_case(dev, 3, 4, lq, ld, 128, dt, true, false)?;
            }
            dense_case(dev, 40, 33, 32, 256, 128, dt, false, false)?; // many query groups and doc chunks
            dense_case(dev, 1, 300, 32, 300, 128, dt, false, false)?; // rerank-like
            dense_case(dev, 300, 3, 128, 20, 64, dt, true, false)?; // more query groups than SMs: blocks take several
        }
    }
    Ok(())
}

test_device!(
    dense_edge_lengths_match_reference,
    dense_edge_lengths_match_reference_cpu,
    dense_edge_lengths_match_reference_cuda
);

/// Transposed q and d, a broadcast (stride-0) mask, a narrowed document
/// batch, and rows whose width is not a multiple of the vector loads.
fn strided_inputs_match_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for dt in DTYPES {
        let q = randn_strided(3, 9, 48, dt, &cpu)?;
        let d = randn_strided(4, 13, 48, dt, &cpu)?;
        let qm = rand_mask(&[3, 9], 0.2, &cpu)?;
        let dm = rand_mask(&[1, 13], 0.2, &cpu)?.broadcast_as((4, 13))?;
        let (qg, dg) = (q.to_device(dev)?, d.to_device(dev)?);
        assert!(!qg.is_contiguous() && !dg.is_contiguous());
        let out = ms::maxsim(&qg, &dg, Some(&qm.to_device(dev)?), Some(&dm.to_device(dev)?))?;
        let want = r::maxsim(&q, &d, Some(&qm), Some(&dm))?;
        assert_close(&format!("transposed, broadcast mask {dt:?}"), &out, &want, score_tol(dev, dt))?;
        let (dn, dng) = (d.narrow(0, 1, 2)?, dg.narrow(0, 1, 2)?);
        let out = ms::maxsim(&qg, &dng, None, None)?;
        assert_close(&format!("narrowed {dt:?}"), &out, &r::maxsim(&q, &dn, None, None)?, score_tol(dev, dt))?;
        dense_case(dev, 3, 5, 20, 40, 96, dt, true, true)?;
        dense_case(dev, 3, 5, 20, 40, 33, dt, true, true)?; // unaligned rows
    }
    Ok(())
}

test_device!(strided_inputs_match_reference, strided_inputs_match_reference_cpu, strided_inputs_match_reference_cuda);

/// Negative similarities everywhere, so a masked document token would win
/// if it were not excluded: a fully masked query and a fully masked
/// document score exactly 0, every other score stays negative.
fn masked_tokens_never_win(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for dim in [16, 64] {
        for dt in DTYPES {
            let q = randn(&[3, 5, dim], dt, &cpu)?.abs()?;
            let d = (randn(&[4, 6, dim], dt, &cpu)?.abs()? * -1.0)?;
            let mut qm = vec![1u8; 15];
            qm[5..10].fill(0); // query 1 fully masked
            let mut dm = vec![1u8; 24];
            dm[12..18].fill(0); // document 2 fully masked
            dm[0] = 0;
            let qm = Tensor::from_vec(qm, (3, 5), &cpu)?;
            let dm = Tensor::from_vec(dm, (4, 6), &cpu)?;
            let out = ms::maxsim(
                &q.to_device(dev)?,
                &d.to_device(dev)?,
                Some(&qm.to_device(dev)?),
                Some(&dm.to_device(dev)?),
            )?;
            let v: Vec<Vec<f32>> = out.to_vec2()?;
            for (i, row) in v.iter().enumerate() {
                for (j, &s) in row.iter().enumerate() {
                    if i == 1 || j == 2 {
                        assert_eq!(s, 0.0, "{dt:?} d{dim} ({i},{j}) should be exactly 0");
                    } else {
                        assert!(s < 0.0, "{dt:?} d{dim} ({i},{j}) = {s}: masked tokens must not win");
                    }
                }
            }
            let want = r::maxsim(&q, &d, Some(&qm), Some(&dm))?;
            assert_close(&format!("masked {dt:?} d{dim}"), &out, &want, score_tol(dev, dt).max(1e-5))?;
        }
    }
    Ok(())
}

test_device!(masked_tokens_never_win, masked_tokens_never_win_cpu, masked_tokens_never_win_cuda);

/// No queries or no documents: empty outputs (zero-size views of
/// non-empty buffers: CUDA allocates no empty one). On the CPU also
/// zero-size tensors of their own, K = 0 documents per query (empty
/// output) and documents of no token (Ld = 0: every score 0).
fn empty_batches_score_empty_or_zero(dev: &Device) -> Result<()> {
    for dt in DTYPES {
        let q = randn(&[2, 4, 16], dt, dev)?;
        let d = randn(&[3, 5, 16], dt, dev)?;
        assert_eq!(ms::maxsim(&q.narrow(0, 0, 0)?, &d, None, None)?.dims(), &[0, 3]);
        assert_eq!(ms::maxsim(&q, &d.narrow(0, 0, 0)?, None, None)?.dims(), &[2, 0]);
        if !dev.is_cuda() {
            let e = |dims: &[usize]| Tensor::zeros(dims, dt, dev);
            assert_eq!(ms::maxsim(&e(&[0, 4, 16])?, &d, None, None)?.dims(), &[0, 3]);
            assert_eq!(ms::maxsim(&q, &e(&[0, 5, 16])?, None, None)?.dims(), &[2, 0]);
            assert_eq!(ms::maxsim(&q, &e(&[2, 0, 5, 16])?, None, None)?.dims(), &[2, 0]);
            let none = ms::maxsim(&q, &e(&[3, 0, 16])?, None, None)?;
            assert_eq!(none.to_vec2::<f32>()?, vec![vec![0f32; 3]; 2], "{dt:?}: documents of no token");
        }
    }
    Ok(())
}

test_device!(
    empty_batches_score_empty_or_zero,
    empty_batches_score_empty_or_zero_cpu,
    empty_batches_score_empty_or_zero_cuda
);

/// KD layout (each query its own K documents) with masks.
fn kd_layout_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for dt in DTYPES {
        for (nq, lq, k, ld, dim) in [(3, 7, 4, 11, 40), (3, 32, 5, 70, 96)] {
            let q = randn(&[nq, lq, dim], dt, &cpu)?;
            let d = randn(&[nq, k, ld, dim], dt, &cpu)?;
            let qm = rand_mask(&[nq, lq], 0.2, &cpu)?;
            let dm = rand_mask(&[nq, k, ld], 0.2, &cpu)?;
            let out = ms::maxsim(
                &q.to_device(dev)?,
                &d.to_device(dev)?,
                Some(&qm.to_device(dev)?),
                Some(&dm.to_device(dev)?),
            )?;
            assert_eq!(out.dims(), &[nq, k]);
            let want = r::maxsim(&q, &d, Some(&qm), Some(&dm))?;
            assert_close(&format!("kd {nq}x{k} lq{lq} ld{ld} d{dim} {dt:?}"), &out, &want, score_tol(dev, dt))?;
        }
    }
    Ok(())
}

test_device!(kd_layout_matches_reference, kd_layout_matches_reference_cpu, kd_layout_matches_reference_cuda);

/// `maxsim_pairs`: query b against document b, with and without masks.
fn pairs_match_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for dt in DTYPES {
        for (b, lq, ld, dim, masks) in [(5, 7, 12, 33, true), (3, 32, 50, 96, false)] {
            let q = randn(&[b, lq, dim], dt, &cpu)?;
            let d = randn(&[b, ld, dim], dt, &cpu)?;
            let qm = masks.then(|| rand_mask(&[b, lq], 0.2, &cpu)).transpose()?;
            let dm = masks.then(|| rand_mask(&[b, ld], 0.2, &cpu)).transpose()?;
            let (qmg, dmg) = (opt_to(dev, qm.as_ref())?, opt_to(dev, dm.as_ref())?);
            let out = ms::maxsim_pairs(&q.to_device(dev)?, &d.to_device(dev)?, qmg.as_ref(), dmg.as_ref())?;
            assert_eq!(out.dims(), &[b]);
            let want = r::maxsim_pairs(&q, &d, qm.as_ref(), dm.as_ref())?;
            assert_close(&format!("pairs {b} lq{lq} ld{ld} d{dim} {dt:?}"), &out, &want, score_tol(dev, dt))?;
        }
    }
    Ok(())
}

test_device!(pairs_match_reference, pairs_match_reference_cpu, pairs_match_reference_cuda);

/// `normalize: true` L2-normalizes every token of q and d inside the op.
fn normalize_option_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let opts = MaxSimOptions { normalize: true, ..Default::default() };
    for dt in DTYPES {
        let q = randn(&[3, 6, 32], dt, &cpu)?;
        let d = randn(&[4, 9, 32], dt, &cpu)?;
        let out = ms::maxsim_with(&q.to_device(dev)?, &d.to_device(dev)?, None, None, &opts)?;
        let want = r::maxsim_with(&q, &d, None, None, &opts)?;
        assert_close(&format!("normalize {dt:?}"), &out, &want, score_tol(dev, dt).max(1e-5))?;
    }
    Ok(())
}

test_device!(
    normalize_option_matches_reference,
    normalize_option_matches_reference_cpu,
    normalize_option_matches_reference_cuda
);

/// The argmax `maxsim_with_argmax` returns is a valid token of maximal
/// similarity, and the reference's winner wherever the best two are
/// clearly apart.
fn argmax_is_a_maximal_valid_token(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for dt in DTYPES {
        let (nq, nd, lq, ld, dim) = (3, 4, 40, 200, 128);
        let q = randn(&[nq, lq, dim], dt, &cpu)?;
        let d = randn(&[nd, ld, dim], dt, &cpu)?;
        let dm = rand_mask(&[nd, ld], 0.2, &cpu)?;
        let (_, am) = ms::maxsim_with_argmax(&q.to_device(dev)?, &d.to_device(dev)?, None, Some(&dm.to_device(dev)?))?;
        assert_eq!(am.dims(), &[nq, nd, lq]);
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

test_device!(
    argmax_is_a_maximal_valid_token,
    argmax_is_a_maximal_valid_token_cpu,
    argmax_is_a_maximal_valid_token_cuda
);

/// Exact ties: documents built from a few repeated rows, so a query row's
/// best value occurs at many tokens, within one tile, across tiles and with
/// masked tokens between; the argmax is the first valid occurrence.
/// Document 1 scores negative everywhere (negative maxima order the packed
/// argmax bits of the CUDA kernels the other way). On CUDA, run the suite
/// under each `CANDLE_MAXSIM_TILE` to cover every tile configuration.
fn argmax_ties_pick_lowest_index(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let mut shapes = vec![(3, 4, 40, 300, 128), (2, 3, 20, 70, 64)];
    if gpu_cases(dev) {
        shapes.push((8, 4, 128, 520, 96));
        // Past 64 tiles of 128 (where the Hopper epilogues' lazy scan runs
        // under CANDLE_MAXSIM_LAZY_ARGMAX): the best rows first appear at
        // token ld / 2 = 10 000.
        shapes.push((2, 2, 64, 20_000, 128));
    }
    for dt in DTYPES {
        for &(nq, nd, lq, ld, dim) in &shapes {
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
                ms::maxsim_with_argmax(&q.to_device(dev)?, &d.to_device(dev)?, None, Some(&dm.to_device(dev)?))?;
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

test_device!(argmax_ties_pick_lowest_index, argmax_ties_pick_lowest_index_cpu, argmax_ties_pick_lowest_index_cuda);

/// Similarities of both signs across the tiles of long documents, on grid
/// inputs (every similarity exact in F32). Query rows lean on feature 0 one
/// way or the other; a document's first half leans the other way than its
/// second, and document 1 leans away everywhere. So a row's running maximum
/// stays negative over several tiles before turning positive, and tiles
/// whose rows are all negative follow a positive maximum: the cases where
/// the CUDA epilogues' integer max of float bits is not the float max.
/// Scores, and the argmax (the first valid token of the exact maximum).
fn mixed_sign_maxima_match_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let mut shapes = vec![(3, 4, 24, 300, 64)];
    if gpu_cases(dev) {
        shapes.push((2, 3, 40, 700, 128));
        // Maxima turning positive past 64 tiles of 128 (the lazy scan's
        // territory under CANDLE_MAXSIM_LAZY_ARGMAX).
        shapes.push((2, 2, 40, 18_000, 128));
    }
    for dt in DTYPES {
        for &(nq, nd, lq, ld, dim) in &shapes {
            let axis = |sign: Vec<f32>, n: usize| -> Result<Tensor> {
                let e0 = Tensor::from_vec((0..dim).map(|k| if k == 0 { 8f32 } else { 0. }).collect(), (1, dim), &cpu)?;
                Tensor::from_vec(sign, (n, 1), &cpu)?.broadcast_mul(&e0)
            };
            let qs = (0..nq * lq).map(|r| if r % 3 == 0 { -1. } else { 1. }).collect();
            let ds = (0..nd * ld).map(|t| if t / ld == 1 || t % ld < ld / 2 { -1. } else { 1. }).collect();
            let q = (grid(&[nq * lq, dim], DType::F32)? + axis(qs, nq * lq)?)?.reshape((nq, lq, dim))?;
            let d = (grid(&[nd * ld, dim], DType::F32)? + axis(ds, nd * ld)?)?.reshape((nd, ld, dim))?;
            let (q, d) = (q.to_dtype(dt)?, d.to_dtype(dt)?);
            let dm = rand_mask(&[nd, ld], 0.1, &cpu)?;
            let (qg, dg, dmg) = (q.to_device(dev)?, d.to_device(dev)?, dm.to_device(dev)?);
            let what = format!("mixed signs {nq}x{nd} lq{lq} ld{ld} d{dim} {dt:?}");
            let want = r::maxsim(&q, &d, None, Some(&dm))?;
            assert_close(&what, &ms::maxsim(&qg, &dg, None, Some(&dmg))?, &want, score_tol(dev, dt))?;
            let (scores, am) = ms::maxsim_with_argmax(&qg, &dg, None, Some(&dmg))?;
            assert_close(&format!("{what} with argmax"), &scores, &want, score_tol(dev, dt))?;
            let am: Vec<i32> = am.to_device(&cpu)?.flatten_all()?.to_vec1()?;
            let sim = q
                .to_dtype(DType::F32)?
                .reshape((nq * lq, dim))?
                .matmul(&d.to_dtype(DType::F32)?.reshape((nd * ld, dim))?.t()?)?;
            let sim: Vec<Vec<f32>> = sim.to_vec2()?;
            let dmv: Vec<u8> = dm.flatten_all()?.to_vec1()?;
            let (mut negative, mut late) = (0, 0);
            for i in 0..nq {
                for j in 0..nd {
                    for s in 0..lq {
                        let row = &sim[i * lq + s][j * ld..][..ld];
                        let mut best: Option<usize> = None;
                        for t in (0..ld).filter(|&t| dmv[j * ld + t] != 0) {
                            if best.is_none_or(|b| row[t] > row[b]) {
                                best = Some(t);
                            }
                        }
                        let want = best.map_or(-1, |b| b as i32);
                        assert_eq!(am[(i * nd + j) * lq + s], want, "{what}: argmax of ({i},{j},{s})");
                        negative += best.is_some_and(|b| row[b] < 0.0) as usize;
                        late += best.is_some_and(|b| b >= ld / 2) as usize;
                    }
                }
            }
            assert!(negative > 0 && late > 0, "{what}: {negative} negative maxima, {late} late winners");
        }
    }
    Ok(())
}

test_device!(
    mixed_sign_maxima_match_reference,
    mixed_sign_maxima_match_reference_cpu,
    mixed_sign_maxima_match_reference_cuda
);
