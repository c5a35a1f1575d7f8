//! AdamW with the learning-rate schedule and gradient clipping of Hugging
//! Face's `Trainer` (what PyLate and Sentence Transformers train with): a
//! linear warm-up from 0, then a linear decay to 0; the global gradient
//! norm clipped to `max_grad_norm`; decoupled weight decay, none for biases
//! and normalization weights. Its state is saved with a checkpoint so that
//! training resumes where it stopped.

use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Result, Tensor, Var};
use std::collections::HashMap;

/// AdamW over named `Var`s; the moments of each are one F32 `[2, n]`
/// tensor, stepped in place by `candle_maxsim::optim::adamw_update`.
pub struct AdamW {
    vars: Vec<(String, Var)>,
    /// First and second moments `[2, n]`, by name.
    mv: HashMap<String, Tensor>,
    /// Optimizer steps taken.
    pub step: usize,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// Whether a parameter decays: not biases, not normalization weights.
fn decays(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    !(n.ends_with("bias") || n.contains("norm") || n.ends_with("beta") || n.ends_with("gamma"))
}

/// The learning rate of optimizer step `t` (0-based) of `total`, with `warmup` steps.
pub fn linear_schedule(lr: f64, t: usize, warmup: usize, total: usize) -> f64 {
    if t < warmup {
        lr * t as f64 / warmup.max(1) as f64
    } else {
        lr * (total.saturating_sub(t) as f64 / total.saturating_sub(warmup).max(1) as f64).max(0.0)
    }
}

impl AdamW {
    /// torch's defaults: betas (0.9, 0.999), eps 1e-8.
    pub fn new(vars: Vec<(String, Var)>, weight_decay: f64) -> Self {
        Self { vars, mv: HashMap::new(), step: 0, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay }
    }

    /// The gradients of `grads` for our vars (`None` where a var got none), by name.
    pub fn collect(&self, grads: &GradStore) -> Vec<(String, Option<Tensor>)> {
        self.vars.iter().map(|(n, v)| (n.clone(), grads.get(v.as_tensor()).cloned())).collect()
    }

    /// One update with learning rate `lr` from `grads` (by name), their
    /// global L2 norm first clipped to `max_grad_norm` (0: no clipping) as
    /// torch's `clip_grad_norm_` does. Returns the squared global norm
    /// before clipping, an F32 tensor of one element: reading it waits for
    /// the step, nothing else does.
    pub fn apply(&mut self, grads: &HashMap<String, Tensor>, lr: f64, max_grad_norm: f64) -> Result<Tensor> {
        let Some((_, first)) = self.vars.first() else { bail!("optimizer: no parameters") };
        let sum_sq = Tensor::zeros(1, DType::F32, first.device())?;
        let mut live = Vec::new();
        for (name, var) in &self.vars {
            let Some(g) = grads.get(name) else { continue };
            let g = g.to_dtype(DType::F32)?.contiguous()?;
            candle_maxsim::optim::adamw_sum_sq(&sum_sq, &g)?;
            live.push((name, var, g));
        }
        self.step += 1;
        for (name, var, g) in live {
            if !self.mv.contains_key(name) {
                self.mv.insert(name.clone(), Tensor::zeros((2, var.elem_count()), DType::F32, var.device())?);
            }
            let step = candle_maxsim::optim::AdamWStep {
                lr,
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
                weight_decay: if decays(name) { self.weight_decay } else { 0.0 },
                max_grad_norm,
                t: self.step,
            };
            candle_maxsim::optim::adamw_update(var.as_tensor(), &self.mv[name], &g, &sum_sq, &step)?;
        }
        Ok(sum_sq)
    }

    /// The moments as tensors named `m.NAME` / `v.NAME`, each the parameter's shape (for a checkpoint).
    pub fn state(&self) -> Result<HashMap<String, Tensor>> {
        let mut s = HashMap::new();
        let shapes: HashMap<&String, &Var> = self.vars.iter().map(|(n, v)| (n, v)).collect();
        for (k, mv) in &self.mv {
            let shape = shapes.get(k).map(|v| v.shape().clone()).unwrap_or_else(|| (mv.dim(1).unwrap_or(0),).into());
            s.insert(format!("m.{k}"), mv.get(0)?.reshape(shape.clone())?);
            s.insert(format!("v.{k}"), mv.get(1)?.reshape(shape)?);
        }
        Ok(s)
    }

    /// Restores the moments of [`Self::state`] and the step count.
    pub fn restore(&mut self, state: HashMap<String, Tensor>, step: usize) -> Result<()> {
        for (name, var) in &self.vars {
            let (Some(m), Some(v)) = (state.get(&format!("m.{name}")), state.get(&format!("v.{name}"))) else {
                continue;
            };
            let n = var.elem_count();
            if m.elem_count() != n || v.elem_count() != n {
                bail!(
                    "optimizer state: the moments of {name} have {} / {} elements, the parameter {n}",
                    m.elem_count(),
                    v.elem_count()
                )
            }
            let mv = Tensor::stack(&[m.flatten_all()?, v.flatten_all()?], 0)?
                .to_dtype(DType::F32)?
                .to_device(var.device())?;
            self.mv.insert(name.clone(), mv.contiguous()?);
        }
        self.step = step;
        Ok(())
    }
}
