//! Symmetric 8-bit embeddings: `quantize` (one F32 scale per token),
//! `dequantize`, and MaxSim over 8-bit queries and documents. A similarity
//! is `s_q · s_d · ⟨q8, d8⟩`: the document token's scale is applied to each
//! similarity before the max over tokens, the query token's (positive,
//! constant over that max) after it. On CPUs with AVX512_VNNI the dot
//! products are exact I32 (cpu/avx512.rs); elsewhere, on CUDA included,
//! the dequantized rows are scored in F32 (the same scores up to F32
//! rounding; no 8-bit tensor-core kernel yet).

use crate::layout::{check_device, check_mask, check_rank, Pairing, Problem, Seqs};
use candle_core::{bail, DType, Device, Layout, Result, Storage, Tensor, D};

/// 8-bit embeddings, `scales[…] · values[…, :]`: half the memory of BF16
/// (plus 4 bytes per token).
#[derive(Clone, Debug)]
pub struct Quantized {
    /// `[…, dim]` U8: the two's-complement bytes of I8 values in −127..=127
    /// (candle has no I8 dtype).
    pub values: Tensor,
    /// `[…]` F32, one per token.
    pub scales: Tensor,
}

/// Symmetric per-token quantization of `x` (a float tensor, last axis the
/// embedding): `scale = max|x| / 127`, `value = round(x / scale)` (a zero
/// row gets scale 0 and zero values). Runs where `x` is.
pub fn quantize(x: &Tensor) -> Result<Quantized> {
    crate::layout::check_float("x", x)?;
    if x.rank() == 0 {
        bail!("x: expected at least one axis (the embedding), got a scalar")
    }
    let x = x.to_dtype(DType::F32)?;
    let amax = x.abs()?.max_keepdim(D::Minus1)?;
    let scales = (&amax / 127.0)?;
    // 1/scale where the row is not zero (0 keeps a zero row at 0).
    let nonzero = amax.gt(0f64)?;
    let inv = nonzero.where_cond(&(127.0 / amax.maximum(f32::MIN_POSITIVE as f64)?)?, &amax.zeros_like()?)?;
    let v = x.broadcast_mul(&inv)?.round()?.clamp(-127f32, 127f32)?;
    // Two's complement bytes: v + 256 for the negative values.
    let bytes = (&v + v.lt(0f64)?.to_dtype(DType::F32)?.affine(256.0, 0.0)?)?.to_dtype(DType::U8)?;
    Ok(Quantized { values: bytes, scales: scales.squeeze(D::Minus1)? })
}

/// `scales · values` as F32 (the inverse of [`quantize`] up to its rounding).
pub fn dequantize(q: &Quantized) -> Result<Tensor> {
    check(&q.values, &q.scales, "values", "scales")?;
    signed(&q.values)?.broadcast_mul(&q.scales.unsqueeze(D::Minus1)?)
}

/// The I8 values of two's-complement bytes, as F32.
fn signed(values: &Tensor) -> Result<Tensor> {
    let v = values.to_dtype(DType::F32)?;
    &v - values.ge(128u8)?.to_dtype(DType::F32)?.affine(256.0, 0.0)?
}

fn check(values: &Tensor, scales: &Tensor, vn: &str, sn: &str) -> Result<()> {
    if values.dtype() != DType::U8 {
        bail!("{vn}: expected U8 (two's-complement I8 bytes), got {:?}", values.dtype())
    }
    if scales.dtype() != DType::F32 || values.rank() == 0 || scales.dims() != &values.dims()[..values.rank() - 1] {
        bail!(
            "{sn}: expected F32 {:?} (one scale per token of {vn}), got {:?} {:?}",
            &values.dims()[..values.rank().saturating_sub(1)],
            scales.dtype(),
            scales.dims()
        )
    }
    check_device(sn, scales, values.device())
}

/// The contiguous elements of a CPU tensor's storage, in place.
fn cpu_slice<'a, T: candle_core::WithDType>(s: &'a Storage, l: &Layout, arg: &str) -> Result<&'a [T]> {
    match (s, l.contiguous_offsets()) {
        (Storage::Cpu(c), Some((a, b))) => Ok(&c.as_slice::<T>()?[a..b]),
        _ => bail!("{arg}: internal error, expected a contiguous CPU tensor"),
    }
}

/// Two's-complement bytes as I8.
fn as_i8(v: &[u8]) -> &[i8] {
    // SAFETY: u8 and i8 have the same size and alignment, and every bit pattern is valid for both.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const i8, v.len()) }
}

/// MaxSim scores `[Nq, Nd]` F32 of 8-bit queries `q` (`[Nq, Lq, dim]`
/// values, `[Nq, Lq]` scales) against 8-bit documents `d` (`[Nd, Ld, dim]`,
/// `[Nd, Ld]`): `Σ_i s_q[i] · max_t s_d[t] · ⟨q8_i, d8_t⟩` over the tokens
/// the U8 masks keep (an empty document scores 0). Inference only.
pub fn maxsim_quantized(
    q: &Quantized,
    d: &Quantized,
    q_mask: Option<&Tensor>,
    d_mask: Option<&Tensor>,
) -> Result<Tensor> {
    check(&q.values, &q.scales, "q.values", "q.scales")?;
    check(&d.values, &d.scales, "d.values", "d.scales")?;
    check_rank("q.values", &q.values, &[3], "rank 3 [Nq, Lq, dim]")?;
    check_rank("d.values", &d.values, &[3], "rank 3 [Nd, Ld, dim]")?;
    let ((nq, lq, dim), (nd, ld, dd)) = (q.values.dims3()?, d.values.dims3()?);
    if dd != dim {
        bail!("d.values: embedding dim {dd} does not match q's dim {dim}")
    }
    let dev = q.values.device();
    check_device("d.values", &d.values, dev)?;
    if let Some(m) = q_mask {
        check_mask("q_mask", m, &[nq, lq], dev)?;
    }
    if let Some(m) = d_mask {
        check_mask("d_mask", m, &[nd, ld], dev)?;
    }
    if let Device::Cpu = dev {
        let flags = |m: Option<&Tensor>| m.map(|t| t.flatten_all()?.to_vec1::<u8>()).transpose();
        let (qv, dv) = (flags(q_mask)?, flags(d_mask)?);
        let problem = Problem {
            dim,
            q: Seqs::Uniform { n: nq, len: lq },
            d: Seqs::Uniform { n: nd, len: ld },
            q_valid: None,
            d_valid: None,
            pairs: Pairing::Cross { nq, nd },
        };
        let hp = crate::cpu::HostProblem::new(&problem, qv.as_deref(), dv.as_deref());
        // The operands in place (a collection of documents is large: no copy).
        let (qt, dt) = (q.values.contiguous()?, d.values.contiguous()?);
        let (qst, dst) = (q.scales.contiguous()?, d.scales.contiguous()?);
        let (qs, ds) = (qt.storage_and_layout(), dt.storage_and_layout());
        let (qss, dss) = (qst.storage_and_layout(), dst.storage_and_layout());
        let scores = crate::cpu::forward_i8(
            &hp,
            (as_i8(cpu_slice(&qs.0, qs.1, "q.values")?), cpu_slice(&qss.0, qss.1, "q.scales")?),
            (as_i8(cpu_slice(&ds.0, ds.1, "d.values")?), cpu_slice(&dss.0, dss.1, "d.scales")?),
        );
        if let Some(scores) = scores {
            return Tensor::from_vec(scores, (nq, nd), dev);
        }
    }
    crate::maxsim(&dequantize(q)?, &dequantize(d)?, q_mask, d_mask)
}
