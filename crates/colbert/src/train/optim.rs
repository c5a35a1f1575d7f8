//! AdamW with the learning-rate schedule and gradient clipping of Hugging
//! Face's `Trainer` (what PyLate and Sentence Transformers train with): a
//! linear warm-up from 0, then a linear decay to 0; the global gradient
//! norm clipped to `max_grad_norm`; decoupled weight decay, none for biases
//! and normalization weights. Its state is saved with a checkpoint so that
//! training resumes where it stopped.

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};
use std::collections::HashMap;

/// AdamW over named `Var`s.
pub struct AdamW {
    vars: Vec<(String, Var)>,
    /// First and second moments, by name.
    m: HashMap<String, Tensor>,
    v: HashMap<String, Tensor>,
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
        Self { vars, m: HashMap::new(), v: HashMap::new(), step: 0, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay }
    }

    /// The gradients of `grads` for our vars (`None` where a var got none), by name.
    pub fn collect(&self, grads: &GradStore) -> Vec<(String, Option<Tensor>)> {
        self.vars.iter().map(|(n, v)| (n.clone(), grads.get(v.as_tensor()).cloned())).collect()
    }

    /// Clips `grads` (by name) to a global L2 norm of at most `max_norm`
    /// (as torch's clip_grad_norm_); returns the norm before clipping.
    pub fn clip(grads: &mut HashMap<String, Tensor>, max_norm: f64) -> Result<f64> {
        let mut sq = 0f64;
        for g in grads.values() {
            sq += g.to_dtype(DType::F32)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        }
        let norm = sq.sqrt();
        if max_norm > 0.0 && norm > max_norm {
            let scale = max_norm / (norm + 1e-6);
            for g in grads.values_mut() {
                *g = (&*g * scale)?;
            }
        }
        Ok(norm)
    }

    /// One update with learning rate `lr` from `grads` (by name).
    pub fn apply(&mut self, grads: &HashMap<String, Tensor>, lr: f64) -> Result<()> {
        self.step += 1;
        let t = self.step as i32;
        let (b1, b2) = (self.beta1, self.beta2);
        let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        for (name, var) in &self.vars {
            let Some(g) = grads.get(name) else { continue };
            let g = g.to_dtype(DType::F32)?;
            let m = match self.m.get(name) {
                Some(m) => ((m * b1)? + (&g * (1.0 - b1))?)?,
                None => (&g * (1.0 - b1))?,
            };
            let v = match self.v.get(name) {
                Some(v) => ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?,
                None => (g.sqr()? * (1.0 - b2))?,
            };
            let mut p = var.as_tensor().clone();
            if self.weight_decay > 0.0 && decays(name) {
                p = (p * (1.0 - lr * self.weight_decay))?;
            }
            let update = ((&m / c1)? / ((&v / c2)?.sqrt()? + self.eps)?)?;
            var.set(&(p - (update * lr)?)?)?;
            self.m.insert(name.clone(), m);
            self.v.insert(name.clone(), v);
        }
        Ok(())
    }

    /// The moments as tensors named `m.NAME` / `v.NAME` (for a checkpoint).
    pub fn state(&self) -> HashMap<String, Tensor> {
        let mut s = HashMap::new();
        for (k, t) in &self.m {
            s.insert(format!("m.{k}"), t.clone());
        }
        for (k, t) in &self.v {
            s.insert(format!("v.{k}"), t.clone());
        }
        s
    }

    /// Restores the moments of [`Self::state`] and the step count.
    pub fn restore(&mut self, state: HashMap<String, Tensor>, step: usize) {
        for (k, t) in state {
            if let Some(n) = k.strip_prefix("m.") {
                self.m.insert(n.to_string(), t);
            } else if let Some(n) = k.strip_prefix("v.") {
                self.v.insert(n.to_string(), t);
            }
        }
        self.step = step;
    }
}
