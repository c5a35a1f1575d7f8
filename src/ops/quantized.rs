//! Symmetric 8-bit embeddings, one F32 scale per token, in two formats:
//! I8 (`quantize`) and FP8 e4m3 (`quantize_e4m3`); `dequantize`, and MaxSim
//! over 8-bit queries and documents (padded, packed, pairs of packed
//! sequences, streaming top-k). A similarity is `s_q · s_d · ⟨q8, d8⟩`: the
//! document token's scale is applied to each similarity before the max over
//! tokens, the query token's (positive, constant over that max) after it.
//!
//! I8: the dot products are exact I32 on CPUs with AVX512_VNNI
//! (cpu/avx512.rs; rounded to F32 before scaling, exact up to dim 1040) and
//! on CUDA sm_80+ for dims up to 128 (s8 tensor cores: mma.sync, and wgmma
//! on sm_90a; kernels/maxsim_fwd.cu), each scaled similarity rounded once
//! on both; elsewhere the dequantized rows are scored in F32 (the same
//! scores up to F32 rounding).
//!
//! e4m3: on CUDA, Hopper (sm_90) e4m3 wgmma with F32 accumulation, dims up
//! to 128; other GPUs have no kernel and get an `Err`. On the CPU the
//! dequantized rows are scored in F32.

use super::maxsim::MaxSimOp;
use crate::cpu::storage::{slice, tensor_slice};
use crate::layout::{check_device, check_mask, check_rank, Pairing, Problem, Seqs};
use crate::options::Backward;
use candle_core::{bail, DType, Layout, Result, Shape, Storage, Tensor, D};

/// The number format of a [`Quantized`] tensor's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// Two's-complement I8 (candle has no I8 dtype), symmetric: −127..=127.
    I8,
    /// FP8 e4m3 (OCP "E4M3FN": 4 exponent bits of bias 7, 3 mantissa bits,
    /// largest finite 448, no infinities; 0x7F / 0xFF are NaN). Stored as
    /// U8 bytes: candle 0.11's own F8E4M3 conversions are unusable here (its
    /// CUDA casts look up misnamed kernels, and its CPU widening loops
    /// forever on subnormals in optimized builds), so this crate encodes and
    /// decodes e4m3 itself.
    E4m3,
}

/// 8-bit embeddings, `scales[…] · values[…, :]`: half the memory of BF16
/// (plus 4 bytes per token). The values are U8 bytes in one
/// [`QuantFormat`]: I8 ([`quantize`]) or e4m3 ([`quantize_e4m3`]).
/// Validated once, when made ([`quantize`], [`quantize_e4m3`],
/// [`Quantized::new`], [`Quantized::new_e4m3`]), so that scoring never
/// reads the scales back to the host.
#[derive(Clone, Debug)]
pub struct Quantized {
    values: Tensor,
    scales: Tensor,
    format: QuantFormat,
    /// Every scale ≥ 0 (required of queries).
    nonneg: bool,
}

impl Quantized {
    /// I8 embeddings. `values`: `[…, dim]` U8, the two's-complement bytes of
    /// I8 values; `scales`: `[…]` F32, one per token, on the same device.
    /// Scales may have either sign for documents; a query's must be
    /// non-negative (its scale is taken out of the max over document
    /// tokens), which this notes with one reduction over `scales`. On CUDA a
    /// similarity is rounded once when each scale has at most 22 significant
    /// bits (as [`quantize`]'s); otherwise it may be off by up to
    /// `|s_q · s_d|` more.
    pub fn new(values: Tensor, scales: Tensor) -> Result<Self> {
        Self::with_format(values, scales, QuantFormat::I8)
    }
    /// e4m3 embeddings: `values` `[…, dim]` U8, e4m3 bytes; `scales` as
    /// [`Quantized::new`].
    pub fn new_e4m3(values: Tensor, scales: Tensor) -> Result<Self> {
        Self::with_format(values, scales, QuantFormat::E4m3)
    }
    fn with_format(values: Tensor, scales: Tensor, format: QuantFormat) -> Result<Self> {
        check(&values, &scales, "values", "scales")?;
        let nonneg = scales.elem_count() == 0 || scales.flatten_all()?.min(0)?.to_scalar::<f32>()? >= 0.0;
        Ok(Self { values, scales, format, nonneg })
    }
    /// `[…, dim]` U8, bytes in [`Quantized::format`].
    pub fn values(&self) -> &Tensor {
        &self.values
    }
    /// `[…]` F32, one per token.
    pub fn scales(&self) -> &Tensor {
        &self.scales
    }
    /// The number format of the values' bytes.
    pub fn format(&self) -> QuantFormat {
        self.format
    }
    /// Tokens (or sequences) `start..start + len` along token axis `axis`
    /// (not the embedding axis): a chunk of a collection, without a copy.
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<Self> {
        if axis + 1 >= self.values.rank() {
            bail!("axis: {axis} is not a token axis of values {:?}", self.values.dims())
        }
        let (values, scales) = (self.values.narrow(axis, start, len)?, self.scales.narrow(axis, start, len)?);
        Ok(Self { values, scales, ..*self })
    }
    /// A copy on `device`.
    pub fn to_device(&self, device: &candle_core::Device) -> Result<Self> {
        Ok(Self { values: self.values.to_device(device)?, scales: self.scales.to_device(device)?, ..*self })
    }
}

/// Symmetric per-token I8 quantization of `x` (a float tensor, last axis
/// the embedding): `scale = max|x| / 127` rounded to 22 significant bits
/// (a relative change under 2^-22, which lets the CUDA kernels round each
/// scaled similarity once, see [`Quantized::new`]), `value = round(x /
/// scale)` (a zero row gets scale 0 and zero values). Runs where `x` is.
pub fn quantize(x: &Tensor) -> Result<Quantized> {
    let (x, amax) = row_amax(x)?;
    let scales = round_to_22_bits(&(&amax / 127.0)?.to_dtype(DType::F32)?)?.to_dtype(DType::F64)?;
    // A zero row divides by 1 (its values stay 0).
    let divisor = amax.gt(0f64)?.where_cond(&scales, &amax.ones_like()?)?;
    let v = x.broadcast_div(&divisor)?.round()?.clamp(-127f64, 127f64)?;
    // Two's complement bytes: v + 256 for the negative values.
    let bytes = (&v + v.lt(0f64)?.to_dtype(DType::F64)?.affine(256.0, 0.0)?)?.to_dtype(DType::U8)?;
    let scales = scales.squeeze(D::Minus1)?.to_dtype(DType::F32)?;
    Ok(Quantized { values: bytes, scales, format: QuantFormat::I8, nonneg: true })
}

/// Symmetric per-token FP8 e4m3 quantization of `x` (a float tensor, last
/// axis the embedding): `scale = max|x| / 448` (e4m3's largest finite
/// value), `value = e4m3(x / scale)` rounded to nearest even, in one
/// rounding from F64 (a zero row gets scale 0 and zero values). The scales
/// are computed where `x` is; the rounding to e4m3 runs on the CPU and the
/// bytes are moved back to `x`'s device.
pub fn quantize_e4m3(x: &Tensor) -> Result<Quantized> {
    let (x, amax) = row_amax(x)?;
    let scales = (&amax / 448.0)?;
    let divisor = amax.gt(0f64)?.where_cond(&scales, &amax.ones_like()?)?;
    let v = x.broadcast_div(&divisor)?.flatten_all()?.to_vec1::<f64>()?;
    let bytes: Vec<u8> = v.into_iter().map(e4m3_encode).collect();
    let values = Tensor::from_vec(bytes, x.shape(), x.device())?;
    let scales = scales.squeeze(D::Minus1)?.to_dtype(DType::F32)?;
    Ok(Quantized { values, scales, format: QuantFormat::E4m3, nonneg: true })
}

/// The e4m3 byte nearest `x` (ties to even), saturating at ±448; NaN to 0x7F.
fn e4m3_encode(x: f64) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return 0x7F;
    }
    if a < 2f64.powi(-6) {
        // Subnormals (and zero): m · 2^-9, m = 8 being the smallest normal (byte 0x08).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let a = a.min(448.0);
    let e = a.log2().floor() as i32;
    // a / 2^(e-3) in [8, 16): the significand with 3 fraction bits; a rounding
    // up to 16 carries into the exponent. log2 may be off by one near a power
    // of two: the loop settles it.
    let (mut e, mut q) = (e, a / 2f64.powi(e - 3));
    while q >= 16.0 {
        e += 1;
        q /= 2.0;
    }
    while q < 8.0 {
        e -= 1;
        q *= 2.0;
    }
    let mut r = q.round_ties_even() as u32;
    if r == 16 {
        e += 1;
        r = 8;
    }
    // At the top binade, 448 = 1.75 · 2^8 (mantissa 6): 0x7F is NaN.
    sign | (((e + 7) as u8) << 3) | (r - 8) as u8
}

/// The value of an e4m3 byte (exact in F32).
fn e4m3_decode(b: u8) -> f32 {
    let (e, m) = (((b >> 3) & 0xF) as i32, (b & 7) as f32);
    let v = if b & 0x7F == 0x7F {
        f32::NAN
    } else if e == 0 {
        m * 2f32.powi(-9)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    if b & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// Whether [`maxsim_quantized`] and the other 8-bit entry points score
/// e4m3 rows of `dim` on `device`: everywhere on the CPU; on CUDA, Hopper
/// (compute capability 9.0) for dims up to 128 (elsewhere they return an
/// `Err`).
pub fn e4m3_supported(device: &candle_core::Device, dim: usize) -> Result<bool> {
    match device {
        candle_core::Device::Cpu => Ok(true),
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(cd) => Ok(crate::cuda::quantized_supported(cd, DType::F8E4M3, dim)?.0),
        _ => {
            let _ = dim;
            Ok(false)
        }
    }
}

/// `x` in F64 (127 / max|x| overflows F32 for rows below ~4e-37) and its
/// rows' max|x| `[…, 1]`.
fn row_amax(x: &Tensor) -> Result<(Tensor, Tensor)> {
    crate::layout::check_float("x", x)?;
    if x.rank() == 0 {
        bail!("x: expected at least one axis (the embedding), got a scalar")
    }
    let x = x.to_dtype(DType::F64)?;
    let amax = x.abs()?.max_keepdim(D::Minus1)?;
    Ok((x, amax))
}

/// F32 values rounded to nearest with at most 22 significant bits, by
/// Veltkamp's split (`c = 5x`, `hi = c − (c − x)`, each operation rounded
/// in F32, as candle's element-wise F32 kernels do; exact for |x| under
/// F32::MAX / 5).
fn round_to_22_bits(x: &Tensor) -> Result<Tensor> {
    let c = (x * 5.0)?;
    &c - (&c - x)?
}

/// `scales · values` as F32 (the inverse of [`quantize`] or
/// [`quantize_e4m3`] up to its rounding). Runs where the values are (e4m3
/// through a 256-entry table).
pub fn dequantize(q: &Quantized) -> Result<Tensor> {
    let v = match q.format {
        QuantFormat::E4m3 => {
            let table: Vec<f32> = (0..=255u8).map(e4m3_decode).collect();
            let table = Tensor::from_vec(table, 256, q.values.device())?;
            table.index_select(&q.values.flatten_all()?, 0)?.reshape(q.values.shape())?
        }
        QuantFormat::I8 => signed(&q.values)?,
    };
    v.broadcast_mul(&q.scales.unsqueeze(D::Minus1)?)
}

/// The I8 values of two's-complement bytes, as F32.
fn signed(values: &Tensor) -> Result<Tensor> {
    let v = values.to_dtype(DType::F32)?;
    &v - values.ge(128u8)?.to_dtype(DType::F32)?.affine(256.0, 0.0)?
}

fn check(values: &Tensor, scales: &Tensor, vn: &str, sn: &str) -> Result<()> {
    if values.dtype() != DType::U8 {
        bail!("{vn}: expected U8 (the bytes of I8 or e4m3 values), got {:?}", values.dtype())
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

/// A query's scales are taken out of the max over document tokens, which
/// needs them ≥ 0; both sides in one format.
fn check_pair(q: &Quantized, d: &Quantized) -> Result<()> {
    if !q.nonneg {
        bail!("q.scales: a query's scales must be non-negative (quantize gives max|x| / 127)")
    }
    if q.format != d.format {
        bail!("d.values: format {:?} does not match q's {:?} (quantize both sides alike)", d.format, q.format)
    }
    Ok(())
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
    check_pair(q, d)?;
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
    let valid = |m: Option<&Tensor>| m.map(|t| t.flatten_all()).transpose();
    let problem = Problem {
        dim,
        q: Seqs::Uniform { n: nq, len: lq },
        d: Seqs::Uniform { n: nd, len: ld },
        q_valid: valid(q_mask)?,
        d_valid: valid(d_mask)?,
        pairs: Pairing::Cross { nq, nd },
    };
    QuantizedScores { problem, q: q.clone(), d: d.clone() }.apply((nq, nd))
}

/// [`maxsim_quantized`] for packed sequences (the layout of an index's
/// documents): `q.values [Tq, dim]`, `q.scales [Tq]` with `cu_q [Nq+1]`
/// (U32 offsets, as [`crate::maxsim_varlen`]), likewise `d` → `[Nq, Nd]`.
pub fn maxsim_quantized_varlen(
    q: &Quantized,
    cu_q: &Tensor,
    max_lq: usize,
    d: &Quantized,
    cu_d: &Tensor,
    max_ld: usize,
) -> Result<Tensor> {
    let (qs, ds, dim) = packed(q, cu_q, max_lq, d, cu_d, max_ld)?;
    let (nq, nd) = (qs.n(), ds.n());
    let problem = Problem { dim, q: qs, d: ds, q_valid: None, d_valid: None, pairs: Pairing::Cross { nq, nd } };
    QuantizedScores { problem, q: q.clone(), d: d.clone() }.apply((nq, nd))
}

/// Scores of arbitrary (query, document) pairs of packed 8-bit sequences
/// (operands as [`maxsim_quantized_varlen`]): pair p is query `pair_q[p]`
/// against document `pair_d[p]` → `[P]`, as [`crate::score_pairs_packed`].
#[allow(clippy::too_many_arguments)]
pub fn score_pairs_quantized(
    q: &Quantized,
    cu_q: &Tensor,
    max_lq: usize,
    d: &Quantized,
    cu_d: &Tensor,
    max_ld: usize,
    pair_q: &Tensor,
    pair_d: &Tensor,
) -> Result<Tensor> {
    let (qs, ds, dim) = packed(q, cu_q, max_lq, d, cu_d, max_ld)?;
    let dev = q.values.device();
    check_device("pair_q", pair_q, dev)?;
    check_device("pair_d", pair_d, dev)?;
    let pairs = Pairing::list_checked(pair_q, pair_d, qs.n(), ds.n())?;
    let n = pairs.len();
    let problem = Problem { dim, q: qs, d: ds, q_valid: None, d_valid: None, pairs };
    QuantizedScores { problem, q: q.clone(), d: d.clone() }.apply(n)
}

/// Validates packed 8-bit operands and their offsets.
fn packed(
    q: &Quantized,
    cu_q: &Tensor,
    max_lq: usize,
    d: &Quantized,
    cu_d: &Tensor,
    max_ld: usize,
) -> Result<(Seqs, Seqs, usize)> {
    check_pair(q, d)?;
    check_rank("q.values", &q.values, &[2], "rank 2 [Tq, dim] (packed)")?;
    check_rank("d.values", &d.values, &[2], "rank 2 [Td, dim] (packed)")?;
    let ((tq, dim), (td, dd)) = (q.values.dims2()?, d.values.dims2()?);
    if dd != dim {
        bail!("d.values: embedding dim {dd} does not match q's dim {dim}")
    }
    let dev = q.values.device();
    check_device("d.values", &d.values, dev)?;
    check_device("cu_q", cu_q, dev)?;
    check_device("cu_d", cu_d, dev)?;
    let qs = Seqs::packed("cu_q", cu_q, tq, "max_lq", max_lq)?;
    let ds = Seqs::packed("cu_d", cu_d, td, "max_ld", max_ld)?;
    Ok((qs, ds, dim))
}

/// The best `top_k` documents of each query by [`maxsim_quantized`], the
/// documents scored `chunk` at a time: `([Nq, k] F32, [Nq, k] U32)` with
/// `k = min(top_k, Nd)`, as [`crate::retrieve`].
pub fn retrieve_quantized(
    q: &Quantized,
    d: &Quantized,
    q_mask: Option<&Tensor>,
    d_mask: Option<&Tensor>,
    top_k: usize,
    chunk: usize,
) -> Result<(Tensor, Tensor)> {
    super::retrieve::check_chunking(top_k, chunk)?;
    check_rank("d.values", &d.values, &[3], "rank 3 [Nd, Ld, dim]")?;
    let (nd, ld, _) = d.values.dims3()?;
    if let Some(m) = d_mask {
        check_mask("d_mask", m, &[nd, ld], d.values.device())?;
    }
    if nd == 0 {
        // Validates the rest.
        maxsim_quantized(q, d, q_mask, d_mask)?;
    }
    super::retrieve::chunked_top_k(q.values.dim(0)?, nd, top_k, chunk, q.values.device(), |start, len| {
        let part = d.narrow(0, start, len)?;
        let dm = d_mask.map(|m| m.narrow(0, start, len)).transpose()?;
        maxsim_quantized(q, &part, q_mask, dm.as_ref())
    })
}

/// 8-bit scores `[n_out]` of `problem` (its masks as `q_valid` / `d_valid`)
/// over the values of `q` and `d` as packed rows: the VNNI lane kernel on
/// the CPU (I8), the I8 / e4m3 tensor-core kernels on CUDA, and where none
/// covers the format, dim and device (I8 on a CPU without AVX512_VNNI or a
/// dim not a multiple of 4, e4m3 on the CPU; I8 on a GPU below sm_80 or a
/// dim over 128) the dequantized rows scored by the dense op. e4m3 on a GPU
/// without its kernels is an `Err`. Inference only.
struct QuantizedScores {
    problem: Problem,
    q: Quantized,
    d: Quantized,
}

impl QuantizedScores {
    fn apply(self, shape: impl Into<Shape>) -> Result<Tensor> {
        let (qv, dv) = (self.q.values.contiguous()?, self.d.values.contiguous()?);
        qv.apply_op2_no_bwd(&dv, &self)?.reshape(shape)
    }

    /// The dequantized rows scored by the dense op, as a storage of the operands' device.
    fn dequantized(&self) -> Result<Storage> {
        let op = MaxSimOp::new(self.problem.clone(), Backward::Unified);
        super::owned_storage(&op.apply(&dequantize(&self.q)?, &dequantize(&self.d)?)?)
    }
}

impl candle_core::CustomOp2 for QuantizedScores {
    fn name(&self) -> &'static str {
        "maxsim_quantized"
    }

    fn cpu_fwd(
        &self,
        qs: &candle_core::CpuStorage,
        ql: &Layout,
        ds: &candle_core::CpuStorage,
        dl: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        let shape = Shape::from(self.problem.n_out());
        if self.q.format == QuantFormat::I8 {
            let flags = |m: &Option<Tensor>| m.as_ref().map(|t| t.to_vec1::<u8>()).transpose();
            let (qf, df) = (flags(&self.problem.q_valid)?, flags(&self.problem.d_valid)?);
            let hp = crate::cpu::HostProblem::new(&self.problem, qf.as_deref(), df.as_deref());
            // The operands in place (a collection of documents is large: no copy).
            let (qsc, dsc) = (self.q.scales.contiguous()?, self.d.scales.contiguous()?);
            let (qss, dss) = (qsc.storage_and_layout(), dsc.storage_and_layout());
            let scores = crate::cpu::forward_i8(
                &hp,
                (as_i8(slice("q.values", qs, ql)?), tensor_slice("q.scales", &qss.0, qss.1)?),
                (as_i8(slice("d.values", ds, dl)?), tensor_slice("d.scales", &dss.0, dss.1)?),
            );
            if let Some(v) = scores {
                return Ok((candle_core::CpuStorage::F32(v), shape));
            }
        }
        match self.dequantized()? {
            Storage::Cpu(s) => Ok((s, shape)),
            _ => bail!("maxsim_quantized: internal error, scores are not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        ds: &candle_core::CudaStorage,
        dl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let shape = Shape::from(self.problem.n_out());
        let e4m3 = self.q.format == QuantFormat::E4m3;
        let (qsc, dsc) = (self.q.scales.contiguous()?, self.d.scales.contiguous()?);
        let scores = crate::cuda::maxsim_quantized(&self.problem, e4m3, ((qs, ql), &qsc), ((ds, dl), &dsc))?;
        match scores {
            Some(out) => Ok((out, shape)),
            None => match self.dequantized()? {
                Storage::Cuda(s) => Ok((s, shape)),
                _ => bail!("maxsim_quantized: internal error, scores are not on the GPU"),
            },
        }
    }
}
