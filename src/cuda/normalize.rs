//! Launch of kernels/normalize.cu: row-wise L2 normalization and its backward.

use super::launch::{grid_stride, kernel, kernel_params, launch, Module};
use super::memory::{alloc_out, storage_ptr};
use super::params::dtype_tag;
use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, Layout, Result};

/// Mirror of `NormParams` in kernels/normalize.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct NormParams {
    x: u64,
    g: u64,
    out: u64,
    rows: i64,
    dim: i32,
}
kernel_params!(NormParams);

/// Launches `l2norm_<fwd|bwd>_<dtype>` over the rows of `[.., dim]` `x`
/// (and the gradient `g`), contiguous and of one dtype.
fn run(kind: &str, x: (&CudaStorage, &Layout), g: Option<(&CudaStorage, &Layout)>) -> Result<CudaStorage> {
    let (s, l) = x;
    let dev = s.device.clone();
    let dim = *l.dims().last().unwrap_or(&1);
    let n = l.shape().elem_count();
    let rows = n / dim.max(1);
    let out = alloc_out(&dev, s.dtype(), n)?;
    if rows == 0 || dim == 0 {
        return Ok(out);
    }
    if dim > i32::MAX as usize {
        candle_core::bail!("x: l2_normalize rows of {dim} elements exceed the kernel's 32-bit length")
    }
    let p = NormParams {
        x: storage_ptr(s, l)?,
        g: g.map(|(s, l)| storage_ptr(s, l)).transpose()?.unwrap_or(0),
        out: storage_ptr(&out, &Layout::contiguous(n))?,
        rows: rows as i64,
        dim: dim as i32,
    };
    let func = kernel(&dev, Module::Normalize, &format!("l2norm_{kind}_{}", dtype_tag(s.dtype())), 0)?;
    // A warp per row, 8 rows per block.
    launch(&dev, &func, grid_stride(&dev, rows, 8, 256, 16)?, &p)?;
    Ok(out)
}

/// `y = x / max(|x|, 1e-12)` per row.
pub(crate) fn l2norm_fwd(x: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
    run("fwd", (x, l), None)
}

/// `dx` from `x` and the gradient of `y` (same dtype and shape).
pub(crate) fn l2norm_bwd(x: &CudaStorage, lx: &Layout, g: &CudaStorage, lg: &Layout) -> Result<CudaStorage> {
    if x.dtype() != g.dtype() || lx.shape() != lg.shape() {
        candle_core::bail!(
            "l2_normalize: internal error, gradient {:?} {:?} for input {:?} {:?}",
            g.dtype(),
            lg.shape(),
            x.dtype(),
            lx.shape()
        )
    }
    run("bwd", (x, lx), Some((g, lg)))
}
