//! Building an index, and its life cycle: adding documents (compressed
//! against the existing codec) and deleting them (ids stay stable). Every
//! change is written to a staging directory and renamed into place, so a
//! failure leaves the index on disk as it was.
//!
//! Building follows fast-plaid 1.7 (its formulas and defaults):
//!
//! 1. a sample of `min(1 + 16·√(120·N), N)` documents;
//! 2. `K = 2^⌊log2(16·√(tokens))⌋` centroids (at most the sampled tokens) by
//!    k-means (module `kmeans`) over at most `K · max_points_per_centroid`
//!    sampled tokens, `kmeans_niters` iterations;
//! 3. the bucket cutoffs and weights (module `codec`) from as many tokens as
//!    5 % of the sample (at most 50 000), of documents drawn from the whole
//!    collection, as quantiles of their pooled residual values;
//! 4. every document coded against that codec, chunk by chunk (module `writer`);
//! 5. the inverted file, the codec and the metadata.
//!
//! Samples are drawn with this crate's seeded generator, so the centroids
//! are not fast-plaid's own, but an index of either engine is searched by both.

use crate::codec::{work_dtype, Codec};
use crate::documents::Documents;
use crate::index::{PlaidIndex, DELETED, DELTA_IVF};
use crate::ivf::{Ivf, IvfRuns};
use crate::kmeans::{kmeans, random_rows};
use crate::store::{json_usize, read_json, write_json, Staging};
use crate::writer::{write_codec, Contents, Lists};
use candle_core::{bail, DType, Device, Result, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::path::Path;

/// How [`create`] builds an index (fast-plaid's names and defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct IndexConfig {
    /// Bits per residual feature: 2 or 4 (fast-plaid's), or 8.
    pub nbits: usize,
    /// k-means iterations.
    pub kmeans_niters: usize,
    /// At most this many sampled tokens per centroid go into k-means.
    pub max_points_per_centroid: usize,
    /// The number of centroids (`None`: fast-plaid's formula).
    pub n_centroids: Option<usize>,
    /// Seed of the document sample and of k-means.
    pub seed: u64,
    /// Documents per chunk file.
    pub chunk_documents: usize,
    /// k-means assigns tokens by dot product to unit centroids, re-normalized
    /// every iteration (spherical, the default), instead of by Euclidean
    /// distance to the means (fast-plaid's), normalized once at the end.
    /// Spherical runs its assignments on 128 columns where Euclidean needs
    /// 136 (a bias column, padded), past the tensor-core path for dim ≤ 128: on an
    /// H200 (2026-12-04, 17 M generated tokens, 65 536 centroids) k-means
    /// took 0.92 s instead of 5.39 s, recall@10 on 256 queries 0.952 against
    /// Euclidean's 0.949.
    pub spherical_kmeans: bool,
    /// Draw a progress bar on stderr.
    pub show_progress: bool,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            nbits: 4,
            kmeans_niters: 4,
            max_points_per_centroid: 256,
            n_centroids: None,
            seed: 42,
            chunk_documents: 25_000,
            spherical_kmeans: true,
            show_progress: false,
        }
    }
}

/// Builds an index of `docs` in `dir` on `device` (replacing an index
/// there; refusing a non-empty directory that is not one) and opens it.
///
/// The build survives being stopped: it is written in `.NAME.building`
/// beside `dir` (the trained codec first, then chunk after chunk, its
/// progress in `build.json`), renamed into place at the end. A build that
/// failed or was killed is resumed by the next `create` of the same
/// documents with the same configuration, from its last completed chunk,
/// and gives the same index as an uninterrupted one; another collection or
/// configuration starts afresh. Until the rename, an index already in
/// `dir` stays as it was.
pub fn create(
    dir: impl AsRef<Path>,
    docs: &dyn Documents,
    config: &IndexConfig,
    device: &Device,
) -> Result<PlaidIndex> {
    build(dir.as_ref(), docs, config, device)?;
    PlaidIndex::load(dir, device)
}

/// [`create`] without opening the index: the build alone (an index larger
/// than the device, or one built to be served elsewhere, is never loaded
/// here; opening 272 M tokens' index takes seconds).
pub fn build(dir: impl AsRef<Path>, docs: &dyn Documents, config: &IndexConfig, device: &Device) -> Result<()> {
    let dir = dir.as_ref();
    check_target(dir)?;
    let bar = progress(config.show_progress, docs.len() as u64, "sampling");
    let fingerprint = fingerprint(docs, config)?;
    let (st, existed) = Staging::building(dir, false)?;
    let state = st.dir.join(BUILD_STATE);
    // Resumed: the same fingerprint, the codec readable, chunks 0..done written.
    let resumed = match existed.then(|| read_json(&state).ok()).flatten() {
        Some(s) if s["fingerprint"] == fingerprint => {
            match (s["chunks_done"].as_u64(), Codec::read(&st.dir, config.nbits, device)) {
                (Some(done), Ok(c)) => Some((c, done as usize)),
                _ => None,
            }
        }
        _ => None,
    };
    let (st, c, done) = match resumed {
        Some((c, done)) => (st, c, done),
        None => {
            drop(st);
            let (st, _) = Staging::building(dir, true)?;
            let t = std::time::Instant::now();
            let c = train(docs, config, device, &bar)?;
            write_codec(&st, &c)?;
            if config.show_progress {
                eprintln!("training: {:.2} s", t.elapsed().as_secs_f64());
            }
            write_state(&state, &fingerprint, 0)?;
            (st, c, 0)
        }
    };
    bar.inc((done * config.chunk_documents).min(docs.len()) as u64);
    finish(st, docs, &c, config.chunk_documents, done, &bar, &mut |n| write_state(&state, &fingerprint, n))?;
    bar.finish_and_clear();
    Ok(())
}

/// The progress file of a build in `.NAME.building`.
const BUILD_STATE: &str = "build.json";

/// What a resumed build must share with the one it continues: the
/// configuration, the collection's size and shape, and a hash of its
/// first, middle and last documents' embeddings.
fn fingerprint(docs: &dyn Documents, config: &IndexConfig) -> Result<serde_json::Value> {
    use std::hash::Hasher;
    let n = docs.len();
    let tokens: usize = (0..n).map(|d| docs.doc_len(d)).sum();
    // SipHash with fixed keys: the same value in every process.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    if n > 0 {
        let mut probe: Vec<u32> = vec![0, (n / 2) as u32, (n - 1) as u32];
        probe.dedup();
        for v in docs.embeddings(&probe)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()? {
            h.write_u32(v.to_bits());
        }
    }
    Ok(serde_json::json!({
        "documents": n, "tokens": tokens, "dim": docs.dim(), "sample_hash": format!("{:016x}", h.finish()), "nbits": config.nbits,
        "kmeans_niters": config.kmeans_niters, "max_points_per_centroid": config.max_points_per_centroid,
        "n_centroids": config.n_centroids, "seed": config.seed, "chunk_documents": config.chunk_documents,
        "spherical_kmeans": config.spherical_kmeans,
    }))
}

/// Records `done` chunks written (atomically: a new file renamed over the old).
fn write_state(path: &Path, fingerprint: &serde_json::Value, done: usize) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    write_json(&tmp, &serde_json::json!({"fingerprint": fingerprint, "chunks_done": done}))?;
    std::fs::rename(&tmp, path).map_err(|e| crate::store::io_err(path, "replace", e))
}

impl PlaidIndex {
    /// Adds `docs` to the index: compressed against its codec (centroids and
    /// bucket cutoffs unchanged, as fast-plaid's update), written as new
    /// chunks, their documents appended to the inverted lists. The new
    /// documents get the ids after the last one, returned as a range.
    ///
    /// Costs what it changes: the documents already there are not read
    /// again; the new chunks are written, and the inverted lists of the
    /// documents added since the last [`PlaidIndex::compact`] (this crate's
    /// `delta_ivf.npy`, searched with `ivf.npy`); the index in memory is
    /// extended. fast-plaid, which reads `ivf.npy` alone, finds the added
    /// documents after the compaction.
    pub fn add(&mut self, docs: &dyn Documents, chunk_documents: usize) -> Result<std::ops::Range<u32>> {
        if docs.is_empty() {
            let n = self.num_documents() as u32;
            return Ok(n..n);
        }
        if docs.dim() != self.dim() {
            bail!("docs: dim {} does not match the index's {}", docs.dim(), self.dim())
        }
        let Some(cutoffs) = self.bucket_cutoffs.clone() else {
            bail!("dir: {} has no bucket_cutoffs.npy, needed to compress new documents", self.dir.display())
        };
        if chunk_documents == 0 {
            bail!("chunk_documents: must be at least 1")
        }
        let meta_path = self.dir.join("metadata.json");
        let meta = read_json(&meta_path)?;
        let n_chunks = json_usize(&meta, "num_chunks", &meta_path)?.unwrap_or(0);
        let first = self.num_documents();
        let st = Staging::new(&self.dir, false)?;
        // The delta lists grow; without an inverted file at all, the whole one is written.
        let delta = self.ivf.is_some();
        let lists = match (&self.delta_ivf, delta) {
            (Some((ids, offsets)), true) => Ivf::from_csr(&ids.to_vec1()?, &offsets.to_vec1()?),
            (None, true) => Ivf::new(self.num_centroids()),
            (_, false) => self.ivf_lists()?,
        };
        let mut contents = Contents {
            chunks: n_chunks,
            documents: first,
            embeddings: *self.offsets.last().unwrap() as usize,
            ivf: Lists::Memory(lists),
        };
        contents.append(&st, docs, &self.codec, &cutoffs, chunk_documents, &ProgressBar::hidden())?;
        if contents.embeddings >= u32::MAX as usize {
            bail!("docs: {} tokens in all would exceed the 32-bit offsets of the residual kernels", contents.embeddings)
        }
        let Lists::Memory(ivf) = &contents.ivf else { bail!("ivf: an update's lists are held in memory") };
        ivf.write_as(&st, if delta { DELTA_IVF } else { "ivf" }, &self.deleted)?;
        contents.write_metadata(&st, self.codec.nbits)?;
        st.commit()?;
        self.append_chunks(n_chunks, contents.chunks, ivf.csr(&self.deleted), delta)?;
        Ok(first as u32..contents.documents as u32)
    }

    /// Deletes documents `ids`: they are never returned again; every other
    /// document keeps its id. Costs what it changes: the ids are recorded in
    /// `deleted.json` (written atomically) and the live-document mask
    /// updated in place; nothing else is rewritten or reloaded. The inverted
    /// file still lists them (search skips them) until [`PlaidIndex::compact`]
    /// drops them, so that fast-plaid, which does not read `deleted.json`,
    /// stops finding them too.
    pub fn delete(&mut self, ids: &[u32]) -> Result<()> {
        let n = self.num_documents();
        if let Some((i, &d)) = ids.iter().enumerate().find(|(_, &d)| d as usize >= n) {
            bail!("ids: ids[{i}] = {d} is out of range for {n} documents")
        }
        let mut deleted = self.deleted.clone();
        deleted.extend_from_slice(ids);
        deleted.sort_unstable();
        deleted.dedup();
        let st = Staging::new(&self.dir, false)?;
        write_json(&st.file(DELETED)?, &serde_json::json!({"deleted": deleted}))?;
        st.commit()?;
        self.set_deleted(deleted)
    }

    /// Folds the updates into the inverted file: the documents added since
    /// the last compaction merged into `ivf.npy` / `ivf_lengths.npy` (the
    /// delta files removed) and the deleted documents' entries dropped,
    /// written atomically (the old files intact on failure). That leaves a
    /// plain fast-plaid layout, which fast-plaid searches as this crate
    /// does. Search results do not change.
    pub fn compact(&mut self) -> Result<()> {
        if self.deleted.is_empty() && self.delta_ivf.is_none() {
            return Ok(());
        }
        let lists = self.ivf_lists()?;
        let st = Staging::new(&self.dir, false)?;
        lists.write(&st, &self.deleted)?;
        for stem in [DELTA_IVF.to_string(), format!("{DELTA_IVF}_lengths")] {
            st.file(&format!("{stem}.npy"))?; // its link removed: gone after the commit
        }
        st.commit()?;
        let (ids, offsets) = lists.csr(&self.deleted);
        let e = ids.len();
        self.ivf = Some((Tensor::from_vec(ids, e, self.device())?, Tensor::new(offsets.as_slice(), self.device())?));
        self.delta_ivf = None;
        Ok(())
    }

    /// The inverted lists of every document: the index's own (copied from
    /// the device; they lack only documents already deleted), the delta
    /// lists after the base ones, or, for an index without any, rebuilt
    /// from every token's code.
    fn ivf_lists(&self) -> Result<Ivf> {
        let csr = |(ids, offsets): &(Tensor, Tensor)| -> Result<Ivf> {
            Ok(Ivf::from_csr(&ids.to_vec1()?, &offsets.to_vec1()?))
        };
        if let Some(base) = &self.ivf {
            let lists = csr(base)?;
            return match &self.delta_ivf {
                Some(d) => Ok(lists.then(csr(d)?)),
                None => Ok(lists),
            };
        }
        let codes = self.host_codes()?;
        let mut ivf = Ivf::new(self.num_centroids());
        for d in 0..self.num_documents() {
            ivf.add(d as u32, &codes[self.offsets[d] as usize..self.offsets[d + 1] as usize]);
        }
        Ok(ivf)
    }
}

/// Trains the codec of `docs` on `device` (steps 1-3 of the module docs).
pub(crate) fn train(docs: &dyn Documents, config: &IndexConfig, device: &Device, bar: &ProgressBar) -> Result<Codec> {
    let n = docs.len();
    if n == 0 {
        bail!("docs: no documents to index")
    }
    if n >= u32::MAX as usize / 2 {
        bail!("docs: {n} documents exceed the 32-bit ids")
    }
    if !matches!(config.nbits, 2 | 4 | 8) || config.kmeans_niters == 0 || config.chunk_documents == 0 {
        bail!("config: nbits must be 2, 4 or 8 and kmeans_niters, chunk_documents at least 1, got {config:?}")
    }
    let dim = docs.dim();
    let wd = work_dtype(device);
    let mut rng = rand::rngs::StdRng::seed_from_u64(config.seed);
    bar.set_message("sampling");
    // 1. The sample.
    let n_sample = ((1.0 + 16.0 * (120.0 * n as f64).sqrt()) as usize).min(n);
    let mut ids: Vec<u32> = (0..n as u32).collect();
    ids.shuffle(&mut rng);
    ids.truncate(n_sample);
    // Read in id order (sequential reads); the held-out tokens are drawn at random below.
    ids.sort_unstable();
    let t = std::time::Instant::now();
    let sample = gather(docs, &ids, device, wd)?;
    let s = sample.dim(0)?;
    if s == 0 || sample.dim(1)? != dim {
        bail!("docs: the sampled documents have no tokens of dim {dim} (shape {:?})", sample.dims())
    }
    let tokens = s as f64 / n_sample as f64 * n as f64;
    let k = config.n_centroids.unwrap_or(1 << (16.0 * tokens.sqrt()).log2().floor() as u32).clamp(1, s);
    // 2. k-means over at most K·max_points_per_centroid sampled tokens.
    let points = if s > k * config.max_points_per_centroid {
        random_rows(&sample, k * config.max_points_per_centroid, &mut rng)?
    } else {
        sample.clone()
    };
    device.synchronize()?;
    let t_sample = t.elapsed().as_secs_f64();
    let t = std::time::Instant::now();
    let n_points = points.dim(0)?;
    let centroids =
        kmeans(&points, k, config.kmeans_niters, config.spherical_kmeans, &mut rng, bar)?.to_dtype(DType::F16)?;
    drop(points);
    device.synchronize()?;
    let t_kmeans = t.elapsed().as_secs_f64();
    let t = std::time::Instant::now();
    // 3. The codec, calibrated on 5 % (at most 50 000) as many tokens as the
    // sample has, of documents drawn from the whole collection: as many of them
    // unseen by k-means as of the documents the codec will encode. (Tokens of
    // the sample alone, on which the centroids were fit, have smaller residuals:
    // recall@10 0.968 instead of 0.971 on 100 000 clustered documents.)
    bar.set_message("calibrating buckets");
    drop(sample);
    let h = ((0.05 * s as f64).round() as usize).clamp(1, 50_000);
    let mut all: Vec<u32> = (0..n as u32).collect();
    all.shuffle(&mut rng);
    let (mut held_docs, mut got) = (Vec::new(), 0usize);
    for &d in &all {
        if got >= h {
            break;
        }
        got += docs.doc_len(d as usize);
        held_docs.push(d);
    }
    held_docs.sort_unstable();
    let heldout = gather(docs, &held_docs, device, wd)?;
    let heldout = heldout.narrow(0, 0, h.min(heldout.dim(0)?))?;
    let codec = Codec::calibrated(centroids, &heldout, config.nbits, dim, device)?;
    if config.show_progress {
        eprintln!(
            "training: sample of {n_sample} documents ({s} tokens) read in {t_sample:.2} s; k-means of {n_points} \
             tokens into {k} centroids, {} iterations: {t_kmeans:.2} s; calibration {:.2} s",
            config.kmeans_niters,
            t.elapsed().as_secs_f64()
        );
    }
    Ok(codec)
}

/// The embeddings of documents `ids` (ascending) on `device` in `dtype`,
/// read a few million tokens at a time: the host holds one piece, not the
/// whole sample (gigabytes at tens of millions of tokens).
fn gather(docs: &dyn Documents, ids: &[u32], device: &Device, dtype: DType) -> Result<Tensor> {
    gather_in(docs, ids, device, dtype, 1 << 22)
}

/// [`gather`] in pieces of at most `piece_tokens` tokens (or one document).
fn gather_in(docs: &dyn Documents, ids: &[u32], device: &Device, dtype: DType, piece_tokens: usize) -> Result<Tensor> {
    let mut parts = Vec::new();
    let mut start = 0;
    while start < ids.len() {
        let (mut end, mut tokens) = (start, 0);
        while end < ids.len() && (end == start || tokens + docs.doc_len(ids[end] as usize) <= piece_tokens) {
            tokens += docs.doc_len(ids[end] as usize);
            end += 1;
        }
        parts.push(docs.embeddings(&ids[start..end])?.to_device(device)?.to_dtype(dtype)?);
        start = end;
    }
    match parts.len() {
        0 => docs.embeddings(ids)?.to_device(device)?.to_dtype(dtype),
        1 => Ok(parts.pop().expect("one part")),
        _ => Tensor::cat(&parts, 0),
    }
}

/// Writes the index of `docs` coded by `c` into `dir` (steps 4-5), replacing what is there.
pub(crate) fn write_index(
    dir: &Path,
    docs: &dyn Documents,
    c: &Codec,
    chunk_documents: usize,
    bar: &ProgressBar,
) -> Result<()> {
    check_target(dir)?;
    let st = Staging::new(dir, true)?;
    write_codec(&st, c)?;
    finish(st, docs, c, chunk_documents, 0, bar, &mut |_| Ok(()))
}

/// Steps 4-5 into `st` (holding the codec and chunks `0..done`), calling
/// `on_chunk` with the chunks written after each, then the commit.
fn finish(
    st: Staging,
    docs: &dyn Documents,
    c: &Codec,
    chunk_documents: usize,
    done: usize,
    bar: &ProgressBar,
    on_chunk: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<()> {
    bar.set_message("compressing");
    // The inverted lists spilled to disk chunk by chunk, merged at the end.
    let runs = IvfRuns::new(&st.dir, c.codec.centroids.dim(0)?);
    let mut contents = Contents { chunks: 0, documents: 0, embeddings: 0, ivf: Lists::Runs(runs) };
    contents.count_written(&st, done)?;
    contents.append_from(&st, docs, &c.codec, &c.cutoffs, chunk_documents, done, bar, on_chunk)?;
    // After the device's last chunk, on one host thread.
    let t = std::time::Instant::now();
    match &contents.ivf {
        Lists::Runs(runs) => runs.merge(&st, contents.chunks)?,
        Lists::Memory(ivf) => ivf.write(&st, &[])?,
    }
    let t_merge = t.elapsed().as_secs_f64();
    contents.write_metadata(&st, c.codec.nbits)?;
    let state = st.dir.join(BUILD_STATE);
    if state.exists() {
        std::fs::remove_file(&state).map_err(|e| crate::store::io_err(&state, "remove", e))?;
    }
    st.commit()?;
    if bar.length().is_some() {
        eprintln!(
            "finishing: inverted lists merged in {t_merge:.2} s, metadata and commit {:.2} s",
            t.elapsed().as_secs_f64() - t_merge
        );
    }
    Ok(())
}

/// `Err` unless `dir` may receive a new index (absent, empty, or an index).
fn check_target(dir: &Path) -> Result<()> {
    if dir.exists() && !dir.join("metadata.json").exists() {
        let empty = std::fs::read_dir(dir).map(|mut d| d.next().is_none()).unwrap_or(false);
        if !empty {
            bail!("dir: {} exists and is not an index", dir.display())
        }
    }
    Ok(())
}

/// The build's progress bar on stderr (hidden unless `show`), `len` documents long.
pub(crate) fn progress(show: bool, len: u64, what: &str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg:28} [{bar:40}] {pos}/{len} documents, {elapsed} (ETA {eta})")
            .unwrap()
            .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PackedDocuments;

    /// Gathered in pieces (of 7 tokens: most documents alone) or whole, the same rows.
    #[test]
    fn gather_in_pieces_equals_one_read() -> Result<()> {
        let lens: Vec<u32> = (0..30).map(|i| 1 + (i * 7 % 11)).collect();
        let t: u32 = lens.iter().sum();
        let x = Tensor::randn(0f32, 1., (t as usize, 8), &Device::Cpu)?;
        let docs = PackedDocuments::new(x, &lens)?;
        let ids: Vec<u32> = (0..30).filter(|i| i % 3 != 1).collect();
        let whole = docs.embeddings(&ids)?;
        for piece in [1, 7, 1 << 20] {
            let got = gather_in(&docs, &ids, &Device::Cpu, DType::F32, piece)?;
            assert_eq!(got.dims(), whole.dims());
            let diff = (got - &whole)?.abs()?.sum_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "pieces of {piece} tokens");
        }
        Ok(())
    }
}
