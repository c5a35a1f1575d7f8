//! Where the embeddings of a collection to index come from: anything that
//! hands out the packed token embeddings of a list of documents, so that a
//! collection larger than device memory streams through the index builder
//! a chunk at a time.

use crate::npy::MappedNpy;
use candle_core::{bail, DType, Device, Result, Tensor};
use std::path::Path;

/// A collection of documents' token embeddings.
pub trait Documents {
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
