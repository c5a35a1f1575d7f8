//! The trained codec: the k-means centroids, and `2^nbits` buckets whose
//! cutoffs and weights are quantiles of held-out residuals (numpy's
//! "linear" quantiles, as fast-plaid computes them), with the calibration
//! fast-plaid's update reads. Tokens are coded by the largest dot product
//! with the unit centroids.

use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::residual::{nearest_centroids, BitOrder, ResidualCodec};

/// A trained codec: what every document of an index (or of its shards) is coded against.
pub(crate) struct Codec {
    pub codec: ResidualCodec,
    /// `[2^nbits − 1]` F32 bucket boundaries, on the codec's device.
    pub cutoffs: Tensor,
    pub cal: Calibration,
}

impl Codec {
    /// The codec of `centroids [K, dim]` F16 with `nbits`-bit buckets fit to
    /// the residuals of `heldout [H, dim]` (in the work dtype), on `device`.
    pub fn calibrated(centroids: Tensor, heldout: &Tensor, nbits: usize, dim: usize, device: &Device) -> Result<Self> {
        let cal = calibrate(heldout, &centroids.to_dtype(heldout.dtype())?, nbits)?;
        let codec = ResidualCodec {
            centroids,
            bucket_weights: Tensor::new(cal.weights.as_slice(), device)?,
            nbits,
            bit_order: BitOrder::ColBert,
        };
        codec.check(dim)?;
        let cutoffs = Tensor::new(cal.cutoffs.as_slice(), device)?;
        Ok(Self { codec, cutoffs, cal })
    }
}

impl Codec {
    /// The codec [`crate::writer::write_codec`] wrote into `dir` (exactly:
    /// F16 centroids, F32 cutoffs, weights and calibration), on `device`.
    pub fn read(dir: &std::path::Path, nbits: usize, device: &Device) -> Result<Self> {
        let f32s = |name: &str| -> Result<Vec<f32>> {
            crate::npy::read(&dir.join(name), &Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
        };
        let centroids = crate::npy::read(&dir.join("centroids.npy"), device)?;
        let dim = centroids.dim(1)?;
        let cal = Calibration {
            cutoffs: f32s("bucket_cutoffs.npy")?,
            weights: f32s("bucket_weights.npy")?,
            avg_residual: f32s("avg_residual.npy")?,
            cluster_threshold: *f32s("cluster_threshold.npy")?.first().unwrap_or(&0.0),
        };
        let codec = ResidualCodec {
            centroids,
            bucket_weights: Tensor::new(cal.weights.as_slice(), device)?,
            nbits,
            bit_order: BitOrder::ColBert,
        };
        codec.check(dim)?;
        let cutoffs = Tensor::new(cal.cutoffs.as_slice(), device)?;
        Ok(Self { codec, cutoffs, cal })
    }
}

/// Statistics of held-out residuals: the bucket cutoffs and weights, and
/// the calibration an index stores for fast-plaid's update.
pub(crate) struct Calibration {
    pub cutoffs: Vec<f32>,
    pub weights: Vec<f32>,
    /// Mean absolute residual per feature (`avg_residual.npy`).
    pub avg_residual: Vec<f32>,
    /// The 75th percentile of residual norms (`cluster_threshold.npy`).
    pub cluster_threshold: f32,
}

fn calibrate(heldout: &Tensor, centroids: &Tensor, nbits: usize) -> Result<Calibration> {
    let codes = nearest_centroids(heldout, centroids)?;
    let res = (heldout.to_dtype(DType::F32)? - centroids.to_dtype(DType::F32)?.index_select(&codes, 0)?)?;
    let mut norms: Vec<f32> = res.sqr()?.sum(1)?.sqrt()?.to_vec1()?;
    let avg_residual: Vec<f32> = res.abs()?.mean(0)?.to_vec1()?;
    let mut vals: Vec<f32> = res.flatten_all()?.to_vec1()?;
    vals.sort_by(f32::total_cmp);
    norms.sort_by(f32::total_cmp);
    let n = 1usize << nbits;
    Ok(Calibration {
        cutoffs: (1..n).map(|i| quantile(&vals, i as f64 / n as f64)).collect(),
        weights: (0..n).map(|i| quantile(&vals, (i as f64 + 0.5) / n as f64)).collect(),
        avg_residual,
        cluster_threshold: quantile(&norms, 0.75),
    })
}

/// numpy's "linear" quantile of sorted values.
fn quantile(sorted: &[f32], q: f64) -> f32 {
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    let f = (pos - lo as f64) as f32;
    sorted[lo] + (sorted[hi] - sorted[lo]) * f
}

/// The dtype k-means and coding run in on `device`: F16 on CUDA (tensor
/// cores, the centroids' stored dtype), F32 on the CPU.
pub(crate) fn work_dtype(device: &Device) -> DType {
    if device.is_cuda() {
        DType::F16
    } else {
        DType::F32
    }
}
