//! Launches of kernels/encoder.cu: the attention softmax, the layer norm and
//! rotary embeddings, forward and backward.

use super::device::device_info;
use super::launch::{blocks, grid_stride, kernel, kernel_params, launch, Module};
use super::memory::{alloc_out, storage_ptr};
use super::params::dtype_tag;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result};

/// Mirror of `SoftmaxParams` in kernels/encoder.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct SoftmaxParams {
    x: u64,
    g: u64,
    bias: u64,
    out: u64,
    rows: i64,
    bias_b: i64,
    lk: i32,
    lq: i32,
    heads: i32,
    bias_i: i32,
    scale: f32,
}

/// Mirror of `LayerNormParams` in kernels/encoder.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct LayerNormParams {
    x: u64,
    res: u64,
    dy: u64,
    w: u64,
    b: u64,
    out: u64,
    rows: i64,
    c: i32,
    eps: f32,
}
/// Mirror of `RotaryParams` in kernels/encoder.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RotaryParams {
    x: u64,
    cos: u64,
    sin: u64,
    out: u64,
    rows: i64,
    heads: i32,
    half: i32,
    sign: f32,
}
kernel_params!(SoftmaxParams, LayerNormParams, RotaryParams);

fn int(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).or_else(|_| bail!("{what}: {v} exceeds the encoder kernels' 32-bit lengths"))
}

/// Launches `<name>_<dtype>` over `rows` rows, a warp per row and 8 per
/// block, at most `per_sm` blocks per SM, with `smem` bytes of shared memory.
fn run<P: super::launch::KernelArgs>(
    dev: &CudaDevice,
    name: &str,
    x: &CudaStorage,
    rows: usize,
    (per_sm, smem): (usize, u32),
    p: &P,
) -> Result<()> {
    let func = kernel(dev, Module::Encoder, &format!("{name}_{}", dtype_tag(x.dtype())), smem)?;
    let mut cfg = grid_stride(dev, rows, 8, 256, per_sm)?;
    cfg.shared_mem_bytes = smem;
    launch(dev, &func, cfg, p)
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
    let p = SoftmaxParams {
        x: storage_ptr(s.0, s.1)?,
        bias: storage_ptr(bias.0, bias.1)?,
        out: storage_ptr(&out, &Layout::contiguous(n))?,
        rows: rows as i64,
        bias_b: g.bias_b as i64,
        lk: int("lk", g.lk)?,
        lq: int("lq", g.lq)?,
        heads: int("heads", g.heads)?,
        bias_i: int("bias", g.bias_i)?,
        scale,
        ..Default::default()
    };
    run(dev, "attn_softmax_fwd", s.0, rows, (16, 0), &p)?;
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
    let params = SoftmaxParams {
        x: storage_ptr(p.0, p.1)?,
        g: storage_ptr(dp.0, dp.1)?,
        out: storage_ptr(&out, &Layout::contiguous(n))?,
        rows: rows as i64,
        lk: int("lk", lk)?,
        scale,
        ..Default::default()
    };
    run(dev, "attn_softmax_bwd", p.0, rows, (16, 0), &params)?;
    Ok(out)
}

/// The layer-norm launch's parameters over the rows of `x` (`c` columns).
/// `res`: a residual (x's dtype and shape) added to `x` before the norm.
fn norm_params(
    x: (&CudaStorage, &Layout),
    res: Option<(&CudaStorage, &Layout)>,
    c: usize,
    out: &CudaStorage,
    eps: f32,
) -> Result<(LayerNormParams, usize)> {
    let n = x.1.shape().elem_count();
    let res = match res {
        Some((r, lr)) if r.dtype() == x.0.dtype() && lr.shape() == x.1.shape() => storage_ptr(r, lr)?,
        Some(_) => bail!("res: internal error, the residual differs from x in dtype or shape"),
        None => 0,
    };
    let p = LayerNormParams {
        x: storage_ptr(x.0, x.1)?,
        res,
        out: storage_ptr(out, &Layout::contiguous(1))?,
        rows: (n / c.max(1)) as i64,
        c: int("x", c)?,
        eps,
        ..Default::default()
    };
    Ok((p, n / c.max(1)))
}

/// The layer norm of the rows of `x [R, C]` (plus `res`) with F32 `w` (and `b`) `[C]`.
pub(crate) fn layer_norm_fwd(
    x: (&CudaStorage, &Layout),
    res: Option<(&CudaStorage, &Layout)>,
    w: (&CudaStorage, &Layout),
    b: Option<(&CudaStorage, &Layout)>,
    eps: f32,
) -> Result<CudaStorage> {
    let dev = &x.0.device;
    let c = w.1.shape().elem_count();
    let out = alloc_out(dev, x.0.dtype(), x.1.shape().elem_count())?;
    let (mut p, rows) = norm_params(x, res, c, &out, eps)?;
    if rows == 0 {
        return Ok(out);
    }
    p.w = storage_ptr(w.0, w.1)?;
    p.b = b.map(|(s, l)| storage_ptr(s, l)).transpose()?.unwrap_or(0);
    run(dev, "layer_norm_fwd", x.0, rows, (16, 0), &p)?;
    Ok(out)
}

/// `dx` of the layer norm from `x` (plus `res`), F32 `w [C]` and `dy` (x's dtype and shape).
pub(crate) fn layer_norm_bwd_x(
    x: (&CudaStorage, &Layout),
    res: Option<(&CudaStorage, &Layout)>,
    w: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
    eps: f32,
) -> Result<CudaStorage> {
    let dev = &x.0.device;
    let c = w.1.shape().elem_count();
    let out = alloc_out(dev, x.0.dtype(), x.1.shape().elem_count())?;
    let (mut p, rows) = norm_params(x, res, c, &out, eps)?;
    if rows == 0 {
        return Ok(out);
    }
    p.w = storage_ptr(w.0, w.1)?;
    p.dy = storage_ptr(dy.0, dy.1)?;
    run(dev, "layer_norm_bwd_x", x.0, rows, (16, 0), &p)?;
    Ok(out)
}

/// `[2, C]` F32: the sums over rows of `dy ⊙ x̂` (the weight's gradient) and of `dy` (the bias's).
pub(crate) fn layer_norm_bwd_wb(
    x: (&CudaStorage, &Layout),
    res: Option<(&CudaStorage, &Layout)>,
    dy: (&CudaStorage, &Layout),
    c: usize,
    eps: f32,
) -> Result<CudaStorage> {
    let dev = &x.0.device;
    if x.1.shape().elem_count() == 0 {
        return Ok(CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>((2 * c).max(1))?, dev.clone()));
    }
    // Two blocks per SM, each at least one chunk of rows, each writing its
    // [2, C] part of the sums; sum_parts adds the parts in order.
    const CHUNK: usize = 32; // NORM_WB_CHUNK in kernels/encoder.cu
    let smem = (2 * c + 2 * CHUNK) * 4;
    if smem > 48 * 1024 {
        bail!("x: layer norm rows of {c} exceed the 6112 columns of the weight-gradient kernel")
    }
    let rows = x.1.shape().elem_count() / c.max(1);
    let n = rows.div_ceil(CHUNK).clamp(1, 2 * device_info(dev)?.sm_count.max(1) as usize);
    let parts = alloc_out(dev, DType::F32, n * 2 * c)?;
    let (mut p, _) = norm_params(x, res, c, &parts, eps)?;
    p.dy = storage_ptr(dy.0, dy.1)?;
    let func = kernel(dev, Module::Encoder, &format!("layer_norm_bwd_wb_{}", dtype_tag(x.0.dtype())), smem as u32)?;
    launch(dev, &func, blocks(n as u32, 256, smem as u32), &p)?;
    if n == 1 {
        return Ok(parts);
    }
    super::rows::sum_parts(&parts, n, 2 * c)
}

/// The q and k blocks of `x [T, 3·H·dh]` (contiguous) rotated by the F32
/// tables `cos`, `sin` `[T, dh/2]` (back when `inverse`), v copied.
pub(crate) fn rotary_qk(
    x: (&CudaStorage, &Layout),
    cos: (&CudaStorage, &Layout),
    sin: (&CudaStorage, &Layout),
    heads: usize,
    inverse: bool,
) -> Result<CudaStorage> {
    let dev = &x.0.device;
    let (t, w) = x.1.shape().dims2()?;
    let out = alloc_out(dev, x.0.dtype(), t * w)?;
    if t * w == 0 {
        return Ok(out);
    }
    let p = RotaryParams {
        x: storage_ptr(x.0, x.1)?,
        cos: storage_ptr(cos.0, cos.1)?,
        sin: storage_ptr(sin.0, sin.1)?,
        out: storage_ptr(&out, &Layout::contiguous(t * w))?,
        rows: t as i64,
        heads: int("heads", heads)?,
        half: int("cos", w / (6 * heads))?,
        sign: if inverse { -1.0 } else { 1.0 },
    };
    let func = kernel(dev, Module::Encoder, &format!("rotary_qk_{}", dtype_tag(x.0.dtype())), 0)?;
    launch(dev, &func, grid_stride(dev, t * w, 256, 256, 16)?, &p)?;
    Ok(out)
}
