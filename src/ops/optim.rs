//! AdamW on F32 parameters, in place, with torch's global-norm gradient
//! clipping folded in: per parameter, one pass to add the gradient's squares
//! to the global sum, then (after every gradient has been summed) one pass
//! for the moments, which reads the clip factor on the device, and one for
//! the parameter. Composed of candle ops a step is a dozen launches and a
//! host synchronization per parameter; here it is three launches and none.
//! kernels/optim.cu on CUDA, the same loops on the CPU.

use candle_core::{bail, CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Result, Tensor};

/// The hyper-parameters of one AdamW step (torch.optim.AdamW's, plus the
/// clipping norm of `clip_grad_norm_`, 0 for none).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment (torch: 0.9).
    pub beta1: f64,
    /// Decay of the second moment (torch: 0.999).
    pub beta2: f64,
    /// Added to the denominator (torch: 1e-8).
    pub eps: f64,
    /// Decoupled weight decay (0 for biases and norms, by convention).
    pub weight_decay: f64,
    /// Clip the global gradient norm to this; 0 for no clipping.
    pub max_grad_norm: f64,
    /// The step number, from 1 (the moments' bias correction).
    pub t: usize,
}

fn check_f32(arg: &str, t: &Tensor, n: usize) -> Result<()> {
    if t.dtype() != DType::F32 || t.elem_count() != n || !t.is_contiguous() {
        bail!("{arg}: expected a contiguous F32 tensor of {n} elements, got {:?} {:?}", t.dtype(), t.dims())
    }
    Ok(())
}

/// Adds `Σ g²` to `sum_sq` (an F32 tensor of one element), in place.
pub fn adamw_sum_sq(sum_sq: &Tensor, g: &Tensor) -> Result<()> {
    check_f32("sum_sq", sum_sq, 1)?;
    check_f32("g", g, g.elem_count())?;
    crate::layout::check_device("g", g, sum_sq.device())?;
    sum_sq.inplace_op2(g, &SumSq)
}

/// One AdamW step of the parameter `p` (F32, contiguous) from its gradient
/// `g` (F32, same element count), in place: the moments `mv` (F32 `[2, n]`,
/// first then second, zeros before the first step) are updated from the
/// gradient scaled by `min(1, max_grad_norm / (√sum_sq + 1e-6))`, where
/// `sum_sq` holds the squared global norm of every gradient of the step
/// (see [`adamw_sum_sq`]); then `p ← p (1 − lr·wd) − lr (m / c₁) / (√(v / c₂) + eps)`.
pub fn adamw_update(p: &Tensor, mv: &Tensor, g: &Tensor, sum_sq: &Tensor, s: &AdamWStep) -> Result<()> {
    let n = p.elem_count();
    check_f32("p", p, n)?;
    check_f32("g", g, n)?;
    check_f32("mv", mv, 2 * n)?;
    check_f32("sum_sq", sum_sq, 1)?;
    for (arg, t) in [("g", g), ("mv", mv), ("sum_sq", sum_sq)] {
        crate::layout::check_device(arg, t, p.device())?;
    }
    if s.t == 0 {
        bail!("step: t counts from 1")
    }
    let t = s.t as i32;
    let moments = Moments {
        b1: s.beta1 as f32,
        b2: s.beta2 as f32,
        one_b1: (1.0 - s.beta1) as f32,
        one_b2: (1.0 - s.beta2) as f32,
        max_norm: s.max_grad_norm as f32,
    };
    mv.inplace_op3(g, sum_sq, &moments)?;
    let update = Params {
        lr: s.lr as f32,
        decay: s.weight_decay as f32,
        c1: (1.0 - s.beta1.powi(t)) as f32,
        c2: (1.0 - s.beta2.powi(t)) as f32,
        eps: s.eps as f32,
    };
    p.inplace_op2(mv, &update)
}

struct SumSq;
struct Moments {
    b1: f32,
    b2: f32,
    /// `1 − b1`, `1 − b2` rounded once from F64.
    one_b1: f32,
    one_b2: f32,
    max_norm: f32,
}
struct Params {
    lr: f32,
    decay: f32,
    c1: f32,
    c2: f32,
    eps: f32,
}

fn slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => bail!("adamw: internal error, expected a contiguous F32 operand"),
    }
}

fn slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => bail!("adamw: internal error, expected a contiguous F32 operand"),
    }
}

/// `min(1, max_norm / (√sum_sq + 1e-6))`, or 1 without clipping (as `clip_grad_norm_`).
fn clip_factor(sum_sq: f32, max_norm: f32) -> f32 {
    if max_norm > 0.0 {
        (max_norm / (sum_sq.sqrt() + 1e-6)).min(1.0)
    } else {
        1.0
    }
}

impl InplaceOp2 for SumSq {
    fn name(&self) -> &'static str {
        "adamw_sum_sq"
    }

    fn cpu_fwd(&self, acc: &mut CpuStorage, la: &Layout, g: &CpuStorage, lg: &Layout) -> Result<()> {
        let s: f64 = slice(g, lg)?.iter().map(|&v| v as f64 * v as f64).sum();
        slice_mut(acc, la)?[0] += s as f32;
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        acc: &mut candle_core::CudaStorage,
        la: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<()> {
        crate::cuda::optim::sum_sq(acc, la, (g, lg))
    }
}

impl InplaceOp3 for Moments {
    fn name(&self) -> &'static str {
        "adamw_moments"
    }

    fn cpu_fwd(
        &self,
        mv: &mut CpuStorage,
        lmv: &Layout,
        g: &CpuStorage,
        lg: &Layout,
        s: &CpuStorage,
        ls: &Layout,
    ) -> Result<()> {
        let (g, c) = (slice(g, lg)?, clip_factor(slice(s, ls)?[0], self.max_norm));
        let (m, v) = slice_mut(mv, lmv)?.split_at_mut(g.len());
        for ((m, v), &gi) in m.iter_mut().zip(v).zip(g) {
            let gi = c * gi;
            *m = self.b1 * *m + self.one_b1 * gi;
            *v = self.b2 * *v + self.one_b2 * gi * gi;
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        mv: &mut candle_core::CudaStorage,
        lmv: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
        s: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> Result<()> {
        crate::cuda::optim::moments(
            mv,
            lmv,
            (g, lg),
            (s, ls),
            (self.b1, self.b2, self.one_b1, self.one_b2, self.max_norm),
        )
    }
}

impl InplaceOp2 for Params {
    fn name(&self) -> &'static str {
        "adamw_params"
    }

    fn cpu_fwd(&self, p: &mut CpuStorage, lp: &Layout, mv: &CpuStorage, lmv: &Layout) -> Result<()> {
        let p = slice_mut(p, lp)?;
        let (m, v) = slice(mv, lmv)?.split_at(p.len());
        for ((p, &m), &v) in p.iter_mut().zip(m).zip(v) {
            *p = *p * (1.0 - self.lr * self.decay) - self.lr * (m / self.c1) / ((v / self.c2).sqrt() + self.eps);
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &mut candle_core::CudaStorage,
        lp: &Layout,
        mv: &candle_core::CudaStorage,
        lmv: &Layout,
    ) -> Result<()> {
        crate::cuda::optim::params(p, lp, (mv, lmv), (self.lr, self.decay, self.c1, self.c2, self.eps))
    }
}
