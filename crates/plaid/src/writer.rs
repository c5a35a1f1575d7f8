//! Writing an index's files into a [`Staging`] directory, in fast-plaid's
//! layout (the table in the crate docs): the documents in chunks coded
//! against a codec, the inverted file, the codec and the metadata. Building
//! an index and adding documents to one write their chunks the same way.

use crate::codec::{work_dtype, Codec};
use crate::documents::Documents;
use crate::ivf::{Ivf, IvfRuns};
use crate::npy;
use crate::store::{write_json, Staging};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_maxsim::residual::{nearest_centroids, ResidualCodec};
use indicatif::ProgressBar;
use std::time::{Duration, Instant};

/// The documents of an index being written: its chunks, documents and
/// tokens so far, and its inverted file. New documents are appended after
/// them (new chunks, the next ids), as fast-plaid's update appends them.
pub(crate) struct Contents {
    pub chunks: usize,
    pub documents: usize,
    pub embeddings: usize,
    pub ivf: Lists,
}

/// The inverted lists of the documents being written.
pub(crate) enum Lists {
    /// In memory (an update's lists).
    Memory(Ivf),
    /// Spilled to disk a chunk at a time (a build's).
    Runs(IvfRuns),
}

impl Lists {
    /// Number of lists (centroids).
    pub fn len(&self) -> usize {
        match self {
            Lists::Memory(i) => i.len(),
            Lists::Runs(r) => r.len(),
        }
    }

    /// Adds chunk file `chunk`: its documents `first, first + 1, ...` of
    /// `lens` tokens each, whose tokens have `codes`.
    fn add_chunk(&mut self, chunk: usize, first: u32, lens: &[usize], codes: &[u32]) -> Result<()> {
        match self {
            Lists::Memory(ivf) => {
                let mut at = 0;
                for (k, &l) in lens.iter().enumerate() {
                    ivf.add(first + k as u32, &codes[at..at + l]);
                    at += l;
                }
                Ok(())
            }
            Lists::Runs(runs) => runs.write_run(chunk, first, lens, codes),
        }
    }
}

impl Contents {
    /// Codes `docs` against `codec` and writes them as new chunks of
    /// `chunk_documents` documents, their ids following the last one.
    pub fn append(
        &mut self,
        st: &Staging,
        docs: &dyn Documents,
        codec: &ResidualCodec,
        cutoffs: &Tensor,
        chunk_documents: usize,
        bar: &ProgressBar,
    ) -> Result<()> {
        self.append_from(st, docs, codec, cutoffs, chunk_documents, 0, bar, &mut |_| Ok(()))
    }

    /// [`Self::append`] from chunk `skip` of `docs` on (the earlier ones
    /// already counted in `self`), calling `done` with the number of chunks
    /// of `docs` written after each.
    #[allow(clippy::too_many_arguments)]
    pub fn append_from(
        &mut self,
        st: &Staging,
        docs: &dyn Documents,
        codec: &ResidualCodec,
        cutoffs: &Tensor,
        chunk_documents: usize,
        skip: usize,
        bar: &ProgressBar,
        done: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        let n = docs.len();
        let base = (self.documents - (skip * chunk_documents).min(n)) as u32;
        // A pipeline of two stages: this thread reads and codes chunk after
        // chunk (on the codec's device), a writer thread copies each one's
        // codes and residuals back, writes its files and adds its documents
        // to the inverted lists, at most two chunks behind.
        let mut ivf = std::mem::replace(&mut self.ivf, Lists::Memory(Ivf::new(0)));
        let (tx, rx) = std::sync::mpsc::sync_channel::<Coded>(2);
        let (written_tx, written_rx) = std::sync::mpsc::channel::<usize>();
        // With progress shown (a bar with a length: hidden ones have none, and
        // a bar on a pipe is hidden but keeps its length), where the time went
        // is printed on stderr at the end, the device synchronized after each
        // chunk's reading and coding to tell them apart.
        let profile = bar.length().is_some();
        let dev = codec.centroids.device();
        let (mut read, mut code, mut wait) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        std::thread::scope(|s| -> Result<()> {
            let writer = s.spawn(move || -> Result<(Lists, [Duration; 2])> {
                let (mut write, mut lists) = (Duration::ZERO, Duration::ZERO);
                for c in rx {
                    let t0 = Instant::now();
                    let codes = write_coded(st, &c)?;
                    let t1 = Instant::now();
                    ivf.add_chunk(c.file, base + c.first, &c.lens, &codes)?;
                    (write, lists) = (write + (t1 - t0), lists + t1.elapsed());
                    // The receiver outlives the writer: a failed send only means it stopped early.
                    let _ = written_tx.send(c.ch + 1);
                }
                Ok((ivf, [write, lists]))
            });
            let mut coded = || -> Result<()> {
                for ch in skip..n.div_ceil(chunk_documents) {
                    let ids: Vec<u32> =
                        (ch * chunk_documents..((ch + 1) * chunk_documents).min(n)).map(|d| d as u32).collect();
                    let t0 = Instant::now();
                    let (x, lens) = read_chunk(docs, &ids, dev, codec.centroids.dim(1)?)?;
                    if profile {
                        dev.synchronize()?;
                    }
                    let t1 = Instant::now();
                    let (codes, residuals) = code_chunk(&x, codec, cutoffs)?;
                    let first = ids.first().copied().unwrap_or(0);
                    let c = Coded {
                        ch,
                        file: self.chunks,
                        first,
                        lens,
                        embedding_offset: self.embeddings,
                        codes,
                        residuals,
                    };
                    if profile {
                        dev.synchronize()?;
                    }
                    let t2 = Instant::now();
                    let (t, docs_in) = (c.codes.dim(0)?, ids.len());
                    if tx.send(c).is_err() {
                        break; // the writer failed: its error is reported below
                    }
                    (read, code, wait) = (read + (t1 - t0), code + (t2 - t1), wait + t2.elapsed());
                    self.chunks += 1;
                    self.embeddings += t;
                    self.documents += docs_in;
                    bar.inc(docs_in as u64);
                    while let Ok(w) = written_rx.try_recv() {
                        done(w)?;
                    }
                }
                Ok(())
            };
            let coding = coded();
            drop(tx);
            let (ivf, [write, lists]) =
                writer.join().map_err(|_| candle_core::Error::Msg("writer thread panicked".into()))??;
            coding?;
            if profile {
                eprintln!(
                "coding: read {:.2} s, coded {:.2} s, waited for the writer {:.2} s; writer: copied back and wrote {:.2} s, inverted lists {:.2} s",
                read.as_secs_f64(), code.as_secs_f64(), wait.as_secs_f64(), write.as_secs_f64(), lists.as_secs_f64()
            );
            }
            for w in written_rx.try_iter() {
                done(w)?;
            }
            self.ivf = ivf;
            Ok(())
        })
    }

    /// The chunks `0..k` already in `st`'s directory, counted and their
    /// documents put in the inverted lists (from their codes files).
    pub fn count_written(&mut self, st: &Staging, k: usize) -> Result<()> {
        for i in 0..k {
            let lens = crate::index::chunk_lens(&st.dir, i)?;
            let codes: Vec<i64> =
                npy::read(&st.dir.join(format!("{i}.codes.npy")), &Device::Cpu)?.to_dtype(DType::I64)?.to_vec1()?;
            let t = lens.iter().sum::<usize>();
            if codes.len() != t || codes.iter().any(|&c| c < 0 || c as usize >= self.ivf.len()) {
                bail!("dir: chunk {i} of the build in {} is inconsistent", st.dir.display())
            }
            let codes: Vec<u32> = codes.into_iter().map(|c| c as u32).collect();
            self.ivf.add_chunk(i, self.documents as u32, &lens, &codes)?;
            self.documents += lens.len();
            self.chunks += 1;
            self.embeddings += t;
        }
        Ok(())
    }

    /// Writes `metadata.json` (fast-plaid's) and `plan.json` (ColBERT's).
    pub fn write_metadata(&self, st: &Staging, nbits: usize) -> Result<()> {
        let avg = if self.documents > 0 { self.embeddings as f64 / self.documents as f64 } else { 0.0 };
        write_json(
            &st.file("metadata.json")?,
            &serde_json::json!({
                "avg_doclen": avg, "compress_only": false, "nbits": nbits, "num_chunks": self.chunks,
                "num_documents": self.documents, "num_embeddings": self.embeddings,
                "num_partitions": self.ivf.len(),
            }),
        )?;
        write_json(&st.file("plan.json")?, &serde_json::json!({"nbits": nbits, "num_chunks": self.chunks}))
    }
}

/// A chunk coded on the codec's device, on its way to the writer.
struct Coded {
    /// Its index among the chunks of the documents being appended, and of the index's files.
    ch: usize,
    file: usize,
    /// Its first document, counted from the first appended.
    first: u32,
    lens: Vec<usize>,
    embedding_offset: usize,
    codes: Tensor,
    residuals: Tensor,
}

/// The embeddings `x` of a chunk coded against `codec`: every token's
/// nearest centroid and its compressed residual.
fn code_chunk(x: &Tensor, codec: &ResidualCodec, cutoffs: &Tensor) -> Result<(Tensor, Tensor)> {
    let codes = nearest_centroids(x, &codec.centroids.to_dtype(x.dtype())?)?;
    let residuals = codec.compress(x, &codes, cutoffs)?;
    Ok((codes, residuals))
}

/// The embeddings of documents `ids` (consecutive) of `docs` on `dev`, in
/// the dtype the codec works in, and their lengths.
fn read_chunk(docs: &dyn Documents, ids: &[u32], dev: &Device, dim: usize) -> Result<(Tensor, Vec<usize>)> {
    let x = docs.embeddings(ids)?.to_device(dev)?.to_dtype(work_dtype(dev))?;
    let lens: Vec<usize> = ids.iter().map(|&d| docs.doc_len(d as usize)).collect();
    let t: usize = lens.iter().sum();
    if x.dims() != [t, dim] {
        bail!("docs: embeddings of documents {:?}.. have shape {:?}, expected [{t}, {dim}]", ids.first(), x.dims())
    }
    Ok((x, lens))
}

/// Writes a coded chunk's files: its codes, residuals, document lengths and
/// metadata; returns every token's code, for the inverted file.
fn write_coded(st: &Staging, c: &Coded) -> Result<Vec<u32>> {
    let (i, t) = (c.file, c.codes.dim(0)?);
    let host_codes: Vec<u32> = c.codes.to_vec1()?;
    let codes_i64 = Tensor::from_vec(host_codes.iter().map(|&c| c as i64).collect::<Vec<i64>>(), t, &Device::Cpu)?;
    npy::write(&st.file(&format!("{i}.codes.npy"))?, &codes_i64)?;
    npy::write(&st.file(&format!("{i}.residuals.npy"))?, &c.residuals)?;
    write_json(&st.file(&format!("doclens.{i}.json"))?, &serde_json::json!(c.lens))?;
    write_json(
        &st.file(&format!("{i}.metadata.json"))?,
        &serde_json::json!({"embedding_offset": c.embedding_offset, "num_documents": c.lens.len(), "num_embeddings": t}),
    )?;
    Ok(host_codes)
}

/// Writes the codec's files: centroids, bucket cutoffs and weights, and the
/// calibration fast-plaid's update reads.
pub(crate) fn write_codec(st: &Staging, c: &Codec) -> Result<()> {
    npy::write(&st.file("centroids.npy")?, &c.codec.centroids)?;
    npy::write(&st.file("bucket_cutoffs.npy")?, &c.cutoffs)?;
    npy::write(&st.file("bucket_weights.npy")?, &c.codec.bucket_weights)?;
    npy::write(&st.file("avg_residual.npy")?, &Tensor::new(c.cal.avg_residual.as_slice(), &Device::Cpu)?)?;
    npy::write(&st.file("cluster_threshold.npy")?, &Tensor::new(&[c.cal.cluster_threshold], &Device::Cpu)?)
}
