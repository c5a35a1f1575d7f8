//! Symmetric 8-bit embeddings (src/ops/quantize.rs), I8 and FP8 e4m3,
//! against `reference`.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{self as ms, quantized::Quantized, reference as r};

type Quantizer = fn(&Tensor) -> Result<Quantized>;

/// The 8-bit formats a scoring test runs, each with the tolerance of its
/// scores against the F64 reference over exactly dequantized rows. I8: the
/// dots are exact and each scaled similarity is rounded once in F32 (1e-5
/// covers the F32 sums). e4m3 on CUDA: Hopper's FP8 tensor cores align the
/// products of each k32 step to the largest and keep about 14 significant
/// bits of the sum (DeepSeek-V3 technical report, section 3.3.2), so a
/// similarity may be off by ~2^-14 of its k32 step's largest product per
/// step: 1e-3 of the largest score. e4m3 elsewhere scores dequantized rows
/// in F32 (1e-5). e4m3 is skipped where [`ms::quantized::e4m3_supported`] says no
/// (that `Err` is checked by `e4m3_errs_where_unsupported`).
fn formats(dev: &Device, dim: usize) -> Result<Vec<(&'static str, Quantizer, f64)>> {
    let mut v: Vec<(&'static str, Quantizer, f64)> = vec![("i8", ms::quantized::quantize, 1e-5)];
    if ms::quantized::e4m3_supported(dev, dim)? {
        v.push(("e4m3", ms::quantized::quantize_e4m3, if dev.is_cuda() { 1e-3 } else { 1e-5 }));
    }
    Ok(v)
}

/// Random rows, every 5th one zero, quantized and back: each element
/// within half a step of its row's scale, the scale `max|x| / 127`, no
/// byte outside −127..=127.
fn quantize_round_trips_within_half_a_step(dev: &Device) -> Result<()> {
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let x = randn(&[3, 40, 96], dt, dev)?;
        let keep = Tensor::from_vec((0..120u32).map(|i| (i % 5 != 0) as u32 as f32).collect(), (3, 40, 1), dev)?;
        // Row 1 of batch 0 at 1e-37 (F32; below where 127 / max|x| overflows), kept in range for F16 / BF16.
        let tiny = if dt == DType::F32 { 1e-37 } else { 1e-4 };
        let size = Tensor::from_vec((0..120).map(|i| if i == 1 { tiny } else { 1f32 }).collect(), (3, 40, 1), dev)?;
        let x = x.to_dtype(DType::F32)?.broadcast_mul(&keep)?.broadcast_mul(&size)?.to_dtype(dt)?;
        let q = ms::quantized::quantize(&x)?;
        assert_eq!((q.values().dtype(), q.values().dims()), (DType::U8, x.dims()));
        assert_eq!(q.scales().dims(), &[3, 40]);
        let xf = x.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
        let want = (xf.abs()?.max(2)? / 127.0)?;
        assert_close(&format!("scales {dt:?}"), q.scales(), &want, 1e-6)?;
        let back = ms::quantized::dequantize(&q)?.to_device(&Device::Cpu)?;
        // Each element within half a step of its row's scale (relative to the step: rows of 1e-37
        // too), plus the F32 roundings of the stored scale and of the product (each ≤ 127·2^-24 steps).
        let step = want.unsqueeze(2)?.broadcast_as(xf.shape())?.to_dtype(DType::F64)?;
        let err = (back.to_dtype(DType::F64)? - xf.to_dtype(DType::F64)?)?.abs()?;
        let excess =
            (err - (&step * (0.5 + 254.0 * f32::EPSILON as f64))?)?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
        assert!(excess <= 0.0, "{dt:?}: an element is {excess} past half a step");
        let bytes = q.values().flatten_all()?.to_vec1::<u8>()?;
        assert!(!bytes.contains(&0x80), "{dt:?}: -128 is outside the symmetric range");
    }
    Ok(())
}

test_device!(
    quantize_round_trips_within_half_a_step,
    quantize_round_trips_within_half_a_step_cpu,
    quantize_round_trips_within_half_a_step_cuda
);

/// e4m3: each row's largest element maps to ±448 (scale `max|x| / 448`),
/// and every element is within half an e4m3 step of `x / scale`: 2^-4 of
/// its magnitude in the normal range (3 mantissa bits), 2^-10 below 2^-6
/// (subnormals step by 2^-9). Zero rows stay zero with scale 0.
fn quantize_e4m3_round_trips_within_half_a_step(dev: &Device) -> Result<()> {
    for dt in [DType::F32, DType::BF16] {
        let x = randn(&[3, 40, 96], dt, dev)?;
        let keep = Tensor::from_vec((0..120u32).map(|i| (i % 5 != 0) as u32 as f32).collect(), (3, 40, 1), dev)?;
        let x = x.to_dtype(DType::F32)?.broadcast_mul(&keep)?.to_dtype(dt)?;
        let q = ms::quantized::quantize_e4m3(&x)?;
        assert_eq!(
            (q.values().dtype(), q.values().dims(), q.format()),
            (DType::U8, x.dims(), ms::quantized::QuantFormat::E4m3)
        );
        let xf = x.to_dtype(DType::F64)?.to_device(&Device::Cpu)?;
        let amax = xf.abs()?.max_keepdim(2)?;
        assert_close(&format!("e4m3 scales {dt:?}"), q.scales(), &(amax.squeeze(2)? / 448.0)?, 1e-6)?;
        // The e4m3 values themselves: the bytes with unit scales, decoded by the reference.
        let unit = Quantized::new_e4m3(q.values().clone(), q.scales().ones_like()?)?;
        let v = r::quantized::dequantize_exact(&unit)?.to_device(&Device::Cpu)?;
        let scaled = xf.broadcast_div(&amax.maximum(1e-300)?.affine(1.0 / 448.0, 0.0)?)?;
        let bound = scaled.abs()?.affine(1.0 / 16.0, 0.0)?.maximum(1.0 / 1024.0)?;
        let excess = ((&v - &scaled)?.abs()? - bound)?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
        assert!(excess <= 1e-12, "{dt:?}: an element is {excess} past half an e4m3 step");
        let vmax = v.abs()?.max_keepdim(2)?.flatten_all()?.to_vec1::<f64>()?;
        let amax = amax.flatten_all()?.to_vec1::<f64>()?;
        for (m, a) in vmax.iter().zip(&amax) {
            assert_eq!(*m, if *a > 0.0 { 448.0 } else { 0.0 }, "{dt:?}: a row's largest value");
        }
        let back = ms::quantized::dequantize(&q)?;
        assert_close(&format!("e4m3 dequantize {dt:?}"), &back, &r::quantized::dequantize_exact(&q)?, 1e-6)?;
    }
    Ok(())
}

test_device!(
    quantize_e4m3_round_trips_within_half_a_step,
    quantize_e4m3_round_trips_within_half_a_step_cpu,
    quantize_e4m3_round_trips_within_half_a_step_cuda
);

/// `maxsim_quantized` against the F64 reference over exactly dequantized
/// rows: query lengths across the 16- and 32-row lane chunks, dims with and
/// without a multiple of 4, masked query rows and documents with no valid
/// token (which score 0).
fn maxsim_quantized_matches_reference(dev: &Device) -> Result<()> {
    for (nq, nd, lq, ld, dim) in
        [(3, 5, 7, 9, 128), (2, 17, 33, 40, 96), (4, 3, 16, 1, 36), (2, 4, 20, 13, 30), (1, 9, 32, 300, 64)]
    {
        for (fmt, quantize, tol) in formats(dev, dim)? {
            let q = quantize(&randn(&[nq, lq, dim], DType::F32, dev)?)?;
            let d = quantize(&randn(&[nd, ld, dim], DType::F32, dev)?)?;
            let qm = rand_mask(&[nq, lq], 0.3, dev)?;
            // Document 0 has no valid token.
            let mut dm = rand_mask(&[nd, ld], 0.3, dev)?.to_dtype(DType::U32)?.to_vec2::<u32>()?;
            dm[0].iter_mut().for_each(|x| *x = 0);
            let dm = Tensor::new(dm, dev)?.to_dtype(DType::U8)?;
            let what = format!("maxsim_quantized {fmt} {nq}x{nd}x{lq}x{ld}x{dim} on {dev:?}");
            for (qm, dm) in [(None, None), (Some(&qm), Some(&dm))] {
                let out = ms::quantized::maxsim_quantized(&q, &d, qm, dm)?;
                assert_eq!((out.dtype(), out.dims()), (DType::F32, &[nq, nd][..]));
                let want = r::quantized::maxsim_quantized(&q, &d, qm, dm)?;
                assert_close(&format!("{what} masks {}", qm.is_some()), &out, &want, tol)?;
                if dm.is_some() {
                    let first = out.narrow(1, 0, 1)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert_eq!(first, 0.0, "{what}: an empty document must score 0");
                }
            }
        }
    }
    Ok(())
}

test_device!(
    maxsim_quantized_matches_reference,
    maxsim_quantized_matches_reference_cpu,
    maxsim_quantized_matches_reference_cuda
);

/// Shapes that take each tile of the 8-bit CUDA kernels (the tests run once
/// per `CANDLE_MAXSIM_TILE` on the GPU to cover every one): a grid of
/// 128-row query tiles against documents spanning several 64- and 128-row
/// tiles, one query against many documents, short documents, a dim that is
/// no multiple of 16 (unaligned rows). Every other document's scales are
/// negated: a document scale of either sign multiplies its similarities
/// before the max.
fn maxsim_quantized_tiles_match_reference(dev: &Device) -> Result<()> {
    for (nq, nd, lq, ld, dim) in
        [(8, 12, 32, 200, 128), (1, 70, 32, 130, 128), (3, 9, 100, 64, 64), (5, 6, 17, 33, 120)]
    {
        for (fmt, quantize, tol) in formats(dev, dim)? {
            let q = quantize(&randn(&[nq, lq, dim], DType::F32, dev)?)?;
            let d = quantize(&randn(&[nd, ld, dim], DType::F32, dev)?)?;
            let sign = Tensor::from_vec((0..nd).map(|j| if j % 2 == 1 { -1f32 } else { 1. }).collect(), (nd, 1), dev)?;
            let signed = d.scales().broadcast_mul(&sign)?;
            let d = match d.format() {
                ms::quantized::QuantFormat::I8 => Quantized::new(d.values().clone(), signed)?,
                ms::quantized::QuantFormat::E4m3 => Quantized::new_e4m3(d.values().clone(), signed)?,
            };
            let qm = rand_mask(&[nq, lq], 0.2, dev)?;
            let dm = rand_mask(&[nd, ld], 0.2, dev)?;
            let what = format!("maxsim_quantized {fmt} {nq}x{nd}x{lq}x{ld}x{dim} on {dev:?}");
            for (qm, dm) in [(None, None), (Some(&qm), Some(&dm))] {
                let out = ms::quantized::maxsim_quantized(&q, &d, qm, dm)?;
                let want = r::quantized::maxsim_quantized(&q, &d, qm, dm)?;
                assert_close(&format!("{what} masks {}", qm.is_some()), &out, &want, tol)?;
            }
        }
    }
    Ok(())
}

test_device!(
    maxsim_quantized_tiles_match_reference,
    maxsim_quantized_tiles_match_reference_cpu,
    maxsim_quantized_tiles_match_reference_cuda
);

/// The packed layout, pairs of packed sequences and the streaming top-k
/// against the reference over
/// exactly dequantized rows (empty sequences included; chunks smaller
/// than the collection).
fn packed_pairs_and_retrieve_quantized_match_reference(dev: &Device) -> Result<()> {
    for (nq, nd, dim, seed) in [(3, 11, 64, 1), (5, 40, 96, 2), (2, 7, 30, 3)] {
        for (fmt, quantize, tol) in formats(dev, dim)? {
            let (cq, mq) = rand_offsets(nq, 33, seed);
            let (cd, md) = rand_offsets(nd, 50, seed + 10);
            let q = quantize(&randn(&[*cq.last().unwrap() as usize, dim], DType::F32, dev)?)?;
            let d = quantize(&randn(&[*cd.last().unwrap() as usize, dim], DType::F32, dev)?)?;
            let (cu_q, cu_d) = (Tensor::new(cq.as_slice(), dev)?, Tensor::new(cd.as_slice(), dev)?);
            let out = ms::quantized::maxsim_quantized_varlen(&q, &cu_q, mq, &d, &cu_d, md)?;
            let want = r::maxsim_varlen(
                &r::quantized::dequantize_exact(&q)?,
                &cu_q,
                mq,
                &r::quantized::dequantize_exact(&d)?,
                &cu_d,
                md,
            )?;
            assert_close(&format!("maxsim_quantized_varlen {fmt} {nq}x{nd}x{dim} on {dev:?}"), &out, &want, tol)?;
            let pq: Vec<u32> = (0..2 * nd as u32).map(|p| p % nq as u32).collect();
            let pd: Vec<u32> = (0..2 * nd as u32).map(|p| (p * 7 + 3) % nd as u32).collect();
            let (pq, pd) = (Tensor::new(pq.as_slice(), dev)?, Tensor::new(pd.as_slice(), dev)?);
            let out = ms::quantized::score_pairs_quantized(&q, &cu_q, mq, &d, &cu_d, md, &pq, &pd)?;
            let (qe, de) = (r::quantized::dequantize_exact(&q)?, r::quantized::dequantize_exact(&d)?);
            let want = r::score_pairs_packed(&qe, &cu_q, mq, &de, &cu_d, md, &pq, &pd)?;
            assert_close(&format!("score_pairs_quantized {fmt} {nq}x{nd}x{dim} on {dev:?}"), &out, &want, tol)?;
        }
    }
    for (fmt, quantize, tol) in formats(dev, 64)? {
        let q = quantize(&randn(&[4, 20, 64], DType::F32, dev)?)?;
        let d = quantize(&randn(&[37, 30, 64], DType::F32, dev)?)?;
        let dm = rand_mask(&[37, 30], 0.3, dev)?;
        let (vals, ids) = ms::quantized::retrieve_quantized(&q, &d, None, Some(&dm), 5, 8)?;
        let (qe, de) = (r::quantized::dequantize_exact(&q)?, r::quantized::dequantize_exact(&d)?);
        let (want_vals, want_ids) = r::retrieve(&qe, &de, None, Some(&dm), 5)?;
        assert_close(&format!("retrieve_quantized {fmt} on {dev:?}"), &vals, &want_vals, tol)?;
        let (ids, want_ids, wv) = (ids.to_vec2::<u32>()?, want_ids.to_vec2::<u32>()?, want_vals.to_vec2::<f32>()?);
        if fmt == "i8" {
            assert_eq!(ids, want_ids, "retrieve_quantized {fmt} on {dev:?}: ids");
            continue;
        }
        // e4m3: the ids are compared where the reference's neighbouring
        // scores are further apart than the tolerance (a near tie may swap).
        let gap = tol * max_abs(&want_vals)?;
        for (i, (row, want)) in ids.iter().zip(&want_ids).enumerate() {
            for k in 0..row.len() {
                let apart = (k == 0 || (wv[i][k - 1] - wv[i][k]) as f64 > 2.0 * gap)
                    && (k + 1 == row.len() || (wv[i][k] - wv[i][k + 1]) as f64 > 2.0 * gap);
                if apart {
                    assert_eq!(row[k], want[k], "retrieve_quantized {fmt} on {dev:?}: query {i} rank {k}");
                }
            }
        }
    }
    let q = ms::quantized::quantize(&randn(&[4, 20, 64], DType::F32, dev)?)?;
    let d = ms::quantized::quantize(&randn(&[37, 30, 64], DType::F32, dev)?)?;
    expect_err(ms::quantized::retrieve_quantized(&q, &d, None, None, 0, 8), "top_k");
    expect_err(
        ms::quantized::maxsim_quantized_varlen(
            &q,
            &Tensor::new(&[0u32, 80], dev)?,
            80,
            &d,
            &Tensor::new(&[0u32, 1110], dev)?,
            1110,
        ),
        "q.values",
    );
    Ok(())
}

test_device!(
    packed_pairs_and_retrieve_quantized_match_reference,
    packed_pairs_and_retrieve_quantized_match_reference_cpu,
    packed_pairs_and_retrieve_quantized_match_reference_cuda
);

/// Each malformed argument is an `Err` naming it.
fn maxsim_quantized_rejects_bad_input(dev: &Device) -> Result<()> {
    let q = ms::quantized::quantize(&randn(&[2, 4, 8], DType::F32, dev)?)?;
    let d = ms::quantized::quantize(&randn(&[3, 5, 8], DType::F32, dev)?)?;
    expect_err(Quantized::new(q.values().to_dtype(DType::F32)?, q.scales().clone()), "values");
    expect_err(Quantized::new(q.values().clone(), q.scales().narrow(1, 0, 3)?), "scales");
    expect_err(q.narrow(2, 0, 4), "axis");
    let other = ms::quantized::quantize(&randn(&[3, 5, 12], DType::F32, dev)?)?;
    expect_err(ms::quantized::maxsim_quantized(&q, &other, None, None), "d.values");
    expect_err(ms::quantized::maxsim_quantized(&q, &d, Some(&Tensor::ones((2, 5), DType::U8, dev)?), None), "q_mask");
    expect_err(ms::quantized::quantize(&Tensor::new(&[1u32, 2], dev)?), "x");
    let negative = Quantized::new(q.values().clone(), q.scales().neg()?)?;
    expect_err(ms::quantized::maxsim_quantized(&negative, &d, None, None), "q.scales");
    let d_e4m3 = ms::quantized::quantize_e4m3(&randn(&[3, 5, 8], DType::F32, dev)?)?;
    expect_err(ms::quantized::maxsim_quantized(&q, &d_e4m3, None, None), "d.values");
    expect_err(ms::quantized::quantize_e4m3(&Tensor::new(&[1u32, 2], dev)?), "x");
    Ok(())
}

test_device!(
    maxsim_quantized_rejects_bad_input,
    maxsim_quantized_rejects_bad_input_cpu,
    maxsim_quantized_rejects_bad_input_cuda
);

/// Where the e4m3 kernels do not run (a CUDA GPU other than Hopper, or a
/// dim over 128), e4m3 scoring is an `Err` naming `q.values`, never a
/// silent fallback; elsewhere it scores.
fn e4m3_errs_where_unsupported(dev: &Device) -> Result<()> {
    for dim in [64, 160] {
        let q = ms::quantized::quantize_e4m3(&randn(&[2, 4, dim], DType::F32, dev)?)?;
        let d = ms::quantized::quantize_e4m3(&randn(&[3, 5, dim], DType::F32, dev)?)?;
        let out = ms::quantized::maxsim_quantized(&q, &d, None, None);
        if ms::quantized::e4m3_supported(dev, dim)? {
            let want = r::quantized::maxsim_quantized(&q, &d, None, None)?;
            assert_close(&format!("e4m3 dim {dim} on {dev:?}"), &out?, &want, 1e-3)?;
        } else {
            expect_err(out, "q.values");
        }
    }
    Ok(())
}

test_device!(e4m3_errs_where_unsupported, e4m3_errs_where_unsupported_cpu, e4m3_errs_where_unsupported_cuda);
