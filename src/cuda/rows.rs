//! Launches of kernels/rows.cu: row gather with zero rows, bias rows (and
//! GELU), row scatter-add and column sums.

use super::params::dtype_tag;
use super::{alloc_out, device_info, load_func, storage_ptr, ROWS};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, Layout, Result};

/// A grid-stride launch of `rows` warps' worth of work, 8 warps per block.
fn grid(dev: &candle_core::CudaDevice, rows: usize) -> Result<LaunchConfig> {
    let blocks = rows.div_ceil(8).min(16 * device_info(dev)?.sm_count.max(1) as usize).max(1) as u32;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })
}

/// `[N, C]` rows of `src` `[R, C]` (contiguous, a float dtype) picked by
/// `idx` `[N]` U32, zero rows where `idx ≥ R`: 16-byte vectors where the
/// rows and the base allow, 2-byte words otherwise.
pub(crate) fn gather_rows(src: (&CudaStorage, &Layout), idx: (&CudaStorage, &Layout)) -> Result<CudaStorage> {
    let dev = &src.0.device;
    let (r, c) = src.1.shape().dims2()?;
    let n = idx.1.shape().elem_count();
    if r >= u32::MAX as usize {
        bail!("src: {r} rows exceed the row gather's 32-bit indices")
    }
    let out = alloc_out(dev, src.0.dtype(), n * c)?;
    if n == 0 || c == 0 {
        return Ok(out);
    }
    let (sp, ip) = (storage_ptr(src.0, src.1)?, storage_ptr(idx.0, idx.1)?);
    let row_bytes = c * src.0.dtype().size_in_bytes();
    let (name, unit) = if row_bytes.is_multiple_of(16) && sp.is_multiple_of(16) { ("v16", 16) } else { ("b2", 2) };
    let func = load_func(dev, &format!("gather_rows_{name}"), 0, "rows", &ROWS)?;
    let op = storage_ptr(&out, &Layout::contiguous(n * c))?;
    let (rows, units, n_src) = (n as i64, (row_bytes / unit) as i32, r as u32);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&sp);
    b.arg(&ip);
    b.arg(&op);
    b.arg(&rows);
    b.arg(&units);
    b.arg(&n_src);
    // SAFETY: (const U*, const uint32_t*, U*, long long, int, uint32_t) as in rows.cu; src
    // holds r rows and out n rows of `units` words of U (aligned to U), idx n entries.
    unsafe { b.launch(grid(dev, n)?) }.w()?;
    Ok(out)
}

/// `act(x + bias)` for `x` `[R, C]` (contiguous, F16/BF16/F32/F64) and
/// `bias` `[C]` in the accumulation type (F32; F64 for F64), rounded once;
/// `act` is GELU (erf) when `gelu`, else the identity.
pub(crate) fn add_bias(x: (&CudaStorage, &Layout), bias: (&CudaStorage, &Layout), gelu: bool) -> Result<CudaStorage> {
    let name = if gelu { "add_bias_gelu" } else { "add_bias" };
    bias_launch(name, x, bias, None)
}

/// `g · GELU'(x + bias)` in `x`'s dtype, operands as [`add_bias`] and `g`
/// like `x`.
pub(crate) fn gelu_bwd(
    x: (&CudaStorage, &Layout),
    bias: (&CudaStorage, &Layout),
    g: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    bias_launch("gelu_bwd", x, bias, Some(g))
}

/// The launch of rows.cu's `NAME_<dtype>(x, bias, [g,] out, rows, cols)`.
fn bias_launch(
    name: &str,
    x: (&CudaStorage, &Layout),
    bias: (&CudaStorage, &Layout),
    g: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let dev = &x.0.device;
    let (r, c) = x.1.shape().dims2()?;
    if c > i32::MAX as usize {
        bail!("x: {c} columns exceed the bias kernel's 32-bit column index")
    }
    let out = alloc_out(dev, x.0.dtype(), r * c)?;
    if r * c == 0 {
        return Ok(out);
    }
    let func = load_func(dev, &format!("{name}_{}", dtype_tag(x.0.dtype())), 0, "rows", &ROWS)?;
    let (xp, bp) = (storage_ptr(x.0, x.1)?, storage_ptr(bias.0, bias.1)?);
    let gp = match g {
        Some((g, lg)) if g.dtype() == x.0.dtype() && lg.shape() == x.1.shape() => Some(storage_ptr(g, lg)?),
        Some(_) => bail!("g: internal error, the gradient differs from x in dtype or shape"),
        None => None,
    };
    let op = storage_ptr(&out, &Layout::contiguous(r * c))?;
    let (rows, cols) = (r as i64, c as i32);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&xp);
    b.arg(&bp);
    if let Some(gp) = &gp {
        b.arg(gp);
    }
    b.arg(&op);
    b.arg(&rows);
    b.arg(&cols);
    // SAFETY: (const T*, const Acc*, [const T*,] T*, long long, int) as in rows.cu; x, g and
    // out hold rows x cols elements of T, bias cols of the accumulation type (F32, F64 for F64).
    unsafe { b.launch(grid(dev, r)?) }.w()?;
    Ok(out)
}

/// `[n_out, C]` F32 sums of the rows of `src` `[R, C]` (contiguous
/// F16/BF16/F32) by destination `idx` `[R]` U32: one f32 atomic per element.
pub(crate) fn scatter_add_rows(
    src: (&CudaStorage, &Layout),
    idx: (&CudaStorage, &Layout),
    n_out: usize,
) -> Result<CudaStorage> {
    let dev = &src.0.device;
    let (r, c) = src.1.shape().dims2()?;
    if c > i32::MAX as usize || n_out >= u32::MAX as usize {
        bail!("src: {n_out} x {c} sums exceed the scatter kernel's 32-bit indices")
    }
    let out = CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>((n_out * c).max(1))?, dev.clone());
    if r * c == 0 {
        return Ok(out);
    }
    let bad = super::HostFlag::new(dev)?;
    let func = load_func(dev, &format!("scatter_add_rows_{}", dtype_tag(src.0.dtype())), 0, "rows", &ROWS)?;
    let (sp, ip, op, bp) = (
        storage_ptr(src.0, src.1)?,
        storage_ptr(idx.0, idx.1)?,
        storage_ptr(&out, &Layout::contiguous(1))?,
        bad.dev_ptr(),
    );
    let (rows, cols, n) = (r as i64, c as i32, n_out as u32);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&sp);
    b.arg(&ip);
    b.arg(&op);
    b.arg(&rows);
    b.arg(&cols);
    b.arg(&n);
    b.arg(&bp);
    // SAFETY: (const T*, const uint32_t*, float*, long long, int, uint32_t, unsigned*) as in
    // rows.cu; src holds r rows of c, idx r entries, out n_out rows of c F32.
    unsafe { b.launch(grid(dev, r)?) }.w()?;
    if bad.is_set(dev)? {
        bail!("idx: an index is out of range for {n_out} output rows")
    }
    Ok(out)
}

/// `[C]` F32 column sums of `g` `[R, C]` (contiguous F16/BF16/F32).
pub(crate) fn sum_rows(g: (&CudaStorage, &Layout)) -> Result<CudaStorage> {
    let dev = &g.0.device;
    let (r, c) = g.1.shape().dims2()?;
    if c > i32::MAX as usize {
        bail!("x: {c} columns exceed the row-sum kernel's 32-bit column index")
    }
    let out = CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>(c.max(1))?, dev.clone());
    if r * c == 0 {
        return Ok(out);
    }
    let func = load_func(dev, &format!("sum_rows_{}", dtype_tag(g.0.dtype())), 0, "rows", &ROWS)?;
    let (gp, op) = (storage_ptr(g.0, g.1)?, storage_ptr(&out, &Layout::contiguous(1))?);
    let (rows, cols) = (r as i64, c as i32);
    // Enough blocks to fill the device (4 per SM), each at least 64 rows.
    let bx = c.div_ceil(256);
    let by = (4 * device_info(dev)?.sm_count.max(1) as usize).div_ceil(bx).clamp(1, r.div_ceil(64).max(1)) as u32;
    let cfg = LaunchConfig { grid_dim: (bx as u32, by, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&gp);
    b.arg(&op);
    b.arg(&rows);
    b.arg(&cols);
    // SAFETY: (const T*, float*, long long, int) as in rows.cu; g holds rows x cols of T, out cols F32.
    unsafe { b.launch(cfg) }.w()?;
    Ok(out)
}
