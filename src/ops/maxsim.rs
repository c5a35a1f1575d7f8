//! The one custom op every dense and packed entry point lowers to:
//! Q and D as packed rows (`[Tq, dim]`, `[Td, dim]`, or any contiguous tensor
//! whose last axis is dim: the padded layouts pass theirs unreshaped), one F32 score per pair out,
//! with a closed-form backward from the argmax saved by the forward.

use crate::cpu::storage::{f32s, slice};
use crate::cpu::{self, HostProblem};
use crate::layout::Problem;
use crate::options::Backward;
use candle_core::{backend::BackendStorage, bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use std::sync::Mutex;

pub(crate) struct MaxSimOp {
    pub problem: Problem,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub backward: Backward,
    /// Whether the forward should keep the argmax for the backward.
    pub save_argmax: bool,
    /// The argmax goes to the caller (always I32); for the backward alone
    /// the CUDA forward may keep it as I16.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub public_argmax: bool,
    /// `[n_pairs, max_lq]` I32 (CUDA: possibly I16) argmax kept by the forward (document-local
    /// token index, -1 = no winner). Only filled when a gradient is needed.
    pub saved: Mutex<Option<Tensor>>,
}

impl MaxSimOp {
    pub fn new(problem: Problem, backward: Backward) -> Self {
        Self { problem, backward, save_argmax: false, public_argmax: false, saved: Mutex::new(None) }
    }

    /// Runs the op on packed `q` / `d`, with autograd when either tracks a gradient.
    pub fn apply(self, q: &Tensor, d: &Tensor) -> Result<Tensor> {
        let q = q.contiguous()?;
        let d = d.contiguous()?;
        if q.track_op() || d.track_op() {
            q.apply_op2(&d, MaxSimOp { save_argmax: true, ..self })
        } else {
            q.apply_op2_no_bwd(&d, &self)
        }
    }

    /// Forward without autograd that also returns the argmax `[n_pairs, max_lq]` I32.
    pub fn run_with_argmax(self, q: &Tensor, d: &Tensor) -> Result<(Tensor, Tensor)> {
        let op = MaxSimOp { save_argmax: true, public_argmax: true, ..self };
        let scores = q.contiguous()?.apply_op2_no_bwd(&d.contiguous()?, &op)?;
        let argmax = op.saved.lock().unwrap().take();
        match argmax {
            Some(a) => Ok((scores, a)),
            None => bail!("maxsim: internal error, the forward kept no argmax"),
        }
    }

    fn host_flags(t: &Option<Tensor>) -> Result<Option<Vec<u8>>> {
        t.as_ref().map(|t| t.to_vec1::<u8>()).transpose()
    }

    /// Argmax for the backward: the saved one, or recomputed on the operands' device.
    fn argmax(&self, q: &Tensor, d: &Tensor) -> Result<Tensor> {
        // Taken, not cloned: freed when this backward is done, before candle
        // accumulates the gradients; a second backward recomputes it.
        if let Some(a) = self.saved.lock().unwrap().take() {
            return Ok(a);
        }
        #[cfg(feature = "cuda")]
        if q.device().is_cuda() {
            return crate::cuda::maxsim_argmax(&self.problem, q, d);
        }
        let (_, am) = self.cpu_run(q, d, true)?;
        Tensor::from_vec(am.unwrap(), (self.problem.n_out(), self.problem.q.max_len()), q.device())
    }

    fn cpu_run(&self, q: &Tensor, d: &Tensor, want_argmax: bool) -> Result<(Vec<f32>, Option<Vec<i32>>)> {
        let qv = Self::host_flags(&self.problem.q_valid)?;
        let dv = Self::host_flags(&self.problem.d_valid)?;
        let hp = HostProblem::new(&self.problem, qv.as_deref(), dv.as_deref());
        if q.dtype() == DType::BF16 {
            let (qb, db) = (q.flatten_all()?.to_vec1::<half::bf16>()?, d.flatten_all()?.to_vec1::<half::bf16>()?);
            if let Some(r) = cpu::forward_bf16(&hp, &qb, &db, want_argmax) {
                return Ok(r);
            }
        }
        Ok(match q.dtype() {
            DType::F64 => {
                cpu::forward(&hp, &q.flatten_all()?.to_vec1::<f64>()?, &d.flatten_all()?.to_vec1::<f64>()?, want_argmax)
            }
            _ => cpu::forward(&hp, &to_f32_vec(q)?, &to_f32_vec(d)?, want_argmax),
        })
    }
}

fn to_f32_vec(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()
}

impl CustomOp2 for MaxSimOp {
    fn name(&self) -> &'static str {
        "maxsim"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let qv = Self::host_flags(&self.problem.q_valid)?;
        let dv = Self::host_flags(&self.problem.d_valid)?;
        let hp = HostProblem::new(&self.problem, qv.as_deref(), dv.as_deref());
        let bf16 = match (s1, s2, l1.contiguous_offsets(), l2.contiguous_offsets()) {
            (CpuStorage::BF16(q), CpuStorage::BF16(d), Some((a, b)), Some((c, e))) => {
                cpu::forward_bf16(&hp, &q[a..b], &d[c..e], self.save_argmax)
            }
            _ => None,
        };
        let (scores, am) = match (bf16, s1.dtype()) {
            (Some(r), _) => r,
            (None, DType::F64) => {
                cpu::forward(&hp, slice::<f64>("q", s1, l1)?, slice::<f64>("d", s2, l2)?, self.save_argmax)
            }
            (None, _) => cpu::forward(&hp, &f32s("q", s1, l1)?, &f32s("d", s2, l2)?, self.save_argmax),
        };
        if let Some(am) = am {
            let n = self.problem.n_out();
            let t = Tensor::from_vec(am, (n, self.problem.q.max_len()), &candle_core::Device::Cpu)?;
            *self.saved.lock().unwrap() = Some(t);
        }
        let n = scores.len();
        Ok((CpuStorage::F32(scores), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::Variant;
        let v = match (self.save_argmax, self.public_argmax) {
            (false, _) => Variant::Nograd,
            (true, true) => Variant::Argmax,
            (true, false) => Variant::ArgmaxCompact,
        };
        let (scores, am) = crate::cuda::maxsim_fwd(&self.problem, s1, l1, s2, l2, v)?;
        if let Some(am) = am {
            *self.saved.lock().unwrap() = Some(am);
        }
        let n = self.problem.n_out();
        Ok((scores, Shape::from(n)))
    }

    fn bwd(&self, q: &Tensor, d: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (gq, gd) = self.grads(q, d, grad)?;
        Ok((Some(gq), Some(gd)))
    }
}

impl MaxSimOp {
    /// `(grad_q, grad_d)` of `Σ grad ⊙ scores` (`grad` `[n_pairs]`), from the
    /// saved argmax (or a recomputed one); `q`, `d` contiguous, as the forward saw them.
    pub fn grads(&self, q: &Tensor, d: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
        let argmax = self.argmax(q, d)?;
        #[cfg(feature = "cuda")]
        if q.device().is_cuda() {
            return crate::cuda::maxsim_bwd(&self.problem, self.backward, q, d, &argmax, grad);
        }
        let qv = Self::host_flags(&self.problem.q_valid)?;
        let dv = Self::host_flags(&self.problem.d_valid)?;
        let hp = HostProblem::new(&self.problem, qv.as_deref(), dv.as_deref());
        let am: Vec<i32> = argmax.flatten_all()?.to_vec1()?;
        let g = to_f32_vec(grad)?;
        let dev = q.device();
        let (gq, gd) = match q.dtype() {
            DType::F64 => {
                let (gq, gd) = cpu::backward(
                    &hp,
                    &q.flatten_all()?.to_vec1::<f64>()?,
                    &d.flatten_all()?.to_vec1::<f64>()?,
                    &am,
                    &g,
                );
                (Tensor::from_vec(gq, q.shape(), dev)?, Tensor::from_vec(gd, d.shape(), dev)?)
            }
            dt => {
                let (gq, gd) = cpu::backward(&hp, &to_f32_vec(q)?, &to_f32_vec(d)?, &am, &g);
                (
                    Tensor::from_vec(gq, q.shape(), dev)?.to_dtype(dt)?,
                    Tensor::from_vec(gd, d.shape(), dev)?.to_dtype(dt)?,
                )
            }
        };
        Ok((gq, gd))
    }
}
