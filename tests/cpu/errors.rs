//! Bad input is an `Err` that names the argument, never a panic.
use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{self as ms, BitOrder, ResidualCodec};

pub(crate) fn expect_err<T: std::fmt::Debug>(r: Result<T>, arg: &str) {
    match r {
        Ok(v) => panic!("expected an error naming `{arg}`, got Ok({v:?})"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(arg), "error does not name `{arg}`: {msg}");
        }
    }
}

#[test]
fn dense_errors() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[2, 3, 8], DType::F32, &dev)?;
    let d = randn(&[4, 5, 8], DType::F32, &dev)?;
    expect_err(ms::maxsim(&q, &randn(&[4, 5, 9], DType::F32, &dev)?, None, None), "dim");
    expect_err(ms::maxsim(&randn(&[3, 8], DType::F32, &dev)?, &d, None, None), "q");
    expect_err(ms::maxsim(&q, &randn(&[5, 8], DType::F32, &dev)?, None, None), "d");
    expect_err(ms::maxsim(&q, &d, Some(&rand_mask(&[2, 4], 0.2, &dev)?), None), "q_mask");
    expect_err(ms::maxsim(&q, &d, None, Some(&Tensor::ones((4, 5), DType::F32, &dev)?)), "d_mask");
    expect_err(ms::maxsim(&q, &d.to_dtype(DType::F16)?, None, None), "d");
    expect_err(ms::maxsim(&q.to_dtype(DType::U32)?, &d, None, None), "q");
    expect_err(ms::maxsim(&q, &randn(&[3, 2, 5, 8], DType::F32, &dev)?, None, None), "d");
    expect_err(ms::maxsim_pairs(&q, &d, None, None), "d");
    expect_err(ms::retrieve(&q, &d, None, None, 0, 4), "top_k");
    Ok(())
}

#[test]
fn varlen_errors() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[6, 8], DType::F32, &dev)?;
    let d = randn(&[9, 8], DType::F32, &dev)?;
    let cu_q = Tensor::new(&[0u32, 2, 6], &dev)?;
    let cu_d = Tensor::new(&[0u32, 4, 9], &dev)?;
    expect_err(ms::maxsim_varlen(&q, &Tensor::new(&[0u32, 4, 2, 6], &dev)?, 4, &d, &cu_d, 5), "cu_q");
    expect_err(ms::maxsim_varlen(&q, &Tensor::new(&[0u32, 2, 7], &dev)?, 5, &d, &cu_d, 5), "cu_q");
    expect_err(ms::maxsim_varlen(&q, &Tensor::new(&[1u32, 2, 6], &dev)?, 5, &d, &cu_d, 5), "cu_q");
    expect_err(ms::maxsim_varlen(&q, &cu_q, 4, &d, &Tensor::new(&[0i64, 4, 9], &dev)?, 5), "cu_d");
    expect_err(ms::maxsim_varlen(&q, &cu_q, 3, &d, &cu_d, 5), "max_lq");
    expect_err(ms::maxsim_varlen(&q, &cu_q, 4, &d, &cu_d, 4), "max_ld");
    let pq = Tensor::new(&[0u32, 2], &dev)?;
    let pd = Tensor::new(&[1u32, 1], &dev)?;
    expect_err(ms::score_pairs_packed(&q, &cu_q, 4, &d, &cu_d, 5, &pq, &pd), "pair_q");
    let pq = Tensor::new(&[0u32, 1], &dev)?;
    let pd = Tensor::new(&[1u32, 2], &dev)?;
    expect_err(ms::score_pairs_packed(&q, &cu_q, 4, &d, &cu_d, 5, &pq, &pd), "pair_d");
    Ok(())
}

#[test]
fn residual_errors() -> Result<()> {
    let dev = Device::Cpu;
    let dim = 16;
    let codec = |nbits: usize| -> Result<ResidualCodec> {
        Ok(ResidualCodec {
            centroids: randn(&[10, dim], DType::F32, &dev)?,
            bucket_weights: randn(&[1 << nbits.min(8)], DType::F32, &dev)?,
            nbits,
            bit_order: BitOrder::ColBert,
        })
    };
    let q = randn(&[2, 3, dim], DType::F32, &dev)?;
    let codes = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &dev)?;
    let res = Tensor::zeros((2, 3, 4), DType::U8, &dev)?;
    let lens = Tensor::new(&[3u32, 2], &dev)?;
    expect_err(ms::maxsim_residual(&q, &codes, &res, &lens, &codec(3)?, false), "nbits");
    expect_err(
        ms::maxsim_residual(&q, &codes, &Tensor::zeros((2, 3, 5), DType::U8, &dev)?, &lens, &codec(2)?, false),
        "residual",
    );
    let bad = Tensor::new(&[[1u32, 2, 10], [4, 5, 6]], &dev)?;
    expect_err(ms::maxsim_residual(&q, &bad, &res, &lens, &codec(2)?, false), "codes");
    expect_err(ms::maxsim_residual(&q, &codes, &res, &Tensor::new(&[4u32, 2], &dev)?, &codec(2)?, false), "doc_lens");
    expect_err(ms::plaid_approx_score(&randn(&[10, 3], DType::F32, &dev)?, &bad, &lens), "codes");
    let cu = Tensor::new(&[0u32, 3, 5], &dev)?;
    let flat = Tensor::new(&[1u32, 2, 3, 4, 11], &dev)?;
    let fres = Tensor::zeros((5, 4), DType::U8, &dev)?;
    expect_err(ms::maxsim_residual_varlen(&q, &flat, &fres, &cu, 3, &codec(2)?, false), "codes");
    expect_err(ms::pack_bucket_indices(&[1, 2, 3], 2, BitOrder::Lsb), "indices");
    Ok(())
}
