//! PLAID / ColBERTv2 compressed documents (src/ops/residual.rs): bucket
//! packing in both bit orders, `maxsim_residual` and
//! `maxsim_residual_varlen` against `reference`, and the gradient to q.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{
    self as ms, reference as r,
    residual::{BitOrder, ResidualCodec},
};

#[test]
fn bucket_indices_pack_as_computed_by_hand() -> Result<()> {
    assert_eq!(ms::residual::pack_bucket_indices(&[1, 2, 3, 0], 2, BitOrder::ColBert)?, vec![156]);
    assert_eq!(ms::residual::pack_bucket_indices(&[1, 8], 4, BitOrder::ColBert)?, vec![0x81]);
    assert_eq!(ms::residual::pack_bucket_indices(&[1, 2, 3, 0], 2, BitOrder::Lsb)?, vec![0b00_11_10_01]);
    assert_eq!(ms::residual::pack_bucket_indices(&[1, 8], 4, BitOrder::Lsb)?, vec![0x81]);
    assert_eq!(ms::residual::pack_bucket_indices(&[0xA5], 8, BitOrder::ColBert)?, vec![0xA5]);
    assert_eq!(ms::residual::unpack_bucket_indices(&[156], 2, BitOrder::ColBert)?, vec![1, 2, 3, 0]);
    Ok(())
}

#[test]
fn bucket_indices_round_trip() -> Result<()> {
    for nbits in [2usize, 4, 8] {
        for order in [BitOrder::Lsb, BitOrder::ColBert] {
            let idx: Vec<u8> = (0..96u32).map(|k| ((k * 7 + 3) % (1 << nbits)) as u8).collect();
            let packed = ms::residual::pack_bucket_indices(&idx, nbits, order)?;
            assert_eq!(packed.len(), 96 * nbits / 8);
            assert_eq!(ms::residual::unpack_bucket_indices(&packed, nbits, order)?, idx, "nbits {nbits} {order:?}");
        }
    }
    Ok(())
}

/// A codec on the CPU: `n_c` F16 centroids, evenly spaced bucket weights (`step` apart).
fn codec(nbits: usize, order: BitOrder, dim: usize, n_c: usize, step: f32) -> Result<ResidualCodec> {
    let bw: Vec<f32> = (0..1 << nbits).map(|k| (k as f32 - (1 << nbits) as f32 / 2.0) * step).collect();
    Ok(ResidualCodec {
        centroids: randn(&[n_c, dim], DType::F16, &Device::Cpu)?,
        bucket_weights: Tensor::new(bw, &Device::Cpu)?,
        nbits,
        bit_order: order,
    })
}

/// The codec's tensors moved to `dev`.
pub fn codec_on(c: &ResidualCodec, dev: &Device) -> Result<ResidualCodec> {
    Ok(ResidualCodec {
        centroids: c.centroids.to_device(dev)?,
        bucket_weights: c.bucket_weights.to_device(dev)?,
        nbits: c.nbits,
        bit_order: c.bit_order,
    })
}

/// Random compressed documents on the CPU: (codec of 97 centroids, codes
/// `[Nd, Ld]` U32 with garbage past each length, residual bytes
/// `[Nd, Ld, dim·nbits/8]`, doc_lens `[Nd]` with document 1 empty and
/// document 2 full).
pub fn residual_docs(
    nd: usize,
    ld: usize,
    dim: usize,
    nbits: usize,
    order: BitOrder,
    seed: u64,
) -> Result<(ResidualCodec, Tensor, Tensor, Tensor)> {
    let cpu = Device::Cpu;
    let n_c = 97;
    let codec = codec(nbits, order, dim, n_c, 0.04)?;
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) as u32
    };
    let lens: Vec<u32> = (0..nd)
        .map(|j| match j {
            1 => 0,
            2 => ld as u32,
            _ => next() % (ld as u32 + 1),
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

/// Both layouts, nbits 2 / 4 / 8, both bit orders, with and without
/// normalization, U32 and I64 codes, an empty document (scores 0). On CUDA
/// also the warp kernel (queries of up to 32 rows at dims 64 / 96 / 128)
/// and the tile kernels (40 rows, dim 48), F16 and BF16.
fn residual_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let dim = 32;
    for nbits in [2usize, 4, 8] {
        for order in [BitOrder::Lsb, BitOrder::ColBert] {
            for dt in [DType::F32, DType::BF16] {
                let c = codec(nbits, order, dim, 50, 0.05)?;
                let cg = codec_on(&c, dev)?;
                let (nd, ld) = (6, 11);
                let codes = Tensor::rand(0f32, 50., (nd, ld), &cpu)?.to_dtype(DType::U32)?;
                let res = Tensor::rand(0f32, 256., (nd, ld, dim * nbits / 8), &cpu)?.to_dtype(DType::U8)?;
                let lens = Tensor::new(&[11u32, 0, 5, 1, 11, 7], &cpu)?;
                let q = randn(&[3, 8, dim], dt, &cpu)?;
                // Normalized half-precision tokens on CUDA: as for the kernels' own shapes below.
                let tol = |normalize: bool| match (dev.is_cuda() && normalize, dt) {
                    (true, DType::F16 | DType::BF16) => 3e-2,
                    _ => score_tol(dev, dt).max(1e-5),
                };
                for normalize in [false, true] {
                    let what = format!("residual nb{nbits} {order:?} {dt:?} norm={normalize}");
                    let tol = tol(normalize);
                    let want = r::residual::maxsim_residual(&q, &codes, &res, &lens, &c, normalize)?;
                    for codes in [codes.clone(), codes.to_dtype(DType::I64)?] {
                        let g = |t: &Tensor| t.to_device(dev);
                        let out =
                            ms::residual::maxsim_residual(&g(&q)?, &g(&codes)?, &g(&res)?, &g(&lens)?, &cg, normalize)?;
                        assert_close(&format!("{what} {:?} codes", codes.dtype()), &out, &want, tol)?;
                        assert_eq!(out.to_vec2::<f32>()?[0][1], 0.0, "{what}: an empty document scores 0");
                    }
                }
                // Packed (varlen) form, I64 codes as fast-plaid writes them.
                let (cu, longest) = rand_offsets(7, 12, nbits as u64);
                let t = *cu.last().unwrap() as usize;
                let codes = Tensor::rand(0f32, 50., t, &cpu)?.to_dtype(DType::U32)?.to_dtype(DType::I64)?;
                let res = Tensor::rand(0f32, 256., (t, dim * nbits / 8), &cpu)?.to_dtype(DType::U8)?;
                let cu = Tensor::new(cu, &cpu)?;
                let g = |t: &Tensor| t.to_device(dev);
                let out = ms::residual::maxsim_residual_varlen(
                    &g(&q)?,
                    &g(&codes)?,
                    &g(&res)?,
                    &g(&cu)?,
                    longest,
                    &cg,
                    true,
                )?;
                let want = r::residual::maxsim_residual_varlen(&q, &codes, &res, &cu, longest, &c, true)?;
                assert_close(&format!("residual varlen nb{nbits} {order:?} {dt:?}"), &out, &want, tol(true))?;
            }
        }
    }
    if gpu_cases(dev) {
        residual_kernel_variants_match_reference(dev)?;
    }
    Ok(())
}

test_device!(residual_matches_reference, residual_matches_reference_cpu, residual_matches_reference_cuda);

/// The CUDA kernels' shapes: queries of up to 32 rows at dims 64 / 96 / 128
/// take the warp kernel (kernels/residual.cu); 40 rows and dim 48 the tile
/// kernels; dim 384 (an encoder without a projection) no fused kernel: the
/// tokens decompressed on the device and scored by the dense kernels.
/// Padded and packed documents, F16 and BF16 queries.
fn residual_kernel_variants_match_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for (dim, nq, lq, nd, ld) in [
        (128, 3, 32, 40, 150),
        (64, 2, 20, 33, 70),
        (96, 1, 32, 25, 300),
        (48, 4, 8, 9, 64),
        (128, 2, 40, 20, 90),
        (384, 2, 32, 12, 70),
    ] {
        for nbits in [2usize, 4, 8] {
            for order in [BitOrder::ColBert, BitOrder::Lsb] {
                let (c, codes, res, lens) = residual_docs(nd, ld, dim, nbits, order, (dim * nbits) as u64)?;
                let cg = codec_on(&c, dev)?;
                let g = |t: &Tensor| t.to_device(dev);
                for dt in [DType::BF16, DType::F16] {
                    let q = randn(&[nq, lq, dim], dt, &cpu)?;
                    for normalize in [false, true] {
                        let what = format!("residual d{dim} nb{nbits} {order:?} {dt:?} norm={normalize}");
                        let want = r::residual::maxsim_residual(&q, &codes, &res, &lens, &c, normalize)?;
                        let tol = if normalize { 3e-2 } else { score_tol(dev, dt) };
                        for codes_t in [codes.clone(), codes.to_dtype(DType::I64)?] {
                            let out = ms::residual::maxsim_residual(
                                &g(&q)?,
                                &g(&codes_t)?,
                                &g(&res)?,
                                &g(&lens)?,
                                &cg,
                                normalize,
                            )?;
                            assert_close(&format!("{what} {:?} codes", codes_t.dtype()), &out, &want, tol)?;
                        }
                    }
                    // Varlen: the valid tokens packed, cu_d from the lengths (one empty document).
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
                    let want = r::residual::maxsim_residual_varlen(&q, &pcodes, &pres, &cu, ld, &c, true)?;
                    let out = ms::residual::maxsim_residual_varlen(
                        &g(&q)?,
                        &g(&pcodes)?,
                        &g(&pres)?,
                        &g(&cu)?,
                        ld,
                        &cg,
                        true,
                    )?;
                    assert_close(&format!("varlen d{dim} nb{nbits} {order:?} {dt:?}"), &out, &want, 3e-2)?;
                }
            }
        }
    }
    Ok(())
}

/// fast-plaid pads codes with -1: codes past a document's length are never read.
fn padding_codes_are_never_read(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let c = codec(2, BitOrder::ColBert, 16, 10, 0.05)?;
    let codes = Tensor::new(&[[3i64, 4, -1], [5, -1, -1]], &cpu)?;
    let res = Tensor::rand(0f32, 256., (2, 3, 4), &cpu)?.to_dtype(DType::U8)?;
    let lens = Tensor::new(&[2u32, 1], &cpu)?;
    let q = randn(&[2, 4, 16], DType::F32, &cpu)?;
    let g = |t: &Tensor| t.to_device(dev);
    let out = ms::residual::maxsim_residual(&g(&q)?, &g(&codes)?, &g(&res)?, &g(&lens)?, &codec_on(&c, dev)?, false)?;
    let want = r::residual::maxsim_residual(&q, &codes.clamp(0i64, 9i64)?, &res, &lens, &c, false)?;
    assert_close("padding codes", &out, &want, score_tol(dev, DType::F32).max(1e-5))
}

test_device!(padding_codes_are_never_read, padding_codes_are_never_read_cpu, padding_codes_are_never_read_cuda);

/// Codes, residuals and a codec whose decompressed tokens are exact in F16
/// (centroids multiples of 1/16, bucket weights of 1/32): the op, which
/// decompresses in the queries' dtype, and the reference, in F32, score the
/// same documents, so both pick the same winners.
fn exact_f16_docs(nd: usize, ld: usize, dim: usize) -> Result<(ResidualCodec, Tensor, Tensor, Tensor)> {
    let (c, codes, res, lens) = residual_docs(nd, ld, dim, 4, BitOrder::ColBert, 7)?;
    let centroids = ((c.centroids.to_dtype(DType::F32)? * 16.0)?.round()? / 16.0)?.to_dtype(DType::F16)?;
    let bw: Vec<f32> = (0..16).map(|k| (k as f32 - 8.0) / 32.0).collect();
    let c = ResidualCodec { centroids, bucket_weights: Tensor::new(bw, &Device::Cpu)?, ..c };
    Ok((c, codes, res, lens))
}

/// Gradients flow to q only (the documents are data), through the
/// decompression and the dense op: F32 with normalization, and F16.
fn residual_grad_to_q_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    // F32, normalized: documents as in the reference.
    let c = ResidualCodec {
        centroids: randn(&[10, 16], DType::F32, &cpu)?,
        bucket_weights: Tensor::new(&[-0.1f32, -0.03, 0.03, 0.1], &cpu)?,
        nbits: 2,
        bit_order: BitOrder::ColBert,
    };
    let codes = Tensor::new(&[[1u32, 4, 9, 0], [3, 3, 7, 2]], &cpu)?;
    let res = Tensor::rand(0f32, 255., (2, 4, 4), &cpu)?.to_dtype(DType::U8)?;
    let lens = Tensor::new(&[4u32, 2], &cpu)?;
    let q = randn(&[2, 5, 16], DType::F32, &cpu)?;
    check_q_grad("residual F32 normalized", dev, &q, &codes, &res, &lens, &c, true, 1e-4)?;
    // F16 queries against documents of up to 80 tokens at dim 128.
    let (c, codes, res, lens) = exact_f16_docs(12, 80, 128)?;
    let q = randn(&[3, 16, 128], DType::F16, &cpu)?;
    check_q_grad("residual F16", dev, &q, &codes, &res, &lens, &c, false, 1e-2)
}

/// The op's gradient to q on `dev` against autograd through `reference` on the CPU in F32.
#[allow(clippy::too_many_arguments)]
fn check_q_grad(
    what: &str,
    dev: &Device,
    q: &Tensor,
    codes: &Tensor,
    res: &Tensor,
    lens: &Tensor,
    c: &ResidualCodec,
    normalize: bool,
    tol: f64,
) -> Result<()> {
    let cpu = Device::Cpu;
    let w = Tensor::rand(0.5f32, 1.5, (q.dim(0)?, codes.dim(0)?), &cpu)?;
    let g = |t: &Tensor| t.to_device(dev);
    let qv = candle_core::Var::from_tensor(&g(q)?)?;
    let s =
        ms::residual::maxsim_residual(qv.as_tensor(), &g(codes)?, &g(res)?, &g(lens)?, &codec_on(c, dev)?, normalize)?;
    let got = (s * g(&w)?)?.sum_all()?.backward()?.get(qv.as_tensor()).expect("grad of q").to_device(&cpu)?;
    assert_eq!(got.dtype(), q.dtype(), "{what}");
    let rv = candle_core::Var::from_tensor(&q.to_dtype(DType::F32)?)?;
    let s = r::residual::maxsim_residual(rv.as_tensor(), codes, res, lens, c, normalize)?;
    let want = (s * &w)?.sum_all()?.backward()?.get(rv.as_tensor()).expect("reference grad of q").clone();
    assert_close(&format!("{what} grad q"), &got, &want, tol)
}

test_device!(
    residual_grad_to_q_matches_reference,
    residual_grad_to_q_matches_reference_cpu,
    residual_grad_to_q_matches_reference_cuda
);

/// `maxsim_residual_pairs` against `reference`: repeated and unordered
/// pairs, pairs with no document (-inf), an empty document, both code
/// dtypes, with and without normalization. On CUDA the warp kernel's shapes
/// (F16/BF16, up to 32 query rows, dims 64 / 96 / 128), which read the pairs
/// on the device, and the host-pairs path (F32 queries, 40 rows, dim 48).
fn residual_pairs_match_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let mut cases = vec![(32usize, DType::F32, 3usize, 8usize)];
    if gpu_cases(dev) {
        cases.extend([
            (128, DType::BF16, 4, 32),
            (64, DType::F16, 2, 20),
            (96, DType::BF16, 3, 32),
            (48, DType::BF16, 2, 8),
        ]);
        cases.extend([(128, DType::F32, 2, 16), (128, DType::BF16, 2, 40), (384, DType::F16, 1, 32)]);
    }
    for (dim, dt, nq, lq) in cases {
        let (nd, ld, nbits) = (23, 60, 4);
        let (c, codes, res, lens) = residual_docs(nd, ld, dim, nbits, BitOrder::ColBert, dim as u64)?;
        // Packed: the valid tokens of each document, document 1 empty.
        let lv: Vec<u32> = lens.to_vec1()?;
        let keep: Vec<u32> = (0..nd * ld).filter(|t| (t % ld) < lv[t / ld] as usize).map(|t| t as u32).collect();
        let keep = Tensor::new(keep, &cpu)?;
        let pcodes = codes.flatten_all()?.index_select(&keep, 0)?;
        let pres = res.reshape((nd * ld, dim * nbits / 8))?.index_select(&keep, 0)?;
        let mut cu = vec![0u32];
        for l in &lv {
            cu.push(cu.last().unwrap() + l);
        }
        let cu = Tensor::new(cu, &cpu)?;
        let pq: Vec<u32> = (0..5 * nd as u32).map(|p| (p * 7 + 1) % nq as u32).collect();
        let pd: Vec<u32> = (0..5 * nd as u32)
            .map(|p| if p % 9 == 4 { ms::residual::NO_DOCUMENT } else { (p * 11 + 3) % nd as u32 })
            .collect();
        let (pq, pd) = (Tensor::new(pq, &cpu)?, Tensor::new(pd, &cpu)?);
        let q = randn(&[nq, lq, dim], dt, &cpu)?;
        let g = |t: &Tensor| t.to_device(dev);
        let cg = codec_on(&c, dev)?;
        for normalize in [false, true] {
            for codes_t in [pcodes.clone(), pcodes.to_dtype(DType::I64)?] {
                let what = format!("pairs d{dim} {dt:?} lq{lq} norm={normalize} {:?}", codes_t.dtype());
                let want = r::residual::maxsim_residual_pairs(&q, &codes_t, &pres, &cu, ld, &pq, &pd, &c, normalize)?;
                let out = ms::residual::maxsim_residual_pairs(
                    &g(&q)?,
                    &g(&codes_t)?,
                    &g(&pres)?,
                    &g(&cu)?,
                    ld,
                    &g(&pq)?,
                    &g(&pd)?,
                    &cg,
                    normalize,
                )?;
                let (ov, wv): (Vec<f32>, Vec<f32>) = (out.to_vec1()?, want.to_vec1()?);
                for (p, (o, w)) in ov.iter().zip(&wv).enumerate() {
                    assert_eq!(o.is_finite(), w.is_finite(), "{what}: pair {p} is {o}, want {w}");
                }
                // The same offsets checked once, either way: the same bits.
                let host = std::sync::Arc::new(cu.to_vec1::<u32>()?);
                let rows = *host.last().unwrap() as usize;
                let once = [
                    ms::residual::DocOffsets::new(&g(&cu)?, rows, ld)?,
                    // SAFETY: the device copy is made from `host`.
                    unsafe { ms::residual::DocOffsets::from_parts(host.clone(), g(&cu)?, rows, ld)? },
                ];
                for d in &once {
                    let (q, codes, pres, pq, pd) = (g(&q)?, g(&codes_t)?, g(&pres)?, g(&pq)?, g(&pd)?);
                    let o2 =
                        ms::residual::maxsim_residual_pairs_offsets(&q, &codes, &pres, d, &pq, &pd, &cg, normalize)?;
                    let o2: Vec<f32> = o2.to_vec1()?;
                    assert!(o2.iter().zip(&ov).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: DocOffsets");
                }
                let finite = |v: &[f32]| {
                    Tensor::new(v.iter().map(|x| if x.is_finite() { *x } else { 0.0 }).collect::<Vec<f32>>(), &cpu)
                };
                let tol = if normalize && dt != DType::F32 { 3e-2 } else { score_tol(dev, dt).max(1e-5) };
                assert_close(&what, &finite(&ov)?, &finite(&wv)?, tol)?;
            }
        }
    }
    Ok(())
}

test_device!(residual_pairs_match_reference, residual_pairs_match_reference_cpu, residual_pairs_match_reference_cuda);

/// Offsets checked once (`DocOffsets`): bad ones are errors naming `cu_d`
/// (or `max_ld`), and offsets of other documents than the codes' too.
fn doc_offsets_errors_name_the_argument(dev: &Device) -> Result<()> {
    use ms::residual::DocOffsets;
    let t = |v: &[u32]| Tensor::new(v, dev);
    let arc = |v: &[u32]| std::sync::Arc::new(v.to_vec());
    let first = |r: Result<DocOffsets>| r.expect_err("bad offsets").to_string();
    assert!(first(DocOffsets::new(&t(&[0, 3, 2])?, 2, 8)).starts_with("cu_d:"));
    assert!(first(DocOffsets::new(&t(&[1, 3])?, 3, 8)).starts_with("cu_d:"));
    assert!(first(DocOffsets::new(&t(&[0, 3, 5])?, 6, 8)).starts_with("cu_d:"));
    assert!(first(DocOffsets::new(&t(&[0, 3, 9])?, 9, 4)).starts_with("max_ld:"));
    // SAFETY (each): the device copy holds the host values.
    assert!(first(unsafe { DocOffsets::from_parts(arc(&[0, 3, 2]), t(&[0, 3, 2])?, 2, 8) }).starts_with("cu_d:"));
    assert!(first(unsafe { DocOffsets::from_parts(arc(&[0, 3]), t(&[0, 3, 4])?, 3, 8) }).starts_with("cu_d:"));
    let (nbits, dim) = (4, 64);
    let (c, codes, res, _) = residual_docs(2, 5, dim, nbits, BitOrder::ColBert, 3)?;
    let (codes, res) = (codes.flatten_all()?.to_device(dev)?, res.reshape((10, dim * nbits / 8))?.to_device(dev)?);
    let q = randn(&[1, 4, dim], DType::F16, dev)?;
    let d = DocOffsets::new(&t(&[0, 3, 7])?, 7, 8)?; // 7 rows, the codes have 10
    let p = t(&[0, 1])?;
    let e =
        ms::residual::maxsim_residual_pairs_offsets(&q, &codes, &res, &d, &t(&[0, 0])?, &p, &codec_on(&c, dev)?, true)
            .expect_err("offsets of 7 rows against 10 codes");
    assert!(e.to_string().starts_with("cu_d:"), "{e}");
    Ok(())
}

test_device!(
    doc_offsets_errors_name_the_argument,
    doc_offsets_errors_name_the_argument_cpu,
    doc_offsets_errors_name_the_argument_cuda
);

/// `ResidualCodec::compress` against buckets counted here from the
/// definition (cutoffs below each residual), packed by
/// `pack_bucket_indices`: nbits 2 / 4 / 8, both bit orders, F16 / BF16 /
/// F32 tokens, F16 and F32 centroids, I64 codes; and the decompressed
/// tokens are centroid plus the chosen bucket's weight.
fn compress_matches_definition(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let (t, dim, n_c) = (37, 64, 11);
    for nbits in [2usize, 4, 8] {
        for order in [BitOrder::ColBert, BitOrder::Lsb] {
            for (xdt, cdt) in [(DType::F16, DType::F16), (DType::BF16, DType::F16), (DType::F32, DType::F32)] {
                let mut c = codec(nbits, order, dim, n_c, 0.05)?;
                c.centroids = c.centroids.to_dtype(cdt)?;
                let x = (randn(&[t, dim], DType::F32, &cpu)? * 0.3)?.to_dtype(xdt)?;
                let codes = Tensor::rand(0f32, n_c as f32, t, &cpu)?.to_dtype(DType::U32)?;
                let mut cut: Vec<f32> = (0..(1 << nbits) - 1).map(|k| (k as f32 - 7.0) * 0.021).collect();
                cut.sort_by(f32::total_cmp);
                let cutoffs = Tensor::new(cut.clone(), &cpu)?;
                let (xv, cv, cents): (Vec<Vec<f32>>, Vec<u32>, Vec<Vec<f32>>) = (
                    x.to_dtype(DType::F32)?.to_vec2()?,
                    codes.to_vec1()?,
                    c.centroids.to_dtype(DType::F32)?.to_vec2()?,
                );
                let mut want = Vec::new();
                for (row, &code) in xv.iter().zip(&cv) {
                    let idx: Vec<u8> = row
                        .iter()
                        .zip(&cents[code as usize])
                        .map(|(&a, &b)| cut.iter().filter(|&&v| v < a - b).count() as u8)
                        .collect();
                    want.extend(ms::residual::pack_bucket_indices(&idx, nbits, order)?);
                }
                let g = |t: &Tensor| t.to_device(dev);
                let cg = codec_on(&c, dev)?;
                let out = cg.compress(&g(&x)?, &g(&codes.to_dtype(DType::I64)?)?, &g(&cutoffs)?)?;
                let what = format!("compress nb{nbits} {order:?} {xdt:?}/{cdt:?}");
                assert_eq!(out.flatten_all()?.to_vec1::<u8>()?, want, "{what}");
                let back = cg.decompress(&g(&codes)?, &out)?;
                let want_back = r::residual::decompress(&codes, &out.to_device(&cpu)?, &c)?;
                assert_close(&format!("{what} decompressed"), &back, &want_back, 1e-6)?;
            }
        }
    }
    Ok(())
}

test_device!(compress_matches_definition, compress_matches_definition_cpu, compress_matches_definition_cuda);

/// `nearest_centroids` against the full product: every dtype, a number of
/// rows that is not a multiple of 128, several dims, on a GPU thousands of
/// centroids; an empty input.
fn nearest_centroids_match_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let mut shapes = vec![(300, 37, 32), (129, 256, 64), (5, 1, 16), (1000, 100, 128)];
    if gpu_cases(dev) {
        shapes.push((300, 20_000, 128)); // 157 tiles of 128 centroids (the lazy scan's, with its knob)
    }
    for (t, c, dim) in shapes {
        for dt in DTYPES {
            let x = randn(&[t, dim], dt, &cpu)?;
            let cents = randn(&[c, dim], dt, &cpu)?;
            let want: Vec<u32> = r::residual::nearest_centroids(&x, &cents)?.to_vec1()?;
            let got: Vec<u32> =
                ms::residual::nearest_centroids(&x.to_device(dev)?, &cents.to_device(dev)?)?.to_vec1()?;
            // Rounding may flip a near-tie: the chosen centroid's product is within rounding of the best.
            let s: Vec<Vec<f32>> = x.to_dtype(DType::F32)?.matmul(&cents.to_dtype(DType::F32)?.t()?)?.to_vec2()?;
            let tol = if dt == DType::F32 { 1e-4 } else { 5e-2 };
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                let (sg, sw) = (s[i][g as usize], s[i][w as usize]);
                assert!(
                    g == w || (sw - sg).abs() <= tol * sw.abs().max(1.0),
                    "{t}x{c} d{dim} {dt:?} row {i}: {g} ({sg}) vs {w} ({sw})"
                );
            }
            let same = got.iter().zip(&want).filter(|(a, b)| a == b).count();
            assert!(same * 100 >= t * 97, "{t}x{c} d{dim} {dt:?}: {same}/{t} identical");
        }
    }
    let e = ms::residual::nearest_centroids(
        &randn(&[4, 8], DType::F32, dev)?.narrow(0, 0, 0)?,
        &randn(&[3, 8], DType::F32, dev)?,
    )?;
    assert_eq!(e.dims(), &[0]);
    expect_err(
        ms::residual::nearest_centroids(&randn(&[4, 8], DType::F32, dev)?, &randn(&[3, 9], DType::F32, dev)?),
        "centroids",
    );
    Ok(())
}

test_device!(
    nearest_centroids_match_reference,
    nearest_centroids_match_reference_cpu,
    nearest_centroids_match_reference_cuda
);
