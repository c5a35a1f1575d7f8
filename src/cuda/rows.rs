//! Launch of kernels/rows.cu: row gather with zero rows, bias rows.

use super::params::dtype_tag;
use super::{alloc_out, device_info, load_func, storage_ptr, tensor_ptr, ROWS};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Layout, Result, Storage, Tensor};

/// `[N, C]` rows of `src` `[R, C]` picked by `idx` `[N]` U32, zero where
/// `idx ≥ R`; `None` where the rows are not whole 16-byte vectors or the
/// operands not 16-byte aligned (the caller then uses candle ops).
pub(crate) fn gather_rows(src: &Tensor, idx: &Tensor) -> Result<Option<Tensor>> {
    let candle_core::Device::Cuda(dev) = src.device() else { return Ok(None) };
    let (r, c) = src.dims2()?;
    let n = idx.dim(0)?;
    let row_bytes = c * src.dtype().size_in_bytes();
    let (src, idx) = (src.contiguous()?, idx.contiguous()?);
    if !row_bytes.is_multiple_of(16) || !tensor_ptr(&src)?.is_multiple_of(16) || n == 0 || r >= u32::MAX as usize {
        return Ok(None);
    }
    let out = alloc_out(dev, src.dtype(), n * c)?;
    let func = load_func(dev, "gather_rows_v16", 0, "rows", &ROWS)?;
    let blocks = n.div_ceil(8).min(16 * device_info(dev)?.sm_count.max(1) as usize) as u32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (sp, ip) = (tensor_ptr(&src)?, tensor_ptr(&idx)?);
    let op = storage_ptr(&out, &Layout::contiguous(n * c))?;
    let (rows, vecs, n_src) = (n as i64, (row_bytes / 16) as i32, r as u32);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&sp);
    b.arg(&ip);
    b.arg(&op);
    b.arg(&rows);
    b.arg(&vecs);
    b.arg(&n_src);
    // SAFETY: (const uint4*, const uint32_t*, uint4*, long long, int, uint32_t) as in rows.cu;
    // src holds r rows and out n rows of `vecs` 16-byte vectors, idx n entries.
    unsafe { b.launch(cfg) }.w()?;
    drop((src, idx));
    Ok(Some(Tensor::from((Storage::Cuda(out), (n, c)))))
}

/// `x + bias` for `x` `[R, C]` F16/BF16/F32 and `bias` `[C]` (any float dtype,
/// added in F32); `None` for other dtypes.
pub(crate) fn add_bias(x: &Tensor, bias: &Tensor) -> Result<Option<Tensor>> {
    let candle_core::Device::Cuda(dev) = x.device() else { return Ok(None) };
    let (r, c) = x.dims2()?;
    if !matches!(x.dtype(), DType::F16 | DType::BF16 | DType::F32) || r * c == 0 || c > i32::MAX as usize {
        return Ok(None);
    }
    let (x, bias) = (x.contiguous()?, bias.to_dtype(DType::F32)?.contiguous()?);
    let out = alloc_out(dev, x.dtype(), r * c)?;
    let func = load_func(dev, &format!("add_bias_{}", dtype_tag(x.dtype())), 0, "rows", &ROWS)?;
    let blocks = r.div_ceil(8).min(16 * device_info(dev)?.sm_count.max(1) as usize) as u32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (xp, bp) = (tensor_ptr(&x)?, tensor_ptr(&bias)?);
    let op = storage_ptr(&out, &Layout::contiguous(r * c))?;
    let (rows, cols) = (r as i64, c as i32);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&xp);
    b.arg(&bp);
    b.arg(&op);
    b.arg(&rows);
    b.arg(&cols);
    // SAFETY: (const T*, const float*, T*, long long, int) as in rows.cu; x and out hold
    // rows x cols elements of T, bias cols F32.
    unsafe { b.launch(cfg) }.w()?;
    drop((x, bias));
    Ok(Some(Tensor::from((Storage::Cuda(out), (r, c)))))
}
