//! Naive [`crate::residual`]: decompression straight from the bit layout's
//! spec, then the dense reference.

use super::{maxsim_with, pad_packed, work_dtype};
use crate::residual::{BitOrder, ResidualCodec};
use crate::MaxSimOptions;
use candle_core::{DType, Result, Tensor};

/// Decompresses packed residual tokens to `[T, dim]` F32 with candle ops
/// (index_select of centroids and bucket weights). The bit unpacking is
/// written out independently of the fast decoder, straight from the spec.
pub fn decompress(codes: &Tensor, residuals: &Tensor, codec: &ResidualCodec) -> Result<Tensor> {
    let dim = codec.centroids.dim(1)?;
    let nbits = codec.nbits;
    let t = codes.elem_count();
    let bytes: Vec<u8> = residuals.flatten_all()?.to_vec1()?;
    let w = dim * nbits / 8;
    let mut buckets = Vec::with_capacity(t * dim);
    for tok in 0..t {
        for k in 0..dim {
            // Bit b (0 = LSB) of the bucket index of feature k.
            let mut v = 0u32;
            for b in 0..nbits {
                let bit_pos = k * nbits + b; // position in the token's bit stream
                let bit = match codec.bit_order {
                    // LSB-first within each byte.
                    BitOrder::Lsb => (bytes[tok * w + bit_pos / 8] >> (bit_pos % 8)) & 1,
                    // np.packbits (MSB-first) of the LSB-first bits of each index.
                    BitOrder::ColBert => (bytes[tok * w + bit_pos / 8] >> (7 - bit_pos % 8)) & 1,
                };
                v |= (bit as u32) << b;
            }
            buckets.push(v);
        }
    }
    let buckets = Tensor::from_vec(buckets, t * dim, codes.device())?;
    let codes = codes.flatten_all()?.to_dtype(DType::U32)?;
    let cents = codec.centroids.to_dtype(DType::F32)?.index_select(&codes, 0)?;
    let res = codec.bucket_weights.to_dtype(DType::F32)?.index_select(&buckets, 0)?.reshape((t, dim))?;
    cents + res
}

/// Naive [`crate::residual::maxsim_residual`].
pub fn maxsim_residual(
    q: &Tensor,
    codes: &Tensor,
    residuals: &Tensor,
    doc_lens: &Tensor,
    codec: &ResidualCodec,
    normalize: bool,
) -> Result<Tensor> {
    let (nd, ld) = codes.dims2()?;
    let dim = q.dim(2)?;
    let lens: Vec<u32> = doc_lens.to_vec1()?;
    // Padding tokens may hold any code: decompress only with in-range codes.
    let mask: Vec<u8> = (0..nd * ld).map(|t| ((t % ld) < lens[t / ld] as usize) as u8).collect();
    let mask = Tensor::from_vec(mask, (nd, ld), q.device())?;
    let safe_codes = mask.to_dtype(codes.dtype())?.mul(codes)?;
    let d = decompress(&safe_codes, residuals, codec)?.reshape((nd, ld, dim))?;
    let opts = MaxSimOptions { normalize, ..Default::default() };
    maxsim_with(&q.to_dtype(work_dtype(q))?, &d.to_dtype(work_dtype(q))?, None, Some(&mask), &opts)
}

/// Naive [`crate::residual::maxsim_residual_varlen`].
pub fn maxsim_residual_varlen(
    q: &Tensor,
    codes: &Tensor,
    residuals: &Tensor,
    cu_d: &Tensor,
    max_ld: usize,
    codec: &ResidualCodec,
    normalize: bool,
) -> Result<Tensor> {
    let d = decompress(codes, residuals, codec)?.to_dtype(work_dtype(q))?;
    let (dp, dm) = pad_packed(&d, cu_d, max_ld)?;
    let opts = MaxSimOptions { normalize, ..Default::default() };
    maxsim_with(&q.to_dtype(work_dtype(q))?, &dp, None, Some(&dm), &opts)
}

/// Naive [`crate::residual::maxsim_residual_pairs`]: every query against every
/// document by [`maxsim_residual_varlen`], then the pairs picked on the host
/// (-inf for [`crate::residual::NO_DOCUMENT`]).
#[allow(clippy::too_many_arguments)]
pub fn maxsim_residual_pairs(
    q: &Tensor,
    codes: &Tensor,
    residuals: &Tensor,
    cu_d: &Tensor,
    max_ld: usize,
    pair_q: &Tensor,
    pair_d: &Tensor,
    codec: &ResidualCodec,
    normalize: bool,
) -> Result<Tensor> {
    let all: Vec<Vec<f32>> = maxsim_residual_varlen(q, codes, residuals, cu_d, max_ld, codec, normalize)?.to_vec2()?;
    let (pq, pd): (Vec<u32>, Vec<u32>) = (pair_q.to_vec1()?, pair_d.to_vec1()?);
    let out: Vec<f32> = pq
        .iter()
        .zip(&pd)
        .map(|(&i, &j)| if j == crate::residual::NO_DOCUMENT { f32::NEG_INFINITY } else { all[i as usize][j as usize] })
        .collect();
    Tensor::from_vec(out, pq.len(), q.device())
}

/// Naive [`crate::residual::nearest_centroids`]: the full `[T, C]` product in F32 (F64
/// for F64), then the first maximum of each row on the host.
pub fn nearest_centroids(x: &Tensor, centroids: &Tensor) -> Result<Tensor> {
    let wd = work_dtype(x);
    let s: Vec<Vec<f64>> = x.to_dtype(wd)?.matmul(&centroids.to_dtype(wd)?.t()?)?.to_dtype(DType::F64)?.to_vec2()?;
    let best: Vec<u32> = s
        .iter()
        .map(|row| {
            row.iter().enumerate().fold((0, f64::NEG_INFINITY), |b, (j, &v)| if v > b.1 { (j, v) } else { b }).0 as u32
        })
        .collect();
    let n = best.len();
    Tensor::from_vec(best, n, x.device())
}
