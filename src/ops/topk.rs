//! Top-k of each row of a score matrix, on the device: the selection step of
//! a multi-stage search (candidates by approximate score, then results by
//! exact score) without copying the scores to the host.

use crate::layout::check_rank;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use std::sync::Mutex;

/// The largest `k` supported per row (the CUDA kernel sorts them in shared memory).
pub const TOPK_MAX_K: usize = 4096;

/// The `k` largest entries of each row of `x [R, N]` (F32, F16 or BF16),
/// best first: `(values [R, k'] F32, column indices [R, k'] U32)` with
/// k' = min(k, N).
/// Equal values keep the lower column first; NaN ranks below every number
/// (so a row with fewer than k' numbers ends with its NaN columns, lowest
/// first). `k` must be in `1..=TOPK_MAX_K`.
pub fn topk_rows(x: &Tensor, k: usize) -> Result<(Tensor, Tensor)> {
    check_rank("x", x, &[2], "rank 2 [R, N]")?;
    if !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        bail!("x: expected F32, F16 or BF16 scores, got {:?}", x.dtype())
    }
    if k == 0 || k > TOPK_MAX_K {
        bail!("k: must be in 1..={TOPK_MAX_K}, got {k}")
    }
    let (r, n) = x.dims2()?;
    let k = k.min(n);
    if r == 0 || k == 0 {
        // Zero-size views (CUDA allocates no empty buffer).
        let empty = |dt| Tensor::zeros((r.max(1), k.max(1)), dt, x.device())?.narrow(0, 0, r)?.narrow(1, 0, k);
        return Ok((empty(DType::F32)?, empty(DType::U32)?));
    }
    // The host ranks F32 rows; the CUDA kernels read 16-bit rows as they are.
    let x = if x.device().is_cpu() { x.to_dtype(DType::F32)? } else { x.clone() };
    let op = TopKRows { k, indices: Mutex::new(None) };
    let values = x.contiguous()?.apply_op1_no_bwd(&op)?;
    let indices = op.indices.lock().unwrap().take();
    match indices {
        Some(i) => Ok((values, i)),
        None => bail!("topk_rows: internal error, no indices"),
    }
}

/// The order [`topk_rows`] ranks by: larger float, larger key; NaN lowest.
fn key(f: f32) -> u32 {
    let u = f.to_bits();
    if f.is_nan() {
        0
    } else if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    }
}

/// The top `k` of one row, best first (larger key, then the lower column).
pub(crate) fn topk_row(row: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    let by = |a: &u32, b: &u32| key(row[*b as usize]).cmp(&key(row[*a as usize])).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k, by);
        idx.truncate(k);
    }
    idx.sort_unstable_by(by);
    idx
}

struct TopKRows {
    k: usize,
    /// `[R, k]` U32, filled by the forward.
    indices: Mutex<Option<Tensor>>,
}

impl CustomOp1 for TopKRows {
    fn name(&self) -> &'static str {
        "topk_rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        use rayon::prelude::*;
        let (r, n) = l.shape().dims2()?;
        let (CpuStorage::F32(v), Some((a, b))) = (s, l.contiguous_offsets()) else {
            bail!("x: expected contiguous F32 scores")
        };
        let rows: Vec<Vec<u32>> = v[a..b].par_chunks(n).map(|row| topk_row(row, self.k)).collect();
        let values: Vec<f32> =
            rows.iter().zip(v[a..b].chunks(n)).flat_map(|(i, row)| i.iter().map(|&c| row[c as usize])).collect();
        let idx = Tensor::from_vec(rows.concat(), (r, self.k), &candle_core::Device::Cpu)?;
        *self.indices.lock().unwrap() = Some(idx);
        Ok((CpuStorage::F32(values), Shape::from((r, self.k))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (r, _) = l.shape().dims2()?;
        let (values, idx) = crate::cuda::topk_rows((s, l), self.k)?;
        *self.indices.lock().unwrap() = Some(Tensor::from((candle_core::Storage::Cuda(idx), (r, self.k))));
        Ok((values, Shape::from((r, self.k))))
    }
}
