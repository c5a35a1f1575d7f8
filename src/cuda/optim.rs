//! Launches of kernels/optim.cu: AdamW on F32 parameters, in place.

use super::launch::{grid_stride, kernel, kernel_params, launch, Module};
use super::memory::storage_ptr;
use candle_core::{CudaStorage, Layout, Result};

/// Mirror of `AdamWParams` in kernels/optim.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AdamWParams {
    p: u64,
    mv: u64,
    g: u64,
    sum_sq: u64,
    n: i64,
    b1: f32,
    b2: f32,
    one_b1: f32,
    one_b2: f32,
    max_norm: f32,
    lr: f32,
    decay: f32,
    c1: f32,
    c2: f32,
    eps: f32,
}
kernel_params!(AdamWParams);

/// Launches `name` over `n` elements, a thread each.
fn run(dev: &candle_core::CudaDevice, name: &str, p: &AdamWParams) -> Result<()> {
    if p.n == 0 {
        return Ok(());
    }
    let func = kernel(dev, Module::Optim, name, 0)?;
    launch(dev, &func, grid_stride(dev, p.n as usize, 256, 256, 8)?, p)
}

/// `acc[0] += Σ g²` (`g` contiguous F32).
pub(crate) fn sum_sq(acc: &mut CudaStorage, la: &Layout, g: (&CudaStorage, &Layout)) -> Result<()> {
    let n = g.1.shape().elem_count() as i64;
    let p = AdamWParams { g: storage_ptr(g.0, g.1)?, sum_sq: storage_ptr(acc, la)?, n, ..Default::default() };
    run(&acc.device.clone(), "adamw_sum_sq", &p)
}

/// The moments `mv [2, n]` updated from the F32 gradient `g [n]`, clipped by `sum_sq`.
pub(crate) fn moments(
    mv: &mut CudaStorage,
    lmv: &Layout,
    g: (&CudaStorage, &Layout),
    sum_sq: (&CudaStorage, &Layout),
    (b1, b2, one_b1, one_b2, max_norm): (f32, f32, f32, f32, f32),
) -> Result<()> {
    let p = AdamWParams {
        mv: storage_ptr(mv, lmv)?,
        g: storage_ptr(g.0, g.1)?,
        sum_sq: storage_ptr(sum_sq.0, sum_sq.1)?,
        n: g.1.shape().elem_count() as i64,
        b1,
        b2,
        one_b1,
        one_b2,
        max_norm,
        ..Default::default()
    };
    run(&mv.device.clone(), "adamw_moments", &p)
}

/// The parameters `p [n]` F32 stepped from the moments `mv [2, n]`.
pub(crate) fn params(
    p: &mut CudaStorage,
    lp: &Layout,
    mv: (&CudaStorage, &Layout),
    (lr, decay, c1, c2, eps): (f32, f32, f32, f32, f32),
) -> Result<()> {
    let a = AdamWParams {
        p: storage_ptr(p, lp)?,
        mv: storage_ptr(mv.0, mv.1)?,
        n: lp.shape().elem_count() as i64,
        lr,
        decay,
        c1,
        c2,
        eps,
        ..Default::default()
    };
    run(&p.device.clone(), "adamw_params", &a)
}
