//! How much symmetric 8-bit embeddings (`candle_maxsim::quantized::quantize`,
//! `maxsim_quantized`) change a ColBERT model's rankings: the first
//! `--queries` queries of a BEIR split against a corpus subset (their
//! relevant documents, then the corpus in order up to `--docs`), scored in
//! F32, in BF16 and in 8-bit. Prints one JSON line: top-10 overlap of the
//! 8-bit (and BF16) rankings with F32's, MRR@10 of each, the largest score
//! error, and the documents' bytes in BF16 and in 8-bit; the same for FP8
//! e4m3 (`quantize_e4m3`: rows divided by max|x| / 448, rounded to e4m3).
//!
//!     cargo run --release -p candle-maxsim-colbert --example quantized_agreement -- \
//!         --model-dir DIR --beir DIR [--split dev] [--queries 200] [--docs 2000] [--cuda]

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_maxsim_colbert::{train, ColBert};
use clap::Parser;

#[derive(Parser)]
struct Args {
    #[arg(long = "model-dir")]
    model_dir: std::path::PathBuf,
    /// A BEIR directory (corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv).
    #[arg(long)]
    beir: std::path::PathBuf,
    #[arg(long, default_value = "dev")]
    split: String,
    #[arg(long, default_value_t = 200)]
    queries: usize,
    #[arg(long, default_value_t = 2000)]
    docs: usize,
    #[arg(long)]
    cuda: bool,
}

/// Embeddings of `texts` in batches of 64, padded to one length: `([N, L, dim], [N, L] U8)`.
fn encode(texts: &[&str], f: impl Fn(&[&str]) -> candle_core::Result<(Tensor, Tensor)>) -> Result<(Tensor, Tensor)> {
    let parts = texts.chunks(64).map(&f).collect::<candle_core::Result<Vec<_>>>()?;
    let l =
        parts.iter().map(|(e, _)| e.dim(1)).collect::<candle_core::Result<Vec<_>>>()?.into_iter().max().unwrap_or(0);
    let mut es = Vec::new();
    let mut ms = Vec::new();
    for (e, m) in parts {
        let pad = l - e.dim(1)?;
        es.push(e.to_dtype(DType::F32)?.pad_with_zeros(1, 0, pad)?);
        ms.push(m.pad_with_zeros(1, 0, pad)?);
    }
    Ok((Tensor::cat(&es, 0)?, Tensor::cat(&ms, 0)?))
}

fn top10(row: &[f32]) -> Vec<usize> {
    let mut i: Vec<usize> = (0..row.len()).collect();
    i.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    i.truncate(10);
    i
}

fn main() -> Result<()> {
    let a = Args::parse();
    let dev = if a.cuda { Device::new_cuda(0)? } else { Device::Cpu };
    let set = train::read_beir(&a.beir, &a.split)?;
    let nq = a.queries.min(set.queries.len());
    if nq == 0 {
        bail!("--beir: the {} split has no queries", a.split)
    }
    // The subset: every relevant document of the chosen queries, then the corpus in order.
    let mut pick: Vec<usize> = set.relevant[..nq].iter().flatten().copied().collect();
    pick.sort_unstable();
    pick.dedup();
    let chosen: std::collections::HashSet<usize> = pick.iter().copied().collect();
    let rest = a.docs.saturating_sub(pick.len());
    pick.extend((0..set.corpus.len()).filter(|i| !chosen.contains(i)).take(rest));
    let pos: std::collections::HashMap<usize, usize> = pick.iter().enumerate().map(|(k, &i)| (i, k)).collect();
    let model = ColBert::load(&a.model_dir, &dev, DType::F32)?;
    let queries: Vec<&str> = set.queries[..nq].iter().map(String::as_str).collect();
    let docs: Vec<&str> = pick.iter().map(|&i| set.corpus[i].as_str()).collect();
    let (q, qm) = encode(&queries, |t| model.encode_queries(t))?;
    let (d, dm) = encode(&docs, |t| model.encode_documents(t))?;
    let f32s = candle_maxsim::maxsim(&q, &d, Some(&qm), Some(&dm))?;
    let bf16 = candle_maxsim::maxsim(&q.to_dtype(DType::BF16)?, &d.to_dtype(DType::BF16)?, Some(&qm), Some(&dm))?;
    let (q8, d8) = (candle_maxsim::quantized::quantize(&q)?, candle_maxsim::quantized::quantize(&d)?);
    let int8 = candle_maxsim::quantized::maxsim_quantized(&q8, &d8, Some(&qm), Some(&dm))?;
    let (qf8, df8) = (candle_maxsim::quantized::quantize_e4m3(&q)?, candle_maxsim::quantized::quantize_e4m3(&d)?);
    let fp8 = candle_maxsim::quantized::maxsim_quantized(&qf8, &df8, Some(&qm), Some(&dm))?.to_vec2::<f32>()?;
    let (f32s, bf16, int8) = (f32s.to_vec2::<f32>()?, bf16.to_vec2::<f32>()?, int8.to_vec2::<f32>()?);
    let mrr = |s: &[Vec<f32>]| -> f64 {
        let total: f64 = s
            .iter()
            .enumerate()
            .map(|(i, row)| {
                let rel: Vec<usize> = set.relevant[i].iter().filter_map(|r| pos.get(r).copied()).collect();
                top10(row).iter().position(|j| rel.contains(j)).map_or(0.0, |p| 1.0 / (p + 1) as f64)
            })
            .sum();
        total / s.len() as f64
    };
    let overlap = |s: &[Vec<f32>]| -> f64 {
        let n: usize = s.iter().zip(&f32s).map(|(a, b)| top10(a).iter().filter(|j| top10(b).contains(j)).count()).sum();
        n as f64 / (10 * s.len()) as f64
    };
    let err =
        |s: &[Vec<f32>]| s.iter().flatten().zip(f32s.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let scale = f32s.iter().flatten().map(|x| x.abs()).fold(0f32, f32::max);
    let (n, l, dim) = d.dims3()?;
    println!(
        "{}",
        serde_json::json!({
            "model": a.model_dir, "split": a.split, "queries": nq, "documents": n, "dim": dim,
            "top10_overlap_int8_vs_f32": overlap(&int8), "top10_overlap_bf16_vs_f32": overlap(&bf16),
            "mrr@10_f32": mrr(&f32s), "mrr@10_bf16": mrr(&bf16), "mrr@10_int8": mrr(&int8),
            "max_abs_score_err_int8": err(&int8), "max_abs_score": scale,
            "top10_overlap_e4m3_vs_f32": overlap(&fp8), "mrr@10_e4m3": mrr(&fp8), "max_abs_score_err_e4m3": err(&fp8),
            "document_bytes_bf16": n * l * dim * 2, "document_bytes_int8": n * l * (dim + 4),
        })
    );
    Ok(())
}
