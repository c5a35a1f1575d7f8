//! PLAID / ColBERTv2 compressed documents: the codec, residual
//! decompression (an op), and exact MaxSim over compressed documents (an op
//! whose CUDA forward never materializes the dense tokens).

use super::maxsim::MaxSimOp;
use super::normalize::l2_normalize;
use crate::layout::{check_device, check_float, check_rank, Pairing, Problem, Seqs};
use crate::options::Backward;
use candle_core::{
    backend::BackendStorage, bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
};

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

#[inline]
fn reverse_bits(v: u8, nbits: usize) -> u8 {
    v.reverse_bits() >> (8 - nbits)
}

/// Bucket index of feature `k` in a packed residual row (nbits checked by the caller).
#[inline]
pub(crate) fn bucket_index(row: &[u8], k: usize, nbits: usize, order: BitOrder) -> u8 {
    let per = 8 / nbits;
    let byte = row[k / per];
    let field = k % per;
    let mask = ((1u16 << nbits) - 1) as u8;
    match order {
        BitOrder::Lsb => (byte >> (field * nbits)) & mask,
        BitOrder::ColBert => reverse_bits((byte >> (8 - nbits * (field + 1))) & mask, nbits),
    }
}

/// Packs bucket indices (one per feature, each < 2^nbits) into bytes; the
/// inverse of [`unpack_bucket_indices`]. `indices.len()` must be a multiple of 8/nbits.
pub fn pack_bucket_indices(indices: &[u8], nbits: usize, order: BitOrder) -> Result<Vec<u8>> {
    check_nbits(nbits)?;
    let per = 8 / nbits;
    if !indices.len().is_multiple_of(per) {
        bail!("indices: length {} is not a multiple of {per} (8 / nbits)", indices.len())
    }
    let mut out = vec![0u8; indices.len() / per];
    for (k, &v) in indices.iter().enumerate() {
        if (v as usize) >> nbits != 0 {
            bail!("indices: indices[{k}] = {v} does not fit in {nbits} bits")
        }
        let field = k % per;
        out[k / per] |= match order {
            BitOrder::Lsb => v << (field * nbits),
            BitOrder::ColBert => reverse_bits(v, nbits) << (8 - nbits * (field + 1)),
        };
    }
    Ok(out)
}

fn check_nbits(nbits: usize) -> Result<()> {
    if !matches!(nbits, 2 | 4 | 8) {
        bail!("nbits: must be 2, 4 or 8, got {nbits}")
    }
    Ok(())
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

/// Host F32 values as a storage of `dtype` (each rounded once).
fn storage_of(v: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::F64 => CpuStorage::F64(v.into_iter().map(f64::from).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(half::f16::from_f32).collect()),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(half::bf16::from_f32).collect()),
        dt => bail!("maxsim_residual: internal error, no dense tokens in {dt:?}"),
    })
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
    fn dense_host(
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
        let mut out = vec![0f32; codes.len() * dim];
        for (t, o) in out.chunks_mut(dim.max(1)).enumerate().take(codes.len()) {
            if valid.is_some_and(|v| v[t] == 0) {
                continue;
            }
            let c = codes.get(t);
            if c < 0 || c as usize >= n_c {
                bail!("codes: codes[{t}] = {c} is out of range for {n_c} centroids")
            }
            let row = &res[t * w..(t + 1) * w];
            let cent = &cents[c as usize * dim..][..dim];
            for (k, o) in o.iter_mut().enumerate() {
                *o = cent[k] + bw[bucket_index(row, k, self.nbits, self.bit_order) as usize];
            }
            if normalize {
                // As l2_normalize: x / max(‖x‖, 1e-12), the norm accumulated in F64.
                let n = o.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>().sqrt().max(1e-12);
                o.iter_mut().for_each(|v| *v = (*v as f64 / n) as f32);
            }
        }
        Ok(out)
    }
}

fn check_codes_dtype(codes: &Tensor) -> Result<()> {
    if !matches!(codes.dtype(), DType::U32 | DType::I64) {
        bail!("codes: expected U32 or I64 centroid codes, got {:?}", codes.dtype())
    }
    Ok(())
}

fn check_residuals(arg: &str, r: &Tensor, rows: usize, width: usize) -> Result<()> {
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
fn codec_dev(codec: &ResidualCodec, normalize: bool) -> crate::cuda::CodecDev<'_> {
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
struct Decompress {
    codec: ResidualCodec,
    /// `[T]` U8: padding slots (zero rows; their codes may hold anything).
    valid: Option<Tensor>,
    dtype: DType,
    normalize: bool,
}

impl Decompress {
    fn apply(&self, codes: &Tensor, residuals: &Tensor) -> Result<Tensor> {
        codes.flatten_all()?.contiguous()?.apply_op2_no_bwd(&residuals.contiguous()?, self)
    }

    fn host(&self, codes: (&CpuStorage, &Layout), residuals: (&CpuStorage, &Layout)) -> Result<CpuStorage> {
        let valid = self.valid.as_ref().map(|v| v.to_vec1::<u8>()).transpose()?;
        storage_of(self.codec.dense_host(codes, residuals, valid.as_deref(), self.normalize)?, self.dtype)
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
        if crate::cuda::residual_supported(dev, self.dtype, dim, self.codec.nbits)? {
            let codes = crate::cuda::codes_u32((c, lc), self.valid.as_ref(), self.codec.centroids.dim(0)?)?;
            let codec = codec_dev(&self.codec, self.normalize);
            let out = crate::cuda::decompress_residual(&codes, (r, lr), &codec, self.dtype, (t, dim))?;
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
        let Some((xa, xb)) = lx.contiguous_offsets() else { bail!("x: expected a contiguous tensor") };
        let xs: std::borrow::Cow<[f32]> = match x {
            CpuStorage::F32(v) => std::borrow::Cow::Borrowed(&v[xa..xb]),
            CpuStorage::F16(v) => std::borrow::Cow::Owned(v[xa..xb].iter().map(|h| h.to_f32()).collect()),
            CpuStorage::BF16(v) => std::borrow::Cow::Owned(v[xa..xb].iter().map(|h| h.to_f32()).collect()),
            x => bail!("x: expected F16, BF16 or F32 tokens, got {:?}", x.dtype()),
        };
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
        let codes = crate::cuda::codes_u32((c, lc), None, self.codec.centroids.dim(0)?)?;
        let codec = codec_dev(&self.codec, false);
        let out = crate::cuda::compress_residual((x, lx), &codes, &codec, &self.cutoffs)?;
        Ok((out, Shape::from((t, self.codec.residual_width(dim)))))
    }
}

/// Compressed documents as [`score`] takes them.
struct Docs<'a> {
    /// `[T]` U32 or I64 centroid codes.
    codes: &'a Tensor,
    /// `[T, dim·nbits/8]` U8 packed residuals.
    residuals: &'a Tensor,
    codec: &'a ResidualCodec,
    normalize: bool,
    /// Padded layout: `[Nd]` U32 document lengths (the problem's `d_valid` marks the same slots).
    lens: Option<&'a Tensor>,
}

/// Exact scores `[n_pairs]` of packed queries `q [Tq, dim]` (normalized by
/// the caller if asked) against the compressed documents laid out by
/// `problem.d`. A gradient to q scores the decompressed documents with the
/// dense op (documents are data); without one, the fused op.
fn score(q: &Tensor, docs: Docs, problem: Problem) -> Result<Tensor> {
    if q.track_op() {
        let op = Decompress {
            codec: docs.codec.clone(),
            valid: problem.d_valid.clone(),
            dtype: q.dtype(),
            normalize: docs.normalize,
        };
        let d = op.apply(docs.codes, docs.residuals)?;
        return MaxSimOp::new(problem, Backward::Unified).apply(q, &d);
    }
    let op = ResidualScore { problem, codec: docs.codec.clone(), normalize: docs.normalize, lens: docs.lens.cloned() };
    q.contiguous()?.apply_op3_no_bwd(&docs.codes.flatten_all()?.contiguous()?, &docs.residuals.contiguous()?, &op)
}

/// Exact MaxSim of packed queries against compressed documents,
/// `(q [Tq, dim], codes [T], residuals [T, dim·nbits/8]) → [n_pairs]` F32,
/// without a gradient: on CUDA a fused kernel (the dense tokens never reach
/// device memory) where one covers the dtype / dim / nbits, on the CPU (and
/// elsewhere) the host decompresses and the CPU engine scores.
struct ResidualScore {
    problem: Problem,
    codec: ResidualCodec,
    normalize: bool,
    /// Padded layout: `[Nd]` U32 document lengths.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    lens: Option<Tensor>,
}

impl ResidualScore {
    fn host_dense(
        &self,
        codes: (&CpuStorage, &Layout),
        residuals: (&CpuStorage, &Layout),
        dtype: DType,
    ) -> Result<CpuStorage> {
        let valid = self.problem.d_valid.as_ref().map(|v| v.to_vec1::<u8>()).transpose()?;
        storage_of(self.codec.dense_host(codes, residuals, valid.as_deref(), self.normalize)?, dtype)
    }

    fn dense_op(&self) -> MaxSimOp {
        MaxSimOp::new(self.problem.clone(), Backward::Unified)
    }
}

impl CustomOp3 for ResidualScore {
    fn name(&self) -> &'static str {
        "maxsim_residual"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        c: &CpuStorage,
        lc: &Layout,
        r: &CpuStorage,
        lr: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = self.host_dense((c, lc), (r, lr), q.dtype())?;
        let ld = Layout::contiguous((lc.shape().elem_count(), self.problem.dim));
        self.dense_op().cpu_fwd(q, lq, &d, &ld)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        c: &candle_core::CudaStorage,
        lc: &Layout,
        r: &candle_core::CudaStorage,
        lr: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::{ResidualPath, WarpDocs, WarpTasks};
        use candle_core::backend::{BackendDevice, BackendStorage};
        let pb = &self.problem;
        let t = lc.shape().elem_count();
        let n_out = pb.n_out();
        let dev = &q.device;
        if t == 0 || n_out == 0 {
            // Every document is empty (or nothing to score): zeros.
            return Ok((dev.zeros_impl(&Shape::from(n_out.max(1)), DType::F32)?, Shape::from(n_out)));
        }
        let n_c = self.codec.centroids.dim(0)?;
        let codec = codec_dev(&self.codec, self.normalize);
        let out = match crate::cuda::residual_path(dev, pb, q.dtype(), self.codec.nbits, (c.dtype(), t, n_c))? {
            ResidualPath::Warp => {
                let docs = match &self.lens {
                    Some(l) => WarpDocs::Padded(l),
                    None => WarpDocs::Packed,
                };
                crate::cuda::residual_scores_warp(pb, (q, lq), (c, lc), (r, lr), &codec, docs, WarpTasks::Cross)?
            }
            ResidualPath::Tile => {
                let codes = crate::cuda::codes_u32((c, lc), pb.d_valid.as_ref(), n_c)?;
                crate::cuda::residual_scores_tile(pb, (q, lq), &codes, (r, lr), &codec)?
            }
            ResidualPath::Host => {
                let d = self.host_dense((&c.to_cpu_storage()?, lc), (&r.to_cpu_storage()?, lr), q.dtype())?;
                let d = dev.storage_from_cpu_storage(&d)?;
                return self.dense_op().cuda_fwd(q, lq, &d, &Layout::contiguous((t, pb.dim)));
            }
        };
        Ok((out, Shape::from(n_out)))
    }
}

/// Exact MaxSim of `q [Nq, Lq, dim]` against padded compressed documents:
/// `codes [Nd, Ld]`, `residuals [Nd, Ld, dim·nbits/8]`, `doc_lens [Nd]` → `[Nq, Nd]`.
/// Gradients flow to `q` only (documents are data).
pub fn maxsim_residual(
    q: &Tensor,
    codes: &Tensor,
    residuals: &Tensor,
    doc_lens: &Tensor,
    codec: &ResidualCodec,
    normalize: bool,
) -> Result<Tensor> {
    check_rank("q", q, &[3], "rank 3 [Nq, Lq, dim]")?;
    let (nq, lq, dim) = q.dims3()?;
    check_float("q", q)?;
    codec.check(dim)?;
    check_rank("codes", codes, &[2], "rank 2 [Nd, Ld]")?;
    check_codes_dtype(codes)?;
    for (arg, t) in [("codes", codes), ("residuals", residuals), ("doc_lens", doc_lens)] {
        check_device(arg, t, q.device())?;
    }
    let (nd, ld) = codes.dims2()?;
    check_rank("residuals", residuals, &[3], "rank 3 [Nd, Ld, dim·nbits/8]")?;
    if residuals.dims()[..2] != [nd, ld] {
        bail!("residuals: expected [{nd}, {ld}, _] like codes, got {:?}", residuals.dims())
    }
    check_residuals("residuals", residuals, nd * ld, codec.residual_width(dim))?;
    if doc_lens.dtype() != DType::U32 || doc_lens.dims() != [nd] {
        bail!("doc_lens: expected U32 [{nd}], got {:?} {:?}", doc_lens.dtype(), doc_lens.dims())
    }
    let lens: Vec<u32> = doc_lens.to_vec1()?;
    if let Some((j, &l)) = lens.iter().enumerate().find(|(_, &l)| l as usize > ld) {
        bail!("doc_lens: doc_lens[{j}] = {l} exceeds Ld = {ld}")
    }
    let valid: Vec<u8> = (0..nd * ld).map(|t| u8::from(t % ld < lens[t / ld] as usize)).collect();
    let problem = Problem {
        dim,
        q: Seqs::Uniform { n: nq, len: lq },
        d: Seqs::Uniform { n: nd, len: ld },
        q_valid: None,
        d_valid: Some(Tensor::from_vec(valid, nd * ld, q.device())?),
        pairs: Pairing::Cross { nq, nd },
    };
    let docs = Docs { codes, residuals, codec, normalize, lens: Some(doc_lens) };
    let q = q.reshape((nq * lq, dim))?;
    let q = if normalize { l2_normalize(&q)? } else { q };
    score(&q, docs, problem)?.reshape((nq, nd))
}

/// The checks the packed residual entry points share: `q [Nq, Lq, dim]`
/// floating point, `codes [T]`, `residuals [T, dim·nbits/8]` and `cu_d` on
/// `q`'s device → `(Nq, Lq, dim, T)`.
fn check_packed(
    q: &Tensor,
    codes: &Tensor,
    residuals: &Tensor,
    cu_d: &Tensor,
    codec: &ResidualCodec,
) -> Result<(usize, usize, usize, usize)> {
    check_rank("q", q, &[3], "rank 3 [Nq, Lq, dim]")?;
    let (nq, lq, dim) = q.dims3()?;
    check_float("q", q)?;
    codec.check(dim)?;
    check_rank("codes", codes, &[1], "rank 1 [T] (packed)")?;
    check_codes_dtype(codes)?;
    check_rank("residuals", residuals, &[2], "rank 2 [T, dim·nbits/8] (packed)")?;
    for (arg, t) in [("codes", codes), ("residuals", residuals), ("cu_d", cu_d)] {
        check_device(arg, t, q.device())?;
    }
    let t = codes.dim(0)?;
    if residuals.dim(0)? != t {
        bail!("residuals: {} rows, but codes has {t}", residuals.dim(0)?)
    }
    check_residuals("residuals", residuals, t, codec.residual_width(dim))?;
    Ok((nq, lq, dim, t))
}

/// Exact MaxSim against packed compressed documents: `codes [T]`,
/// `residuals [T, dim·nbits/8]`, `cu_d [Nd+1]` → `[Nq, Nd]`.
pub fn maxsim_residual_varlen(
    q: &Tensor,
    codes: &Tensor,
    residuals: &Tensor,
    cu_d: &Tensor,
    max_ld: usize,
    codec: &ResidualCodec,
    normalize: bool,
) -> Result<Tensor> {
    let (nq, lq, dim, t) = check_packed(q, codes, residuals, cu_d, codec)?;
    let ds = Seqs::packed("cu_d", cu_d, t, "max_ld", max_ld)?;
    let nd = ds.n();
    let problem = Problem {
        dim,
        q: Seqs::Uniform { n: nq, len: lq },
        d: ds,
        q_valid: None,
        d_valid: None,
        pairs: Pairing::Cross { nq, nd },
    };
    let docs = Docs { codes, residuals, codec, normalize, lens: None };
    let q = q.reshape((nq * lq, dim))?;
    let q = if normalize { l2_normalize(&q)? } else { q };
    score(&q, docs, problem)?.reshape((nq, nd))
}

/// For each row of `x [T, dim]`, the row of `centroids [C, dim]` with the
/// largest dot product: `[T]` U32 (F16, BF16, F32 or F64, the same dtype for
/// both). These are the centroid codes of ColBERTv2 / PLAID compression
/// (`compress_into_codes`) and the assignment step of spherical k-means. It
/// is MaxSim's forward with its argmax (every 128 rows of `x` a query, the
/// centroids one document), so the `[T, C]` products are never
/// materialized; ties go to the lower index, on CUDA with F16/BF16 also
/// near-ties within a relative 2^-18 (see the crate docs).
pub fn nearest_centroids(x: &Tensor, centroids: &Tensor) -> Result<Tensor> {
    check_rank("x", x, &[2], "rank 2 [T, dim]")?;
    check_rank("centroids", centroids, &[2], "rank 2 [C, dim]")?;
    check_float("x", x)?;
    check_device("centroids", centroids, x.device())?;
    let (t, dim) = x.dims2()?;
    if centroids.dtype() != x.dtype() || centroids.dim(1)? != dim {
        bail!(
            "centroids: expected {:?} [C, {dim}] like x, got {:?} {:?}",
            x.dtype(),
            centroids.dtype(),
            centroids.dims()
        )
    }
    let c = centroids.dim(0)?;
    if c == 0 {
        bail!("centroids: no centroids to choose from")
    }
    if c > i32::MAX as usize {
        bail!("centroids: {c} centroids exceed the 32-bit argmax")
    }
    if t == 0 {
        return Tensor::zeros(1, DType::U32, x.device())?.narrow(0, 0, 0);
    }
    // Queries of 128 rows (the last shorter), one document of every centroid.
    const ROWS: u32 = 128;
    let cu: Vec<u32> =
        (0..t.div_ceil(ROWS as usize) as u32).map(|i| i * ROWS).chain(std::iter::once(t as u32)).collect();
    let cu_dev = Tensor::new(cu.as_slice(), x.device())?;
    let nq = cu.len() - 1;
    let problem = Problem {
        dim,
        q: Seqs::Packed { cu: std::sync::Arc::new(cu), cu_dev, max_len: ROWS as usize },
        d: Seqs::Uniform { n: 1, len: c },
        q_valid: None,
        d_valid: None,
        pairs: Pairing::Cross { nq, nd: 1 },
    };
    let (_, argmax) = MaxSimOp::new(problem, Backward::Unified).run_with_argmax(x, centroids)?;
    // [nq, 128] document-local winners, -1 past the last row: the first t.
    let argmax = argmax.flatten_all()?.narrow(0, 0, t)?;
    #[cfg(feature = "cuda")]
    if argmax.device().is_cuda() {
        return crate::cuda::i32_bits_as_u32(&argmax);
    }
    argmax.to_dtype(DType::U32)
}

/// The document index of [`maxsim_residual_pairs`] that stands for "no
/// document" (a pair scored `-inf`): the padding of candidate lists shorter
/// than asked for.
pub const NO_DOCUMENT: u32 = u32::MAX;

/// Exact MaxSim of arbitrary (query, document) pairs against packed
/// compressed documents, as [`maxsim_residual_varlen`] scores them: `q [Nq,
/// Lq, dim]`, `codes [T]`, `residuals [T, dim·nbits/8]`, `cu_d [Nd+1]`,
/// `pair_q [P]` / `pair_d [P]` U32 → `[P]` F32, pair `p` being query
/// `pair_q[p]` against document `pair_d[p]`. A pair whose document is
/// [`NO_DOCUMENT`] scores `-inf`; any other out-of-range index is an `Err`.
/// No gradient.
///
/// On CUDA, where the warp kernel covers the queries (F16/BF16, at most 32
/// rows, dims 64 / 96 / 128), the pairs are read by the kernel itself: no
/// host copy, so a search can feed it candidates it selected on the device.
/// Elsewhere the pairs are read on the host and only the documents they
/// name are gathered and scored.
#[allow(clippy::too_many_arguments)]
pub fn maxsim_residual_pairs(
    q: &Tensor,
    codes: &Tensor,
    residuals: &Tensor,
    cu_d: &Tensor,
    max_ld: usize,
    pair_q: &Tensor,
    pair_d: &Tensor,
    codec: &ResidualCodec,
    normalize: bool,
) -> Result<Tensor> {
    let (nq, lq, dim, t) = check_packed(q, codes, residuals, cu_d, codec)?;
    for (arg, p) in [("pair_q", pair_q), ("pair_d", pair_d)] {
        check_device(arg, p, q.device())?;
    }
    for (arg, p) in [("pair_q", pair_q), ("pair_d", pair_d)] {
        if p.dtype() != DType::U32 || p.rank() != 1 {
            bail!("{arg}: expected a rank-1 U32 tensor, got {:?} {:?}", p.dtype(), p.dims())
        }
    }
    if pair_q.dim(0)? != pair_d.dim(0)? {
        bail!("pair_d: length {} differs from pair_q's {}", pair_d.dim(0)?, pair_q.dim(0)?)
    }
    let d = Seqs::packed("cu_d", cu_d, t, "max_ld", max_ld)?;
    let q = if normalize { l2_normalize(&q.detach())? } else { q.detach() };
    let op = ResidualPairs {
        lq,
        d,
        codes: codes.contiguous()?,
        residuals: residuals.contiguous()?,
        pair_q: pair_q.contiguous()?,
        pair_d: pair_d.contiguous()?,
        codec: codec.clone(),
        normalize,
    };
    q.reshape((nq * lq, dim))?.contiguous()?.apply_op1_no_bwd(&op)
}

/// [`maxsim_residual_pairs`] over packed queries `[Nq·Lq, dim]` (normalized
/// if asked); the documents and pairs are held by the op (no gradient).
struct ResidualPairs {
    lq: usize,
    d: Seqs,
    codes: Tensor,
    residuals: Tensor,
    pair_q: Tensor,
    pair_d: Tensor,
    codec: ResidualCodec,
    normalize: bool,
}

impl ResidualPairs {
    /// Pairs read on the host: the documents they name gathered, scored as
    /// a pair list by [`score`], `-inf` scattered back for [`NO_DOCUMENT`].
    fn on_host_pairs(&self, q: &Tensor) -> Result<Tensor> {
        let (nq, nd) = (q.dim(0)? / self.lq.max(1), self.d.n());
        let pq: Vec<u32> = self.pair_q.to_vec1()?;
        let pd: Vec<u32> = self.pair_d.to_vec1()?;
        let mut slot = vec![u32::MAX; nd];
        let (mut docs, mut vq, mut vd, mut keep) = (vec![], vec![], vec![], vec![]);
        for (p, (&i, &j)) in pq.iter().zip(&pd).enumerate() {
            if i as usize >= nq {
                bail!("pair_q: pair_q[{p}] = {i} is out of range for {nq} queries")
            }
            if j == NO_DOCUMENT {
                continue;
            }
            if j as usize >= nd {
                bail!("pair_d: pair_d[{p}] = {j} is out of range for {nd} documents")
            }
            if slot[j as usize] == u32::MAX {
                slot[j as usize] = docs.len() as u32;
                docs.push(j);
            }
            vq.push(i);
            vd.push(slot[j as usize]);
            keep.push(p);
        }
        let dev = q.device();
        let mut out = vec![f32::NEG_INFINITY; pq.len()];
        if !keep.is_empty() {
            let mut cu = vec![0u32];
            let mut rows = vec![];
            let mut max_len = 0;
            for &j in &docs {
                let (a, b) = (self.d.start(j as usize), self.d.end(j as usize));
                rows.extend(a as u32..b as u32);
                cu.push(rows.len() as u32);
                max_len = max_len.max(b - a);
            }
            let n_rows = rows.len();
            let ds = if n_rows == 0 {
                // Only empty documents: no rows to gather (a zero-size view).
                (self.codes.narrow(0, 0, 0)?, self.residuals.narrow(0, 0, 0)?)
            } else {
                let rows = Tensor::from_vec(rows, n_rows, dev)?;
                (self.codes.index_select(&rows, 0)?, self.residuals.index_select(&rows, 0)?)
            };
            let n_docs = docs.len();
            let cu = Tensor::from_vec(cu, n_docs + 1, dev)?;
            let problem = Problem {
                dim: q.dim(1)?,
                q: Seqs::Uniform { n: nq, len: self.lq },
                d: Seqs::packed("cu_d", &cu, n_rows, "max_ld", max_len)?,
                q_valid: None,
                d_valid: None,
                pairs: Pairing::list_from(vq, vd, dev)?,
            };
            let docs =
                Docs { codes: &ds.0, residuals: &ds.1, codec: &self.codec, normalize: self.normalize, lens: None };
            let scores: Vec<f32> = score(q, docs, problem)?.to_vec1()?;
            for (&p, s) in keep.iter().zip(scores) {
                out[p] = s;
            }
        }
        Tensor::from_vec(out, pq.len(), dev)
    }

    /// The query rows of a copied storage (the whole buffer) at layout `l`.
    fn rows(s: candle_core::Storage, l: &Layout) -> Result<Tensor> {
        let n = s_elems(&s)?;
        let all = Tensor::from((s, n));
        all.narrow(0, l.start_offset(), l.shape().elem_count())?.reshape(l.shape())
    }

    /// The scores as a storage of the device's kind.
    fn tensor_storage(t: &Tensor) -> Result<candle_core::Storage> {
        let t = t.contiguous()?;
        let (s, l) = t.storage_and_layout();
        if l.start_offset() != 0 {
            bail!("maxsim_residual_pairs: internal error, an offset result")
        }
        Ok(match &*s {
            candle_core::Storage::Cpu(c) => candle_core::Storage::Cpu(c.clone()),
            #[cfg(feature = "cuda")]
            candle_core::Storage::Cuda(c) => candle_core::Storage::Cuda(c.try_clone(l)?),
            _ => bail!("maxsim_residual_pairs: unsupported device"),
        })
    }
}

/// Elements of a storage's whole buffer.
fn s_elems(s: &candle_core::Storage) -> Result<usize> {
    Ok(match s {
        candle_core::Storage::Cpu(c) => match c {
            CpuStorage::F16(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            c => bail!("q: unsupported dtype {:?}", c.dtype()),
        },
        #[cfg(feature = "cuda")]
        candle_core::Storage::Cuda(c) => match c.dtype() {
            DType::F16 => c.as_cuda_slice::<half::f16>()?.len(),
            DType::BF16 => c.as_cuda_slice::<half::bf16>()?.len(),
            DType::F32 => c.as_cuda_slice::<f32>()?.len(),
            DType::F64 => c.as_cuda_slice::<f64>()?.len(),
            dt => bail!("q: unsupported dtype {dt:?}"),
        },
        _ => bail!("q: unsupported device"),
    })
}

impl CustomOp1 for ResidualPairs {
    fn name(&self) -> &'static str {
        "maxsim_residual_pairs"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = self.on_host_pairs(&Self::rows(candle_core::Storage::Cpu(s.clone()), l)?)?;
        match Self::tensor_storage(&out)? {
            candle_core::Storage::Cpu(c) => Ok((c, out.shape().clone())),
            _ => bail!("maxsim_residual_pairs: internal error, scores are not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::{WarpDocs, WarpTasks};
        let (tq, dim) = l.shape().dims2()?;
        let n_pairs = self.pair_q.dim(0)?;
        let t = self.codes.dim(0)?;
        let n_c = self.codec.centroids.dim(0)?;
        let warp = crate::cuda::residual_supported(&s.device, s.dtype(), dim, self.codec.nbits)?
            && crate::cuda::warp_applies(dim, self.lq, self.codes.dtype(), t, n_c);
        if warp {
            let nq = tq / self.lq.max(1);
            let problem = Problem {
                dim,
                q: Seqs::Uniform { n: nq, len: self.lq },
                d: self.d.clone(),
                q_valid: None,
                d_valid: None,
                pairs: Pairing::Cross { nq, nd: self.d.n() },
            };
            let (cs, cl) = self.codes.storage_and_layout();
            let (rs, rl) = self.residuals.storage_and_layout();
            let (candle_core::Storage::Cuda(cs), candle_core::Storage::Cuda(rs)) = (&*cs, &*rs) else {
                bail!("codes: expected a CUDA tensor")
            };
            let codec = codec_dev(&self.codec, self.normalize);
            let tasks = WarpTasks::Pairs(&self.pair_q, &self.pair_d);
            let out = crate::cuda::residual_scores_warp(
                &problem,
                (s, l),
                (cs, cl),
                (rs, rl),
                &codec,
                WarpDocs::Packed,
                tasks,
            )?;
            return Ok((out, Shape::from(n_pairs)));
        }
        // Other queries: a copy of them (small) as a tensor, the pairs on the host.
        use candle_core::backend::BackendStorage;
        let out = self.on_host_pairs(&Self::rows(candle_core::Storage::Cuda(s.try_clone(l)?), l)?)?;
        match Self::tensor_storage(&out)? {
            candle_core::Storage::Cuda(c) => Ok((c, out.shape().clone())),
            _ => bail!("maxsim_residual_pairs: internal error, scores are not on the GPU"),
        }
    }
}

/// Unpacks every bucket index of packed residual rows (for tests and tools).
pub fn unpack_bucket_indices(bytes: &[u8], nbits: usize, order: BitOrder) -> Result<Vec<u8>> {
    check_nbits(nbits)?;
    Ok((0..bytes.len() * 8 / nbits).map(|k| bucket_index(bytes, k, nbits, order)).collect())
}
