use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{self as ms, reference as r, BitOrder, ResidualCodec};

#[test]
fn hand_computed_colbert_order() -> Result<()> {
    assert_eq!(ms::pack_bucket_indices(&[1, 2, 3, 0], 2, BitOrder::ColBert)?, vec![156]);
    assert_eq!(ms::pack_bucket_indices(&[1, 8], 4, BitOrder::ColBert)?, vec![0x81]);
    assert_eq!(ms::pack_bucket_indices(&[1, 2, 3, 0], 2, BitOrder::Lsb)?, vec![0b00_11_10_01]);
    assert_eq!(ms::pack_bucket_indices(&[1, 8], 4, BitOrder::Lsb)?, vec![0x81]);
    assert_eq!(ms::pack_bucket_indices(&[0xA5], 8, BitOrder::ColBert)?, vec![0xA5]);
    assert_eq!(ms::unpack_bucket_indices(&[156], 2, BitOrder::ColBert)?, vec![1, 2, 3, 0]);
    Ok(())
}

#[test]
fn pack_unpack_round_trip() -> Result<()> {
    for nbits in [2usize, 4, 8] {
        for order in [BitOrder::Lsb, BitOrder::ColBert] {
            let idx: Vec<u8> = (0..96u32).map(|k| ((k * 7 + 3) % (1 << nbits)) as u8).collect();
            let packed = ms::pack_bucket_indices(&idx, nbits, order)?;
            assert_eq!(packed.len(), 96 * nbits / 8);
            assert_eq!(ms::unpack_bucket_indices(&packed, nbits, order)?, idx, "nbits {nbits} {order:?}");
        }
    }
    Ok(())
}

fn codec(nbits: usize, order: BitOrder, dim: usize, n_c: usize) -> Result<ResidualCodec> {
    let dev = Device::Cpu;
    let bw: Vec<f32> = (0..1 << nbits).map(|k| (k as f32 - (1 << nbits) as f32 / 2.0) * 0.05).collect();
    Ok(ResidualCodec {
        centroids: randn(&[n_c, dim], DType::F16, &dev)?,
        bucket_weights: Tensor::new(bw, &dev)?,
        nbits,
        bit_order: order,
    })
}

#[test]
fn residual_scoring_matches_reference() -> Result<()> {
    let dev = Device::Cpu;
    let dim = 32;
    for nbits in [2usize, 4, 8] {
        for order in [BitOrder::Lsb, BitOrder::ColBert] {
            for dt in [DType::F32, DType::BF16] {
                let c = codec(nbits, order, dim, 50)?;
                let (nd, ld) = (6, 11);
                let codes = Tensor::rand(0f32, 50., (nd, ld), &dev)?.to_dtype(DType::U32)?;
                let res = Tensor::rand(0f32, 256., (nd, ld, dim * nbits / 8), &dev)?.to_dtype(DType::U8)?;
                let lens = Tensor::new(&[11u32, 0, 5, 1, 11, 7], &dev)?;
                let q = randn(&[3, 8, dim], dt, &dev)?;
                for normalize in [false, true] {
                    let out = ms::maxsim_residual(&q, &codes, &res, &lens, &c, normalize)?;
                    let want = r::maxsim_residual(&q, &codes, &res, &lens, &c, normalize)?;
                    assert_close(&format!("residual nb{nbits} {order:?} {dt:?}"), &out, &want, tol(dt).max(1e-5))?;
                    assert_eq!(out.to_vec2::<f32>()?[0][1], 0.0, "empty doc scores 0");
                }
                // Packed (varlen) form, I64 codes as fast-plaid writes them.
                let (cu, longest) = rand_offsets(7, 12, nbits as u64);
                let t = *cu.last().unwrap() as usize;
                let codes = Tensor::rand(0f32, 50., t, &dev)?.to_dtype(DType::U32)?.to_dtype(DType::I64)?;
                let res = Tensor::rand(0f32, 256., (t, dim * nbits / 8), &dev)?.to_dtype(DType::U8)?;
                let cu = Tensor::new(cu, &dev)?;
                let out = ms::maxsim_residual_varlen(&q, &codes, &res, &cu, longest, &c, true)?;
                let want = r::maxsim_residual_varlen(&q, &codes, &res, &cu, longest, &c, true)?;
                assert_close("residual varlen", &out, &want, tol(dt).max(1e-5))?;
            }
        }
    }
    Ok(())
}

#[test]
fn plaid_approx_matches_reference() -> Result<()> {
    let dev = Device::Cpu;
    let qcs = randn(&[40, 8], DType::F32, &dev)?;
    let codes = Tensor::rand(0f32, 40., (9, 16), &dev)?.to_dtype(DType::U32)?;
    let lens = Tensor::new(&[16u32, 3, 0, 1, 16, 9, 12, 2, 5], &dev)?;
    let out = ms::plaid_approx_score(&qcs, &codes, &lens)?;
    assert_close("plaid approx", &out, &r::plaid_approx_score(&qcs, &codes, &lens)?, 1e-6)?;
    assert_eq!(out.to_vec1::<f32>()?[2], 0.0);
    let out64 = ms::plaid_approx_score(&qcs, &codes.to_dtype(DType::I64)?, &lens)?;
    assert_close("plaid approx i64", &out64, &out, 0.0 + 1e-12)?;
    Ok(())
}

#[test]
fn padding_codes_and_views() -> Result<()> {
    let dev = Device::Cpu;
    let c = codec(2, BitOrder::ColBert, 16, 10)?;
    // fast-plaid pads codes with -1: padding codes are never read.
    let codes = Tensor::new(&[[3i64, 4, -1], [5, -1, -1]], &dev)?;
    let res = Tensor::rand(0f32, 256., (2, 3, 4), &dev)?.to_dtype(DType::U8)?;
    let lens = Tensor::new(&[2u32, 1], &dev)?;
    let q = randn(&[2, 4, 16], DType::F32, &dev)?;
    let out = ms::maxsim_residual(&q, &codes, &res, &lens, &c, false)?;
    let want = r::maxsim_residual(&q, &codes.clamp(0i64, 9i64)?, &res, &lens, &c, false)?;
    assert_close("padding codes", &out, &want, 1e-5)?;
    // A narrowed (offset) doc_lens view.
    let qcs = randn(&[10, 3], DType::F32, &dev)?;
    let codes = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &dev)?;
    let lens = Tensor::new(&[9u32, 3, 1], &dev)?.narrow(0, 1, 2)?;
    let out = ms::plaid_approx_score(&qcs, &codes, &lens)?;
    assert_close("narrowed doc_lens", &out, &r::plaid_approx_score(&qcs, &codes, &lens)?, 1e-6)?;
    Ok(())
}
