//! Tile-configuration sweep of the CUDA forward: runs the autotuner over a
//! grid of problem shapes and prints, for each, every candidate tile
//! configuration's time. These measurements are what the static tile
//! heuristic (src/cuda/maxsim_fwd.rs, `static_config`) is derived from;
//! rerun this on a new GPU before changing it.
//!
//!   CANDLE_MAXSIM_LOG=1 cargo run --release --features cuda --example tile_sweep -- [--dtype bf16] > sweep.txt 2>&1
//!
//! Each problem prints one JSON line to stdout (layout, sizes, dtype,
//! variant); with `CANDLE_MAXSIM_LOG=1` the autotuner's decision, with every
//! candidate's time, follows on stderr.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use clap::Parser;

/// Sweep the forward's tile configurations over a grid of shapes.
#[derive(Parser)]
struct Args {
    /// Input dtypes to sweep (comma-separated: bf16, f16, f32).
    #[arg(long, default_value = "bf16,f16", value_delimiter = ',')]
    dtype: Vec<String>,
    /// Embedding dims to sweep (comma-separated).
    #[arg(long, default_value = "48,64,96,128", value_delimiter = ',')]
    dims: Vec<usize>,
}

/// A problem: `layout` is "cross" (`[Nq, Nd]`), "kd" (`[Nq, K]`, `nd` = K).
struct Shape {
    layout: &'static str,
    nq: usize,
    lq: usize,
    nd: usize,
    ld: usize,
}

fn shapes() -> Vec<Shape> {
    let mut v = Vec::new();
    let cross = |nq, lq, nd, ld| Shape { layout: "cross", nq, lq, nd, ld };
    // Reranking: one or a few queries against many documents.
    for (nq, lq) in [(1, 32), (1, 64), (4, 32)] {
        for nd in [100, 1000, 10000] {
            for ld in [128, 300] {
                v.push(cross(nq, lq, nd, ld));
            }
        }
    }
    // Scans: a batch of short queries against a collection.
    for ld in [64, 128, 256] {
        v.push(cross(32, 32, 10000, ld));
    }
    // In-batch grids, small to large.
    for n in [16, 32, 64, 128, 256] {
        for ld in [64, 180, 300, 512] {
            v.push(cross(n, 32, n, ld));
        }
    }
    // Long queries (ColPali pages).
    for (nq, nd) in [(16, 16), (64, 64), (64, 256)] {
        v.push(cross(nq, 1024, nd, 1024));
    }
    v.push(cross(16, 128, 256, 300));
    // KD lists: each query its own K documents.
    for (nq, k) in [(32, 8), (64, 32), (256, 8)] {
        for ld in [180, 300] {
            v.push(Shape { layout: "kd", nq, lq: 32, nd: k, ld });
        }
    }
    v
}

fn main() -> Result<()> {
    let args = Args::parse();
    // Time every candidate (the decisions and their timings go to stderr).
    candle_maxsim::set_tile_selection(candle_maxsim::TileSelection::Autotune);
    let dev = Device::new_cuda(0)?;
    for dt in &args.dtype {
        let dtype = match dt.as_str() {
            "bf16" => DType::BF16,
            "f16" => DType::F16,
            "f32" => DType::F32,
            other => anyhow::bail!("--dtype: unknown dtype {other}"),
        };
        for &dim in &args.dims {
            for s in shapes() {
                let q = Tensor::randn(0f32, 1., (s.nq, s.lq, dim), &dev)?.to_dtype(dtype)?;
                let d = match s.layout {
                    "kd" => Tensor::randn(0f32, 1., (s.nq, s.nd, s.ld, dim), &dev)?,
                    _ => Tensor::randn(0f32, 1., (s.nd, s.ld, dim), &dev)?,
                }
                .to_dtype(dtype)?;
                for variant in ["nograd", "argmax"] {
                    println!(
                        "{{\"layout\": \"{}\", \"nq\": {}, \"lq\": {}, \"nd\": {}, \"ld\": {}, \"dim\": {dim}, \"dtype\": \"{dt}\", \"variant\": \"{variant}\"}}",
                        s.layout, s.nq, s.lq, s.nd, s.ld
                    );
                    if variant == "nograd" {
                        candle_maxsim::maxsim(&q, &d, None, None)?;
                    } else {
                        candle_maxsim::maxsim_with_argmax(&q, &d, None, None)?;
                    }
                    dev.synchronize()?;
                }
            }
        }
    }
    Ok(())
}
