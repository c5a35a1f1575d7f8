//! The centroid training: k-means over sampled tokens, from random tokens,
//! assigning by dot product to unit centroids (spherical) or by Euclidean
//! distance as fastkmeans does; empty clusters restart from random tokens.

use candle_core::{DType, Result, Tensor};
use candle_maxsim::{l2_normalize, nn::scatter_add_rows, residual::nearest_centroids};
use indicatif::ProgressBar;
use rand::Rng;

/// k-means of `points [S, dim]` (in the work dtype) into `k` centroids
/// `[k, dim]` F32, unit vectors: spherical (assignment by dot product to the
/// normalized centroids), or Euclidean (to the means, as fastkmeans:
/// argmin ‖x − c‖² = argmax x·c − ‖c‖²/2, the dot product of `[x, 1]` and
/// `[c, −‖c‖²/2]`), normalized at the end.
pub(crate) fn kmeans(
    points: &Tensor,
    k: usize,
    iters: usize,
    spherical: bool,
    rng: &mut impl Rng,
    bar: &ProgressBar,
) -> Result<Tensor> {
    let (s, _) = points.dims2()?;
    let dev = points.device().clone();
    // Euclidean: the points once with a column of ones (padded to a multiple of 8 columns).
    let pad = 8;
    let augmented = if spherical {
        None
    } else {
        let extra = Tensor::cat(
            &[&Tensor::ones((s, 1), points.dtype(), &dev)?, &Tensor::zeros((s, pad - 1), points.dtype(), &dev)?],
            1,
        )?;
        Some(Tensor::cat(&[points, &extra], 1)?)
    };
    let init = random_rows(points, k, rng)?.to_dtype(DType::F32)?;
    let mut cents = if spherical { l2_normalize(&init)? } else { init };
    for it in 0..iters {
        bar.set_message(format!("k-means iteration {}/{iters}", it + 1));
        let codes = match &augmented {
            None => nearest_centroids(points, &cents.to_dtype(points.dtype())?)?,
            Some(x) => {
                let half_sq = (cents.sqr()?.sum_keepdim(1)? * -0.5)?;
                let c = Tensor::cat(&[&cents, &half_sq, &Tensor::zeros((k, pad - 1), DType::F32, &dev)?], 1)?;
                nearest_centroids(x, &c.to_dtype(points.dtype())?)?
            }
        };
        let sums = scatter_add_rows(points, &codes, k)?;
        let counts = scatter_add_rows(&Tensor::ones((s, 1), DType::F32, &dev)?, &codes, k)?;
        let updated =
            if spherical { l2_normalize(&sums)? } else { sums.broadcast_div(&counts.clamp(1f32, f32::MAX)?)? };
        let counts: Vec<f32> = counts.flatten_all()?.to_vec1()?;
        cents = if counts.iter().all(|&c| c > 0.0) {
            updated
        } else {
            // Empty clusters restart from random tokens (as fastkmeans does).
            let fresh = random_rows(points, k, rng)?.to_dtype(DType::F32)?;
            let fresh = if spherical { l2_normalize(&fresh)? } else { fresh };
            let keep: Vec<u8> = counts.iter().map(|&c| u8::from(c > 0.0)).collect();
            let keep = Tensor::from_vec(keep, (k, 1), &dev)?.broadcast_as(updated.shape())?;
            keep.where_cond(&updated, &fresh)?
        };
    }
    l2_normalize(&cents)
}

/// `n` distinct rows of `x` drawn at random, in the order drawn (the same
/// draws from `rng` for the same row count and `n`, so a seed fixes them).
pub(crate) fn random_rows(x: &Tensor, n: usize, rng: &mut impl Rng) -> Result<Tensor> {
    let ids: Vec<u32> = rand::seq::index::sample(rng, x.dim(0)?, n).into_iter().map(|i| i as u32).collect();
    x.index_select(&Tensor::from_vec(ids, n, x.device())?, 0)
}
