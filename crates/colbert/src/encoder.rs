//! The transformer encoders of ColBERT checkpoints, BERT and ModernBERT,
//! written for inference and training alike: weights come from a
//! `VarBuilder` (a memory-mapped checkpoint, or a `VarMap` of trainable
//! `Var`s), every op is differentiable, and the compute dtype is chosen per
//! call (weights are cast to it, so F32 master weights train in BF16).
//!
//! Attention masks are additive biases of `f32::MIN` (finite), added to
//! the scores in F32 before an F32 softmax (one fused op,
//! `candle_maxsim::nn::attention_softmax`), as transformers' eager attention does: no `0 · -inf` (the NaN of a mask built by multiplying in
//! F16) and no all-`-inf` row (a padding row attends uniformly, like
//! transformers', instead of producing NaN that would reach the valid rows
//! through the values).

use candle_core::{bail, DType, Device, Module, Result, Tensor, D};
use candle_maxsim::nn::SeqOffsets;
use candle_nn::VarBuilder;

/// `x · wᵀ + b` over the last dim, `w` cast to `x`'s dtype.
fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    linear_act(x, w, b, None)
}

/// `act(x · wᵀ + b)`: the product, the bias and an exact GELU are one fused
/// op (instead of a graph node per step, each costing the backward a
/// zero-filled gradient and an add over the activations).
fn linear_act(x: &Tensor, w: &Tensor, b: Option<&Tensor>, act: Option<Act>) -> Result<Tensor> {
    let w = w.to_dtype(x.dtype())?;
    let dims = x.dims().to_vec();
    let (inner, out) = (dims[dims.len() - 1], w.dim(0)?);
    let rows = x.elem_count() / inner.max(1);
    // The product alone: tiled on all cores on the CPU (F32), cuBLAS on CUDA.
    // Reshapes only where the rank changes: each is a graph node, and each
    // node costs the backward a zero-filled gradient and an add.
    let x2 = if x.rank() == 2 { x.clone() } else { x.reshape((rows, inner))? };
    // Product, bias (and BERT's GELU) in one graph node each.
    let y = match (b, act) {
        (Some(b), Some(Act::Gelu)) => candle_maxsim::nn::linear_gelu(&x2, &w, b)?,
        (b, act) => {
            let y = candle_maxsim::nn::linear(&x2, &w, b)?;
            match act {
                Some(act) => act.apply(&y)?,
                None => y,
            }
        }
    };
    let mut shape = dims;
    *shape.last_mut().unwrap() = out;
    if y.dims() == shape.as_slice() {
        Ok(y)
    } else {
        y.reshape(shape)
    }
}

/// A layer-norm's weight (and bias), named `weight`/`bias` or, in older
/// checkpoints, `gamma`/`beta`.
struct Norm {
    w: Tensor,
    b: Option<Tensor>,
    eps: f64,
}

impl Norm {
    fn load(vb: VarBuilder, h: usize, bias: bool, eps: f64) -> Result<Self> {
        let (w, b) = if vb.contains_tensor("weight") || !vb.contains_tensor("gamma") {
            (vb.get(h, "weight")?, if bias { Some(vb.get(h, "bias")?) } else { None })
        } else {
            (vb.get(h, "gamma")?, if bias { Some(vb.get(h, "beta")?) } else { None })
        };
        Ok(Self { w, b, eps })
    }
    /// In F32, returned in `x`'s dtype (one fused op, and one backward).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_maxsim::nn::layer_norm(x, &self.w, self.b.as_ref(), self.eps)
    }
    /// The norm of `x + res` (a post-norm residual connection), one op: the
    /// sum is neither a graph node nor kept.
    fn forward_residual(&self, x: &Tensor, res: &Tensor) -> Result<Tensor> {
        candle_maxsim::nn::residual_layer_norm(x, res, &self.w, self.b.as_ref(), self.eps)
    }
}

/// Scaled dot-product attention of `q, k, v [B, L, H·dh]` (heads side by
/// side) with an additive F32 bias broadcast to `[B, H, L, L]`; returns
/// `[B, L, H·dh]`. One op (`candle_maxsim::nn::attention`): fused on the
/// CPU for inference, scaled, biased and normalized in F32 in one softmax
/// op between two matmuls elsewhere.
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, heads: usize) -> Result<Tensor> {
    let dh = q.dim(D::Minus1)? / heads;
    candle_maxsim::nn::attention(q, k, v, bias, heads, (dh as f64).powf(-0.5))
}

/// `[B, 1, 1, L]` F32: 0 where `attention` (U8 `[B, L]`) is set, `f32::MIN` elsewhere.
fn padding_bias(attention: &Tensor) -> Result<Tensor> {
    let (b, l) = attention.dims2()?;
    let zero = Tensor::zeros((b, l), DType::F32, attention.device())?;
    let min = Tensor::full(f32::MIN, (b, l), attention.device())?;
    attention.where_cond(&zero, &min)?.reshape((b, 1, 1, l))
}

/// Self-attention of packed rows within the sequences of `offsets`, from
/// one fused projection `qkv [T, 3·H·dh]`: the fused varlen op (one graph
/// node) for the head dims it is built for, otherwise the same function
/// composed of candle ops.
fn attention_packed(qkv: &Tensor, offsets: &SeqOffsets, heads: usize, window: Option<usize>) -> Result<Tensor> {
    let hd = qkv.dim(1)? / 3;
    let dh = hd / heads;
    let scale = (dh as f64).powf(-0.5);
    if candle_maxsim::nn::ATTENTION_HEAD_DIMS.contains(&dh) {
        candle_maxsim::nn::attention_varlen_qkv_offsets(qkv, offsets, heads, scale, window)
    } else {
        let (part, cu) = (|i: usize| qkv.narrow(1, i * hd, hd), offsets.tensor());
        candle_maxsim::reference::nn::attention_varlen(&part(0)?, &part(1)?, &part(2)?, cu, heads, scale, window)
    }
}

/// The offsets checked against `ids [T]` and `max_positions`, and the
/// position of each packed row within its sequence (U32 `[T]`).
fn packed_positions(ids: &Tensor, offsets: &SeqOffsets, max_positions: usize) -> Result<Tensor> {
    let t =
        ids.dims1().map_err(|_| candle_core::Error::Msg(format!("ids: expected packed [T], got {:?}", ids.dims())))?;
    let c = offsets.host();
    if offsets.total() != t {
        bail!("cu_seqlens: expected offsets from 0, non-decreasing, ending at the {t} ids")
    }
    let pos: Vec<u32> = c.windows(2).flat_map(|w| 0..w[1] - w[0]).collect();
    if let Some(l) = c.windows(2).map(|w| (w[1] - w[0]) as usize).max().filter(|&l| l > max_positions) {
        bail!("ids: a sequence of {l} tokens exceeds the {max_positions} positions of the encoder")
    }
    Tensor::from_vec(pos, t, ids.device())
}

fn usize_of(c: &serde_json::Value, key: &str) -> Result<usize> {
    match c.get(key).and_then(|v| v.as_u64()) {
        Some(v) => Ok(v as usize),
        None => bail!("config.json: `{key}` must be a non-negative integer"),
    }
}

fn f64_or(c: &serde_json::Value, key: &str, default: f64) -> f64 {
    c.get(key).and_then(|v| v.as_f64()).unwrap_or(default)
}

fn gelu_kind(c: &serde_json::Value, key: &str) -> Result<Act> {
    match c.get(key).and_then(|v| v.as_str()).unwrap_or("gelu") {
        "gelu" | "gelu_python" => Ok(Act::Gelu),
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Act::GeluTanh),
        "relu" => Ok(Act::Relu),
        "silu" | "swish" => Ok(Act::Silu),
        a => bail!("config.json: unsupported `{key}` {a:?}"),
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Act {
    Gelu,
    GeluTanh,
    Relu,
    Silu,
}

impl Act {
    fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Act::Gelu => x.gelu_erf(),
            Act::GeluTanh => x.gelu(),
            Act::Relu => x.relu(),
            Act::Silu => x.silu(),
        }
    }
}

// ---------------------------------------------------------------------------
// BERT
// ---------------------------------------------------------------------------

struct BertLayer {
    q: (Tensor, Tensor),
    k: (Tensor, Tensor),
    v: (Tensor, Tensor),
    o: (Tensor, Tensor),
    attn_norm: Norm,
    up: (Tensor, Tensor),
    down: (Tensor, Tensor),
    out_norm: Norm,
}

/// BERT (`BertModel` of transformers, `model_type` "bert" and relatives).
pub struct Bert {
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    emb_norm: Norm,
    layers: Vec<BertLayer>,
    heads: usize,
    act: Act,
}

impl Bert {
    fn load(vb: VarBuilder, c: &serde_json::Value) -> Result<Self> {
        let (h, i, heads) =
            (usize_of(c, "hidden_size")?, usize_of(c, "intermediate_size")?, usize_of(c, "num_attention_heads")?);
        let (v, p) = (usize_of(c, "vocab_size")?, usize_of(c, "max_position_embeddings")?);
        let t = c.get("type_vocab_size").and_then(|x| x.as_u64()).unwrap_or(2) as usize;
        let eps = f64_or(c, "layer_norm_eps", 1e-12);
        if heads == 0 || h % heads != 0 {
            bail!("config.json: hidden_size {h} is not a multiple of num_attention_heads {heads}")
        }
        let lin = |vb: VarBuilder, o: usize, i: usize| -> Result<(Tensor, Tensor)> {
            Ok((vb.get((o, i), "weight")?, vb.get(o, "bias")?))
        };
        let e = vb.pp("embeddings");
        let layers = (0..usize_of(c, "num_hidden_layers")?)
            .map(|n| {
                let l = vb.pp(format!("encoder.layer.{n}"));
                let a = l.pp("attention");
                Ok(BertLayer {
                    q: lin(a.pp("self.query"), h, h)?,
                    k: lin(a.pp("self.key"), h, h)?,
                    v: lin(a.pp("self.value"), h, h)?,
                    o: lin(a.pp("output.dense"), h, h)?,
                    attn_norm: Norm::load(a.pp("output.LayerNorm"), h, true, eps)?,
                    up: lin(l.pp("intermediate.dense"), i, h)?,
                    down: lin(l.pp("output.dense"), h, i)?,
                    out_norm: Norm::load(l.pp("output.LayerNorm"), h, true, eps)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            word: e.get((v, h), "word_embeddings.weight")?,
            position: e.get((p, h), "position_embeddings.weight")?,
            token_type: e.get((t, h), "token_type_embeddings.weight")?,
            emb_norm: Norm::load(e.pp("LayerNorm"), h, true, eps)?,
            layers,
            heads,
            act: gelu_kind(c, "hidden_act")?,
        })
    }

    fn forward(&self, ids: &Tensor, att: &Tensor, dt: DType) -> Result<Tensor> {
        let (b, l) = ids.dims2()?;
        if l > self.position.dim(0)? {
            bail!("ids: {l} tokens exceed the {} positions of the encoder", self.position.dim(0)?)
        }
        let dev = ids.device();
        let pos = Tensor::arange(0u32, l as u32, dev)?;
        let h = self.word.dim(1)?;
        // Word + position + token type 0, each added as a bias of rows (`[B, L·H]`, then `[B·L, H]`).
        let x = self.word.embedding_rows(&ids.flatten_all()?)?.reshape((b, l * h))?;
        let x = candle_maxsim::nn::add_bias(&x, &self.position.embedding_rows(&pos)?.flatten_all()?)?;
        let x = candle_maxsim::nn::add_bias(&x.reshape((b * l, h))?, &self.token_type.get(0)?)?.reshape((b, l, h))?;
        let mut x = self.emb_norm.forward(&x.to_dtype(dt)?)?;
        let bias = padding_bias(att)?;
        for layer in &self.layers {
            let q = linear(&x, &layer.q.0, Some(&layer.q.1))?;
            let k = linear(&x, &layer.k.0, Some(&layer.k.1))?;
            let v = linear(&x, &layer.v.0, Some(&layer.v.1))?;
            let a = linear(&attention(&q, &k, &v, &bias, self.heads)?, &layer.o.0, Some(&layer.o.1))?;
            x = layer.attn_norm.forward_residual(&a, &x)?;
            let m = linear_act(&x, &layer.up.0, Some(&layer.up.1), Some(self.act))?;
            x = layer.out_norm.forward_residual(&linear(&m, &layer.down.0, Some(&layer.down.1))?, &x)?;
        }
        Ok(x)
    }
}

impl Bert {
    /// [`Encoder::forward_packed`] for BERT.
    fn forward_packed(&self, ids: &Tensor, offsets: &SeqOffsets, dt: DType) -> Result<Tensor> {
        let pos = packed_positions(ids, offsets, self.position.dim(0)?)?;
        // Token type 0 as a bias of rows: its gradient is one column-sum
        // kernel (candle's broadcast add sums one strided element per thread).
        let x = (self.word.embedding_rows(ids)? + self.position.embedding_rows(&pos)?)?;
        let x = candle_maxsim::nn::add_bias(&x, &self.token_type.get(0)?)?;
        let mut x = self.emb_norm.forward(&x.to_dtype(dt)?)?;
        let h = x.dim(1)?;
        let fused = self.act == Act::Gelu && candle_maxsim::nn::ATTENTION_HEAD_DIMS.contains(&(h / self.heads));
        for layer in &self.layers {
            if let (true, Some(b1), Some(b2)) = (fused, &layer.attn_norm.b, &layer.out_norm.b) {
                // The whole layer one graph node when training (see
                // `candle_maxsim::nn::bert_layer`), the same ops otherwise.
                let w = candle_maxsim::nn::BertLayerWeights {
                    query: (&layer.q.0, &layer.q.1),
                    key: (&layer.k.0, &layer.k.1),
                    value: (&layer.v.0, &layer.v.1),
                    output: (&layer.o.0, &layer.o.1),
                    attention_norm: (&layer.attn_norm.w, b1),
                    intermediate: (&layer.up.0, &layer.up.1),
                    down: (&layer.down.0, &layer.down.1),
                    output_norm: (&layer.out_norm.w, b2),
                };
                x = candle_maxsim::nn::bert_layer(&x, offsets, &w, self.heads, layer.attn_norm.eps)?;
                continue;
            }
            // One QKV projection (its weights stacked, a small copy): one
            // node feeding the attention, whose gradient comes back whole.
            let w = Tensor::cat(&[&layer.q.0, &layer.k.0, &layer.v.0], 0)?;
            let b = Tensor::cat(&[&layer.q.1, &layer.k.1, &layer.v.1], 0)?;
            let qkv = linear(&x, &w, Some(&b))?;
            let a = linear(&attention_packed(&qkv, offsets, self.heads, None)?, &layer.o.0, Some(&layer.o.1))?;
            x = layer.attn_norm.forward_residual(&a, &x)?;
            let m = linear_act(&x, &layer.up.0, Some(&layer.up.1), Some(self.act))?;
            x = layer.out_norm.forward_residual(&linear(&m, &layer.down.0, Some(&layer.down.1))?, &x)?;
        }
        Ok(x)
    }
}

/// Rows of an embedding table (differentiable: a gather whose backward is a row scatter-add).
trait Rows {
    fn embedding_rows(&self, ids: &Tensor) -> Result<Tensor>;
}

impl Rows for Tensor {
    fn embedding_rows(&self, ids: &Tensor) -> Result<Tensor> {
        candle_maxsim::nn::embedding(self, ids)
    }
}

// ---------------------------------------------------------------------------
// ModernBERT
// ---------------------------------------------------------------------------

struct ModernLayer {
    attn_norm: Option<Norm>,
    wqkv: Tensor,
    wo: Tensor,
    mlp_norm: Norm,
    wi: Tensor,
    wo_mlp: Tensor,
    /// Sliding window (half width) for local-attention layers.
    window: Option<usize>,
    /// Rotary base of this layer's kind.
    theta: f64,
}

/// ModernBERT (`ModernBertModel` of transformers, `model_type` "modernbert").
pub struct ModernBert {
    tok: Tensor,
    emb_norm: Norm,
    layers: Vec<ModernLayer>,
    final_norm: Norm,
    heads: usize,
    act: Act,
}

/// The rotary bases and sliding window of a ModernBERT config, in the
/// format of transformers ≥ 5 (`layer_types`, `rope_parameters`) or the
/// earlier one (`global_attn_every_n_layers`, `global_rope_theta`, `local_rope_theta`).
fn modern_layer_kinds(c: &serde_json::Value, n: usize) -> Result<Vec<(bool, f64)>> {
    let every = c.get("global_attn_every_n_layers").and_then(|v| v.as_u64()).unwrap_or(3).max(1) as usize;
    let kinds: Vec<bool> = match c.get("layer_types").and_then(|v| v.as_array()) {
        Some(t) => t.iter().map(|k| k.as_str() == Some("sliding_attention")).collect(),
        None => (0..n).map(|i| i % every != 0).collect(),
    };
    if kinds.len() != n {
        bail!("config.json: {} layer_types for {n} layers", kinds.len())
    }
    let rope = |kind: &str, old: &str, default: f64| -> f64 {
        c.get("rope_parameters")
            .and_then(|r| r.get(kind))
            .and_then(|r| r.get("rope_theta"))
            .and_then(|v| v.as_f64())
            .or_else(|| c.get(old).and_then(|v| v.as_f64()))
            .unwrap_or(default)
    };
    let (global, local) = (
        rope("full_attention", "global_rope_theta", 160_000.0),
        rope("sliding_attention", "local_rope_theta", 10_000.0),
    );
    Ok(kinds.into_iter().map(|s| (s, if s { local } else { global })).collect())
}

impl ModernBert {
    fn load(vb: VarBuilder, c: &serde_json::Value) -> Result<Self> {
        let (h, i, heads) =
            (usize_of(c, "hidden_size")?, usize_of(c, "intermediate_size")?, usize_of(c, "num_attention_heads")?);
        let n = usize_of(c, "num_hidden_layers")?;
        let v = usize_of(c, "vocab_size")?;
        let eps = c.get("norm_eps").or_else(|| c.get("layer_norm_eps")).and_then(|x| x.as_f64()).unwrap_or(1e-5);
        let norm_bias = c.get("norm_bias").and_then(|x| x.as_bool()).unwrap_or(false);
        if c.get("attention_bias").and_then(|x| x.as_bool()).unwrap_or(false)
            || c.get("mlp_bias").and_then(|x| x.as_bool()).unwrap_or(false)
        {
            bail!("config.json: ModernBERT with attention or MLP biases is not supported")
        }
        if heads == 0 || h % heads != 0 {
            bail!("config.json: hidden_size {h} is not a multiple of num_attention_heads {heads}")
        }
        let half = usize_of(c, "local_attention").unwrap_or(128) / 2;
        let kinds = modern_layer_kinds(c, n)?;
        let layers = kinds
            .iter()
            .enumerate()
            .map(|(k, &(sliding, theta))| {
                let l = vb.pp(format!("layers.{k}"));
                Ok(ModernLayer {
                    // Layer 0 takes the embeddings' norm as its attention norm.
                    attn_norm: if k == 0 { None } else { Some(Norm::load(l.pp("attn_norm"), h, norm_bias, eps)?) },
                    wqkv: l.get((3 * h, h), "attn.Wqkv.weight")?,
                    wo: l.get((h, h), "attn.Wo.weight")?,
                    mlp_norm: Norm::load(l.pp("mlp_norm"), h, norm_bias, eps)?,
                    wi: l.get((2 * i, h), "mlp.Wi.weight")?,
                    wo_mlp: l.get((h, i), "mlp.Wo.weight")?,
                    window: sliding.then_some(half),
                    theta,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            tok: vb.get((v, h), "embeddings.tok_embeddings.weight")?,
            emb_norm: Norm::load(vb.pp("embeddings.norm"), h, norm_bias, eps)?,
            layers,
            final_norm: Norm::load(vb.pp("final_norm"), h, norm_bias, eps)?,
            heads,
            act: gelu_kind(c, "hidden_activation")?,
        })
    }

    /// `(cos, sin)` `[L, dh]` F32 of rotary base `theta`.
    fn rotary(theta: f64, l: usize, dh: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
        let inv: Vec<f32> = (0..dh / 2).map(|j| (1.0 / theta.powf(2.0 * j as f64 / dh as f64)) as f32).collect();
        let inv = Tensor::from_vec(inv, (1, dh / 2), dev)?;
        let pos = Tensor::arange(0u32, l as u32, dev)?.to_dtype(DType::F32)?.reshape((l, 1))?;
        let f = pos.broadcast_mul(&inv)?;
        let f = Tensor::cat(&[&f, &f], 1)?;
        Ok((f.cos()?, f.sin()?))
    }

    fn forward(&self, ids: &Tensor, att: &Tensor, dt: DType) -> Result<Tensor> {
        let (b, l) = ids.dims2()?;
        let dev = ids.device();
        let mut x =
            self.emb_norm.forward(&self.tok.embedding_rows(&ids.flatten_all()?)?.reshape((b, l, ()))?.to_dtype(dt)?)?;
        let h = x.dim(2)?;
        let dh = h / self.heads;
        let pad = padding_bias(att)?;
        // (rope theta, window) -> (attention bias, (cos, sin)).
        type LayerTables = (f64, Option<usize>, Tensor, (Tensor, Tensor));
        let mut cache: Vec<LayerTables> = Vec::new();
        for layer in &self.layers {
            // The bias (padding, and the sliding window) and rotary tables of this layer's kind.
            if !cache.iter().any(|c| c.0 == layer.theta && c.1 == layer.window) {
                let bias = match layer.window {
                    None => pad.clone(),
                    Some(w) => {
                        let near: Vec<f32> =
                            (0..l * l).map(|e| if (e / l).abs_diff(e % l) <= w { 0.0 } else { f32::MIN }).collect();
                        pad.broadcast_add(&Tensor::from_vec(near, (1, 1, l, l), dev)?)?.clamp(f32::MIN, 0f32)?
                    }
                };
                cache.push((layer.theta, layer.window, bias, Self::rotary(layer.theta, l, dh, dev)?));
            }
            let (_, _, bias, (cos, sin)) = cache.iter().find(|c| c.0 == layer.theta && c.1 == layer.window).unwrap();
            let xn = match &layer.attn_norm {
                Some(n) => n.forward(&x)?,
                None => x.clone(),
            };
            let qkv = linear(&xn, &layer.wqkv, None)?.reshape((b, l, 3, self.heads, dh))?;
            let part = |k: usize| qkv.narrow(2, k, 1)?.squeeze(2)?.transpose(1, 2); // [B, H, L, dh]
            let rot = |t: Tensor| -> Result<Tensor> {
                let t32 = t.to_dtype(DType::F32)?;
                let (x1, x2) = (t32.narrow(D::Minus1, 0, dh / 2)?, t32.narrow(D::Minus1, dh / 2, dh / 2)?);
                let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
                (t32.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?.to_dtype(t.dtype())
            };
            // Back to heads side by side, the layout the attention op takes.
            let merge = |t: Tensor| t.transpose(1, 2)?.reshape((b, l, h));
            let (q, k, v) = (merge(rot(part(0)?)?)?, merge(rot(part(1)?)?)?, merge(part(2)?)?);
            x = (&x + linear(&attention(&q, &k, &v, bias, self.heads)?, &layer.wo, None)?)?;
            let up = linear(&layer.mlp_norm.forward(&x)?, &layer.wi, None)?;
            let i = up.dim(2)? / 2;
            let m = (self.act.apply(&up.narrow(2, 0, i)?)? * up.narrow(2, i, i)?)?;
            x = (&x + linear(&m, &layer.wo_mlp, None)?)?;
        }
        self.final_norm.forward(&x)
    }
}

impl ModernBert {
    /// [`Encoder::forward_packed`] for ModernBERT: the rotary tables
    /// gathered at each row's position, q and k rotated in the QKV
    /// projection ([`candle_maxsim::nn::rotary_qk`]), the attention on it
    /// whole, the GeGLU one op: each block a few graph nodes, not tens.
    fn forward_packed(&self, ids: &Tensor, offsets: &SeqOffsets, dt: DType) -> Result<Tensor> {
        let pos = packed_positions(ids, offsets, usize::MAX)?;
        let dev = ids.device();
        let mut x = self.emb_norm.forward(&self.tok.embedding_rows(ids)?.to_dtype(dt)?)?;
        let h = x.dim(1)?;
        let dh = h / self.heads;
        let longest = offsets.host().windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
        let mut tables: Vec<(f64, (Tensor, Tensor))> = Vec::new();
        for layer in &self.layers {
            if !tables.iter().any(|c| c.0 == layer.theta) {
                // [T, dh/2] F32: the angle of each row's position per frequency.
                let (cos, sin) = Self::rotary(layer.theta, longest.max(1), dh, dev)?;
                let at = |x: Tensor| x.narrow(1, 0, dh / 2)?.contiguous()?.index_select(&pos, 0);
                tables.push((layer.theta, (at(cos)?, at(sin)?)));
            }
            let (cos, sin) = &tables.iter().find(|c| c.0 == layer.theta).unwrap().1;
            if self.act == Act::Gelu && candle_maxsim::nn::ATTENTION_HEAD_DIMS.contains(&dh) {
                // The whole layer one graph node when training (see
                // `candle_maxsim::nn::modernbert_layer`), the same ops otherwise.
                let w = candle_maxsim::nn::ModernBertLayerWeights {
                    attention_norm: layer.attn_norm.as_ref().map(|n| (&n.w, n.b.as_ref())),
                    wqkv: &layer.wqkv,
                    wo: &layer.wo,
                    mlp_norm: (&layer.mlp_norm.w, layer.mlp_norm.b.as_ref()),
                    wi: &layer.wi,
                    wo_mlp: &layer.wo_mlp,
                };
                let eps = layer.mlp_norm.eps;
                x = candle_maxsim::nn::modernbert_layer(&x, offsets, &w, self.heads, layer.window, (cos, sin), eps)?;
                continue;
            }
            let xn = match &layer.attn_norm {
                Some(n) => n.forward(&x)?,
                None => x.clone(),
            };
            let qkv = candle_maxsim::nn::rotary_qk(&linear(&xn, &layer.wqkv, None)?, cos, sin, self.heads)?;
            let a = attention_packed(&qkv, offsets, self.heads, layer.window)?;
            x = (&x + linear(&a, &layer.wo, None)?)?;
            let up = linear(&layer.mlp_norm.forward(&x)?, &layer.wi, None)?;
            let m = if self.act == Act::Gelu {
                candle_maxsim::nn::geglu(&up)?
            } else {
                let i = up.dim(1)? / 2;
                (self.act.apply(&up.narrow(1, 0, i)?)? * up.narrow(1, i, i)?)?
            };
            x = (&x + linear(&m, &layer.wo_mlp, None)?)?;
        }
        self.final_norm.forward(&x)
    }
}

// ---------------------------------------------------------------------------

/// A BERT or ModernBERT encoder.
pub enum Encoder {
    /// `model_type` "bert" (and BERT-like: "distilbert" is not).
    Bert(Bert),
    /// `model_type` "modernbert".
    ModernBert(ModernBert),
}

impl Encoder {
    /// The encoder described by `config` (a transformers `config.json`),
    /// its weights under `vb` (without a `bert.` / `model.` prefix: see
    /// [`weight_prefix`]).
    pub fn load(vb: VarBuilder, config: &serde_json::Value) -> Result<Self> {
        match config.get("model_type").and_then(|v| v.as_str()).unwrap_or("bert") {
            "modernbert" => Ok(Encoder::ModernBert(ModernBert::load(vb, config)?)),
            "bert" | "roberta" | "xlm-roberta" | "electra" => Ok(Encoder::Bert(Bert::load(vb, config)?)),
            t => bail!("config.json: unsupported model_type {t:?} (BERT and ModernBERT are)"),
        }
    }

    /// Contextual token embeddings `[B, L, H]` in `dtype` of `ids [B, L]`
    /// U32, attending to the positions where `attention [B, L]` U8 is set.
    pub fn forward(&self, ids: &Tensor, attention: &Tensor, dtype: DType) -> Result<Tensor> {
        match self {
            Encoder::Bert(m) => m.forward(ids, attention, dtype),
            Encoder::ModernBert(m) => m.forward(ids, attention, dtype),
        }
    }

    /// Contextual token embeddings `[T, H]` in `dtype` of a packed batch:
    /// `ids [T]` U32 holding the sequences one after another, `cu_seqlens`
    /// U32 `[B+1]` the first row of each (0, non-decreasing, ending at T).
    /// No padding anywhere: the rows of [`Encoder::forward`] at its attended
    /// positions, with attention through `candle_maxsim::nn::attention_varlen`
    /// (head dims 32, 64 and 128; others composed of candle ops).
    pub fn forward_packed(&self, ids: &Tensor, cu_seqlens: &Tensor, dtype: DType) -> Result<Tensor> {
        self.forward_packed_offsets(ids, &SeqOffsets::new(cu_seqlens)?, dtype)
    }

    /// [`Encoder::forward_packed`] with offsets already on the host and the
    /// device ([`SeqOffsets::from_slice`]): `cu_seqlens` as a tensor is
    /// copied to the host first, which waits for the device's queued work;
    /// these do not, so the host can prepare the next batch meanwhile.
    pub fn forward_packed_offsets(&self, ids: &Tensor, offsets: &SeqOffsets, dtype: DType) -> Result<Tensor> {
        match self {
            Encoder::Bert(m) => m.forward_packed(ids, offsets, dtype),
            Encoder::ModernBert(m) => m.forward_packed(ids, offsets, dtype),
        }
    }

    /// The token embedding table `[V, H]`.
    pub fn token_embeddings(&self) -> &Tensor {
        match self {
            Encoder::Bert(m) => &m.word,
            Encoder::ModernBert(m) => &m.tok,
        }
    }
}

impl Module for Encoder {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let att = Tensor::ones(ids.shape(), DType::U8, ids.device())?;
        Encoder::forward(self, ids, &att, self.token_embeddings().dtype())
    }
}

/// The prefix of the encoder's weights in a checkpoint's tensor names:
/// `"bert."`, `"model."` (a ModernBERT saved with its head) or none.
pub fn weight_prefix(names: &[String], model_type: &str) -> &'static str {
    let probe = if model_type == "modernbert" {
        "embeddings.tok_embeddings.weight"
    } else {
        "embeddings.word_embeddings.weight"
    };
    for p in ["", "bert.", "model.", "roberta."] {
        if names.iter().any(|n| n == &format!("{p}{probe}")) {
            return p;
        }
    }
    ""
}
