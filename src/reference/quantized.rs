//! Naive [`crate::quantized`]: exact dequantization in F64, then [`super::maxsim`].

use super::maxsim;
use candle_core::{DType, Result, Tensor, D};

/// 8-bit embeddings as F64, `scale · value` exactly (I8 bytes read as I8;
/// e4m3 bytes decoded from their sign, exponent and mantissa fields).
pub fn dequantize_exact(x: &crate::quantized::Quantized) -> Result<Tensor> {
    let bytes = x.values().flatten_all()?.to_vec1::<u8>()?;
    let v: Vec<f64> = match x.format() {
        crate::quantized::QuantFormat::I8 => bytes.into_iter().map(|b| b as i8 as f64).collect(),
        crate::quantized::QuantFormat::E4m3 => bytes.into_iter().map(e4m3_value).collect(),
    };
    let v = Tensor::from_vec(v, x.values().shape(), x.values().device())?;
    v.broadcast_mul(&x.scales().to_dtype(DType::F64)?.unsqueeze(D::Minus1)?)
}

/// An e4m3 byte's value: (−1)^s · 2^(e−7) · (1 + m/8), or m · 2^−9 for e = 0;
/// 0x7F / 0xFF are NaN.
fn e4m3_value(b: u8) -> f64 {
    let (s, e, m) = (if b & 0x80 != 0 { -1.0 } else { 1.0 }, ((b >> 3) & 0xF) as i32, (b & 7) as f64);
    if b & 0x7F == 0x7F {
        f64::NAN
    } else if e == 0 {
        s * m / 512.0
    } else {
        s * (8.0 + m) / 8.0 * 2f64.powi(e - 7)
    }
}

/// MaxSim of 8-bit embeddings: [`super::maxsim`] of [`dequantize_exact`]'s rows.
pub fn maxsim_quantized(
    q: &crate::quantized::Quantized,
    d: &crate::quantized::Quantized,
    q_mask: Option<&Tensor>,
    d_mask: Option<&Tensor>,
) -> Result<Tensor> {
    maxsim(&dequantize_exact(q)?, &dequantize_exact(d)?, q_mask, d_mask)
}
