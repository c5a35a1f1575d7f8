//! PLAID / ColBERTv2 compressed documents: residual decompression, exact
//! MaxSim over decompressed tokens, and the centroid-only approximate score.

use super::dense::maybe_normalize;
use super::maxsim::MaxSimOp;
use crate::layout::{check_device, check_float, check_rank, Pairing, Problem, Seqs};
use crate::options::Backward;
use candle_core::{bail, DType, Result, Tensor};

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

/// Codes as host u32, from U32 or I64 (rank checked by the caller). Codes of
/// padding tokens (`valid[t] == false`) may hold anything and read as 0.
fn codes_host(codes: &Tensor, valid: &[bool]) -> Result<Vec<u32>> {
    let raw: Vec<i64> = match codes.dtype() {
        DType::U32 => codes.flatten_all()?.to_vec1::<u32>()?.into_iter().map(i64::from).collect(),
        DType::I64 => codes.flatten_all()?.to_vec1::<i64>()?,
        dt => bail!("codes: expected U32 or I64 centroid codes, got {dt:?}"),
    };
    raw.into_iter()
        .zip(valid)
        .enumerate()
        .map(|(k, (c, &ok))| match (ok, u32::try_from(c)) {
            (false, _) => Ok(0),
            (true, Ok(c)) => Ok(c),
            (true, Err(_)) => bail!("codes: codes[{k}] = {c} is negative or too large"),
        })
        .collect()
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
        check_rank("centroids", &self.centroids, &[2], "rank 2 [C, dim]")?;
        let dim = self.centroids.dim(1)?;
        self.check(dim)?;
        check_rank("codes", codes, &[1], "rank 1 [T] (packed)")?;
        check_rank("residuals", residuals, &[2], "rank 2 [T, dim·nbits/8] (packed)")?;
        if !residuals.device().same_device(codes.device()) {
            bail!("residuals: is on {:?} but codes is on {:?}", residuals.device(), codes.device())
        }
        if residuals.dim(0)? != codes.dim(0)? {
            bail!("residuals: {} rows, but codes has {}", residuals.dim(0)?, codes.dim(0)?)
        }
        self.decompress_packed(codes, residuals, dim)
    }

    /// Decompressed tokens `[T, dim]` in `dtype`, L2-normalized if asked: the
    /// dense documents for [`crate::maxsim_varlen`] and friends. On CUDA, for
    /// F16/BF16 and dims that are a multiple of 8 (at most 128), one
    /// decompression kernel on the device; elsewhere [`Self::decompress`].
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
        check_residuals("residuals", residuals, codes.dim(0)?, self.residual_width(dim))?;
        check_device("residuals", residuals, codes.device())?;
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = codes.device() {
            if codes.dim(0)? > 0 && crate::cuda::residual_supported(dev, dtype, dim, self.nbits)? {
                let res = self.on_device(codes, residuals, None, dtype, normalize)?;
                return crate::cuda::decompress_residual(&res, dtype, dim);
            }
        }
        let d = self.decompress_packed(codes, residuals, dim)?;
        let d = if normalize { crate::l2_normalize(&d)? } else { d };
        d.to_dtype(dtype)
    }

    /// The codec and documents as the CUDA kernels take them: U32 codes
    /// (masked by `valid`, checked against the number of centroids with one
    /// read-back), centroids in `dtype`, F32 bucket weights.
    #[cfg(feature = "cuda")]
    fn on_device(
        &self,
        codes: &Tensor,
        residuals: &Tensor,
        valid: Option<&Tensor>,
        dtype: DType,
        normalize: bool,
    ) -> Result<crate::cuda::ResidualDev> {
        // I64 codes become U32: negative ones wrap past the range check.
        let mut codes = codes.flatten_all()?.to_dtype(DType::U32)?;
        if let Some(v) = valid {
            codes = v.where_cond(&codes, &codes.zeros_like()?)?;
        }
        let n_c = self.centroids.dim(0)?;
        let max = max_u32(&codes)?;
        if max as usize >= n_c {
            bail!("codes: code {max} is out of range for {n_c} centroids")
        }
        Ok(crate::cuda::ResidualDev {
            codes,
            residuals: residuals.flatten_all()?,
            centroids: self.centroids.to_dtype(dtype)?,
            buckets: self.bucket_weights.to_dtype(DType::F32)?,
            nbits: self.nbits,
            colbert_order: self.bit_order == BitOrder::ColBert,
            normalize,
        })
    }

    /// [`Self::decompress`] after validation (shapes and codec checked by the caller).
    fn decompress_packed(&self, codes: &Tensor, residuals: &Tensor, dim: usize) -> Result<Tensor> {
        let t = codes.dim(0)?;
        if t == 0 {
            // A zero-size view: CUDA allocates no empty buffer.
            return Tensor::zeros((1, dim), DType::F32, codes.device())?.narrow(0, 0, 0);
        }
        let codes_h = codes_host(codes, &vec![true; t])?;
        let res_h = residual_bytes("residuals", residuals, t, self.residual_width(dim))?;
        let dense = self.decompress_host(&codes_h, &res_h, &vec![true; t], dim)?;
        Tensor::from_vec(dense, (t, dim), codes.device())
    }

    /// Packed residual bytes per token.
    pub fn residual_width(&self, dim: usize) -> usize {
        dim * self.nbits / 8
    }

    /// Decompresses the tokens `rows` (token index into codes/residuals) to a
    /// host F32 `[rows.len(), dim]` matrix; tokens outside `rows` are zero.
    fn decompress_host(&self, codes: &[u32], residuals: &[u8], valid: &[bool], dim: usize) -> Result<Vec<f32>> {
        let cents: Vec<f32> = self.centroids.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let bw: Vec<f32> = self.bucket_weights.to_dtype(DType::F32)?.to_vec1()?;
        let n_c = self.centroids.dim(0)?;
        let w = self.residual_width(dim);
        let mut out = vec![0f32; codes.len() * dim];
        for (t, (&c, &ok)) in codes.iter().zip(valid).enumerate() {
            if !ok {
                continue;
            }
            if c as usize >= n_c {
                bail!("codes: code {c} at token {t} is out of range for {n_c} centroids")
            }
            let row = &residuals[t * w..(t + 1) * w];
            let cent = &cents[c as usize * dim..][..dim];
            for (k, o) in out[t * dim..(t + 1) * dim].iter_mut().enumerate() {
                *o = cent[k] + bw[bucket_index(row, k, self.nbits, self.bit_order) as usize];
            }
        }
        Ok(out)
    }
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

fn residual_bytes(arg: &str, r: &Tensor, rows: usize, width: usize) -> Result<Vec<u8>> {
    check_residuals(arg, r, rows, width)?;
    r.flatten_all()?.to_vec1()
}

/// The largest element of a U32 vector, reduced in two stages: candle
/// reduces a whole tensor in one block, milliseconds for millions of codes.
#[cfg(feature = "cuda")]
fn max_u32(x: &Tensor) -> Result<u32> {
    const CHUNK: usize = 4096;
    let n = x.elem_count();
    let main = n / CHUNK * CHUNK;
    let mut parts = Vec::with_capacity(2);
    if main > 0 {
        parts.push(x.narrow(0, 0, main)?.reshape((main / CHUNK, CHUNK))?.max(1)?);
    }
    if n > main {
        parts.push(x.narrow(0, main, n - main)?);
    }
    Tensor::cat(&parts, 0)?.max(0)?.to_scalar::<u32>()
}

/// CUDA: the path [`crate::cuda::residual_path`] picks. Fused (no gradient
/// to q): the dense documents never reach device memory (the warp kernel
/// for short queries, the MaxSim tile loader otherwise). `Dense` (a gradient
/// to q): a decompression kernel feeds the MaxSim op. `None`: no kernel
/// covers this dtype / dim / nbits (the caller decompresses on the host).
/// `valid` masks padded token slots, whose codes may hold anything;
/// `doc_lens` gives the same for the warp kernel (padded layout). `q` is
/// `[Tq, dim]`, not yet normalized.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn residual_on_cuda(
    dev: &candle_core::CudaDevice,
    q: &Tensor,
    codes: &Tensor,
    residuals: &Tensor,
    codec: &ResidualCodec,
    normalize: bool,
    valid: Option<&Tensor>,
    doc_lens: Option<&Tensor>,
    problem: Problem,
) -> Result<Option<Tensor>> {
    use crate::cuda::ResidualPath;
    let dim = problem.dim;
    let t = codes.elem_count();
    let n_c = codec.centroids.dim(0)?;
    let path =
        crate::cuda::residual_path(dev, &problem, q.dtype(), codec.nbits, q.track_op(), (codes.dtype(), t, n_c))?;
    if path == ResidualPath::Host {
        return Ok(None);
    }
    check_residuals("residuals", residuals, t, codec.residual_width(dim))?;
    let n_out = problem.n_out();
    if t == 0 || n_out == 0 {
        return Tensor::zeros(n_out, DType::F32, q.device()).map(Some);
    }
    let q = if normalize { crate::l2_normalize(q)? } else { q.clone() };
    let scores = match path {
        ResidualPath::Warp => {
            let docs = match doc_lens {
                Some(l) => crate::cuda::WarpDocs::Padded(l),
                None => crate::cuda::WarpDocs::Packed,
            };
            let flags = (codec.nbits, codec.bit_order == BitOrder::ColBert, normalize);
            let (c, b) = (&codec.centroids, &codec.bucket_weights);
            crate::cuda::residual_scores_warp(&problem, &q, codes, residuals, c, b, flags, docs)?
        }
        ResidualPath::Tile => {
            let res = codec.on_device(codes, residuals, valid, q.dtype(), normalize)?;
            crate::cuda::residual_scores(&problem, &q, &res)?
        }
        _ => {
            // Training: dense documents for the closed-form gradient to q.
            let res = codec.on_device(codes, residuals, valid, q.dtype(), normalize)?;
            let d = crate::cuda::decompress_residual(&res, q.dtype(), dim)?;
            MaxSimOp::new(problem, Backward::Unified).apply(&q, &d)?
        }
    };
    Ok(Some(scores))
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
    for (arg, t) in [("codes", codes), ("residuals", residuals), ("doc_lens", doc_lens)] {
        check_device(arg, t, q.device())?;
    }
    let (nd, ld) = codes.dims2()?;
    check_rank("residuals", residuals, &[3], "rank 3 [Nd, Ld, dim·nbits/8]")?;
    if residuals.dims()[..2] != [nd, ld] {
        bail!("residuals: expected [{nd}, {ld}, _] like codes, got {:?}", residuals.dims())
    }
    if doc_lens.dtype() != DType::U32 || doc_lens.dims() != [nd] {
        bail!("doc_lens: expected U32 [{nd}], got {:?} {:?}", doc_lens.dtype(), doc_lens.dims())
    }
    let lens: Vec<u32> = doc_lens.to_vec1()?;
    if let Some((j, &l)) = lens.iter().enumerate().find(|(_, &l)| l as usize > ld) {
        bail!("doc_lens: doc_lens[{j}] = {l} exceeds Ld = {ld}")
    }
    let valid: Vec<bool> = (0..nd * ld).map(|t| t % ld < lens[t / ld] as usize).collect();
    let d_valid = Tensor::from_vec(valid.iter().map(|&v| v as u8).collect::<Vec<u8>>(), nd * ld, q.device())?;
    let problem = Problem {
        dim,
        q: Seqs::Uniform { n: nq, len: lq },
        d: Seqs::Uniform { n: nd, len: ld },
        q_valid: None,
        d_valid: Some(d_valid.clone()),
        pairs: Pairing::Cross { nq, nd },
    };
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = q.device() {
        let qp = q.reshape((nq * lq, dim))?;
        let (valid, lens) = (Some(&d_valid), Some(doc_lens));
        if let Some(s) = residual_on_cuda(dev, &qp, codes, residuals, codec, normalize, valid, lens, problem.clone())? {
            return s.reshape((nq, nd));
        }
    }
    let codes_h = codes_host(codes, &valid)?;
    let res_h = residual_bytes("residuals", residuals, nd * ld, codec.residual_width(dim))?;
    let dense = codec.decompress_host(&codes_h, &res_h, &valid, dim)?;
    let d = Tensor::from_vec(dense, (nd * ld, dim), q.device())?.to_dtype(q.dtype())?;
    let (q, d) = maybe_normalize(q, &d, normalize)?;
    MaxSimOp::new(problem, Backward::Unified).apply(&q.reshape((nq * lq, dim))?, &d)?.reshape((nq, nd))
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
    check_rank("q", q, &[3], "rank 3 [Nq, Lq, dim]")?;
    let (nq, lq, dim) = q.dims3()?;
    check_float("q", q)?;
    codec.check(dim)?;
    check_rank("codes", codes, &[1], "rank 1 [T] (packed)")?;
    check_rank("residuals", residuals, &[2], "rank 2 [T, dim·nbits/8] (packed)")?;
    for (arg, t) in [("codes", codes), ("residuals", residuals), ("cu_d", cu_d)] {
        check_device(arg, t, q.device())?;
    }
    let t = codes.dim(0)?;
    if residuals.dim(0)? != t {
        bail!("residuals: {} rows, but codes has {t}", residuals.dim(0)?)
    }
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
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = q.device() {
        let qp = q.reshape((nq * lq, dim))?;
        if let Some(s) = residual_on_cuda(dev, &qp, codes, residuals, codec, normalize, None, None, problem.clone())? {
            return s.reshape((nq, nd));
        }
    }
    let d = codec.decompress_packed(codes, residuals, dim)?.to_dtype(q.dtype())?;
    let (q, d) = maybe_normalize(q, &d, normalize)?;
    MaxSimOp::new(problem, Backward::Unified).apply(&q.reshape((nq * lq, dim))?, &d)?.reshape((nq, nd))
}

/// Unpacks every bucket index of packed residual rows (for tests and tools).
pub fn unpack_bucket_indices(bytes: &[u8], nbits: usize, order: BitOrder) -> Result<Vec<u8>> {
    check_nbits(nbits)?;
    Ok((0..bytes.len() * 8 / nbits).map(|k| bucket_index(bytes, k, nbits, order)).collect())
}
