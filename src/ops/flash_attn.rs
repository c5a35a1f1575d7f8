//! Multi-head self-attention over packed variable-length sequences, as
//! FlashAttention-2 computes it: no `[B, H, L, L]` tensor and no padding,
//! the probabilities recomputed in the backward from the log-sum-exp the
//! forward keeps. CUDA: kernels/flash_attn.cu (F16 / BF16, sm_80+); CPU: one
//! F32 task per (sequence, head) on all cores, the same function.

use crate::cpu::math::{exp_f32, max_f32, simd, sum_f32};
use crate::cpu::storage::f32s;
use crate::cpu::{gemm_into, Mat, OutPtr};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::sync::Mutex;

/// The head dims the attention kernels are built for.
pub const ATTENTION_HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// The offsets `cu_seqlens` of a packed batch (U32 `[B+1]`: 0, then the
/// end of each sequence, non-decreasing), checked once and held both where
/// the kernels read them and on the host, where each call plans from them.
/// [`attention_varlen`] given a tensor copies it to the host on every call
/// (on a GPU, a synchronization); an encoder that attends in every layer
/// builds one `SeqOffsets` per batch and calls
/// [`attention_varlen_qkv_offsets`] (or [`crate::nn::bert_layer`]).
#[derive(Clone, Debug)]
pub struct SeqOffsets {
    host: std::sync::Arc<Vec<u32>>,
    device: Tensor,
}

impl SeqOffsets {
    /// From `cu_seqlens` on any device (one copy to the host).
    pub fn new(cu_seqlens: &Tensor) -> Result<Self> {
        if cu_seqlens.dtype() != DType::U32 || cu_seqlens.rank() != 1 || cu_seqlens.dim(0)? == 0 {
            bail!("cu_seqlens: expected U32 [B+1], got {:?} {:?}", cu_seqlens.dtype(), cu_seqlens.dims())
        }
        let host = cu_seqlens.to_vec1::<u32>()?;
        Self::check(&host)?;
        Ok(Self { host: std::sync::Arc::new(host), device: cu_seqlens.clone() })
    }

    /// From offsets on the host, copied to `device` once.
    pub fn from_slice(cu_seqlens: &[u32], device: &candle_core::Device) -> Result<Self> {
        if cu_seqlens.is_empty() {
            bail!("cu_seqlens: expected U32 [B+1], got no offsets")
        }
        Self::check(cu_seqlens)?;
        Ok(Self { host: std::sync::Arc::new(cu_seqlens.to_vec()), device: Tensor::new(cu_seqlens, device)? })
    }

    fn check(cu: &[u32]) -> Result<()> {
        if cu[0] != 0 || cu.windows(2).any(|w| w[1] < w[0]) {
            bail!("cu_seqlens: expected offsets from 0, non-decreasing, got {cu:?}")
        }
        Ok(())
    }

    /// The offsets as a U32 `[B+1]` tensor on their device.
    pub fn tensor(&self) -> &Tensor {
        &self.device
    }

    /// The offsets on the host.
    pub fn host(&self) -> &[u32] {
        &self.host
    }

    /// The rows of the batch (the last offset).
    pub fn total(&self) -> usize {
        *self.host.last().expect("checked non-empty") as usize
    }
}

/// `softmax(scale · q_h k_hᵀ) v_h` of every head h within each sequence of
/// a packed batch: `q`, `k`, `v` are `[T, H·dh]` (heads side by side, one
/// dtype: F16, BF16 or F32; column slices of one fused QKV projection pass
/// without a copy), `cu_seqlens` U32 `[B+1]` the first row of each sequence
/// (0, non-decreasing, ending at T; empty sequences allowed), `dh` 32, 64 or
/// 128. With `window = Some(w)` (w ≥ 1) query i sees the keys j of its
/// sequence with `|i − j| ≤ w` only (ModernBERT's local layers: w = 64 for
/// its 128-token window). Returns `[T, H·dh]` in q's dtype.
///
/// Differentiable in q, k and v: the backward recomputes the probabilities
/// from the saved log-sum-exp (F32, `[H, T]`), never storing them. On CUDA
/// (F16 / BF16, compute capability 8.0+) FlashAttention-2's tiles on tensor
/// cores, F32 accumulation and softmax statistics, and a deterministic
/// backward; on the CPU the same function in F32 (16-bit inputs widened,
/// the result rounded once); F32 on CUDA runs the composed
/// [`crate::reference::nn::attention_varlen`].
pub fn attention_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    heads: usize,
    scale: f64,
    window: Option<usize>,
) -> Result<Tensor> {
    attention_varlen_offsets(q, k, v, &SeqOffsets::new(cu_seqlens)?, heads, scale, window)
}

/// [`attention_varlen`] with offsets checked once ([`SeqOffsets`]): no
/// copy of them to the host per call.
pub fn attention_varlen_offsets(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    offsets: &SeqOffsets,
    heads: usize,
    scale: f64,
    window: Option<usize>,
) -> Result<Tensor> {
    match plan(q, k, v, offsets, heads, scale, window)? {
        Some(op) => {
            // Rows with a unit column stride pass as they are (CUDA reads strided rows).
            let rows = |x: &Tensor| -> Result<Tensor> {
                if x.device().is_cuda() && x.layout().stride()[1] == 1 {
                    Ok(x.clone())
                } else {
                    x.contiguous()
                }
            };
            rows(q)?.apply_op3(&rows(k)?, &rows(v)?, op)
        }
        None => crate::reference::nn::attention_varlen(q, k, v, offsets.tensor(), heads, scale, window),
    }
}

/// [`attention_varlen`] of the q, k and v column blocks of one fused
/// projection `qkv [T, 3·H·dh]` → `[T, H·dh]`: one graph node whose
/// gradient is one `[T, 3·H·dh]` tensor. (Three column slices passed to
/// [`attention_varlen`] are three nodes, and candle's backward of each is
/// a zero-padded copy of the whole `[T, 3·H·dh]` gradient and an add.)
/// Arguments and errors as [`attention_varlen`]'s, `qkv` named for q.
pub fn attention_varlen_qkv(
    qkv: &Tensor,
    cu_seqlens: &Tensor,
    heads: usize,
    scale: f64,
    window: Option<usize>,
) -> Result<Tensor> {
    attention_varlen_qkv_offsets(qkv, &SeqOffsets::new(cu_seqlens)?, heads, scale, window)
}

/// [`attention_varlen_qkv`] with offsets checked once ([`SeqOffsets`]): no
/// copy of them to the host per call.
pub fn attention_varlen_qkv_offsets(
    qkv: &Tensor,
    offsets: &SeqOffsets,
    heads: usize,
    scale: f64,
    window: Option<usize>,
) -> Result<Tensor> {
    let w =
        qkv.dims2().map_err(|_| candle_core::Error::Msg(format!("qkv: expected [T, 3·H·dh], got {:?}", qkv.dims())))?.1;
    if w % 3 != 0 {
        bail!("qkv: expected three blocks [T, 3·H·dh], got {:?}", qkv.dims())
    }
    let hd = w / 3;
    let (q, k, v) = (qkv.narrow(1, 0, hd)?, qkv.narrow(1, hd, hd)?, qkv.narrow(1, 2 * hd, hd)?);
    match plan(&q, &k, &v, offsets, heads, scale, window).map_err(rename_q)? {
        Some(op) => qkv.contiguous()?.apply_op1(FlashAttnQkv(op)),
        None => crate::reference::nn::attention_varlen(&q, &k, &v, offsets.tensor(), heads, scale, window),
    }
}

/// Whether the fused kernels (or the CPU loops) run for rows like `q` with
/// head dim `dh` (one of [`ATTENTION_HEAD_DIMS`]): not F32 on CUDA, nor on a
/// GPU before compute capability 8.0, where the attention is composed.
pub(crate) fn fused_runs(q: &Tensor, dh: usize) -> Result<bool> {
    if !ATTENTION_HEAD_DIMS.contains(&dh) || (q.device().is_cuda() && q.dtype() == DType::F32) {
        return Ok(false);
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(_) = q.device() {
        let (s, _) = q.storage_and_layout();
        return match &*s {
            candle_core::Storage::Cuda(c) => crate::cuda::flash_attn::flash_supported(c, dh),
            _ => Ok(false),
        };
    }
    Ok(true)
}

/// [`attention_varlen_qkv`] computed outside the graph, keeping what its
/// backward needs, for an op that fuses it into a larger node.
pub(crate) struct QkvAttention(FlashAttnQkv);

impl QkvAttention {
    /// `None` where the fused kernels do not run (F32 on CUDA, a GPU before
    /// sm_80): the caller composes instead.
    pub(crate) fn new(
        qkv: &Tensor,
        offsets: &SeqOffsets,
        heads: usize,
        scale: f64,
        window: Option<usize>,
    ) -> Result<Option<Self>> {
        let hd = qkv.dims2()?.1 / 3;
        let (q, k, v) = (qkv.narrow(1, 0, hd)?, qkv.narrow(1, hd, hd)?, qkv.narrow(1, 2 * hd, hd)?);
        Ok(plan(&q, &k, &v, offsets, heads, scale, window).map_err(rename_q)?.map(|op| Self(FlashAttnQkv(op))))
    }

    /// The attention of the rows of `qkv` (contiguous), its log-sum-exp kept.
    pub(crate) fn forward(&self, qkv: &Tensor) -> Result<Tensor> {
        qkv.apply_op1_no_bwd(&self.0)
    }

    /// The gradient `[T, 3·H·dh]` of `qkv` from that of the output `out`.
    pub(crate) fn backward(&self, qkv: &Tensor, out: &Tensor, grad: &Tensor) -> Result<Tensor> {
        CustomOp1::bwd(&self.0, qkv, out, grad)?
            .ok_or_else(|| candle_core::Error::Msg("attention_varlen: internal error, no gradient".into()))
    }
}

/// An error of [`plan`] about `q` as one about `qkv`.
fn rename_q(e: candle_core::Error) -> candle_core::Error {
    match e.to_string().strip_prefix("q: ") {
        Some(rest) => candle_core::Error::Msg(format!("qkv: {rest}")),
        None => e,
    }
}

/// The fused op for these arguments after checking them, or `None` where
/// the composed reference runs (F32 on CUDA, GPUs below sm_80).
fn plan(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    offsets: &SeqOffsets,
    heads: usize,
    scale: f64,
    window: Option<usize>,
) -> Result<Option<FlashAttn>> {
    let (t, hd) =
        q.dims2().map_err(|_| candle_core::Error::Msg(format!("q: expected [T, H·dh], got {:?}", q.dims())))?;
    if !matches!(q.dtype(), DType::F16 | DType::BF16 | DType::F32) {
        bail!("q: expected F16, BF16 or F32, got {:?}", q.dtype())
    }
    if heads == 0 || hd % heads != 0 {
        bail!("heads: {heads} does not divide q's last axis {hd}")
    }
    let dh = hd / heads;
    if !ATTENTION_HEAD_DIMS.contains(&dh) {
        bail!("q: head dim {dh} ({hd} / {heads} heads) not supported, expected 32, 64 or 128")
    }
    for (arg, x) in [("k", k), ("v", v)] {
        if x.dims() != q.dims() || x.dtype() != q.dtype() {
            bail!("{arg}: expected {:?} {:?} like q, got {:?} {:?}", q.dtype(), q.dims(), x.dtype(), x.dims())
        }
        crate::layout::check_device(arg, x, q.device())?;
    }
    if window == Some(0) {
        bail!("window: 0 keys around a query; use Some(w) with w >= 1, or None for the whole sequence")
    }
    if !scale.is_finite() {
        bail!("scale: {scale} is not finite")
    }
    crate::layout::check_device("cu_seqlens", offsets.tensor(), q.device())?;
    let cu = offsets.host();
    if offsets.total() != t {
        bail!("cu_seqlens: expected offsets ending at q's {t} rows, got {cu:?}")
    }
    let max_len = cu.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
    let geom = Geom { batch: cu.len() - 1, heads, dh, total: t, max_len, window, scale: scale as f32 };
    if !fused_runs(q, dh)? {
        return Ok(None);
    }
    Ok(Some(FlashAttn { geom, cu: offsets.tensor().clone(), cu_host: cu.to_vec(), lse: Mutex::new(None) }))
}

/// The problem: `batch` sequences of at most `max_len` rows, `total` in all.
#[derive(Clone, Copy, Debug)]
struct Geom {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    batch: usize,
    heads: usize,
    dh: usize,
    total: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    max_len: usize,
    window: Option<usize>,
    scale: f32,
}

#[cfg(feature = "cuda")]
impl Geom {
    fn cuda(&self) -> crate::cuda::flash_attn::FlashGeom {
        crate::cuda::flash_attn::FlashGeom {
            batch: self.batch,
            heads: self.heads,
            dh: self.dh,
            total: self.total,
            max_len: self.max_len,
            window: self.window,
            scale: self.scale,
        }
    }
}

/// The forward: `(q, k, v) → out`, keeping the log-sum-exp for the backward
/// (`[H, T]` F32: natural log on the CPU, base 2 of the scaled logits on CUDA).
struct FlashAttn {
    geom: Geom,
    cu: Tensor,
    cu_host: Vec<u32>,
    lse: Mutex<Option<Tensor>>,
}

fn round_to(dt: DType, v: Vec<f32>) -> CpuStorage {
    match dt {
        DType::F16 => CpuStorage::F16(v.into_iter().map(half::f16::from_f32).collect()),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(half::bf16::from_f32).collect()),
        _ => CpuStorage::F32(v),
    }
}

/// The keys query `i` of a sequence of `len` sees: `lo..hi` (|i − j| ≤ window).
#[inline(always)]
fn visible(i: usize, len: usize, window: Option<usize>) -> (usize, usize) {
    match window {
        Some(w) => (i.saturating_sub(w).min(len), i.saturating_add(w).saturating_add(1).min(len)),
        None => (0, len),
    }
}

/// `scale · row` with the keys outside the window at −∞, then the softmax
/// in place; returns the row's natural log-sum-exp. Loops without a
/// carried dependence or a branch per key, so that they vectorize (a
/// running sum beside the exponentials kept them scalar).
#[inline(always)]
fn softmax_row(row: &mut [f32], i: usize, window: Option<usize>, scale: f32) -> f32 {
    let (lo, hi) = visible(i, row.len(), window);
    row[..lo].fill(f32::NEG_INFINITY);
    row[hi..].fill(f32::NEG_INFINITY);
    row[lo..hi].iter_mut().for_each(|x| *x *= scale);
    let m = max_f32(row);
    row.iter_mut().for_each(|x| *x = exp_f32(*x - m));
    let sum = sum_f32(row);
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|x| *x *= inv);
    m + sum.ln()
}

/// The (sequence, head) tasks of a CPU pass: sequence start, length, head.
fn tasks(cu: &[u32], heads: usize) -> Vec<(usize, usize, usize)> {
    let mut v = Vec::new();
    for w in cu.windows(2) {
        let (s, l) = (w[0] as usize, (w[1] - w[0]) as usize);
        if l > 0 {
            v.extend((0..heads).map(|h| (s, l, h)));
        }
    }
    v
}

impl FlashAttn {
    /// The CPU forward over F32 rows: token t's q, k and v at
    /// `t · stride` of their slices (H·dh for separate tensors, 3·H·dh for
    /// the column blocks of one QKV tensor, read in place); returns the
    /// output `[T, H·dh]` and keeps the log-sum-exp.
    fn forward_rows(&self, q: &[f32], k: &[f32], v: &[f32], stride: usize) -> Result<Vec<f32>> {
        let g = self.geom;
        let hd = g.heads * g.dh;
        let mut out = vec![0f32; g.total * hd];
        let mut lse = vec![0f32; g.heads * g.total];
        let (dst, lse_dst) = (OutPtr(out.as_mut_ptr()), OutPtr(lse.as_mut_ptr()));
        tasks(&self.cu_host, g.heads).into_par_iter().for_each_init(Vec::new, |p, (s, l, h)| {
            p.resize(l * l, 0f32);
            let at = s * stride + h * g.dh;
            // SAFETY: strided views of this sequence's rows of head h within q, k, v.
            unsafe {
                gemm_into(
                    l,
                    l,
                    g.dh,
                    p.as_mut_ptr(),
                    l,
                    Mat::rows(q[at..].as_ptr(), stride),
                    Mat::t(k[at..].as_ptr(), stride),
                )
            };
            simd(
                #[inline(always)]
                || {
                    for (i, row) in p.chunks_mut(l).enumerate() {
                        let v = softmax_row(row, i, g.window, g.scale);
                        // SAFETY: (h, s + i) belongs to this task alone.
                        unsafe { *lse_dst.at(h * g.total + s + i) = v };
                    }
                },
            );
            // SAFETY: this task alone writes head h's columns of the sequence's rows.
            unsafe {
                gemm_into(
                    l,
                    g.dh,
                    l,
                    dst.at(s * hd + h * g.dh),
                    hd,
                    Mat::rows(p.as_ptr(), l),
                    Mat::rows(v[at..].as_ptr(), stride),
                )
            };
        });
        *self.lse.lock().unwrap() = Some(Tensor::from_vec(lse, (g.heads, g.total), &candle_core::Device::Cpu)?);
        Ok(out)
    }
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "attention-varlen"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        k: &CpuStorage,
        lk: &Layout,
        v: &CpuStorage,
        lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, dt) = (self.geom, q.dtype());
        let (q, k, v) = (f32s("q", q, lq)?, f32s("k", k, lk)?, f32s("v", v, lv)?);
        let hd = g.heads * g.dh;
        let out = self.forward_rows(&q, &k, &v, hd)?;
        Ok((round_to(dt, out), Shape::from((g.total, hd))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        k: &candle_core::CudaStorage,
        lk: &Layout,
        v: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let cu = self.cu.contiguous()?;
        let (cs, _) = cu.storage_and_layout();
        let candle_core::Storage::Cuda(cu_s) = &*cs else { bail!("cu_seqlens: expected a CUDA tensor") };
        let (out, lse) = crate::cuda::flash_attn::flash_fwd((q, lq), (k, lk), (v, lv), cu_s, &self.geom.cuda())?;
        let g = self.geom;
        let lse = Tensor::from((candle_core::Storage::Cuda(lse), (g.heads, g.total)));
        *self.lse.lock().unwrap() = Some(lse);
        Ok((out, Shape::from((g.total, g.heads * g.dh))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if self.geom.total == 0 {
            let z = || q.zeros_like().map(Some);
            return Ok((z()?, z()?, z()?));
        }
        // Taken, not cloned: freed with this backward; a second one recomputes it.
        let lse = match self.lse.lock().unwrap().take() {
            Some(l) => l,
            None => {
                let again =
                    FlashAttn { lse: Mutex::new(None), cu_host: self.cu_host.clone(), cu: self.cu.clone(), ..*self };
                q.apply_op3_no_bwd(k, v, &again)?;
                let l = again.lse.lock().unwrap().take();
                l.ok_or_else(|| candle_core::Error::Msg("attention_varlen: internal error, no log-sum-exp".into()))?
            }
        };
        let op = FlashAttnBwd {
            geom: self.geom,
            cu: self.cu.clone(),
            cu_host: self.cu_host.clone(),
            q: q.clone(),
            k: k.clone(),
            v: v.clone(),
            out: out.contiguous()?,
            lse,
        };
        let g = grad.to_dtype(q.dtype())?.contiguous()?.apply_op1_no_bwd(&op)?;
        Ok((Some(g.get(0)?), Some(g.get(1)?), Some(g.get(2)?)))
    }
}

/// [`FlashAttn`] over the three column blocks of one `[T, 3·H·dh]` tensor.
struct FlashAttnQkv(FlashAttn);

/// The q, k and v column blocks of a contiguous `[T, 3·H·dh]` layout.
#[cfg(feature = "cuda")]
fn qkv_blocks(l: &Layout) -> Result<[Layout; 3]> {
    let hd = l.dims()[1] / 3;
    Ok([l.narrow(1, 0, hd)?, l.narrow(1, hd, hd)?, l.narrow(1, 2 * hd, hd)?])
}

impl CustomOp1 for FlashAttnQkv {
    fn name(&self) -> &'static str {
        "attention-varlen-qkv"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        // The three column blocks read in place (rows 3·H·dh apart), the
        // output rounded once.
        let x = f32s("qkv", s, l)?;
        let (t, w) = l.shape().dims2()?;
        let hd = w / 3;
        let from = |c: usize| x.get(c..).unwrap_or_default(); // no rows: empty
        let out = self.0.forward_rows(&x, from(hd), from(2 * hd), w)?;
        Ok((round_to(s.dtype(), out), Shape::from((t, hd))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let [lq, lk, lv] = qkv_blocks(l)?;
        self.0.cuda_fwd(s, &lq, s, &lk, s, &lv)
    }

    fn bwd(&self, qkv: &Tensor, out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let hd = qkv.dim(1)? / 3;
        let (q, k, v) = (qkv.narrow(1, 0, hd)?, qkv.narrow(1, hd, hd)?, qkv.narrow(1, 2 * hd, hd)?);
        let (dq, dk, dv) = self.0.bwd(&q, &k, &v, out, grad)?;
        let grads = [dq, dk, dv].map(|g| g.expect("the attention backward gives every gradient"));
        // [T, 3·H·dh]: one copy of the three blocks side by side.
        Ok(Some(Tensor::cat(&grads, 1)?))
    }
}

/// The backward: `dO → [3, T, H·dh]` (dQ, dK, dV) from the tensors it keeps.
struct FlashAttnBwd {
    geom: Geom,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    cu: Tensor,
    cu_host: Vec<u32>,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
}

impl CustomOp1 for FlashAttnBwd {
    fn name(&self) -> &'static str {
        "attention-varlen-bwd"
    }

    /// With `P = exp(scale · Q Kᵀ − lse)` per (sequence, head) and
    /// `δ_i = Σ dO_i ⊙ O_i`: `dV = Pᵀ dO`, `dS = P ⊙ (dO Vᵀ − δ)`,
    /// `dQ = scale · dS K`, `dK = scale · dSᵀ Q`.
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = self.geom;
        let hd = g.heads * g.dh;
        let host = |t: &Tensor| -> Result<Vec<f32>> { t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>() };
        let (q, k, v, o, lse) = (host(&self.q)?, host(&self.k)?, host(&self.v)?, host(&self.out)?, host(&self.lse)?);
        let dout = f32s("grad", s, l)?;
        let n = g.total * hd;
        let mut grads = vec![0f32; 3 * n];
        let dst = OutPtr(grads.as_mut_ptr());
        tasks(&self.cu_host, g.heads).into_par_iter().for_each_init(
            || (Vec::new(), Vec::new(), Vec::new()),
            |(p, dp, delta), (s, l, h)| {
                p.resize(l * l, 0f32);
                dp.resize(l * l, 0f32);
                delta.resize(l, 0f32);
                let at = s * hd + h * g.dh;
                let (qa, ka, va, da) = (q[at..].as_ptr(), k[at..].as_ptr(), v[at..].as_ptr(), dout[at..].as_ptr());
                // SAFETY: strided views of this sequence's rows of head h; the
                // gradient blocks written (head h's columns of these rows of
                // dQ, dK, dV) belong to this task alone.
                unsafe {
                    gemm_into(l, l, g.dh, p.as_mut_ptr(), l, Mat::rows(qa, hd), Mat::t(ka, hd));
                    gemm_into(l, l, g.dh, dp.as_mut_ptr(), l, Mat::rows(da, hd), Mat::t(va, hd));
                }
                for (i, d) in delta.iter_mut().enumerate() {
                    let r = at + i * hd;
                    *d = (0..g.dh).map(|c| dout[r + c] * o[r + c]).sum();
                }
                for (i, (pr, dpr)) in p.chunks_exact_mut(l).zip(dp.chunks_exact_mut(l)).enumerate() {
                    // P recomputed and dS = P (dP − delta); keys outside the window 0.
                    let (m, di) = (lse[h * g.total + s + i], delta[i]);
                    let (lo, hi) = visible(i, l, g.window);
                    for t in [&mut *pr, &mut *dpr] {
                        t[..lo].fill(0.0);
                        t[hi..].fill(0.0);
                    }
                    for (x, d) in pr[lo..hi].iter_mut().zip(&mut dpr[lo..hi]) {
                        *x = exp_f32(g.scale * *x - m);
                        *d = *x * (*d - di);
                    }
                }
                unsafe {
                    gemm_into(l, g.dh, l, dst.at(2 * n + at), hd, Mat::t(p.as_ptr(), l), Mat::rows(da, hd));
                    gemm_into(l, g.dh, l, dst.at(at), hd, Mat::rows(dp.as_ptr(), l), Mat::rows(ka, hd));
                    gemm_into(l, g.dh, l, dst.at(n + at), hd, Mat::t(dp.as_ptr(), l), Mat::rows(qa, hd));
                }
            },
        );
        for x in &mut grads[..2 * n] {
            *x *= g.scale;
        }
        Ok((round_to(self.q.dtype(), grads), Shape::from((3, g.total, hd))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::Storage;
        let g = self.geom;
        let [q, k, v, o, lse, cu] =
            [&self.q, &self.k, &self.v, &self.out, &self.lse, &self.cu].map(|t| t.storage_and_layout());
        fn cuda(x: &Storage) -> Result<&candle_core::CudaStorage> {
            match x {
                Storage::Cuda(c) => Ok(c),
                _ => bail!("attention_varlen: internal error, expected CUDA tensors"),
            }
        }
        let grads = crate::cuda::flash_attn::flash_bwd(
            (cuda(&q.0)?, q.1),
            (cuda(&k.0)?, k.1),
            (cuda(&v.0)?, v.1),
            (cuda(&o.0)?, o.1),
            (s, l),
            (cuda(&lse.0)?, lse.1),
            cuda(&cu.0)?,
            &g.cuda(),
        )?;
        Ok((grads, Shape::from((3, g.total, g.heads * g.dh))))
    }
}
