//! Fused D-side projection head: hidden states → linear → (normalize) → MaxSim.

use super::dense::maxsim_with_argmax;
use super::maxsim::MaxSimOp;
use super::normalize::{l2_normalize, l2_normalize_bwd};
use super::rows::{add_bias, gather_rows};
use crate::layout::{check_device, check_float, check_mask, check_rank, Pairing, Problem, Seqs};
use crate::options::Backward;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use std::sync::Mutex;

/// `maxsim(q, normalize?(h_d · wᵀ + b), None, d_mask)`: `q [Nq, Lq, dout]`
/// (already projected), `h_d [Nd, Ld, dmodel]`, `w [dout, dmodel]`,
/// `b [dout]` → `[Nq, Nd]`. Gradients flow to q, h_d, w and b.
///
/// Inference on Hopper (compute capability 9.0), for F16/BF16, `dout ≤ 128`
/// and `dout`, `dmodel` multiples of 8, with the projected documents at
/// least as many rows as the queries (`Nd·Ld ≥ Nq·Lq`; fewer, and
/// materializing them costs less than the queries themselves), runs one
/// fused kernel: each block projects a 128-row chunk of a document once into
/// shared memory and scores every query against it, so the projected
/// `[Nd, Ld, dout]` never exists in device memory. Other inference composes
/// `matmul`, [`l2_normalize`] and MaxSim.
///
/// Training (any operand tracks a gradient) runs the forward with the argmax
/// and a closed-form backward: only the document rows that won some max are
/// gathered from `h_d` (all rows when the queries have more than half as many
/// rows as a document) and projected again, the normalization's Jacobian is
/// applied to their gradients, grad `w` / `b` / `q` come from small matmuls
/// and the MaxSim gradient kernels, and grad `h_d` is written once, in its
/// dtype (zero rows where nothing won).
pub fn maxsim_from_hidden(
    q: &Tensor,
    h_d: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    d_mask: Option<&Tensor>,
    normalize: bool,
) -> Result<Tensor> {
    let (nd, ld, dmodel, dout) = check(q, h_d, w, b, d_mask)?;
    let (nq, lq) = (q.dim(0)?, q.dim(1)?);
    let tracks = q.track_op() || h_d.track_op() || w.track_op() || b.is_some_and(|b| b.track_op());
    let nonempty = [nq, lq, nd, ld, dmodel, dout].iter().all(|&n| n > 0);
    if tracks && nonempty {
        let (hd, wd, bd) = (h_d.detach(), w.detach(), b.map(|b| b.detach()));
        let head = Head { h_d: &hd, w: &wd, b: bd.as_ref(), d_mask, normalize };
        let (scores, argmax) = head.forward(&q.detach())?;
        let wb = match b {
            Some(b) => Tensor::cat(&[w, &b.unsqueeze(1)?], 1)?,
            None => w.clone(),
        };
        let op = HeadGrad {
            want_h: h_d.track_op(),
            normalize,
            has_bias: b.is_some(),
            d_mask: d_mask.cloned(),
            scores: scores.flatten_all()?,
            argmax: Mutex::new(Some(argmax.reshape((nq * nd, lq))?)),
        };
        return q.contiguous()?.apply_op3(&h_d.contiguous()?, &wb.contiguous()?, op)?.reshape((nq, nd));
    }
    let op = InferenceHead {
        h_d: h_d.detach(),
        w: w.detach(),
        b: b.map(Tensor::detach),
        d_mask: d_mask.cloned(),
        normalize,
    };
    q.detach().contiguous()?.apply_op1_no_bwd(&op)?.reshape((nq, nd))
}

/// The inference forward of [`maxsim_from_hidden`], over `q [Nq, Lq, dout]`
/// (no gradient): the head's operands are held by the op. On CUDA the fused
/// kernel where [`crate::cuda::FusedHeadPlan`] applies; elsewhere the
/// projected documents are materialized and scored by the MaxSim op.
struct InferenceHead {
    h_d: Tensor,
    w: Tensor,
    b: Option<Tensor>,
    d_mask: Option<Tensor>,
    normalize: bool,
}

impl InferenceHead {
    fn head(&self) -> Head<'_> {
        Head { h_d: &self.h_d, w: &self.w, b: self.b.as_ref(), d_mask: self.d_mask.as_ref(), normalize: self.normalize }
    }

    /// MaxSim of `q` (dims `lq`) against the projected documents `d`.
    fn scores_op(&self, lq: &Layout, d: &Tensor) -> Result<MaxSimOp> {
        let (nq, lq_, dout) = lq.shape().dims3()?;
        let (nd, ld, _) = d.dims3()?;
        let problem = Problem {
            dim: dout,
            q: Seqs::Uniform { n: nq, len: lq_ },
            d: Seqs::Uniform { n: nd, len: ld },
            q_valid: None,
            d_valid: self.d_mask.as_ref().map(|m| m.flatten_all()).transpose()?,
            pairs: Pairing::Cross { nq, nd },
        };
        Ok(MaxSimOp::new(problem, Backward::Unified))
    }
}

impl CustomOp1 for InferenceHead {
    fn name(&self) -> &'static str {
        "maxsim_from_hidden"
    }

    fn cpu_fwd(&self, q: &CpuStorage, lq: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = self.head().project()?.contiguous()?;
        let op = self.scores_op(lq, &d)?;
        let (ds, dl) = d.storage_and_layout();
        match &*ds {
            candle_core::Storage::Cpu(ds) => op.cpu_fwd(q, lq, ds, dl),
            _ => bail!("maxsim_from_hidden: internal error, projected documents are not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, q: &candle_core::CudaStorage, lq: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let n_out = lq.shape().dims()[0] * self.h_d.dim(0)?;
        let plan = crate::cuda::FusedHeadPlan::new(&q.device, q.dtype(), lq.shape().dims3()?, self.h_d.dims3()?)?;
        if let Some(plan) = plan {
            let (b, m) = (self.b.as_ref(), self.d_mask.as_ref());
            let out = crate::cuda::from_hidden_fwd(&plan, (q, lq), &self.h_d, &self.w, b, m, self.normalize)?;
            return Ok((out, Shape::from(n_out)));
        }
        let d = self.head().project()?.contiguous()?;
        let op = self.scores_op(lq, &d)?;
        let (ds, dl) = d.storage_and_layout();
        match &*ds {
            candle_core::Storage::Cuda(ds) => op.cuda_fwd(q, lq, ds, dl),
            _ => bail!("maxsim_from_hidden: internal error, projected documents are not on the GPU"),
        }
    }
}

/// The document side of the head: `normalize?(h_d · wᵀ + b)`, masked by `d_mask`.
#[derive(Clone, Copy)]
struct Head<'a> {
    h_d: &'a Tensor,
    w: &'a Tensor,
    b: Option<&'a Tensor>,
    d_mask: Option<&'a Tensor>,
    normalize: bool,
}

impl Head<'_> {
    /// The projected documents `[Nd, Ld, dout]`.
    fn project(&self) -> Result<Tensor> {
        let (nd, ld, dmodel) = self.h_d.dims3()?;
        let mut proj = self.h_d.reshape((nd * ld, dmodel))?.matmul(&self.w.t()?)?;
        if let Some(b) = self.b {
            proj = add_bias(&proj, b)?;
        }
        let d = proj.reshape((nd, ld, self.w.dim(0)?))?;
        // `normalize` applies to the projected documents only (q is already projected).
        if self.normalize {
            l2_normalize(&d)
        } else {
            Ok(d)
        }
    }

    /// Training forward: scores `[Nq, Nd]` and argmax `[Nq, Nd, Lq]` I32 of
    /// detached operands. The projection is materialized here and dropped on
    /// return: the backward keeps only the argmax.
    fn forward(&self, q: &Tensor) -> Result<(Tensor, Tensor)> {
        maxsim_with_argmax(q, &self.project()?, None, self.d_mask)
    }
}

/// The autograd node of a training call: its forward hands out the scores
/// computed by [`Head::forward`]; its backward is the closed form.
struct HeadGrad {
    /// Whether `h_d` needs its gradient (not for a frozen encoder's states).
    want_h: bool,
    normalize: bool,
    has_bias: bool,
    d_mask: Option<Tensor>,
    /// `[Nq·Nd]` F32.
    scores: Tensor,
    /// `[Nq·Nd, Lq]` I32 (document-local winning row, -1: none); taken by
    /// the first backward, recomputed by any later one.
    argmax: Mutex<Option<Tensor>>,
}

impl CustomOp3 for HeadGrad {
    fn name(&self) -> &'static str {
        "maxsim_from_hidden"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let v = self.scores.to_vec1::<f32>()?;
        let n = v.len();
        Ok((CpuStorage::F32(v), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (st, l) = self.scores.storage_and_layout();
        match &*st {
            candle_core::Storage::Cuda(cs) => Ok((cs.try_clone(l)?, l.shape().clone())),
            _ => bail!("maxsim_from_hidden: internal error, scores are not on the GPU"),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        h_d: &Tensor,
        wb: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (q, h_d, wb) = (q.detach(), h_d.detach(), wb.detach());
        let dmodel = h_d.dim(2)?;
        // Contiguous copies (small): CUDA matmul wants unit-stride rows.
        let w = wb.narrow(1, 0, dmodel)?.contiguous()?;
        let b = if self.has_bias { Some(wb.narrow(1, dmodel, 1)?.squeeze(1)?.contiguous()?) } else { None };
        let argmax = self.argmax.lock().unwrap().take();
        let head = Head { h_d: &h_d, w: &w, b: b.as_ref(), d_mask: self.d_mask.as_ref(), normalize: self.normalize };
        let g = head_grads(&q, head, argmax, grad, self.want_h)?;
        let gwb = match g.b {
            Some(gb) => Tensor::cat(&[&g.w, &gb.unsqueeze(1)?], 1)?,
            None => g.w,
        };
        Ok((Some(g.q), g.h_d, Some(gwb)))
    }
}

/// Gradients of `Σ grad ⊙ scores` for [`maxsim_from_hidden`], in the inputs' dtype.
#[derive(Clone, Debug)]
pub struct FromHiddenGrads {
    /// `[Nq, Lq, dout]`
    pub q: Tensor,
    /// `[Nd, Ld, dmodel]` (zero rows where no query row's max was won)
    pub h_d: Tensor,
    /// `[dout, dmodel]`
    pub w: Tensor,
    /// `[dout]`, when a bias was given
    pub b: Option<Tensor>,
}

/// Scores of [`maxsim_from_hidden`] and the gradients of a loss of them,
/// outside candle's autograd (as [`crate::maxsim_value_and_grads`]): `dloss`
/// maps the scores `[Nq, Nd]` F32 to dLoss/dscores of the same shape.
///
/// The same closed-form backward as the autograd path, but every gradient is
/// allocated once: under candle 0.11's autograd grad `h_d` is filed as
/// `zeros_like(h_d) + grad`, two more `h_d`-sized passes (the largest cost of
/// a training step at reranking shapes).
pub fn maxsim_from_hidden_value_and_grads(
    q: &Tensor,
    h_d: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    d_mask: Option<&Tensor>,
    normalize: bool,
    dloss: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<(Tensor, FromHiddenGrads)> {
    let nd = check(q, h_d, w, b, d_mask)?.0;
    let (nq, lq) = (q.dim(0)?, q.dim(1)?);
    for (arg, t) in [("q", q), ("h_d", h_d), ("w", w)] {
        if t.elem_count() == 0 {
            bail!("{arg}: maxsim_from_hidden_value_and_grads needs non-empty operands, got shape {:?}", t.dims())
        }
    }
    let (q, h_d, w) = (q.detach().contiguous()?, h_d.detach().contiguous()?, w.detach().contiguous()?);
    let b = b.map(|b| b.detach().contiguous()).transpose()?;
    let head = Head { h_d: &h_d, w: &w, b: b.as_ref(), d_mask, normalize };
    let (scores, argmax) = head.forward(&q)?;
    let g = dloss(&scores)?;
    if g.dims() != scores.dims() {
        bail!("dloss: returned shape {:?}, expected the scores' {:?}", g.dims(), scores.dims())
    }
    let g = g.to_device(q.device())?.to_dtype(DType::F32)?;
    let argmax = Some(argmax.reshape((nq * nd, lq))?);
    let g = head_grads(&q, head, argmax, &g, true)?;
    let Some(h_d) = g.h_d else { bail!("maxsim_from_hidden: internal error, no gradient of h_d") };
    Ok((scores, FromHiddenGrads { q: g.q, h_d, w: g.w, b: g.b }))
}

/// The closed-form backward (see [`maxsim_from_hidden`]): detached,
/// contiguous operands; `argmax` `[Nq·Nd, Lq]` I32 from the forward, or
/// `None` to recompute it; `grad` `[Nq·Nd]` (or `[Nq, Nd]`) F32; grad `h_d`
/// only `if want_h`.
fn head_grads(q: &Tensor, head: Head, argmax: Option<Tensor>, grad: &Tensor, want_h: bool) -> Result<Grads> {
    let Head { h_d, w, b, normalize, .. } = head;
    let (nq, lq, dout) = q.dims3()?;
    let (nd, ld, dmodel) = h_d.dims3()?;
    let dt = q.dtype();
    let acc = if dt == DType::F64 { DType::F64 } else { DType::F32 };
    let argmax = match argmax {
        Some(a) => a,
        None => head.forward(q)?.1.reshape((nq * nd, lq))?,
    };
    // The rows that won: every row, or (few query rows) each document's
    // winners gathered into `cap` slots.
    let h2 = h_d.reshape((nd * ld, dmodel))?;
    let cap = ld.min(nq * lq);
    let (hs, argmax, gather, cap) = if 2 * cap <= ld {
        let win = Winners::new(&argmax, nq, nd, lq, ld, cap)?;
        let dev = q.device();
        let rows = Tensor::from_vec(win.rows, nd * cap, dev)?;
        let gather = Tensor::from_vec(win.gather, nd * ld, dev)?;
        (gather_rows(&h2, &rows)?, Tensor::from_vec(win.argmax, (nq * nd, lq), dev)?, Some(gather), cap)
    } else {
        (h2, argmax, None, ld)
    };
    // Their projection again (rounded to the dtype, as the forward did).
    let mut y = hs.matmul(&w.t()?)?;
    if let Some(b) = b {
        y = add_bias(&y, b)?;
    }
    let dn = if normalize { l2_normalize(&y)? } else { y.clone() };
    // MaxSim's gradients against those rows, from the (remapped) argmax.
    let problem = Problem {
        dim: dout,
        q: Seqs::Uniform { n: nq, len: lq },
        d: Seqs::Uniform { n: nd, len: cap },
        q_valid: None,
        d_valid: None,
        pairs: Pairing::Cross { nq, nd },
    };
    let op = MaxSimOp { save_argmax: true, ..MaxSimOp::new(problem, Backward::Auto.resolve(false, nq, nd, lq)) };
    *op.saved.lock().unwrap() = Some(argmax);
    let ds = dn.reshape((nd, cap, dout))?;
    let (gq, gds) = op.grads(q, &ds, &grad.flatten_all()?)?;
    // Through the normalization: (g − d·⟨d, g⟩) / |y| (one kernel).
    let gds = gds.reshape((nd * cap, dout))?;
    let gy = if normalize { l2_normalize_bwd(&y, &gds)? } else { gds };
    let gw = gy.t()?.matmul(&hs)?;
    // Row r of grad h_d from its slot, or a zero row where nothing won.
    let gh = if want_h {
        let ghs = gy.matmul(w)?;
        let gh = match gather {
            Some(g) => gather_rows(&ghs, &g)?,
            None => ghs,
        };
        Some(gh.reshape((nd, ld, dmodel))?)
    } else {
        None
    };
    let gb = b.map(|_| gy.to_dtype(acc)?.sum(0)?.to_dtype(dt)).transpose()?;
    Ok(Grads { q: gq, h_d: gh, w: gw, b: gb })
}

/// What [`head_grads`] returns: [`FromHiddenGrads`] with grad `h_d` optional.
struct Grads {
    q: Tensor,
    h_d: Option<Tensor>,
    w: Tensor,
    b: Option<Tensor>,
}

/// Each document's winning rows packed into `cap` slots (host side: the
/// argmax of few query rows is small).
struct Winners {
    /// `[Nd·cap]` row of `h_d` in each slot (unused slots: `Nd·Ld`, a zero row).
    rows: Vec<u32>,
    /// `[Nq·Nd·Lq]` the argmax as slot indices.
    argmax: Vec<i32>,
    /// `[Nd·Ld]` slot of each row of `h_d`, or `Nd·cap` (a zero row) where nothing won.
    gather: Vec<u32>,
}

impl Winners {
    fn new(argmax: &Tensor, nq: usize, nd: usize, lq: usize, ld: usize, cap: usize) -> Result<Self> {
        let mut am: Vec<i32> = argmax.flatten_all()?.to_vec1::<i32>()?;
        let none = (nd * cap) as u32;
        let mut rows = Vec::with_capacity(nd * cap);
        let mut gather = vec![none; nd * ld];
        for j in 0..nd {
            let mut used = 0usize;
            for i in 0..nq {
                for a in &mut am[(i * nd + j) * lq..(i * nd + j + 1) * lq] {
                    if *a < 0 || *a as usize >= ld {
                        *a = -1; // no winner (the forward never writes past ld)
                        continue;
                    }
                    let t = j * ld + *a as usize;
                    if gather[t] == none {
                        gather[t] = (j * cap + used) as u32;
                        rows.push(t as u32);
                        used += 1;
                    }
                    *a = (gather[t] as usize - j * cap) as i32;
                }
            }
            // A zero row, not a real one: padding rows may hold anything (NaN
            // included), and 0 · NaN would reach grad w through the matmul.
            rows.extend(std::iter::repeat_n((nd * ld) as u32, cap - used));
        }
        Ok(Self { rows, argmax: am, gather })
    }
}

/// Validates the arguments; returns `(Nd, Ld, dmodel, dout)`.
fn check(
    q: &Tensor,
    h_d: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    d_mask: Option<&Tensor>,
) -> Result<(usize, usize, usize, usize)> {
    check_rank("q", q, &[3], "rank 3 [Nq, Lq, dout]")?;
    check_rank("h_d", h_d, &[3], "rank 3 [Nd, Ld, dmodel]")?;
    check_rank("w", w, &[2], "rank 2 [dout, dmodel]")?;
    for (arg, t) in [("h_d", h_d), ("w", w)] {
        check_float(arg, t)?;
        check_device(arg, t, q.device())?;
        if t.dtype() != q.dtype() {
            bail!("{arg}: dtype {:?} differs from q's {:?}", t.dtype(), q.dtype())
        }
    }
    let (nd, ld, dmodel) = h_d.dims3()?;
    let (dout, wk) = w.dims2()?;
    if wk != dmodel {
        bail!("w: expected [dout, dmodel = {dmodel}], got {:?}", w.dims())
    }
    if q.dim(2)? != dout {
        bail!("q: dim {} does not match w's dout {dout}", q.dim(2)?)
    }
    if let Some(b) = b {
        check_device("b", b, q.device())?;
        if b.dims() != [dout] || b.dtype() != q.dtype() {
            bail!("b: expected {:?} [{dout}], got {:?} {:?}", q.dtype(), b.dtype(), b.dims())
        }
    }
    if let Some(m) = d_mask {
        check_mask("d_mask", m, &[nd, ld], q.device())?;
    }
    Ok((nd, ld, dmodel, dout))
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use candle_core::{DType, Device, Result};

    /// The fused kernel's plan exists exactly on compute capability 9.0 for
    /// the shapes of the CUDA cases in tests/ops/hidden.rs (partial chunks,
    /// dout 48 / 96 / 128, two query chunks per document), and nowhere for
    /// F32, a dout over 128 or fewer document rows than query rows.
    #[test]
    fn fused_head_runs_exactly_on_hopper() -> Result<()> {
        let Device::Cuda(dev) = Device::new_cuda(0)? else { unreachable!() };
        let hopper = crate::cuda::device_info(&dev)?.cc == 90;
        let plan = |dt, q, h| crate::cuda::FusedHeadPlan::new(&dev, dt, q, h).map(|p| p.is_some());
        for (q, h) in [
            ((3, 7, 128), (5, 300, 136)),
            ((2, 32, 96), (4, 128, 768)),
            ((5, 9, 48), (3, 70, 64)),
            ((300, 32, 128), (2, 4800, 64)),
            ((1, 32, 64), (9, 257, 256)),
        ] {
            for dt in [DType::BF16, DType::F16] {
                assert_eq!(plan(dt, q, h)?, hopper, "{dt:?} q {q:?} h {h:?}");
            }
            assert!(!plan(DType::F32, q, h)?, "F32 q {q:?} h {h:?}");
        }
        assert!(!plan(DType::BF16, (2, 32, 256), (9, 257, 256))?, "dout 256");
        assert!(!plan(DType::BF16, (64, 32, 128), (2, 64, 256))?, "Nd·Ld < Nq·Lq");
        Ok(())
    }
}
