//! Forward benchmark: one JSON line per case with shape, dtype, median ms,
//! effective TFLOP/s (2·Nq·Nd·Lq·Ld·dim / t) and peak device memory, for the
//! fused op and for `reference` (the naive materializing path) on the same
//! device and tensors.
//!
//!   cargo run --release --features cuda --example bench -- [--shape Nq,Nd,Lq,Ld,dim]... \
//!       [--dtype bf16|f16|f32|i8|e4m3] [--iters N] [--no-reference] [--cpu] [--wall] [--impl NAME] [--normalize] \
//!       [--train | --residual | --plaid-approx | --hidden]
//!
//! `--help` lists the flags and their defaults.
//!
//! `--train` times fwd+bwd (sum of the scores, backward) for each `Backward`
//! mode on colpali_train and colbert_train, and LowMem through
//! `maxsim_value_and_grads` (`lowmem_grads`, outside candle's autograd); the
//! peak memory of a step counts what it needs beyond Q, D and the gradients a
//! training loop keeps (as bench/peers.py measures late-interaction-kernels).
//! `--normalize` scores L2-normalized Q and D. `--plaid-approx` times
//! `plaid_approx_score` instead (65 536 centroids, Lq 32, 100 000 documents of
//! 1..=64 codes, U32 and I64 codes). `--residual` times fused scoring of
//! PLAID-compressed documents against decompress-then-`maxsim_varlen`.
//! `--hidden` times `maxsim_from_hidden` (dmodel 768 → dout 128, normalized)
//! against linear + bias + `l2_normalize` + `maxsim` with this crate's ops,
//! forward and fwd+bwd. `--impl NAME` times only the implementation whose
//! `impl` field is NAME. `--dtype i8` / `e4m3` time `maxsim_quantized` on
//! the same random rows quantized per token (`quantize` / `quantize_e4m3`;
//! forward only).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_maxsim::{Backward, MaxSimOptions};
use clap::builder::RangedU64ValueParser;
use clap::{ArgGroup, CommandFactory, Parser, ValueEnum};
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

type ScoreFn = dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>;

/// Training steps through `score` on fixed parameters Q and D: forward, sum
/// of the scores, backward. As bench/peers.py does for late-interaction-kernels
/// (a leaf tensor's `.grad` set to None at the start of each step), the
/// previous step's gradients are held until the next step begins, so the peak
/// memory of a step is what it needs beyond its inputs and the gradients a
/// training loop keeps.
struct Trainer {
    q: candle_core::Var,
    d: candle_core::Var,
    prev: std::cell::RefCell<Option<candle_core::backprop::GradStore>>,
    score: Box<ScoreFn>,
}

impl Trainer {
    fn new(q: &Tensor, d: &Tensor, score: Box<ScoreFn>) -> Result<Self> {
        let (q, d) = (candle_core::Var::from_tensor(q)?, candle_core::Var::from_tensor(d)?);
        Ok(Self { q, d, prev: Default::default(), score })
    }
    fn step(&self) -> Result<Tensor> {
        drop(self.prev.borrow_mut().take());
        let s = (self.score)(self.q.as_tensor(), self.d.as_tensor())?;
        let grads = s.sum_all()?.backward()?;
        let gd = grads.get(self.d.as_tensor()).unwrap().clone();
        *self.prev.borrow_mut() = Some(grads);
        Ok(gd)
    }
}

/// Forward (or, with --train, fwd+bwd) MaxSim benchmark: one JSON line per
/// case and implementation on stdout (median ms, TFLOP/s, peak device memory).
#[derive(Parser)]
#[command(name = "bench", args_override_self = true)]
#[command(group = ArgGroup::new("mode").args(["train", "residual", "plaid_approx", "hidden", "attention"]))]
struct Args {
    /// A case of Nq queries of Lq tokens against Nd documents of Ld tokens of
    /// width dim, named custom_0, custom_1, ... in order (repeatable; default:
    /// the built-in cases, colpali_train and colbert_train with --train).
    #[arg(long = "shape", value_name = "Nq,Nd,Lq,Ld,dim", value_parser = parse_shape)]
    shapes: Vec<[usize; 5]>,
    /// Element type of the queries and documents.
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    dtype: Dtype,
    /// Timed runs per implementation; the median is reported (`reference`
    /// takes at most 10 in the MaxSim cases).
    #[arg(long, value_name = "N", default_value_t = 50, value_parser = RangedU64ValueParser::<usize>::from(1..))]
    iters: usize,
    /// Skip the naive materializing `reference` path.
    #[arg(long = "no-reference")]
    no_reference: bool,
    /// Time from the host, synchronizing around each run (CUDA default:
    /// events around each run, L2 flushed before it).
    #[arg(long)]
    wall: bool,
    /// Run on the CPU (default: CUDA device 0 when there is one).
    #[arg(long)]
    cpu: bool,
    /// Time fwd+bwd training steps (sum of the scores, backward) instead of the forward.
    #[arg(long)]
    train: bool,
    /// Time fused residual (PLAID-compressed) scoring against decompress-then-`maxsim_varlen`.
    #[arg(long)]
    residual: bool,
    /// Time `plaid_approx_score` (centroid-only approximate scores).
    #[arg(long = "plaid-approx")]
    plaid_approx: bool,
    /// Time `maxsim_from_hidden` (the fused projection head) against
    /// linear + bias + `l2_normalize` + `maxsim`.
    #[arg(long)]
    hidden: bool,
    /// Time `nn::attention_varlen` (forward, and forward + backward of the
    /// sum of its output) against the padded `nn::attention` on the same
    /// rows: B sequences of L tokens, H heads of dh, with and without a
    /// sliding window (bench/attention_peers.py times torch's SDPA on them).
    #[arg(long)]
    attention: bool,
    /// Score L2-normalized queries and documents (MaxSim and --train cases).
    #[arg(long)]
    normalize: bool,
    /// Also time the forward that keeps the argmax (`maxsim_with_argmax`,
    /// the training forward's kernels), as `fused_argmax`.
    #[arg(long)]
    argmax: bool,
    /// Time only the implementations of these names (the `impl` field of
    /// the output; repeatable), e.g. to profile one alone.
    #[arg(long = "impl", value_name = "NAME")]
    only: Vec<String>,
}

/// `--dtype`.
#[derive(Clone, Copy, ValueEnum)]
enum Dtype {
    Bf16,
    F16,
    F32,
    /// Symmetric per-token 8-bit (`quantize`, `maxsim_quantized`).
    I8,
    /// Symmetric per-token FP8 e4m3 (`quantize_e4m3`, `maxsim_quantized`).
    E4m3,
}

impl From<Dtype> for DType {
    fn from(d: Dtype) -> Self {
        match d {
            Dtype::Bf16 => DType::BF16,
            Dtype::F16 => DType::F16,
            // 8-bit inputs are quantized from F32 rows.
            Dtype::F32 | Dtype::I8 | Dtype::E4m3 => DType::F32,
        }
    }
}

/// `--shape Nq,Nd,Lq,Ld,dim`.
fn parse_shape(s: &str) -> Result<[usize; 5], String> {
    let v: Vec<usize> = s
        .split(',')
        .map(|x| x.trim().parse())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("takes Nq,Nd,Lq,Ld,dim: {e}"))?;
    v.try_into().map_err(|_| "takes Nq,Nd,Lq,Ld,dim (five sizes)".to_string())
}

impl Args {
    fn dtype(&self) -> DType {
        self.dtype.into()
    }
    /// The cases to run: `--shape`s, or the built-in ones.
    fn cases(&self) -> Vec<(String, [usize; 5])> {
        if self.shapes.is_empty() {
            let cases: &[(&str, [usize; 5])] = if self.train { &TRAIN_CASES } else { &DEFAULT_CASES };
            cases.iter().map(|(n, s)| (n.to_string(), *s)).collect()
        } else {
            self.shapes.iter().enumerate().map(|(i, s)| (format!("custom_{i}"), *s)).collect()
        }
    }
    /// The implementations the chosen mode times, by `impl` name.
    fn impl_names(&self) -> &'static [&'static str] {
        if self.plaid_approx {
            &["fused", "reference"]
        } else if self.residual {
            &["fused", "decompress_then_maxsim"]
        } else if self.hidden {
            &["fused", "unfused", "fused_train", "unfused_train", "fused_grads"]
        } else if self.attention {
            &["varlen", "varlen_train", "padded", "padded_train"]
        } else if self.train {
            &["unified", "lowmem", "lowmem_grads", "reference"]
        } else {
            &["fused", "fused_argmax", "reference"]
        }
    }
    /// The implementations to time: all, or those `--impl` names.
    fn select<'a>(&self, impls: Vec<(&'a str, Box<Op<'a>>)>) -> Vec<(&'a str, Box<Op<'a>>)> {
        impls.into_iter().filter(|(n, _)| self.only.is_empty() || self.only.iter().any(|o| o == n)).collect()
    }
}

#[path = "common/mem.rs"]
mod mem;

/// Median milliseconds of `f` over `iters` runs after 3 warm-ups (the first
/// call also autotunes). On CUDA, timed as `triton.testing.do_bench` times
/// the Python implementations in bench/peers.py: the L2 cache flushed by a
/// 256 MB memset before each run, CUDA events around the run alone, so host
/// launch overhead overlaps the flush (`--wall` times from the host instead,
/// synchronizing around each run).
fn time(dev: &Device, iters: usize, wall: bool, f: &dyn Fn() -> Result<Tensor>) -> Result<(f64, Option<u64>)> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let base = mem::reset();
    let t = f()?;
    dev.synchronize()?;
    let peak = mem::peak_since(base);
    drop(t);
    #[cfg(feature = "cuda")]
    if let (Device::Cuda(cd), false) = (dev, wall) {
        return Ok((gpu_time(cd, iters, f)?, peak));
    }
    let _ = wall;
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

/// Median device time of `f` between CUDA events, L2 flushed before each run.
#[cfg(feature = "cuda")]
fn gpu_time(dev: &candle_core::CudaDevice, iters: usize, f: &dyn Fn() -> Result<Tensor>) -> Result<f64> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
    let stream = dev.cuda_stream();
    let mut flush = stream.alloc_zeros::<u8>(256 << 20)?;
    let mut runs = Vec::with_capacity(iters);
    for _ in 0..iters {
        stream.memset_zeros(&mut flush)?;
        let start = stream.record_event(Some(CU_EVENT_DEFAULT))?;
        let out = f()?;
        let end = stream.record_event(Some(CU_EVENT_DEFAULT))?;
        runs.push((start, end, out));
    }
    stream.synchronize()?;
    let mut ts = runs.iter().map(|(a, b, _)| Ok(a.elapsed_ms(b)? as f64)).collect::<Result<Vec<_>>>()?;
    ts.sort_by(f64::total_cmp);
    Ok(ts[ts.len() / 2])
}

/// `--attention`: (B, L, H, dh, window) cases of an encoder's attention:
/// MiniLM (12 x 32), BERT-base (12 x 64) and ModernBERT-base's global and
/// local (window 64 each side) layers, 512 tokens; 128-wide heads. TFLOP/s
/// count the dense FLOPs (4 B H L² dh forward, 2.5x that backward) and,
/// with a window, only the visible pairs.
fn attention_bench(dev: &Device, args: &Args) -> Result<()> {
    let cases: [(usize, usize, usize, usize, Option<usize>); 5] = [
        (32, 180, 12, 32, None),
        (32, 512, 12, 64, None),
        (32, 512, 12, 64, Some(64)),
        (16, 512, 16, 128, None),
        (4, 4096, 12, 64, None),
    ];
    let dt = args.dtype();
    for (b, l, h, dh, window) in cases {
        let hd = h * dh;
        let [q, k, v] = [0; 3].map(|_| Tensor::randn(0f32, 1., (b * l, hd), dev).and_then(|t| t.to_dtype(dt)));
        let (q, k, v) = (
            candle_core::Var::from_tensor(&q?)?,
            candle_core::Var::from_tensor(&k?)?,
            candle_core::Var::from_tensor(&v?)?,
        );
        // Offsets checked once, as an encoder holds them for its layers (a
        // `cu_seqlens` tensor per call is a copy to the host and a wait).
        let cu = candle_maxsim::nn::SeqOffsets::new(&Tensor::arange_step(0u32, (b * l + 1) as u32, l as u32, dev)?)?;
        let scale = 1.0 / (dh as f64).sqrt();
        let varlen = |q: &Tensor, k: &Tensor, v: &Tensor| {
            candle_maxsim::nn::attention_varlen_offsets(q, k, v, &cu, h, scale, window)
        };
        let mask: Vec<f32> = (0..l * l)
            .map(|x| if window.is_some_and(|w| (x / l).abs_diff(x % l) > w) { f32::MIN } else { 0. })
            .collect();
        let bias = Tensor::from_vec(mask, (1, 1, l, l), dev)?;
        let padded = |q: &Tensor, k: &Tensor, v: &Tensor| {
            let p = |t: &Tensor| t.reshape((b, l, hd));
            candle_maxsim::nn::attention(&p(q)?, &p(k)?, &p(v)?, &bias, h, scale)
        };
        let train = |f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>| -> Result<Tensor> {
            // The gradient of the output's sum, seeded directly (candle's sum_all is one block).
            let g = f(q.as_tensor(), k.as_tensor(), v.as_tensor())?.backward()?;
            Ok(g.get(q.as_tensor()).unwrap().clone())
        };
        let (qt, kt, vt) = (q.as_tensor().detach(), k.as_tensor().detach(), v.as_tensor().detach());
        let impls: Vec<(&str, Box<Op>)> = vec![
            ("varlen", Box::new(|| Ok(varlen(&qt, &kt, &vt)?))),
            ("varlen_train", Box::new(|| train(&varlen))),
            ("padded", Box::new(|| Ok(padded(&qt, &kt, &vt)?))),
            ("padded_train", Box::new(|| train(&padded))),
        ];
        let pairs: f64 = match window {
            None => (l * l) as f64,
            Some(w) => (0..l).map(|i| (i.min(w) + (l - 1 - i).min(w) + 1) as f64).sum(),
        };
        let fwd_flops = 4.0 * (b * h * dh) as f64 * pairs;
        for (imp, f) in &args.select(impls) {
            let (ms, peak) = time(dev, args.iters, args.wall, f.as_ref())?;
            let flops = if imp.ends_with("_train") { 3.5 * fwd_flops } else { fwd_flops };
            println!(
                "{{\"case\":\"attention\",\"impl\":\"{imp}\",\"dtype\":\"{}\",\"shape\":[{b},{l},{h},{dh}],\"window\":{},\"median_ms\":{ms:.4},\"tflops\":{:.1},\"peak_mem_mb\":{}}}",
                format!("{dt:?}").to_lowercase(),
                window.map_or("null".to_string(), |w| w.to_string()),
                flops / ms / 1e9,
                peak.map_or("null".to_string(), |p| format!("{:.1}", p as f64 / 1e6)),
            );
        }
    }
    Ok(())
}

/// `--plaid-approx`: the fused op and `reference` on the same tensors.
fn plaid_approx_bench(dev: &Device, args: &Args) -> Result<()> {
    let (n_c, lq, b, ld) = (65536, 32, 100_000, 64);
    let qcs = Tensor::randn(0f32, 1., (n_c, lq), dev)?;
    let lens = Tensor::rand(1f32, ld as f32 + 1., b, dev)?.to_dtype(DType::U32)?.clamp(1u32, ld as u32)?;
    let codes = Tensor::rand(0f32, n_c as f32, (b, ld), dev)?.to_dtype(DType::U32)?.clamp(0u32, n_c as u32 - 1)?;
    for codes in [codes.clone(), codes.to_dtype(DType::I64)?] {
        let mut impls: Vec<(&str, Box<Op>)> =
            vec![("fused", Box::new(|| Ok(candle_maxsim::plaid::plaid_approx_score(&qcs, &codes, &lens)?)))];
        if !args.no_reference {
            impls.push((
                "reference",
                Box::new(|| Ok(candle_maxsim::reference::plaid::plaid_approx_score(&qcs, &codes, &lens)?)),
            ));
        }
        for (imp, f) in &args.select(impls) {
            let (ms, peak) = time(dev, args.iters, args.wall, f.as_ref())?;
            println!(
                "{{\"case\":\"plaid_approx\",\"impl\":\"{imp}\",\"device\":\"{}\",\"shape\":[{n_c},{lq},{b},{ld}],\"codes\":\"{:?}\",\"median_ms\":{ms:.4},\"peak_mem_mb\":{}}}",
                if dev.is_cuda() { "cuda" } else { "cpu" },
                codes.dtype(),
                peak.map_or("null".to_string(), |p| format!("{:.1}", p as f64 / 1e6)),
            );
        }
    }
    Ok(())
}

/// `--residual`: 1 query (Lq 32, dim 128) against 10 000 packed documents of
/// 150..=300 tokens, 65 536 F16 centroids, nbits 2 and 4, normalized: the
/// fused op and decompress-then-`maxsim_varlen` with this crate's own kernels,
/// on the same tensors.
fn residual_bench(dev: &Device, args: &Args) -> Result<()> {
    let (n_c, dim, lq, nd) = (65536usize, 128usize, 32usize, 10_000usize);
    let mut x = 12345u64;
    let lens: Vec<u32> = (0..nd)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            150 + ((x >> 33) % 151) as u32
        })
        .collect();
    let mut cu = vec![0u32];
    for l in &lens {
        cu.push(cu.last().unwrap() + l);
    }
    let t = *cu.last().unwrap() as usize;
    let cu = Tensor::new(cu, dev)?;
    let q = candle_maxsim::l2_normalize(&Tensor::randn(0f32, 1., (1, lq, dim), dev)?)?.to_dtype(args.dtype())?;
    let centroids = candle_maxsim::l2_normalize(&Tensor::randn(0f32, 1., (n_c, dim), dev)?)?.to_dtype(DType::F16)?;
    let codes = Tensor::rand(0f32, n_c as f32, t, dev)?.to_dtype(DType::U32)?.clamp(0u32, n_c as u32 - 1)?;
    for nbits in [2usize, 4] {
        let w = dim * nbits / 8;
        let residuals = Tensor::rand(0f32, 256., (t, w), dev)?.floor()?.clamp(0f32, 255f32)?.to_dtype(DType::U8)?;
        let bw: Vec<f32> = (0..1 << nbits).map(|k| (k as f32 - ((1 << nbits) - 1) as f32 / 2.0) * 0.02).collect();
        let codec = candle_maxsim::residual::ResidualCodec {
            centroids: centroids.clone(),
            bucket_weights: Tensor::new(bw, dev)?,
            nbits,
            bit_order: candle_maxsim::residual::BitOrder::ColBert,
        };
        let impls: Vec<(&str, Box<Op>)> = vec![
            (
                "fused",
                Box::new(|| {
                    Ok(candle_maxsim::residual::maxsim_residual_varlen(&q, &codes, &residuals, &cu, 300, &codec, true)?)
                }),
            ),
            (
                "decompress_then_maxsim",
                Box::new(|| {
                    let d = codec.decompress_dense(&codes, &residuals, args.dtype(), true)?;
                    let cu_q = Tensor::new(&[0u32, lq as u32], q.device())?;
                    Ok(candle_maxsim::maxsim_varlen(&q.reshape((lq, dim))?, &cu_q, lq, &d, &cu, 300)?)
                }),
            ),
        ];
        for (imp, f) in &args.select(impls) {
            let (ms, peak) = time(dev, args.iters, args.wall, f.as_ref())?;
            println!(
                "{{\"case\":\"residual_varlen_nb{nbits}\",\"impl\":\"{imp}\",\"shape\":[1,{nd},{lq},{t},{dim}],\"median_ms\":{ms:.4},\"peak_mem_mb\":{}}}",
                peak.map_or("null".to_string(), |p| format!("{:.1}", p as f64 / 1e6)),
            );
        }
    }
    Ok(())
}

/// `--hidden`: the projection-head cases, the fused op against linear +
/// bias + `l2_normalize` + `maxsim` (this crate's ops), forward and fwd+bwd.
fn hidden_bench(dev: &Device, args: &Args) -> Result<()> {
    let (dmodel, dout) = (768usize, 128usize);
    // The third: few documents, many queries (the grid splits the queries so every SM works).
    let cases = [
        ("hidden_rerank", [1usize, 1000, 32, 300]),
        ("hidden_inbatch", [128, 128, 32, 1024]),
        ("hidden_fewdocs", [1000, 4, 32, 300]),
    ];
    for (name, [nq, nd, lq, ld]) in cases {
        let q = candle_maxsim::l2_normalize(&Tensor::randn(0f32, 1., (nq, lq, dout), dev)?)?.to_dtype(args.dtype())?;
        let h = Tensor::randn(0f32, 1., (nd, ld, dmodel), dev)?.to_dtype(args.dtype())?;
        let w = (Tensor::randn(0f32, 1., (dout, dmodel), dev)? / (dmodel as f64).sqrt())?.to_dtype(args.dtype())?;
        let b = (Tensor::randn(0f32, 1., dout, dev)? * 0.1)?.to_dtype(args.dtype())?;
        let unfused = |q: &Tensor, h: &Tensor, w: &Tensor, b: &Tensor| -> candle_core::Result<Tensor> {
            let p = h.reshape((nd * ld, dmodel))?.matmul(&w.t()?)?.broadcast_add(b)?;
            let d = candle_maxsim::l2_normalize(&p.reshape((nd, ld, dout))?)?;
            candle_maxsim::maxsim(q, &d, None, None)
        };
        let vars =
            [&q, &h, &w, &b].map(candle_core::Var::from_tensor).into_iter().collect::<candle_core::Result<Vec<_>>>()?;
        let train = |f: &dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>| -> Result<Tensor> {
            let s = f(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), vars[3].as_tensor())?;
            let g = s.sum_all()?.backward()?;
            Ok(g.get(vars[2].as_tensor()).unwrap().clone())
        };
        let fused = |q: &Tensor, h: &Tensor, w: &Tensor, b: &Tensor| {
            candle_maxsim::maxsim_from_hidden(q, h, w, Some(b), None, true)
        };
        let impls: Vec<(&str, Box<Op>)> = vec![
            ("fused", Box::new(|| Ok(fused(&q, &h, &w, &b)?))),
            ("unfused", Box::new(|| Ok(unfused(&q, &h, &w, &b)?))),
            ("fused_train", Box::new(|| train(&fused))),
            ("unfused_train", Box::new(|| train(&unfused))),
            // The closed-form backward outside candle's autograd (d loss / d scores = 1).
            (
                "fused_grads",
                Box::new(|| {
                    let ones = |s: &Tensor| s.ones_like();
                    let (_, g) =
                        candle_maxsim::maxsim_from_hidden_value_and_grads(&q, &h, &w, Some(&b), None, true, ones)?;
                    Ok(g.w)
                }),
            ),
        ];
        let flop = 2.0 * ((nq * nd * lq * ld * dout) + nd * ld * dmodel * dout) as f64;
        for (imp, f) in &args.select(impls) {
            let (ms, peak) = time(dev, args.iters, args.wall, f.as_ref())?;
            println!(
                "{{\"case\":\"{name}\",\"impl\":\"{imp}\",\"shape\":[{nq},{nd},{lq},{ld},{dmodel},{dout}],\"median_ms\":{ms:.4},\"tflops\":{:.1},\"peak_mem_mb\":{}}}",
                flop / (ms * 1e-3) / 1e12,
                peak.map_or("null".to_string(), |p| format!("{:.1}", p as f64 / 1e6)),
            );
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(only) = args.only.iter().find(|o| !args.impl_names().contains(&o.as_str())) {
        let msg = format!("no implementation '{only}' here (this mode times: {})", args.impl_names().join(", "));
        Args::command().error(clap::error::ErrorKind::InvalidValue, msg).exit();
    }
    let dev = if args.cpu { Device::Cpu } else { Device::cuda_if_available(0)? };
    if args.plaid_approx {
        return plaid_approx_bench(&dev, &args);
    }
    if args.residual {
        return residual_bench(&dev, &args);
    }
    if args.hidden {
        return hidden_bench(&dev, &args);
    }
    if args.attention {
        return attention_bench(&dev, &args);
    }
    let int8 = matches!(args.dtype, Dtype::I8 | Dtype::E4m3);
    if int8 && (args.train || args.normalize) {
        anyhow::bail!("--dtype i8 / e4m3 time the forward of unnormalized rows only (no --train, --normalize)")
    }
    let dname = match args.dtype {
        Dtype::I8 => "i8".to_string(),
        Dtype::E4m3 => "e4m3".to_string(),
        _ => format!("{:?}", args.dtype()).to_lowercase(),
    };
    for (name, [nq, nd, lq, ld, dim]) in &args.cases() {
        let q = Tensor::randn(0f32, 1., (*nq, *lq, *dim), &dev)?.to_dtype(args.dtype())?;
        let d = Tensor::randn(0f32, 1., (*nd, *ld, *dim), &dev)?.to_dtype(args.dtype())?;
        // fwd+bwd counts the forward GEMM only (the backward is gathers, not GEMMs).
        let flop = 2.0 * (*nq * *nd * *lq * *ld * *dim) as f64;
        let mut impls: Vec<(&str, Box<Op>)> = if args.train {
            [("unified", Backward::Unified), ("lowmem", Backward::LowMem)]
                .into_iter()
                .map(|(name, backward)| {
                    let opts = MaxSimOptions { normalize: args.normalize, backward };
                    let t = Trainer::new(
                        &q,
                        &d,
                        Box::new(move |q, d| candle_maxsim::maxsim_with(q, d, None, None, &opts)),
                    )?;
                    let f: Box<Op> = Box::new(move || t.step());
                    Ok((name, f))
                })
                .chain((!args.normalize).then(|| {
                    // The same LowMem kernels outside candle's autograd
                    // (`maxsim_value_and_grads`): the gradients are allocated
                    // once; the previous step's are kept until the next begins.
                    let (q, d) = (q.clone(), d.clone());
                    let prev = std::cell::RefCell::new(None::<(Tensor, Tensor)>);
                    let f: Box<Op> = Box::new(move || {
                        drop(prev.borrow_mut().take());
                        let (_, gq, gd) =
                            candle_maxsim::maxsim_value_and_grads(&q, &d, None, None, Backward::LowMem, |s| {
                                s.ones_like()
                            })?;
                        *prev.borrow_mut() = Some((gq, gd.clone()));
                        Ok(gd)
                    });
                    Ok(("lowmem_grads", f))
                }))
                .collect::<Result<_>>()?
        } else if int8 {
            let quantize = if matches!(args.dtype, Dtype::E4m3) {
                candle_maxsim::quantized::quantize_e4m3
            } else {
                candle_maxsim::quantized::quantize
            };
            let (q8, d8) = (quantize(&q)?, quantize(&d)?);
            vec![("fused", Box::new(move || Ok(candle_maxsim::quantized::maxsim_quantized(&q8, &d8, None, None)?)))]
        } else {
            let opts = MaxSimOptions { normalize: args.normalize, ..Default::default() };
            let (q, d) = (q.clone(), d.clone());
            let mut v: Vec<(&str, Box<Op>)> = vec![(
                "fused",
                Box::new({
                    let (q, d) = (q.clone(), d.clone());
                    move || Ok(candle_maxsim::maxsim_with(&q, &d, None, None, &opts)?)
                }),
            )];
            if args.argmax {
                let (q, d) = (q.clone(), d.clone());
                v.push((
                    "fused_argmax",
                    Box::new(move || Ok(candle_maxsim::maxsim_with_argmax(&q, &d, None, None)?.0)),
                ));
            }
            v
        };
        // The naive path materializes [Nq, Nd, Lq, Ld] in f32: skip it past 40 GB.
        if !args.no_reference && !int8 && (nq * nd * lq * ld * 4) as f64 <= 40e9 {
            impls.push(if args.train {
                let t = Trainer::new(&q, &d, Box::new(|q, d| candle_maxsim::reference::maxsim(q, d, None, None)))?;
                ("reference", Box::new(move || t.step()))
            } else {
                ("reference", Box::new(|| Ok(candle_maxsim::reference::maxsim(&q, &d, None, None)?)))
            });
        }
        for (imp, f) in &args.select(impls) {
            let iters = if *imp == "reference" { args.iters.min(10) } else { args.iters };
            let (ms, peak) = time(&dev, iters, args.wall, f.as_ref())?;
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
