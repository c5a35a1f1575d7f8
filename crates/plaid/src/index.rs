//! A PLAID index opened on a device: the codec, every token's code and
//! residual bytes (memory-mapped from the index directory and copied to the
//! device once), the document offsets, the inverted file, and the deleted
//! documents.

use crate::npy::{self, MappedNpy};
use crate::store::{json_usize, read_json};
use candle_core::{bail, DType, Device, Error, Result, Tensor};
use candle_maxsim::{
    l2_normalize,
    residual::{maxsim_residual_varlen, BitOrder, DocOffsets, ResidualCodec},
    TopK,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Tokens decompressed per scoring call of the exhaustive search: bounds its memory.
const CHUNK_TOKENS: usize = 1 << 18;

/// The file of deleted document ids (this crate's; fast-plaid does not read it).
pub(crate) const DELETED: &str = "deleted.json";
/// The stem of the inverted file of documents added since the last
/// compaction (this crate's: `delta_ivf.npy`, `delta_ivf_lengths.npy`).
pub(crate) const DELTA_IVF: &str = "delta_ivf";

/// A fast-plaid / ColBERTv2 index in device memory.
#[derive(Clone, Debug)]
pub struct PlaidIndex {
    pub(crate) dir: PathBuf,
    /// Centroids (dtype as stored: F16 for fast-plaid), bucket weights, nbits, [`BitOrder::ColBert`].
    pub codec: ResidualCodec,
    /// `[T]` U32 centroid code of every token, documents back to back.
    pub codes: Tensor,
    /// `[T, dim·nbits/8]` U8 packed residuals: on the index's device, or
    /// in host memory for an index opened with a device budget it exceeds
    /// ([`PlaidIndex::load_with_device_budget`]).
    pub residuals: Tensor,
    /// `[2^nbits − 1]` bucket boundaries, if the index has them (needed to compress new documents).
    pub bucket_cutoffs: Option<Tensor>,
    /// `[dim]` mean absolute residual, if the index has it.
    pub avg_residual: Option<Tensor>,
    /// Document `i` is tokens `offsets[i]..offsets[i + 1]`.
    pub(crate) offsets: Arc<Vec<u32>>,
    /// `[Nd + 1]` U32, the offsets on the device.
    pub(crate) cu: Tensor,
    /// `offsets` and `cu` as the exact scoring takes them, checked once.
    pub(crate) doc_offsets: DocOffsets,
    pub(crate) max_len: usize,
    /// The inverted file: `[E]` U32 document ids and `[C + 1]` U32 offsets
    /// of each centroid's list; `None` for an index without one (fast-plaid's `compress_only`).
    pub(crate) ivf: Option<(Tensor, Tensor)>,
    /// The inverted lists of the documents added since the last compaction
    /// (`delta_ivf.npy`, this crate's), in the same form; searched with `ivf`.
    pub(crate) delta_ivf: Option<(Tensor, Tensor)>,
    /// Deleted document ids, ascending.
    pub(crate) deleted: Vec<u32>,
    /// `[1, ⌈Nd/32⌉]` U32 bitmap of the live documents, when some are deleted.
    pub(crate) live: Option<Tensor>,
    /// Whether `residuals` are kept in host memory (the device budget):
    /// each search then copies only its candidates' rows to the device.
    pub(crate) host_residuals: bool,
    /// The tensors `codes`, `residuals` and `cu` are the first rows of, with
    /// spare rows for the next adds ([`Room`] at load, then [`append_rows`]).
    pub(crate) stores: Stores,
    /// Device tensors of the last few search shapes, reused by the next
    /// search of one of them (shared by clones: they are never written).
    pub(crate) search_consts: Arc<std::sync::Mutex<Vec<crate::search::SearchConsts>>>,
}

/// The buffers of `codes`, `residuals` and `cu` with their spare rows. A
/// clone of an index gets none (its first add copies into buffers of its
/// own): an add writes into the spare rows in place, and two indexes must
/// never write into the same ones.
#[derive(Debug, Default)]
pub(crate) struct Stores(pub(crate) Option<(Tensor, Tensor, Tensor)>);

impl Clone for Stores {
    fn clone(&self) -> Self {
        Stores(None)
    }
}

/// One of the two per-token arrays (`codes` or `residuals`), chunk by chunk.
struct Payload<'a> {
    dir: &'a Path,
    suffix: &'static str,
    /// The merged file and the row offset of each chunk in it, read on first use.
    merged: Option<(MappedNpy, Vec<usize>)>,
}

impl Payload<'_> {
    /// Rows of chunk `i` (`rows` of them, from its doclens) on `device`: the
    /// chunk file if there is one (fast-plaid writes these first and they
    /// win), else the merged file.
    fn chunk(&mut self, i: usize, rows: usize, chunk_rows: &[usize], device: &Device) -> Result<(Tensor, PathBuf)> {
        let path = self.dir.join(format!("{i}.{}.npy", self.suffix));
        if path.exists() {
            return chunk_file(path, i, rows, device);
        }
        let merged = self.dir.join(format!("merged_{}.npy", self.suffix));
        if !merged.exists() {
            bail!("dir: neither {} nor {} exists", path.display(), merged.display())
        }
        if self.merged.is_none() {
            let offsets = self.merged_offsets(chunk_rows)?;
            self.merged = Some((MappedNpy::open(&merged)?, offsets));
        }
        let (all, offsets) = self.merged.as_ref().unwrap();
        let have = all.shape.first().copied().unwrap_or(0);
        if offsets[i] + rows > have {
            bail!("dir: {} has {have} rows, chunk {i} needs {}..{}", merged.display(), offsets[i], offsets[i] + rows)
        }
        Ok((all.rows(offsets[i], offsets[i] + rows, device)?, merged))
    }

    /// Row offset of each chunk in the merged file: from the manifest's row
    /// counts when there is one, else from the document lengths.
    fn merged_offsets(&self, chunk_rows: &[usize]) -> Result<Vec<usize>> {
        let path = self.dir.join(format!("merged_{}.manifest.json", self.suffix));
        let manifest = if path.exists() { Some(read_json(&path)?) } else { None };
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

/// The rows of chunk `i`'s own file `path` (`{i}.codes.npy` or
/// `{i}.residuals.npy`), checked to hold its `rows` tokens.
fn chunk_file(path: PathBuf, i: usize, rows: usize, device: &Device) -> Result<(Tensor, PathBuf)> {
    let f = MappedNpy::open(&path)?;
    if f.shape.first() != Some(&rows) {
        bail!("dir: {} has shape {:?}, but doclens.{i}.json sums to {rows} tokens", path.display(), f.shape)
    }
    Ok((f.tensor(device)?, path))
}

/// Chunk `i`'s codes and residuals (each with the file it came from)
/// checked against its `rows` tokens, `n_c` centroids and the residual
/// `width`: the codes as U32.
fn checked_chunk(
    i: usize,
    rows: usize,
    (c, cpath): (Tensor, PathBuf),
    (r, rpath): (Tensor, PathBuf),
    n_c: usize,
    width: usize,
) -> Result<(Tensor, Tensor)> {
    if c.dims() != [rows] || !matches!(c.dtype(), DType::I64 | DType::I32 | DType::U32) {
        bail!(
            "dir: {} (chunk {i}) must hold integer codes [{rows}] (its documents' tokens), got {:?} {:?}",
            cpath.display(),
            c.dtype(),
            c.dims()
        )
    }
    if rows > 0 {
        let (lo, hi) = int_range(&c)?;
        if lo < 0 || hi >= n_c as i64 {
            bail!(
                "dir: {} (chunk {i}) codes range over [{lo}, {hi}], out of range for {n_c} centroids",
                cpath.display()
            )
        }
    }
    if r.dtype() != DType::U8 || r.dims() != [rows, width] {
        bail!(
            "dir: {} (chunk {i}) must hold U8 [{rows}, {width}] residuals (dim·nbits/8), got {:?} {:?}",
            rpath.display(),
            r.dtype(),
            r.dims()
        )
    }
    Ok((c.to_dtype(DType::U32)?, r))
}

/// The document lengths of chunk `i` (`doclens.{i}.json`).
pub(crate) fn chunk_lens(dir: &Path, i: usize) -> Result<Vec<usize>> {
    let path = dir.join(format!("doclens.{i}.json"));
    serde_json::from_value(read_json(&path)?)
        .map_err(|e| Error::Msg(format!("dir: {} must be a list of document lengths: {e}", path.display())))
}

/// The largest and smallest value of an integer tensor, on its device.
/// Bytes an index of `tokens` tokens in `docs` documents takes on a device
/// besides its residuals, and its residuals: `(rest, residuals)`, as
/// [`PlaidIndex::device_bytes`] counts them (codes as U32, each inverted
/// file's ids and offsets, document offsets, centroids of `centroid_bytes`
/// each).
fn footprint(
    dir: &Path,
    tokens: usize,
    docs: usize,
    n_c: usize,
    centroid_bytes: usize,
    width: usize,
) -> Result<(usize, usize)> {
    let lists = |stem: &str| -> Result<usize> {
        let p = dir.join(format!("{stem}.npy"));
        Ok(if p.exists() { (MappedNpy::open(&p)?.shape.first().copied().unwrap_or(0) + n_c + 1) * 4 } else { 0 })
    };
    let rest = tokens * 4 + lists("ivf")? + lists(DELTA_IVF)? + (docs + 1) * 4 + n_c * centroid_bytes;
    Ok((rest, tokens * width))
}

/// The spare rows an index is opened with, so that adds append in place:
/// without them the first add copies the whole index into a larger buffer
/// (a device-side rewrite of what is already there, needing the index twice
/// in device memory at once; about 6 ms per GB of index on an H200).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Room {
    tokens: usize,
    documents: usize,
}

impl Room {
    /// 1/64 of the index's tokens and documents (1.6 % more memory: 16 M
    /// tokens of adds at a billion) and at least 65 536 tokens and 1 024
    /// documents, so that small indexes grow in place too.
    fn default_for(tokens: usize, documents: usize) -> Room {
        Room { tokens: tokens / 64 + (1 << 16), documents: documents / 64 + 1024 }
    }

    /// The same room, scaled down to fit `bytes` at `per_token` bytes a
    /// token and 4 a document.
    fn within(self, bytes: usize, per_token: usize) -> Room {
        let want = self.tokens * per_token + self.documents * 4;
        if want <= bytes {
            return self;
        }
        let f = bytes as f64 / want as f64;
        Room { tokens: (self.tokens as f64 * f) as usize, documents: (self.documents as f64 * f) as usize }
    }
}

/// Inverted-file entries read to a GPU at a time (128 MB of I64 ids).
const IVF_PIECE: usize = 1 << 24;

fn int_range(t: &Tensor) -> Result<(i64, i64)> {
    let t = t.to_dtype(DType::I64)?;
    Ok((t.min(0)?.to_scalar::<i64>()?, t.max(0)?.to_scalar::<i64>()?))
}

impl PlaidIndex {
    /// Opens the index directory `dir` on `device`. The layout is
    /// fast-plaid's, per-chunk (`{i}.codes.npy`, `{i}.residuals.npy`) or
    /// merged (`merged_*.npy`, fast-plaid ≥ 1.7); the large arrays are
    /// memory-mapped and copied to the device without a copy in RAM first
    /// (on the CPU the tensors themselves are the one copy). Every file is
    /// validated against the others (shapes, chunk sizes, code and id
    /// ranges); a missing, truncated or inconsistent file is an `Err` naming it.
    /// An update cut short by a killed process is finished or dropped first
    /// (the index opens as it was before the update or as after, never in
    /// between), and what that process left beside the index is removed.
    /// The index is opened with room for adds after its rows (1/64 of its
    /// tokens and documents, at least 65 536 tokens; [`Self::spare_tokens`]),
    /// so that adds append in place instead of copying the index; on a
    /// device that holds the index but not that room, without it.
    pub fn load(dir: impl AsRef<Path>, device: &Device) -> Result<Self> {
        Self::load_budgeted(dir.as_ref(), device, None)
    }

    /// [`Self::load`] within `device_bytes` of device memory for the index
    /// itself (codes, residuals, inverted file, centroids, offsets; a
    /// search's working memory comes on top): where the whole index does not
    /// fit, its residuals (`dim·nbits/8` bytes per token, most of an index)
    /// stay in host memory and each search copies to the device only the
    /// rows of the documents it scores exactly. Search results are the same
    /// as with the whole index on the device. `Err` naming `device_bytes`
    /// when even the rest does not fit. The room for adds kept by
    /// [`Self::load`] is kept here as far as the budget leaves room for it.
    pub fn load_with_device_budget(dir: impl AsRef<Path>, device: &Device, device_bytes: usize) -> Result<Self> {
        Self::load_budgeted(dir.as_ref(), device, Some(device_bytes))
    }

    fn load_budgeted(dir: &Path, device: &Device, budget: Option<usize>) -> Result<Self> {
        crate::store::recover(dir)?;
        let meta_path = dir.join("metadata.json");
        let meta = read_json(&meta_path)?;
        let Some(n_chunks) = json_usize(&meta, "num_chunks", &meta_path)? else {
            bail!("dir: {} has no `num_chunks`", meta_path.display())
        };
        let Some(nbits) = json_usize(&meta, "nbits", &meta_path)? else {
            bail!("dir: {} has no `nbits`", meta_path.display())
        };
        let cpath = dir.join("centroids.npy");
        let cf = MappedNpy::open(&cpath)?;
        npy::expect(&cpath, &cf, &[DType::F16, DType::F32, DType::F64], 2)?;
        let (n_c, dim) = (cf.shape[0], cf.shape[1]);
        let codec = ResidualCodec {
            centroids: cf.tensor(device)?,
            bucket_weights: npy::read(&dir.join("bucket_weights.npy"), device)?,
            nbits,
            bit_order: BitOrder::ColBert,
        };
        codec.check(dim).map_err(|e| Error::Msg(format!("dir: {}: {e}", dir.display())))?;

        let mut lens: Vec<usize> = Vec::new();
        let mut chunk_rows = Vec::with_capacity(n_chunks);
        for i in 0..n_chunks {
            let chunk = chunk_lens(dir, i)?;
            chunk_rows.push(chunk.iter().sum());
            lens.extend(chunk);
        }
        let total: usize = chunk_rows.iter().sum();
        if total >= u32::MAX as usize || lens.len() >= u32::MAX as usize / 2 {
            bail!("dir: {total} tokens exceed the 32-bit offsets of the residual kernels")
        }
        for (key, have) in [("num_documents", lens.len()), ("num_embeddings", total)] {
            if let Some(want) = json_usize(&meta, key, &meta_path)? {
                if want != have {
                    bail!("dir: metadata.json says {key} = {want}, the doclens files hold {have}")
                }
            }
        }

        let width = codec.residual_width(dim);
        // What the index takes on the device, and whether its residuals must stay on the host.
        let (rest, _) = footprint(dir, total, lens.len(), n_c, dim * cf.dtype.size_in_bytes(), width)?;
        let host_residuals = match budget {
            Some(b) if rest > b => bail!(
                "device_bytes: the index needs {rest} bytes on the device besides its residuals (codes, \
                 inverted file, centroids, offsets), {b} given"
            ),
            Some(b) => rest + total * width > b,
            None => false,
        };
        let rdev = if host_residuals { &Device::Cpu } else { device };
        // Room for adds after the index's own rows, within the budget.
        let per_token = 4 + if host_residuals { 0 } else { width };
        let mut room = match budget {
            None => Room::default_for(total, lens.len()),
            Some(b) => Room::default_for(total, lens.len())
                .within(b.saturating_sub(rest + if host_residuals { 0 } else { total * width }), per_token),
        };
        let mut codes_p = Payload { dir, suffix: "codes", merged: None };
        let mut res_p = Payload { dir, suffix: "residuals", merged: None };
        // Each chunk copied into its place in the whole tensors as it is read:
        // the index plus one chunk on the device at the peak (reading every
        // chunk, then concatenating, took twice the index).
        // (At least one row: CUDA allocates no empty buffer.)
        let stores = |rows: usize| -> Result<(Tensor, Tensor)> {
            let rows = rows.max(1);
            Ok((Tensor::zeros(rows, DType::U32, device)?, Tensor::zeros((rows, width), DType::U8, rdev)?))
        };
        let (code_store, res_store) = match stores(total + room.tokens) {
            Ok(s) => s,
            // A device that holds the index but not its room opens it without
            // (a first add then grows the buffers).
            Err(_) if room.tokens > 0 => {
                room = Room { tokens: 0, documents: 0 };
                stores(total)?
            }
            Err(e) => return Err(e),
        };
        let (codes, residuals) = (code_store.narrow(0, 0, total)?, res_store.narrow(0, 0, total)?);
        let mut at = 0;
        for (i, &rows) in chunk_rows.iter().enumerate() {
            let c = codes_p.chunk(i, rows, &chunk_rows, device)?;
            let r = res_p.chunk(i, rows, &chunk_rows, rdev)?;
            let (c, r) = checked_chunk(i, rows, c, r, n_c, width)?;
            write_rows(&codes, at, &[c])?;
            at = write_rows(&residuals, at, &[r])?;
        }
        let mut offsets = Vec::with_capacity(lens.len() + 1);
        offsets.push(0u32);
        for l in &lens {
            offsets.push(offsets.last().unwrap() + *l as u32);
        }
        let cu_store = Tensor::zeros(offsets.len() + room.documents, DType::U32, device)?;
        let cu = cu_store.narrow(0, 0, offsets.len())?;
        write_rows(&cu_store, 0, &[Tensor::new(offsets.as_slice(), device)?])?;
        let offsets = Arc::new(offsets);
        let n_docs = lens.len();
        let ivf = Self::load_ivf(dir, "ivf", n_c, n_docs, device)?;
        let delta_ivf = Self::load_ivf(dir, DELTA_IVF, n_c, n_docs, device)?;
        let deleted = Self::load_deleted(dir, n_docs)?;
        let optional = |name: &str| -> Result<Option<Tensor>> {
            let p = dir.join(name);
            if p.exists() {
                Ok(Some(npy::read(&p, device)?))
            } else {
                Ok(None)
            }
        };
        let mut index = PlaidIndex {
            dir: dir.to_path_buf(),
            codec,
            codes,
            residuals,
            bucket_cutoffs: optional("bucket_cutoffs.npy")?,
            avg_residual: optional("avg_residual.npy")?,
            doc_offsets: checked_offsets(&offsets, &cu, lens.iter().copied().max().unwrap_or(0))?,
            cu,
            max_len: lens.iter().copied().max().unwrap_or(0),
            offsets,
            ivf,
            delta_ivf,
            deleted: Vec::new(),
            live: None,
            host_residuals,
            stores: Stores(Some((code_store, res_store, cu_store))),
            search_consts: Arc::default(),
        };
        index.set_deleted(deleted)?;
        Ok(index)
    }

    /// `STEM.npy` and `STEM_lengths.npy` (the inverted file `ivf`, or the
    /// delta one) as U32 ids and offsets, checked; `None` without them.
    pub(crate) fn load_ivf(
        dir: &Path,
        stem: &str,
        n_c: usize,
        n_docs: usize,
        device: &Device,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let (ip, lp) = (dir.join(format!("{stem}.npy")), dir.join(format!("{stem}_lengths.npy")));
        if !ip.exists() && !lp.exists() {
            return Ok(None);
        }
        let (ivf, lens) = (MappedNpy::open(&ip)?, MappedNpy::open(&lp)?);
        npy::expect(&ip, &ivf, &[DType::I64, DType::I32, DType::U32], 1)?;
        npy::expect(&lp, &lens, &[DType::I64, DType::I32, DType::U32], 1)?;
        let lengths: Vec<i64> = lens.tensor(&Device::Cpu)?.to_dtype(DType::I64)?.to_vec1()?;
        // fast-plaid may write more lengths than centroids (trailing zeros).
        if lengths.len() < n_c || lengths[n_c..].iter().any(|&l| l != 0) || lengths.iter().any(|&l| l < 0) {
            bail!(
                "dir: {} must hold {n_c} non-negative list lengths (then only zeros), got {}",
                lp.display(),
                lengths.len()
            )
        }
        let mut off = Vec::with_capacity(n_c + 1);
        off.push(0u64);
        for &l in &lengths[..n_c] {
            off.push(off.last().unwrap() + l as u64);
        }
        let e = ivf.shape[0];
        if *off.last().unwrap() != e as u64 || e >= u32::MAX as usize {
            bail!("dir: {} has {e} entries, {} says {}", ip.display(), lp.display(), off.last().unwrap())
        }
        // On a GPU in pieces through one host buffer (see `row_pieces`): at a
        // billion tokens the file is gigabytes.
        let pieces = match device.is_cpu() || e == 0 {
            true => vec![ivf.tensor(device)?],
            false => ivf.row_pieces(0, e, IVF_PIECE, device)?,
        };
        let mut ids = Vec::with_capacity(pieces.len());
        for p in pieces {
            if p.dim(0)? > 0 {
                let (lo, hi) = int_range(&p)?;
                if lo < 0 || hi >= n_docs as i64 {
                    bail!(
                        "dir: {} holds document ids in [{lo}, {hi}], out of range for {n_docs} documents",
                        ip.display()
                    )
                }
            }
            ids.push(p.to_dtype(DType::U32)?);
        }
        let ids = match ids.len() {
            1 => ids.pop().expect("one piece"),
            _ => Tensor::cat(&ids, 0)?,
        };
        let off: Vec<u32> = off.into_iter().map(|o| o as u32).collect();
        Ok(Some((ids, Tensor::new(off.as_slice(), device)?)))
    }

    fn load_deleted(dir: &Path, n_docs: usize) -> Result<Vec<u32>> {
        let path = dir.join(DELETED);
        if !path.exists() {
            return Ok(Vec::new());
        }
        let v = read_json(&path)?;
        let ids: Vec<u32> = serde_json::from_value(v["deleted"].clone()).map_err(|e| {
            Error::Msg(format!("dir: {}: `deleted` must be a list of document ids: {e}", path.display()))
        })?;
        if let Some(&d) = ids.iter().find(|&&d| d as usize >= n_docs) {
            bail!("dir: {}: deleted id {d} is out of range for {n_docs} documents", path.display())
        }
        Ok(ids)
    }

    /// Extends the index in memory with chunks `from..to`, just written by
    /// an update as per-chunk files (read back and checked as [`Self::load`]
    /// does), and the update's inverted lists `(ids, offsets)` (the delta
    /// ones when `delta`, else the whole inverted file): nothing loaded
    /// before is read again. The new codes and residuals go into the spare
    /// rows kept after the current ones, or, when those do not suffice,
    /// everything into new tensors with room to spare ([`append_rows`]; old
    /// and new side by side for a moment: where the device cannot hold the
    /// residuals twice, see [`Self::grow_residuals`]).
    pub(crate) fn append_chunks(
        &mut self,
        from: usize,
        to: usize,
        (ids, offsets): (Vec<u32>, Vec<u32>),
        delta: bool,
    ) -> Result<()> {
        let device = self.device().clone();
        let (n_c, width) = (self.num_centroids(), self.residuals.dim(1)?);
        let (mut codes, mut residuals) = (Vec::new(), Vec::new());
        // The new documents' end offsets (the index's own are copied nowhere).
        let (mut offs, mut last) = (Vec::new(), *self.offsets.last().expect("offsets start with 0"));
        let mut max_len = self.max_len;
        for i in from..to {
            let lens = chunk_lens(&self.dir, i)?;
            let rows = lens.iter().sum();
            let read =
                |suffix: &str, dev: &Device| chunk_file(self.dir.join(format!("{i}.{suffix}.npy")), i, rows, dev);
            let rdev = if self.host_residuals { &Device::Cpu } else { &device };
            let (c, r) = checked_chunk(i, rows, read("codes", &device)?, read("residuals", rdev)?, n_c, width)?;
            codes.push(c);
            residuals.push(r);
            for l in lens {
                last += l as u32;
                offs.push(last);
                max_len = max_len.max(l);
            }
        }
        let e = ids.len();
        let ivf = (Tensor::from_vec(ids, e, &device)?, Tensor::new(offsets.as_slice(), &device)?);
        let (codes, code_store) = append_rows(&self.codes, self.stores.0.as_ref().map(|s| &s.0), &codes)?;
        let new_cu = [Tensor::new(offs.as_slice(), &device)?];
        let (cu, cu_store) = append_rows(&self.cu, self.stores.0.as_ref().map(|s| &s.2), &new_cu)?;
        let residual_store = self.grow_residuals(&residuals)?;
        self.stores = Stores(residual_store.map(|r| (code_store, r, cu_store)));
        self.codes = codes;
        let mut offsets = Vec::with_capacity(self.offsets.len() + offs.len());
        offsets.extend_from_slice(&self.offsets);
        offsets.extend(offs);
        self.offsets = Arc::new(offsets);
        self.doc_offsets = checked_offsets(&self.offsets, &cu, max_len)?;
        self.cu = cu;
        self.max_len = max_len;
        if delta {
            self.delta_ivf = Some(ivf);
        } else {
            self.ivf = Some(ivf);
        }
        self.set_deleted(self.deleted.clone())
    }

    /// Records `deleted` (any order, repeats allowed) and builds the live-document mask.
    pub(crate) fn set_deleted(&mut self, mut deleted: Vec<u32>) -> Result<()> {
        deleted.sort_unstable();
        deleted.dedup();
        self.live = if deleted.is_empty() {
            None
        } else {
            let n = self.num_documents();
            let mut bits: Vec<u32> =
                (0..n.div_ceil(32)).map(|w| if (w + 1) * 32 <= n { !0 } else { (1u32 << (n % 32)) - 1 }).collect();
            for &d in &deleted {
                bits[d as usize / 32] &= !(1 << (d % 32));
            }
            let w = bits.len();
            Some(Tensor::from_vec(bits, (1, w), self.device())?)
        };
        self.deleted = deleted;
        Ok(())
    }

    /// The index directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of documents (deleted ones included: ids are stable).
    pub fn num_documents(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The deleted document ids, ascending.
    pub fn deleted(&self) -> &[u32] {
        &self.deleted
    }

    /// The device the index was loaded on.
    pub fn device(&self) -> &Device {
        self.codes.device()
    }

    /// Bytes the index holds on its device: codes, residuals (unless kept in
    /// host memory), inverted lists, document offsets and centroids, with
    /// the room kept for adds (what [`Self::load_with_device_budget`]
    /// compares with its budget).
    pub fn device_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let lists = |l: &Option<(Tensor, Tensor)>| l.as_ref().map_or(0, |(a, b)| bytes(a) + bytes(b));
        let (codes, residuals, cu) =
            self.stores.0.as_ref().map_or((&self.codes, &self.residuals, &self.cu), |(c, r, cu)| (c, r, cu));
        bytes(codes)
            + if self.host_residuals { 0 } else { bytes(residuals) }
            + lists(&self.ivf)
            + lists(&self.delta_ivf)
            + bytes(cu)
            + bytes(&self.codec.centroids)
    }

    /// The device memory the index in `dir` would take, read from its
    /// files' headers and document lengths without loading it: `(whole,
    /// residuals)` bytes, as [`Self::device_bytes`] counts them without the
    /// room for adds ([`Self::load`] takes that on top; a budget of `whole`
    /// leaves none). A budget of at least `whole - residuals` opens it with
    /// [`Self::load_with_device_budget`].
    pub fn device_bytes_needed(dir: impl AsRef<Path>) -> Result<(usize, usize)> {
        let dir = dir.as_ref();
        let meta_path = dir.join("metadata.json");
        let meta = read_json(&meta_path)?;
        let (Some(n_chunks), Some(nbits)) =
            (json_usize(&meta, "num_chunks", &meta_path)?, json_usize(&meta, "nbits", &meta_path)?)
        else {
            bail!("dir: {} needs `num_chunks` and `nbits`", meta_path.display())
        };
        let cf = MappedNpy::open(&dir.join("centroids.npy"))?;
        let (&n_c, &dim) = match cf.shape.as_slice() {
            [c, d] => (c, d),
            s => bail!("dir: {} must be [C, dim], got {s:?}", cf.path.display()),
        };
        let (mut tokens, mut docs) = (0, 0);
        for i in 0..n_chunks {
            let l = chunk_lens(dir, i)?;
            (tokens, docs) = (tokens + l.iter().sum::<usize>(), docs + l.len());
        }
        let (rest, res) = footprint(dir, tokens, docs, n_c, dim * cf.dtype.size_in_bytes(), dim * nbits / 8)?;
        Ok((rest + res, res))
    }

    /// Tokens that can be added before an add must grow the index's buffers
    /// (copying what is there into larger ones).
    pub fn spare_tokens(&self) -> usize {
        let cap = self.stores.0.as_ref().map_or(0, |s| s.0.dims()[0]);
        cap.saturating_sub(self.codes.dims()[0])
    }

    /// Whether the residuals are kept in host memory (an index opened with a
    /// device budget it exceeds).
    pub fn residuals_on_host(&self) -> bool {
        self.host_residuals
    }

    /// Embedding dimension.
    pub fn dim(&self) -> usize {
        self.codec.centroids.dims()[1]
    }

    /// Number of centroids.
    pub fn num_centroids(&self) -> usize {
        self.codec.centroids.dims()[0]
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
        let (codes, r, _, _) = self.gather_docs(&[doc as u32])?;
        let d = self.codec.decompress(&codes, &r)?;
        l2_normalize(&d)
    }

    /// Exhaustive exact search: the top-`k` documents for each query
    /// `q [Nq, Lq, dim]`, best first: `(scores [Nq, k'] F32, document ids
    /// [Nq, k'] U32)` with k' = min(k, number of candidates). Candidates are
    /// all live documents, or the ids in `subset` (duplicates ignored).
    /// Scores are [`maxsim_residual_varlen`] with `normalize: true`:
    /// documents are decompressed and L2-normalized as fast-plaid does, and
    /// so are the query tokens (ColBERT query embeddings already are unit
    /// vectors). Equal scores keep the lower document id first. Documents are
    /// scored a bounded number of tokens at a time. A query with a NaN or an
    /// infinite entry is an `Err` naming `q`.
    pub fn search_exact(&self, q: &Tensor, k: usize, subset: Option<&[u32]>) -> Result<(Tensor, Tensor)> {
        if k == 0 {
            bail!("k: must be at least 1")
        }
        self.check_queries(q)?;
        query_rows(q)?;
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
        let ids: Vec<u32> = ids.into_iter().filter(|d| self.deleted.binary_search(d).is_err()).collect();
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

    /// `Err` unless `q` is float `[Nq, Lq, dim]` on the index's device.
    pub(crate) fn check_queries(&self, q: &Tensor) -> Result<()> {
        if q.rank() != 3 || q.dim(2)? != self.dim() || !q.dtype().is_float() {
            bail!("q: expected float [Nq, Lq, {}] queries, got {:?} {:?}", self.dim(), q.dtype(), q.dims())
        }
        if !q.device().same_device(self.device()) {
            bail!("q: is on {:?} but the index is on {:?}", q.device(), self.device())
        }
        Ok(())
    }

    /// Every token's code on the host (for subset searches and rebuilding
    /// the inverted file), read from the device.
    pub(crate) fn host_codes(&self) -> Result<Vec<u32>> {
        self.codes.to_device(&Device::Cpu)?.to_vec1()
    }

    pub(crate) fn len(&self, doc: u32) -> usize {
        (self.offsets[doc as usize + 1] - self.offsets[doc as usize]) as usize
    }

    /// Exact scores `[Nq, docs.len()]` of the documents `docs`.
    fn score_docs(&self, q: &Tensor, docs: &[u32]) -> Result<Tensor> {
        let (codes, residuals, cu, max_len) = self.gather_docs(docs)?;
        let cu = Tensor::from_vec(cu, docs.len() + 1, self.device())?;
        maxsim_residual_varlen(q, &codes, &residuals, &cu, max_len, &self.codec, true)
    }

    /// The residuals followed by `new` rows ([`append_rows`]); returns their
    /// store. On a GPU that cannot hold the old and the grown residuals at
    /// once (an index of more than half its memory), the old rows go
    /// through host memory: the device then holds the grown residuals and
    /// one piece of the old ones at a time. Should the device not hold even
    /// that, the residuals stay in host memory (as
    /// [`Self::load_with_device_budget`] keeps them): search gives the same
    /// results, its exact stage copying its candidates' rows.
    fn grow_residuals(&mut self, new: &[Tensor]) -> Result<Option<Tensor>> {
        let store = self.stores.0.as_ref().map(|s| &s.1);
        let err = match append_rows(&self.residuals, store, new) {
            Ok((view, store)) => {
                self.residuals = view;
                return Ok(Some(store));
            }
            Err(e) => e,
        };
        let dev = self.residuals.device().clone();
        if dev.is_cpu() {
            return Err(err);
        }
        // Most likely out of device memory: the old rows to the host, which
        // frees them on the device (nothing else holds them during an add).
        let host = self.residuals.to_device(&Device::Cpu)?;
        self.stores = Stores(None);
        self.residuals = host.clone();
        self.host_residuals = true;
        let piece = ((256usize << 20) / host.dim(1)?.max(1)).max(1);
        match grow_through_host(&host, new, &dev, piece) {
            Ok(t) => {
                self.residuals = t;
                self.host_residuals = false;
            }
            Err(_) => {
                let mut parts = vec![host];
                for t in new {
                    parts.push(t.to_device(&Device::Cpu)?);
                }
                self.residuals = Tensor::cat(&parts, 0)?;
            }
        }
        Ok(None)
    }

    /// The codes and residuals of documents `docs` back to back on the
    /// index's device (the residuals gathered where they are, then copied),
    /// their offsets `[docs.len() + 1]` and longest length.
    pub(crate) fn gather_docs(&self, docs: &[u32]) -> Result<(Tensor, Tensor, Vec<u32>, usize)> {
        let mut cu = Vec::with_capacity(docs.len() + 1);
        cu.push(0u32);
        let mut max_len = 0;
        for &d in docs {
            max_len = max_len.max(self.len(d));
            cu.push(cu.last().unwrap() + self.len(d) as u32);
        }
        let n_rows = *cu.last().unwrap() as usize;
        // A run of consecutive documents is a view; anything else is gathered.
        let run = match docs.first() {
            Some(&first) if docs.windows(2).all(|w| w[1] == w[0] + 1) => Some(self.offsets[first as usize] as usize),
            _ => None,
        };
        // The rows of a gather, on the device (uploaded once, for codes and residuals).
        let rows = match run {
            None if n_rows > 0 => {
                let rows: Vec<u32> =
                    docs.iter().flat_map(|&d| self.offsets[d as usize]..self.offsets[d as usize + 1]).collect();
                Some(Tensor::from_vec(rows, n_rows, self.device())?)
            }
            _ => None,
        };
        let codes = match (run, &rows) {
            (Some(a), _) => self.codes.narrow(0, a, n_rows)?,
            (None, Some(rows)) => self.codes.index_select(rows, 0)?,
            (None, None) => self.codes.narrow(0, 0, 0)?,
        };
        // Residuals in host memory are copied row by row, a run included:
        // moving a view to the device copies its whole storage (every
        // residual of the index).
        let residuals = match (run, &rows) {
            _ if self.host_residuals => gather_host_rows(&self.residuals, docs, &self.offsets, n_rows)?,
            (Some(a), _) => self.residuals.narrow(0, a, n_rows)?,
            (None, Some(rows)) => self.residuals.index_select(rows, 0)?,
            (None, None) => self.residuals.narrow(0, 0, 0)?,
        };
        Ok((codes, residuals.to_device(self.device())?, cu, max_len))
    }
}

/// `view` (the first rows of `store`, when there is one) followed by `new`
/// rows, as `(view, store)`: `new` written into the store's spare rows when
/// they suffice (nothing else is copied: an add costs what it adds), else
/// everything into a new store of 1/16 more rows than needed, so that the
/// next adds find room (one copy of the old rows per 1/16 of growth). A
/// view's rows are never written: one taken earlier stays as it was.
fn append_rows(view: &Tensor, store: Option<&Tensor>, new: &[Tensor]) -> Result<(Tensor, Tensor)> {
    let len = view.dim(0)?;
    let rows = len + new.iter().map(|t| t.dim(0)).sum::<Result<usize>>()?;
    let store = match store {
        Some(s) if s.dim(0)? >= rows => s.clone(),
        _ => {
            let mut shape = view.dims().to_vec();
            shape[0] = rows + rows / 16;
            let grown = Tensor::zeros(shape, view.dtype(), view.device())?;
            write_rows(&grown, 0, std::slice::from_ref(view))?;
            grown
        }
    };
    write_rows(&store, len, new)?;
    Ok((store.narrow(0, 0, rows)?, store))
}

/// Writes `parts` one after another into `store`'s rows from `at` on
/// (each copied to the store's device); returns the row after them.
fn write_rows(store: &Tensor, mut at: usize, parts: &[Tensor]) -> Result<usize> {
    for t in parts {
        if t.dim(0)? > 0 {
            store.slice_set(&t.to_device(store.device())?.contiguous()?, 0, at)?;
        }
        at += t.dim(0)?;
    }
    Ok(at)
}

/// `old` (in host memory) followed by `new` (on `dev`), on `dev`: the whole
/// allocated first, then `old` copied in pieces of `piece` rows, so that the
/// device holds the result and one piece.
fn grow_through_host(old: &Tensor, new: &[Tensor], dev: &Device, piece: usize) -> Result<Tensor> {
    let rows = old.dim(0)? + new.iter().map(|t| t.dim(0)).sum::<Result<usize>>()?;
    let mut shape = old.dims().to_vec();
    shape[0] = rows;
    let grown = Tensor::zeros(shape, old.dtype(), dev)?;
    let mut at = 0;
    while at < old.dim(0)? {
        let n = piece.min(old.dim(0)? - at);
        at = write_rows(&grown, at, &[old.narrow(0, at, n)?])?;
    }
    write_rows(&grown, at, new)?;
    Ok(grown)
}

/// The rows of documents `docs` (tokens `offsets[d]..offsets[d + 1]`) of
/// `x [T, B]` U8 in host memory, `n_rows` in all, copied a document at a time
/// by several threads: a search within a device budget gathers its
/// candidates' residuals here, often a good part of the collection for a
/// batch of queries, which one thread's `index_select` copied at ~1 GB/s.
fn gather_host_rows(x: &Tensor, docs: &[u32], offsets: &[u32], n_rows: usize) -> Result<Tensor> {
    let b = x.dim(1)?;
    let (storage, layout) = x.storage_and_layout();
    let candle_core::Storage::Cpu(candle_core::CpuStorage::U8(all)) = &*storage else {
        bail!("residuals: expected U8 in host memory")
    };
    let Some((start, end)) = layout.contiguous_offsets() else { bail!("residuals: expected contiguous rows") };
    let all = &all[start..end];
    let mut out = vec![0u8; n_rows * b];
    // Documents split into runs of about equal bytes, one per thread.
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get()).min(16);
    let per = (n_rows * b).div_ceil(threads).max(1 << 20);
    std::thread::scope(|s| {
        let (mut rest, mut i) = (out.as_mut_slice(), 0);
        while i < docs.len() {
            let (mut j, mut bytes) = (i, 0);
            while j < docs.len() && bytes < per {
                bytes += (offsets[docs[j] as usize + 1] - offsets[docs[j] as usize]) as usize * b;
                j += 1;
            }
            let (mine, later) = std::mem::take(&mut rest).split_at_mut(bytes);
            rest = later;
            let run = &docs[i..j];
            s.spawn(move || {
                let mut at = 0;
                for &d in run {
                    let (a, z) = (offsets[d as usize] as usize * b, offsets[d as usize + 1] as usize * b);
                    mine[at..at + z - a].copy_from_slice(&all[a..z]);
                    at += z - a;
                }
            });
            i = j;
        }
    });
    Tensor::from_vec(out, (n_rows, b), &Device::Cpu)
}

/// The index's document offsets for the exact scoring, checked on the host.
fn checked_offsets(offsets: &Arc<Vec<u32>>, cu: &Tensor, max_len: usize) -> Result<DocOffsets> {
    let rows = *offsets.last().unwrap_or(&0) as usize;
    // SAFETY: `cu` is uploaded from `offsets` at load, and an add appends to
    // both the same new offsets.
    unsafe { DocOffsets::from_parts(offsets.clone(), cu.clone(), rows, max_len) }
}

/// The query rows `q [Nq, Lq, dim]` read on the host as bits: whether each
/// of the `Nq·Lq` rows has a non-zero entry (rows of zeros are padding), or
/// `Err` naming `q` and the first query with a NaN or infinite entry (one
/// copy of the queries and a scan of their bits, instead of a dozen device
/// kernels).
pub(crate) fn query_rows(q: &Tensor) -> Result<Vec<bool>> {
    let (_, lq, dim) = q.dims3()?;
    // A batch narrowed out of a larger tensor is copied out first: reading
    // a view copies its whole storage to the host (2 MB and 0.2 ms for one
    // query of a batch of 256, measured).
    let flat = if shares_larger_storage(q) { q.affine(1.0, 0.0)? } else { q.clone() }.flatten_all()?;
    // Per dtype: the entries' bits, the exponent mask (all ones: NaN or
    // infinite) and the magnitude mask (zero: +0 or -0).
    match q.dtype() {
        DType::F16 => scan_rows(&flat.to_vec1::<half::f16>()?, |x| x.to_bits() as u64, 0x7c00, 0x7fff, lq, dim),
        DType::BF16 => scan_rows(&flat.to_vec1::<half::bf16>()?, |x| x.to_bits() as u64, 0x7f80, 0x7fff, lq, dim),
        DType::F32 => scan_rows(&flat.to_vec1::<f32>()?, |x| x.to_bits() as u64, 0x7f80_0000, 0x7fff_ffff, lq, dim),
        _ => scan_rows(&flat.to_dtype(DType::F64)?.to_vec1::<f64>()?, f64::to_bits, 0x7ff << 52, !(1 << 63), lq, dim),
    }
}

/// Whether `x` is a view of a device buffer with more elements than its own.
fn shares_larger_storage(x: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Storage::Cuda(c) = &*x.storage_and_layout().0 {
        let len = match x.dtype() {
            DType::F16 => c.as_cuda_slice::<half::f16>().map(|s| s.len()),
            DType::BF16 => c.as_cuda_slice::<half::bf16>().map(|s| s.len()),
            DType::F32 => c.as_cuda_slice::<f32>().map(|s| s.len()),
            DType::F64 => c.as_cuda_slice::<f64>().map(|s| s.len()),
            _ => return true,
        };
        return len.map_or(true, |n| n > x.elem_count());
    }
    let _ = x;
    false
}

/// [`query_rows`] over one dtype's values.
fn scan_rows<T: Copy>(
    v: &[T],
    bits: impl Fn(T) -> u64,
    exp: u64,
    mag: u64,
    lq: usize,
    dim: usize,
) -> Result<Vec<bool>> {
    let mut real = Vec::with_capacity(v.len() / dim.max(1));
    for (r, row) in v.chunks(dim.max(1)).enumerate() {
        if row.iter().any(|&x| bits(x) & exp == exp) {
            bail!("q: query {} has a NaN or infinite entry", r / lq.max(1))
        }
        real.push(row.iter().any(|&x| bits(x) & mag != 0));
    }
    Ok(real)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growing_through_host_memory_equals_concatenating() -> Result<()> {
        let dev = Device::Cpu;
        let rows = |n: usize, seed: u8| -> Result<Tensor> {
            let v: Vec<u8> = (0..n * 3).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
            Tensor::from_vec(v, (n, 3), &dev)
        };
        let old = rows(10, 1)?;
        let new = [rows(2, 2)?, rows(0, 3)?, rows(4, 4)?];
        let want = Tensor::cat(&[&old, &new[0], &new[1], &new[2]], 0)?.to_vec2::<u8>()?;
        for piece in [1, 3, 10, 64] {
            let got = grow_through_host(&old, &new, &dev, piece)?;
            assert_eq!(got.to_vec2::<u8>()?, want, "pieces of {piece} rows");
        }
        Ok(())
    }

    /// The elements of a tensor's storage (a view's may be more than its own).
    fn storage_len(t: &Tensor) -> usize {
        match &*t.storage_and_layout().0 {
            candle_core::Storage::Cpu(candle_core::CpuStorage::U8(v)) => v.len(),
            _ => usize::MAX,
        }
    }

    #[test]
    fn host_residuals_leave_as_their_rows_alone() -> Result<()> {
        let dev = Device::Cpu;
        let dir = std::env::temp_dir().join(format!("candle_maxsim_plaid_{}_host_rows", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let lens: Vec<u32> = (0..40).map(|i| 5 + (i * 7) % 23).collect();
        let x = Tensor::randn(0f32, 1., (lens.iter().sum::<u32>() as usize, 32), &dev)?;
        let config = crate::IndexConfig { n_centroids: Some(16), ..Default::default() };
        let whole = crate::create(&dir, &crate::PackedDocuments::new(x, &lens)?, &config, &dev)?;
        let (need, _) = PlaidIndex::device_bytes_needed(&dir)?;
        let small = PlaidIndex::load_with_device_budget(&dir, &dev, need - 1)?;
        assert!(small.residuals_on_host());
        for docs in [&[3u32, 4, 5][..], &[7], &[9, 2, 30], &[]] {
            let (codes, r, cu, max_len) = small.gather_docs(docs)?;
            let (wcodes, wr, wcu, wmax) = whole.gather_docs(docs)?;
            assert_eq!(storage_len(&r), r.elem_count(), "{docs:?}: only the documents' rows are copied");
            assert_eq!((r.to_vec2::<u8>()?, cu, max_len), (wr.to_vec2::<u8>()?, wcu, wmax), "{docs:?}");
            assert_eq!(codes.to_vec1::<u32>()?, wcodes.to_vec1::<u32>()?, "{docs:?}");
        }
        assert_eq!(small.embeddings(7)?.to_vec2::<f32>()?, whole.embeddings(7)?.to_vec2::<f32>()?);
        std::fs::remove_dir_all(&dir).ok();
        Ok(())
    }
}
