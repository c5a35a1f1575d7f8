//! Building an index, and its life cycle: adding documents (compressed
//! against the existing codec) and deleting them (ids stay stable). Every
//! change is written to a staging directory and renamed into place, so a
//! failure leaves the index on disk as it was.
//!
//! Building follows fast-plaid 1.7 (its formulas and defaults): a sample of
//! `min(1 + 16·√(120·N), N)` documents; `K = 2^⌊log2(16·√(tokens))⌋`
//! centroids (at most the sampled tokens) by k-means over at most
//! `K · max_points_per_centroid` sampled tokens, `kmeans_niters` iterations
//! from random tokens; the bucket cutoffs and weights from as many tokens
//! as 5 % of the sample (at most 50 000), of documents drawn from the whole
//! collection, as quantiles of their pooled residual values. k-means assigns by Euclidean distance, as fastkmeans does (or,
//! with `spherical_kmeans`, by dot product to unit centroids); tokens are
//! then coded by the largest dot product with the unit centroids. Samples
//! are drawn with this crate's seeded generator, so the centroids are not
//! fast-plaid's own, but an index of either engine is searched by both.

use crate::documents::Documents;
use crate::index::{PlaidIndex, DELETED};
use crate::npy;
use crate::store::{read_json, write_json, Staging};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_maxsim::{
    l2_normalize,
    nn::scatter_add_rows,
    residual::{nearest_centroids, BitOrder, ResidualCodec},
};
use indicatif::{ProgressBar, ProgressStyle};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
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
    /// every iteration (spherical), instead of by Euclidean distance to the
    /// means (fast-plaid's, the default), normalized once at the end.
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
            spherical_kmeans: false,
            show_progress: false,
        }
    }
}

/// The dtype k-means and coding run in on `device`: F16 on CUDA (tensor
/// cores, the centroids' stored dtype), F32 on the CPU.
fn work_dtype(device: &Device) -> DType {
    if device.is_cuda() {
        DType::F16
    } else {
        DType::F32
    }
}

/// For each row of `points [S, dim]`, the row of `centroids [K, dim]` of
/// largest dot product (both in the same dtype).
pub(crate) fn nearest(points: &Tensor, centroids: &Tensor) -> Result<Tensor> {
    nearest_centroids(points, centroids)
}

/// k-means of `points [S, dim]` (in the work dtype) into `k` centroids
/// `[k, dim]` F32, unit vectors: spherical (assignment by dot product to the
/// normalized centroids), or Euclidean (to the means, as fastkmeans:
/// argmin ‖x − c‖² = argmax x·c − ‖c‖²/2, the dot product of `[x, 1]` and
/// `[c, −‖c‖²/2]`), normalized at the end.
fn kmeans(
    points: &Tensor,
    k: usize,
    iters: usize,
    spherical: bool,
    rng: &mut impl Rng,
    bar: &ProgressBar,
) -> Result<Tensor> {
    let (s, dim) = points.dims2()?;
    let dev = points.device().clone();
    let pick = |rng: &mut dyn rand::RngCore, n: usize| -> Result<Tensor> {
        let ids: Vec<u32> = rand::seq::index::sample(rng, s, n).into_iter().map(|i| i as u32).collect();
        Tensor::from_vec(ids, n, &dev)
    };
    // Euclidean: the points once with a column of ones (padded to a multiple of 8 columns).
    let pad = 8;
    let augmented = if spherical {
        None
    } else {
        let extra = Tensor::cat(
            &[&Tensor::ones((s, 1), points.dtype(), &dev)?, &Tensor::zeros((s, pad - 1), points.dtype(), &dev)?],
            1,
        )?;
        Some(Tensor::cat(&[points, &extra], 1)?)
    };
    let init = points.index_select(&pick(rng, k)?, 0)?.to_dtype(DType::F32)?;
    let mut cents = if spherical { l2_normalize(&init)? } else { init };
    for it in 0..iters {
        bar.set_message(format!("k-means iteration {}/{iters}", it + 1));
        let codes = match &augmented {
            None => nearest(points, &cents.to_dtype(points.dtype())?)?,
            Some(x) => {
                let half_sq = (cents.sqr()?.sum_keepdim(1)? * -0.5)?;
                let c = Tensor::cat(&[&cents, &half_sq, &Tensor::zeros((k, pad - 1), DType::F32, &dev)?], 1)?;
                nearest(x, &c.to_dtype(points.dtype())?)?
            }
        };
        let sums = scatter_add_rows(points, &codes, k)?;
        let counts = scatter_add_rows(&Tensor::ones((s, 1), DType::F32, &dev)?, &codes, k)?;
        let updated =
            if spherical { l2_normalize(&sums)? } else { sums.broadcast_div(&counts.clamp(1f32, f32::MAX)?)? };
        let counts: Vec<f32> = counts.flatten_all()?.to_vec1()?;
        cents = if counts.iter().all(|&c| c > 0.0) {
            updated
        } else {
            // Empty clusters restart from random tokens (as fastkmeans does).
            let fresh = points.index_select(&pick(rng, k)?, 0)?.to_dtype(DType::F32)?;
            let fresh = if spherical { l2_normalize(&fresh)? } else { fresh };
            let keep: Vec<u8> = counts.iter().map(|&c| u8::from(c > 0.0)).collect();
            let keep = Tensor::from_vec(keep, (k, 1), &dev)?.broadcast_as(updated.shape())?;
            keep.where_cond(&updated, &fresh)?
        };
        let _ = dim;
    }
    l2_normalize(&cents)
}

/// numpy's "linear" quantile of sorted values.
fn quantile(sorted: &[f32], q: f64) -> f32 {
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    let f = (pos - lo as f64) as f32;
    sorted[lo] + (sorted[hi] - sorted[lo]) * f
}

/// The trained codec and its calibration, from held-out tokens.
struct Calibration {
    cutoffs: Vec<f32>,
    weights: Vec<f32>,
    avg_residual: Vec<f32>,
    cluster_threshold: f32,
}

fn calibrate(heldout: &Tensor, centroids: &Tensor, nbits: usize) -> Result<Calibration> {
    let codes = nearest(heldout, centroids)?;
    let res = (heldout.to_dtype(DType::F32)? - centroids.to_dtype(DType::F32)?.index_select(&codes, 0)?)?;
    let (h, dim) = res.dims2()?;
    let norms: Vec<f32> = res.sqr()?.sum(1)?.sqrt()?.to_vec1()?;
    let avg_residual: Vec<f32> = res.abs()?.mean(0)?.to_vec1()?;
    let mut vals: Vec<f32> = res.flatten_all()?.to_vec1()?;
    vals.sort_by(f32::total_cmp);
    let mut norms = norms;
    norms.sort_by(f32::total_cmp);
    let n = 1usize << nbits;
    let _ = (h, dim);
    Ok(Calibration {
        cutoffs: (1..n).map(|i| quantile(&vals, i as f64 / n as f64)).collect(),
        weights: (0..n).map(|i| quantile(&vals, (i as f64 + 0.5) / n as f64)).collect(),
        avg_residual,
        cluster_threshold: quantile(&norms, 0.75),
    })
}

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

/// The inverted file: each centroid's documents, ascending (documents are
/// added in id order, so a list is sorted and deduplicated by comparing
/// with its last entry).
struct Ivf {
    lists: Vec<Vec<u32>>,
}

impl Ivf {
    fn add(&mut self, doc: u32, codes: &[u32]) {
        for &c in codes {
            let l = &mut self.lists[c as usize];
            if l.last() != Some(&doc) {
                l.push(doc);
            }
        }
    }

    fn write(&self, st: &Staging, skip: &[u32]) -> Result<()> {
        let mut ids = Vec::new();
        let mut lens = Vec::with_capacity(self.lists.len());
        for l in &self.lists {
            let before = ids.len();
            ids.extend(l.iter().filter(|d| skip.binary_search(d).is_err()).map(|&d| d as i64));
            lens.push((ids.len() - before) as i32);
        }
        let n = ids.len();
        npy::write(&st.file("ivf.npy")?, &Tensor::from_vec(ids, n, &Device::Cpu)?)?;
        let k = lens.len();
        npy::write(&st.file("ivf_lengths.npy")?, &Tensor::from_vec(lens, k, &Device::Cpu)?)
    }
}

/// Writes chunk `i` (documents `ids`, consecutive) of `docs` coded against
/// `codec`: its codes, residuals, document lengths and metadata; returns
/// (tokens, every token's code) for the inverted file.
fn write_chunk(
    st: &Staging,
    i: usize,
    docs: &dyn Documents,
    ids: &[u32],
    codec: &ResidualCodec,
    cutoffs: &Tensor,
    embedding_offset: usize,
) -> Result<(usize, Vec<u32>)> {
    let dev = codec.centroids.device();
    let x = docs.embeddings(ids)?.to_device(dev)?.to_dtype(work_dtype(dev))?;
    let lens: Vec<usize> = ids.iter().map(|&d| docs.doc_len(d as usize)).collect();
    let t: usize = lens.iter().sum();
    if x.dims() != [t, codec.centroids.dim(1)?] {
        bail!(
            "docs: embeddings of documents {:?}.. have shape {:?}, expected [{t}, {}]",
            ids.first(),
            x.dims(),
            codec.centroids.dim(1)?
        )
    }
    let codes = nearest(&x, &codec.centroids.to_dtype(x.dtype())?)?;
    let residuals = codec.compress(&x, &codes, cutoffs)?;
    let host_codes: Vec<u32> = codes.to_vec1()?;
    let codes_i64 = Tensor::from_vec(host_codes.iter().map(|&c| c as i64).collect::<Vec<i64>>(), t, &Device::Cpu)?;
    npy::write(&st.file(&format!("{i}.codes.npy"))?, &codes_i64)?;
    npy::write(&st.file(&format!("{i}.residuals.npy"))?, &residuals)?;
    write_json(&st.file(&format!("doclens.{i}.json"))?, &serde_json::json!(lens))?;
    write_json(
        &st.file(&format!("{i}.metadata.json"))?,
        &serde_json::json!({"embedding_offset": embedding_offset, "num_documents": ids.len(), "num_embeddings": t}),
    )?;
    Ok((t, host_codes))
}

fn write_metadata(
    st: &Staging,
    nbits: usize,
    num_chunks: usize,
    num_documents: usize,
    num_embeddings: usize,
    k: usize,
) -> Result<()> {
    let avg = if num_documents > 0 { num_embeddings as f64 / num_documents as f64 } else { 0.0 };
    write_json(
        &st.file("metadata.json")?,
        &serde_json::json!({
            "avg_doclen": avg, "compress_only": false, "nbits": nbits, "num_chunks": num_chunks,
            "num_documents": num_documents, "num_embeddings": num_embeddings, "num_partitions": k,
        }),
    )?;
    write_json(&st.file("plan.json")?, &serde_json::json!({"nbits": nbits, "num_chunks": num_chunks}))
}

/// A trained codec: what every document of an index (or of its shards) is coded against.
pub(crate) struct Codec {
    codec: ResidualCodec,
    cutoffs: Tensor,
    cal: Calibration,
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
    let sample = docs.embeddings(&ids)?.to_device(device)?.to_dtype(wd)?;
    let s = sample.dim(0)?;
    if s == 0 || sample.dim(1)? != dim {
        bail!("docs: the sampled documents have no tokens of dim {dim} (shape {:?})", sample.dims())
    }
    let tokens = s as f64 / n_sample as f64 * n as f64;
    let k = config.n_centroids.unwrap_or(1 << (16.0 * tokens.sqrt()).log2().floor() as u32).clamp(1, s);
    // 2. k-means over at most K·max_points_per_centroid sampled tokens.
    let points = if s > k * config.max_points_per_centroid {
        let keep: Vec<u32> = rand::seq::index::sample(&mut rng, s, k * config.max_points_per_centroid)
            .into_iter()
            .map(|i| i as u32)
            .collect();
        let nk = keep.len();
        sample.index_select(&Tensor::from_vec(keep, nk, device)?, 0)?
    } else {
        sample.clone()
    };
    let centroids =
        kmeans(&points, k, config.kmeans_niters, config.spherical_kmeans, &mut rng, bar)?.to_dtype(DType::F16)?;
    drop(points);
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
    let heldout = docs.embeddings(&held_docs)?.to_device(device)?.to_dtype(wd)?;
    let heldout = heldout.narrow(0, 0, h.min(heldout.dim(0)?))?;
    let cal = calibrate(&heldout, &centroids.to_dtype(wd)?, config.nbits)?;
    let codec = ResidualCodec {
        centroids,
        bucket_weights: Tensor::new(cal.weights.as_slice(), device)?,
        nbits: config.nbits,
        bit_order: BitOrder::ColBert,
    };
    codec.check(dim)?;
    let cutoffs = Tensor::new(cal.cutoffs.as_slice(), device)?;
    Ok(Codec { codec, cutoffs, cal })
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
    let (codec, n) = (&c.codec, docs.len());
    let k = codec.centroids.dim(0)?;
    let st = Staging::new(dir, true)?;
    bar.set_message("compressing");
    let mut ivf = Ivf { lists: vec![Vec::new(); k] };
    let mut total = 0;
    let n_chunks = n.div_ceil(chunk_documents);
    for ch in 0..n_chunks {
        let ids: Vec<u32> = (ch * chunk_documents..((ch + 1) * chunk_documents).min(n)).map(|d| d as u32).collect();
        let (t, codes) = write_chunk(&st, ch, docs, &ids, codec, &c.cutoffs, total)?;
        let mut at = 0;
        for &d in &ids {
            let l = docs.doc_len(d as usize);
            ivf.add(d, &codes[at..at + l]);
            at += l;
        }
        total += t;
        bar.inc(ids.len() as u64);
    }
    ivf.write(&st, &[])?;
    npy::write(&st.file("centroids.npy")?, &codec.centroids)?;
    npy::write(&st.file("bucket_cutoffs.npy")?, &c.cutoffs)?;
    npy::write(&st.file("bucket_weights.npy")?, &codec.bucket_weights)?;
    npy::write(&st.file("avg_residual.npy")?, &Tensor::new(c.cal.avg_residual.as_slice(), &Device::Cpu)?)?;
    npy::write(&st.file("cluster_threshold.npy")?, &Tensor::new(&[c.cal.cluster_threshold], &Device::Cpu)?)?;
    write_metadata(&st, codec.nbits, n_chunks, n, total, k)?;
    st.commit()
}

/// Builds an index of `docs` in `dir` on `device` (replacing an index
/// there; refusing a non-empty directory that is not one) and opens it.
pub fn create(
    dir: impl AsRef<Path>,
    docs: &dyn Documents,
    config: &IndexConfig,
    device: &Device,
) -> Result<PlaidIndex> {
    let dir = dir.as_ref();
    check_target(dir)?;
    let bar = progress(config.show_progress, docs.len() as u64, "sampling");
    let c = train(docs, config, device, &bar)?;
    write_index(dir, docs, &c, config.chunk_documents, &bar)?;
    bar.finish_and_clear();
    PlaidIndex::load(dir, device)
}

impl PlaidIndex {
    /// Adds `docs` to the index: compressed against its codec (centroids and
    /// bucket cutoffs unchanged, as fast-plaid's update), written as new
    /// chunks, their documents appended to the inverted lists. The new
    /// documents get the ids after the last one, returned as a range; the
    /// index is reopened.
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
        let n_chunks = crate::store::json_usize(&meta, "num_chunks", &meta_path)?.unwrap_or(0);
        let first = self.num_documents();
        let st = Staging::new(&self.dir, false)?;
        let mut ivf = self.ivf_lists()?;
        let mut total = *self.offsets.last().unwrap() as usize;
        let n_new = docs.len();
        let chunks = n_new.div_ceil(chunk_documents);
        for c in 0..chunks {
            let local: Vec<u32> =
                (c * chunk_documents..((c + 1) * chunk_documents).min(n_new)).map(|d| d as u32).collect();
            let (t, codes) = write_chunk(&st, n_chunks + c, docs, &local, &self.codec, &cutoffs, total)?;
            let mut at = 0;
            for &d in &local {
                let l = docs.doc_len(d as usize);
                ivf.add((first + d as usize) as u32, &codes[at..at + l]);
                at += l;
            }
            total += t;
        }
        ivf.write(&st, &self.deleted)?;
        write_metadata(&st, self.codec.nbits, n_chunks + chunks, first + n_new, total, self.num_centroids())?;
        st.commit()?;
        *self = PlaidIndex::load(&self.dir, self.device())?;
        Ok(first as u32..(first + n_new) as u32)
    }

    /// Deletes documents `ids`: they are never returned again and are
    /// dropped from the inverted file (so fast-plaid does not find them
    /// either); every other document keeps its id. Recorded in `deleted.json`.
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
        self.ivf_lists()?.write(&st, &deleted)?;
        write_json(&st.file(DELETED)?, &serde_json::json!({"deleted": deleted}))?;
        st.commit()?;
        *self = PlaidIndex::load(&self.dir, self.device())?;
        Ok(())
    }

    /// The inverted lists rebuilt from the codes (deleted documents included).
    fn ivf_lists(&self) -> Result<Ivf> {
        let codes: Vec<u32> = self.codes.to_device(&Device::Cpu)?.to_vec1()?;
        let mut ivf = Ivf { lists: vec![Vec::new(); self.num_centroids()] };
        for d in 0..self.num_documents() {
            ivf.add(d as u32, &codes[self.offsets[d] as usize..self.offsets[d + 1] as usize]);
        }
        Ok(ivf)
    }
}
