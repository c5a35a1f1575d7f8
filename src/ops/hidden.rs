//! Fused D-side projection head: hidden states → linear → (normalize) → MaxSim.

use super::core::MaxSimOp;
use super::dense::{maxsim_with, maxsim_with_argmax, resolve_backward};
use super::l2_normalize;
use crate::layout::{check_device, check_float, check_mask, check_rank, Pairing, Problem, Seqs};
use crate::{Backward, MaxSimOptions};
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
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
/// gathered from `h_d` (all rows when the queries have at least twice as many
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
    if tracks && nq * lq * nd * ld * dmodel * dout > 0 {
        let (scores, argmax) = head_forward(&q.detach(), &h_d.detach(), &w.detach(), b, d_mask, normalize)?;
        let wb = match b {
            Some(b) => Tensor::cat(&[w, &b.unsqueeze(1)?], 1)?,
            None => w.clone(),
        };
        let op = HeadGrad {
            normalize,
            has_bias: b.is_some(),
            d_mask: d_mask.cloned(),
            scores: scores.flatten_all()?,
            argmax: Mutex::new(Some(argmax.reshape((nq * nd, lq))?)),
        };
        return q.contiguous()?.apply_op3(&h_d.contiguous()?, &wb.contiguous()?, op)?.reshape((nq, nd));
    }
    #[cfg(feature = "cuda")]
    if !tracks && nd * ld >= nq * lq {
        if let Some(s) = crate::cuda::from_hidden_fwd(q, h_d, w, b, d_mask, normalize)? {
            return Ok(s);
        }
    }
    let d = project(h_d, w, b, normalize)?;
    maxsim_with(q, &d, None, d_mask, &MaxSimOptions::default())
}

/// `normalize?(h_d · wᵀ + b)` as `[Nd, Ld, dout]`.
fn project(h_d: &Tensor, w: &Tensor, b: Option<&Tensor>, normalize: bool) -> Result<Tensor> {
    let (nd, ld, dmodel) = h_d.dims3()?;
    let mut proj = h_d.reshape((nd * ld, dmodel))?.matmul(&w.t()?)?;
    if let Some(b) = b {
        proj = proj.broadcast_add(b)?;
    }
    let d = proj.reshape((nd, ld, w.dim(0)?))?;
    // `normalize` applies to the projected documents only (q is already projected).
    if normalize {
        l2_normalize(&d)
    } else {
        Ok(d)
    }
}

/// Training forward: scores `[Nq, Nd]` and argmax `[Nq, Nd, Lq]` I32 of
/// detached operands. The projection is materialized here and dropped on
/// return: the backward keeps only the argmax.
fn head_forward(
    q: &Tensor,
    h_d: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    d_mask: Option<&Tensor>,
    normalize: bool,
) -> Result<(Tensor, Tensor)> {
    let d = project(h_d, w, b.map(|b| b.detach()).as_ref(), normalize)?;
    maxsim_with_argmax(q, &d, None, d_mask)
}

/// The autograd node of a training call: its forward hands out the scores
/// computed by [`head_forward`]; its backward is the closed form.
struct HeadGrad {
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
        let (nq, lq, dout) = q.dims3()?;
        let (nd, ld, dmodel) = h_d.dims3()?;
        let dt = q.dtype();
        let acc = if dt == DType::F64 { DType::F64 } else { DType::F32 };
        let w = wb.narrow(1, 0, dmodel)?;
        let b = if self.has_bias { Some(wb.narrow(1, dmodel, 1)?.squeeze(1)?) } else { None };
        let argmax = match self.argmax.lock().unwrap().take() {
            Some(a) => a,
            None => head_forward(&q, &h_d, &w, b.as_ref(), self.d_mask.as_ref(), self.normalize)?
                .1
                .reshape((nq * nd, lq))?,
        };
        // The rows that won: every row, or (few query rows) each document's
        // winners gathered into `cap` slots.
        let h2 = h_d.reshape((nd * ld, dmodel))?;
        let cap = ld.min(nq * lq);
        let (hs, argmax, gather, cap) = if 2 * cap <= ld {
            let w = Winners::new(&argmax, nq, nd, lq, ld, cap)?;
            let dev = q.device();
            let rows = Tensor::from_vec(w.rows, nd * cap, dev)?;
            let gather = Tensor::from_vec(w.gather, nd * ld, dev)?;
            (h2.index_select(&rows, 0)?, Tensor::from_vec(w.argmax, (nq * nd, lq), dev)?, Some(gather), cap)
        } else {
            (h2, argmax, None, ld)
        };
        // Their projection again, normalized in `acc`.
        let mut y = hs.matmul(&w.t()?)?;
        if let Some(b) = &b {
            y = y.broadcast_add(b)?;
        }
        let y = y.to_dtype(acc)?;
        let (dn, norm) = if self.normalize {
            let n = y.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::INFINITY)?;
            (y.broadcast_div(&n)?, Some(n))
        } else {
            (y, None)
        };
        // MaxSim's gradients against those rows, from the (remapped) argmax.
        let problem = Problem {
            dim: dout,
            q: Seqs::Uniform { n: nq, len: lq },
            d: Seqs::Uniform { n: nd, len: cap },
            q_valid: None,
            d_valid: None,
            pairs: Pairing::Cross { nq, nd },
        };
        let op = MaxSimOp {
            save_argmax: true,
            ..MaxSimOp::new(problem, resolve_backward(Backward::Auto, false, nq, nd, lq))
        };
        *op.saved.lock().unwrap() = Some(argmax);
        let ds = dn.to_dtype(dt)?.reshape((nd, cap, dout))?;
        let (gq, gds) = op.grads(&q, &ds, &grad.flatten_all()?)?;
        // Through the normalization: (g − d·⟨d, g⟩) / |y|.
        let gd = gds.reshape((nd * cap, dout))?.to_dtype(acc)?;
        let gy = match &norm {
            Some(n) => (&gd - dn.broadcast_mul(&(&dn * &gd)?.sum_keepdim(1)?)?)?.broadcast_div(n)?,
            None => gd,
        };
        let gy_t = gy.to_dtype(dt)?;
        let gw = gy_t.t()?.matmul(&hs)?;
        let ghs = gy_t.matmul(&w)?;
        let gh = match gather {
            // Row r of grad h_d is gathered from its slot, or from the zero row past the last.
            Some(g) => Tensor::cat(&[&ghs, &ghs.narrow(0, 0, 1)?.zeros_like()?], 0)?.index_select(&g, 0)?,
            None => ghs,
        };
        let gwb = if self.has_bias { Tensor::cat(&[&gw, &gy.sum(0)?.to_dtype(dt)?.unsqueeze(1)?], 1)? } else { gw };
        Ok((Some(gq), Some(gh.reshape((nd, ld, dmodel))?), Some(gwb)))
    }
}

/// Each document's winning rows packed into `cap` slots (host side: the
/// argmax of few query rows is small).
struct Winners {
    /// `[Nd·cap]` row of `h_d` in each slot (unused slots: the document's first row).
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
            rows.extend(std::iter::repeat_n((j * ld) as u32, cap - used));
        }
        Ok(Self { rows, argmax: am, gather })
    }
}

/// The fused CUDA forward of [`maxsim_from_hidden`] alone: `Ok(None)` where
/// it does not apply (see there). For tests and benchmarks that must know
/// which path ran.
#[doc(hidden)]
pub fn maxsim_from_hidden_fused(
    q: &Tensor,
    h_d: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    d_mask: Option<&Tensor>,
    normalize: bool,
) -> Result<Option<Tensor>> {
    check(q, h_d, w, b, d_mask)?;
    #[cfg(feature = "cuda")]
    return crate::cuda::from_hidden_fwd(q, h_d, w, b, d_mask, normalize);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = normalize;
        Ok(None)
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
