//! The losses Sentence Transformers 6 ships for `MultiVectorEncoder` (and
//! PyLate before it), on MaxSim scores computed by candle-maxsim:
//!
//! - contrastive (`MultiVectorMultipleNegativesRankingLoss`, PyLate's
//!   `Contrastive`): every query against every document of the batch (its
//!   positive, the other positives, every hard negative), cross-entropy
//!   towards its own positive, scores multiplied by `scale` (PyLate's
//!   `temperature` is `1 / scale`); the cached form (gradient cache,
//!   `Cached...`) has the same value and gradients at bounded memory;
//! - distillation (`MultiVectorDistillKLDivLoss`): KL divergence from the
//!   teacher's softmax to the student's over each query's documents (the KD
//!   layout), both divided by the temperature, times its square;
//! - margin MSE (`MultiVectorMarginMSELoss`): the student's score margins
//!   (positive − each negative) against the teacher's.

use candle_core::{Result, Tensor, D};
use candle_nn::ops::log_softmax;

/// Which loss a training run minimizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Loss {
    /// In-batch (and hard) negatives, cross-entropy of the scores × `scale`.
    Contrastive {
        /// Multiplies the scores (Sentence Transformers' default 1; PyLate's temperature 0.05 is 20).
        scale: f64,
    },
    /// [`Loss::Contrastive`] by gradient cache: embeddings computed in
    /// mini-batches without a graph, the loss's gradients taken with respect
    /// to them, then each mini-batch re-run with its graph.
    Cached {
        /// Multiplies the scores.
        scale: f64,
        /// Queries / documents embedded at a time.
        mini_batch: usize,
    },
    /// KL divergence to the teacher's scores (softmax over each query's documents).
    Distill {
        /// Divides both sides' scores (Sentence Transformers' default 1).
        temperature: f64,
    },
    /// Mean squared error of score margins.
    MarginMse,
}

/// Cross-entropy of `scores [B, C] × scale` towards column `targets[i]` of row `i`.
pub fn contrastive(scores: &Tensor, targets: &Tensor, scale: f64) -> Result<Tensor> {
    candle_nn::loss::cross_entropy(&(scores * scale)?, targets)
}

/// KL(teacher ‖ student) over each row of `[B, N]` scores, batch mean, × T².
pub fn distill_kl(student: &Tensor, teacher: &Tensor, temperature: f64) -> Result<Tensor> {
    let ls = log_softmax(&(student / temperature)?, D::Minus1)?;
    let lt = log_softmax(&(teacher / temperature)?, D::Minus1)?.detach();
    let kl = (lt.exp()? * (&lt - ls)?)?.sum_all()?;
    (kl / student.dim(0)? as f64)? * (temperature * temperature)
}

/// MSE of the margins `s[:, 0] − s[:, k]` (k ≥ 1) against the teacher's.
pub fn margin_mse(student: &Tensor, teacher: &Tensor) -> Result<Tensor> {
    let n = student.dim(1)?;
    let margins = |s: &Tensor| -> Result<Tensor> { s.narrow(1, 0, 1)?.broadcast_sub(&s.narrow(1, 1, n - 1)?) };
    (margins(student)? - margins(&teacher.detach())?)?.sqr()?.mean_all()
}
