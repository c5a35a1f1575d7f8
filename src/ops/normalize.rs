//! Row-wise L2 normalization as one custom op with a closed-form backward:
//! kernels/normalize.cu on CUDA, the same loops on the CPU.

use crate::cpu::storage::range;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

/// The norm's floor, as `torch.nn.functional.normalize`.
const EPS: f64 = 1e-12;

/// `x / max(‖x‖₂, 1e-12)` over the last dim, accumulated in F32 (F64 for
/// F64; F64 on the CPU) and returned in `x`'s dtype. One op forward; its
/// backward applies the normalization's Jacobian, `(g − y (y·g)) / ‖x‖`, in
/// one pass (`g / 1e-12` where `‖x‖ ≤ 1e-12`).
pub fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    if x.rank() == 0 {
        bail!("x: l2_normalize needs at least one axis, got a scalar")
    }
    if !matches!(x.dtype(), DType::F16 | DType::BF16 | DType::F32 | DType::F64) {
        bail!("x: l2_normalize needs a float dtype, got {:?}", x.dtype())
    }
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    x.contiguous()?.apply_op1(L2Normalize)
}

struct L2Normalize;

/// The backward of [`l2_normalize`] alone: `dx` from `x` and the gradient of
/// the normalized rows (same dtype and shape), no autograd.
pub(crate) fn l2_normalize_bwd(x: &Tensor, g: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2_no_bwd(&g.contiguous()?, &L2NormalizeBwd)
}

/// `(x, g) → dx`, the backward of [`L2Normalize`].
struct L2NormalizeBwd;

/// Rows normalized in parallel, each alone (the same results whatever the thread count).
fn fwd_rows<T: Copy + Default + Send + Sync>(
    x: &[T],
    dim: usize,
    get: impl Fn(T) -> f64 + Sync,
    put: impl Fn(f64) -> T + Sync,
) -> Vec<T> {
    let dim = dim.max(1);
    let mut y = vec![T::default(); x.len()];
    y.par_chunks_mut(dim).zip(x.par_chunks(dim)).with_min_len(16).for_each(|(yr, r)| {
        let n = r.iter().map(|&v| get(v) * get(v)).sum::<f64>().sqrt().max(EPS);
        yr.iter_mut().zip(r).for_each(|(o, &v)| *o = put(get(v) / n));
    });
    y
}

fn bwd_rows<T: Copy + Default + Send + Sync>(
    x: &[T],
    g: &[T],
    dim: usize,
    get: impl Fn(T) -> f64 + Sync,
    put: impl Fn(f64) -> T + Sync,
) -> Vec<T> {
    let dim = dim.max(1);
    let mut dx = vec![T::default(); x.len()];
    dx.par_chunks_mut(dim).zip(x.par_chunks(dim)).zip(g.par_chunks(dim)).with_min_len(16).for_each(|((dr, xr), gr)| {
        let n = xr.iter().map(|&v| get(v) * get(v)).sum::<f64>().sqrt();
        let xg: f64 = xr.iter().zip(gr).map(|(&a, &b)| get(a) * get(b)).sum();
        // Below EPS the norm is the constant EPS: no term through ‖x‖.
        let (inv, proj) = if n <= EPS { (1.0 / EPS, 0.0) } else { (1.0 / n, xg / (n * n)) };
        dr.iter_mut().zip(xr.iter().zip(gr)).for_each(|(o, (&a, &b))| *o = put((get(b) - get(a) * proj) * inv));
    });
    dx
}

fn cpu_fwd(s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
    let (a, b) = range("x", l)?;
    let dim = *l.dims().last().unwrap_or(&1);
    Ok(match s {
        CpuStorage::F16(v) => CpuStorage::F16(fwd_rows(&v[a..b], dim, |v| v.to_f64(), f16::from_f64)),
        CpuStorage::BF16(v) => CpuStorage::BF16(fwd_rows(&v[a..b], dim, |v| v.to_f64(), bf16::from_f64)),
        CpuStorage::F32(v) => CpuStorage::F32(fwd_rows(&v[a..b], dim, |v| v as f64, |v| v as f32)),
        CpuStorage::F64(v) => CpuStorage::F64(fwd_rows(&v[a..b], dim, |v| v, |v| v)),
        s => bail!("x: l2_normalize needs a float dtype, got {:?}", s.dtype()),
    })
}

fn cpu_bwd(x: &CpuStorage, lx: &Layout, g: &CpuStorage, lg: &Layout) -> Result<CpuStorage> {
    let ((a, b), (c, d)) = (range("x", lx)?, range("g", lg)?);
    let dim = *lx.dims().last().unwrap_or(&1);
    Ok(match (x, g) {
        (CpuStorage::F16(x), CpuStorage::F16(g)) => {
            CpuStorage::F16(bwd_rows(&x[a..b], &g[c..d], dim, |v| v.to_f64(), f16::from_f64))
        }
        (CpuStorage::BF16(x), CpuStorage::BF16(g)) => {
            CpuStorage::BF16(bwd_rows(&x[a..b], &g[c..d], dim, |v| v.to_f64(), bf16::from_f64))
        }
        (CpuStorage::F32(x), CpuStorage::F32(g)) => {
            CpuStorage::F32(bwd_rows(&x[a..b], &g[c..d], dim, |v| v as f64, |v| v as f32))
        }
        (CpuStorage::F64(x), CpuStorage::F64(g)) => CpuStorage::F64(bwd_rows(&x[a..b], &g[c..d], dim, |v| v, |v| v)),
        (x, g) => bail!("l2_normalize: internal error, dtypes {:?} / {:?} in the backward", x.dtype(), g.dtype()),
    })
}

impl CustomOp1 for L2Normalize {
    fn name(&self) -> &'static str {
        "l2_normalize"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((cpu_fwd(s, l)?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::cuda::l2norm_fwd(s, l)?, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&g.contiguous()?, &L2NormalizeBwd)?))
    }
}

impl CustomOp2 for L2NormalizeBwd {
    fn name(&self) -> &'static str {
        "l2_normalize_bwd"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout, g: &CpuStorage, lg: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((cpu_bwd(x, lx, g, lg)?, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::cuda::l2norm_bwd(x, lx, g, lg)?, lx.shape().clone()))
    }
}
