//! Benchmark of the PLAID engine, one phase per run (so that each phase's
//! peak memory is its own): build an index, search it in batches, break a
//! search down by stage, compute the exhaustive exact top-k on the
//! uncompressed embeddings (the ground truth of recall), or time updates
//! (an add, an add of one document, a delete, a compaction) of an index. Prints one JSON
//! line per measurement; `bench/plaid_engine.py` drives it next to fast-plaid.
//!
//!   cargo run --release --features cuda -p candle-maxsim-plaid --example plaid_bench -- \
//!       build --docs emb.npy --lens lens.npy --index DIR [--nbits 4] [--cuda]
//!   ... search --index DIR --queries q.npy [--batch 1 --batch 32 --batch 256] [--out ids.json] [--cuda]
//!   ... stages --index DIR --queries q.npy [--batch 1 --batch 256] [--cuda]
//!   ... exact --docs emb.npy --lens lens.npy --queries q.npy --out exact.json [--cuda]
//!   ... update --index DIR --docs emb.npy --lens lens.npy [--add 1000] [--delete 100] [--cuda]
//!   ... queries --generate 8000000 --out q.npy [--n 256] [--lq 32] [--cuda]
//!
//! Each `--docs emb.npy --lens lens.npy` may be `--generate N_DOCS
//! [--seed-collection S]` instead: a collection generated document by
//! document from the seed on the device (`Generated`), of any size and
//! with no input file.
//! `--help` lists every flag.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_maxsim::{maxsim_varlen, TopK};
use candle_maxsim_plaid::{build, Documents, IndexConfig, NpyDocuments, PackedDocuments, PlaidIndex, SearchParams};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser)]
#[command(name = "plaid_bench")]
struct Args {
    #[command(subcommand)]
    phase: Phase,
    /// Run on CUDA device 0 (default: the CPU).
    #[arg(long, global = true)]
    cuda: bool,
}

#[derive(clap::Args)]
struct Collection {
    /// Packed token embeddings `[Td, dim]` F16 or F32 (.npy).
    #[arg(long, required_unless_present = "generate")]
    docs: Option<PathBuf>,
    /// Document lengths `[Nd]` integers (.npy).
    #[arg(long, required_unless_present = "generate")]
    lens: Option<PathBuf>,
    /// Instead of files: this many documents generated from `--seed-collection` (see `Generated`).
    #[arg(long, conflicts_with_all = ["docs", "lens"])]
    generate: Option<usize>,
    /// The generated collection's seed.
    #[arg(long = "seed-collection", default_value_t = 0)]
    seed_collection: u64,
}

impl Collection {
    /// The documents: the .npy files memory-mapped, or the generated collection on `dev`.
    fn open(&self, dev: &Device) -> Result<Box<dyn Documents>> {
        match (self.generate, &self.docs, &self.lens) {
            (Some(n), _, _) => Ok(Box::new(Generated::new(n, 128, self.seed_collection, dev)?)),
            (None, Some(docs), Some(lens)) => Ok(Box::new(NpyDocuments::open(docs, &read_lens(lens)?)?)),
            _ => anyhow::bail!("--docs and --lens, or --generate"),
        }
    }
}

/// SplitMix64's finalizer: a well-mixed 64-bit hash of `z`.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A collection generated from a seed and never stored, so that a build of
/// any size needs no input file: document `i`'s length (60-190 tokens) and
/// topic are hashes of (seed, i); 70 % of its tokens are words of its topic,
/// the rest any word, each plus a noise row, picked by hashes of (seed, i,
/// position); the embeddings are rows of fixed seeded tables (4 096 topic
/// directions, 12 words near each, 65 536 noise rows) gathered on the
/// device, summed and normalized. The same ids give the same embeddings in
/// every run (build, update, exact ground truth, queries).
struct Generated {
    lens: Vec<u32>,
    seed: u64,
    words: Tensor,
    noise: Tensor,
    dim: usize,
}

const TOPICS: usize = 4096;
const WORDS_PER_TOPIC: usize = 12;
const NOISE_ROWS: usize = 65_536;

impl Generated {
    fn new(n: usize, dim: usize, seed: u64, dev: &Device) -> Result<Self> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(mix(seed));
        let mut table = |rows: usize, scale: f32| -> Result<Tensor> {
            // Standard normal values by Box-Muller.
            let v: Vec<f32> = (0..rows * dim)
                .map(|_| {
                    let (u, v): (f32, f32) = (rng.random_range(f32::EPSILON..1.0), rng.random());
                    scale * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
                })
                .collect();
            Ok(Tensor::from_vec(v, (rows, dim), dev)?)
        };
        let topics = candle_maxsim::l2_normalize(&table(TOPICS, 1.0)?)?;
        let spread =
            table(TOPICS * WORDS_PER_TOPIC, 0.5 / (dim as f32).sqrt())?.reshape((TOPICS, WORDS_PER_TOPIC, dim))?;
        let words = candle_maxsim::l2_normalize(&topics.unsqueeze(1)?.broadcast_add(&spread)?)?
            .reshape((TOPICS * WORDS_PER_TOPIC, dim))?;
        let noise = table(NOISE_ROWS, 0.3 / (dim as f32).sqrt())?;
        let lens = (0..n as u64).map(|i| 60 + (mix(seed ^ mix(i)) % 131) as u32).collect();
        Ok(Self { lens, seed, words, noise, dim })
    }
}

impl Documents for Generated {
    fn len(&self) -> usize {
        self.lens.len()
    }
    fn dim(&self) -> usize {
        self.dim
    }
    fn doc_len(&self, i: usize) -> usize {
        self.lens[i] as usize
    }
    fn embeddings(&self, ids: &[u32]) -> candle_core::Result<Tensor> {
        let t: usize = ids.iter().map(|&i| self.lens[i as usize] as usize).sum();
        // Each token's word and noise row from a hash of (document, position),
        // the documents split over threads (this is the host's work per token).
        let part = |ids: &[u32]| -> (Vec<u32>, Vec<u32>) {
            let (mut word, mut noise) = (Vec::new(), Vec::new());
            for &i in ids {
                let h = mix(self.seed ^ mix(i as u64 ^ (1 << 40)));
                let topic = (h % TOPICS as u64) as u32;
                for j in 0..self.lens[i as usize] as u64 {
                    let r = mix(h ^ mix(j));
                    let w = if (r & 0xffff) < 45_875 {
                        topic * WORDS_PER_TOPIC as u32 + ((r >> 16) % WORDS_PER_TOPIC as u64) as u32
                    } else {
                        ((r >> 16) % (TOPICS * WORDS_PER_TOPIC) as u64) as u32
                    };
                    word.push(w);
                    noise.push(((r >> 40) % NOISE_ROWS as u64) as u32);
                }
            }
            (word, noise)
        };
        let threads = std::thread::available_parallelism().map_or(4, |n| n.get()).min(8);
        let parts: Vec<(Vec<u32>, Vec<u32>)> = std::thread::scope(|s| {
            let handles: Vec<_> =
                ids.chunks(ids.len().div_ceil(threads).max(1)).map(|c| s.spawn(move || part(c))).collect();
            handles.into_iter().map(|h| h.join().expect("a generator thread panicked")).collect()
        });
        let (mut word, mut noise) = (Vec::with_capacity(t), Vec::with_capacity(t));
        for (w, n) in parts {
            word.extend(w);
            noise.extend(n);
        }
        let dev = self.words.device();
        let x = (self.words.index_select(&Tensor::from_vec(word, t, dev)?, 0)?
            + self.noise.index_select(&Tensor::from_vec(noise, t, dev)?, 0)?)?;
        candle_maxsim::l2_normalize(&x)
    }
}

#[derive(clap::Args)]
struct Params {
    /// Results per query.
    #[arg(long = "top-k", default_value_t = 10)]
    top_k: usize,
    /// Centroids probed per query token.
    #[arg(long = "n-ivf-probe", default_value_t = 8)]
    n_ivf_probe: usize,
    /// Candidates kept by approximate score (a quarter scored exactly).
    #[arg(long = "n-full-scores", default_value_t = 4096)]
    n_full_scores: usize,
}

impl Params {
    fn search(&self) -> SearchParams {
        SearchParams {
            top_k: self.top_k,
            n_ivf_probe: self.n_ivf_probe,
            n_full_scores: self.n_full_scores,
            ..Default::default()
        }
    }
}

#[derive(Subcommand)]
enum Phase {
    /// Build an index of the collection.
    Build {
        #[command(flatten)]
        docs: Collection,
        /// The index directory.
        #[arg(long)]
        index: PathBuf,
        /// Bits per residual feature.
        #[arg(long, default_value_t = 4)]
        nbits: usize,
        /// Euclidean k-means, as fast-plaid (default: spherical).
        #[arg(long)]
        euclidean: bool,
        /// Seed of the sample and of k-means.
        #[arg(long, default_value_t = 42)]
        seed: u64,
    },
    /// Search the index with the queries, in batches of each `--batch` size.
    Search {
        #[arg(long)]
        index: PathBuf,
        /// Queries `[Nq, Lq, dim]` (.npy).
        #[arg(long)]
        queries: PathBuf,
        /// Queries per search call (repeatable).
        #[arg(long = "batch", default_values_t = [1usize, 32, 256])]
        batches: Vec<usize>,
        #[command(flatten)]
        params: Params,
        /// Timed repeats of each batch size (the median is reported).
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        /// Write every query's results (ids, scores) as JSON here.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Open the index within this fraction of the device memory it
        /// needs whole (`PlaidIndex::load_with_device_budget`).
        #[arg(long)]
        device_budget_fraction: Option<f64>,
    },
    /// Time each stage of a search, for batches of each `--batch` size.
    Stages {
        #[arg(long)]
        index: PathBuf,
        #[arg(long)]
        queries: PathBuf,
        #[arg(long = "batch", default_values_t = [1usize, 256])]
        batches: Vec<usize>,
        #[command(flatten)]
        params: Params,
    },
    /// Time updates of the index (which they change): adding the first
    /// `--add` documents of the collection again (new ids), deleting
    /// `--delete` documents spread over the index, and the compaction.
    Update {
        #[command(flatten)]
        docs: Collection,
        #[arg(long)]
        index: PathBuf,
        /// Documents to add (the first ones of the collection).
        #[arg(long, default_value_t = 1000)]
        add: usize,
        /// Documents to delete.
        #[arg(long, default_value_t = 100)]
        delete: usize,
    },
    /// Queries made from the collection: `--n` documents spread over it,
    /// `--lq` of each one's tokens (seeded draws) plus noise, normalized;
    /// written as `[n, lq, dim]` F16 (.npy).
    Queries {
        #[command(flatten)]
        docs: Collection,
        #[arg(long, default_value_t = 256)]
        n: usize,
        #[arg(long, default_value_t = 32)]
        lq: usize,
        #[arg(long)]
        out: PathBuf,
    },
    /// Write the collection's embeddings `[Td, dim]` F16 and lengths `[Nd]`
    /// as .npy (a generated collection, for another engine to read).
    Dump {
        #[command(flatten)]
        docs: Collection,
        #[arg(long)]
        out: PathBuf,
        #[arg(long = "lens-out")]
        lens_out: PathBuf,
    },
    /// The exhaustive exact top-k of every query on the uncompressed embeddings.
    Exact {
        #[command(flatten)]
        docs: Collection,
        #[arg(long)]
        queries: PathBuf,
        #[arg(long = "top-k", default_value_t = 10)]
        top_k: usize,
        #[arg(long)]
        out: PathBuf,
    },
}

/// Peak resident memory of this process, from /proc (Linux), in MB.
fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn read_lens(path: &PathBuf) -> Result<Vec<u32>> {
    let t = Tensor::read_npy(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(t.to_dtype(DType::I64)?.to_vec1::<i64>()?.into_iter().map(|l| l as u32).collect())
}

fn write_results(path: &PathBuf, res: &[Vec<(u32, f32)>]) -> Result<()> {
    let ids: Vec<Vec<u32>> = res.iter().map(|r| r.iter().map(|x| x.0).collect()).collect();
    let scores: Vec<Vec<f32>> = res.iter().map(|r| r.iter().map(|x| x.1).collect()).collect();
    std::fs::write(path, serde_json::to_string(&serde_json::json!({"ids": ids, "scores": scores}))?)?;
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = if args.cuda { Device::new_cuda(0)? } else { Device::Cpu };
    match args.phase {
        Phase::Build { docs, index, nbits, euclidean, seed } => {
            let collection = docs.open(&dev)?;
            let t = Instant::now();
            let config =
                IndexConfig { nbits, spherical_kmeans: !euclidean, seed, show_progress: true, ..Default::default() };
            // The build alone (as fast-plaid's create), then opening the index.
            build(&index, collection.as_ref(), &config, &dev)?;
            dev.synchronize()?;
            let s = t.elapsed().as_secs_f64();
            let peak = peak_rss_mb();
            let t = Instant::now();
            let idx = PlaidIndex::load(&index, &dev)?;
            dev.synchronize()?;
            println!(
                "{}",
                serde_json::json!({"phase": "build", "seconds": s, "documents": idx.num_documents(),
                    "centroids": idx.num_centroids(), "nbits": nbits, "peak_rss_mb": peak,
                    "open_seconds": t.elapsed().as_secs_f64()})
            );
        }
        Phase::Update { docs, index, add, delete } => {
            let collection = docs.open(&dev)?;
            let lens: Vec<u32> = (0..collection.len()).map(|i| collection.doc_len(i) as u32).collect();
            let t = Instant::now();
            let mut idx = PlaidIndex::load(&index, &dev)?;
            dev.synchronize()?;
            let load_s = t.elapsed().as_secs_f64();
            let n = idx.num_documents();
            let k = add.min(lens.len());
            let first: Vec<u32> = (0..k as u32).collect();
            let few = PackedDocuments::new(collection.embeddings(&first)?, &lens[..k])?;
            let t = Instant::now();
            let added = idx.add(&few, 25_000)?;
            dev.synchronize()?;
            let add_s = t.elapsed().as_secs_f64();
            // As many again, the process now warm (kernels loaded, buffers cached).
            let k2 = add.min(lens.len() - k);
            let mut add_again_s = None;
            if k2 > 0 {
                let next: Vec<u32> = (k as u32..(k + k2) as u32).collect();
                let again = PackedDocuments::new(collection.embeddings(&next)?, &lens[k..k + k2])?;
                let t = Instant::now();
                idx.add(&again, 25_000)?;
                dev.synchronize()?;
                add_again_s = Some(t.elapsed().as_secs_f64());
            }
            // One document more: what an add costs whatever its size.
            let one = PackedDocuments::new(collection.embeddings(&[0])?, &lens[..1])?;
            let t = Instant::now();
            idx.add(&one, 25_000)?;
            dev.synchronize()?;
            let add_one_s = t.elapsed().as_secs_f64();
            let step = (n / delete.max(1)).max(1);
            let ids: Vec<u32> = (0..n).step_by(step).take(delete).map(|d| d as u32).collect();
            let t = Instant::now();
            idx.delete(&ids)?;
            let delete_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            idx.compact()?;
            dev.synchronize()?;
            println!(
                "{}",
                serde_json::json!({"phase": "update", "documents": n, "added": added.len(), "add_seconds": add_s,
                    "add_one_seconds": add_one_s, "add_again_seconds": add_again_s,
                    "deleted": ids.len(), "delete_seconds": delete_s, "compact_seconds": t.elapsed().as_secs_f64(),
                    "load_seconds": load_s, "peak_rss_mb": peak_rss_mb()})
            );
        }
        Phase::Queries { docs, n, lq, out } => {
            use rand::{Rng, SeedableRng};
            let collection = docs.open(&dev)?;
            let (nd, dim) = (collection.len(), collection.dim());
            let mut rng = rand::rngs::StdRng::seed_from_u64(mix(docs.seed_collection ^ 0x51));
            let mut qs = Vec::with_capacity(n);
            for k in 0..n {
                let t = (k * nd / n.max(1)) as u32;
                let e = collection.embeddings(&[t])?.to_device(&dev)?.to_dtype(DType::F32)?;
                let len = e.dim(0)? as u32;
                let rows: Vec<u32> = (0..lq).map(|_| rng.random_range(0..len)).collect();
                let noise: Vec<f32> =
                    (0..lq * dim).map(|_| rng.random_range(-0.3f32..0.3) / (dim as f32).sqrt()).collect();
                let q = (e.index_select(&Tensor::from_vec(rows, lq, &dev)?, 0)?
                    + Tensor::from_vec(noise, (lq, dim), &dev)?)?;
                qs.push(candle_maxsim::l2_normalize(&q)?);
            }
            Tensor::stack(&qs, 0)?.to_dtype(DType::F16)?.to_device(&Device::Cpu)?.write_npy(&out)?;
            println!("{}", serde_json::json!({"phase": "queries", "queries": n, "tokens": lq, "documents": nd}));
        }
        Phase::Dump { docs, out, lens_out } => {
            // Streamed, 20 000 documents at a time, in one buffered file:
            // candle's `write_npy` writes element by element (a system call
            // each: hours at a billion tokens).
            use std::io::Write;
            let collection = docs.open(&dev)?;
            let (n, dim) = (collection.len(), collection.dim());
            let lens: Vec<i64> = (0..n).map(|i| collection.doc_len(i) as i64).collect();
            let tokens = lens.iter().sum::<i64>() as usize;
            let mut f = std::io::BufWriter::with_capacity(1 << 24, std::fs::File::create(&out)?);
            let header = format!("{{'descr': '<f2', 'fortran_order': False, 'shape': ({tokens}, {dim}), }}");
            let pad = (10 + header.len() + 1).div_ceil(64) * 64 - (10 + header.len() + 1);
            let header = format!("{header}{}\n", " ".repeat(pad));
            f.write_all(b"\x93NUMPY\x01\x00")?;
            f.write_all(&(header.len() as u16).to_le_bytes())?;
            f.write_all(header.as_bytes())?;
            for a in (0..n).step_by(20_000) {
                let ids: Vec<u32> = (a as u32..(a + 20_000).min(n) as u32).collect();
                let x = collection.embeddings(&ids)?.to_dtype(DType::F16)?.flatten_all()?.to_vec1::<half::f16>()?;
                let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
                f.write_all(&bytes)?;
            }
            f.flush()?;
            Tensor::new(lens, &Device::Cpu)?.write_npy(&lens_out)?;
            println!("{}", serde_json::json!({"phase": "dump", "documents": n, "tokens": tokens}));
        }
        Phase::Search { index, queries, batches, params, repeats, out, device_budget_fraction } => {
            let t = Instant::now();
            let idx = match device_budget_fraction {
                None => PlaidIndex::load(&index, &dev)?,
                Some(f) => {
                    let (whole, _) = PlaidIndex::device_bytes_needed(&index)?;
                    PlaidIndex::load_with_device_budget(&index, &dev, (whole as f64 * f) as usize)?
                }
            };
            dev.synchronize()?;
            println!(
                "{}",
                serde_json::json!({"phase": "load", "seconds": t.elapsed().as_secs_f64(), "peak_rss_mb": peak_rss_mb(),
                    "device_bytes": idx.device_bytes(), "residuals_on_host": idx.residuals_on_host()})
            );
            let q = Tensor::read_npy(&queries)?.to_dtype(DType::F16)?.to_device(&dev)?;
            let sp = params.search();
            let nq = q.dim(0)?;
            idx.search(&q.narrow(0, 0, 1)?, &sp, None)?; // warm-up: module loads, allocations
            for &b in &batches {
                let b = b.min(nq);
                let mut times = Vec::new();
                for r in 0..repeats {
                    let start = (r * b) % (nq - b + 1);
                    let qb = q.narrow(0, start, b)?;
                    dev.synchronize()?;
                    let t = Instant::now();
                    idx.search(&qb, &sp, None)?; // returns on the host: the results are in
                    times.push(t.elapsed().as_secs_f64() * 1e3);
                }
                let ms = median(times);
                println!(
                    "{}",
                    serde_json::json!({"phase": "search", "batch": b, "median_ms": ms, "queries_per_s": b as f64 / ms * 1e3,
                        "n_ivf_probe": sp.n_ivf_probe, "n_full_scores": sp.n_full_scores})
                );
            }
            if let Some(path) = out {
                let mut res = Vec::new();
                for a in (0..q.dim(0)?).step_by(256) {
                    res.extend(idx.search(&q.narrow(0, a, 256.min(q.dim(0)? - a))?, &sp, None)?);
                }
                write_results(&path, &res)?;
            }
            println!("{}", serde_json::json!({"phase": "search_done", "peak_rss_mb": peak_rss_mb()}));
        }
        Phase::Stages { index, queries, batches, params } => {
            let idx = PlaidIndex::load(&index, &dev)?;
            let q = Tensor::read_npy(&queries)?.to_dtype(DType::F16)?.to_device(&dev)?;
            let sp = params.search();
            idx.search(&q.narrow(0, 0, 1)?, &sp, None)?;
            for &b in &batches {
                let qb = q.narrow(0, 0, b.min(q.dim(0)?))?;
                let mut runs: Vec<Vec<(&str, f64)>> = Vec::new();
                for _ in 0..3 {
                    let (_, times) = idx.search_profiled(&qb, &sp, None)?;
                    runs.push(times.into_iter().map(|(s, d)| (s, d.as_secs_f64() * 1e3)).collect());
                }
                for (k, (stage, _)) in runs[0].iter().enumerate() {
                    let ms = median(runs.iter().map(|r| r[k].1).collect());
                    println!(
                        "{}",
                        serde_json::json!({"phase": "stage", "batch": qb.dim(0)?, "stage": stage, "median_ms": ms})
                    );
                }
            }
        }
        Phase::Exact { docs, queries, top_k, out } => {
            let collection = docs.open(&dev)?;
            let lens: Vec<u32> = (0..collection.len()).map(|i| collection.doc_len(i) as u32).collect();
            let q = Tensor::read_npy(&queries)?.to_dtype(DType::F16)?.to_device(&dev)?;
            let (nq, lq, dim) = q.dims3()?;
            let qp = q.reshape((nq * lq, dim))?;
            let cu_q = Tensor::new((0..=nq as u32).map(|i| i * lq as u32).collect::<Vec<_>>(), &dev)?;
            let t = Instant::now();
            let mut top = TopK::new(nq, top_k);
            let step = 20_000;
            for a in (0..lens.len()).step_by(step) {
                let ids: Vec<u32> = (a as u32..(a + step).min(lens.len()) as u32).collect();
                let d = collection.embeddings(&ids)?.to_device(&dev)?.to_dtype(DType::F16)?;
                let d = candle_maxsim::l2_normalize(&d)?;
                let mut cu = vec![0u32];
                for &i in &ids {
                    cu.push(cu.last().unwrap() + lens[i as usize]);
                }
                let max_ld = ids.iter().map(|&i| lens[i as usize] as usize).max().unwrap_or(0);
                let cu = Tensor::new(cu, &dev)?;
                let s = maxsim_varlen(&candle_maxsim::l2_normalize(&qp)?, &cu_q, lq, &d, &cu, max_ld)?;
                top.push(&s, |j| ids[j])?;
            }
            let (s, i) = top.finish(&Device::Cpu)?;
            let (s, i): (Vec<Vec<f32>>, Vec<Vec<u32>>) = (s.to_vec2()?, i.to_vec2()?);
            let res: Vec<Vec<(u32, f32)>> = i.into_iter().zip(s).map(|(i, s)| i.into_iter().zip(s).collect()).collect();
            write_results(&out, &res)?;
            println!("{}", serde_json::json!({"phase": "exact", "seconds": t.elapsed().as_secs_f64()}));
        }
    }
    Ok(())
}
