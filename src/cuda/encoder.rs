//! Launches of kernels/encoder.cu: the attention softmax and the layer norm,
//! forward and backward.

use super::params::dtype_tag;
use super::{alloc_out, device_info, load_func, storage_ptr, ENCODER};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result};

/// 8 warps (rows) per block, at most `per_sm` blocks per SM (grid-stride beyond).
fn grid(dev: &CudaDevice, rows: usize, per_sm: usize, smem: u32) -> Result<LaunchConfig> {
    let blocks = rows.div_ceil(8).clamp(1, per_sm * device_info(dev)?.sm_count.max(1) as usize) as u32;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: smem })
}

fn int(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).or_else(|_| bail!("{what}: {v} exceeds the encoder kernels' 32-bit lengths"))
}

/// The geometry of an attention softmax: `[B, H, Lq, Lk]` scores, the bias
/// strides of batch and query row (0 to broadcast).
pub(crate) struct SoftmaxShape {
    pub heads: usize,
    pub lq: usize,
    pub lk: usize,
    pub bias_b: usize,
    pub bias_i: usize,
}

/// `softmax(scale · s + bias)` over the rows of `s` (contiguous).
pub(crate) fn attn_softmax_fwd(
    s: (&CudaStorage, &Layout),
    bias: (&CudaStorage, &Layout),
    g: &SoftmaxShape,
    scale: f32,
) -> Result<CudaStorage> {
    let dev = &s.0.device;
    let n = s.1.shape().elem_count();
    let out = alloc_out(dev, s.0.dtype(), n)?;
    let rows = n / g.lk.max(1);
    if rows == 0 {
        return Ok(out);
    }
    let func = load_func(dev, &format!("attn_softmax_fwd_{}", dtype_tag(s.0.dtype())), 0, "encoder", &ENCODER)?;
    let (sp, bp, op) =
        (storage_ptr(s.0, s.1)?, storage_ptr(bias.0, bias.1)?, storage_ptr(&out, &Layout::contiguous(n))?);
    let (rows_, lk, lq, heads) = (rows as i64, int("lk", g.lk)?, int("lq", g.lq)?, int("heads", g.heads)?);
    let (bias_b, bias_i) = (g.bias_b as i64, int("bias", g.bias_i)?);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&sp);
    b.arg(&bp);
    b.arg(&op);
    b.arg(&rows_);
    b.arg(&lk);
    b.arg(&lq);
    b.arg(&heads);
    b.arg(&bias_b);
    b.arg(&bias_i);
    b.arg(&scale);
    // SAFETY: (const T*, const float*, T*, long long, int, int, int, long long, int, float) as in
    // encoder.cu; s and out hold rows x lk of T, the bias covers every (b, i) row the strides reach.
    unsafe { b.launch(grid(dev, rows, 16, 0)?) }.w()?;
    Ok(out)
}

/// `scale · p ⊙ (dp − Σ p ⊙ dp)` per row of `lk` (p, dp contiguous, one dtype).
pub(crate) fn attn_softmax_bwd(
    p: (&CudaStorage, &Layout),
    dp: (&CudaStorage, &Layout),
    lk: usize,
    scale: f32,
) -> Result<CudaStorage> {
    let dev = &p.0.device;
    let n = p.1.shape().elem_count();
    let out = alloc_out(dev, p.0.dtype(), n)?;
    let rows = n / lk.max(1);
    if rows == 0 {
        return Ok(out);
    }
    let func = load_func(dev, &format!("attn_softmax_bwd_{}", dtype_tag(p.0.dtype())), 0, "encoder", &ENCODER)?;
    let (pp, gp, op) = (storage_ptr(p.0, p.1)?, storage_ptr(dp.0, dp.1)?, storage_ptr(&out, &Layout::contiguous(n))?);
    let (rows_, lk_) = (rows as i64, int("lk", lk)?);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&pp);
    b.arg(&gp);
    b.arg(&op);
    b.arg(&rows_);
    b.arg(&lk_);
    b.arg(&scale);
    // SAFETY: (const T*, const T*, T*, long long, int, float) as in encoder.cu; every operand
    // holds rows x lk elements of T.
    unsafe { b.launch(grid(dev, rows, 16, 0)?) }.w()?;
    Ok(out)
}

/// The layer norm of the rows of `x [R, C]` with F32 `w` (and `b`) `[C]`.
pub(crate) fn layer_norm_fwd(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: Option<(&CudaStorage, &Layout)>,
    eps: f32,
) -> Result<CudaStorage> {
    let dev = &x.0.device;
    let c = w.1.shape().elem_count();
    let n = x.1.shape().elem_count();
    let out = alloc_out(dev, x.0.dtype(), n)?;
    let rows = n / c.max(1);
    if rows == 0 {
        return Ok(out);
    }
    let func = load_func(dev, &format!("layer_norm_fwd_{}", dtype_tag(x.0.dtype())), 0, "encoder", &ENCODER)?;
    let (xp, wp, op) = (storage_ptr(x.0, x.1)?, storage_ptr(w.0, w.1)?, storage_ptr(&out, &Layout::contiguous(n))?);
    let bp = match b {
        Some((s, l)) => storage_ptr(s, l)?,
        None => 0u64,
    };
    let (rows_, c_) = (rows as i64, int("x", c)?);
    let stream = dev.cuda_stream();
    let mut lb = stream.launch_builder(&func);
    lb.arg(&xp);
    lb.arg(&wp);
    lb.arg(&bp);
    lb.arg(&op);
    lb.arg(&rows_);
    lb.arg(&c_);
    lb.arg(&eps);
    // SAFETY: (const T*, const float*, const float* or null, T*, long long, int, float) as in
    // encoder.cu; x and out hold rows x c of T, w and b c floats.
    unsafe { lb.launch(grid(dev, rows, 16, 0)?) }.w()?;
    Ok(out)
}

/// `dx` of the layer norm from `x`, F32 `w [C]` and `dy` (x's dtype and shape).
pub(crate) fn layer_norm_bwd_x(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
    eps: f32,
) -> Result<CudaStorage> {
    let dev = &x.0.device;
    let c = w.1.shape().elem_count();
    let n = x.1.shape().elem_count();
    let out = alloc_out(dev, x.0.dtype(), n)?;
    let rows = n / c.max(1);
    if rows == 0 {
        return Ok(out);
    }
    let func = load_func(dev, &format!("layer_norm_bwd_x_{}", dtype_tag(x.0.dtype())), 0, "encoder", &ENCODER)?;
    let (xp, wp, gp) = (storage_ptr(x.0, x.1)?, storage_ptr(w.0, w.1)?, storage_ptr(dy.0, dy.1)?);
    let op = storage_ptr(&out, &Layout::contiguous(n))?;
    let (rows_, c_) = (rows as i64, int("x", c)?);
    let stream = dev.cuda_stream();
    let mut lb = stream.launch_builder(&func);
    lb.arg(&xp);
    lb.arg(&wp);
    lb.arg(&gp);
    lb.arg(&op);
    lb.arg(&rows_);
    lb.arg(&c_);
    lb.arg(&eps);
    // SAFETY: (const T*, const float*, const T*, T*, long long, int, float) as in encoder.cu;
    // x, dy and out hold rows x c of T, w c floats.
    unsafe { lb.launch(grid(dev, rows, 16, 0)?) }.w()?;
    Ok(out)
}

/// `[2, C]` F32: the sums over rows of `dy ⊙ x̂` (the weight's gradient) and of `dy` (the bias's).
pub(crate) fn layer_norm_bwd_wb(
    x: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
    c: usize,
    eps: f32,
) -> Result<CudaStorage> {
    let dev = &x.0.device;
    let n = x.1.shape().elem_count();
    let out = CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>((2 * c).max(1))?, dev.clone());
    let rows = n / c.max(1);
    if rows == 0 {
        return Ok(out);
    }
    let smem = 2 * c * 4;
    if smem > 48 * 1024 {
        bail!("x: layer norm rows of {c} exceed the 6144 columns of the weight-gradient kernel")
    }
    let func = load_func(dev, &format!("layer_norm_bwd_wb_{}", dtype_tag(x.0.dtype())), 0, "encoder", &ENCODER)?;
    let (xp, gp, op) = (storage_ptr(x.0, x.1)?, storage_ptr(dy.0, dy.1)?, storage_ptr(&out, &Layout::contiguous(1))?);
    let (rows_, c_) = (rows as i64, int("x", c)?);
    let stream = dev.cuda_stream();
    let mut lb = stream.launch_builder(&func);
    lb.arg(&xp);
    lb.arg(&gp);
    lb.arg(&op);
    lb.arg(&rows_);
    lb.arg(&c_);
    lb.arg(&eps);
    // SAFETY: (const T*, const T*, float*, long long, int, float) as in encoder.cu; x and dy
    // hold rows x c of T, out 2c floats, the block's shared memory 2c floats.
    // Two blocks per SM: each block adds 2c atomics at its end.
    unsafe { lb.launch(grid(dev, rows, 2, smem as u32)?) }.w()?;
    Ok(out)
}
