//! Fused D-side projection head: hidden states → linear → (normalize) → MaxSim.

use super::dense::maxsim_with;
use super::l2_normalize;
use crate::layout::{check_device, check_float, check_mask, check_rank};
use crate::MaxSimOptions;
use candle_core::{bail, Result, Tensor};

/// `maxsim(q, normalize?(h_d · wᵀ + b), None, d_mask)`: `q [Nq, Lq, dout]`
/// (already projected), `h_d [Nd, Ld, dmodel]`, `w [dout, dmodel]`,
/// `b [dout]` → `[Nq, Nd]`. Gradients flow to q, h_d, w and b.
///
/// On Hopper (compute capability 9.0), for F16/BF16, `dout ≤ 128` and
/// `dout`, `dmodel` multiples of 8, inference (no operand tracks a gradient)
/// runs one fused kernel: each block projects a 128-row chunk of a document
/// once into shared memory and scores every query against it, so the
/// projected `[Nd, Ld, dout]` never exists in device memory. Elsewhere, and
/// for training, it composes `matmul`, [`l2_normalize`] and MaxSim (whose
/// backward is this crate's fused gradient kernels).
pub fn maxsim_from_hidden(
    q: &Tensor,
    h_d: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    d_mask: Option<&Tensor>,
    normalize: bool,
) -> Result<Tensor> {
    let (nd, ld, dmodel, dout) = check(q, h_d, w, b, d_mask)?;
    let tracks = q.track_op() || h_d.track_op() || w.track_op() || b.is_some_and(|b| b.track_op());
    #[cfg(feature = "cuda")]
    if !tracks {
        if let Some(s) = crate::cuda::from_hidden_fwd(q, h_d, w, b, d_mask, normalize)? {
            return Ok(s);
        }
    }
    let _ = tracks;
    let mut proj = h_d.reshape((nd * ld, dmodel))?.matmul(&w.t()?)?;
    if let Some(b) = b {
        proj = proj.broadcast_add(b)?;
    }
    let d = proj.reshape((nd, ld, dout))?;
    // `normalize` applies to the projected documents only (q is already projected).
    let d = if normalize { l2_normalize(&d)? } else { d };
    maxsim_with(q, &d, None, d_mask, &MaxSimOptions::default())
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
