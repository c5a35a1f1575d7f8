//! Bad input is an `Err` whose message starts with the argument at fault
//! (`expect_err(r, "q_mask")` asserts `q_mask:` first), never a panic or an
//! out-of-bounds read; the device stays usable afterwards.

use crate::common::*;
use crate::residual::{codec_on, residual_docs};
use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{
    self as ms,
    residual::{BitOrder, ResidualCodec},
};

/// `maxsim`, `maxsim_pairs`, `maxsim_with_argmax`, `retrieve`: ranks,
/// dims, dtypes, mask dtypes and shapes, KD and pair counts, top-k and chunk sizes.
fn dense_errors_name_the_argument(dev: &Device) -> Result<()> {
    let f32s = |dims: &[usize]| randn(dims, DType::F32, dev);
    let (q, d) = (f32s(&[2, 3, 8])?, f32s(&[4, 5, 8])?);
    expect_err(ms::maxsim(&q, &f32s(&[4, 5, 9])?, None, None), "d"); // dim
    expect_err(ms::maxsim(&f32s(&[3, 8])?, &d, None, None), "q");
    expect_err(ms::maxsim(&q, &f32s(&[5, 8])?, None, None), "d");
    expect_err(ms::maxsim(&q, &d, Some(&rand_mask(&[2, 4], 0.2, dev)?), None), "q_mask");
    expect_err(ms::maxsim(&q, &d, None, Some(&Tensor::ones((4, 5), DType::F32, dev)?)), "d_mask");
    expect_err(ms::maxsim(&q, &d, None, Some(&rand_mask(&[4, 6], 0.2, dev)?)), "d_mask");
    expect_err(ms::maxsim(&q, &d.to_dtype(DType::F16)?, None, None), "d");
    expect_err(ms::maxsim(&q.to_dtype(DType::U32)?, &d, None, None), "q");
    expect_err(ms::maxsim(&q, &d.to_dtype(DType::U8)?, None, None), "d");
    expect_err(ms::maxsim(&q, &f32s(&[3, 2, 5, 8])?, None, None), "d"); // KD needs Nq documents lists
    expect_err(ms::maxsim(&q, &f32s(&[2, 2, 5, 8])?, None, Some(&rand_mask(&[2, 5], 0.2, dev)?)), "d_mask");
    expect_err(ms::maxsim_with_argmax(&q, &f32s(&[4, 5, 9])?, None, None), "d");
    expect_err(ms::maxsim_pairs(&q, &d, None, None), "d"); // 4 documents for 2 queries
    let d2 = f32s(&[2, 5, 8])?;
    expect_err(ms::maxsim_pairs(&q, &d2, Some(&rand_mask(&[2, 4], 0.2, dev)?), None), "q_mask");
    expect_err(ms::maxsim_pairs(&q, &d2, None, Some(&rand_mask(&[2, 4], 0.2, dev)?)), "d_mask");
    expect_err(ms::retrieve(&q, &d, None, None, 0, 4), "top_k");
    expect_err(ms::retrieve(&q, &d, None, None, 3, 0), "chunk");
    expect_err(ms::retrieve(&q, &f32s(&[4, 8])?, None, None, 3, 2), "d");
    expect_err(ms::retrieve(&q, &d, None, Some(&rand_mask(&[4, 4], 0.2, dev)?), 3, 2), "d_mask");
    Ok(())
}

test_device!(dense_errors_name_the_argument, dense_errors_name_the_argument_cpu, dense_errors_name_the_argument_cuda);

/// `maxsim_varlen`, `score_pairs_packed`: offsets (order, start, end,
/// dtype), maxima below a real length, pair indices and counts.
fn varlen_errors_name_the_argument(dev: &Device) -> Result<()> {
    let q = randn(&[6, 8], DType::F32, dev)?;
    let d = randn(&[9, 8], DType::F32, dev)?;
    let u32s = |v: &[u32]| Tensor::new(v, dev);
    let (cu_q, cu_d) = (u32s(&[0, 2, 6])?, u32s(&[0, 4, 9])?);
    expect_err(ms::maxsim_varlen(&q, &u32s(&[0, 4, 2, 6])?, 4, &d, &cu_d, 5), "cu_q");
    expect_err(ms::maxsim_varlen(&q, &u32s(&[0, 2, 7])?, 5, &d, &cu_d, 5), "cu_q");
    expect_err(ms::maxsim_varlen(&q, &u32s(&[1, 2, 6])?, 5, &d, &cu_d, 5), "cu_q");
    expect_err(ms::maxsim_varlen(&q, &cu_q, 4, &d, &Tensor::new(&[0i64, 4, 9], dev)?, 5), "cu_d");
    expect_err(ms::maxsim_varlen(&q, &cu_q, 3, &d, &cu_d, 5), "max_lq");
    expect_err(ms::maxsim_varlen(&q, &cu_q, 4, &d, &cu_d, 4), "max_ld");
    expect_err(ms::maxsim_varlen(&q.unsqueeze(0)?, &cu_q, 4, &d, &cu_d, 5), "q");
    expect_err(ms::maxsim_varlen(&q, &cu_q, 4, &d.to_dtype(DType::BF16)?, &cu_d, 5), "d");
    let pairs = |pq: &[u32], pd: &[u32]| ms::score_pairs_packed(&q, &cu_q, 4, &d, &cu_d, 5, &u32s(pq)?, &u32s(pd)?);
    expect_err(pairs(&[0, 2], &[1, 1]), "pair_q");
    expect_err(pairs(&[0, 1], &[1, 2]), "pair_d");
    expect_err(pairs(&[0, 1], &[1]), "pair_d");
    let pd64 = Tensor::new(&[1i64, 1], dev)?;
    expect_err(ms::score_pairs_packed(&q, &cu_q, 4, &d, &cu_d, 5, &u32s(&[0, 1])?, &pd64), "pair_d");
    Ok(())
}

test_device!(
    varlen_errors_name_the_argument,
    varlen_errors_name_the_argument_cpu,
    varlen_errors_name_the_argument_cuda
);

/// Residual scoring and bucket packing: codec (nbits, centroid dim, bucket
/// weights), residual widths and rows, codes out of range (in a document,
/// through each kernel; past a length they are padding and never read),
/// lengths past Ld, offsets.
fn residual_errors_name_the_argument(dev: &Device) -> Result<()> {
    let dim = 16;
    let codec = |nbits: usize| -> Result<ResidualCodec> {
        Ok(ResidualCodec {
            centroids: randn(&[10, dim], DType::F32, dev)?,
            bucket_weights: randn(&[1 << nbits.min(8)], DType::F32, dev)?,
            nbits,
            bit_order: BitOrder::ColBert,
        })
    };
    let q = randn(&[2, 3, dim], DType::F32, dev)?;
    let codes = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], dev)?;
    let res = Tensor::zeros((2, 3, 4), DType::U8, dev)?;
    let lens = Tensor::new(&[3u32, 2], dev)?;
    let c2 = codec(2)?;
    expect_err(ms::residual::maxsim_residual(&q, &codes, &res, &lens, &codec(3)?, false), "nbits");
    let wide = ResidualCodec { centroids: randn(&[10, dim + 1], DType::F32, dev)?, ..c2.clone() };
    expect_err(ms::residual::maxsim_residual(&q, &codes, &res, &lens, &wide, false), "centroids");
    let few = ResidualCodec { bucket_weights: randn(&[3], DType::F32, dev)?, ..c2.clone() };
    expect_err(ms::residual::maxsim_residual(&q, &codes, &res, &lens, &few, false), "bucket_weights");
    let res5 = Tensor::zeros((2, 3, 5), DType::U8, dev)?;
    expect_err(ms::residual::maxsim_residual(&q, &codes, &res5, &lens, &c2, false), "residuals");
    expect_err(
        ms::residual::maxsim_residual(&q, &codes, &Tensor::zeros((2, 2, 4), DType::U8, dev)?, &lens, &c2, false),
        "residuals",
    );
    let bad = Tensor::new(&[[1u32, 2, 10], [4, 5, 6]], dev)?;
    expect_err(ms::residual::maxsim_residual(&q, &bad, &res, &lens, &c2, false), "codes");
    expect_err(ms::residual::maxsim_residual(&q, &codes, &res, &Tensor::new(&[4u32, 2], dev)?, &c2, false), "doc_lens");
    expect_err(ms::residual::maxsim_residual(&q, &codes, &res, &Tensor::new(&[3i64, 2], dev)?, &c2, false), "doc_lens");
    expect_err(ms::plaid::plaid_approx_score(&randn(&[10, 3], DType::F32, dev)?, &bad, &lens), "codes");
    let cu = Tensor::new(&[0u32, 3, 5], dev)?;
    let flat = Tensor::new(&[1u32, 2, 3, 4, 11], dev)?;
    let fres = Tensor::zeros((5, 4), DType::U8, dev)?;
    expect_err(ms::residual::maxsim_residual_varlen(&q, &flat, &fres, &cu, 3, &c2, false), "codes");
    let ok_flat = Tensor::new(&[1u32, 2, 3, 4, 5], dev)?;
    expect_err(
        ms::residual::maxsim_residual_varlen(&q, &ok_flat, &fres.narrow(0, 0, 4)?, &cu, 3, &c2, false),
        "residuals",
    );
    expect_err(
        ms::residual::maxsim_residual_varlen(&q, &ok_flat, &fres, &Tensor::new(&[0u32, 3, 4], dev)?, 3, &c2, false),
        "cu_d",
    );
    expect_err(ms::residual::maxsim_residual_varlen(&q, &ok_flat, &fres, &cu, 2, &c2, false), "max_ld");
    expect_err(ms::residual::pack_bucket_indices(&[1, 2, 3], 2, BitOrder::Lsb), "indices");
    expect_err(ms::residual::pack_bucket_indices(&[1, 2, 3, 4], 2, BitOrder::Lsb), "indices");
    expect_err(ms::residual::unpack_bucket_indices(&[1, 2], 3, BitOrder::ColBert), "nbits");

    // Codes past the 97 centroids inside documents of up to 80 tokens at dim
    // 128: found on the device by each path (the decompression kernel, the
    // warp kernel, padded and packed), never read out of bounds.
    let (c, codes, res, _) = residual_docs(12, 80, 128, 4, BitOrder::ColBert, 7)?;
    let cg = codec_on(&c, dev)?;
    let g = |t: &Tensor| t.to_device(dev);
    let q = g(&randn(&[3, 16, 128], DType::F16, &Device::Cpu)?)?;
    let ones = Tensor::ones(12, DType::U32, dev)?;
    let neg = codes.to_dtype(DType::I64)?.slice_assign(&[0..1, 0..1], &Tensor::new(&[[-5i64]], &Device::Cpu)?)?;
    expect_err(ms::residual::maxsim_residual(&q, &g(&neg)?, &g(&res)?, &ones, &cg, false), "codes");
    let pcodes = Tensor::new(&[3u32, 97, 5], dev)?;
    let pres = g(&res.reshape((12 * 80, 64))?.narrow(0, 0, 3)?)?;
    let pcu = Tensor::new(&[0u32, 1, 3], dev)?;
    expect_err(ms::residual::maxsim_residual_varlen(&q, &pcodes, &pres, &pcu, 2, &cg, false), "codes");
    let big = codes.slice_assign(&[3..4, 0..1], &Tensor::new(&[[200u32]], &Device::Cpu)?)?;
    // Only document 3's first token is scored.
    let only3 = Tensor::new(&[0u32, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0], dev)?;
    expect_err(ms::residual::maxsim_residual(&q, &g(&big)?, &g(&res)?, &only3, &cg, false), "codes");
    // Past each length: padding, never read.
    let pad0 = Tensor::zeros(12, DType::U32, dev)?;
    let out = ms::residual::maxsim_residual(&q, &g(&big)?, &g(&res)?, &pad0, &cg, false)?;
    assert_eq!(out.to_vec2::<f32>()?, vec![vec![0f32; 12]; 3], "documents of no token score 0");
    Ok(())
}

test_device!(
    residual_errors_name_the_argument,
    residual_errors_name_the_argument_cpu,
    residual_errors_name_the_argument_cuda
);

/// The first line of an error's message (candle may append a backtrace).
fn first_line<T: std::fmt::Debug>(r: Result<T>) -> String {
    let e = r.expect_err("an error").to_string();
    e.lines().next().unwrap_or_default().to_string()
}

/// `plaid_approx_score`: the first out-of-range length or code in document
/// order, reported exactly as the CPU op reports it (found on the device,
/// never read out of bounds); padding codes past a length are never read;
/// the device stays usable.
fn plaid_approx_errors_name_the_first_bad_entry(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let qcs = randn(&[10, 32], DType::F32, dev)?;
    let lens = Tensor::new(&[3u32, 2, 3], dev)?;
    let err_for = |qcs: &Tensor, codes: Tensor, lens: &Tensor| -> Result<String> {
        let e = first_line(ms::plaid::plaid_approx_score(qcs, &codes, lens));
        let e_cpu = first_line(ms::plaid::plaid_approx_score(
            &qcs.to_device(&cpu)?,
            &codes.to_device(&cpu)?,
            &lens.to_device(&cpu)?,
        ));
        assert_eq!(e, e_cpu, "the device reports the error as the CPU op does");
        Ok(e)
    };
    let err = |codes: Tensor, lens: &Tensor| err_for(&qcs, codes, lens);
    let expect = |e: String, start: &str| assert!(e.starts_with(start), "expected `{start}…`, got: {e}");
    expect(err(Tensor::new(&[[1u32, 2, 3], [4, 5, 6], [7, 10, 99]], dev)?, &lens)?, "codes: codes[2, 1] = 10");
    expect(err(Tensor::new(&[[1i64, 2, 3], [4, -5, 6], [7, 10, 99]], dev)?, &lens)?, "codes: codes[1, 1] = -5");
    // Past doc_lens[1] = 2: codes[1, 2] is padding and never read.
    let ok = ms::plaid::plaid_approx_score(&qcs, &Tensor::new(&[[1i64, 2, 3], [4, 5, -1], [7, 8, 9]], dev)?, &lens)?;
    assert_eq!(ok.dims(), &[3]);
    let long = Tensor::new(&[3u32, 4, 3], dev)?;
    expect(err(Tensor::new(&[[1u32, 2, 3], [4, 5, 6], [7, 10, 99]], dev)?, &long)?, "doc_lens: doc_lens[1] = 4");
    expect(err(Tensor::new(&[[1u32, 2, 3], [4, 5, 6], [7, 8, 9]], dev)?, &long)?, "doc_lens: doc_lens[1] = 4");
    // Past a document's first 32 codes (the row kernel's second chunk), for
    // the row kernel's query lengths and the general kernel's, and with C = 0.
    for (n_c, lq) in [(10, 16), (10, 32), (10, 64), (10, 20), (0, 32)] {
        let qcs = randn(&[n_c.max(1), lq], DType::F32, dev)?.narrow(0, 0, n_c)?;
        let mut codes = vec![1i64; 3 * 40];
        codes[40 + 35] = 10;
        codes[2 * 40 + 39] = -3;
        let codes = Tensor::from_vec(codes, (3, 40), dev)?;
        let e = err_for(&qcs, codes.clone(), &Tensor::new(&[0u32, 36, 40], dev)?)?;
        expect(e, if n_c == 0 { "codes: codes[1, 0] = 1" } else { "codes: codes[1, 35] = 10" });
        if n_c > 0 {
            let e = err_for(&qcs, codes.to_dtype(DType::U32)?, &Tensor::new(&[0u32, 35, 40], dev)?)?;
            expect(e, "codes: codes[2, 39] = 4294967293");
            expect(err_for(&qcs, codes, &Tensor::new(&[0u32, 35, 41], dev)?)?, "doc_lens: doc_lens[2] = 41");
        }
    }
    expect_err(
        ms::plaid::plaid_approx_score(
            &qcs.to_dtype(DType::F16)?,
            &Tensor::new(&[[1u32]], dev)?,
            &Tensor::new(&[1u32], dev)?,
        ),
        "query_centroid_scores",
    );
    expect_err(
        ms::plaid::plaid_approx_score(&qcs, &Tensor::new(&[[1u32]], dev)?, &Tensor::new(&[1u32, 1], dev)?),
        "doc_lens",
    );
    expect_err(ms::plaid::plaid_approx_score(&qcs, &Tensor::new(&[1u32], dev)?, &Tensor::new(&[1u32], dev)?), "codes");
    // Still usable.
    let ok = ms::plaid::plaid_approx_score(&qcs, &Tensor::new(&[[1u32, 2, 3], [4, 5, 6], [7, 8, 9]], dev)?, &lens)?;
    assert_eq!(ok.dims(), &[3]);
    Ok(())
}

test_device!(
    plaid_approx_errors_name_the_first_bad_entry,
    plaid_approx_errors_name_the_first_bad_entry_cpu,
    plaid_approx_errors_name_the_first_bad_entry_cuda
);

/// `maxsim_from_hidden` and its
/// value-and-grads form: shapes and dtypes of h_d, w, b, q, the document
/// mask, empty operands, the shape `dloss` returns.
fn from_hidden_errors_name_the_argument(dev: &Device) -> Result<()> {
    let bf16s = |dims: &[usize]| randn(dims, DType::BF16, dev);
    let (q, h, w) = (bf16s(&[2, 4, 64])?, bf16s(&[3, 5, 64])?, bf16s(&[64, 64])?);
    let bad_mask = Tensor::ones((3, 6), DType::U8, dev)?;
    expect_err(ms::maxsim_from_hidden(&q, &h, &w, None, Some(&bad_mask), true), "d_mask");
    expect_err(ms::maxsim_from_hidden(&q, &h, &bf16s(&[64, 32])?, None, None, true), "w");
    expect_err(ms::maxsim_from_hidden(&q, &h, &bf16s(&[64])?, None, None, true), "w");
    expect_err(ms::maxsim_from_hidden(&q, &h.to_dtype(DType::F32)?, &w, None, None, true), "h_d");
    expect_err(ms::maxsim_from_hidden(&q, &h, &w.to_dtype(DType::F16)?, None, None, true), "w");
    expect_err(ms::maxsim_from_hidden(&bf16s(&[2, 4, 32])?, &h, &w, None, None, true), "q");
    expect_err(ms::maxsim_from_hidden(&q, &h, &w, Some(&bf16s(&[32])?), None, true), "b");
    expect_err(ms::maxsim_from_hidden(&q, &h, &w, Some(&randn(&[64], DType::F32, dev)?), None, true), "b");
    let f32s = |dims: &[usize]| randn(dims, DType::F32, dev);
    let (q, h, w) = (f32s(&[2, 3, 4])?, f32s(&[3, 5, 6])?, f32s(&[4, 6])?);
    let vg = |q: &Tensor, dloss: &dyn Fn(&Tensor) -> Result<Tensor>| {
        ms::maxsim_from_hidden_value_and_grads(q, &h, &w, None, None, true, dloss).map(|(s, _)| s)
    };
    expect_err(vg(&q, &|s| s.sum_keepdim(1)), "dloss");
    expect_err(vg(&q.narrow(0, 0, 0)?, &|s| s.ones_like()), "q");
    Ok(())
}

test_device!(
    from_hidden_errors_name_the_argument,
    from_hidden_errors_name_the_argument_cpu,
    from_hidden_errors_name_the_argument_cuda
);

/// `l2_normalize` of a scalar or of integers.
fn l2_normalize_errors_name_the_argument(dev: &Device) -> Result<()> {
    expect_err(ms::l2_normalize(&Tensor::new(1f32, dev)?), "x");
    expect_err(ms::l2_normalize(&Tensor::new(&[1u32, 2], dev)?), "x");
    Ok(())
}

test_device!(
    l2_normalize_errors_name_the_argument,
    l2_normalize_errors_name_the_argument_cpu,
    l2_normalize_errors_name_the_argument_cuda
);

/// Operands on different devices: an `Err` naming the one not on q's device.
#[cfg(feature = "cuda")]
#[test]
fn operands_on_different_devices_are_errors_cuda() -> Result<()> {
    let (dev, cpu) = (cuda_device(), Device::Cpu);
    let q = randn(&[2, 4, 32], DType::F32, &dev)?;
    let d = randn(&[3, 5, 32], DType::F32, &cpu)?;
    expect_err(ms::maxsim(&q, &d, None, None), "d");
    let dm = Tensor::ones((3, 5), DType::U8, &cpu)?;
    expect_err(ms::maxsim(&q, &d.to_device(&dev)?, None, Some(&dm)), "d_mask");
    let qm = Tensor::ones((2, 4), DType::U8, &cpu)?;
    expect_err(ms::maxsim(&q, &d.to_device(&dev)?, Some(&qm), None), "q_mask");
    Ok(())
}
