//! How much symmetric 8-bit scoring (`quantize`, `maxsim_quantized`) changes
//! rankings against BF16 and F32 `maxsim`, on a generated collection with the
//! structure of ColBERT embeddings: `--topics` topics of 60 word vectors each
//! plus 2000 common words (dim 128), documents of 100-260 tokens with 70 % of
//! their tokens from their topic's words, contextual noise on every token,
//! L2-normalized; each query is 32 noisy tokens of one document (its planted
//! answer). Prints one JSON line: the mean top-10 overlap of each pair of
//! rankings, recall@10 of the planted documents, and the 8-bit scores' error
//! against F32 (largest and median, relative to the largest F32 score).
//! The same for FP8 e4m3 (`quantize_e4m3`, `maxsim_quantized`: each row
//! divided by max|x| / 448 and rounded to e4m3; on CUDA the Hopper e4m3
//! tensor-core kernels, on the CPU the dequantized rows in F32).
//!
//!     cargo run --release --example int8_agreement -- [--docs 3000] [--topics 150] \
//!         [--queries 128] [--seed 0] [--cuda]

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use rand::{Rng, SeedableRng};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 3000)]
    docs: usize,
    #[arg(long, default_value_t = 150)]
    topics: usize,
    #[arg(long, default_value_t = 128)]
    queries: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long)]
    cuda: bool,
}

const DIM: usize = 128;
const WORDS: usize = 60;
const COMMON: usize = 2000;
const MAX_LEN: usize = 260;
const LQ: usize = 32;

struct Gen(rand::rngs::StdRng);

impl Gen {
    /// A standard normal draw (Box-Muller).
    fn normal(&mut self) -> f32 {
        let (u, v): (f32, f32) = (self.0.random::<f32>().max(1e-12), self.0.random());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
    /// `base + sigma · N(0, 1/dim)` per feature, L2-normalized (`base` None: zero).
    fn unit_near(&mut self, base: Option<&[f32]>, sigma: f32) -> Vec<f32> {
        let s = sigma / (DIM as f32).sqrt();
        let mut x: Vec<f32> = (0..DIM).map(|k| base.map_or(0.0, |b| b[k]) + s * self.normal()).collect();
        let n = x.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
        x.iter_mut().for_each(|v| *v /= n);
        x
    }
}

fn top10(row: &[f32]) -> Vec<usize> {
    let mut i: Vec<usize> = (0..row.len()).collect();
    i.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    i.truncate(10);
    i
}

fn overlap(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let per = a.iter().zip(b).map(|(x, y)| {
        let (tx, ty) = (top10(x), top10(y));
        tx.iter().filter(|d| ty.contains(d)).count() as f64 / tx.len().max(1) as f64
    });
    per.sum::<f64>() / a.len().max(1) as f64
}

fn main() -> Result<()> {
    let a = Args::parse();
    let dev = if a.cuda { Device::new_cuda(0)? } else { Device::Cpu };
    let mut g = Gen(rand::rngs::StdRng::seed_from_u64(a.seed));
    // The vocabulary: topic words near their topic's centre, and common words.
    let centres: Vec<Vec<f32>> = (0..a.topics).map(|_| g.unit_near(None, (DIM as f32).sqrt())).collect();
    let mut vocab: Vec<Vec<f32>> = Vec::with_capacity(a.topics * WORDS + COMMON);
    for c in &centres {
        for _ in 0..WORDS {
            vocab.push(g.unit_near(Some(c), 0.6));
        }
    }
    for _ in 0..COMMON {
        vocab.push(g.unit_near(None, (DIM as f32).sqrt()));
    }
    // Documents, padded to MAX_LEN with a mask.
    let mut d = vec![0f32; a.docs * MAX_LEN * DIM];
    let mut mask = vec![0u8; a.docs * MAX_LEN];
    let mut lens = Vec::with_capacity(a.docs);
    for j in 0..a.docs {
        let (len, topic) = (g.0.random_range(100..=MAX_LEN), g.0.random_range(0..a.topics));
        for t in 0..len {
            let w = if g.0.random::<f32>() < 0.7 {
                topic * WORDS + g.0.random_range(0..WORDS)
            } else {
                a.topics * WORDS + g.0.random_range(0..COMMON)
            };
            let x = g.unit_near(Some(&vocab[w]), 0.35);
            d[(j * MAX_LEN + t) * DIM..][..DIM].copy_from_slice(&x);
            mask[j * MAX_LEN + t] = 1;
        }
        lens.push(len);
    }
    // Queries: 32 noisy tokens of a planted document each.
    let mut q = vec![0f32; a.queries * LQ * DIM];
    let mut planted = Vec::with_capacity(a.queries);
    for i in 0..a.queries {
        let j = g.0.random_range(0..a.docs);
        for s in 0..LQ {
            let t = g.0.random_range(0..lens[j]);
            let x = g.unit_near(Some(&d[(j * MAX_LEN + t) * DIM..][..DIM]), 0.3);
            q[(i * LQ + s) * DIM..][..DIM].copy_from_slice(&x);
        }
        planted.push(j);
    }
    let q = Tensor::from_vec(q, (a.queries, LQ, DIM), &dev)?;
    let d = Tensor::from_vec(d, (a.docs, MAX_LEN, DIM), &dev)?;
    let dm = Tensor::from_vec(mask, (a.docs, MAX_LEN), &dev)?;

    let rows = |t: Tensor| -> Result<Vec<Vec<f32>>> { Ok(t.to_dtype(DType::F32)?.to_vec2::<f32>()?) };
    let f32s = rows(candle_maxsim::maxsim(&q, &d, None, Some(&dm))?)?;
    let bf16 = rows(candle_maxsim::maxsim(&q.to_dtype(DType::BF16)?, &d.to_dtype(DType::BF16)?, None, Some(&dm))?)?;
    let (q8, d8) = (candle_maxsim::quantized::quantize(&q)?, candle_maxsim::quantized::quantize(&d)?);
    let int8 = rows(candle_maxsim::quantized::maxsim_quantized(&q8, &d8, None, Some(&dm))?)?;
    let (qf8, df8) = (candle_maxsim::quantized::quantize_e4m3(&q)?, candle_maxsim::quantized::quantize_e4m3(&d)?);
    let fp8 = rows(candle_maxsim::quantized::maxsim_quantized(&qf8, &df8, None, Some(&dm))?)?;

    let recall = |s: &[Vec<f32>]| {
        s.iter().zip(&planted).filter(|(row, j)| top10(row).contains(j)).count() as f64 / s.len().max(1) as f64
    };
    let scale = f32s.iter().flatten().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    let mut errs: Vec<f32> =
        f32s.iter().flatten().zip(int8.iter().flatten()).map(|(x, y)| (x - y).abs() / scale).collect();
    errs.sort_by(f32::total_cmp);
    let max_err = |s: &[Vec<f32>]| {
        f32s.iter().flatten().zip(s.iter().flatten()).fold(0f32, |m, (x, y)| m.max((x - y).abs() / scale))
    };
    println!(
        "{{\"collection\":\"clustered\",\"seed\":{},\"docs\":{},\"topics\":{},\"queries\":{},\"tokens\":{},\"device\":\"{}\",\
         \"top10_overlap_int8_vs_bf16\":{:.4},\"top10_overlap_int8_vs_f32\":{:.4},\"top10_overlap_bf16_vs_f32\":{:.4},\
         \"recall10_planted_f32\":{:.4},\"recall10_planted_bf16\":{:.4},\"recall10_planted_int8\":{:.4},\
         \"int8_max_rel_err_vs_f32\":{:.2e},\"int8_median_rel_err_vs_f32\":{:.2e},\"bf16_max_rel_err_vs_f32\":{:.2e},\
         \"top10_overlap_e4m3_vs_bf16\":{:.4},\"recall10_planted_e4m3\":{:.4},\"e4m3_max_rel_err_vs_f32\":{:.2e}}}",
        a.seed,
        a.docs,
        a.topics,
        a.queries,
        lens.iter().sum::<usize>(),
        if a.cuda { "cuda" } else { "cpu" },
        overlap(&int8, &bf16),
        overlap(&int8, &f32s),
        overlap(&bf16, &f32s),
        recall(&f32s),
        recall(&bf16),
        recall(&int8),
        errs.last().copied().unwrap_or(0.0),
        errs.get(errs.len() / 2).copied().unwrap_or(0.0),
        max_err(&bf16),
        overlap(&fp8, &bf16),
        recall(&fp8),
        max_err(&fp8),
    );
    Ok(())
}
