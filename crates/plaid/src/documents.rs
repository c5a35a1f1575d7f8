//! Where the embeddings of a collection to index come from: anything that
//! hands out the packed token embeddings of a list of documents, so that a
//! collection larger than device memory streams through the index builder
//! a chunk at a time.

use crate::npy::{self, MappedNpy};
use crate::store::io_err;
use candle_core::{bail, DType, Device, Result, Tensor};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// A collection of documents' token embeddings. `Sync`: a build reads the
/// next chunk on one thread while it codes the current one on another.
pub trait Documents: Sync {
    /// Number of documents.
    fn len(&self) -> usize;
    /// Whether there are no documents.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Embedding dimension.
    fn dim(&self) -> usize;
    /// Token count of document `i`.
    fn doc_len(&self, i: usize) -> usize;
    /// The token embeddings of documents `ids`, in that order, packed:
    /// `[Σ len, dim]`, any float dtype, on any device.
    fn embeddings(&self, ids: &[u32]) -> Result<Tensor>;
}

/// The row offsets of documents of the given lengths.
fn offsets(lens: &[u32]) -> Result<Vec<usize>> {
    let mut cu = Vec::with_capacity(lens.len() + 1);
    cu.push(0usize);
    for &l in lens {
        cu.push(cu.last().unwrap() + l as usize);
    }
    if *cu.last().unwrap() > u32::MAX as usize {
        bail!("lens: {} tokens exceed the index's 32-bit offsets", cu.last().unwrap())
    }
    Ok(cu)
}

/// The row ranges of `ids`, merged where consecutive.
fn runs(cu: &[usize], ids: &[u32]) -> Result<Vec<(usize, usize)>> {
    let n = cu.len() - 1;
    let mut out: Vec<(usize, usize)> = Vec::new();
    for &i in ids {
        if i as usize >= n {
            bail!("ids: document {i} is out of range for {n} documents")
        }
        let (a, b) = (cu[i as usize], cu[i as usize + 1]);
        match out.last_mut() {
            Some(last) if last.1 == a => last.1 = b,
            _ => out.push((a, b)),
        }
    }
    Ok(out)
}

/// Documents held as one packed `[Td, dim]` tensor (any device) and their lengths.
#[derive(Clone, Debug)]
pub struct PackedDocuments {
    embeddings: Tensor,
    cu: Vec<usize>,
}

impl PackedDocuments {
    /// `embeddings [Td, dim]` (F16, BF16 or F32), document `i` being the next
    /// `lens[i]` rows; the lengths must add up to `Td`.
    pub fn new(embeddings: Tensor, lens: &[u32]) -> Result<Self> {
        if embeddings.rank() != 2 || !matches!(embeddings.dtype(), DType::F16 | DType::BF16 | DType::F32) {
            bail!(
                "embeddings: expected F16, BF16 or F32 [Td, dim], got {:?} {:?}",
                embeddings.dtype(),
                embeddings.dims()
            )
        }
        let cu = offsets(lens)?;
        if *cu.last().unwrap() != embeddings.dim(0)? {
            bail!("lens: the lengths add up to {} tokens, embeddings has {}", cu.last().unwrap(), embeddings.dim(0)?)
        }
        Ok(Self { embeddings, cu })
    }
}

impl Documents for PackedDocuments {
    fn len(&self) -> usize {
        self.cu.len() - 1
    }
    fn dim(&self) -> usize {
        self.embeddings.dims()[1]
    }
    fn doc_len(&self, i: usize) -> usize {
        self.cu[i + 1] - self.cu[i]
    }
    fn embeddings(&self, ids: &[u32]) -> Result<Tensor> {
        let parts: Vec<Tensor> = runs(&self.cu, ids)?
            .into_iter()
            .map(|(a, b)| self.embeddings.narrow(0, a, b - a))
            .collect::<Result<_>>()?;
        match parts.len() {
            0 => self.embeddings.narrow(0, 0, 0),
            1 => Ok(parts.into_iter().next().unwrap()),
            _ => Tensor::cat(&parts, 0),
        }
    }
}

/// Documents in an `.npy` file of `[Td, dim]` F16 or F32 token embeddings,
/// memory-mapped: only the documents asked for are read, so a collection
/// larger than RAM streams through.
pub struct NpyDocuments {
    file: MappedNpy,
    cu: Vec<usize>,
}

impl NpyDocuments {
    /// Opens `path`, document `i` being the next `lens[i]` rows.
    pub fn open(path: impl AsRef<Path>, lens: &[u32]) -> Result<Self> {
        let file = MappedNpy::open(path.as_ref())?;
        if file.shape.len() != 2 || !matches!(file.dtype, DType::F16 | DType::F32) {
            bail!(
                "embeddings: {} must be F16 or F32 [Td, dim], got {:?} {:?}",
                path.as_ref().display(),
                file.dtype,
                file.shape
            )
        }
        let cu = offsets(lens)?;
        if *cu.last().unwrap() != file.shape[0] {
            bail!(
                "lens: the lengths add up to {} tokens, {} has {}",
                cu.last().unwrap(),
                path.as_ref().display(),
                file.shape[0]
            )
        }
        Ok(Self { file, cu })
    }
}

impl Documents for NpyDocuments {
    fn len(&self) -> usize {
        self.cu.len() - 1
    }
    fn dim(&self) -> usize {
        self.file.shape[1]
    }
    fn doc_len(&self, i: usize) -> usize {
        self.cu[i + 1] - self.cu[i]
    }
    fn embeddings(&self, ids: &[u32]) -> Result<Tensor> {
        let parts: Vec<Tensor> =
            runs(&self.cu, ids)?.into_iter().map(|(a, b)| self.file.rows(a, b, &Device::Cpu)).collect::<Result<_>>()?;
        match parts.len() {
            0 => self.file.rows(0, 0, &Device::Cpu),
            1 => Ok(parts.into_iter().next().unwrap()),
            _ => Tensor::cat(&parts, 0),
        }
    }
}

/// Writes a collection to disk batch by batch as it is encoded (an `.npy`
/// of `[Td, dim]` F16 token embeddings), so that it never sits in memory
/// whole; [`DocumentsWriter::finish`] opens it as [`NpyDocuments`] for
/// [`crate::create`]. The index build itself reads documents a chunk at a
/// time, and draws its k-means sample from the whole collection: the file
/// is the collection's one copy, in the page cache or on disk.
///
/// ```no_run
/// # fn main() -> candle_core::Result<()> {
/// # let batches: Vec<(candle_core::Tensor, Vec<u32>)> = vec![];
/// use candle_maxsim_plaid::{create, DocumentsWriter, IndexConfig};
/// let mut w = DocumentsWriter::create("collection.npy", 128)?;
/// for (embeddings, lens) in batches {
///     // e.g. ColBert::encode_documents_packed of the next texts
///     w.push(&embeddings, &lens)?;
/// }
/// let docs = w.finish()?;
/// let index = create("index", &docs, &IndexConfig::default(), &candle_core::Device::Cpu)?;
/// # Ok(()) }
/// ```
pub struct DocumentsWriter {
    path: PathBuf,
    out: std::io::BufWriter<std::fs::File>,
    dim: usize,
    lens: Vec<u32>,
    rows: usize,
}

/// The header's reserved length: room for any row count.
const SPOOL_HEADER: usize = 128;

impl DocumentsWriter {
    /// Creates (or replaces) `path` for documents of `dim`-dimensional tokens.
    pub fn create(path: impl AsRef<Path>, dim: usize) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        if dim == 0 {
            bail!("dim: must be at least 1")
        }
        if !cfg!(target_endian = "little") {
            bail!("npy: writing needs a little-endian machine")
        }
        let io = |e| io_err(&path, "create", e);
        let mut out = std::io::BufWriter::with_capacity(1 << 22, std::fs::File::create(&path).map_err(io)?);
        out.write_all(&npy::header_of_length("<f2", &[0, dim], SPOOL_HEADER)).map_err(io)?;
        Ok(Self { path, out, dim, lens: Vec::new(), rows: 0 })
    }

    /// Appends documents: `embeddings [Σ lens, dim]` (any float dtype, any
    /// device; stored as F16), document `i` being the next `lens[i]` rows.
    pub fn push(&mut self, embeddings: &Tensor, lens: &[u32]) -> Result<()> {
        let (t, dim) = embeddings.dims2().map_err(|_| {
            candle_core::Error::Msg(format!("embeddings: expected [T, {}], got {:?}", self.dim, embeddings.dims()))
        })?;
        if dim != self.dim || !embeddings.dtype().is_float() {
            bail!("embeddings: expected float [T, {}], got {:?} {:?}", self.dim, embeddings.dtype(), embeddings.dims())
        }
        let total: usize = lens.iter().map(|&l| l as usize).sum();
        if total != t {
            bail!("lens: the lengths add up to {total} tokens, embeddings has {t}")
        }
        if self.rows + t > u32::MAX as usize {
            bail!("embeddings: {} tokens in all would exceed the index's 32-bit offsets", self.rows + t)
        }
        let data = npy::raw_bytes(&embeddings.to_dtype(DType::F16)?)?;
        let bytes = data.as_bytes();
        // F16 infinity and NaN: every exponent bit set.
        if bytes.chunks_exact(2).any(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7c00 == 0x7c00) {
            bail!("embeddings: a value is not finite (or overflows F16) in documents {}..", self.lens.len())
        }
        self.out.write_all(bytes).map_err(|e| io_err(&self.path, "write", e))?;
        self.rows += t;
        self.lens.extend_from_slice(lens);
        Ok(())
    }

    /// Documents so far.
    pub fn len(&self) -> usize {
        self.lens.len()
    }

    /// Whether no document was pushed.
    pub fn is_empty(&self) -> bool {
        self.lens.is_empty()
    }

    /// Completes the file (its header rewritten with the row count, synced)
    /// and opens it.
    pub fn finish(self) -> Result<NpyDocuments> {
        let Self { path, out, dim, lens, rows } = self;
        let io = |e| io_err(&path, "write", e);
        let mut f = out.into_inner().map_err(|e| io(e.into_error()))?;
        let header = npy::header_of_length("<f2", &[rows, dim], SPOOL_HEADER);
        if header.len() != SPOOL_HEADER {
            bail!("embeddings: {} rows of dim {dim} need a longer .npy header than reserved", rows)
        }
        f.seek(SeekFrom::Start(0)).map_err(io)?;
        f.write_all(&header).map_err(io)?;
        f.sync_all().map_err(io)?;
        drop(f);
        NpyDocuments::open(&path, &lens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{create, IndexConfig};

    /// Batches pushed (F32 and BF16, one empty) read back as the documents
    /// they were, in F16; the index built from the file equals the index
    /// built from the same documents in memory, file for file.
    #[test]
    fn written_documents_equal_the_batches() -> Result<()> {
        let dir = candle_maxsim_testing::tmpdir("documents-writer");
        let dev = Device::Cpu;
        let mut w = DocumentsWriter::create(dir.join("c.npy"), 16)?;
        let (mut all, mut all_lens) = (Vec::new(), Vec::new());
        for (b, n) in [7usize, 0, 30, 13].into_iter().enumerate() {
            let lens: Vec<u32> = (0..n as u32).map(|i| 1 + (i * 5 + b as u32) % 9).collect();
            let t: u32 = lens.iter().sum();
            let x = Tensor::randn(0f32, 1., (t as usize, 16), &dev)?;
            let x = if b % 2 == 1 { x.to_dtype(DType::BF16)? } else { x };
            w.push(&x, &lens)?;
            all.push(x.to_dtype(DType::F16)?);
            all_lens.extend(lens);
        }
        assert_eq!(w.len(), 50);
        let docs = w.finish()?;
        let mem = PackedDocuments::new(Tensor::cat(&all, 0)?, &all_lens)?;
        assert_eq!((docs.len(), docs.dim()), (50, 16));
        let ids: Vec<u32> = vec![0, 3, 4, 17, 49];
        let (a, b) = (docs.embeddings(&ids)?.to_dtype(DType::F32)?, mem.embeddings(&ids)?.to_dtype(DType::F32)?);
        assert_eq!(a.to_vec2::<f32>()?, b.to_vec2::<f32>()?);
        let config = IndexConfig { n_centroids: Some(8), ..Default::default() };
        create(dir.join("from_file"), &docs, &config, &dev)?;
        create(dir.join("from_memory"), &mem, &config, &dev)?;
        let mut names: Vec<_> =
            std::fs::read_dir(dir.join("from_file")).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert!(names.len() > 5, "{names:?}");
        for n in names {
            let (f, m) = (
                std::fs::read(dir.join("from_file").join(&n)).unwrap(),
                std::fs::read(dir.join("from_memory").join(&n)).unwrap(),
            );
            assert!(f == m, "{n:?} differs");
        }
        std::fs::remove_dir_all(&dir).unwrap();
        Ok(())
    }

    /// Bad batches are errors naming the argument, and leave the file usable.
    #[test]
    fn bad_batches_are_errors() -> Result<()> {
        let dir = candle_maxsim_testing::tmpdir("documents-writer-bad");
        let dev = Device::Cpu;
        let mut w = DocumentsWriter::create(dir.join("c.npy"), 4)?;
        let x = Tensor::randn(0f32, 1., (5, 4), &dev)?;
        let msg = |r: Result<()>| r.unwrap_err().to_string();
        assert!(msg(w.push(&Tensor::randn(0f32, 1., (5, 3), &dev)?, &[5])).starts_with("embeddings:"));
        assert!(msg(w.push(&x, &[2, 2])).starts_with("lens:"));
        assert!(msg(w.push(&Tensor::zeros((5, 4), DType::U32, &dev)?, &[5])).starts_with("embeddings:"));
        let nan = x.broadcast_mul(&Tensor::new(&[1f32, f32::NAN, 1., 1.], &dev)?)?;
        assert!(msg(w.push(&nan, &[5])).starts_with("embeddings:"));
        assert!(msg(w.push(&(x.clone() * 1e6)?, &[5])).starts_with("embeddings:"), "overflows F16");
        assert!(DocumentsWriter::create(dir.join("d.npy"), 0).is_err());
        w.push(&x, &[2, 3])?;
        let docs = w.finish()?;
        assert_eq!((docs.len(), docs.doc_len(1)), (2, 3));
        std::fs::remove_dir_all(&dir).unwrap();
        Ok(())
    }
}
