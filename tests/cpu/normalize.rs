//! `l2_normalize` on the CPU: forward and closed-form backward against plain candle ops.

use crate::common::normalize;
use candle_core::{DType, Device, Result};

#[test]
fn l2_normalize_matches_candle_ops() -> Result<()> {
    let cpu = Device::Cpu;
    for (dt, tol) in [(DType::F32, 1e-6), (DType::F64, 1e-12), (DType::F16, 2e-3), (DType::BF16, 1e-2)] {
        for dim in [2, 16, 33, 128] {
            normalize::check(&cpu, 37, dim, dt, tol)?;
        }
    }
    normalize::zero_rows(&cpu)
}
