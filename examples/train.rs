//! Contrastive training through MaxSim: a trainable projection head over
//! fixed token features, in-batch negatives (cross-entropy over the
//! `[B, B]` score matrix, the diagonal as positives), AdamW. Prints the loss
//! of each step, the step time and (CUDA) peak device memory, for the fused
//! op under candle's autograd, for the same kernels through
//! `maxsim_value_and_grads` (gradients of the scores' loss filed once, then
//! chained into the head), and for the same step with `reference` scoring.
//!
//!   cargo run --release --example train -- [--steps 30] [--batch 32] [--cuda]
//!
//! `--help` lists the flags and their defaults. tests/train.rs runs `run` on
//! the CPU and checks that the loss falls.

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{linear_no_bias, loss, optim::AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use clap::builder::RangedU64ValueParser;
use clap::Parser;
use std::time::Instant;

#[path = "common/mem.rs"]
mod mem;

#[derive(Clone, Debug)]
pub struct Config {
    pub steps: usize,
    pub batch: usize,
    pub lq: usize,
    pub ld: usize,
    pub dmodel: usize,
    pub dout: usize,
    pub lr: f64,
    pub scoring: Scoring,
    pub seed_docs: usize,
}

/// How the step scores and differentiates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// `maxsim_with` under candle's autograd.
    Fused,
    /// `maxsim_value_and_grads`: MaxSim's gradients without autograd,
    /// chained into the head through a surrogate loss Σ q ⊙ grad_q + Σ d ⊙ grad_d.
    Grads,
    /// `reference::maxsim_with` (materializing) under autograd.
    Reference,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            steps: 30,
            batch: 32,
            lq: 16,
            ld: 64,
            dmodel: 96,
            dout: 32,
            lr: 1e-2,
            scoring: Scoring::Fused,
            seed_docs: 512,
        }
    }
}

/// A synthetic retrieval task. Token features have a few informative
/// dimensions and many loud nuisance ones; a query is a noisy copy of the
/// informative part of a few tokens of its document, with fresh nuisance.
/// A random head mixes the nuisance into every score; training must learn
/// to project onto the informative dimensions.
struct Task {
    signal: Tensor, // [N, Ld, SIGNAL]
}

const SIGNAL: usize = 16;
const NUISANCE_STD: f32 = 0.7;

impl Task {
    fn new(cfg: &Config, dev: &Device) -> Result<Self> {
        Ok(Self { signal: Tensor::randn(0f32, 1., (cfg.seed_docs, cfg.ld, SIGNAL), dev)? })
    }
    fn with_nuisance(x: &Tensor, dmodel: usize) -> Result<Tensor> {
        let (b, l, _) = x.dims3()?;
        let n = Tensor::randn(0f32, NUISANCE_STD, (b, l, dmodel - SIGNAL), x.device())?;
        Ok(Tensor::cat(&[x, &n], 2)?)
    }
    /// Batch `step`: (queries [B, Lq, dmodel], docs [B, Ld, dmodel]); query b matches doc b.
    fn batch(&self, cfg: &Config, step: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
        let n = cfg.seed_docs;
        let ids: Vec<u32> = (0..cfg.batch).map(|b| ((step * cfg.batch + b) * 7919 % n) as u32).collect();
        let sig = self.signal.index_select(&Tensor::new(ids.as_slice(), dev)?, 0)?;
        let pick: Vec<u32> = (0..cfg.lq).map(|s| ((s * 5 + step) % cfg.ld) as u32).collect();
        let qsig = (sig.index_select(&Tensor::new(pick.as_slice(), dev)?, 1)?
            + Tensor::randn(0f32, 0.3, (cfg.batch, cfg.lq, SIGNAL), dev)?)?;
        Ok((Self::with_nuisance(&qsig, cfg.dmodel)?, Self::with_nuisance(&sig, cfg.dmodel)?))
    }
}

/// Trains for `cfg.steps` and returns the loss of every step.
pub fn run(cfg: &Config, dev: &Device, verbose: bool) -> Result<Vec<f32>> {
    let task = Task::new(cfg, dev)?;
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, dev);
    let head = linear_no_bias(cfg.dmodel, cfg.dout, vb.pp("head"))?;
    let mut opt = AdamW::new(vars.all_vars(), ParamsAdamW { lr: cfg.lr, weight_decay: 0.0, ..Default::default() })?;
    let opts = candle_maxsim::MaxSimOptions { normalize: true, ..Default::default() };
    let targets = Tensor::arange(0u32, cfg.batch as u32, dev)?;
    let mut losses = Vec::with_capacity(cfg.steps);
    for step in 0..cfg.steps {
        let t0 = Instant::now();
        let (q, d) = task.batch(cfg, step, dev)?;
        let (qp, dp) = (head.forward(&q)?, head.forward(&d)?);
        // Temperature: normalized MaxSim lies in [-Lq, Lq].
        let temp = 20.0 / cfg.lq as f64;
        let (logits, l) = match cfg.scoring {
            Scoring::Fused | Scoring::Reference => {
                let scores = if cfg.scoring == Scoring::Fused {
                    candle_maxsim::maxsim_with(&qp, &dp, None, None, &opts)?
                } else {
                    candle_maxsim::reference::maxsim_with(&qp, &dp, None, None, &opts)?
                };
                let logits = (scores * temp)?;
                let l = loss::cross_entropy(&logits, &targets)?;
                opt.backward_step(&l)?;
                (logits, l)
            }
            Scoring::Grads => {
                let (qn, dn) = (candle_maxsim::l2_normalize(&qp)?, candle_maxsim::l2_normalize(&dp)?);
                let mut out = None;
                let (_, gq, gd) = candle_maxsim::maxsim_value_and_grads(
                    &qn.detach(),
                    &dn.detach(),
                    None,
                    None,
                    candle_maxsim::Backward::LowMem,
                    |s| {
                        let sv = candle_core::Var::from_tensor(s)?;
                        let logits = (sv.as_tensor() * temp)?;
                        let l = loss::cross_entropy(&logits, &targets)?;
                        let g = l.backward()?.remove(sv.as_tensor()).expect("gradient of the scores");
                        out = Some((logits.detach(), l.detach()));
                        Ok(g)
                    },
                )?;
                // d/dθ of Σ qn ⊙ grad_q + Σ dn ⊙ grad_d is the loss's gradient for the head.
                let surrogate = ((&qn * &gq)?.sum_all()? + (&dn * &gd)?.sum_all()?)?;
                opt.backward_step(&surrogate)?;
                out.expect("dloss ran")
            }
        };
        let lv = l.to_scalar::<f32>()?;
        dev.synchronize()?;
        let acc = logits.argmax(D::Minus1)?.eq(&targets)?.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>()?;
        if verbose {
            println!("step {step:3}  loss {lv:.4}  in-batch acc {acc:.2}  {:.2} ms", t0.elapsed().as_secs_f64() * 1e3);
        }
        losses.push(lv);
    }
    Ok(losses)
}

/// Contrastive training of a projection head through MaxSim (in-batch
/// negatives, AdamW), once each with fused scoring under autograd, with
/// `maxsim_value_and_grads`, and with the naive reference: the loss of every
/// step, ms per step and peak device memory.
#[derive(Parser)]
#[command(name = "train", args_override_self = true)]
#[allow(dead_code)]
struct Args {
    /// Training steps per scoring mode.
    #[arg(long, value_name = "N", default_value_t = Config::default().steps, value_parser = RangedU64ValueParser::<usize>::from(1..))]
    steps: usize,
    /// Query-document pairs per batch (each query's negatives are the other documents).
    #[arg(long, value_name = "N", default_value_t = Config::default().batch, value_parser = RangedU64ValueParser::<usize>::from(1..))]
    batch: usize,
    /// Train on CUDA device 0 (default: the CPU).
    #[arg(long)]
    cuda: bool,
}

#[allow(dead_code)]
fn main() -> Result<()> {
    let args = Args::parse();
    let dev = if args.cuda { Device::new_cuda(0)? } else { Device::Cpu };
    let base = Config { steps: args.steps, batch: args.batch, ..Default::default() };
    for scoring in [Scoring::Fused, Scoring::Grads, Scoring::Reference] {
        let cfg = Config { scoring, ..base.clone() };
        println!("== {scoring:?} scoring on {dev:?}");
        let base_mem = mem::reset();
        let t0 = Instant::now();
        let losses = run(&cfg, &dev, true)?;
        let peak = mem::peak_since(base_mem).map_or("n/a (CPU)".to_string(), |b| format!("{:.1} MB", b as f64 / 1e6));
        println!(
            "first loss {:.4}, last loss {:.4}, {:.1} ms/step, peak device memory {peak}",
            losses[0],
            losses[losses.len() - 1],
            t0.elapsed().as_secs_f64() * 1e3 / cfg.steps as f64
        );
    }
    Ok(())
}
