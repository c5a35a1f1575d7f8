//! Fine-tune a ColBERT model end to end in candle (encoder and projection),
//! with candle-maxsim scoring, and save it in the PyLate layout.
//!
//!   cargo run --release -p candle-maxsim-colbert --example finetune -- \
//!       --train train.jsonl [--eval eval.jsonl] --model-dir DIR --out OUT \
//!       [--loss contrastive|cached|distill|margin-mse] [--cuda] [...]
//!
//! Data: JSONL in PyLate's conventions (see candle_maxsim_colbert::train::data):
//! `query`, `positive`, `negative` (or a list, or `negative_1`..) rows; for
//! distillation and margin MSE, `query_id`, `document_ids`, `scores` rows with
//! `--queries` and `--documents` files of `{id, text}`.
//! `--eval-only` scores `--model-dir` on `--eval` without training;
//! `--profile N` times N training steps by phase (encode, scores and loss,
//! backward, optimizer) instead of a run. `--help` lists every flag.

// Shared with the colbert example, which uses more of it.
#[allow(dead_code)]
#[path = "common/cli.rs"]
mod cli;

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use candle_maxsim_colbert::train::{self, EvalSet, Loss, TrainConfig, TrainableColBert};
use candle_maxsim_colbert::ColBert;
use clap::{Parser, ValueEnum};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LossKind {
    /// In-batch and hard negatives, cross-entropy towards each query's positive (triples).
    Contrastive,
    /// Contrastive by gradient cache: the same loss at bounded memory (--mini-batch).
    Cached,
    /// KL divergence to a teacher's scores (distillation rows).
    Distill,
    /// Mean squared error of the positive-negative score margins against the teacher's.
    MarginMse,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Dtype {
    F32,
    Bf16,
}

/// Fine-tune a ColBERT model (the whole encoder and its projection).
#[derive(Parser)]
#[command(
    name = "finetune",
    long_about = "Fine-tune a ColBERT model end to end (the whole encoder and its projection) \
and save it in the PyLate layout, which PyLate and Sentence Transformers load.

Training data (--train) is JSONL, one JSON object per line (blank lines skipped):

  contrastive and cached losses, one query with its positive and hard negatives per row:
    {\"query\": \"...\", \"positive\": \"...\", \"negative\": \"...\"}
  `negative` may be a list of strings, or the negatives `negative_1`, `negative_2`, ...;
  every row has the same number of them; `anchor` is read where `query` is absent.

  distill and margin-mse losses, a teacher's scores of documents per query:
    {\"query_id\": \"q1\", \"document_ids\": [\"d1\", \"d2\", ...], \"scores\": [12.5, 3.1, ...]}
  with the texts in --queries ({\"query_id\": ..., \"text\": ...} per line) and
  --documents ({\"document_id\": ..., \"text\": ...} per line); the first --n-ways
  documents of each row are used (margin-mse: the first is the positive).

Evaluation data (--eval) is a BEIR directory (corpus.jsonl, queries.jsonl,
qrels/SPLIT.tsv) or a triples file as above (each query's positive is its
relevant document, ranked among all the file's documents). Results are printed
as JSON lines on stdout."
)]
pub(crate) struct Args {
    /// Training data: JSONL triples, or distillation rows (the formats: see --help).
    #[arg(long, value_name = "FILE")]
    train: Option<PathBuf>,
    /// Evaluation data: a BEIR directory (corpus.jsonl, queries.jsonl,
    /// qrels/SPLIT.tsv), or JSONL triples (each query's positive its relevant document).
    #[arg(long, value_name = "PATH")]
    eval: Option<PathBuf>,
    /// The qrels split of a BEIR --eval directory.
    #[arg(long = "eval-split", value_name = "SPLIT", default_value = "dev")]
    eval_split: String,
    /// With --eval-only: write the scores of the first 64 queries over the first
    /// 256 corpus documents to this .npy file (F32), to compare with another stack.
    #[arg(long = "dump-scores", value_name = "FILE")]
    dump_scores: Option<PathBuf>,
    /// With --eval-only: write the --eval corpus's token embeddings to DIR
    /// (emb.npy `[T, dim]` F16 packed, scored tokens only; lens.npy) and its
    /// queries' (queries.npy `[Nq, Lq, dim]` F16, unscored tokens zero), for
    /// indexing benchmarks on real text.
    #[arg(long = "export", value_name = "DIR")]
    export: Option<PathBuf>,
    /// The starting checkpoint (PyLate / Sentence Transformers, colbert-ai, or a plain BERT / ModernBERT).
    #[arg(long = "model-dir", value_name = "DIR")]
    model_dir: PathBuf,
    /// Where the trained model (and checkpoint-N/) go.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// The training loss.
    #[arg(long, value_enum, default_value_t = LossKind::Contrastive)]
    loss: LossKind,
    /// Queries file of the distillation losses: JSONL `{query_id, text}`.
    #[arg(long, value_name = "FILE")]
    queries: Option<PathBuf>,
    /// Documents file of the distillation losses: JSONL `{document_id, text}`.
    #[arg(long, value_name = "FILE")]
    documents: Option<PathBuf>,
    /// Queries per micro-batch, each with its documents.
    #[arg(long = "batch-size", value_name = "N", default_value_t = 32)]
    batch_size: usize,
    /// Queries and documents embedded at a time by the cached loss.
    #[arg(long = "mini-batch", value_name = "N", default_value_t = 32)]
    mini_batch: usize,
    /// Peak learning rate of AdamW (linear warm-up, then linear decay to 0).
    #[arg(long, value_name = "LR", default_value_t = 3e-5)]
    lr: f64,
    /// Passes over the training data.
    #[arg(long, value_name = "N", default_value_t = 1)]
    epochs: usize,
    /// Stop after this many optimizer steps (default: all steps of --epochs).
    #[arg(long = "max-steps", value_name = "N")]
    max_steps: Option<usize>,
    /// Warm-up as a fraction of the optimizer steps (a value of 1 or more: a step count).
    #[arg(long = "warmup-ratio", value_name = "R", default_value_t = 0.0)]
    warmup_ratio: f64,
    /// AdamW's decoupled weight decay (not applied to biases and normalization weights).
    #[arg(long = "weight-decay", value_name = "W", default_value_t = 0.0)]
    weight_decay: f64,
    /// Clip the global gradient norm to this (0: no clipping).
    #[arg(long = "max-grad-norm", value_name = "X", default_value_t = 1.0)]
    max_grad_norm: f64,
    /// Micro-batches whose gradients are averaged into one optimizer step.
    #[arg(long = "grad-accum", value_name = "N", default_value_t = 1)]
    grad_accum: usize,
    /// Score scale of the contrastive losses (PyLate's temperature is 1 / scale).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Temperature of the distillation loss.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Evaluate on --eval every N optimizer steps and at the end (default: at the end only).
    #[arg(long = "eval-steps", value_name = "N")]
    eval_steps: Option<usize>,
    /// Save a checkpoint (OUT/checkpoint-N, with the optimizer state, for --resume)
    /// every N optimizer steps (default: only the final model).
    #[arg(long = "save-steps", value_name = "N")]
    save_steps: Option<usize>,
    /// Seed of the data order and of a new projection's initialization.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Resume from this checkpoint directory (an earlier run's OUT/checkpoint-N).
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Output dimension of a new projection (for a checkpoint without one).
    #[arg(long, value_name = "N", default_value_t = 128)]
    dim: usize,
    /// Start the projection from the principal directions of the encoder's
    /// token states over the first 2 000 documents of --train (instead of
    /// PyTorch's random init).
    #[arg(long = "pca-init")]
    pca_init: bool,
    /// Documents per distillation row (its first ones).
    #[arg(long = "n-ways", value_name = "N", default_value_t = 32)]
    n_ways: usize,
    /// Compute dtype (default: bf16 on CUDA, f32 on the CPU); weights stay F32.
    #[arg(long, value_enum)]
    dtype: Option<Dtype>,
    /// Only evaluate --model-dir on --eval.
    #[arg(long = "eval-only")]
    eval_only: bool,
    /// Save the starting model (projection and markers added) to this directory and stop.
    #[arg(long = "save-init", value_name = "DIR")]
    save_init: Option<PathBuf>,
    /// Time this many training steps by phase instead of training.
    #[arg(long, value_name = "N")]
    profile: Option<usize>,
    /// Run on CUDA device 0 (needs a build with `--features cuda`).
    #[arg(long)]
    cuda: bool,
    /// Pad every sequence to its batch's longest instead of running the
    /// encoder on packed sequences (for comparison).
    #[arg(long)]
    padded: bool,
}

fn main() -> Result<()> {
    cli::keep_freed_memory();
    let a = Args::parse();
    let dev = cli::device(a.cuda)?;
    let dtype = match a.dtype {
        Some(Dtype::F32) => DType::F32,
        Some(Dtype::Bf16) => DType::BF16,
        None if a.cuda => DType::BF16,
        None => DType::F32,
    };
    let eval = match &a.eval {
        Some(p) if p.is_dir() => Some(train::read_beir(p, &a.eval_split)?),
        Some(p) => Some(EvalSet::from_examples(&train::read_triples(p)?)),
        None => None,
    };
    if a.eval_only {
        let Some(set) = &eval else { bail!("--eval-only needs --eval") };
        let m = ColBert::load(&a.model_dir, &dev, dtype)?;
        let t = Instant::now();
        let r = train::evaluate(&m, set, 64)?;
        if let Some(path) = &a.dump_scores {
            let q: Vec<&str> = set.queries.iter().take(64).map(String::as_str).collect();
            let d: Vec<&str> = set.corpus.iter().take(256).map(String::as_str).collect();
            let ((qe, qm), (de, dm)) = (m.encode_queries(&q)?, m.encode_documents(&d)?);
            let s = candle_maxsim::maxsim(&qe, &de, Some(&qm), Some(&dm))?.to_dtype(DType::F32)?;
            s.to_device(&Device::Cpu)?.write_npy(path)?;
        }
        if let Some(dir) = &a.export {
            export(&m, set, dir)?;
        }
        println!(
            "{}",
            serde_json::json!({"phase": "eval", "model": a.model_dir, "queries": set.queries.len(), "corpus": set.corpus.len(),
                "mrr@10": r.mrr_at_10, "recall@10": r.recall_at_10, "seconds": t.elapsed().as_secs_f64()})
        );
        return Ok(());
    }
    let mut model = TrainableColBert::load(&a.model_dir, &dev, dtype, a.dim, a.seed)?;
    model.model.set_packed_encoder(!a.padded);
    if a.pca_init {
        let Some(path) = &a.train else { bail!("--pca-init takes its documents from --train") };
        let examples = train::read_triples(path)?;
        let mut seen = std::collections::HashSet::new();
        let docs: Vec<&str> = examples
            .iter()
            .flat_map(|e| e.documents.iter())
            .map(String::as_str)
            .filter(|d| seen.insert(*d))
            .take(2000)
            .collect();
        model.init_projection_pca(&docs, 64)?;
    }
    if let Some(dir) = &a.save_init {
        model.save(dir)?;
        println!("{}", serde_json::json!({"phase": "save_init", "dir": dir}));
        return Ok(());
    }
    let Some(train_path) = &a.train else { bail!("--train is needed to train") };
    let data = match a.loss {
        LossKind::Distill | LossKind::MarginMse => {
            let (Some(q), Some(d)) = (&a.queries, &a.documents) else {
                bail!("--loss distill / margin-mse need --queries and --documents")
            };
            train::read_distillation(train_path, q, d, a.n_ways)?
        }
        _ => train::read_triples(train_path)?,
    };
    let loss = match a.loss {
        LossKind::Contrastive => Loss::Contrastive { scale: a.scale },
        LossKind::Cached => Loss::Cached { scale: a.scale, mini_batch: a.mini_batch },
        LossKind::Distill => Loss::Distill { temperature: a.temperature },
        LossKind::MarginMse => Loss::MarginMse,
    };
    if let Some(n) = a.profile {
        return profile(&mut model, &data, loss, a.batch_size, n, &dev);
    }
    let Some(out) = &a.out else { bail!("--out is needed to train") };
    let cfg = TrainConfig {
        loss,
        batch_size: a.batch_size,
        grad_accum: a.grad_accum,
        lr: a.lr,
        epochs: a.epochs,
        max_steps: a.max_steps,
        warmup_ratio: a.warmup_ratio,
        weight_decay: a.weight_decay,
        max_grad_norm: a.max_grad_norm,
        eval_steps: a.eval_steps,
        save_steps: a.save_steps,
        seed: a.seed,
        show_progress: true,
    };
    let r = train::train(&mut model, &data, eval.as_ref(), &cfg, out, a.resume.as_deref())?;
    let first = r.steps.first().map_or(0.0, |s| s.1);
    let last = r.steps.last().map_or(0.0, |s| s.1);
    println!(
        "{}",
        serde_json::json!({"phase": "train", "steps": r.steps.len(), "seconds": r.seconds,
            "first_loss": first, "last_loss": last, "out": out})
    );
    for (step, m) in &r.evals {
        println!(
            "{}",
            serde_json::json!({"phase": "eval", "step": step, "mrr@10": m.mrr_at_10, "recall@10": m.recall_at_10})
        );
    }
    Ok(())
}

/// Times `n` training steps (after one warm-up) by phase, the device
/// synchronized between phases; prints the median of each.
/// The embeddings of `set` for an index (see `--export`).
fn export(m: &ColBert, set: &EvalSet, dir: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let (mut parts, mut lens) = (Vec::new(), Vec::<i64>::new());
    for chunk in set.corpus.chunks(64) {
        let texts: Vec<&str> = chunk.iter().map(String::as_str).collect();
        let (x, l) = m.encode_documents_packed(&texts)?;
        parts.push(x.to_dtype(DType::F16)?.to_device(&Device::Cpu)?);
        lens.extend(l.into_iter().map(i64::from));
    }
    write_f16_npy(&dir.join("emb.npy"), &candle_core::Tensor::cat(&parts, 0)?)?;
    let nd = lens.len();
    candle_core::Tensor::from_vec(lens, nd, &Device::Cpu)?.write_npy(dir.join("lens.npy"))?;
    let mut qs = Vec::new();
    for chunk in set.queries.chunks(256) {
        let texts: Vec<&str> = chunk.iter().map(String::as_str).collect();
        let (q, qm) = m.encode_queries(&texts)?;
        let q = q.broadcast_mul(&qm.to_dtype(q.dtype())?.unsqueeze(2)?)?;
        qs.push(q.to_dtype(DType::F16)?.to_device(&Device::Cpu)?);
    }
    write_f16_npy(&dir.join("queries.npy"), &candle_core::Tensor::cat(&qs, 0)?)?;
    Ok(())
}

/// An F16 tensor as a .npy file, its bytes written at once (candle's
/// `write_npy` formats element by element: a minute for 300 MB).
fn write_f16_npy(path: &std::path::Path, t: &candle_core::Tensor) -> Result<()> {
    let shape: Vec<String> = t.dims().iter().map(|d| d.to_string()).collect();
    let shape = if shape.len() == 1 { format!("{},", shape[0]) } else { shape.join(", ") };
    let mut header = format!("{{'descr': '<f2', 'fortran_order': False, 'shape': ({shape}), }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((header.len() as u16).to_le_bytes());
    bytes.extend(header.as_bytes());
    let v: Vec<half::f16> = t.flatten_all()?.to_vec1()?;
    for x in v {
        bytes.extend(x.to_le_bytes());
    }
    std::fs::write(path, bytes)?;
    Ok(())
}

fn profile(
    model: &mut TrainableColBert,
    data: &[train::Example],
    loss: Loss,
    batch: usize,
    n: usize,
    dev: &Device,
) -> Result<()> {
    use candle_maxsim::{maxsim_with, Backward, MaxSimOptions};
    let m = &model.model;
    let vars = model.vars();
    let mut opt = train::optim::AdamW::new(vars.clone(), 0.0);
    let mut times: Vec<[f64; 7]> = Vec::new();
    // The host's own time of a phase (until its work is enqueued): where it
    // nears the synchronized time, the host bounds the phase, not the device.
    let host = |t: &Instant| t.elapsed().as_secs_f64() * 1e3;
    for s in 0..=n {
        let exs: Vec<&train::Example> = (0..batch).map(|i| &data[(s * batch + i) % data.len()]).collect();
        let lap = |t: &mut Instant| -> Result<f64> {
            dev.synchronize()?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            *t = Instant::now();
            Ok(ms)
        };
        let mut t = Instant::now();
        let q: Vec<&str> = exs.iter().map(|e| e.query.as_str()).collect();
        let d: Vec<&str> = exs.iter().flat_map(|e| e.documents.iter().map(String::as_str)).collect();
        let (qt, dt) = (m.tokenize_queries(&q)?, m.tokenize_documents(&d)?);
        let t_tok = lap(&mut t)?;
        let (qe, de) = (m.embed(&qt)?, m.embed(&dt)?);
        let h_enc = host(&t);
        let t_enc = lap(&mut t)?;
        let (qm, dm) = (m.mask_tensor(&qt.score_mask)?, m.mask_tensor(&dt.score_mask)?);
        let nd = exs[0].documents.len();
        let scale = match loss {
            Loss::Contrastive { scale } | Loss::Cached { scale, .. } => scale,
            _ => 1.0,
        };
        let opts = MaxSimOptions { backward: Backward::LowMem, ..Default::default() };
        let scores = maxsim_with(&qe, &de, Some(&qm), Some(&dm), &opts)?;
        let targets =
            candle_core::Tensor::arange(0u32, batch as u32, dev)?.affine(nd as f64, 0.0)?.to_dtype(DType::U32)?;
        let l = train::loss::contrastive(&scores, &targets, scale)?;
        let t_score = lap(&mut t)?;
        let g = l.backward()?;
        let h_bwd = host(&t);
        let t_bwd = lap(&mut t)?;
        let mut grads = std::collections::HashMap::new();
        for (name, v) in &vars {
            if let Some(x) = g.get(v.as_tensor()) {
                grads.insert(name.clone(), x.clone());
            }
        }
        opt.apply(&grads, 3e-5, 1.0)?;
        let t_opt = lap(&mut t)?;
        if s > 0 {
            times.push([t_tok, t_enc, t_score, t_bwd, t_opt, h_enc, h_bwd]);
        }
    }
    let names = [
        "tokenize",
        "encode (forward)",
        "scores + loss",
        "backward",
        "optimizer",
        "encode (host until enqueued)",
        "backward (host until enqueued)",
    ];
    let mut total = 0.0;
    for (k, name) in names.iter().enumerate() {
        let mut v: Vec<f64> = times.iter().map(|t| t[k]).collect();
        v.sort_by(f64::total_cmp);
        let ms = v[v.len() / 2];
        if k < 5 {
            total += ms;
        }
        println!("{}", serde_json::json!({"phase": "profile", "part": name, "median_ms": ms}));
    }
    println!(
        "{}",
        serde_json::json!({"phase": "profile", "part": "step (phases synchronized)", "median_ms": total,
        "batch": batch, "documents_per_query": data[0].documents.len()})
    );
    // The same steps as the trainer runs them (tokenization ahead on a thread, no
    // synchronization but the loss read back): the wall time per step.
    let cfg = train::TrainConfig { batch_size: batch, max_steps: Some(n), loss, ..Default::default() };
    let shown: Vec<train::Example> = (0..batch * (n + 1)).map(|i| data[i % data.len()].clone()).collect();
    let out = std::env::temp_dir().join(format!("candle-maxsim-profile-{}", std::process::id()));
    let report = train::train(model, &shown, None, &cfg, &out, None)?;
    let _ = std::fs::remove_dir_all(&out);
    println!(
        "{}",
        serde_json::json!({"phase": "profile", "part": "step (trainer)", "mean_ms": report.seconds * 1e3 / n as f64,
        "batch": batch, "documents_per_query": data[0].documents.len(), "note": "mean over the steps, the first included"})
    );
    Ok(())
}
