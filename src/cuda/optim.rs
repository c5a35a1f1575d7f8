//! Launches of kernels/optim.cu: AdamW on F32 parameters, in place.

use super::{device_info, load_func, storage_ptr, OPTIM};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Layout, Result};

fn grid(dev: &CudaDevice, n: usize) -> Result<LaunchConfig> {
    let blocks = n.div_ceil(256).clamp(1, 8 * device_info(dev)?.sm_count.max(1) as usize) as u32;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })
}

/// `acc[0] += Σ g²` (`g` contiguous F32).
pub(crate) fn sum_sq(acc: &mut CudaStorage, la: &Layout, g: (&CudaStorage, &Layout)) -> Result<()> {
    let n = g.1.shape().elem_count();
    if n == 0 {
        return Ok(());
    }
    let dev = acc.device.clone();
    let func = load_func(&dev, "adamw_sum_sq", 0, "optim", &OPTIM)?;
    let (gp, ap, n_) = (storage_ptr(g.0, g.1)?, storage_ptr(acc, la)?, n as i64);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&gp);
    b.arg(&ap);
    b.arg(&n_);
    // SAFETY: (const float*, float*, long long) as in optim.cu; g holds n floats, acc one.
    unsafe { b.launch(grid(&dev, n)?) }.w()?;
    Ok(())
}

/// The moments `mv [2, n]` updated from the F32 gradient `g [n]`, clipped by `sum_sq`.
pub(crate) fn moments(
    mv: &mut CudaStorage,
    lmv: &Layout,
    g: (&CudaStorage, &Layout),
    sum_sq: (&CudaStorage, &Layout),
    (b1, b2, one_b1, one_b2, max_norm): (f32, f32, f32, f32, f32),
) -> Result<()> {
    let n = g.1.shape().elem_count();
    if n == 0 {
        return Ok(());
    }
    let dev = mv.device.clone();
    let func = load_func(&dev, "adamw_moments", 0, "optim", &OPTIM)?;
    let (mp, gp, sp, n_) = (storage_ptr(mv, lmv)?, storage_ptr(g.0, g.1)?, storage_ptr(sum_sq.0, sum_sq.1)?, n as i64);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&mp);
    b.arg(&gp);
    b.arg(&sp);
    b.arg(&n_);
    b.arg(&b1);
    b.arg(&b2);
    b.arg(&one_b1);
    b.arg(&one_b2);
    b.arg(&max_norm);
    // SAFETY: (float*, const float*, const float*, long long, float x5) as in
    // optim.cu; mv holds 2n floats, g n, sum_sq one.
    unsafe { b.launch(grid(&dev, n)?) }.w()?;
    Ok(())
}

/// The parameters `p [n]` F32 stepped from the moments `mv [2, n]`.
pub(crate) fn params(
    p: &mut CudaStorage,
    lp: &Layout,
    mv: (&CudaStorage, &Layout),
    (lr, decay, c1, c2, eps): (f32, f32, f32, f32, f32),
) -> Result<()> {
    let n = lp.shape().elem_count();
    if n == 0 {
        return Ok(());
    }
    let dev = p.device.clone();
    let func = load_func(&dev, "adamw_params", 0, "optim", &OPTIM)?;
    let (pp, mp, n_) = (storage_ptr(p, lp)?, storage_ptr(mv.0, mv.1)?, n as i64);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&pp);
    b.arg(&mp);
    b.arg(&n_);
    b.arg(&lr);
    b.arg(&decay);
    b.arg(&c1);
    b.arg(&c2);
    b.arg(&eps);
    // SAFETY: (float*, const float*, long long, float x5) as in optim.cu; p holds n floats, mv 2n.
    unsafe { b.launch(grid(&dev, n)?) }.w()?;
    Ok(())
}
