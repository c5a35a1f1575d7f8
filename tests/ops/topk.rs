//! Top-k of each row (src/ops/topk.rs) against `reference`: exact values
//! and indices, ties, NaN and -inf, k past the row length.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{self as ms, reference as r};

/// Random rows with many exact ties (values on a coarse grid, exact in every
/// dtype), NaN and -inf entries, rows shorter and longer than k, a single
/// column, in F32, F16 and BF16; on CUDA also rows read in chunks (up to
/// 100 000, a short last chunk, k = 4096).
fn topk_rows_match_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let mut cases = vec![(5usize, 37usize, 10usize), (3, 8, 20), (2, 1, 1), (4, 1000, 257), (1, 300, 300), (7, 40, 32)];
    if gpu_cases(dev) {
        cases.extend([
            (3, 100_000, 1024),
            (2, 65_536, 8),
            (1, 9000, 4096),
            (130, 2000, 64),
            (2, 66_000, 4096),
            (4, 20_000, 3),
        ]);
    }
    for (rows, n, k) in cases {
        let x = (Tensor::randn(0f32, 1., (rows, n), &cpu)? * 4.0)?.round()?;
        // NaN and -inf at scattered places.
        let special: Vec<f32> = (0..rows * n)
            .map(|i| match i % 17 {
                3 => f32::NAN,
                5 => f32::NEG_INFINITY,
                _ => 1.0,
            })
            .collect();
        let special = Tensor::from_vec(special, (rows, n), &cpu)?;
        let x = (x * &special)?;
        let (wv, wi) = r::nn::topk_rows(&x, k)?;
        let (wv, wi): (Vec<Vec<f32>>, Vec<Vec<u32>>) = (wv.to_vec2()?, wi.to_vec2()?);
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let (ov, oi) = ms::nn::topk_rows(&x.to_dtype(dt)?.to_device(dev)?, k)?;
            let what = format!("topk {rows}x{n} k{k} {dt:?}");
            assert_eq!(oi.to_vec2::<u32>()?, wi, "{what}: indices");
            let ov: Vec<Vec<f32>> = ov.to_vec2()?;
            for (o, w) in ov.iter().flatten().zip(wv.iter().flatten()) {
                assert!(o.to_bits() == w.to_bits() || (o.is_nan() && w.is_nan()), "{what}: value {o} vs {w}");
            }
        }
    }
    let (v, i) = ms::nn::topk_rows(&Tensor::zeros((0, 5), DType::F32, dev)?, 3)?;
    assert_eq!((v.dims(), i.dims()), (&[0, 3][..], &[0, 3][..]));
    Ok(())
}

test_device!(topk_rows_match_reference, topk_rows_match_reference_cpu, topk_rows_match_reference_cuda);
