//! PLAID / ColBERTv2 compressed documents, by concern: the bit layout
//! (bits.rs), the codec with its decompression and compression ops
//! (codec.rs), centroid assignment (centroids.rs), exact MaxSim of chosen
//! pairs (pairs.rs), and here exact MaxSim over whole compressed collections
//! (an op whose CUDA forward never materializes the dense tokens).

use super::maxsim::MaxSimOp;
use super::normalize::l2_normalize;
use crate::layout::{check_device, check_float, check_rank, Pairing, Problem, Seqs};
use crate::options::Backward;
use candle_core::{
    backend::BackendStorage, bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
};
use codec::{check_codes_dtype, check_residuals, Decompress};

mod bits;
mod centroids;
mod codec;
mod pairs;

pub use bits::{pack_bucket_indices, unpack_bucket_indices};
pub use centroids::nearest_centroids;
pub use codec::{BitOrder, ResidualCodec};
pub use pairs::{maxsim_residual_pairs, maxsim_residual_pairs_offsets, DocOffsets, NO_DOCUMENT};

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
        crate::cpu::storage::store(self.codec.dense_host(codes, residuals, valid.as_deref(), self.normalize)?, dtype)
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
        use candle_core::backend::{BackendDevice, BackendStorage};
        let pb = &self.problem;
        let t = lc.shape().elem_count();
        let n_out = pb.n_out();
        let dev = &q.device;
        if t == 0 || n_out == 0 {
            // Every document is empty (or nothing to score): zeros.
            return Ok((dev.zeros_impl(&Shape::from(n_out.max(1)), DType::F32)?, Shape::from(n_out)));
        }
        let codec = codec::codec_dev(&self.codec, self.normalize);
        if let Some(out) = crate::cuda::residual_scores(pb, (q, lq), (c, lc), (r, lr), &codec, self.lens.as_ref())? {
            return Ok((out, Shape::from(n_out)));
        }
        // No fused kernel for this dtype / dim / nbits: the tokens
        // decompressed on the device where a kernel does that (dims over
        // 128), else on the host, then the dense op.
        let valid = pb.d_valid.as_ref();
        let dense = crate::cuda::decompress_residual((c, lc), valid, (r, lr), &codec, q.dtype(), (t, pb.dim))?;
        if let Some(d) = dense {
            return self.dense_op().cuda_fwd(q, lq, &d, &Layout::contiguous((t, pb.dim)));
        }
        let d = self.host_dense((&c.to_cpu_storage()?, lc), (&r.to_cpu_storage()?, lr), q.dtype())?;
        let d = dev.storage_from_cpu_storage(&d)?;
        self.dense_op().cuda_fwd(q, lq, &d, &Layout::contiguous((t, pb.dim)))
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
