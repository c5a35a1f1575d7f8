//! Whole encoder layers as one graph node each: post-norm BERT and
//! pre-norm ModernBERT (below, the same way).
//!
//! One post-norm BERT layer (transformers' `BertLayer`: fused QKV
//! projection, attention over packed sequences, output projection, residual
//! and layer norm, GELU MLP, residual and layer norm) as one graph node with
//! a closed-form backward. Composed of this crate's ops it is seven nodes
//! whose activations candle's backward passes along its edges, each edge a
//! zero-filled gradient and an add over `[T, C]` or wider, and each weight
//! a cast node of its own; as one node the backward is the layer's GEMMs
//! and kernels alone, the weights' gradients come back as one F32 vector,
//! and the intermediate tensors are the ones the composition keeps (held by
//! the node instead of the graph).

use crate::ops::encoder::{residual_layer_norm, LayerNorm};
use crate::ops::flash_attn::{QkvAttention, SeqOffsets};
use crate::ops::linear::{linear, linear_gelu, pre_activation};
use crate::ops::rows::{gelu_bwd, sum_rows};
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use std::sync::Mutex;

/// The weights of one BERT layer as a checkpoint stores them: each pair a
/// linear layer's `[out, in]` weight and `[out]` bias, or a layer norm's
/// weight and bias. `hidden` = C, `intermediate` = I.
#[derive(Clone, Copy, Debug)]
pub struct BertLayerWeights<'a> {
    /// `attention.self.query`: `[C, C]`, `[C]`.
    pub query: (&'a Tensor, &'a Tensor),
    /// `attention.self.key`.
    pub key: (&'a Tensor, &'a Tensor),
    /// `attention.self.value`.
    pub value: (&'a Tensor, &'a Tensor),
    /// `attention.output.dense`.
    pub output: (&'a Tensor, &'a Tensor),
    /// `attention.output.LayerNorm`: `[C]`, `[C]`.
    pub attention_norm: (&'a Tensor, &'a Tensor),
    /// `intermediate.dense`: `[I, C]`, `[I]`.
    pub intermediate: (&'a Tensor, &'a Tensor),
    /// `output.dense`: `[C, I]`, `[C]`.
    pub down: (&'a Tensor, &'a Tensor),
    /// `output.LayerNorm`.
    pub output_norm: (&'a Tensor, &'a Tensor),
}

impl<'a> BertLayerWeights<'a> {
    /// In the packed order: QKV weights, QKV biases, output, its bias, the
    /// first norm's weight and bias, intermediate, its bias, down, its bias,
    /// the second norm's weight and bias.
    fn parts(&self) -> [&'a Tensor; 16] {
        let w = self;
        [
            w.query.0,
            w.key.0,
            w.value.0,
            w.query.1,
            w.key.1,
            w.value.1,
            w.output.0,
            w.output.1,
            w.attention_norm.0,
            w.attention_norm.1,
            w.intermediate.0,
            w.intermediate.1,
            w.down.0,
            w.down.1,
            w.output_norm.0,
            w.output_norm.1,
        ]
    }
}

/// The blocks of a layer's weights packed into one F32 vector, in order
/// (block `k` is `lens[k]` elements): the packing, and each block as a view.
#[derive(Clone, Debug)]
struct Blocks(Vec<usize>);

impl Blocks {
    /// The F32 vector of `parts` flattened one after the other (a block may
    /// hold several consecutive parts).
    fn pack(parts: &[&Tensor]) -> Result<Tensor> {
        let flat = parts.iter().map(|t| t.to_dtype(DType::F32)?.flatten_all()).collect::<Result<Vec<_>>>()?;
        Tensor::cat(&flat, 0)
    }
    fn offset(&self, block: usize) -> usize {
        self.0[..block].iter().sum()
    }
    fn len(&self) -> usize {
        self.0.iter().sum()
    }
    /// Block `block` of `pack` (a view).
    fn block(&self, pack: &Tensor, block: usize) -> Result<Tensor> {
        pack.narrow(0, self.offset(block), self.0[block])
    }
    /// The weights' gradients `grads` (one per block, any float dtype)
    /// packed as the weights: the node's gradient of the packed vector.
    fn grads(&self, grads: Vec<Tensor>) -> Result<Tensor> {
        let flat = grads.into_iter().map(|t| t.to_dtype(DType::F32)?.flatten_all()).collect::<Result<Vec<_>>>()?;
        let g = Tensor::cat(&flat, 0)?;
        if g.dim(0)? != self.len() {
            bail!("encoder layer: internal error, {} weight gradients for {} weights", g.dim(0)?, self.len())
        }
        Ok(g)
    }
}

/// `f` of a layer op's stash, which its forward reads (`op` names the op in
/// errors).
fn with_stash<S, R>(stash: &Mutex<Option<S>>, op: &str, f: impl FnOnce(&S) -> Result<R>) -> Result<R> {
    match stash.lock().map_err(|_| candle_core::Error::Msg(format!("{op}: poisoned stash")))?.as_ref() {
        Some(s) => f(s),
        None => bail!("{op}: internal error, the forward ran without its stash"),
    }
}

/// A layer op's stash, taken by its backward (freed with it), or computed
/// again by `again` for a second backward.
fn take_stash<S>(stash: &Mutex<Option<S>>, op: &str, again: impl FnOnce() -> Result<Option<S>>) -> Result<S> {
    let taken = stash.lock().map_err(|_| candle_core::Error::Msg(format!("{op}: poisoned stash")))?.take();
    match taken {
        Some(s) => Ok(s),
        None => again()?.ok_or_else(|| candle_core::Error::Msg(format!("{op}: internal error, no fused attention"))),
    }
}

/// Whether a backward's products run in F32 and round once, as [`linear`]
/// computes them for 16-bit types on the CPU (in the compute dtype
/// elsewhere); [`mm`] is such a product.
fn product_rule(dev: &candle_core::Device, dt: DType) -> bool {
    dev.is_cpu() && matches!(dt, DType::F16 | DType::BF16)
}

fn widen(t: &Tensor, wide: bool) -> Result<Tensor> {
    if wide {
        t.to_dtype(DType::F32)
    } else {
        Ok(t.clone())
    }
}

fn mm(a: &Tensor, b: &Tensor, wide: bool, dt: DType) -> Result<Tensor> {
    widen(a, wide)?.matmul(&widen(b, wide)?)?.to_dtype(dt)
}

/// The width C of a layer's packed input `x [T, C]` (F16, BF16 or F32).
fn check_input(x: &Tensor) -> Result<usize> {
    let (_, c) = x.dims2().map_err(|_| candle_core::Error::Msg(format!("x: expected [T, C], got {:?}", x.dims())))?;
    if !matches!(x.dtype(), DType::F16 | DType::BF16 | DType::F32) {
        bail!("x: expected F16, BF16 or F32, got {:?}", x.dtype())
    }
    Ok(c)
}

/// The BERT layer's blocks for width `c` and intermediate width `i`: wqkv,
/// bqkv, wo, bo, norm 1 (weight then bias), wup, bup, wdown, bdown, norm 2
/// (the order of [`BertLayerWeights::parts`], Q, K and V side by side).
fn bert_blocks(c: usize, i: usize) -> Blocks {
    Blocks(vec![3 * c * c, 3 * c, c * c, c, 2 * c, i * c, i, c * i, c, 2 * c])
}

/// `residual_layer_norm(linear(u, w_down, b_down), h1)` of the attention
/// block's output `h1 = residual_layer_norm(linear(attention(linear(x, w_qkv,
/// b_qkv)), w_o, b_o), x)` with `u = linear_gelu(h1, w_up, b_up)`: one
/// post-norm BERT layer over the packed rows `x [T, C]` (F16, BF16 or F32)
/// of the sequences of `offsets` (see [`SeqOffsets`]), `heads` attention heads
/// of `C / heads` columns (32, 64 or 128; others are an error), GELU with
/// the exact erf, layer norms in F32 with `eps`. Weights in any float dtype
/// (linear weights are cast to `x`'s, biases and norms computed in F32),
/// each differentiable.
///
/// Where gradients are tracked and the fused attention runs (not F32 on
/// CUDA, nor before compute capability 8.0), the layer is one graph node: its weights are
/// packed into one F32 vector (a copy per call) whose gradient the node
/// returns whole. Otherwise it is the same ops composed, with the same
/// values.
pub fn bert_layer(
    x: &Tensor,
    offsets: &SeqOffsets,
    weights: &BertLayerWeights<'_>,
    heads: usize,
    eps: f64,
) -> Result<Tensor> {
    let c = check_input(x)?;
    let i = weights.intermediate.0.dims().first().copied().unwrap_or(0);
    let pack = bert_blocks(c, i);
    let names = [
        "query",
        "key",
        "value",
        "query",
        "key",
        "value",
        "output",
        "output",
        "attention_norm",
        "attention_norm",
        "intermediate",
        "intermediate",
        "down",
        "down",
        "output_norm",
        "output_norm",
    ];
    let shapes: [&[usize]; 16] = [
        &[c, c],
        &[c, c],
        &[c, c],
        &[c],
        &[c],
        &[c],
        &[c, c],
        &[c],
        &[c],
        &[c],
        &[i, c],
        &[i],
        &[c, i],
        &[c],
        &[c],
        &[c],
    ];
    let parts = weights.parts();
    for ((t, name), shape) in parts.iter().zip(names).zip(shapes) {
        if t.dims() != shape || !t.dtype().is_float() {
            bail!(
                "weights: {name} expected a float {shape:?} (C from x, I from intermediate's weight), got {:?} {:?}",
                t.dtype(),
                t.dims()
            )
        }
        crate::layout::check_device(&format!("weights: {name}"), t, x.device())?;
    }
    let tracked = x.track_op() || parts.iter().any(|t| t.track_op());
    if !tracked || !crate::ops::flash_attn::fused_runs(x, c / heads.max(1))? {
        return composed(x, offsets, weights, heads, eps);
    }
    let wpack = Blocks::pack(&parts)?;
    let x = x.contiguous()?;
    let Some(stash) = Stash::forward(&x.detach(), &wpack.detach(), offsets, &pack, heads, eps)? else {
        return composed(&x, offsets, weights, heads, eps);
    };
    let op = BertLayerOp { pack, heads, eps, offsets: offsets.clone(), stash: Mutex::new(Some(stash)) };
    x.apply_op2(&wpack, op)
}

/// [`bert_layer`] composed of this crate's differentiable ops.
fn composed(x: &Tensor, offsets: &SeqOffsets, w: &BertLayerWeights<'_>, heads: usize, eps: f64) -> Result<Tensor> {
    let dt = x.dtype();
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let wqkv = Tensor::cat(&[w.query.0, w.key.0, w.value.0], 0)?.to_dtype(dt)?;
    let bqkv = Tensor::cat(&[f32(w.query.1)?, f32(w.key.1)?, f32(w.value.1)?], 0)?;
    let qkv = linear(x, &wqkv, Some(&bqkv))?;
    let dh = x.dim(1)? / heads.max(1);
    let a = crate::ops::flash_attn::attention_varlen_qkv_offsets(&qkv, offsets, heads, (dh as f64).powf(-0.5), None)?;
    let o = linear(&a, &w.output.0.to_dtype(dt)?, Some(w.output.1))?;
    let h1 = residual_layer_norm(&o, x, w.attention_norm.0, Some(w.attention_norm.1), eps)?;
    let u = linear_gelu(&h1, &w.intermediate.0.to_dtype(dt)?, w.intermediate.1)?;
    let d = linear(&u, &w.down.0.to_dtype(dt)?, Some(w.down.1))?;
    residual_layer_norm(&d, &h1, w.output_norm.0, Some(w.output_norm.1), eps)
}

/// What the backward needs, from the forward up to the second norm's input
/// (all outside the graph): the weights in the compute dtype and F32, the
/// attention (with its log-sum-exp), and the intermediate tensors.
struct Stash {
    wqkv: Tensor,
    wo: Tensor,
    wup: Tensor,
    wdown: Tensor,
    bup: Tensor,
    norm1_w: Tensor,
    norm2: (Tensor, Tensor),
    attention: QkvAttention,
    qkv: Tensor,
    a: Tensor,
    o: Tensor,
    h1: Tensor,
    u: Tensor,
    d: Tensor,
}

impl Stash {
    /// `None` where the fused attention does not run.
    fn forward(
        x: &Tensor,
        wpack: &Tensor,
        offsets: &SeqOffsets,
        pack: &Blocks,
        heads: usize,
        eps: f64,
    ) -> Result<Option<Self>> {
        let (c, i, dt) = (x.dim(1)?, pack.0[6], x.dtype());
        let block = |b: usize| pack.block(wpack, b);
        let wqkv = block(0)?.reshape((3 * c, c))?.to_dtype(dt)?;
        let qkv = linear(x, &wqkv, Some(&block(1)?))?;
        let dh = c / heads.max(1);
        let Some(attention) = QkvAttention::new(&qkv, offsets, heads, (dh as f64).powf(-0.5), None)? else {
            return Ok(None);
        };
        let a = attention.forward(&qkv)?;
        let wo = block(2)?.reshape((c, c))?.to_dtype(dt)?;
        let o = linear(&a, &wo, Some(&block(3)?))?;
        let norm1 = block(4)?;
        let norm1_w = norm1.narrow(0, 0, c)?;
        let h1 = residual_layer_norm(&o, x, &norm1_w, Some(&norm1.narrow(0, c, c)?), eps)?;
        let (wup, bup) = (block(5)?.reshape((i, c))?.to_dtype(dt)?, block(6)?);
        let u = linear_gelu(&h1, &wup, &bup)?;
        let wdown = block(7)?.reshape((c, i))?.to_dtype(dt)?;
        let d = linear(&u, &wdown, Some(&block(8)?))?;
        let norm2 = block(9)?;
        let norm2 = (norm2.narrow(0, 0, c)?, norm2.narrow(0, c, c)?);
        Ok(Some(Self { wqkv, wo, wup, wdown, bup, norm1_w, norm2, attention, qkv, a, o, h1, u, d }))
    }
}

/// `(x, packed weights) → y`: the layer's last step (the second norm) from
/// the stash, and the closed-form backward of the whole layer.
struct BertLayerOp {
    pack: Blocks,
    heads: usize,
    eps: f64,
    offsets: SeqOffsets,
    /// Taken by the backward (a second backward recomputes it).
    stash: Mutex<Option<Stash>>,
}

impl CustomOp2 for BertLayerOp {
    fn name(&self) -> &'static str {
        "bert_layer"
    }

    fn cpu_fwd(&self, _x: &CpuStorage, lx: &Layout, wp: &CpuStorage, lwp: &Layout) -> Result<(CpuStorage, Shape)> {
        let c = lx.dims()[1];
        let w = crate::cpu::storage::slice::<f32>("weights", wp, lwp)?;
        let n2 = &w[self.pack.offset(9)..][..2 * c];
        with_stash(&self.stash, self.name(), |s| {
            let ((d, ld), (h1, lh1)) = (s.d.storage_and_layout(), s.h1.storage_and_layout());
            let (candle_core::Storage::Cpu(d), candle_core::Storage::Cpu(h1)) = (&*d, &*h1) else {
                bail!("bert_layer: internal error, expected CPU tensors")
            };
            let y = LayerNorm { eps: self.eps as f32 }.cpu(d, ld, Some((h1, lh1)), &n2[..c], &n2[c..])?;
            Ok((y, lx.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _x: &candle_core::CudaStorage,
        lx: &Layout,
        wp: &candle_core::CudaStorage,
        lwp: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let c = lx.dims()[1];
        let at = lwp.start_offset() + self.pack.offset(9);
        let (lw, lb) = (Layout::contiguous_with_offset(c, at), Layout::contiguous_with_offset(c, at + c));
        with_stash(&self.stash, self.name(), |s| {
            let ((d, ld), (h1, lh1)) = (s.d.storage_and_layout(), s.h1.storage_and_layout());
            let (candle_core::Storage::Cuda(d), candle_core::Storage::Cuda(h1)) = (&*d, &*h1) else {
                bail!("bert_layer: internal error, expected CUDA tensors")
            };
            let eps = self.eps as f32;
            let y = crate::cuda::encoder::layer_norm_fwd((d, ld), Some((h1, lh1)), (wp, &lw), Some((wp, &lb)), eps)?;
            Ok((y, lx.shape().clone()))
        })
    }

    /// From `dy`: the second norm, the down projection, GELU and the up
    /// projection (its product recomputed, as `linear_gelu` does), the first
    /// norm, the output projection, the attention and the QKV projection;
    /// the residual paths' gradients added where they meet. The weights'
    /// gradients in F32, packed as the weights.
    fn bwd(&self, x: &Tensor, wpack: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let x = x.detach();
        let s = take_stash(&self.stash, self.name(), || {
            Stash::forward(&x, &wpack.detach(), &self.offsets, &self.pack, self.heads, self.eps)
        })?;
        let norm = LayerNorm { eps: self.eps as f32 };
        let dy = dy.to_dtype(x.dtype())?.contiguous()?;
        let wide = product_rule(x.device(), x.dtype());
        let mm = |a: &Tensor, b: &Tensor| mm(a, b, wide, x.dtype());
        let (gd, g_norm2) = norm.backward(&s.d, Some(&s.h1), &s.norm2.0, &dy)?;
        let gu = mm(&gd, &s.wdown)?;
        let (g_wdown, g_bdown) = (mm(&gd.t()?, &s.u)?, sum_rows(&gd)?);
        // GELU's pre-activation recomputed by the product the forward ran
        // (in F32 where that is, on the same engine).
        let gz = gelu_bwd(&pre_activation(&s.h1, &s.wup)?, &s.bup, &gu)?;
        let (g_wup, g_bup) = (mm(&gz.t()?, &s.h1)?, sum_rows(&gz)?);
        let gh1 = (gd + mm(&gz, &s.wup)?)?;
        let (go, g_norm1) = norm.backward(&s.o, Some(&x), &s.norm1_w, &gh1)?;
        let ga = mm(&go, &s.wo)?;
        let (g_wo, g_bo) = (mm(&go.t()?, &s.a)?, sum_rows(&go)?);
        let gqkv = s.attention.backward(&s.qkv, &s.a, &ga)?;
        let (g_wqkv, g_bqkv) = (mm(&gqkv.t()?, &x)?, sum_rows(&gqkv)?);
        let dx = (go + mm(&gqkv, &s.wqkv)?)?;
        let blocks = vec![g_wqkv, g_bqkv, g_wo, g_bo, g_norm1, g_wup, g_bup, g_wdown, g_bdown, g_norm2];
        Ok((Some(dx), Some(self.pack.grads(blocks)?)))
    }
}

/// The weights of one ModernBERT layer as a checkpoint stores them (its
/// projections have no biases): `C` = hidden width, `I` = intermediate.
#[derive(Clone, Copy, Debug)]
pub struct ModernBertLayerWeights<'a> {
    /// `attn_norm`: weight `[C]` and bias; `None` in the first layer, whose
    /// input is already normalized (the embeddings' norm).
    pub attention_norm: Option<(&'a Tensor, Option<&'a Tensor>)>,
    /// `attn.Wqkv`: `[3C, C]`.
    pub wqkv: &'a Tensor,
    /// `attn.Wo`: `[C, C]`.
    pub wo: &'a Tensor,
    /// `mlp_norm`: weight `[C]` and bias.
    pub mlp_norm: (&'a Tensor, Option<&'a Tensor>),
    /// `mlp.Wi`: `[2I, C]` (GeGLU's input and gate halves).
    pub wi: &'a Tensor,
    /// `mlp.Wo`: `[C, I]`.
    pub wo_mlp: &'a Tensor,
}

impl<'a> ModernBertLayerWeights<'a> {
    /// The present weights in packed order (attention norm, wqkv, wo, MLP
    /// norm, wi, wo_mlp; each norm's weight then its bias) with their blocks.
    fn parts(&self, c: usize, i: usize) -> (Vec<&'a Tensor>, Blocks) {
        let (mut parts, mut lens) = (Vec::new(), Vec::new());
        let mut norm = |n: (&'a Tensor, Option<&'a Tensor>)| {
            parts.push(n.0);
            lens.push(c);
            if let Some(b) = n.1 {
                parts.push(b);
                lens.push(c);
            }
        };
        if let Some(n) = self.attention_norm {
            norm(n);
        }
        let mut parts2 = vec![self.wqkv, self.wo];
        let mut lens2 = vec![3 * c * c, c * c];
        let (mut p3, mut l3) = (vec![self.mlp_norm.0], vec![c]);
        if let Some(b) = self.mlp_norm.1 {
            p3.push(b);
            l3.push(c);
        }
        parts.append(&mut parts2);
        lens.append(&mut lens2);
        parts.append(&mut p3);
        lens.append(&mut l3);
        parts.extend([self.wi, self.wo_mlp]);
        lens.extend([2 * i * c, c * i]);
        (parts, Blocks(lens))
    }
}

/// One pre-norm ModernBERT layer over the packed rows `x [T, C]` (F16, BF16
/// or F32) of the sequences of `offsets`: `x1 = x + attention(rotary(norm(x)
/// · Wqkvᵀ)) · Woᵀ`, then `x1 + GeGLU(norm(x1) · Wiᵀ) · Wo_mlpᵀ` (GELU with
/// the exact erf), `heads` heads of `C / heads` columns (32, 64 or 128;
/// others are an error), an
/// optional sliding `window` (keys within `window` rows of a query), the
/// rotary tables `cos`, `sin` `[T, head_dim / 2]` F32 of each row's
/// position ([`crate::nn::rotary_qk`]), layer norms in F32 with `eps`.
/// Weights in any float dtype (cast to `x`'s; norms in F32), each
/// differentiable.
///
/// Where gradients are tracked and the fused attention runs (not F32 on
/// CUDA), the layer is one graph node, as [`bert_layer`]: composed it is
/// about ten nodes, whose edges each cost candle's backward a zero-filled
/// gradient and an add over `[T, C]` or wider. Otherwise the same ops
/// composed, with the same values.
pub fn modernbert_layer(
    x: &Tensor,
    offsets: &SeqOffsets,
    weights: &ModernBertLayerWeights<'_>,
    heads: usize,
    window: Option<usize>,
    (cos, sin): (&Tensor, &Tensor),
    eps: f64,
) -> Result<Tensor> {
    let c = check_input(x)?;
    let i = weights.wo_mlp.dims().get(1).copied().unwrap_or(0);
    let w = weights;
    let mut named: Vec<(&str, &Tensor, Vec<usize>)> = Vec::new();
    if let Some((nw, nb)) = w.attention_norm {
        named.push(("attention_norm", nw, vec![c]));
        if let Some(b) = nb {
            named.push(("attention_norm", b, vec![c]));
        }
    }
    named.extend([("wqkv", w.wqkv, vec![3 * c, c]), ("wo", w.wo, vec![c, c]), ("mlp_norm", w.mlp_norm.0, vec![c])]);
    if let Some(b) = w.mlp_norm.1 {
        named.push(("mlp_norm", b, vec![c]));
    }
    named.extend([("wi", w.wi, vec![2 * i, c]), ("wo_mlp", w.wo_mlp, vec![c, i])]);
    for (name, t, shape) in &named {
        if t.dims() != shape.as_slice() || !t.dtype().is_float() {
            bail!(
                "weights: {name} expected a float {shape:?} (C from x, I from wo_mlp), got {:?} {:?}",
                t.dtype(),
                t.dims()
            )
        }
        crate::layout::check_device(&format!("weights: {name}"), t, x.device())?;
    }
    let (parts, pack) = w.parts(c, i);
    let tracked = x.track_op() || parts.iter().any(|t| t.track_op());
    let rotary = (cos.contiguous()?, sin.contiguous()?);
    if !tracked || !crate::ops::flash_attn::fused_runs(x, c / heads.max(1))? {
        return modern_composed(x, offsets, w, heads, window, &rotary, eps);
    }
    let wpack = Blocks::pack(&parts)?;
    let x = x.contiguous()?;
    let geom = ModernGeom {
        heads,
        window,
        eps,
        norm1: w.attention_norm.map(|n| n.1.is_some()),
        bias2: w.mlp_norm.1.is_some(),
    };
    let Some(stash) = ModernStash::forward(&x.detach(), &wpack.detach(), offsets, &pack, &geom, &rotary)? else {
        return modern_composed(&x, offsets, w, heads, window, &rotary, eps);
    };
    let op = ModernLayerOp { pack, geom, offsets: offsets.clone(), rotary, stash: Mutex::new(Some(stash)) };
    x.apply_op2(&wpack, op)
}

/// [`modernbert_layer`] composed of this crate's differentiable ops.
fn modern_composed(
    x: &Tensor,
    offsets: &SeqOffsets,
    w: &ModernBertLayerWeights<'_>,
    heads: usize,
    window: Option<usize>,
    (cos, sin): &(Tensor, Tensor),
    eps: f64,
) -> Result<Tensor> {
    use crate::ops::encoder::{layer_norm, rotary_qk};
    let dt = x.dtype();
    let xn = match w.attention_norm {
        Some((nw, nb)) => layer_norm(x, nw, nb, eps)?,
        None => x.clone(),
    };
    let qkv = rotary_qk(&linear(&xn, &w.wqkv.to_dtype(dt)?, None)?, cos, sin, heads)?;
    let dh = x.dim(1)? / heads.max(1);
    let a = crate::ops::flash_attn::attention_varlen_qkv_offsets(&qkv, offsets, heads, (dh as f64).powf(-0.5), window)?;
    let x1 = (x + linear(&a, &w.wo.to_dtype(dt)?, None)?)?;
    let up = linear(&layer_norm(&x1, w.mlp_norm.0, w.mlp_norm.1, eps)?, &w.wi.to_dtype(dt)?, None)?;
    &x1 + linear(&crate::ops::rows::geglu(&up)?, &w.wo_mlp.to_dtype(dt)?, None)?
}

/// A ModernBERT layer's shape beyond its weights: heads, window, norm eps,
/// whether the attention norm exists (and has a bias), whether the MLP
/// norm has a bias.
#[derive(Clone, Copy, Debug)]
struct ModernGeom {
    heads: usize,
    window: Option<usize>,
    eps: f64,
    norm1: Option<bool>,
    bias2: bool,
}

/// A norm's block indices: its weight's, and its bias's if it has one.
type NormBlocks = (usize, Option<usize>);

/// The block index of each of a ModernBERT layer's weights.
struct ModernBlocks {
    norm1: Option<NormBlocks>,
    wqkv: usize,
    wo: usize,
    norm2: NormBlocks,
    wi: usize,
    wo_mlp: usize,
}

impl ModernGeom {
    /// The block indices, in [`ModernBertLayerWeights::parts`]' order.
    fn blocks(&self) -> ModernBlocks {
        let mut k = 0;
        let mut next = || {
            k += 1;
            k - 1
        };
        let norm1 = self.norm1.map(|bias| (next(), bias.then(&mut next)));
        let (wqkv, wo) = (next(), next());
        let norm2 = (next(), self.bias2.then(&mut next));
        ModernBlocks { norm1, wqkv, wo, norm2, wi: next(), wo_mlp: next() }
    }
}

/// What the backward of a ModernBERT layer needs, from its forward outside
/// the graph.
struct ModernStash {
    wqkv: Tensor,
    wo: Tensor,
    wi: Tensor,
    wo_mlp: Tensor,
    norm1: Option<(Tensor, Tensor)>,
    norm2: (Tensor, Tensor),
    attention: QkvAttention,
    xn: Tensor,
    qkv: Tensor,
    a: Tensor,
    x1: Tensor,
    xn2: Tensor,
    up: Tensor,
    m: Tensor,
    d: Tensor,
}

impl ModernStash {
    fn forward(
        x: &Tensor,
        wpack: &Tensor,
        offsets: &SeqOffsets,
        pack: &Blocks,
        g: &ModernGeom,
        (cos, sin): &(Tensor, Tensor),
    ) -> Result<Option<Self>> {
        use crate::ops::encoder::{layer_norm, rotary_qk};
        let (c, dt) = (x.dim(1)?, x.dtype());
        let block = |b: usize| pack.block(wpack, b);
        let b = g.blocks();
        let i = pack.0[b.wo_mlp] / c.max(1);
        // A norm's weight and its bias (zeros where it has none).
        let norm = |(w, bias): NormBlocks| -> Result<(Tensor, Tensor)> {
            let bias = match bias {
                Some(k) => block(k)?,
                None => Tensor::zeros(c, DType::F32, x.device())?,
            };
            Ok((block(w)?, bias))
        };
        let norm1 = b.norm1.map(norm).transpose()?;
        let norm2 = norm(b.norm2)?;
        let xn = match &norm1 {
            Some((w, b)) => layer_norm(x, w, Some(b), g.eps)?,
            None => x.clone(),
        };
        let wqkv = block(b.wqkv)?.reshape((3 * c, c))?.to_dtype(dt)?;
        let qkv = rotary_qk(&linear(&xn, &wqkv, None)?, cos, sin, g.heads)?;
        let dh = c / g.heads.max(1);
        let Some(attention) = QkvAttention::new(&qkv, offsets, g.heads, (dh as f64).powf(-0.5), g.window)? else {
            return Ok(None);
        };
        let a = attention.forward(&qkv)?;
        let wo = block(b.wo)?.reshape((c, c))?.to_dtype(dt)?;
        let x1 = (x + linear(&a, &wo, None)?)?;
        let xn2 = layer_norm(&x1, &norm2.0, Some(&norm2.1), g.eps)?;
        let wi = block(b.wi)?.reshape((2 * i, c))?.to_dtype(dt)?;
        let up = linear(&xn2, &wi, None)?;
        let m = crate::ops::rows::geglu(&up)?;
        let wo_mlp = block(b.wo_mlp)?.reshape((c, i))?.to_dtype(dt)?;
        let d = linear(&m, &wo_mlp, None)?;
        Ok(Some(Self { wqkv, wo, wi, wo_mlp, norm1, norm2, attention, xn, qkv, a, x1, xn2, up, m, d }))
    }
}

/// `(x, packed weights) → y = x1 + d` from the stash, and the closed-form
/// backward of the whole layer.
struct ModernLayerOp {
    pack: Blocks,
    geom: ModernGeom,
    offsets: SeqOffsets,
    rotary: (Tensor, Tensor),
    /// Taken by the backward (a second backward recomputes it).
    stash: Mutex<Option<ModernStash>>,
}

impl CustomOp2 for ModernLayerOp {
    fn name(&self) -> &'static str {
        "modernbert_layer"
    }

    fn cpu_fwd(&self, _x: &CpuStorage, lx: &Layout, _w: &CpuStorage, _lw: &Layout) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        with_stash(&self.stash, self.name(), |s| {
            let ((x1, l1), (d, ld)) = (s.x1.storage_and_layout(), s.d.storage_and_layout());
            let (candle_core::Storage::Cpu(x1), candle_core::Storage::Cpu(d)) = (&*x1, &*d) else {
                bail!("modernbert_layer: internal error, expected CPU tensors")
            };
            Ok((x1.binary_impl::<candle_core::op::Add>(d, l1, ld)?, lx.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _x: &candle_core::CudaStorage,
        lx: &Layout,
        _w: &candle_core::CudaStorage,
        _lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        with_stash(&self.stash, self.name(), |s| {
            let ((x1, l1), (d, ld)) = (s.x1.storage_and_layout(), s.d.storage_and_layout());
            let (candle_core::Storage::Cuda(x1), candle_core::Storage::Cuda(d)) = (&*x1, &*d) else {
                bail!("modernbert_layer: internal error, expected CUDA tensors")
            };
            Ok((x1.binary_impl::<candle_core::op::Add>(d, l1, ld)?, lx.shape().clone()))
        })
    }

    /// From `dy`: the MLP (its down projection, GeGLU, its up projection,
    /// its norm), the attention block (output projection, attention, the
    /// rotation back, the QKV projection, its norm); the residual paths'
    /// gradients added where they meet. The weights' gradients in F32,
    /// packed as the weights.
    fn bwd(&self, x: &Tensor, wpack: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let x = x.detach();
        let s = take_stash(&self.stash, self.name(), || {
            ModernStash::forward(&x, &wpack.detach(), &self.offsets, &self.pack, &self.geom, &self.rotary)
        })?;
        let g = self.geom;
        let norm = LayerNorm { eps: g.eps as f32 };
        let dt = x.dtype();
        let gy = dy.to_dtype(dt)?.contiguous()?;
        let wide = product_rule(x.device(), dt);
        let mm = |a: &Tensor, b: &Tensor| mm(a, b, wide, dt);
        // MLP: y = x1 + m · Wo_mlpᵀ, m = GeGLU(up), up = norm2(x1) · Wiᵀ.
        let gm = mm(&gy, &s.wo_mlp)?;
        let g_wo_mlp = mm(&gy.t()?, &s.m)?;
        let gup = crate::ops::rows::geglu_bwd(&s.up, &gm)?;
        let g_wi = mm(&gup.t()?, &s.xn2)?;
        let (gx1_norm, g_norm2) = norm.backward(&s.x1, None, &s.norm2.0, &mm(&gup, &s.wi)?)?;
        let gx1 = (&gy + gx1_norm)?;
        // Attention: x1 = x + a · Woᵀ, a = attention(rotary(xn · Wqkvᵀ)).
        let ga = mm(&gx1, &s.wo)?;
        let g_wo = mm(&gx1.t()?, &s.a)?;
        let gqkv = s.attention.backward(&s.qkv, &s.a, &ga)?;
        let gqkv = crate::ops::encoder::rotary_qk_bwd(&gqkv, &self.rotary.0, &self.rotary.1, g.heads)?;
        let g_wqkv = mm(&gqkv.t()?, &s.xn)?;
        let gxn = mm(&gqkv, &s.wqkv)?;
        let mut grads = Vec::new();
        let gx = match (&s.norm1, g.norm1) {
            (Some((w1, _)), Some(bias)) => {
                let (gx_norm, g_norm1) = norm.backward(&x, None, w1, &gxn)?;
                grads.push(g_norm1.get(0)?);
                if bias {
                    grads.push(g_norm1.get(1)?);
                }
                (gx1 + gx_norm)?
            }
            _ => (gx1 + gxn)?,
        };
        grads.extend([g_wqkv, g_wo, g_norm2.get(0)?]);
        if g.bias2 {
            grads.push(g_norm2.get(1)?);
        }
        grads.extend([g_wi, g_wo_mlp]);
        Ok((Some(gx), Some(self.pack.grads(grads)?)))
    }
}
