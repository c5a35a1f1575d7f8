//! Benchmark of the PLAID engine, one phase per run (so that each phase's
//! peak memory is its own): build an index, search it in batches, break a
//! search down by stage, compute the exhaustive exact top-k on the
//! uncompressed embeddings (the ground truth of recall), or time updates
//! (an add, a delete, a compaction) of an index. Prints one JSON
//! line per measurement; `bench/plaid_engine.py` drives it next to fast-plaid.
//!
//!   cargo run --release --features cuda -p candle-maxsim-plaid --example plaid_bench -- \
//!       build --docs emb.npy --lens lens.npy --index DIR [--nbits 4] [--cuda]
//!   ... search --index DIR --queries q.npy [--batch 1 --batch 32 --batch 256] [--out ids.json] [--cuda]
//!   ... stages --index DIR --queries q.npy [--batch 1 --batch 256] [--cuda]
//!   ... exact --docs emb.npy --lens lens.npy --queries q.npy --out exact.json [--cuda]
//!   ... update --index DIR --docs emb.npy --lens lens.npy [--add 1000] [--delete 100] [--cuda]
//!
//! `--help` lists every flag.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_maxsim::{maxsim_varlen, TopK};
use candle_maxsim_plaid::{create, Documents, IndexConfig, NpyDocuments, PackedDocuments, PlaidIndex, SearchParams};
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
    #[arg(long)]
    docs: PathBuf,
    /// Document lengths `[Nd]` integers (.npy).
    #[arg(long)]
    lens: PathBuf,
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
        /// Spherical k-means (default: Euclidean, as fast-plaid).
        #[arg(long)]
        spherical: bool,
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
        Phase::Build { docs, index, nbits, spherical, seed } => {
            let lens = read_lens(&docs.lens)?;
            let collection = NpyDocuments::open(&docs.docs, &lens)?;
            let t = Instant::now();
            let config =
                IndexConfig { nbits, spherical_kmeans: spherical, seed, show_progress: true, ..Default::default() };
            let idx = create(&index, &collection, &config, &dev)?;
            dev.synchronize()?;
            let s = t.elapsed().as_secs_f64();
            println!(
                "{}",
                serde_json::json!({"phase": "build", "seconds": s, "documents": idx.num_documents(),
                    "centroids": idx.num_centroids(), "nbits": nbits, "peak_rss_mb": peak_rss_mb()})
            );
        }
        Phase::Update { docs, index, add, delete } => {
            let lens = read_lens(&docs.lens)?;
            let collection = NpyDocuments::open(&docs.docs, &lens)?;
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
                    "deleted": ids.len(), "delete_seconds": delete_s, "compact_seconds": t.elapsed().as_secs_f64(),
                    "load_seconds": load_s, "peak_rss_mb": peak_rss_mb()})
            );
        }
        Phase::Search { index, queries, batches, params, repeats, out } => {
            let t = Instant::now();
            let idx = PlaidIndex::load(&index, &dev)?;
            dev.synchronize()?;
            println!(
                "{}",
                serde_json::json!({"phase": "load", "seconds": t.elapsed().as_secs_f64(), "peak_rss_mb": peak_rss_mb()})
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
            let lens = read_lens(&docs.lens)?;
            let collection = NpyDocuments::open(&docs.docs, &lens)?;
            let q = Tensor::read_npy(&queries)?.to_dtype(DType::F16)?.to_device(&dev)?;
            let (nq, lq, dim) = q.dims3()?;
            let qp = q.reshape((nq * lq, dim))?;
            let cu_q = Tensor::new((0..=nq as u32).map(|i| i * lq as u32).collect::<Vec<_>>(), &dev)?;
            let t = Instant::now();
            let mut top = TopK::new(nq, top_k);
            let step = 20_000;
            use candle_maxsim_plaid::Documents;
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
