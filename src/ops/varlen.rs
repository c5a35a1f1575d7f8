//! Packed (varlen) layouts with FlashAttention-style `cu_seqlens` offsets.

use super::dense::check_common;
use super::maxsim::MaxSimOp;
use crate::layout::{check_device, check_rank, Pairing, Problem, Seqs};
use crate::options::Backward;
use candle_core::{Result, Tensor};

/// Every packed query against every packed document → `[Nq, Nd]`.
///
/// `q [Tq, dim]` with `cu_q [Nq+1]` (U32 offsets, non-decreasing, from 0 to
/// Tq); likewise `d`, `cu_d`. `max_lq` / `max_ld` must be at least the longest
/// sequence. Empty sequences are allowed (an empty document scores 0).
pub fn maxsim_varlen(
    q: &Tensor,
    cu_q: &Tensor,
    max_lq: usize,
    d: &Tensor,
    cu_d: &Tensor,
    max_ld: usize,
) -> Result<Tensor> {
    let (qs, ds, dim) = packed_seqs(q, cu_q, max_lq, d, cu_d, max_ld)?;
    let (nq, nd) = (qs.n(), ds.n());
    let backward = Backward::Auto.resolve(false, nq, nd, max_lq);
    let problem = Problem { dim, q: qs, d: ds, q_valid: None, d_valid: None, pairs: Pairing::Cross { nq, nd } };
    MaxSimOp::new(problem, backward).apply(q, d)?.reshape((nq, nd))
}

/// Scores of arbitrary (query, document) pairs of packed sequences:
/// pair p is query `pair_q[p]` against document `pair_d[p]` → `[P]`.
#[allow(clippy::too_many_arguments)]
pub fn score_pairs_packed(
    q: &Tensor,
    cu_q: &Tensor,
    max_lq: usize,
    d: &Tensor,
    cu_d: &Tensor,
    max_ld: usize,
    pair_q: &Tensor,
    pair_d: &Tensor,
) -> Result<Tensor> {
    let (qs, ds, dim) = packed_seqs(q, cu_q, max_lq, d, cu_d, max_ld)?;
    check_device("pair_q", pair_q, q.device())?;
    check_device("pair_d", pair_d, q.device())?;
    let pairs = Pairing::list_checked(pair_q, pair_d, qs.n(), ds.n())?;
    let problem = Problem { dim, q: qs, d: ds, q_valid: None, d_valid: None, pairs };
    MaxSimOp::new(problem, Backward::Unified).apply(q, d)
}

/// Validates packed operands and their offsets.
pub(crate) fn packed_seqs(
    q: &Tensor,
    cu_q: &Tensor,
    max_lq: usize,
    d: &Tensor,
    cu_d: &Tensor,
    max_ld: usize,
) -> Result<(Seqs, Seqs, usize)> {
    check_rank("q", q, &[2], "rank 2 [Tq, dim] (packed)")?;
    check_rank("d", d, &[2], "rank 2 [Td, dim] (packed)")?;
    let (tq, dim) = q.dims2()?;
    check_common(q, d, dim)?;
    check_device("cu_q", cu_q, q.device())?;
    check_device("cu_d", cu_d, q.device())?;
    let qs = Seqs::packed("cu_q", cu_q, tq, "max_lq", max_lq)?;
    let ds = Seqs::packed("cu_d", cu_d, d.dim(0)?, "max_ld", max_ld)?;
    Ok((qs, ds, dim))
}
