//! Forward benchmark: one JSON line per case with shape, dtype, median ms,
//! effective TFLOP/s (2·Nq·Nd·Lq·Ld·dim / t) and peak device memory, for the
//! fused op and for `reference` (the naive materializing path) on the same
//! device and tensors.
//!
//!   cargo run --release --features cuda --example bench -- [--shape Nq,Nd,Lq,Ld,dim]... \
//!       [--dtype bf16|f16|f32] [--iters N] [--no-reference] [--cpu] [--train]
//!
//! `--train` times fwd+bwd (sum of the scores, backward) for each `Backward`
//! mode on colpali_train and colbert_train.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_maxsim::{Backward, MaxSimOptions};
use std::time::Instant;

const DEFAULT_CASES: [(&str, [usize; 5]); 6] = [
    ("colpali_inbatch", [128, 128, 128, 1024, 128]),
    ("colbert_inbatch", [256, 256, 32, 256, 128]),
    ("rerank_colbert_1q", [1, 1000, 32, 300, 128]),
    ("rerank_colpali_1q", [1, 1000, 128, 1024, 128]),
    ("longdoc", [16, 32, 32, 8192, 128]),
    ("scan_32q_10k", [32, 10000, 32, 256, 128]),
];

/// One benchmarked implementation.
type Op<'a> = dyn Fn() -> Result<Tensor> + 'a;

const TRAIN_CASES: [(&str, [usize; 5]); 2] =
    [("colpali_train", [128, 128, 128, 1024, 128]), ("colbert_train", [256, 256, 32, 256, 128])];

/// One training step through `score`: forward, sum of the scores, backward.
fn train_step(
    q: &Tensor,
    d: &Tensor,
    score: &dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
) -> Result<Tensor> {
    let (qv, dv) = (candle_core::Var::from_tensor(q)?, candle_core::Var::from_tensor(d)?);
    let s = score(qv.as_tensor(), dv.as_tensor())?;
    let grads = s.sum_all()?.backward()?;
    Ok(grads.get(dv.as_tensor()).unwrap().clone())
}

struct Args {
    cases: Vec<(String, [usize; 5])>,
    dtype: DType,
    iters: usize,
    reference: bool,
    cpu: bool,
    /// fwd+bwd (training step) instead of the forward alone.
    train: bool,
}

fn parse() -> Result<Args> {
    let mut a = Args { cases: vec![], dtype: DType::BF16, iters: 50, reference: true, cpu: false, train: false };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--shape" => {
                let v: Vec<usize> =
                    it.next().unwrap_or_default().split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>()?;
                if v.len() != 5 {
                    bail!("--shape takes Nq,Nd,Lq,Ld,dim")
                }
                a.cases.push((format!("custom_{}", a.cases.len()), [v[0], v[1], v[2], v[3], v[4]]));
            }
            "--dtype" => {
                a.dtype = match it.next().as_deref() {
                    Some("bf16") => DType::BF16,
                    Some("f16") => DType::F16,
                    Some("f32") => DType::F32,
                    d => bail!("--dtype: bf16, f16 or f32, got {d:?}"),
                }
            }
            "--iters" => a.iters = it.next().unwrap_or_default().parse()?,
            "--no-reference" => a.reference = false,
            "--cpu" => a.cpu = true,
            "--train" => a.train = true,
            x => bail!("unknown argument {x}"),
        }
    }
    if a.cases.is_empty() {
        let cases: &[(&str, [usize; 5])] = if a.train { &TRAIN_CASES } else { &DEFAULT_CASES };
        a.cases = cases.iter().map(|(n, s)| (n.to_string(), *s)).collect();
    }
    Ok(a)
}

#[path = "common/mem.rs"]
mod mem;

/// Median milliseconds of `f` over `iters` runs after 3 warm-ups (the first
/// call also autotunes). The device is synchronized around each run.
fn time(dev: &Device, iters: usize, f: &dyn Fn() -> Result<Tensor>) -> Result<(f64, Option<u64>)> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let base = mem::reset();
    let t = f()?;
    dev.synchronize()?;
    let peak = mem::peak_since(base);
    drop(t);
    let mut ts = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t0 = Instant::now();
        let out = f()?;
        dev.synchronize()?;
        ts.push(t0.elapsed().as_secs_f64() * 1e3);
        drop(out);
    }
    ts.sort_by(f64::total_cmp);
    Ok((ts[ts.len() / 2], peak))
}

fn main() -> Result<()> {
    let args = parse()?;
    let dev = if args.cpu { Device::Cpu } else { Device::cuda_if_available(0)? };
    let dname = format!("{:?}", args.dtype).to_lowercase();
    for (name, [nq, nd, lq, ld, dim]) in &args.cases {
        let q = Tensor::randn(0f32, 1., (*nq, *lq, *dim), &dev)?.to_dtype(args.dtype)?;
        let d = Tensor::randn(0f32, 1., (*nd, *ld, *dim), &dev)?.to_dtype(args.dtype)?;
        // fwd+bwd counts the forward GEMM only (the backward is gathers, not GEMMs).
        let flop = 2.0 * (*nq * *nd * *lq * *ld * *dim) as f64;
        let mut impls: Vec<(&str, Box<Op>)> = if args.train {
            [("unified", Backward::Unified), ("lowmem", Backward::LowMem)]
                .into_iter()
                .map(|(name, backward)| {
                    let opts = MaxSimOptions { normalize: false, backward };
                    let (q, d) = (q.clone(), d.clone());
                    let f: Box<Op> = Box::new(move || {
                        train_step(&q, &d, &|q, d| candle_maxsim::maxsim_with(q, d, None, None, &opts))
                    });
                    (name, f)
                })
                .collect()
        } else {
            vec![("fused", Box::new(|| Ok(candle_maxsim::maxsim(&q, &d, None, None)?)))]
        };
        // The naive path materializes [Nq, Nd, Lq, Ld] in f32: skip it past 40 GB.
        if args.reference && (nq * nd * lq * ld * 4) as f64 <= 40e9 {
            impls.push(if args.train {
                (
                    "reference",
                    Box::new(|| train_step(&q, &d, &|q, d| candle_maxsim::reference::maxsim(q, d, None, None))),
                )
            } else {
                ("reference", Box::new(|| Ok(candle_maxsim::reference::maxsim(&q, &d, None, None)?)))
            });
        }
        for (imp, f) in &impls {
            let iters = if *imp == "reference" { args.iters.min(10) } else { args.iters };
            let (ms, peak) = time(&dev, iters, f.as_ref())?;
            println!(
                "{{\"case\":\"{name}\",\"impl\":\"{imp}\",\"device\":\"{}\",\"shape\":[{nq},{nd},{lq},{ld},{dim}],\"dtype\":\"{dname}\",\"median_ms\":{ms:.4},\"tflops\":{:.1},\"peak_mem_mb\":{}}}",
                if dev.is_cuda() { "cuda" } else { "cpu" },
                flop / (ms * 1e-3) / 1e12,
                peak.map_or("null".to_string(), |p| format!("{:.1}", p as f64 / 1e6)),
            );
        }
    }
    Ok(())
}
