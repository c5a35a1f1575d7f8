//! The training loop: shuffled batches (seeded), a loss per micro-batch,
//! gradient accumulation, global-norm clipping, AdamW with a linear
//! warm-up and decay, evaluation and checkpoints every N steps, resuming
//! from a checkpoint, and a progress bar with the loss, steps/s and ETA.
//!
//! Runs are reproducible from the seed: the batch order comes from it, the
//! encoders have no dropout, and MaxSim's backward runs its deterministic
//! (`LowMem`) kernels.

use super::data::Example;
use super::eval::{evaluate, EvalSet, Metrics};
use super::loss::{contrastive, distill_kl, margin_mse, Loss};
use super::model::TrainableColBert;
use super::optim::{linear_schedule, AdamW};
use crate::checkpoint::{read_json, safetensors_bytes, write_dir};
use crate::Tokenized;
use candle_core::{bail, DType, Device, Error, Result, Tensor, Var};
use candle_maxsim::{maxsim_value_and_grads, maxsim_with, Backward, MaxSimOptions};
use indicatif::{ProgressBar, ProgressStyle};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

/// How a run trains (defaults: Hugging Face's `Trainer` with Sentence
/// Transformers' multi-vector examples: lr 3e-5, batch 32, 1 epoch, no warm-up).
#[derive(Clone, Debug, PartialEq)]
pub struct TrainConfig {
    pub loss: Loss,
    /// Queries per micro-batch (each with its documents).
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    pub lr: f64,
    pub epochs: usize,
    /// Stop after this many optimizer steps (default: the epochs).
    pub max_steps: Option<usize>,
    /// Warm-up steps as a fraction of the steps (rounded up).
    pub warmup_ratio: f64,
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0: no clipping).
    pub max_grad_norm: f64,
    /// Evaluate every this many steps (and at the end), when there is an eval set.
    pub eval_steps: Option<usize>,
    /// Save a checkpoint every this many steps (and the final model at the end).
    pub save_steps: Option<usize>,
    pub seed: u64,
    pub show_progress: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            loss: Loss::Contrastive { scale: 1.0 },
            batch_size: 32,
            grad_accum: 1,
            lr: 3e-5,
            epochs: 1,
            max_steps: None,
            warmup_ratio: 0.0,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            eval_steps: None,
            save_steps: None,
            seed: 42,
            show_progress: false,
        }
    }
}

/// What a run did: the loss of every optimizer step, the evaluations.
#[derive(Clone, Debug, Default)]
pub struct TrainReport {
    /// `(step, loss, learning rate)` of each optimizer step, from the first.
    pub steps: Vec<(usize, f32, f64)>,
    pub evals: Vec<(usize, Metrics)>,
    /// Wall time of the steps and evaluations (the final save excluded).
    pub seconds: f64,
}

/// Sum of gradients by name, over micro-batches.
type Grads = HashMap<String, Tensor>;

fn add_grads(
    into: &mut Grads,
    vars: &[(String, Var)],
    grads: &candle_core::backprop::GradStore,
    scale: f64,
) -> Result<()> {
    for (name, v) in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            let g = g.to_dtype(DType::F32)?;
            let g = if scale == 1.0 { g } else { (g * scale)? };
            let sum = match into.remove(name) {
                Some(a) => (a + g)?,
                None => g,
            };
            into.insert(name.clone(), sum);
        }
    }
    Ok(())
}

/// The micro-batches of an epoch: `examples` indices, shuffled by the seed.
fn epoch_order(n: usize, batch: usize, seed: u64, epoch: usize) -> Vec<Vec<usize>> {
    let mut idx: Vec<usize> = (0..n).collect();
    idx.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed.wrapping_add(epoch as u64)));
    idx.chunks(batch).map(<[usize]>::to_vec).collect()
}

/// Tokenized queries and documents of a micro-batch (documents query-major:
/// query i's documents are rows i·N .. i·N + N).
struct Batch {
    queries: Tokenized,
    docs: Tokenized,
    n_docs: usize,
    /// Teacher scores `[queries, n_docs]` row-major (distillation).
    teacher: Option<Vec<f32>>,
}

fn tokenize(model: &TrainableColBert, examples: &[&Example]) -> Result<Batch> {
    let m = &model.model;
    let q: Vec<&str> = examples.iter().map(|e| e.query.as_str()).collect();
    let queries = m.tokenize_queries(&q)?;
    for (e, ids) in examples.iter().zip(&queries.ids) {
        // [CLS], the marker, [SEP] and expansion only: nothing left of the text.
        let content = ids.iter().filter(|&&t| !m.is_special(t)).count();
        if content == 0 {
            bail!("{}: the query has no tokens after tokenization", e.origin)
        }
    }
    let d: Vec<&str> = examples.iter().flat_map(|e| e.documents.iter().map(String::as_str)).collect();
    let docs = m.tokenize_documents(&d)?;
    let n_docs = examples[0].documents.len();
    let teacher = examples[0]
        .scores
        .as_ref()
        .map(|_| examples.iter().flat_map(|e| e.scores.clone().unwrap_or_default()).collect());
    Ok(Batch { queries, docs, n_docs, teacher })
}

/// Rows `a..b` of a tokenized batch.
fn rows(t: &Tokenized, a: usize, b: usize) -> Tokenized {
    Tokenized {
        ids: t.ids[a..b].to_vec(),
        attention: t.attention[a..b].to_vec(),
        score_mask: t.score_mask[a..b].to_vec(),
    }
}

/// The loss of a micro-batch and its gradients (summed into `grads`, scaled by `scale`).
fn micro_step(
    model: &TrainableColBert,
    vars: &[(String, Var)],
    loss: Loss,
    b: &Batch,
    grads: &mut Grads,
    scale: f64,
) -> Result<f32> {
    let m = &model.model;
    let dev = m.device();
    let nq = b.queries.ids.len();
    let qm = m.mask_tensor(&b.queries.score_mask)?;
    let dm = m.mask_tensor(&b.docs.score_mask)?;
    let targets = || Tensor::arange(0u32, nq as u32, dev)?.affine(b.n_docs as f64, 0.0)?.to_dtype(DType::U32);
    let lowmem = MaxSimOptions { backward: Backward::LowMem, ..Default::default() };
    let value = match loss {
        Loss::Contrastive { scale: s } => {
            let (q, d) = (m.embed(&b.queries)?, m.embed(&b.docs)?);
            let scores = maxsim_with(&q, &d, Some(&qm), Some(&dm), &lowmem)?;
            let l = contrastive(&scores, &targets()?, s)?;
            add_grads(grads, vars, &l.backward()?, scale)?;
            l
        }
        Loss::Distill { .. } | Loss::MarginMse => {
            let Some(teacher) = &b.teacher else {
                bail!("loss: distillation and margin MSE need teacher scores (distillation data)")
            };
            let teacher = &Tensor::from_slice(teacher, (nq, b.n_docs), dev)?;
            let (q, d) = (m.embed(&b.queries)?, m.embed(&b.docs)?);
            let (_, ld, dim) = d.dims3()?;
            let d4 = d.reshape((nq, b.n_docs, ld, dim))?;
            let scores = maxsim_with(&q, &d4, Some(&qm), Some(&dm.reshape((nq, b.n_docs, ld))?), &lowmem)?;
            let l = match loss {
                Loss::Distill { temperature } => distill_kl(&scores, teacher, temperature)?,
                _ => margin_mse(&scores, teacher)?,
            };
            add_grads(grads, vars, &l.backward()?, scale)?;
            l
        }
        Loss::Cached { scale: s, mini_batch } => {
            // 1. Every embedding, a mini-batch at a time, without keeping a graph.
            let mb = mini_batch.max(1);
            let embed_all = |t: &Tokenized| -> Result<Tensor> {
                let n = t.ids.len();
                let parts: Vec<Tensor> = (0..n)
                    .step_by(mb)
                    .map(|a| Ok(m.embed(&rows(t, a, (a + mb).min(n)))?.detach()))
                    .collect::<Result<_>>()?;
                Tensor::cat(&parts, 0)
            };
            let (q, d) = (embed_all(&b.queries)?, embed_all(&b.docs)?);
            // 2. The loss and its gradients with respect to the embeddings.
            let value = std::cell::Cell::new(0f32);
            let t = targets()?;
            let (_, gq, gd) = maxsim_value_and_grads(&q, &d, Some(&qm), Some(&dm), Backward::LowMem, |scores| {
                let sv = Var::from_tensor(scores)?;
                let l = contrastive(sv.as_tensor(), &t, s)?;
                value.set(l.to_scalar::<f32>()?);
                let g = l.backward()?;
                g.get(sv.as_tensor()).cloned().ok_or_else(|| Error::Msg("loss: no gradient of the scores".into()))
            })?;
            // 3. Each mini-batch again with its graph, back-propagating those gradients.
            for (t, g) in [(&b.queries, &gq), (&b.docs, &gd)] {
                let n = t.ids.len();
                for a in (0..n).step_by(mb) {
                    let e = (a + mb).min(n);
                    let emb = m.embed(&rows(t, a, e))?;
                    let surrogate =
                        (emb.to_dtype(DType::F32)? * g.narrow(0, a, e - a)?.to_dtype(DType::F32)?)?.sum_all()?;
                    add_grads(grads, vars, &surrogate.backward()?, scale)?;
                }
            }
            Tensor::new(value.get(), dev)?
        }
    };
    value.to_dtype(DType::F32)?.to_scalar::<f32>()
}

/// The loss of one batch of `examples` and its gradients, by var name (what
/// one micro-batch of [`train`] computes): for custom training loops and checks.
pub fn loss_and_gradients(
    model: &TrainableColBert,
    examples: &[Example],
    loss: Loss,
) -> Result<(f32, HashMap<String, Tensor>)> {
    if examples.is_empty() {
        bail!("examples: an empty batch")
    }
    let refs: Vec<&Example> = examples.iter().collect();
    let b = tokenize(model, &refs)?;
    let mut grads = Grads::new();
    let l = micro_step(model, &model.vars(), loss, &b, &mut grads, 1.0)?;
    Ok((l, grads))
}

/// `trainer_state.json` of a checkpoint.
fn state_json(step: usize, report: &TrainReport) -> serde_json::Value {
    serde_json::json!({
        "step": step,
        "losses": report.steps.iter().map(|s| s.1).collect::<Vec<_>>(),
    })
}

/// Trains `model` on `train`: see the [module docs](self). Checkpoints go to
/// `out/checkpoint-{step}/` (the model in the PyLate layout, the optimizer
/// state, `trainer_state.json`), the final model to `out/`. With `resume`
/// (a checkpoint directory of the same run), training continues from its
/// step: its weights, optimizer state and position in the data.
pub fn train(
    model: &mut TrainableColBert,
    train: &[Example],
    eval: Option<&EvalSet>,
    cfg: &TrainConfig,
    out: &Path,
    resume: Option<&Path>,
) -> Result<TrainReport> {
    if train.is_empty() {
        bail!("train: no examples")
    }
    if cfg.batch_size == 0 || cfg.grad_accum == 0 || cfg.epochs == 0 {
        bail!("config: batch_size, grad_accum and epochs must be at least 1")
    }
    let micro_per_epoch = train.len().div_ceil(cfg.batch_size);
    let steps_per_epoch = micro_per_epoch.div_ceil(cfg.grad_accum);
    let total = cfg.max_steps.unwrap_or(steps_per_epoch * cfg.epochs).min(steps_per_epoch * cfg.epochs);
    let warmup = if cfg.warmup_ratio >= 1.0 {
        cfg.warmup_ratio as usize
    } else {
        (total as f64 * cfg.warmup_ratio).ceil() as usize
    };
    let vars = model.vars();
    let mut opt = AdamW::new(vars.clone(), cfg.weight_decay);
    let mut report = TrainReport::default();
    if let Some(dir) = resume {
        let st = read_json(&dir.join("trainer_state.json"))?;
        let step =
            st["step"].as_u64().ok_or_else(|| Error::Msg(format!("resume: {} has no step", dir.display())))? as usize;
        *model = TrainableColBert::load(dir, model.model.device(), model.model.compute_dtype(), 128, cfg.seed)?;
        let state = candle_core::safetensors::load(dir.join("optimizer.safetensors"), model.model.device())?;
        opt = AdamW::new(model.vars(), cfg.weight_decay);
        opt.restore(state, step)?;
        if let Some(l) = st["losses"].as_array() {
            report.steps = l.iter().enumerate().map(|(i, v)| (i + 1, v.as_f64().unwrap_or(0.0) as f32, 0.0)).collect();
        }
    }
    let vars = model.vars();
    let bar = if cfg.show_progress { ProgressBar::new(total as u64) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  {per_sec}  ETA {eta}")
            .map_err(|e| Error::Msg(e.to_string()))?,
    );
    bar.set_position(opt.step as u64);
    let t0 = Instant::now();
    let mut step = opt.step;
    // The micro-batches of each remaining step (an epoch's last step may have fewer).
    let mut plan: Vec<Vec<usize>> = Vec::new();
    let mut micro = step * cfg.grad_accum; // micro-batches done, over all epochs
    for _ in step..total {
        let epoch = micro / micro_per_epoch;
        let mut v = Vec::new();
        while v.len() < cfg.grad_accum && micro / micro_per_epoch == epoch {
            v.push(micro);
            micro += 1;
        }
        plan.push(v);
    }
    let model: &TrainableColBert = model;
    // Tokenization runs on a thread, up to two micro-batches ahead of the device.
    let (tx, rx) = std::sync::mpsc::sync_channel::<Result<Batch>>(2);
    let feed = plan.concat();
    std::thread::scope(|scope| -> Result<()> {
        scope.spawn(move || {
            let mut order: Option<(usize, Vec<Vec<usize>>)> = None;
            for id in feed {
                let epoch = id / micro_per_epoch;
                if order.as_ref().is_none_or(|o| o.0 != epoch) {
                    order = Some((epoch, epoch_order(train.len(), cfg.batch_size, cfg.seed, epoch)));
                }
                let exs: Vec<&Example> =
                    order.as_ref().unwrap().1[id % micro_per_epoch].iter().map(|&i| &train[i]).collect();
                if tx.send(tokenize(model, &exs)).is_err() {
                    return; // the loop stopped early (an error)
                }
            }
        });
        let result = (|| -> Result<()> {
            for micros in &plan {
                let mut grads = Grads::new();
                let mut loss_sum = 0f32;
                let n = micros.len();
                for _ in micros {
                    let b = rx.recv().map_err(|_| Error::Msg("train: the tokenizer thread stopped".into()))??;
                    loss_sum += micro_step(model, &vars, cfg.loss, &b, &mut grads, 1.0 / cfg.grad_accum as f64)?;
                }
                let loss = loss_sum / n as f32;
                if !loss.is_finite() {
                    bail!("train: the loss is {loss} at step {}", step + 1)
                }
                let lr = linear_schedule(cfg.lr, step, warmup, total);
                opt.apply(&grads, lr, cfg.max_grad_norm)?;
                step += 1;
                report.steps.push((step, loss, lr));
                bar.set_message(format!("loss {loss:.4}"));
                bar.set_position(step as u64);
                let last = step == total;
                if let (Some(set), Some(every)) = (eval, cfg.eval_steps) {
                    if step.is_multiple_of(every) || last {
                        report.evals.push((step, evaluate(&model.model, set, 64)?));
                    }
                }
                if let Some(every) = cfg.save_steps {
                    if step.is_multiple_of(every) && !last {
                        let mut files = model.files()?;
                        files.push(("optimizer.safetensors".into(), safetensors_bytes(&host(opt.state()?)?)?));
                        files.push((
                            "trainer_state.json".into(),
                            serde_json::to_vec_pretty(&state_json(step, &report)).unwrap(),
                        ));
                        write_dir(&out.join(format!("checkpoint-{step}")), &files)?;
                    }
                }
            }
            Ok(())
        })();
        drop(rx); // unblocks the thread if the loop stopped early
        result
    })?;
    bar.finish_and_clear();
    if let (Some(set), None) = (eval, cfg.eval_steps) {
        report.evals.push((step, evaluate(&model.model, set, 64)?));
    }
    model.model.device().synchronize()?;
    report.seconds = t0.elapsed().as_secs_f64();
    let mut files = model.files()?;
    files.push(("trainer_state.json".into(), serde_json::to_vec_pretty(&state_json(step, &report)).unwrap()));
    write_dir(out, &files)?;
    Ok(report)
}

fn host(t: HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    t.into_iter().map(|(k, v)| Ok((k, v.to_device(&Device::Cpu)?))).collect()
}
