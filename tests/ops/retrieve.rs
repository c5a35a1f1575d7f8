//! Streaming top-k retrieval (src/ops/retrieve.rs) against `reference` on the CPU.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{self as ms, reference as r};

/// `retrieve` on `dev` against `reference::retrieve`: close scores, and
/// the reference's indices, but for documents whose reference scores are
/// within the score tolerance of each other, which may trade places (the
/// device sums in another order): each returned document's reference score
/// is the reference's score at that rank, within the tolerance.
fn check(dev: &Device, q: &Tensor, d: &Tensor, dm: Option<&Tensor>, k: usize, chunk: usize) -> Result<()> {
    let dmg = opt_to(dev, dm)?;
    let (s, i) = ms::retrieve(&q.to_device(dev)?, &d.to_device(dev)?, None, dmg.as_ref(), k, chunk)?;
    let (ws, wi) = r::retrieve(q, d, None, dm, k)?;
    let what = format!("retrieve {:?} k={k} chunk={chunk}", d.dims());
    assert_eq!(s.dims(), ws.dims(), "{what}");
    let tol = score_tol(dev, DType::F32).max(1e-5);
    let full: Vec<Vec<f32>> = r::maxsim(q, d, None, dm)?.to_vec2()?;
    let scale = full.iter().flatten().fold(0f32, |m, x| m.max(x.abs())) as f64;
    let (ids, want): (Vec<Vec<u32>>, Vec<Vec<u32>>) = (i.to_device(&Device::Cpu)?.to_vec2()?, wi.to_vec2()?);
    for (row, (ids, want)) in ids.iter().zip(&want).enumerate() {
        let mut seen = ids.clone();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), ids.len(), "{what}: query {row} repeats a document: {ids:?}");
        for (rank, (&got, &w)) in ids.iter().zip(want).enumerate() {
            let (a, b) = (full[row][got as usize] as f64, full[row][w as usize] as f64);
            assert!(
                got == w || (a - b).abs() <= tol * scale,
                "{what}: query {row} rank {rank}: document {got} (reference score {a}) where the reference has {w} ({b}); {ids:?} against {want:?}"
            );
        }
    }
    assert_close(&what, &s, &ws, tol)
}

/// Top-k with k below, at and above the number of documents, chunks that
/// do and do not divide it, a document mask; on CUDA also 300 documents of
/// 64 tokens at dim 128.
fn retrieve_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let q = randn(&[3, 6, 32], DType::F32, &cpu)?;
    let d = randn(&[50, 10, 32], DType::F32, &cpu)?;
    let dm = rand_mask(&[50, 10], 0.2, &cpu)?;
    for (k, chunk) in [(5, 7), (50, 16), (80, 50), (1, 1)] {
        check(dev, &q, &d, Some(&dm), k, chunk)?;
    }
    if gpu_cases(dev) {
        let q = randn(&[4, 32, 128], DType::F32, &cpu)?;
        let d = randn(&[300, 64, 128], DType::F32, &cpu)?;
        let dm = rand_mask(&[300, 64], 0.2, &cpu)?;
        check(dev, &q, &d, Some(&dm), 10, 64)?;
    }
    Ok(())
}

test_device!(retrieve_matches_reference, retrieve_matches_reference_cpu, retrieve_matches_reference_cuda);

/// Identical documents score exactly alike (grid values: exact in any
/// summation order, in every chunk): the lower document index comes first.
fn retrieve_ties_keep_lower_index(dev: &Device) -> Result<()> {
    let q = grid(&[3, 6, 32], DType::F32)?.to_device(dev)?;
    let d = grid(&[1, 10, 32], DType::F32)?.repeat((6, 1, 1))?.to_device(dev)?;
    for (k, chunk) in [(4, 4), (6, 1), (3, 6)] {
        let (s, i) = ms::retrieve(&q, &d, None, None, k, chunk)?;
        let (s, i): (Vec<Vec<f32>>, Vec<Vec<u32>>) = (s.to_vec2()?, i.to_vec2()?);
        for (row, ids) in s.iter().zip(&i) {
            assert_eq!(ids, &(0..k as u32).collect::<Vec<_>>(), "k={k} chunk={chunk}");
            assert!(row.iter().all(|&v| v == row[0]), "k={k} chunk={chunk}: {row:?}");
        }
    }
    Ok(())
}

test_device!(retrieve_ties_keep_lower_index, retrieve_ties_keep_lower_index_cpu, retrieve_ties_keep_lower_index_cuda);

/// No documents: `[Nq, 0]` scores and indices.
fn retrieve_without_documents_is_empty(dev: &Device) -> Result<()> {
    let q = randn(&[2, 4, 16], DType::F32, dev)?;
    let none = randn(&[1, 5, 16], DType::F32, dev)?.narrow(0, 0, 0)?;
    let (s, i) = ms::retrieve(&q, &none, None, None, 3, 8)?;
    assert_eq!((s.dims(), i.dims()), (&[2usize, 0][..], &[2usize, 0][..]));
    assert_eq!((s.dtype(), i.dtype()), (DType::F32, DType::U32));
    Ok(())
}

test_device!(
    retrieve_without_documents_is_empty,
    retrieve_without_documents_is_empty_cpu,
    retrieve_without_documents_is_empty_cuda
);

/// `TopK` merged chunk by chunk equals a full sort of every score (best
/// first, equal scores by the lower id, NaN last), and returns as many
/// columns as ids were pushed when that is fewer than k, on `dev`.
fn top_k_merges_chunks_like_a_full_sort(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    // Grid values in 1/4 steps: many exact ties across chunks; one NaN.
    let mut v: Vec<f32> = randn(&[3, 23], DType::F32, &cpu)?.flatten_all()?.to_vec1()?;
    v.iter_mut().for_each(|x| *x = (*x * 4.0).round() / 4.0);
    v[5] = f32::NAN;
    let scores = Tensor::from_vec(v.clone(), (3, 23), &cpu)?;
    for (k, chunk) in [(5, 4), (23, 7), (40, 23), (1, 1)] {
        let mut top = ms::TopK::new(3, k);
        let mut start = 0;
        while start < 23 {
            let n = chunk.min(23 - start);
            top.push(&scores.narrow(1, start, n)?.to_device(dev)?, |j| (start + j) as u32)?;
            start += n;
        }
        let (s, i) = top.finish(dev)?;
        let kk = k.min(23);
        assert_eq!(i.dims(), &[3, kk], "k={k}: as many columns as ids pushed");
        let (s, i): (Vec<Vec<f32>>, Vec<Vec<u32>>) = (s.to_device(&cpu)?.to_vec2()?, i.to_device(&cpu)?.to_vec2()?);
        for row in 0..3 {
            let mut want: Vec<(f32, u32)> = (0..23).map(|j| (v[row * 23 + j], j as u32)).collect();
            want.sort_by(|a, b| match (a.0.is_nan(), b.0.is_nan()) {
                (true, false) => std::cmp::Ordering::Greater,
                (false, true) => std::cmp::Ordering::Less,
                _ => b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal).then(a.1.cmp(&b.1)),
            });
            let ids: Vec<u32> = want.iter().take(kk).map(|x| x.1).collect();
            assert_eq!(i[row], ids, "k={k} chunk={chunk} row {row}: ids");
            for (got, w) in s[row].iter().zip(&want) {
                assert!(got == &w.0 || (got.is_nan() && w.0.is_nan()), "k={k} row {row}: {got} vs {}", w.0);
            }
        }
    }
    Ok(())
}

test_device!(
    top_k_merges_chunks_like_a_full_sort,
    top_k_merges_chunks_like_a_full_sort_cpu,
    top_k_merges_chunks_like_a_full_sort_cuda
);
