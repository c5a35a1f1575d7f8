//! A fast-plaid / ColBERTv2 index on disk, loaded into tensors and searched
//! with exact MaxSim over its compressed documents.
//!
//! The directory layout is the one `fast-plaid` (lightonai/fast-plaid) writes:
//!
//! | file | content |
//! |---|---|
//! | `metadata.json` | `num_chunks`, `nbits` (also `num_documents`, `num_embeddings`, checked when present) |
//! | `centroids.npy` | `[C, dim]` F16 centroids (unit vectors) |
//! | `bucket_weights.npy` | `[2^nbits]` F32 residual value of each bucket |
//! | `bucket_cutoffs.npy`, `avg_residual.npy` | used to compress new tokens; kept when present |
//! | `doclens.{i}.json` | token count of each document of chunk `i` |
//! | `{i}.codes.npy`, `{i}.residuals.npy` | `[T_i]` I64 centroid codes, `[T_i, dim·nbits/8]` U8 packed residuals |
//! | `merged_codes.npy`, `merged_residuals.npy` | fast-plaid ≥ 1.7: all chunks back to back (plus padding rows), replacing the per-chunk files |
//!
//! Residuals use [`BitOrder::ColBert`]. Chunks read from the merged files are
//! located with `merged_{codes,residuals}.manifest.json` when present (rows per
//! chunk), else with the document lengths. `ivf.npy` (the inverted file of the
//! approximate search) is not needed for exact scoring and is not read.

use candle_core::{bail, DType, Device, Error, Result, Tensor};
use candle_maxsim::{l2_normalize, maxsim_residual_varlen, BitOrder, ResidualCodec, TopK};
use std::path::Path;

/// Tokens decompressed per scoring call: bounds the memory of a search.
const CHUNK_TOKENS: usize = 1 << 18;

/// A fast-plaid index in memory: the codec and every document's codes and residuals.
#[derive(Clone, Debug)]
pub struct PlaidIndex {
    /// Centroids (dtype as stored, F16 for fast-plaid), bucket weights, nbits, [`BitOrder::ColBert`].
    pub codec: ResidualCodec,
    /// `[T]` I64 centroid code of every token, documents back to back.
    pub codes: Tensor,
    /// `[T, dim·nbits/8]` U8 packed residuals.
    pub residuals: Tensor,
    /// `[2^nbits − 1]` bucket boundaries, if the index has them (only needed to compress new tokens).
    pub bucket_cutoffs: Option<Tensor>,
    /// `[dim]` mean absolute residual, if the index has it.
    pub avg_residual: Option<Tensor>,
    /// Document `i` is tokens `offsets[i]..offsets[i + 1]`.
    offsets: Vec<u32>,
}

/// Reads an `.npy` file, naming it in errors.
fn npy(path: &Path) -> Result<Tensor> {
    Tensor::read_npy(path).map_err(|e| Error::Msg(format!("dir: cannot read {}: {e}", path.display())))
}

fn optional_npy(path: &Path, device: &Device) -> Result<Option<Tensor>> {
    if path.exists() {
        Ok(Some(npy(path)?.to_device(device)?))
    } else {
        Ok(None)
    }
}

/// A `[0, ..]` tensor on `device` (a zero-size view: CUDA allocates no empty buffer).
fn empty(dims: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    let mut one = dims.to_vec();
    one[0] = 1;
    Tensor::zeros(one, dtype, device)?.narrow(0, 0, 0)
}

fn json(path: &Path) -> Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).map_err(|e| Error::Msg(format!("dir: cannot read {}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| Error::Msg(format!("dir: {} is not valid JSON: {e}", path.display())))
}

fn json_usize(meta: &serde_json::Value, key: &str, path: &Path) -> Result<Option<usize>> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) => Ok(Some(n as usize)),
            None => bail!("dir: {}: `{key}` must be a non-negative integer, got {v}", path.display()),
        },
    }
}

/// One of the two per-token arrays (`codes` or `residuals`), chunk by chunk.
struct Payload<'a> {
    dir: &'a Path,
    suffix: &'static str,
    /// The merged file and the row offset of each chunk in it, read on first use.
    merged: Option<(Tensor, Vec<usize>)>,
}

impl Payload<'_> {
    /// Rows of chunk `i` (`rows` of them, from its doclens): the chunk file if
    /// there is one (fast-plaid writes these first and they win), else the merged file.
    fn chunk(&mut self, i: usize, rows: usize, chunk_rows: &[usize]) -> Result<Tensor> {
        let mut path = self.dir.join(format!("{i}.{}.npy", self.suffix));
        let t = if path.exists() {
            npy(&path)?
        } else {
            let merged = self.dir.join(format!("merged_{}.npy", self.suffix));
            if !merged.exists() {
                bail!("dir: neither {} nor {} exists", path.display(), merged.display())
            }
            if self.merged.is_none() {
                let offsets = self.merged_offsets(chunk_rows)?;
                self.merged = Some((npy(&merged)?, offsets));
            }
            let (all, offsets) = self.merged.as_ref().unwrap();
            if offsets[i] + rows > all.dim(0)? {
                bail!(
                    "dir: {} has {} rows, chunk {i} needs {}..{}",
                    merged.display(),
                    all.dim(0)?,
                    offsets[i],
                    offsets[i] + rows
                )
            }
            let t = all.narrow(0, offsets[i], rows)?;
            path = merged;
            t
        };
        if t.rank() == 0 || t.dim(0)? != rows {
            bail!("dir: {} has shape {:?}, but doclens.{i}.json sums to {rows} tokens", path.display(), t.dims())
        }
        Ok(t)
    }

    /// Row offset of each chunk in the merged file: from the manifest's row
    /// counts when there is one, else from the document lengths.
    fn merged_offsets(&self, chunk_rows: &[usize]) -> Result<Vec<usize>> {
        let path = self.dir.join(format!("merged_{}.manifest.json", self.suffix));
        let manifest = if path.exists() { Some(json(&path)?) } else { None };
        let mut offsets = Vec::with_capacity(chunk_rows.len());
        let mut at = 0;
        for (i, &rows) in chunk_rows.iter().enumerate() {
            offsets.push(at);
            at += match &manifest {
                Some(m) => match m.get(format!("{i}.{}.npy", self.suffix)) {
                    Some(entry) => json_usize(entry, "rows", &path)?.unwrap_or(0),
                    None => 0,
                },
                None => rows,
            };
        }
        Ok(offsets)
    }
}

impl PlaidIndex {
    /// Reads the fast-plaid index directory `dir` (see the [module docs](self))
    /// onto `device`. Every file is validated against the others (shapes, chunk
    /// sizes, code range); a missing or inconsistent file is an `Err` naming it.
    pub fn load(dir: impl AsRef<Path>, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        let meta_path = dir.join("metadata.json");
        let meta = json(&meta_path)?;
        let Some(n_chunks) = json_usize(&meta, "num_chunks", &meta_path)? else {
            bail!("dir: {} has no `num_chunks`", meta_path.display())
        };
        let Some(nbits) = json_usize(&meta, "nbits", &meta_path)? else {
            bail!("dir: {} has no `nbits`", meta_path.display())
        };

        let centroids = npy(&dir.join("centroids.npy"))?;
        if centroids.rank() != 2 || !matches!(centroids.dtype(), DType::F16 | DType::F32 | DType::BF16 | DType::F64) {
            bail!(
                "dir: centroids.npy must be a float [C, dim] matrix, got {:?} {:?}",
                centroids.dtype(),
                centroids.dims()
            )
        }
        let (n_c, dim) = centroids.dims2()?;
        let codec = ResidualCodec {
            centroids: centroids.to_device(device)?,
            bucket_weights: npy(&dir.join("bucket_weights.npy"))?.to_device(device)?,
            nbits,
            bit_order: BitOrder::ColBert,
        };
        codec.check(dim).map_err(|e| Error::Msg(format!("dir: {}: {e}", dir.display())))?;

        let mut lens: Vec<usize> = Vec::new();
        let mut chunk_rows = Vec::with_capacity(n_chunks);
        for i in 0..n_chunks {
            let path = dir.join(format!("doclens.{i}.json"));
            let chunk: Vec<usize> = serde_json::from_value(json(&path)?)
                .map_err(|e| Error::Msg(format!("dir: {} must be a list of document lengths: {e}", path.display())))?;
            chunk_rows.push(chunk.iter().sum());
            lens.extend(chunk);
        }
        let total: usize = chunk_rows.iter().sum();
        if total > u32::MAX as usize {
            bail!("dir: {total} tokens exceed the 32-bit offsets of maxsim_residual_varlen")
        }
        for (key, have) in [("num_documents", lens.len()), ("num_embeddings", total)] {
            if let Some(want) = json_usize(&meta, key, &meta_path)? {
                if want != have {
                    bail!("dir: metadata.json says {key} = {want}, the doclens files hold {have}")
                }
            }
        }

        let width = codec.residual_width(dim);
        let mut codes_p = Payload { dir, suffix: "codes", merged: None };
        let mut res_p = Payload { dir, suffix: "residuals", merged: None };
        let mut codes = Vec::with_capacity(n_chunks);
        let mut residuals = Vec::with_capacity(n_chunks);
        for (i, &rows) in chunk_rows.iter().enumerate() {
            let c = codes_p.chunk(i, rows, &chunk_rows)?;
            if c.rank() != 1 || !matches!(c.dtype(), DType::I64 | DType::I32 | DType::U32) {
                bail!("dir: chunk {i} codes must be integers [T], got {:?} {:?}", c.dtype(), c.dims())
            }
            let r = res_p.chunk(i, rows, &chunk_rows)?;
            if r.dtype() != DType::U8 || r.dims() != [rows, width] {
                bail!(
                    "dir: chunk {i} residuals must be U8 [{rows}, {width}] (dim·nbits/8), got {:?} {:?}",
                    r.dtype(),
                    r.dims()
                )
            }
            let c = c.to_dtype(DType::I64)?;
            if rows > 0 {
                let (lo, hi) = (c.min(0)?.to_scalar::<i64>()?, c.max(0)?.to_scalar::<i64>()?);
                if lo < 0 || hi >= n_c as i64 {
                    bail!("dir: chunk {i} codes range over [{lo}, {hi}], out of range for {n_c} centroids")
                }
            }
            codes.push(c);
            residuals.push(r);
        }
        let (codes, residuals) = if total == 0 {
            (empty(&[0], DType::I64, device)?, empty(&[0, width], DType::U8, device)?)
        } else {
            (Tensor::cat(&codes, 0)?.to_device(device)?, Tensor::cat(&residuals, 0)?.to_device(device)?)
        };
        let mut offsets = Vec::with_capacity(lens.len() + 1);
        offsets.push(0u32);
        for l in &lens {
            offsets.push(offsets.last().unwrap() + *l as u32);
        }
        Ok(PlaidIndex {
            codec,
            codes,
            residuals,
            bucket_cutoffs: optional_npy(&dir.join("bucket_cutoffs.npy"), device)?,
            avg_residual: optional_npy(&dir.join("avg_residual.npy"), device)?,
            offsets,
        })
    }

    /// Number of documents.
    pub fn num_documents(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The device the index was loaded on.
    pub fn device(&self) -> &Device {
        self.codes.device()
    }

    /// Embedding dimension.
    pub fn dim(&self) -> usize {
        self.codec.centroids.dims()[1]
    }

    /// Token count of each document.
    pub fn doc_lens(&self) -> Vec<u32> {
        self.offsets.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// The decompressed, L2-normalized tokens of document `doc`, `[len, dim]`
    /// F32: what fast-plaid's `get_embeddings` returns.
    pub fn embeddings(&self, doc: usize) -> Result<Tensor> {
        if doc >= self.num_documents() {
            bail!("doc: {doc} is out of range for {} documents", self.num_documents())
        }
        let (a, b) = (self.offsets[doc] as usize, self.offsets[doc + 1] as usize);
        let d = self.codec.decompress(&self.codes.narrow(0, a, b - a)?, &self.residuals.narrow(0, a, b - a)?)?;
        l2_normalize(&d)
    }

    /// Exact top-`k` documents for each query `q [Nq, Lq, dim]`, best first:
    /// `(scores [Nq, k'] F32, document ids [Nq, k'] U32)` with k' = min(k, number of
    /// candidates). Candidates are all documents, or the ids in `subset`
    /// (duplicates ignored). Scores are [`maxsim_residual_varlen`] with
    /// `normalize: true`: documents are decompressed and L2-normalized as fast-plaid
    /// does, and so are the query tokens (ColBERT query embeddings already are
    /// unit vectors). Equal scores keep the lower document id first. Documents are
    /// scored a bounded number of tokens at a time.
    pub fn search(&self, q: &Tensor, k: usize, subset: Option<&[u32]>) -> Result<(Tensor, Tensor)> {
        if k == 0 {
            bail!("k: must be at least 1")
        }
        if q.rank() != 3 || q.dim(2)? != self.dim() || !q.dtype().is_float() {
            bail!("q: expected float [Nq, Lq, {}] queries, got {:?} {:?}", self.dim(), q.dtype(), q.dims())
        }
        if !q.device().same_device(self.codes.device()) {
            bail!("q: is on {:?} but the index is on {:?}", q.device(), self.codes.device())
        }
        let n = self.num_documents();
        let ids: Vec<u32> = match subset {
            None => (0..n as u32).collect(),
            Some(s) => {
                if let Some((i, &d)) = s.iter().enumerate().find(|(_, &d)| d as usize >= n) {
                    bail!("subset: subset[{i}] = {d} is out of range for {n} documents")
                }
                let mut s = s.to_vec();
                s.sort_unstable();
                s.dedup();
                s
            }
        };
        let mut top = TopK::new(q.dim(0)?, k.min(ids.len()));
        let mut start = 0;
        while start < ids.len() {
            // Whole documents up to CHUNK_TOKENS tokens (at least one document).
            let mut end = start + 1;
            let mut tokens = self.len(ids[start]);
            while end < ids.len() && tokens + self.len(ids[end]) <= CHUNK_TOKENS {
                tokens += self.len(ids[end]);
                end += 1;
            }
            let chunk = &ids[start..end];
            let scores = self.score_docs(q, chunk)?;
            top.push(&scores, |j| chunk[j])?;
            start = end;
        }
        top.finish(q.device())
    }

    fn len(&self, doc: u32) -> usize {
        (self.offsets[doc as usize + 1] - self.offsets[doc as usize]) as usize
    }

    /// Exact scores `[Nq, docs.len()]` of the documents `docs`.
    fn score_docs(&self, q: &Tensor, docs: &[u32]) -> Result<Tensor> {
        let mut cu = Vec::with_capacity(docs.len() + 1);
        cu.push(0u32);
        let mut max_len = 0;
        for &d in docs {
            max_len = max_len.max(self.len(d));
            cu.push(cu.last().unwrap() + self.len(d) as u32);
        }
        let consecutive = docs.windows(2).all(|w| w[1] == w[0] + 1);
        let (codes, residuals) = match docs.first() {
            // A run of consecutive documents is a view; anything else is gathered.
            Some(&first) if consecutive => {
                let a = self.offsets[first as usize] as usize;
                let t = *cu.last().unwrap() as usize;
                (self.codes.narrow(0, a, t)?, self.residuals.narrow(0, a, t)?)
            }
            _ => {
                let rows: Vec<u32> =
                    docs.iter().flat_map(|&d| self.offsets[d as usize]..self.offsets[d as usize + 1]).collect();
                let n_rows = rows.len();
                let rows = Tensor::from_vec(rows, n_rows, self.codes.device())?;
                (self.codes.index_select(&rows, 0)?, self.residuals.index_select(&rows, 0)?)
            }
        };
        let cu = Tensor::from_vec(cu, docs.len() + 1, self.codes.device())?;
        maxsim_residual_varlen(q, &codes, &residuals, &cu, max_len, &self.codec, true)
    }
}
