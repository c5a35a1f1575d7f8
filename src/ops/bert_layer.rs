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
use crate::ops::linear::{linear, linear_gelu};
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

/// Where each weight lies in the packed F32 vector of a layer of width `c`
/// and intermediate width `i` (the order of [`BertLayerWeights::parts`],
/// Q, K and V side by side as one `[3C, C]` matrix and one `[3C]` bias).
#[derive(Clone, Copy, Debug)]
struct Pack {
    c: usize,
    i: usize,
}

impl Pack {
    /// Element counts of the packed blocks: wqkv, bqkv, wo, bo, norm 1
    /// (weight then bias), wup, bup, wdown, bdown, norm 2.
    fn sizes(self) -> [usize; 10] {
        let (c, i) = (self.c, self.i);
        [3 * c * c, 3 * c, c * c, c, 2 * c, i * c, i, c * i, c, 2 * c]
    }
    fn offset(self, block: usize) -> usize {
        self.sizes()[..block].iter().sum()
    }
    fn len(self) -> usize {
        self.sizes().iter().sum()
    }
    /// Block `block` of `pack` (a view).
    fn block(self, pack: &Tensor, block: usize) -> Result<Tensor> {
        pack.narrow(0, self.offset(block), self.sizes()[block])
    }
}

/// `residual_layer_norm(linear(u, w_down, b_down), h1)` of the attention
/// block's output `h1 = residual_layer_norm(linear(attention(linear(x, w_qkv,
/// b_qkv)), w_o, b_o), x)` with `u = linear_gelu(h1, w_up, b_up)`: one
/// post-norm BERT layer over the packed rows `x [T, C]` (F16, BF16 or F32)
/// of the sequences of `offsets` (see [`SeqOffsets`]), `heads` attention heads
/// of `C / heads` columns, GELU with the exact erf, layer norms in F32 with
/// `eps`. Weights in any float dtype (linear weights are cast to `x`'s,
/// biases and norms computed in F32), each differentiable.
///
/// Where gradients are tracked and the fused attention runs (head dims 32,
/// 64, 128; not F32 on CUDA), the layer is one graph node: its weights are
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
    let (_, c) = x.dims2().map_err(|_| candle_core::Error::Msg(format!("x: expected [T, C], got {:?}", x.dims())))?;
    let i = weights.intermediate.0.dims().first().copied().unwrap_or(0);
    let pack = Pack { c, i };
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
            bail!("weights: {name} expected a float {shape:?}, got {:?} {:?}", t.dtype(), t.dims())
        }
        crate::layout::check_device("weights", t, x.device())?;
    }
    let tracked = x.track_op() || parts.iter().any(|t| t.track_op());
    if !tracked {
        return composed(x, offsets, weights, heads, eps);
    }
    let wpack =
        Tensor::cat(&parts.map(|t| t.to_dtype(DType::F32)?.flatten_all()).into_iter().collect::<Result<Vec<_>>>()?, 0)?;
    let x = x.contiguous()?;
    let Some(stash) = Stash::forward(&x.detach(), &wpack.detach(), offsets, pack, heads, eps)? else {
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
        pack: Pack,
        heads: usize,
        eps: f64,
    ) -> Result<Option<Self>> {
        let (c, i, dt) = (pack.c, pack.i, x.dtype());
        let block = |b: usize| pack.block(wpack, b);
        let wqkv = block(0)?.reshape((3 * c, c))?.to_dtype(dt)?;
        let qkv = linear(x, &wqkv, Some(&block(1)?))?;
        let dh = c / heads.max(1);
        let Some(attention) = QkvAttention::new(&qkv, offsets, heads, (dh as f64).powf(-0.5))? else { return Ok(None) };
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
    pack: Pack,
    heads: usize,
    eps: f64,
    offsets: SeqOffsets,
    /// Taken by the backward (a second backward recomputes it).
    stash: Mutex<Option<Stash>>,
}

impl BertLayerOp {
    fn with_stash<R>(&self, f: impl FnOnce(&Stash) -> Result<R>) -> Result<R> {
        match self.stash.lock().map_err(|_| candle_core::Error::Msg("bert_layer: poisoned stash".into()))?.as_ref() {
            Some(s) => f(s),
            None => bail!("bert_layer: internal error, the forward ran without its stash"),
        }
    }
}

impl CustomOp2 for BertLayerOp {
    fn name(&self) -> &'static str {
        "bert_layer"
    }

    fn cpu_fwd(&self, _x: &CpuStorage, lx: &Layout, wp: &CpuStorage, lwp: &Layout) -> Result<(CpuStorage, Shape)> {
        let c = self.pack.c;
        let w = crate::cpu::storage::slice::<f32>("weights", wp, lwp)?;
        let n2 = &w[self.pack.offset(9)..][..2 * c];
        self.with_stash(|s| {
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
        let c = self.pack.c;
        let at = lwp.start_offset() + self.pack.offset(9);
        let (lw, lb) = (Layout::contiguous_with_offset(c, at), Layout::contiguous_with_offset(c, at + c));
        self.with_stash(|s| {
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
        let stash = self.stash.lock().map_err(|_| candle_core::Error::Msg("bert_layer: poisoned stash".into()))?.take();
        let x = x.detach();
        let s = match stash {
            Some(s) => s,
            None => Stash::forward(&x, &wpack.detach(), &self.offsets, self.pack, self.heads, self.eps)?
                .ok_or_else(|| candle_core::Error::Msg("bert_layer: internal error, no fused attention".into()))?,
        };
        let norm = LayerNorm { eps: self.eps as f32 };
        let dt = x.dtype();
        let dy = dy.to_dtype(dt)?.contiguous()?;
        // Products as `linear` computes them: in F32 on the CPU for 16-bit
        // types (rounded once), in the compute dtype elsewhere.
        let wide = x.device().is_cpu() && matches!(dt, DType::F16 | DType::BF16);
        let cast = |t: &Tensor| if wide { t.to_dtype(DType::F32) } else { Ok(t.clone()) };
        let mm = |a: &Tensor, b: &Tensor| cast(a)?.matmul(&cast(b)?)?.to_dtype(dt);
        let (gd, g_norm2) = norm.backward(&s.d, Some(&s.h1), &s.norm2.0, &dy)?;
        let gu = mm(&gd, &s.wdown)?;
        let (g_wdown, g_bdown) = (mm(&gd.t()?, &s.u)?, sum_rows(&gd)?);
        // GELU's pre-activation recomputed (F32 where the product is).
        let gz = gelu_bwd(&cast(&s.h1)?.matmul(&cast(&s.wup)?.t()?)?, &s.bup, &gu)?;
        let (g_wup, g_bup) = (mm(&gz.t()?, &s.h1)?, sum_rows(&gz)?);
        let gh1 = (gd + mm(&gz, &s.wup)?)?;
        let (go, g_norm1) = norm.backward(&s.o, Some(&x), &s.norm1_w, &gh1)?;
        let ga = mm(&go, &s.wo)?;
        let (g_wo, g_bo) = (mm(&go.t()?, &s.a)?, sum_rows(&go)?);
        let gqkv = s.attention.backward(&s.qkv, &s.a, &ga)?;
        let (g_wqkv, g_bqkv) = (mm(&gqkv.t()?, &x)?, sum_rows(&gqkv)?);
        let dx = (go + mm(&gqkv, &s.wqkv)?)?;
        let flat = |t: Tensor| t.to_dtype(DType::F32)?.flatten_all();
        let blocks = [g_wqkv, g_bqkv, g_wo, g_bo, g_norm1, g_wup, g_bup, g_wdown, g_bdown, g_norm2];
        let g_pack = Tensor::cat(&blocks.map(flat).into_iter().collect::<Result<Vec<_>>>()?, 0)?;
        if g_pack.dim(0)? != self.pack.len() {
            bail!("bert_layer: internal error, {} weight gradients for {} weights", g_pack.dim(0)?, self.pack.len())
        }
        Ok((Some(dx), Some(g_pack)))
    }
}
