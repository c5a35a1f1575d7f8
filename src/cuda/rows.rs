//! Launches of kernels/rows.cu: row gather with zero rows, bias rows (and
//! GELU), row scatter-add and column sums.

use super::device::device_info;
use super::launch::{blocks, grid_stride, kernel, kernel_params, launch, Module};
use super::memory::{alloc_out, storage_ptr, HostFlag};
use super::params::dtype_tag;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result};

/// Mirror of `RowsParams` in kernels/rows.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RowsParams {
    x: u64,
    aux: u64,
    g: u64,
    out: u64,
    bad: u64,
    rows: i64,
    cols: i32,
    n: u32,
}
kernel_params!(RowsParams);

/// Launches `name` with a warp per row, 8 per block, at most 16 blocks per SM.
fn run_rows(dev: &CudaDevice, name: &str, p: &RowsParams) -> Result<()> {
    let func = kernel(dev, Module::Rows, name, 0)?;
    launch(dev, &func, grid_stride(dev, p.rows as usize, 8, 256, 16)?, p)
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
    let sp = storage_ptr(src.0, src.1)?;
    let row_bytes = c * src.0.dtype().size_in_bytes();
    let (name, unit) = if row_bytes.is_multiple_of(16) && sp.is_multiple_of(16) { ("v16", 16) } else { ("b2", 2) };
    let p = RowsParams {
        x: sp,
        aux: storage_ptr(idx.0, idx.1)?,
        out: storage_ptr(&out, &Layout::contiguous(n * c))?,
        rows: n as i64,
        cols: (row_bytes / unit) as i32,
        n: r as u32,
        ..Default::default()
    };
    run_rows(dev, &format!("gather_rows_{name}"), &p)?;
    Ok(out)
}

/// `act(x + bias)` for `x` `[R, C]` (contiguous, F16/BF16/F32/F64) and
/// `bias` `[C]` in the accumulation type (F32; F64 for F64), rounded once;
/// `act` is GELU (erf) when `gelu`, else the identity.
pub(crate) fn add_bias(x: (&CudaStorage, &Layout), bias: (&CudaStorage, &Layout), gelu: bool) -> Result<CudaStorage> {
    let name = if gelu { "add_bias_gelu" } else { "add_bias" };
    let out = alloc_out(&x.0.device, x.0.dtype(), x.1.shape().elem_count())?;
    bias_launch(name, x, bias, None, &out)?;
    Ok(out)
}

/// [`add_bias`] in place: `y` `[R, C]` (contiguous from offset 0, a fresh
/// buffer such as a product's output) becomes `act(y + bias)`. The kernel
/// reads each element before writing it, in the same thread.
pub(crate) fn add_bias_in_place(
    y: &CudaStorage,
    rows: usize,
    cols: usize,
    bias: (&CudaStorage, &Layout),
    gelu: bool,
) -> Result<()> {
    let name = if gelu { "add_bias_gelu" } else { "add_bias" };
    bias_launch(name, (y, &Layout::contiguous((rows, cols))), bias, None, y)
}

/// `g · GELU'(x + bias)` in `x`'s dtype, operands as [`add_bias`] and `g`
/// like `x`.
pub(crate) fn gelu_bwd(
    x: (&CudaStorage, &Layout),
    bias: (&CudaStorage, &Layout),
    g: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let out = alloc_out(&x.0.device, x.0.dtype(), x.1.shape().elem_count())?;
    bias_launch("gelu_bwd", x, bias, Some(g), &out)?;
    Ok(out)
}

/// The launch of rows.cu's `NAME_<dtype>` over `x`, `bias` and `g` into
/// `out` (x's dtype and element count; it may be x's own buffer).
fn bias_launch(
    name: &str,
    x: (&CudaStorage, &Layout),
    bias: (&CudaStorage, &Layout),
    g: Option<(&CudaStorage, &Layout)>,
    out: &CudaStorage,
) -> Result<()> {
    let dev = &x.0.device;
    let (r, c) = x.1.shape().dims2()?;
    if c > i32::MAX as usize {
        bail!("x: {c} columns exceed the bias kernel's 32-bit column index")
    }
    if r * c == 0 {
        return Ok(());
    }
    let gp = match g {
        Some((g, lg)) if g.dtype() == x.0.dtype() && lg.shape() == x.1.shape() => storage_ptr(g, lg)?,
        Some(_) => bail!("g: internal error, the gradient differs from x in dtype or shape"),
        None => 0,
    };
    let p = RowsParams {
        x: storage_ptr(x.0, x.1)?,
        aux: storage_ptr(bias.0, bias.1)?,
        g: gp,
        out: storage_ptr(out, &Layout::contiguous(r * c))?,
        rows: r as i64,
        cols: c as i32,
        ..Default::default()
    };
    run_rows(dev, &format!("{name}_{}", dtype_tag(x.0.dtype())), &p)
}

/// GeGLU of `x [R, 2C]` (contiguous, F16/BF16/F32): `GELU(x[:, :C]) ·
/// x[:, C:]` `[R, C]`; with `g [R, C]`, its backward `[R, 2C]` instead.
pub(crate) fn geglu(x: (&CudaStorage, &Layout), g: Option<(&CudaStorage, &Layout)>) -> Result<CudaStorage> {
    let dev = &x.0.device;
    let (r, c2) = x.1.shape().dims2()?;
    let c = c2 / 2;
    if c2 > i32::MAX as usize {
        bail!("x: {c2} columns exceed the GeGLU kernel's 32-bit column index")
    }
    let out = alloc_out(dev, x.0.dtype(), r * if g.is_some() { c2 } else { c })?;
    if r * c == 0 {
        return Ok(out);
    }
    let gp = match g {
        Some((g, lg)) if g.dtype() == x.0.dtype() && lg.shape().dims() == [r, c] => storage_ptr(g, lg)?,
        Some(_) => bail!("g: internal error, the gradient is not [R, C] in x's dtype"),
        None => 0,
    };
    let p = RowsParams {
        x: storage_ptr(x.0, x.1)?,
        g: gp,
        out: storage_ptr(&out, &Layout::contiguous(1))?,
        rows: r as i64,
        cols: c as i32,
        ..Default::default()
    };
    let name = if g.is_some() { "geglu_bwd" } else { "geglu" };
    run_rows(dev, &format!("{name}_{}", dtype_tag(x.0.dtype())), &p)?;
    Ok(out)
}

/// `[n_out, C]` F32 sums of the rows of `src` `[R, C]` (contiguous
/// F16/BF16/F32) by destination `idx` `[R]` U32: one f32 atomic per element.
/// A row whose index is ≥ `n_out` is an `Err` if `checked` (which waits for
/// the stream to read the kernel's flag), else skipped (no wait).
pub(crate) fn scatter_add_rows(
    src: (&CudaStorage, &Layout),
    idx: (&CudaStorage, &Layout),
    n_out: usize,
    checked: bool,
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
    let bad = if checked { Some(HostFlag::new(dev)?) } else { None };
    let p = RowsParams {
        x: storage_ptr(src.0, src.1)?,
        aux: storage_ptr(idx.0, idx.1)?,
        out: storage_ptr(&out, &Layout::contiguous(1))?,
        bad: bad.as_ref().map_or(0, HostFlag::dev_ptr),
        rows: r as i64,
        cols: c as i32,
        n: n_out as u32,
        ..Default::default()
    };
    run_rows(dev, &format!("scatter_add_rows_{}", dtype_tag(src.0.dtype())), &p)?;
    if let Some(bad) = bad {
        if bad.is_set(dev)? {
            bail!("idx: an index is out of range for {n_out} output rows")
        }
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
    if r * c == 0 {
        return Ok(CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>(c.max(1))?, dev.clone()));
    }
    // Blocks of 256 columns along x; along y enough blocks to fill the
    // device (4 per SM), each at least 64 rows, each writing its part.
    let bx = c.div_ceil(256);
    let by = (4 * device_info(dev)?.sm_count.max(1) as usize).div_ceil(bx).clamp(1, r.div_ceil(64).max(1));
    let parts = alloc_out(dev, DType::F32, by * c)?;
    let p = RowsParams {
        x: storage_ptr(g.0, g.1)?,
        out: storage_ptr(&parts, &Layout::contiguous(1))?,
        rows: r as i64,
        cols: c as i32,
        ..Default::default()
    };
    let mut cfg = blocks(bx as u32, 256, 0);
    cfg.grid_dim.1 = by as u32;
    let func = kernel(dev, Module::Rows, &format!("sum_rows_{}", dtype_tag(g.0.dtype())), 0)?;
    launch(dev, &func, cfg, &p)?;
    if by == 1 {
        return Ok(parts);
    }
    sum_parts(&parts, by, c)
}

/// `[C]` F32: the sums over the `n` rows of `parts` `[n, C]` (F32,
/// contiguous), added in row order, so that a reduction split over blocks
/// gives the same bits on every run.
pub(crate) fn sum_parts(parts: &CudaStorage, n: usize, c: usize) -> Result<CudaStorage> {
    let dev = &parts.device;
    let out = alloc_out(dev, DType::F32, c.max(1))?;
    let p = RowsParams {
        x: storage_ptr(parts, &Layout::contiguous(n * c))?,
        out: storage_ptr(&out, &Layout::contiguous(1))?,
        rows: n as i64,
        cols: c as i32,
        ..Default::default()
    };
    let func = kernel(dev, Module::Rows, "sum_parts", 0)?;
    launch(dev, &func, blocks(c.div_ceil(256).max(1) as u32, 256, 0), &p)?;
    Ok(out)
}
