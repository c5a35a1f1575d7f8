//! Centroid assignment: the nearest centroid of each token, by MaxSim's
//! forward with its argmax.

use crate::layout::{check_device, check_float, check_rank, Pairing, Problem, Seqs};
use crate::ops::maxsim::MaxSimOp;
use crate::options::Backward;
use candle_core::{bail, DType, Result, Tensor};

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
