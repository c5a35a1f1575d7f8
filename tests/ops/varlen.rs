//! Packed layouts (src/ops/varlen.rs): `maxsim_varlen` and
//! `score_pairs_packed` against `reference` on the CPU.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{self as ms, reference as r};

/// Packed sequences of `cu` in rows of `dim`: (rows, cu, longest).
fn packed(cu: Vec<u32>, longest: usize, dim: usize, dt: DType) -> Result<(Tensor, Tensor, usize)> {
    let rows = *cu.last().unwrap() as usize;
    Ok((randn(&[rows, dim], dt, &Device::Cpu)?, Tensor::new(cu, &Device::Cpu)?, longest))
}

/// Both entry points on `dev` against `reference` (all inputs on the CPU).
#[allow(clippy::too_many_arguments)]
fn check(
    what: &str,
    dev: &Device,
    (q, cu_q, lq): (&Tensor, &Tensor, usize),
    (d, cu_d, ld): (&Tensor, &Tensor, usize),
    max_lq: usize,
    pq: &[u32],
    pd: &[u32],
) -> Result<()> {
    let tol = score_tol(dev, q.dtype());
    let g = |t: &Tensor| t.to_device(dev);
    let out = ms::maxsim_varlen(&g(q)?, &g(cu_q)?, max_lq, &g(d)?, &g(cu_d)?, ld)?;
    let want = r::maxsim_varlen(q, cu_q, max_lq, d, cu_d, ld)?;
    assert_eq!(out.dims(), &[cu_q.dim(0)? - 1, cu_d.dim(0)? - 1]);
    assert_close(&format!("{what} varlen"), &out, &want, tol)?;
    let (pq, pd) = (Tensor::new(pq, &Device::Cpu)?, Tensor::new(pd, &Device::Cpu)?);
    let out = ms::score_pairs_packed(&g(q)?, &g(cu_q)?, lq, &g(d)?, &g(cu_d)?, ld, &g(&pq)?, &g(&pd)?)?;
    let want = r::score_pairs_packed(q, cu_q, lq, d, cu_d, ld, &pq, &pd)?;
    assert_close(&format!("{what} packed pairs"), &out, &want, tol)
}

/// Random lengths with empty sequences, `max_lq` above the longest query;
/// on CUDA also a 600-token query (chunked) among short ones and documents
/// of up to 400 tokens.
fn varlen_and_packed_pairs_match_reference(dev: &Device) -> Result<()> {
    for dt in DTYPES {
        let (cu_q, lq) = rand_offsets(6, 20, 1);
        let (cu_d, ld) = rand_offsets(9, 60, 2);
        let (q, cu_q, lq) = packed(cu_q, lq, 48, dt)?;
        let (d, cu_d, ld) = packed(cu_d, ld, 48, dt)?;
        let what = format!("{dt:?} d48");
        check(&what, dev, (&q, &cu_q, lq), (&d, &cu_d, ld), lq + 3, &[0, 5, 3, 3, 1, 0], &[8, 0, 3, 4, 1, 8])?;
        if gpu_cases(dev) {
            let (mut cu_q, lq) = rand_offsets(6, 40, 3);
            cu_q.push(cu_q.last().unwrap() + 600);
            let (cu_d, ld) = rand_offsets(11, 400, 4);
            let (q, cu_q, lq) = packed(cu_q, lq.max(600), 128, dt)?;
            let (d, cu_d, ld) = packed(cu_d, ld, 128, dt)?;
            let (pq, pd) = ([0, 6, 3, 3, 1, 5, 2], [8, 0, 3, 10, 1, 8, 3]);
            check(&format!("{dt:?} d128 long query"), dev, (&q, &cu_q, lq), (&d, &cu_d, ld), lq, &pq, &pd)?;
        }
    }
    Ok(())
}

test_device!(
    varlen_and_packed_pairs_match_reference,
    varlen_and_packed_pairs_match_reference_cpu,
    varlen_and_packed_pairs_match_reference_cuda
);

/// No query rows at all (one empty query) against a document and an empty
/// document: every score exactly 0.
fn empty_packed_sequences_score_zero(dev: &Device) -> Result<()> {
    for dt in DTYPES {
        let (cu0, cu1) = (Tensor::new(&[0u32, 0], dev)?, Tensor::new(&[0u32, 5, 5], dev)?);
        let rows = randn(&[5, 64], dt, dev)?;
        let out = ms::maxsim_varlen(&rows.narrow(0, 0, 0)?, &cu0, 0, &rows, &cu1, 5)?;
        assert_eq!(out.to_vec2::<f32>()?, vec![vec![0f32, 0.0]], "{dt:?}");
        let out = ms::maxsim_varlen(&rows, &Tensor::new(&[0u32, 5], dev)?, 5, &rows, &cu1, 5)?;
        assert_eq!(out.to_vec2::<f32>()?[0][1], 0.0, "{dt:?}: an empty document scores 0");
    }
    Ok(())
}

test_device!(
    empty_packed_sequences_score_zero,
    empty_packed_sequences_score_zero_cpu,
    empty_packed_sequences_score_zero_cuda
);

/// Documents whose lengths end in partial tiles of 64 and 128 rows, each
/// followed by a document of rows 1000× larger: the short documents' scores
/// match `reference` (a kernel that let the next document's rows into a
/// partial tile would be off by orders of magnitude there).
fn neighbouring_rows_never_enter_partial_tiles(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let lens = [5u32, 70, 63, 130, 65, 200, 1, 129, 127, 40];
    let mut cu = vec![0u32];
    for l in lens {
        cu.push(cu.last().unwrap() + l);
    }
    let rows = *cu.last().unwrap() as usize;
    let small: Vec<u32> = (0..lens.len() as u32).step_by(2).collect();
    for dt in DTYPES {
        for dim in [48, 128] {
            // Odd documents' rows scaled by 1000.
            let scale: Vec<f32> =
                (0..lens.len()).flat_map(|j| vec![if j % 2 == 1 { 1e3 } else { 1.0 }; lens[j] as usize]).collect();
            let scale = Tensor::from_vec(scale, (rows, 1), &cpu)?;
            let d = randn(&[rows, dim], DType::F32, &cpu)?.broadcast_mul(&scale)?.to_dtype(dt)?;
            let cu_d = Tensor::new(cu.as_slice(), &cpu)?;
            let (cu_q, lq) = rand_offsets(5, 40, 7);
            let q = randn(&[*cu_q.last().unwrap() as usize, dim], dt, &cpu)?;
            let cu_q = Tensor::new(cu_q, &cpu)?;
            let g = |t: &Tensor| t.to_device(dev);
            let out = ms::maxsim_varlen(&g(&q)?, &g(&cu_q)?, lq, &g(&d)?, &g(&cu_d)?, 200)?.to_device(&cpu)?;
            let want = r::maxsim_varlen(&q, &cu_q, lq, &d, &cu_d, 200)?;
            let idx = Tensor::new(small.as_slice(), &cpu)?;
            assert_close(
                &format!("short documents next to large rows, {dt:?} d{dim}"),
                &out.index_select(&idx, 1)?,
                &want.index_select(&idx, 1)?,
                score_tol(dev, dt),
            )?;
        }
    }
    Ok(())
}

test_device!(
    neighbouring_rows_never_enter_partial_tiles,
    neighbouring_rows_never_enter_partial_tiles_cpu,
    neighbouring_rows_never_enter_partial_tiles_cuda
);
