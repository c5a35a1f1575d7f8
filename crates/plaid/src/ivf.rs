//! The inverted file being written: each centroid's documents, ascending,
//! as `ivf.npy` (I64 ids, the lists back to back) and `ivf_lengths.npy`
//! (I32). Two forms: [`Ivf`], the lists in memory (updates: the lists of
//! the documents added since the last compaction, and compaction), and
//! [`IvfRuns`], a build's lists spilled to disk chunk by chunk and merged
//! into the files at the end, so that the host holds no list of the whole
//! collection (at a billion tokens, the lists are gigabytes).

use crate::npy;
use crate::store::{io_err, Staging};
use candle_core::{bail, Device, Result, Tensor};
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

/// The lists in memory. Documents are added in id order, so a list is
/// sorted and deduplicated by comparing with its last entry.
pub(crate) struct Ivf {
    lists: Vec<Vec<u32>>,
}

impl Ivf {
    /// `k` empty lists.
    pub fn new(k: usize) -> Self {
        Self { lists: vec![Vec::new(); k] }
    }

    /// Number of lists (centroids).
    pub fn len(&self) -> usize {
        self.lists.len()
    }

    /// Adds document `doc` to the lists of its tokens' `codes`.
    pub fn add(&mut self, doc: u32, codes: &[u32]) {
        for &c in codes {
            let l = &mut self.lists[c as usize];
            if l.last() != Some(&doc) {
                l.push(doc);
            }
        }
    }

    /// The lists of an inverted file held as document ids `ids` and list
    /// offsets `offsets` (`[C + 1]`).
    pub fn from_csr(ids: &[u32], offsets: &[u32]) -> Self {
        Self { lists: offsets.windows(2).map(|w| ids[w[0] as usize..w[1] as usize].to_vec()).collect() }
    }

    /// The lists, less the documents `skip` (ascending), as `(ids, offsets [C + 1])`.
    pub fn csr(&self, skip: &[u32]) -> (Vec<u32>, Vec<u32>) {
        let mut ids = Vec::new();
        let mut offsets = Vec::with_capacity(self.lists.len() + 1);
        offsets.push(0u32);
        for l in &self.lists {
            ids.extend(l.iter().filter(|d| skip.binary_search(d).is_err()));
            offsets.push(ids.len() as u32);
        }
        (ids, offsets)
    }

    /// Each list of `self` followed by the same list of `later` (whose
    /// documents all come after `self`'s).
    pub fn then(mut self, later: Ivf) -> Self {
        for (l, m) in self.lists.iter_mut().zip(later.lists) {
            l.extend(m);
        }
        self
    }

    /// Writes `ivf.npy` and `ivf_lengths.npy`, less the documents `skip` (ascending).
    pub fn write(&self, st: &Staging, skip: &[u32]) -> Result<()> {
        self.write_as(st, "ivf", skip)
    }

    /// Writes `STEM.npy` and `STEM_lengths.npy`, less the documents `skip`,
    /// streamed from the lists (no copy of them).
    pub fn write_as(&self, st: &Staging, stem: &str, skip: &[u32]) -> Result<()> {
        let kept = |l: &Vec<u32>| l.iter().filter(|d| skip.binary_search(d).is_err()).count();
        let lens: Vec<i32> = self.lists.iter().map(|l| kept(l) as i32).collect();
        let n = lens.iter().map(|&l| l as usize).sum();
        npy::write_i64_stream(&st.file(&format!("{stem}.npy"))?, n, |out| {
            for d in self.lists.iter().flatten().filter(|d| skip.binary_search(d).is_err()) {
                out(*d as i64)?;
            }
            Ok(())
        })?;
        write_lengths(st, stem, lens)
    }
}

fn write_lengths(st: &Staging, stem: &str, lens: Vec<i32>) -> Result<()> {
    let k = lens.len();
    npy::write(&st.file(&format!("{stem}_lengths.npy"))?, &Tensor::from_vec(lens, k, &Device::Cpu)?)
}

/// A build's inverted lists on disk: one run file per chunk in the staging
/// directory (`ivf_run.{chunk}.bin`: the chunk's `(centroid, document)`
/// pairs, each once, ordered by centroid then document, as little-endian
/// u32s), merged into `ivf.npy` / `ivf_lengths.npy` by [`IvfRuns::merge`].
/// A chunk's run is a function of its codes alone: a resumed build makes the
/// runs of its finished chunks again from their codes files, so a run needs
/// no sync to disk.
pub(crate) struct IvfRuns {
    dir: PathBuf,
    k: usize,
}

impl IvfRuns {
    /// Runs of `k` lists in `dir` (a staging directory).
    pub fn new(dir: &Path, k: usize) -> Self {
        Self { dir: dir.to_path_buf(), k }
    }

    /// Number of lists (centroids).
    pub fn len(&self) -> usize {
        self.k
    }

    fn path(&self, chunk: usize) -> PathBuf {
        self.dir.join(format!("ivf_run.{chunk}.bin"))
    }

    /// Writes chunk `chunk`'s run: its documents `first, first + 1, ...` of
    /// `lens` tokens each, whose tokens have `codes` (a counting sort by
    /// centroid: documents stay in id order within a list).
    pub fn write_run(&self, chunk: usize, first: u32, lens: &[usize], codes: &[u32]) -> Result<()> {
        if lens.iter().sum::<usize>() != codes.len() {
            bail!("ivf: chunk {chunk}: {} codes for documents of {} tokens", codes.len(), lens.iter().sum::<usize>())
        }
        if let Some(&c) = codes.iter().find(|&&c| c as usize >= self.k) {
            bail!("ivf: chunk {chunk}: code {c} is out of range for {} centroids", self.k)
        }
        // Each (centroid, document) once: `last[c]` is the last document counted in list c.
        let docs = || {
            let mut at = 0;
            lens.iter().enumerate().map(move |(i, &l)| {
                at += l;
                (first + i as u32, &codes[at - l..at])
            })
        };
        let (mut start, mut last) = (vec![0u32; self.k + 1], vec![u32::MAX; self.k]);
        for (d, cs) in docs() {
            for &c in cs {
                if last[c as usize] != d {
                    last[c as usize] = d;
                    start[c as usize + 1] += 1;
                }
            }
        }
        for c in 0..self.k {
            start[c + 1] += start[c];
        }
        let mut pairs = vec![0u32; 2 * start[self.k] as usize];
        last.fill(u32::MAX);
        for (d, cs) in docs() {
            for &c in cs {
                if last[c as usize] != d {
                    last[c as usize] = d;
                    let at = start[c as usize] as usize;
                    (pairs[2 * at], pairs[2 * at + 1]) = (c, d);
                    start[c as usize] += 1;
                }
            }
        }
        let path = self.path(chunk);
        let io = |e| io_err(&path, "write", e);
        let bytes: Vec<u8> = pairs.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&path, bytes).map_err(io)
    }

    /// Merges the runs of chunks `0..chunks` into `ivf.npy` and
    /// `ivf_lengths.npy` in `st` (each list: its documents in chunk order,
    /// so ascending), then removes the runs. Reads every run once, in step;
    /// holds a buffer per run and the list lengths.
    pub fn merge(&self, st: &Staging, chunks: usize) -> Result<()> {
        let mut runs = Vec::with_capacity(chunks);
        let mut n = 0usize;
        for i in 0..chunks {
            let path = self.path(i);
            let f = std::fs::File::open(&path).map_err(|e| io_err(&path, "open", e))?;
            let bytes = f.metadata().map_err(|e| io_err(&path, "read", e))?.len() as usize;
            if !bytes.is_multiple_of(8) {
                bail!("ivf: {} is not whole (centroid, document) pairs", path.display())
            }
            n += bytes / 8;
            let mut r = Run { path, reader: BufReader::with_capacity(1 << 16, f), next: None };
            r.advance()?;
            runs.push(r);
        }
        let mut lens = vec![0i32; self.k];
        npy::write_i64_stream(&st.file("ivf.npy")?, n, |out| {
            for (c, len) in lens.iter_mut().enumerate() {
                for r in runs.iter_mut() {
                    while let Some((rc, d)) = r.next {
                        if rc as usize != c {
                            if (rc as usize) < c {
                                bail!("ivf: {} is not ordered by centroid", r.path.display())
                            }
                            break;
                        }
                        out(d as i64)?;
                        *len += 1;
                        r.advance()?;
                    }
                }
            }
            match runs.iter().find(|r| r.next.is_some()) {
                Some(r) => bail!("ivf: {} holds a centroid past the last of {}", r.path.display(), self.k),
                None => Ok(()),
            }
        })?;
        write_lengths(st, "ivf", lens)?;
        for r in runs {
            std::fs::remove_file(&r.path).map_err(|e| io_err(&r.path, "remove", e))?;
        }
        Ok(())
    }
}

/// A run being merged: its next pair, `None` at its end.
struct Run {
    path: PathBuf,
    reader: BufReader<std::fs::File>,
    next: Option<(u32, u32)>,
}

impl Run {
    fn advance(&mut self) -> Result<()> {
        let mut b = [0u8; 8];
        self.next = match self.reader.read_exact(&mut b) {
            Ok(()) => {
                Some((u32::from_le_bytes([b[0], b[1], b[2], b[3]]), u32::from_le_bytes([b[4], b[5], b[6], b[7]])))
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => None,
            Err(e) => return Err(io_err(&self.path, "read", e)),
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Chunks of random documents (empty ones, repeated codes, lists left
    /// empty) spilled as runs and merged: the same files, byte for byte,
    /// as the lists in memory write; the runs are gone after.
    #[test]
    fn merged_runs_equal_the_lists_in_memory() -> Result<()> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for (k, chunks) in [(1usize, 1usize), (5, 3), (64, 7), (300, 12)] {
            let root = candle_maxsim_testing::tmpdir("ivf-runs");
            let (a, b) = (Staging::new(&root.join("memory"), true)?, Staging::new(&root.join("runs"), true)?);
            let (mut memory, runs) = (Ivf::new(k), IvfRuns::new(&b.dir, k));
            let mut doc = 0u32;
            for ch in 0..chunks {
                let lens: Vec<usize> = (0..rng.random_range(0..20)).map(|_| rng.random_range(0..12)).collect();
                // Codes drawn from a few centroids: repeats within a document.
                let codes: Vec<u32> =
                    (0..lens.iter().sum()).map(|_| rng.random_range(0..k.div_ceil(2)) as u32 * 2 % k as u32).collect();
                runs.write_run(ch, doc, &lens, &codes)?;
                let mut at = 0;
                for &l in &lens {
                    memory.add(doc, &codes[at..at + l]);
                    (doc, at) = (doc + 1, at + l);
                }
            }
            memory.write(&a, &[])?;
            runs.merge(&b, chunks)?;
            for f in ["ivf.npy", "ivf_lengths.npy"] {
                assert_eq!(
                    std::fs::read(a.dir.join(f)).unwrap(),
                    std::fs::read(b.dir.join(f)).unwrap(),
                    "{f}, k = {k}"
                );
            }
            let left: Vec<_> = std::fs::read_dir(&b.dir).unwrap().map(|e| e.unwrap().file_name()).collect();
            assert_eq!(left.len(), 2, "only the two files remain: {left:?}");
            std::fs::remove_dir_all(&root).unwrap();
        }
        Ok(())
    }

    /// A code past the centroids is an error; a run out of centroid order,
    /// one naming a centroid past the last, or one of a partial pair is an
    /// error naming the run.
    #[test]
    fn bad_runs_are_errors() -> Result<()> {
        let root = candle_maxsim_testing::tmpdir("ivf-bad");
        let st = Staging::new(&root.join("i"), true)?;
        let runs = IvfRuns::new(&st.dir, 4);
        assert!(runs.write_run(0, 0, &[2], &[1, 4]).unwrap_err().to_string().contains("code 4"));
        assert!(runs.write_run(0, 0, &[2], &[1]).is_err());
        let pairs = |v: &[u32]| -> Vec<u8> { v.iter().flat_map(|v| v.to_le_bytes()).collect() };
        for (bytes, want) in [
            (pairs(&[3, 0, 1, 1]), "not ordered by centroid"),
            (pairs(&[0, 1, 1, 1, 4, 2]), "past the last"),
            (vec![0u8; 12], "not whole"),
        ] {
            std::fs::write(st.dir.join("ivf_run.0.bin"), bytes).unwrap();
            let err = runs.merge(&st, 1).unwrap_err().to_string();
            assert!(err.contains(want) && err.contains("ivf_run.0.bin"), "{want}: {err}");
        }
        std::fs::remove_dir_all(&root).unwrap();
        Ok(())
    }
}
