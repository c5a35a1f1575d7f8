//! The residual codec: a token is `centroids[code] + bucket_weights[bucket(k)]`
//! per feature k. Its checks, decompression (an op; on CUDA one kernel where
//! one covers the dtype / dim / nbits) and compression (an op).

use super::bits::{bucket_index, check_nbits, pack_bucket_indices};
use crate::cpu::math::{simd, sum_sq_f64};
use crate::cpu::storage::{f32s, store};
use crate::layout::{check_device, check_float, check_rank};
use candle_core::{backend::BackendStorage, bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Bit layout of packed residual bucket indices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BitOrder {
    /// Feature k is byte k/(8/nbits), bits (k % (8/nbits))·nbits upward from the LSB.
    Lsb,
    /// ColBERTv2 / fast-plaid: `np.packbits` of the LSB-first bits of each
    /// index, feature 0 in the top bits of byte 0, each field bit-reversed.
    ColBert,
}

/// A residual codec: token = `centroids[code] + bucket_weights[bucket(k)]` per feature k.
#[derive(Clone, Debug)]
pub struct ResidualCodec {
    /// `[C, dim]` centroids (any float dtype).
    pub centroids: Tensor,
    /// `[2^nbits]` bucket values (any float dtype).
    pub bucket_weights: Tensor,
    /// 2, 4 or 8 bits per feature.
    pub nbits: usize,
    /// How each feature's bucket index is packed into the residual bytes.
    pub bit_order: BitOrder,
}

/// The codes of a CPU storage (U32 or I64), one per token.
enum HostCodes<'a> {
    U32(&'a [u32]),
    I64(&'a [i64]),
}

impl HostCodes<'_> {
    fn of<'a>(s: &'a CpuStorage, l: &Layout) -> Result<HostCodes<'a>> {
        let Some((a, b)) = l.contiguous_offsets() else { bail!("codes: internal error, not contiguous") };
        match s {
            CpuStorage::U32(v) => Ok(HostCodes::U32(&v[a..b])),
            CpuStorage::I64(v) => Ok(HostCodes::I64(&v[a..b])),
            s => bail!("codes: expected U32 or I64 centroid codes, got {:?}", s.dtype()),
        }
    }
    fn get(&self, t: usize) -> i64 {
        match self {
            HostCodes::U32(v) => v[t] as i64,
            HostCodes::I64(v) => v[t],
        }
    }
    fn len(&self) -> usize {
        match self {
            HostCodes::U32(v) => v.len(),
            HostCodes::I64(v) => v.len(),
        }
    }
}

impl ResidualCodec {
    /// Validates the codec against the embedding dim: nbits, dtypes and
    /// shapes of the centroids and bucket weights, a whole number of bytes per row.
    pub fn check(&self, dim: usize) -> Result<()> {
        check_nbits(self.nbits)?;
        check_float("centroids", &self.centroids)?;
        check_float("bucket_weights", &self.bucket_weights)?;
        check_rank("centroids", &self.centroids, &[2], "rank 2 [C, dim]")?;
        if self.centroids.dim(1)? != dim {
            bail!("centroids: dim {} does not match q's dim {dim}", self.centroids.dim(1)?)
        }
        if self.bucket_weights.dims() != [1 << self.nbits] {
            bail!(
                "bucket_weights: expected shape [{}] (2^nbits), got {:?}",
                1 << self.nbits,
                self.bucket_weights.dims()
            )
        }
        if !(dim * self.nbits).is_multiple_of(8) {
            bail!("nbits: dim {dim} · nbits {} is not a whole number of bytes", self.nbits)
        }
        Ok(())
    }

    /// Decompresses packed tokens, `codes [T]` (U32 or I64) and `residuals
    /// [T, dim·nbits/8]` U8, to `[T, dim]` F32 on the codes' device: centroid
    /// row plus one bucket weight per feature, not normalized (fast-plaid and
    /// ColBERTv2 L2-normalize the result, see [`crate::l2_normalize`]).
    pub fn decompress(&self, codes: &Tensor, residuals: &Tensor) -> Result<Tensor> {
        self.decompress_dense(codes, residuals, DType::F32, false)
    }

    /// Decompressed tokens `[T, dim]` in `dtype`, L2-normalized if asked: the
    /// dense documents for [`crate::maxsim_varlen`] and friends. On CUDA, for
    /// F16/BF16 and dims that are a multiple of 8 (at most 128), one
    /// decompression kernel on the device; elsewhere on the host.
    pub fn decompress_dense(
        &self,
        codes: &Tensor,
        residuals: &Tensor,
        dtype: DType,
        normalize: bool,
    ) -> Result<Tensor> {
        check_rank("centroids", &self.centroids, &[2], "rank 2 [C, dim]")?;
        let dim = self.centroids.dim(1)?;
        self.check(dim)?;
        check_rank("codes", codes, &[1], "rank 1 [T] (packed)")?;
        check_codes_dtype(codes)?;
        check_device("residuals", residuals, codes.device())?;
        check_residuals("residuals", residuals, codes.dim(0)?, self.residual_width(dim))?;
        if !dtype.is_float() {
            bail!("dtype: expected a float dtype for the decompressed tokens, got {dtype:?}")
        }
        let op = Decompress { codec: self.clone(), valid: None, dtype, normalize };
        op.apply(codes, residuals)
    }

    /// Compresses tokens `x [T, dim]` (F16/BF16/F32) given their centroid
    /// `codes [T]` (U32 or I64) and the `bucket_cutoffs [2^nbits − 1]`
    /// (ascending): the packed residual bytes `[T, dim·nbits/8]` U8 that
    /// [`Self::decompress`] reads back. A feature's bucket is the number of
    /// cutoffs below its residual `x − centroids[code]` (computed in F32), as
    /// ColBERTv2 and fast-plaid bucketize (`torch.bucketize`, right = False).
    pub fn compress(&self, x: &Tensor, codes: &Tensor, bucket_cutoffs: &Tensor) -> Result<Tensor> {
        check_rank("centroids", &self.centroids, &[2], "rank 2 [C, dim]")?;
        let dim = self.centroids.dim(1)?;
        self.check(dim)?;
        check_rank("x", x, &[2], "rank 2 [T, dim]")?;
        if !matches!(x.dtype(), DType::F16 | DType::BF16 | DType::F32) || x.dim(1)? != dim {
            bail!("x: expected F16, BF16 or F32 [T, {dim}] tokens, got {:?} {:?}", x.dtype(), x.dims())
        }
        check_rank("codes", codes, &[1], "rank 1 [T]")?;
        check_codes_dtype(codes)?;
        if codes.dim(0)? != x.dim(0)? {
            bail!("codes: {} codes for {} tokens", codes.dim(0)?, x.dim(0)?)
        }
        let n_cut = (1usize << self.nbits) - 1;
        if bucket_cutoffs.dims() != [n_cut] || !bucket_cutoffs.dtype().is_float() {
            bail!(
                "bucket_cutoffs: expected float [{n_cut}] (2^nbits − 1), got {:?} {:?}",
                bucket_cutoffs.dtype(),
                bucket_cutoffs.dims()
            )
        }
        for (arg, t) in [("codes", codes), ("bucket_cutoffs", bucket_cutoffs), ("centroids", &self.centroids)] {
            check_device(arg, t, x.device())?;
        }
        let op = Compress { codec: self.clone(), cutoffs: bucket_cutoffs.to_dtype(DType::F32)?.contiguous()? };
        x.contiguous()?.apply_op2_no_bwd(&codes.contiguous()?, &op)
    }

    /// Packed residual bytes per token.
    pub fn residual_width(&self, dim: usize) -> usize {
        dim * self.nbits / 8
    }

    /// Host decompression of `codes [T]` / `residuals [T, dim·nbits/8]`
    /// storages to `[T, dim]` F32, normalized if asked; tokens whose `valid`
    /// byte is 0 (padding slots, whose codes may hold anything) are zero rows.
    /// An out-of-range code of a valid token is an `Err` naming it.
    pub(super) fn dense_host(
        &self,
        codes: (&CpuStorage, &Layout),
        residuals: (&CpuStorage, &Layout),
        valid: Option<&[u8]>,
        normalize: bool,
    ) -> Result<Vec<f32>> {
        let codes = HostCodes::of(codes.0, codes.1)?;
        let (CpuStorage::U8(res), Some((ra, rb))) = (residuals.0, residuals.1.contiguous_offsets()) else {
            bail!("residuals: expected contiguous U8 packed residuals")
        };
        let res = &res[ra..rb];
        let dim = self.centroids.dim(1)?;
        let cents: Vec<f32> = self.centroids.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let bw: Vec<f32> = self.bucket_weights.to_dtype(DType::F32)?.to_vec1()?;
        let n_c = self.centroids.dim(0)?;
        let w = self.residual_width(dim);
        // The bucket weights of the 8 / nbits features of every byte value.
        let per = 8 / self.nbits;
        let byte_weights: Vec<f32> = (0..=255u8)
            .flat_map(|b| (0..per).map(move |k| (b, k)))
            .map(|(b, k)| bw[bucket_index(&[b], k, self.nbits, self.bit_order) as usize])
            .collect();
        let mut out = vec![0f32; codes.len() * dim];
        // Tokens in parallel, each decompressed alone.
        out.par_chunks_mut(dim.max(1)).enumerate().take(codes.len()).with_min_len(64).try_for_each(|(t, o)| {
            if valid.is_some_and(|v| v[t] == 0) {
                return Ok(());
            }
            let c = codes.get(t);
            if c < 0 || c as usize >= n_c {
                bail!("codes: codes[{t}] = {c} is out of range for {n_c} centroids")
            }
            let row = &res[t * w..(t + 1) * w];
            let cent = &cents[c as usize * dim..][..dim];
            simd(
                #[inline(always)]
                || {
                    for ((o, c), &b) in o.chunks_mut(per).zip(cent.chunks(per)).zip(row) {
                        let wb = &byte_weights[b as usize * per..][..per];
                        o.iter_mut().zip(c).zip(wb).for_each(|((o, &c), &w)| *o = c + w);
                    }
                    if normalize {
                        // As l2_normalize: x / max(‖x‖, 1e-12), the norm accumulated
                        // in F64 (in lanes, so that it vectorizes; then one reciprocal).
                        let inv = 1.0 / sum_sq_f64(o).sqrt().max(1e-12);
                        o.iter_mut().for_each(|v| *v = (*v as f64 * inv) as f32);
                    }
                },
            );
            Ok(())
        })?;
        Ok(out)
    }
}

pub(super) fn check_codes_dtype(codes: &Tensor) -> Result<()> {
    if !matches!(codes.dtype(), DType::U32 | DType::I64) {
        bail!("codes: expected U32 or I64 centroid codes, got {:?}", codes.dtype())
    }
    Ok(())
}

pub(super) fn check_residuals(arg: &str, r: &Tensor, rows: usize, width: usize) -> Result<()> {
    if r.dtype() != DType::U8 {
        bail!("{arg}: expected U8 packed residuals, got {:?}", r.dtype())
    }
    if r.elem_count() != rows * width || r.dim(candle_core::D::Minus1)? != width {
        bail!("{arg}: residual width must be dim·nbits/8 = {width} bytes per token, got shape {:?}", r.dims())
    }
    Ok(())
}

/// The codec as the CUDA kernels take it.
#[cfg(feature = "cuda")]
pub(super) fn codec_dev(codec: &ResidualCodec, normalize: bool) -> crate::cuda::CodecDev<'_> {
    crate::cuda::CodecDev {
        centroids: &codec.centroids,
        buckets: &codec.bucket_weights,
        nbits: codec.nbits,
        colbert_order: codec.bit_order == BitOrder::ColBert,
        normalize,
    }
}

/// Decompression, `(codes [T], residuals [T, dim·nbits/8]) → [T, dim]` in
/// `dtype`, normalized if asked (no gradient: documents are data).
pub(super) struct Decompress {
    pub(super) codec: ResidualCodec,
    /// `[T]` U8: padding slots (zero rows; their codes may hold anything).
    pub(super) valid: Option<Tensor>,
    pub(super) dtype: DType,
    pub(super) normalize: bool,
}

impl Decompress {
    pub(super) fn apply(&self, codes: &Tensor, residuals: &Tensor) -> Result<Tensor> {
        codes.flatten_all()?.contiguous()?.apply_op2_no_bwd(&residuals.contiguous()?, self)
    }

    fn host(&self, codes: (&CpuStorage, &Layout), residuals: (&CpuStorage, &Layout)) -> Result<CpuStorage> {
        let valid = self.valid.as_ref().map(|v| v.to_vec1::<u8>()).transpose()?;
        store(self.codec.dense_host(codes, residuals, valid.as_deref(), self.normalize)?, self.dtype)
    }
}

impl CustomOp2 for Decompress {
    fn name(&self) -> &'static str {
        "residual_decompress"
    }

    fn cpu_fwd(&self, c: &CpuStorage, lc: &Layout, r: &CpuStorage, lr: &Layout) -> Result<(CpuStorage, Shape)> {
        let dim = self.codec.centroids.dim(1)?;
        Ok((self.host((c, lc), (r, lr))?, Shape::from((lc.shape().elem_count(), dim))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        c: &candle_core::CudaStorage,
        lc: &Layout,
        r: &candle_core::CudaStorage,
        lr: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        let dim = self.codec.centroids.dim(1)?;
        let t = lc.shape().elem_count();
        let shape = Shape::from((t, dim));
        let dev = &c.device;
        let codec = codec_dev(&self.codec, self.normalize);
        let valid = self.valid.as_ref();
        if let Some(out) = crate::cuda::decompress_residual((c, lc), valid, (r, lr), &codec, self.dtype, (t, dim))? {
            return Ok((out, shape));
        }
        // No kernel for this dtype / dim / nbits: the host decompresses.
        let host = self.host((&c.to_cpu_storage()?, lc), (&r.to_cpu_storage()?, lr))?;
        Ok((dev.storage_from_cpu_storage(&host)?, shape))
    }
}

/// [`ResidualCodec::compress`]: `(x [T, dim], codes [T]) → [T, dim·nbits/8]` U8.
struct Compress {
    codec: ResidualCodec,
    /// `[2^nbits − 1]` F32, ascending.
    cutoffs: Tensor,
}

impl CustomOp2 for Compress {
    fn name(&self) -> &'static str {
        "residual_compress"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout, c: &CpuStorage, lc: &Layout) -> Result<(CpuStorage, Shape)> {
        let (t, dim) = lx.shape().dims2()?;
        let xs = f32s("x", x, lx)?;
        let codes = HostCodes::of(c, lc)?;
        let cents: Vec<f32> = self.codec.centroids.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let cut: Vec<f32> = self.cutoffs.to_vec1()?;
        let n_c = self.codec.centroids.dim(0)?;
        let nbits = self.codec.nbits;
        let mut out = Vec::with_capacity(t * self.codec.residual_width(dim));
        let mut idx = vec![0u8; dim];
        for r in 0..t {
            let code = codes.get(r);
            if code < 0 || code as usize >= n_c {
                bail!("codes: codes[{r}] = {code} is out of range for {n_c} centroids")
            }
            let cent = &cents[code as usize * dim..][..dim];
            for (k, b) in idx.iter_mut().enumerate() {
                let res = xs[r * dim + k] - cent[k];
                *b = cut.partition_point(|&v| v < res) as u8;
            }
            out.extend(pack_bucket_indices(&idx, nbits, self.codec.bit_order)?);
        }
        Ok((CpuStorage::U8(out), Shape::from((t, self.codec.residual_width(dim)))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        c: &candle_core::CudaStorage,
        lc: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (t, dim) = lx.shape().dims2()?;
        let codec = codec_dev(&self.codec, false);
        let out = crate::cuda::compress_residual((x, lx), (c, lc), &codec, &self.cutoffs)?;
        Ok((out, Shape::from((t, self.codec.residual_width(dim)))))
    }
}
