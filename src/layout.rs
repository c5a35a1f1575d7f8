//! How a MaxSim problem is laid out, independent of the entry point.
//!
//! Every entry point lowers to the same description: queries are row ranges
//! of a packed `[Tq, dim]` matrix, documents are row ranges of a packed
//! `[Td, dim]` matrix, optional per-row validity flags (the masks, flattened),
//! and a pairing that says which (query, document) pairs to score:
//! the full cross product (dense in-batch, varlen) or an explicit list
//! (KD / hard negatives, pairs, `score_pairs_packed`).

use candle_core::{bail, DType, Device, Result, Tensor};
use std::sync::Arc;

/// Sequences as row ranges of a packed matrix.
#[derive(Clone, Debug)]
pub(crate) enum Seqs {
    /// `n` sequences of `len` rows each, back to back (a padded dense batch).
    Uniform { n: usize, len: usize },
    /// FlashAttention-style offsets: sequence `i` is rows `cu[i]..cu[i+1]`.
    /// `cu` is kept on the host (validated once) and on the device.
    Packed {
        cu: Arc<Vec<u32>>,
        #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
        cu_dev: Tensor,
        max_len: usize,
    },
}

impl Seqs {
    pub fn n(&self) -> usize {
        match self {
            Seqs::Uniform { n, .. } => *n,
            Seqs::Packed { cu, .. } => cu.len() - 1,
        }
    }
    pub fn start(&self, i: usize) -> usize {
        match self {
            Seqs::Uniform { len, .. } => i * len,
            Seqs::Packed { cu, .. } => cu[i] as usize,
        }
    }
    pub fn end(&self, i: usize) -> usize {
        match self {
            Seqs::Uniform { len, .. } => (i + 1) * len,
            Seqs::Packed { cu, .. } => cu[i + 1] as usize,
        }
    }
    pub fn max_len(&self) -> usize {
        match self {
            Seqs::Uniform { len, .. } => *len,
            Seqs::Packed { max_len, .. } => *max_len,
        }
    }
    /// Rows spanned by all sequences.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn rows(&self) -> usize {
        match self.n() {
            0 => 0,
            n => self.end(n - 1),
        }
    }

    /// Validates `cu` (u32, rank 1, starts at 0, non-decreasing, ends at
    /// `rows`, longest sequence ≤ `max_len`) and reads it to the host once.
    pub fn packed(arg: &str, cu: &Tensor, rows: usize, max_arg: &str, max_len: usize) -> Result<Self> {
        if cu.dtype() != DType::U32 || cu.rank() != 1 || cu.dim(0)? == 0 {
            bail!("{arg}: expected a rank-1 U32 offsets tensor [N+1], got {:?} {:?}", cu.dtype(), cu.dims())
        }
        let host: Vec<u32> = cu.to_vec1()?;
        Self::packed_host(arg, Arc::new(host), cu.contiguous()?, rows, max_arg, max_len)
    }

    /// [`Self::packed`] of offsets already on the host (`host`), with their
    /// device copy `cu_dev` (the caller vouches that they are equal).
    pub fn packed_host(
        arg: &str,
        host: Arc<Vec<u32>>,
        cu_dev: Tensor,
        rows: usize,
        max_arg: &str,
        max_len: usize,
    ) -> Result<Self> {
        if host.is_empty() {
            bail!("{arg}: expected a rank-1 U32 offsets tensor [N+1], got an empty one")
        }
        if host[0] != 0 {
            bail!("{arg}: offsets must start at 0, got {}", host[0])
        }
        let mut longest = 0usize;
        for (k, w) in host.windows(2).enumerate() {
            if w[1] < w[0] {
                bail!(
                    "{arg}: offsets must be non-decreasing, but {arg}[{}] = {} > {arg}[{}] = {}",
                    k,
                    w[0],
                    k + 1,
                    w[1]
                )
            }
            longest = longest.max((w[1] - w[0]) as usize);
        }
        let last = *host.last().unwrap() as usize;
        if last != rows {
            bail!("{arg}: last offset must equal the number of packed rows ({rows}), got {last}")
        }
        if longest > max_len {
            bail!("{max_arg}: {max_len} is smaller than the longest sequence in {arg} ({longest})")
        }
        Ok(Seqs::Packed { cu: host, cu_dev, max_len })
    }
}

/// Which (query, document) pairs to score.
#[derive(Clone, Debug)]
pub(crate) enum Pairing {
    /// Every query against every document: output `[Nq * Nd]`, pair `i * Nd + j`.
    Cross { nq: usize, nd: usize },
    /// Pair `p` scores query `pq[p]` against document `pd[p]`.
    List {
        pq: Arc<Vec<u32>>,
        pd: Arc<Vec<u32>>,
        #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
        pq_dev: Tensor,
        #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
        pd_dev: Tensor,
    },
}

impl Pairing {
    pub fn len(&self) -> usize {
        match self {
            Pairing::Cross { nq, nd } => nq * nd,
            Pairing::List { pq, .. } => pq.len(),
        }
    }
    #[inline]
    pub fn get(&self, p: usize) -> (usize, usize) {
        match self {
            Pairing::Cross { nd, .. } => (p / nd, p % nd),
            Pairing::List { pq, pd, .. } => (pq[p] as usize, pd[p] as usize),
        }
    }

    /// A pair list built by the crate itself (KD layout, pairs): indices are in range by construction.
    pub fn list_from(pq: Vec<u32>, pd: Vec<u32>, device: &Device) -> Result<Self> {
        let n = pq.len();
        // CUDA allocates no empty buffer; an empty list is never launched on.
        let device = if n == 0 { &Device::Cpu } else { device };
        let pq_dev = Tensor::from_vec(pq.clone(), n, device)?;
        let pd_dev = Tensor::from_vec(pd.clone(), n, device)?;
        Ok(Pairing::List { pq: Arc::new(pq), pd: Arc::new(pd), pq_dev, pd_dev })
    }

    /// A user-supplied pair list: U32 rank-1, equal lengths, indices in range.
    pub fn list_checked(pair_q: &Tensor, pair_d: &Tensor, nq: usize, nd: usize) -> Result<Self> {
        for (arg, t) in [("pair_q", pair_q), ("pair_d", pair_d)] {
            if t.dtype() != DType::U32 || t.rank() != 1 {
                bail!("{arg}: expected a rank-1 U32 tensor, got {:?} {:?}", t.dtype(), t.dims())
            }
        }
        if pair_q.dim(0)? != pair_d.dim(0)? {
            bail!("pair_d: length {} differs from pair_q's {}", pair_d.dim(0)?, pair_q.dim(0)?)
        }
        let pq: Vec<u32> = pair_q.to_vec1()?;
        let pd: Vec<u32> = pair_d.to_vec1()?;
        if let Some((p, &v)) = pq.iter().enumerate().find(|(_, &v)| v as usize >= nq) {
            bail!("pair_q: pair_q[{p}] = {v} is out of range for {nq} queries")
        }
        if let Some((p, &v)) = pd.iter().enumerate().find(|(_, &v)| v as usize >= nd) {
            bail!("pair_d: pair_d[{p}] = {v} is out of range for {nd} documents")
        }
        Ok(Pairing::List {
            pq: Arc::new(pq),
            pd: Arc::new(pd),
            pq_dev: pair_q.contiguous()?,
            pd_dev: pair_d.contiguous()?,
        })
    }
}

/// The full description of one MaxSim problem over packed rows.
#[derive(Clone, Debug)]
pub(crate) struct Problem {
    pub dim: usize,
    pub q: Seqs,
    pub d: Seqs,
    /// `[Tq]` U8 row validity (the flattened query mask), on the inputs' device.
    pub q_valid: Option<Tensor>,
    /// `[Td]` U8 row validity (the flattened document mask).
    pub d_valid: Option<Tensor>,
    pub pairs: Pairing,
}

impl Problem {
    /// Number of scores produced.
    pub fn n_out(&self) -> usize {
        self.pairs.len()
    }
}

/// `Err` unless `mask` is a U8 tensor of exactly `dims`, on `device`.
pub(crate) fn check_mask(arg: &str, mask: &Tensor, dims: &[usize], device: &Device) -> Result<()> {
    if mask.dtype() != DType::U8 {
        bail!("{arg}: expected a U8 mask (0 = padding), got {:?}", mask.dtype())
    }
    if mask.dims() != dims {
        bail!("{arg}: expected shape {dims:?}, got {:?}", mask.dims())
    }
    check_device(arg, mask, device)
}

pub(crate) fn check_device(arg: &str, t: &Tensor, device: &Device) -> Result<()> {
    if !t.device().same_device(device) {
        bail!("{arg}: is on {:?} but q is on {:?}", t.device(), device)
    }
    Ok(())
}

pub(crate) fn check_float(arg: &str, t: &Tensor) -> Result<()> {
    match t.dtype() {
        DType::F16 | DType::BF16 | DType::F32 | DType::F64 => Ok(()),
        dt => bail!("{arg}: expected F16, BF16, F32 or F64 embeddings, got {dt:?}"),
    }
}

pub(crate) fn check_rank(arg: &str, t: &Tensor, ranks: &[usize], what: &str) -> Result<()> {
    if !ranks.contains(&t.rank()) {
        bail!("{arg}: expected {what}, got shape {:?}", t.dims())
    }
    Ok(())
}

pub(crate) fn check_dim(q_dim: usize, arg: &str, dim: usize) -> Result<()> {
    if q_dim != dim {
        bail!("{arg}: embedding dim {dim} does not match q's dim {q_dim}")
    }
    Ok(())
}
