//! Two layers of the transformer encoders as custom ops with closed-form
//! backwards: the attention softmax `softmax(scale · s + bias)` and the layer
//! norm. Composed of candle ops, each is a chain of F32 casts, broadcasts and
//! reductions (a dozen launches forward, twice that backward, each a pass
//! over `[B, H, L, L]` for the softmax); here each is one kernel forward
//! (kernels/encoder.cu on CUDA, the same loops on the CPU), computed in F32
//! and rounded once to the input's dtype.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

/// `softmax(scale · scores + bias)` over the last axis of `scores [B, H,
/// Lq, Lk]` (F16, BF16 or F32), computed in F32 and returned in `scores`'
/// dtype: the attention probabilities of an encoder. `bias` is an additive
/// F32 mask of shape `[B or 1, 1, Lq or 1, Lk]` (0 where a key is attended,
/// a large negative number such as `f32::MIN` where it is not). A row whose
/// every logit is `-inf` gets zeros (a composed softmax would give NaN).
/// The backward is `scale · p ⊙ (dp − Σ p ⊙ dp)`, one pass; `bias` gets no
/// gradient.
pub fn attention_softmax(scores: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, h, lq, lk) = match scores.dims() {
        &[b, h, lq, lk] => (b, h, lq, lk),
        d => bail!("scores: expected rank 4 [B, H, Lq, Lk], got {d:?}"),
    };
    if !matches!(scores.dtype(), DType::F16 | DType::BF16 | DType::F32) {
        bail!("scores: expected F16, BF16 or F32, got {:?}", scores.dtype())
    }
    let bd = bias.dims();
    let ok = bias.rank() == 4 && (bd[0] == b || bd[0] == 1) && bd[1] == 1 && (bd[2] == lq || bd[2] == 1) && bd[3] == lk;
    if bias.dtype() != DType::F32 || !ok {
        bail!("bias: expected F32 [{b} or 1, 1, {lq} or 1, {lk}], got {:?} {bd:?}", bias.dtype())
    }
    crate::layout::check_device("bias", bias, scores.device())?;
    if scores.elem_count() == 0 {
        return Ok(scores.clone());
    }
    let op = AttentionSoftmax {
        scale: scale as f32,
        heads: h,
        lq,
        lk,
        bias_b: if bd[0] == 1 { 0 } else { bd[2] * lk },
        bias_i: if bd[2] == 1 { 0 } else { lk },
    };
    scores.contiguous()?.apply_op2(&bias.contiguous()?, op)
}

/// Layer normalization over the last axis: `(x − mean) / √(var + eps) · w + b`
/// with the biased variance (as torch), computed in F32 and returned in
/// `x`'s dtype (F16, BF16 or F32); `w` and `b` are `[C]` and cast to F32.
/// Differentiable in `x`, `w` and `b`.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    let c = match x.dims().last() {
        Some(&c) => c,
        None => bail!("x: layer_norm needs at least one axis, got a scalar"),
    };
    if !matches!(x.dtype(), DType::F16 | DType::BF16 | DType::F32) {
        bail!("x: expected F16, BF16 or F32, got {:?}", x.dtype())
    }
    for (arg, t) in [("w", Some(w)), ("b", b)] {
        let Some(t) = t else { continue };
        if t.dims() != [c] || !t.dtype().is_float() {
            bail!("{arg}: expected a float [{c}], got {:?} {:?}", t.dtype(), t.dims())
        }
        crate::layout::check_device(arg, t, x.device())?;
    }
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    let (x, w) = (x.contiguous()?, w.to_dtype(DType::F32)?.contiguous()?);
    // Without a bias, a zero one: its gradient goes nowhere.
    let b = match b {
        Some(b) => b.to_dtype(DType::F32)?.contiguous()?,
        None => Tensor::zeros(c, DType::F32, x.device())?,
    };
    x.apply_op3(&w, &b, LayerNorm { eps: eps as f32 })
}

#[derive(Clone, Copy)]
struct AttentionSoftmax {
    scale: f32,
    heads: usize,
    lq: usize,
    lk: usize,
    /// Bias offsets of a batch and of a query row (0: broadcast).
    bias_b: usize,
    bias_i: usize,
}

/// `(p, dp) → ds`, the backward of [`AttentionSoftmax`].
struct AttentionSoftmaxBwd {
    scale: f32,
    lk: usize,
}

#[derive(Clone, Copy)]
struct LayerNorm {
    eps: f32,
}

/// `(x, w, dy) → dx`.
struct LayerNormBwdX {
    eps: f32,
}

/// `(x, dy) → [2, C]` F32: the gradients of the weight and of the bias.
struct LayerNormBwdWb {
    eps: f32,
}

fn range(l: &Layout) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("encoder ops: internal error, operand is not contiguous"),
    }
}

/// A float operand's elements as F32.
fn f32s(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    let (a, b) = range(l)?;
    Ok(match s {
        CpuStorage::F16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::BF16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::F32(v) => v[a..b].to_vec(),
        s => bail!("encoder ops: expected F16, BF16 or F32, got {:?}", s.dtype()),
    })
}

/// F32 values rounded once to `dt`.
fn store(v: Vec<f32>, dt: DType) -> CpuStorage {
    match dt {
        DType::F16 => CpuStorage::F16(v.into_iter().map(f16::from_f32).collect()),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect()),
        _ => CpuStorage::F32(v),
    }
}

impl AttentionSoftmax {
    fn cpu(&self, s: &[f32], bias: &[f32]) -> Vec<f32> {
        let mut p = vec![0f32; s.len()];
        for (r, (sr, pr)) in s.chunks(self.lk).zip(p.chunks_mut(self.lk)).enumerate() {
            let br = &bias[(r / (self.heads * self.lq)) * self.bias_b + (r % self.lq) * self.bias_i..];
            let x: Vec<f32> = sr.iter().zip(br).map(|(&v, &b)| self.scale * v + b).collect();
            let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let l: f32 = x.iter().map(|&v| (v - m).exp()).sum();
            for (o, &v) in pr.iter_mut().zip(&x) {
                *o = (v - m).exp() / l;
            }
        }
        p
    }
}

impl CustomOp2 for AttentionSoftmax {
    fn name(&self) -> &'static str {
        "attention_softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, ls: &Layout, b: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((store(self.cpu(&f32s(s, ls)?, &f32s(b, lb)?), s.dtype()), ls.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        ls: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let g = crate::cuda::encoder::SoftmaxShape {
            heads: self.heads,
            lq: self.lq,
            lk: self.lk,
            bias_b: self.bias_b,
            bias_i: self.bias_i,
        };
        Ok((crate::cuda::encoder::attn_softmax_fwd((s, ls), (b, lb), &g, self.scale)?, ls.shape().clone()))
    }

    fn bwd(&self, _s: &Tensor, _b: &Tensor, p: &Tensor, dp: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let op = AttentionSoftmaxBwd { scale: self.scale, lk: self.lk };
        Ok((Some(p.apply_op2_no_bwd(&dp.contiguous()?, &op)?), None))
    }
}

impl CustomOp2 for AttentionSoftmaxBwd {
    fn name(&self) -> &'static str {
        "attention_softmax_bwd"
    }

    fn cpu_fwd(&self, p: &CpuStorage, lp: &Layout, g: &CpuStorage, lg: &Layout) -> Result<(CpuStorage, Shape)> {
        let (p32, g32) = (f32s(p, lp)?, f32s(g, lg)?);
        let mut ds = vec![0f32; p32.len()];
        for ((pr, gr), dr) in p32.chunks(self.lk).zip(g32.chunks(self.lk)).zip(ds.chunks_mut(self.lk)) {
            let dot: f32 = pr.iter().zip(gr).map(|(a, b)| a * b).sum();
            for ((o, &a), &b) in dr.iter_mut().zip(pr).zip(gr) {
                *o = self.scale * a * (b - dot);
            }
        }
        Ok((store(ds, p.dtype()), lp.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &candle_core::CudaStorage,
        lp: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        if p.dtype() != g.dtype() {
            bail!("attention_softmax: internal error, gradient {:?} for {:?} probabilities", g.dtype(), p.dtype())
        }
        Ok((crate::cuda::encoder::attn_softmax_bwd((p, lp), (g, lg), self.lk, self.scale)?, lp.shape().clone()))
    }
}

/// Mean and `1/√(var + eps)` of each row of `c`.
fn row_stats(x: &[f32], c: usize, eps: f32) -> Vec<(f32, f32)> {
    x.chunks(c)
        .map(|r| {
            let mean = r.iter().sum::<f32>() / c as f32;
            let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / c as f32;
            (mean, 1.0 / (var + eps).sqrt())
        })
        .collect()
}

impl LayerNorm {
    fn cpu(&self, x: &CpuStorage, lx: &Layout, w: &[f32], b: &[f32]) -> Result<CpuStorage> {
        let x32 = f32s(x, lx)?;
        let c = w.len();
        let mut y = Vec::with_capacity(x32.len());
        for (r, (mean, rstd)) in x32.chunks(c).zip(row_stats(&x32, c, self.eps)) {
            for (j, &v) in r.iter().enumerate() {
                y.push((v - mean) * rstd * w[j] + b[j]);
            }
        }
        Ok(store(y, x.dtype()))
    }

    fn backward(&self, x: &Tensor, w: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let dy = dy.contiguous()?;
        let dx = x.apply_op3_no_bwd(w, &dy, &LayerNormBwdX { eps: self.eps })?;
        let wb = x.apply_op2_no_bwd(&dy, &LayerNormBwdWb { eps: self.eps })?;
        Ok((dx, wb.get(0)?, wb.get(1)?))
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer_norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((self.cpu(x, lx, &f32s(w, lw)?, &f32s(b, lb)?)?, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::cuda::encoder::layer_norm_fwd((x, lx), (w, lw), Some((b, lb)), self.eps)?, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = self.backward(x, w, dy)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

impl CustomOp3 for LayerNormBwdX {
    fn name(&self) -> &'static str {
        "layer_norm_bwd_x"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x32, w32, g32) = (f32s(x, lx)?, f32s(w, lw)?, f32s(g, lg)?);
        let c = w32.len();
        let mut dx = Vec::with_capacity(x32.len());
        for ((xr, gr), (mean, rstd)) in x32.chunks(c).zip(g32.chunks(c)).zip(row_stats(&x32, c, self.eps)) {
            let xh: Vec<f32> = xr.iter().map(|v| (v - mean) * rstd).collect();
            let gw: Vec<f32> = gr.iter().zip(&w32).map(|(a, b)| a * b).collect();
            let sg = gw.iter().sum::<f32>() / c as f32;
            let sgx = gw.iter().zip(&xh).map(|(a, b)| a * b).sum::<f32>() / c as f32;
            dx.extend(gw.iter().zip(&xh).map(|(g, h)| rstd * (g - sg - h * sgx)));
        }
        Ok((store(dx, x.dtype()), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::cuda::encoder::layer_norm_bwd_x((x, lx), (w, lw), (g, lg), self.eps)?, lx.shape().clone()))
    }
}

impl CustomOp2 for LayerNormBwdWb {
    fn name(&self) -> &'static str {
        "layer_norm_bwd_wb"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout, g: &CpuStorage, lg: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x32, g32) = (f32s(x, lx)?, f32s(g, lg)?);
        let c = *lx.dims().last().unwrap_or(&1);
        let mut wb = vec![0f32; 2 * c];
        for ((xr, gr), (mean, rstd)) in x32.chunks(c).zip(g32.chunks(c)).zip(row_stats(&x32, c, self.eps)) {
            for j in 0..c {
                wb[j] += gr[j] * (xr[j] - mean) * rstd;
                wb[c + j] += gr[j];
            }
        }
        Ok((CpuStorage::F32(wb), Shape::from((2, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let c = *lx.dims().last().unwrap_or(&1);
        Ok((crate::cuda::encoder::layer_norm_bwd_wb((x, lx), (g, lg), c, self.eps)?, Shape::from((2, c))))
    }
}
