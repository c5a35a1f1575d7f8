//! The quickstart: score random ColBERT-like embeddings with the fused op,
//! check them against the naive reference, and print both timings.
//!
//!   cargo run --release --example score -- [--nq 32] [--nd 256] [--lq 32] [--ld 180] [--dim 128] [--cuda]
//!
//! `--help` lists the flags and their defaults.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use clap::builder::RangedU64ValueParser;
use clap::Parser;
use std::time::Instant;

/// Score random unit-norm ColBERT-like embeddings with the fused MaxSim op,
/// check them against the naive reference, and print both timings.
#[derive(Parser)]
#[command(name = "score", args_override_self = true)]
struct Args {
    /// Queries.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = RangedU64ValueParser::<usize>::from(1..))]
    nq: usize,
    /// Documents (about 20 % of their tokens masked out as padding).
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = RangedU64ValueParser::<usize>::from(1..))]
    nd: usize,
    /// Tokens per query.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = RangedU64ValueParser::<usize>::from(1..))]
    lq: usize,
    /// Tokens per document.
    #[arg(long, value_name = "N", default_value_t = 180, value_parser = RangedU64ValueParser::<usize>::from(1..))]
    ld: usize,
    /// Embedding width.
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = RangedU64ValueParser::<usize>::from(1..))]
    dim: usize,
    /// Run on CUDA device 0 in BF16 (default: the CPU in F32).
    #[arg(long)]
    cuda: bool,
}

fn timed(dev: &Device, f: impl Fn() -> candle_core::Result<Tensor>) -> Result<(Tensor, f64)> {
    f()?; // warm-up (CUDA: module load and autotuning)
    dev.synchronize()?;
    let t0 = Instant::now();
    let out = f()?;
    dev.synchronize()?;
    Ok((out, t0.elapsed().as_secs_f64() * 1e3))
}

fn main() -> Result<()> {
    let Args { nq, nd, lq, ld, dim, cuda } = Args::parse();
    let dev = if cuda { Device::new_cuda(0)? } else { Device::Cpu };
    let dtype = if dev.is_cuda() { DType::BF16 } else { DType::F32 };
    // Unit-norm token embeddings with ~20% padding in the documents.
    let q = candle_maxsim::l2_normalize(&Tensor::randn(0f32, 1., (nq, lq, dim), &dev)?)?.to_dtype(dtype)?;
    let d = candle_maxsim::l2_normalize(&Tensor::randn(0f32, 1., (nd, ld, dim), &dev)?)?.to_dtype(dtype)?;
    let d_mask = Tensor::rand(0f32, 1., (nd, ld), &dev)?.ge(0.2)?;

    let (fused, t_fused) = timed(&dev, || candle_maxsim::maxsim(&q, &d, None, Some(&d_mask)))?;
    let (naive, t_naive) = timed(&dev, || candle_maxsim::reference::maxsim(&q, &d, None, Some(&d_mask)))?;
    let diff = (&fused - &naive)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let scale = naive.abs()?.max_all()?.to_scalar::<f32>()?;

    println!("MaxSim scores [{nq} queries x {nd} documents], Lq={lq}, Ld={ld}, dim={dim}, {dtype:?} on {dev:?}");
    let rows: Vec<Vec<f32>> = fused.to_vec2()?;
    for (i, row) in rows.iter().take(4).enumerate() {
        let shown: Vec<String> = row.iter().take(6).map(|s| format!("{s:8.3}")).collect();
        println!("  q{i}: {} ...", shown.join(" "));
    }
    println!("fused     {t_fused:9.3} ms");
    println!("reference {t_naive:9.3} ms  ({:.1}x slower; it materializes [Nq, Nd, Lq, Ld])", t_naive / t_fused);
    println!("max |fused - reference| / max |reference| = {:.2e}", diff / scale);
    Ok(())
}
