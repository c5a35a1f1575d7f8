//! Layers of the transformer encoders as custom ops with closed-form
//! backwards: the attention softmax `softmax(scale · s + bias)`, the layer
//! norm and the rotary embeddings of a fused QKV projection. Composed of
//! candle ops, each is a chain of F32 casts, broadcasts and reductions (a
//! dozen launches forward, twice that backward, each a pass
//! over `[B, H, L, L]` for the softmax); here each is one kernel forward
//! (kernels/encoder.cu on CUDA, the same loops on the CPU), computed in F32
//! and rounded once to the input's dtype.

use crate::cpu::math::{exp_f32, max_f32, simd, sum_f32};
use crate::cpu::storage::{f32s, filled, store};
use crate::cpu::{gemm_into, Mat, OutPtr};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

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

/// Rotary position embeddings of the queries and keys of a fused QKV
/// projection, in the rotate-half convention of RoFormer / ModernBERT:
/// `qkv [T, 3·H·dh]` (F16, BF16 or F32; the q, k and v blocks of `heads`
/// heads of `dh` columns), `cos` and `sin` F32 `[T, dh/2]` (each row's
/// angles, one per frequency) → `[T, 3·H·dh]` in `qkv`'s dtype with each
/// head's halves of q and k rotated, `(x₁, x₂) → (x₁ cos − x₂ sin, x₂ cos +
/// x₁ sin)`, computed in F32 and rounded once, and v unchanged. One op each
/// way (the backward rotates back), where the composed rotation is ten
/// graph nodes per block; `cos` and `sin` get no gradient.
pub fn rotary_qk(qkv: &Tensor, cos: &Tensor, sin: &Tensor, heads: usize) -> Result<Tensor> {
    let (t, w) =
        qkv.dims2().map_err(|_| candle_core::Error::Msg(format!("qkv: expected [T, 3·H·dh], got {:?}", qkv.dims())))?;
    if !matches!(qkv.dtype(), DType::F16 | DType::BF16 | DType::F32) {
        bail!("qkv: expected F16, BF16 or F32, got {:?}", qkv.dtype())
    }
    if heads == 0 || w % (6 * heads) != 0 {
        bail!("heads: qkv's {w} columns are not 3 blocks of {heads} heads of an even head dim")
    }
    let half = w / (6 * heads);
    for (arg, x) in [("cos", cos), ("sin", sin)] {
        if x.dtype() != DType::F32 || x.dims() != [t, half] {
            bail!("{arg}: expected F32 [{t}, {half}] (rows, half the head dim), got {:?} {:?}", x.dtype(), x.dims())
        }
        crate::layout::check_device(arg, x, qkv.device())?;
    }
    qkv.contiguous()?.apply_op3(&cos.contiguous()?, &sin.contiguous()?, RotaryQk { heads, inverse: false })
}

/// The gradient of [`rotary_qk`]'s input from its output's `g`: the
/// rotation back (q and k by the opposite angles, v as it is).
pub(crate) fn rotary_qk_bwd(g: &Tensor, cos: &Tensor, sin: &Tensor, heads: usize) -> Result<Tensor> {
    g.contiguous()?.apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &RotaryQk { heads, inverse: true })
}

/// [`rotary_qk`] (or its inverse, the backward) as one op.
struct RotaryQk {
    heads: usize,
    inverse: bool,
}

impl CustomOp3 for RotaryQk {
    fn name(&self) -> &'static str {
        "rotary_qk"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        cos: &CpuStorage,
        lc: &Layout,
        sin: &CpuStorage,
        ls: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x32, cs, sn) = (f32s("qkv", x, lx)?, f32s("cos", cos, lc)?, f32s("sin", sin, ls)?);
        let w = lx.shape().dims2()?.1;
        let half = w / (6 * self.heads);
        let (dh, qk) = (2 * half, 2 * self.heads * 2 * half);
        let sign = if self.inverse { -1.0 } else { 1.0 };
        let mut out = vec![0f32; x32.len()];
        out.par_chunks_mut(w.max(1)).zip(x32.par_chunks(w.max(1))).enumerate().with_min_len(ROWS_PER_TASK).for_each(
            |(r, (o, xr))| {
                let (c_r, s_r) = (&cs[r * half..(r + 1) * half], &sn[r * half..(r + 1) * half]);
                for h in (0..qk).step_by(dh.max(1)) {
                    for f in 0..half {
                        let (x1, x2) = (xr[h + f], xr[h + half + f]);
                        let (c, s) = (c_r[f], sign * s_r[f]);
                        o[h + f] = x1 * c - x2 * s;
                        o[h + half + f] = x2 * c + x1 * s;
                    }
                }
                o[qk..].copy_from_slice(&xr[qk..]);
            },
        );
        Ok((store(out, x.dtype())?, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        cos: &candle_core::CudaStorage,
        lc: &Layout,
        sin: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::cuda::encoder::rotary_qk((x, lx), (cos, lc), (sin, ls), self.heads, self.inverse)?;
        Ok((out, lx.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let back = RotaryQk { heads: self.heads, inverse: !self.inverse };
        Ok((Some(g.contiguous()?.apply_op3_no_bwd(cos, sin, &back)?), None, None))
    }
}

/// Multi-head attention `softmax(scale · q_h k_hᵀ + bias) v_h` of every head
/// h, with the heads side by side in the last axis: `q [B, Lq, H·dh]`,
/// `k` and `v` `[B, Lk, H·dh]` (one dtype), `bias` as for
/// [`attention_softmax`] → `[B, Lq, H·dh]` (the layout the output
/// projection takes, no transposes). The same function as the composed
/// `matmul`, [`attention_softmax`], `matmul`, which runs on CUDA; on the
/// CPU one fused F32 task per (batch, head) on all cores (16-bit inputs
/// widened, the result rounded once; the scores of one head in a buffer of
/// its own, never a `[B, H, Lq, Lk]` tensor, no head-major copies), its
/// backward the closed form from the recomputed probabilities.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, heads: usize, scale: f64) -> Result<Tensor> {
    let (b, lq, hd) =
        q.dims3().map_err(|_| candle_core::Error::Msg(format!("q: expected [B, Lq, H·dh], got {:?}", q.dims())))?;
    if heads == 0 || hd % heads != 0 {
        bail!("heads: {heads} does not divide q's last axis {hd}")
    }
    for (arg, t) in [("k", k), ("v", v)] {
        if t.rank() != 3 || t.dim(0)? != b || t.dim(2)? != hd || t.dtype() != q.dtype() {
            bail!("{arg}: expected {:?} [{b}, Lk, {hd}] like q, got {:?} {:?}", q.dtype(), t.dtype(), t.dims())
        }
        crate::layout::check_device(arg, t, q.device())?;
    }
    if k.dim(1)? != v.dim(1)? {
        bail!("v: {} keys' values for {} keys", v.dim(1)?, k.dim(1)?)
    }
    let (lk, dh) = (k.dim(1)?, hd / heads);
    if q.device().is_cpu() && matches!(q.dtype(), DType::F16 | DType::BF16) && b * lq * lk > 0 {
        // No fast 16-bit matmul on candle's CPU: the fused F32 op, rounded once.
        let f = |t: &Tensor| t.to_dtype(DType::F32);
        return attention(&f(q)?, &f(k)?, &f(v)?, bias, heads, scale)?.to_dtype(q.dtype());
    }
    let fused = q.device().is_cpu() && q.dtype() == DType::F32;
    if !fused || b * lq * lk == 0 {
        let split = |t: &Tensor, l: usize| t.reshape((b, l, heads, dh))?.transpose(1, 2)?.contiguous();
        let (qh, kh, vh) = (split(q, lq)?, split(k, lk)?, split(v, lk)?);
        let p = attention_softmax(&qh.matmul(&kh.t()?.contiguous()?)?, bias, scale)?;
        return p.matmul(&vh)?.transpose(1, 2)?.reshape((b, lq, hd));
    }
    // The bias checks of attention_softmax, on its shape alone.
    let bd = bias.dims();
    let ok = bias.rank() == 4 && (bd[0] == b || bd[0] == 1) && bd[1] == 1 && (bd[2] == lq || bd[2] == 1) && bd[3] == lk;
    if bias.dtype() != DType::F32 || !ok {
        bail!("bias: expected F32 [{b} or 1, 1, {lq} or 1, {lk}], got {:?} {bd:?}", bias.dtype())
    }
    crate::layout::check_device("bias", bias, q.device())?;
    let softmax = AttentionSoftmax {
        scale: scale as f32,
        heads,
        lq,
        lk,
        bias_b: if bd[0] == 1 { 0 } else { bd[2] * lk },
        bias_i: if bd[2] == 1 { 0 } else { lk },
    };
    let op = CpuAttention { softmax, bias: bias.contiguous()?, batch: b };
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

/// [`attention`]'s fused CPU op: `(q, k, v) → out`, F32.
struct CpuAttention {
    softmax: AttentionSoftmax,
    bias: Tensor,
    batch: usize,
}

impl CustomOp3 for CpuAttention {
    fn name(&self) -> &'static str {
        "attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq_: &Layout,
        k: &CpuStorage,
        lk_: &Layout,
        v: &CpuStorage,
        lv_: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        use crate::cpu::storage::slice;
        let (q, k, v) = (slice::<f32>("q", q, lq_)?, slice::<f32>("k", k, lk_)?, slice::<f32>("v", v, lv_)?);
        let bias_t = self.bias.flatten_all()?;
        let bias_s = bias_t.storage_and_layout();
        let bias = crate::cpu::storage::tensor_slice::<f32>("bias", &bias_s.0, bias_s.1)?;
        let s = &self.softmax;
        let (b, h, lq, lk) = (self.batch, s.heads, s.lq, s.lk);
        let hd = lq_.dims()[2];
        let dh = hd / h;
        let fill = |out: &mut [std::mem::MaybeUninit<f32>]| {
            let dst = OutPtr(out.as_mut_ptr().cast());
            (0..b * h).into_par_iter().for_each_init(
                || vec![0f32; lq * lk],
                |scores, task| {
                    let (bi, hi) = (task / h, task % h);
                    let (qb, kb, vb) =
                        (&q[bi * lq * hd + hi * dh..], &k[bi * lk * hd + hi * dh..], &v[bi * lk * hd + hi * dh..]);
                    // SAFETY: row-major strided views within q, k, v and this task's block of out
                    // (rows of H·dh, columns hi·dh .. hi·dh + dh); sizes as the shapes say.
                    unsafe {
                        gemm_into(
                            lq,
                            lk,
                            dh,
                            scores.as_mut_ptr(),
                            lk,
                            Mat::rows(qb.as_ptr(), hd),
                            Mat::t(kb.as_ptr(), hd),
                        )
                    };
                    for (r, row) in scores.chunks_mut(lk).enumerate() {
                        let br = &bias[bi * s.bias_b + r * s.bias_i..][..lk];
                        softmax_row(row, br, s.scale);
                    }
                    let ob = dst.at(bi * lq * hd + hi * dh);
                    // SAFETY: as above; this task alone writes rows of its head's columns.
                    unsafe {
                        gemm_into(lq, dh, lk, ob, hd, Mat::rows(scores.as_ptr(), lk), Mat::rows(vb.as_ptr(), hd))
                    };
                },
            );
        };
        // SAFETY: the (batch, head) tasks cover every element of the output
        // once, and gemm_into writes all of its block.
        let out = unsafe { filled(b * lq * hd, fill) };
        Ok((CpuStorage::F32(out), Shape::from((b, lq, hd))))
    }

    /// With `P = softmax(scale · Q Kᵀ + bias)` recomputed per head:
    /// `dV = Pᵀ dO`, `dS = scale · P ⊙ (dO Vᵀ − rowsum(dO Vᵀ ⊙ P))`,
    /// `dQ = dS K`, `dK = dSᵀ Q`.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let s = &self.softmax;
        let (b, h, lq, lk) = (self.batch, s.heads, s.lq, s.lk);
        let hd = q.dim(2)?;
        let split = |t: &Tensor, l: usize| t.reshape((b, l, h, hd / h))?.transpose(1, 2)?.contiguous();
        let merge = |t: Tensor, l: usize| t.transpose(1, 2)?.reshape((b, l, hd));
        let (qh, kh, vh, go) = (split(q, lq)?, split(k, lk)?, split(v, lk)?, split(grad, lq)?);
        let p = qh.matmul(&kh.t()?.contiguous()?)?.apply_op2_no_bwd(&self.bias, s)?;
        let dv = p.t()?.matmul(&go)?;
        let dp = go.matmul(&vh.t()?.contiguous()?)?;
        let ds = p.apply_op2_no_bwd(&dp, &AttentionSoftmaxBwd { scale: s.scale, lk })?;
        let dq = ds.matmul(&kh)?;
        let dk = ds.t()?.matmul(&qh)?;
        Ok((Some(merge(dq, lq)?), Some(merge(dk, lk)?), Some(merge(dv, lk)?)))
    }
}

/// `softmax(scale · row + bias)` in place (a row of every `-inf` to zeros),
/// as [`AttentionSoftmax`] computes each row.
fn softmax_row(row: &mut [f32], bias: &[f32], scale: f32) {
    simd(
        #[inline(always)]
        || softmax_row_in(row, bias, scale),
    )
}

#[inline(always)]
fn softmax_row_in(row: &mut [f32], bias: &[f32], scale: f32) {
    for (o, &b) in row.iter_mut().zip(bias) {
        *o = scale * *o + b;
    }
    let m = max_f32(row);
    if m == f32::NEG_INFINITY {
        row.fill(0.0);
        return;
    }
    row.iter_mut().for_each(|o| *o = exp_f32(*o - m));
    let inv = 1.0 / sum_f32(row);
    row.iter_mut().for_each(|o| *o *= inv);
}

/// Layer normalization over the last axis: `(x − mean) / √(var + eps) · w + b`
/// with the biased variance (as torch), computed in F32 and returned in
/// `x`'s dtype (F16, BF16 or F32); `w` and `b` are `[C]` and cast to F32.
/// Differentiable in `x`, `w` and `b`.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    let c = norm_args(x, w, b)?;
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    let (w, b) = norm_f32(w, b, c)?;
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, LayerNorm { eps: eps as f32 })
}

/// The width C of the rows of a layer norm's `x` (F16, BF16 or F32), after
/// checking `w` and `b` (`[C]`, float, on x's device).
fn norm_args(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<usize> {
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
    Ok(c)
}

/// The weight in F32 and the bias in F32 (zeros without one: its gradient
/// goes nowhere), as the norm ops take them.
fn norm_f32(w: &Tensor, b: Option<&Tensor>, c: usize) -> Result<(Tensor, Tensor)> {
    let b = match b {
        Some(b) => b.to_dtype(DType::F32)?,
        None => Tensor::zeros(c, DType::F32, w.device())?,
    };
    Ok((w.to_dtype(DType::F32)?, b))
}

/// `layer_norm(x + res, w, b, eps)`, the residual connection and the norm
/// after it as one op: the sum is rounded to `x`'s dtype as a separate add
/// would round it, and is not kept (the backward's kernels add it again
/// as they read it). Composed, the sum is one more graph node: a pass each
/// way, a zero-filled gradient and an add, and `[.., C]` of memory kept.
/// `res` is like `x` (dtype, shape, device); both get the same gradient.
pub fn residual_layer_norm(x: &Tensor, res: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    if res.dims() != x.dims() || res.dtype() != x.dtype() {
        bail!("res: expected {:?} {:?} like x, got {:?} {:?}", x.dtype(), x.dims(), res.dtype(), res.dims())
    }
    crate::layout::check_device("res", res, x.device())?;
    let c = norm_args(x, w, b)?;
    if x.elem_count() == 0 {
        return x + res;
    }
    // The weight and the bias (or zeros) as one [2, C] F32 operand.
    let (w, b) = norm_f32(w, b, c)?;
    let wb = Tensor::stack(&[&w, &b], 0)?;
    x.contiguous()?.apply_op3(&res.contiguous()?, &wb, ResidualLayerNorm { eps: eps as f32 })
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
pub(crate) struct LayerNorm {
    pub(crate) eps: f32,
}

/// `(x, res, [w; b]) → layer_norm(x + res)`.
struct ResidualLayerNorm {
    eps: f32,
}

/// `(x, w, dy) → dx`, the norm's input being `x + res` with a residual.
struct LayerNormBwdX {
    eps: f32,
    res: Option<Tensor>,
}

/// `(x, dy) → [2, C]` F32: the gradients of the weight and of the bias.
struct LayerNormBwdWb {
    eps: f32,
    res: Option<Tensor>,
}

/// The rows a layer norm normalizes, in F32: `x`, or `x + res` rounded to
/// `x`'s dtype.
fn norm_rows<'a>(
    x: &'a CpuStorage,
    lx: &Layout,
    res: Option<(&CpuStorage, &Layout)>,
) -> Result<std::borrow::Cow<'a, [f32]>> {
    let xs = f32s("x", x, lx)?;
    let Some((r, lr)) = res else { return Ok(xs) };
    let rs = f32s("res", r, lr)?;
    if rs.len() != xs.len() || r.dtype() != x.dtype() {
        bail!("res: internal error, the residual differs from x in dtype or shape")
    }
    let sum = xs.iter().zip(rs.iter()).map(|(&a, &b)| a + b);
    Ok(std::borrow::Cow::Owned(match x.dtype() {
        DType::F16 => sum.map(|v| half::f16::from_f32(v).to_f32()).collect(),
        DType::BF16 => sum.map(|v| half::bf16::from_f32(v).to_f32()).collect(),
        _ => sum.collect(),
    }))
}

/// A backward op's residual (a CPU tensor, if any) as storage, applied to `f`.
fn with_cpu_res<R>(res: Option<&Tensor>, f: impl FnOnce(Option<(&CpuStorage, &Layout)>) -> Result<R>) -> Result<R> {
    let Some(res) = res else { return f(None) };
    let (r, lr) = res.storage_and_layout();
    let candle_core::Storage::Cpu(r) = &*r else { bail!("res: internal error, expected a CPU tensor") };
    f(Some((r, lr)))
}

/// A backward op's residual (a CUDA tensor, if any) as storage, applied to `f`.
#[cfg(feature = "cuda")]
fn with_cuda_res<R>(
    res: Option<&Tensor>,
    f: impl FnOnce(Option<(&candle_core::CudaStorage, &Layout)>) -> Result<R>,
) -> Result<R> {
    let Some(res) = res else { return f(None) };
    let (r, lr) = res.storage_and_layout();
    let candle_core::Storage::Cuda(r) = &*r else { bail!("res: internal error, expected a CUDA tensor") };
    f(Some((r, lr)))
}

/// Rows per rayon task of the row-wise CPU loops: enough work per task to
/// amortize its scheduling, few enough that every core gets rows.
const ROWS_PER_TASK: usize = 8;

impl AttentionSoftmax {
    /// Rows in parallel; each row's logits go to its output slot, then
    /// their exponentials in place (no allocation per row).
    fn cpu(&self, s: &[f32], bias: &[f32]) -> Vec<f32> {
        let lk = self.lk.max(1);
        let mut p = vec![0f32; s.len()];
        p.par_chunks_mut(lk).zip(s.par_chunks(lk)).enumerate().with_min_len(ROWS_PER_TASK).for_each(|(r, (pr, sr))| {
            let br = &bias[(r / (self.heads * self.lq)) * self.bias_b + (r % self.lq) * self.bias_i..];
            pr.copy_from_slice(sr);
            softmax_row(pr, br, self.scale);
        });
        p
    }
}

impl CustomOp2 for AttentionSoftmax {
    fn name(&self) -> &'static str {
        "attention_softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, ls: &Layout, b: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((store(self.cpu(&f32s("scores", s, ls)?, &f32s("bias", b, lb)?), s.dtype())?, ls.shape().clone()))
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
        let (p32, g32) = (f32s("p", p, lp)?, f32s("g", g, lg)?);
        let lk = self.lk.max(1);
        let mut ds = vec![0f32; p32.len()];
        let rows = ds.par_chunks_mut(lk).zip(p32.par_chunks(lk)).zip(g32.par_chunks(lk));
        rows.with_min_len(ROWS_PER_TASK).for_each(|((dr, pr), gr)| {
            let dot: f32 = pr.iter().zip(gr).map(|(a, b)| a * b).sum();
            for ((o, &a), &b) in dr.iter_mut().zip(pr).zip(gr) {
                *o = self.scale * a * (b - dot);
            }
        });
        Ok((store(ds, p.dtype())?, lp.shape().clone()))
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

/// Mean and `1/√(var + eps)` of a row.
fn row_stats(r: &[f32], eps: f32) -> (f32, f32) {
    let c = r.len().max(1) as f32;
    let mean = r.iter().sum::<f32>() / c;
    let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / c;
    (mean, 1.0 / (var + eps).sqrt())
}

impl LayerNorm {
    pub(crate) fn cpu(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        res: Option<(&CpuStorage, &Layout)>,
        w: &[f32],
        b: &[f32],
    ) -> Result<CpuStorage> {
        let x32 = norm_rows(x, lx, res)?;
        let c = w.len().max(1);
        // SAFETY: the rows cover y, and each row's loop writes all of it.
        let y = unsafe {
            filled(x32.len(), |y| {
                y.par_chunks_mut(c).zip(x32.par_chunks(c)).with_min_len(ROWS_PER_TASK).for_each(|(yr, r)| {
                    let (mean, rstd) = row_stats(r, self.eps);
                    for (j, (o, &v)) in yr.iter_mut().zip(r).enumerate() {
                        o.write((v - mean) * rstd * w[j] + b[j]);
                    }
                })
            })
        };
        store(y, x.dtype())
    }

    /// `dx` and the `[2, C]` gradient of the weight and the bias, for the
    /// norm of `x` (plus `res`) with the F32 weight `w`.
    pub(crate) fn backward(
        &self,
        x: &Tensor,
        res: Option<&Tensor>,
        w: &Tensor,
        dy: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (dy, res) = (dy.contiguous()?, res.map(|r| r.detach()));
        let dx = x.apply_op3_no_bwd(w, &dy, &LayerNormBwdX { eps: self.eps, res: res.clone() })?;
        let wb = x.apply_op2_no_bwd(&dy, &LayerNormBwdWb { eps: self.eps, res })?;
        Ok((dx, wb))
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
        Ok((self.cpu(x, lx, None, &f32s("w", w, lw)?, &f32s("b", b, lb)?)?, lx.shape().clone()))
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
        Ok((crate::cuda::encoder::layer_norm_fwd((x, lx), None, (w, lw), Some((b, lb)), self.eps)?, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, wb) = self.backward(x, None, w, dy)?;
        Ok((Some(dx), Some(wb.get(0)?), Some(wb.get(1)?)))
    }
}

impl CustomOp3 for ResidualLayerNorm {
    fn name(&self) -> &'static str {
        "residual_layer_norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        r: &CpuStorage,
        lr: &Layout,
        wb: &CpuStorage,
        lwb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let wb = f32s("wb", wb, lwb)?;
        let (w, b) = wb.split_at(wb.len() / 2);
        Ok((LayerNorm { eps: self.eps }.cpu(x, lx, Some((r, lr)), w, b)?, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        r: &candle_core::CudaStorage,
        lr: &Layout,
        wb: &candle_core::CudaStorage,
        lwb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let c = lwb.shape().elem_count() / 2;
        let (lw, lb) = (
            Layout::contiguous_with_offset(c, lwb.start_offset()),
            Layout::contiguous_with_offset(c, lwb.start_offset() + c),
        );
        let y = crate::cuda::encoder::layer_norm_fwd((x, lx), Some((r, lr)), (wb, &lw), Some((wb, &lb)), self.eps)?;
        Ok((y, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        res: &Tensor,
        wb: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dwb) = LayerNorm { eps: self.eps }.backward(x, Some(res), &wb.get(0)?, dy)?;
        Ok((Some(dx.clone()), Some(dx), Some(dwb)))
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
        let x32 = with_cpu_res(self.res.as_ref(), |r| norm_rows(x, lx, r))?;
        let (w32, g32) = (f32s("w", w, lw)?, f32s("g", g, lg)?);
        let c = w32.len().max(1);
        let mut dx = vec![0f32; x32.len()];
        let rows = dx.par_chunks_mut(c).zip(x32.par_chunks(c)).zip(g32.par_chunks(c));
        rows.with_min_len(ROWS_PER_TASK).for_each(|((dr, xr), gr)| {
            let (mean, rstd) = row_stats(xr, self.eps);
            let (mut sg, mut sgx) = (0f32, 0f32);
            for ((&v, &g), &w) in xr.iter().zip(gr).zip(w32.iter()) {
                sg += g * w;
                sgx += g * w * ((v - mean) * rstd);
            }
            let (sg, sgx) = (sg / c as f32, sgx / c as f32);
            for (((o, &v), &g), &w) in dr.iter_mut().zip(xr).zip(gr).zip(w32.iter()) {
                *o = rstd * (g * w - sg - (v - mean) * rstd * sgx);
            }
        });
        Ok((store(dx, x.dtype())?, lx.shape().clone()))
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
        let dx = with_cuda_res(self.res.as_ref(), |r| {
            crate::cuda::encoder::layer_norm_bwd_x((x, lx), r, (w, lw), (g, lg), self.eps)
        })?;
        Ok((dx, lx.shape().clone()))
    }
}

impl CustomOp2 for LayerNormBwdWb {
    fn name(&self) -> &'static str {
        "layer_norm_bwd_wb"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout, g: &CpuStorage, lg: &Layout) -> Result<(CpuStorage, Shape)> {
        let x32 = with_cpu_res(self.res.as_ref(), |r| norm_rows(x, lx, r))?;
        let g32 = f32s("g", g, lg)?;
        let c = *lx.dims().last().unwrap_or(&1);
        // Blocks of rows summed in parallel, then the blocks in order: the
        // same sums whatever the thread count.
        const BLOCK_ROWS: usize = 64;
        let block = BLOCK_ROWS * c.max(1);
        let partial: Vec<Vec<f32>> = x32
            .par_chunks(block)
            .zip(g32.par_chunks(block))
            .map(|(xb, gb)| {
                let mut wb = vec![0f32; 2 * c];
                for (xr, gr) in xb.chunks(c.max(1)).zip(gb.chunks(c.max(1))) {
                    let (mean, rstd) = row_stats(xr, self.eps);
                    for j in 0..c {
                        wb[j] += gr[j] * (xr[j] - mean) * rstd;
                        wb[c + j] += gr[j];
                    }
                }
                wb
            })
            .collect();
        let mut wb = vec![0f32; 2 * c];
        for p in partial {
            wb.iter_mut().zip(p).for_each(|(a, b)| *a += b);
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
        let wb = with_cuda_res(self.res.as_ref(), |r| {
            crate::cuda::encoder::layer_norm_bwd_wb((x, lx), r, (g, lg), c, self.eps)
        })?;
        Ok((wb, Shape::from((2, c))))
    }
}
