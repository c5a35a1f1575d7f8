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
        let chunks = n.div_ceil(chunk_documents);
        let chunk_ids = |ch: usize| -> Vec<u32> {
            (ch * chunk_documents..((ch + 1) * chunk_documents).min(n)).map(|d| d as u32).collect()
        };
        // A pipeline of three stages: a reader thread reads chunk after chunk
        // (`Documents::embeddings`: a file's pages, a decoder's output), this
        // thread copies each to the codec's device and codes it, and WRITERS
        // threads copy its codes and residuals back and write its files, side
        // by side; they add the chunks to the inverted lists in order. Each
        // stage runs at most two chunks ahead of the next. Documents whose
        // first chunk comes on a GPU are read on this thread: a reader thread
        // making them (plaid_bench's generated collection) stalled on an
        // H200 (2026-12-04) in its first CUDA call, the cause not found.
        let read_chunk = |ch: usize| -> Result<ReadChunk> {
            let ids = chunk_ids(ch);
            docs.embeddings(&ids).map(|x| (ch, ids, x))
        };
        let first_chunk = (skip < chunks).then(|| read_chunk(skip));
        let read_ahead = matches!(&first_chunk, Some(Ok((_, _, x))) if x.device().is_cpu());
        let ivf = std::mem::replace(&mut self.ivf, Lists::Memory(Ivf::new(0)));
        let (read_tx, read_rx) = std::sync::mpsc::sync_channel::<Result<ReadChunk>>(2);
        let (tx, rx) = std::sync::mpsc::sync_channel::<Coded>(2);
        // Shared by the writers and dropped with the last of them, so that
        // the coder's send fails (instead of waiting) once they all stopped.
        let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
        let (written_tx, written_rx) = std::sync::mpsc::channel::<usize>();
        let lists = Turns { state: std::sync::Mutex::new((skip, Some(ivf))), turn: std::sync::Condvar::new() };
        // With progress shown (a bar with a length: hidden ones have none, and
        // a bar on a pipe is hidden but keeps its length), where the time went
        // is printed on stderr at the end, the device synchronized after each
        // chunk's coding to tell it apart.
        let profile = bar.length().is_some();
        let dev = codec.centroids.device();
        let dim = codec.centroids.dim(1)?;
        let (mut read, mut code, mut wait) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        std::thread::scope(|s| -> Result<()> {
            let reader = read_ahead.then(|| {
                s.spawn(move || -> Duration {
                    let mut busy = Duration::ZERO;
                    for ch in skip + 1..chunks {
                        let t0 = Instant::now();
                        let x = read_chunk(ch);
                        busy += t0.elapsed();
                        let failed = x.is_err();
                        // A closed channel: the coder stopped early (its error is reported).
                        if read_tx.send(x).is_err() || failed {
                            break;
                        }
                    }
                    busy
                })
            });
            let writers: Vec<_> = (0..WRITERS)
                .map(|_| {
                    let (rx, lists, written_tx) = (rx.clone(), &lists, written_tx.clone());
                    s.spawn(move || -> Result<[Duration; 2]> {
                        // A writer that panics releases the others waiting for its turn.
                        let _release = ReleaseOnPanic(lists);
                        let (mut write, mut add) = (Duration::ZERO, Duration::ZERO);
                        loop {
                            // The lock is held only while waiting for the next chunk.
                            let Ok(c) = rx.lock().map_err(|_| poisoned())?.recv() else { break };
                            let t0 = Instant::now();
                            let codes = write_coded(st, &c).inspect_err(|_| lists.fail())?;
                            let t1 = Instant::now();
                            lists.in_turn(c.ch, |ivf| {
                                ivf.add_chunk(c.file, base + c.first, &c.lens, &codes)?;
                                // In turn, so that the counts arrive in order. The receiver
                                // outlives the writers: a failed send only means it stopped early.
                                let _ = written_tx.send(c.ch + 1);
                                Ok(())
                            })?;
                            (write, add) = (write + (t1 - t0), add + t1.elapsed());
                        }
                        Ok([write, add])
                    })
                })
                .collect();
            drop((written_tx, rx));
            let coded = || -> Result<()> {
                let rest: Box<dyn Iterator<Item = Result<ReadChunk>>> =
                    if read_ahead { Box::new(read_rx.iter()) } else { Box::new((skip + 1..chunks).map(read_chunk)) };
                let mut incoming = first_chunk.into_iter().chain(rest);
                loop {
                    // The read (on this thread) or the wait for the reader thread.
                    let t0 = Instant::now();
                    let Some(got) = incoming.next() else { break };
                    let (ch, ids, x) = got?;
                    let (x, lens) = to_work(docs, x, &ids, dev, dim)?;
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
                        break; // the writers failed: their error is reported below
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
            let t_wait = Instant::now();
            let coding = coded();
            drop(tx);
            drop(read_rx);
            let reading = match reader {
                Some(r) => r.join().map_err(|_| candle_core::Error::Msg("reader thread panicked".into()))?,
                None => Duration::ZERO,
            };
            let mut spent = [Duration::ZERO; 2];
            let mut failed = Vec::new();
            for w in writers {
                match w.join().map_err(|_| candle_core::Error::Msg("writer thread panicked".into()))? {
                    Ok([a, b]) => (spent[0], spent[1]) = (spent[0] + a, spent[1] + b),
                    Err(e) => failed.push(e),
                }
            }
            // The failing writer's error, not the others' report of it.
            let released = |e: &candle_core::Error| e.to_string().contains(ANOTHER_FAILED);
            if let Some(i) = failed.iter().position(|e| !released(e)).or((!failed.is_empty()).then_some(0)) {
                return Err(failed.swap_remove(i));
            }
            coding?;
            if profile {
                let total = t_wait.elapsed().as_secs_f64();
                eprintln!(
                    "coding: {total:.2} s in all: reader thread busy {:.2} s; read or waited for the reader {:.2} s, coded {:.2} s, \
                     waited for the writers {:.2} s; {WRITERS} writers: copied back and wrote {:.2} s, inverted lists {:.2} s",
                    reading.as_secs_f64(),
                    read.as_secs_f64(),
                    code.as_secs_f64(),
                    wait.as_secs_f64(),
                    spent[0].as_secs_f64(),
                    spent[1].as_secs_f64()
                );
            }
            for w in written_rx.try_iter() {
                done(w)?;
            }
            Ok(())
        })?;
        let (_, ivf) = lists.state.into_inner().map_err(|_| poisoned())?;
        self.ivf = ivf.ok_or_else(|| candle_core::Error::Msg("the inverted lists were lost".into()))?;
        Ok(())
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

/// A chunk read: its index, its documents and their embeddings.
type ReadChunk = (usize, Vec<u32>, Tensor);

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

/// Chunk `x` (the embeddings of documents `ids`, read from `docs`) on
/// `dev` in the dtype the codec works in, checked, and its documents'
/// lengths.
fn to_work(docs: &dyn Documents, x: Tensor, ids: &[u32], dev: &Device, dim: usize) -> Result<(Tensor, Vec<usize>)> {
    let x = x.to_device(dev)?.to_dtype(work_dtype(dev))?;
    let lens: Vec<usize> = ids.iter().map(|&d| docs.doc_len(d as usize)).collect();
    let t: usize = lens.iter().sum();
    if x.dims() != [t, dim] {
        bail!("docs: embeddings of documents {:?}.. have shape {:?}, expected [{t}, {dim}]", ids.first(), x.dims())
    }
    Ok((x, lens))
}

/// Writer threads: each chunk's copies back and file writes are mostly
/// waits (on the device's stream, on the file system's sync), so several
/// overlap them.
const WRITERS: usize = 3;

/// The inverted lists shared by the writers, each chunk added in its turn
/// (the chunk index next to add); `None` once a writer failed, so that the
/// others stop waiting.
struct Turns {
    state: std::sync::Mutex<(usize, Option<Lists>)>,
    turn: std::sync::Condvar,
}

impl Turns {
    /// Runs `f` on the lists once every chunk before `ch` was added.
    fn in_turn(&self, ch: usize, f: impl FnOnce(&mut Lists) -> Result<()>) -> Result<()> {
        let mut g = self.state.lock().map_err(|_| poisoned())?;
        while g.0 != ch && g.1.is_some() {
            g = self.turn.wait(g).map_err(|_| poisoned())?;
        }
        let Some(lists) = g.1.as_mut() else { bail!("{ANOTHER_FAILED}") };
        let r = f(lists);
        if r.is_ok() {
            g.0 += 1;
        } else {
            g.1 = None;
        }
        self.turn.notify_all();
        r
    }

    /// Stops the writers waiting for their turn (one failed).
    fn fail(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1 = None;
        self.turn.notify_all();
    }
}

/// The error of the writers a failing one released.
const ANOTHER_FAILED: &str = "another writer failed";

/// Calls [`Turns::fail`] when dropped by a panicking thread.
struct ReleaseOnPanic<'a>(&'a Turns);

impl Drop for ReleaseOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.fail();
        }
    }
}

fn poisoned() -> candle_core::Error {
    candle_core::Error::Msg("a writer thread panicked".into())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn turns(first: usize) -> Turns {
        Turns {
            state: std::sync::Mutex::new((first, Some(Lists::Memory(Ivf::new(4))))),
            turn: std::sync::Condvar::new(),
        }
    }

    #[test]
    fn chunks_are_added_in_order_whatever_order_writers_finish() {
        let t = turns(3);
        let order = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            // Chunks 3..11, the writers started last chunk first.
            for ch in (3..11).rev() {
                let (t, order) = (&t, &order);
                s.spawn(move || {
                    t.in_turn(ch, |l| {
                        order.lock().unwrap().push(ch);
                        l.add_chunk(ch, ch as u32, &[1], &[ch as u32 % 4])
                    })
                    .unwrap()
                });
            }
        });
        assert_eq!(order.into_inner().unwrap(), (3..11).collect::<Vec<_>>());
        let (next, lists) = t.state.into_inner().unwrap();
        let Some(Lists::Memory(ivf)) = lists else { panic!("lists lost") };
        assert_eq!(next, 11);
        let (ids, offsets) = ivf.csr(&[]);
        assert_eq!((ids, offsets), (vec![4, 8, 5, 9, 6, 10, 3, 7], vec![0, 2, 4, 6, 8]));
    }

    #[test]
    fn a_failed_writer_releases_the_others() {
        let t = turns(0);
        std::thread::scope(|s| {
            // Chunks 1 and 2 wait for chunk 0, whose writer fails.
            let waiting: Vec<_> = (1..3)
                .map(|ch| {
                    s.spawn({
                        let t = &t;
                        move || t.in_turn(ch, |_| Ok(()))
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(20));
            t.fail();
            for w in waiting {
                let e = w.join().unwrap().unwrap_err().to_string();
                assert!(e.contains("another writer failed"), "{e}");
            }
        });
        assert!(t.in_turn(0, |_| Ok(())).is_err());
        // A failing addition also releases them.
        let t = turns(0);
        std::thread::scope(|s| {
            let later = s.spawn(|| t.in_turn(1, |_| Ok(())));
            assert!(t.in_turn(0, |_| candle_core::bail!("disk full")).is_err());
            assert!(later.join().unwrap().is_err());
        });
    }
}
