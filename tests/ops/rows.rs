//! Row scatter-add (src/ops/rows.rs) against `reference`.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{self as ms, reference as r};

/// Random rows and destinations (many rows per destination, some
/// destinations empty), every dtype; an out-of-range index is an error.
fn scatter_add_rows_match_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for (rows, cols, n_out) in [(50, 7, 9), (1000, 128, 37), (3, 1, 1)] {
        for dt in DTYPES {
            let src = randn(&[rows, cols], dt, &cpu)?;
            let idx = (Tensor::rand(0f32, 1., rows, &cpu)? * (n_out as f64 - 0.01))?.floor()?.to_dtype(DType::U32)?;
            let want = r::scatter_add_rows(&src, &idx, n_out)?;
            let out = ms::scatter_add_rows(&src.to_device(dev)?, &idx.to_device(dev)?, n_out)?;
            assert_close(&format!("scatter {rows}x{cols}->{n_out} {dt:?}"), &out, &want, 1e-5)?;
        }
    }
    let src = randn(&[4, 3], DType::F32, dev)?;
    expect_err(ms::scatter_add_rows(&src, &Tensor::new(&[0u32, 1, 9, 2], dev)?, 5), "idx");
    Ok(())
}

test_device!(
    scatter_add_rows_match_reference,
    scatter_add_rows_match_reference_cpu,
    scatter_add_rows_match_reference_cuda
);
