//! The Sentence Transformers scoring layers (src/layers.rs): `MaxSim` and
//! `MaxSimPairwise` equal the functional ops, except that a document with
//! no valid token scores `EMPTY_DOC_SCORE`.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{self as ms, reference as r, EMPTY_DOC_SCORE};

/// A U8 mask of `shape` (last axis = tokens) with about 20% padding and the
/// documents `empty` (indices into the flattened leading axes) fully masked.
fn mask_with_empty(shape: &[usize], empty: &[usize]) -> Result<Tensor> {
    let ld = *shape.last().unwrap();
    let mut m: Vec<u8> = rand_mask(shape, 0.2, &Device::Cpu)?.flatten_all()?.to_vec1()?;
    for &j in empty {
        m[j * ld..(j + 1) * ld].fill(0);
    }
    // Every other document keeps a valid token.
    for (j, doc) in m.chunks_mut(ld).enumerate() {
        if !empty.contains(&j) {
            doc[0] = 1;
        }
    }
    Tensor::from_vec(m, shape, &Device::Cpu)
}

/// Every score of `layer` equals `f`'s (`maxsim`'s), bitwise, except the
/// empty documents' (`empty(i, j)`), which are `EMPTY_DOC_SCORE`.
fn check_columns(what: &str, layer: &Tensor, f: &Tensor, empty: impl Fn(usize, usize) -> bool) -> Result<()> {
    let (s, f): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (layer.to_vec2()?, f.to_vec2()?);
    assert_eq!((s.len(), s[0].len()), (f.len(), f[0].len()), "{what}: shape");
    let mut n_empty = 0;
    for (i, (row, frow)) in s.iter().zip(&f).enumerate() {
        for (j, (&v, &fv)) in row.iter().zip(frow).enumerate() {
            if empty(i, j) {
                assert_eq!(v, EMPTY_DOC_SCORE, "{what}: empty document ({i},{j})");
                n_empty += 1;
            } else {
                assert_eq!(v, fv, "{what}: ({i},{j}) differs from maxsim");
            }
        }
    }
    assert!(n_empty > 0, "{what}: no empty document checked");
    Ok(())
}

/// `MaxSim` in-batch and KD, `MaxSimPairwise`, each with an empty
/// document; on CUDA also 300 documents of 64 tokens at dim 128.
fn layers_score_empty_documents_last(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let g = |t: &Tensor| t.to_device(dev);
    let mut shapes = vec![(2, 3, 5, 7, 16)];
    if gpu_cases(dev) {
        shapes.push((4, 300, 32, 64, 128));
    }
    for (nq, nd, lq, ld, dim) in shapes {
        let q = g(&randn(&[nq, lq, dim], DType::F32, &cpu)?)?;
        let d = g(&randn(&[nd, ld, dim], DType::F32, &cpu)?)?;
        let dm = g(&mask_with_empty(&[nd, ld], &[1])?)?;
        let s = ms::MaxSim.forward(&q, &d, None, Some(&dm))?;
        let f = ms::maxsim(&q, &d, None, Some(&dm))?;
        check_columns(&format!("MaxSim {nq}x{nd}"), &s, &f, |_, j| j == 1)?;
    }
    // KD: query i's document j is empty for (0, 2) and (1, 0).
    let q = g(&randn(&[2, 5, 16], DType::F32, &cpu)?)?;
    let d = g(&randn(&[2, 3, 7, 16], DType::F32, &cpu)?)?;
    let dm = g(&mask_with_empty(&[2, 3, 7], &[2, 3])?)?;
    let s = ms::MaxSim.forward(&q, &d, None, Some(&dm))?;
    let f = ms::maxsim(&q, &d, None, Some(&dm))?;
    check_columns("MaxSim KD", &s, &f, |i, j| (i, j) == (0, 2) || (i, j) == (1, 0))?;
    // Pairwise: document 0 empty.
    let qm = g(&rand_mask(&[2, 5], 0.2, &cpu)?)?;
    let d2 = g(&randn(&[2, 7, 16], DType::F32, &cpu)?)?;
    let dm2 = g(&mask_with_empty(&[2, 7], &[0])?)?;
    let p = ms::MaxSimPairwise.forward(&q, &d2, Some(&qm), Some(&dm2))?;
    let f = ms::maxsim_pairs(&q, &d2, Some(&qm), Some(&dm2))?;
    check_columns("MaxSimPairwise", &p.unsqueeze(0)?, &f.unsqueeze(0)?, |_, j| j == 0)?;
    let want = r::maxsim_pairs(
        &q.to_device(&cpu)?,
        &d2.to_device(&cpu)?,
        Some(&qm.to_device(&cpu)?),
        Some(&dm2.to_device(&cpu)?),
    )?;
    let p: Vec<f32> = p.to_vec1()?;
    let want: Vec<f32> = want.to_vec1()?;
    let tol = score_tol(dev, DType::F32).max(1e-5) as f32 * want[1].abs().max(1.0);
    assert!((p[1] - want[1]).abs() <= tol, "pairwise {} vs reference {}", p[1], want[1]);
    Ok(())
}

test_device!(
    layers_score_empty_documents_last,
    layers_score_empty_documents_last_cpu,
    layers_score_empty_documents_last_cuda
);
