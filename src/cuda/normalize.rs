//! Launch of kernels/normalize.cu: row-wise L2 normalization and its backward.

use super::params::dtype_tag;
use super::{alloc_out, device_info, load_func, storage_ptr, NORMALIZE};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result};

/// Threads per block: 8 rows (one warp each) per block pass.
const THREADS: u32 = 256;

/// Launches `l2norm_<fwd|bwd>_<dtype>` over the rows of `[.., dim]` operands (contiguous).
fn run(kind: &str, ops: &[(&CudaStorage, &Layout)]) -> Result<CudaStorage> {
    let (s, l) = ops[0];
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
    let func = load_func(&dev, &format!("l2norm_{kind}_{}", dtype_tag(s.dtype())), 0, "normalize", &NORMALIZE)?;
    let ptrs = ops.iter().map(|(s, l)| storage_ptr(s, l)).collect::<Result<Vec<u64>>>()?;
    let out_ptr = storage_ptr(&out, &Layout::contiguous(n))?;
    let sms = device_info(&dev)?.sm_count.max(1) as usize;
    let blocks = rows.div_ceil((THREADS / 32) as usize).clamp(1, 16 * sms) as u32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    for p in &ptrs {
        b.arg(p);
    }
    b.arg(&out_ptr);
    let (rows, dim) = (rows as i64, dim as i32);
    b.arg(&rows);
    b.arg(&dim);
    // SAFETY: (const T* in..., T* out, long long rows, int dim) as declared in normalize.cu;
    // every operand holds rows x dim elements of the same dtype.
    unsafe { b.launch(cfg) }.w()?;
    Ok(out)
}

/// `y = x / max(|x|, 1e-12)` per row.
pub(crate) fn l2norm_fwd(x: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
    run("fwd", &[(x, l)])
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
    run("bwd", &[(x, lx), (g, lg)])
}
