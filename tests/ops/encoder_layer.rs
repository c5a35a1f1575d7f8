//! `nn::bert_layer` (src/ops/bert_layer.rs) against the same layer composed
//! of the crate's public ops, and in F32 against `reference`'s ops in F64:
//! forward values and the gradients of the input and of every weight.

use crate::common::*;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_maxsim::{self as ms, reference};

/// The sixteen weights of a layer of width `c`, intermediate width `i`, as
/// F32 variables on `dev` (linear weights small, norm weights near 1).
fn layer_vars(c: usize, i: usize, dev: &Device) -> Result<Vec<Var>> {
    let shapes: [&[usize]; 16] = [
        &[c, c],
        &[c],
        &[c, c],
        &[c],
        &[c, c],
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
    shapes
        .iter()
        .enumerate()
        .map(|(k, s)| {
            let r = Tensor::randn(0f32, 1., *s, &Device::Cpu)?;
            // Norm weights (8 and 14) near 1, everything else small.
            let t = if k == 8 || k == 14 { r.affine(0.1, 1.0)? } else { r.affine(0.1, 0.0)? };
            Var::from_tensor(&t.to_device(dev)?)
        })
        .collect()
}

/// The vars in `BertLayerWeights`' fields (q, k, v, o, norm 1, up, down, norm 2; weight then bias).
fn weights(v: &[Tensor]) -> ms::nn::BertLayerWeights<'_> {
    ms::nn::BertLayerWeights {
        query: (&v[0], &v[1]),
        key: (&v[2], &v[3]),
        value: (&v[4], &v[5]),
        output: (&v[6], &v[7]),
        attention_norm: (&v[8], &v[9]),
        intermediate: (&v[10], &v[11]),
        down: (&v[12], &v[13]),
        output_norm: (&v[14], &v[15]),
    }
}

/// The layer composed of the public ops (`reference`'s in F64 when `naive`).
fn composed(x: &Tensor, cu: &ms::nn::SeqOffsets, v: &[Tensor], heads: usize, eps: f64, naive: bool) -> Result<Tensor> {
    let dt = x.dtype();
    let scale = ((x.dim(1)? / heads) as f64).powf(-0.5);
    let wqkv = Tensor::cat(&[&v[0], &v[2], &v[4]], 0)?.to_dtype(dt)?;
    let bqkv = Tensor::cat(&[&v[1], &v[3], &v[5]], 0)?;
    if naive {
        use reference::nn as r;
        let qkv = r::linear(x, &wqkv, Some(&bqkv))?;
        let c = x.dim(1)?;
        let part = |k: usize| qkv.narrow(1, k * c, c);
        let a = r::attention_varlen(&part(0)?, &part(1)?, &part(2)?, cu.tensor(), heads, scale, None)?;
        let o = r::linear(&a, &v[6].to_dtype(dt)?, Some(&v[7]))?;
        let h1 = r::layer_norm(&(o + x)?, &v[8], Some(&v[9]), eps)?;
        let u = r::linear_gelu(&h1, &v[10].to_dtype(dt)?, &v[11])?;
        let d = r::linear(&u, &v[12].to_dtype(dt)?, Some(&v[13]))?;
        return r::layer_norm(&(d + h1)?, &v[14], Some(&v[15]), eps);
    }
    use ms::nn as n;
    let qkv = n::linear(x, &wqkv, Some(&bqkv))?;
    let a = n::attention_varlen_qkv_offsets(&qkv, cu, heads, scale, None)?;
    let o = n::linear(&a, &v[6].to_dtype(dt)?, Some(&v[7]))?;
    let h1 = n::residual_layer_norm(&o, x, &v[8], Some(&v[9]), eps)?;
    let u = n::linear_gelu(&h1, &v[10].to_dtype(dt)?, &v[11])?;
    let d = n::linear(&u, &v[12].to_dtype(dt)?, Some(&v[13]))?;
    n::residual_layer_norm(&d, &h1, &v[14], Some(&v[15]), eps)
}

/// `(y, gradients of x and of the 16 weights)` of `sum(y ⊙ up)` in F64.
fn run(y: &Tensor, up: &Tensor, x: &Var, vars: &[Var]) -> Result<(Tensor, Vec<Tensor>)> {
    let g: GradStore = y.to_dtype(DType::F64)?.mul(&up.to_device(y.device())?)?.sum_all()?.backward()?;
    let cpu = Device::Cpu;
    let grads = std::iter::once(x)
        .chain(vars)
        .map(|v| g.get(v.as_tensor()).expect("a gradient").to_device(&cpu)?.to_dtype(DType::F64))
        .collect::<Result<Vec<_>>>()?;
    Ok((y.to_device(&cpu)?, grads))
}

/// `a` against the gradient `b` of the same set `all`: the error relative
/// to `b`'s size, or to `floor` times the largest gradient's where that is
/// larger. The key bias's gradient is zero in exact arithmetic (shifting
/// every key's logit by the same q·b leaves the softmax as it is), so only
/// its rounding noise is compared.
fn close_grad(what: &str, a: &Tensor, b: &Tensor, all: &[Tensor], tol: f64, floor: f64) -> Result<()> {
    let largest = all.iter().map(max_abs).collect::<Result<Vec<_>>>()?.into_iter().fold(0.0, f64::max);
    let e = max_abs_diff(a, b)? / max_abs(b)?.max(floor * largest);
    assert!(e < tol, "{what}: err {e:e} >= {tol:e}");
    Ok(())
}

/// Ragged sequences (one of a single row) of width 64, two heads of 32, an
/// intermediate width of 96; every dtype. The fused node's forward equals
/// the composed ops' exactly, and so do its gradients on the CPU (to
/// rounding on CUDA); in F32 both match the F64 reference. A second
/// backward of the same output (its stash already taken, the forward
/// recomputed) gives the same gradients.
fn bert_layer_matches_composed(dev: &Device) -> Result<()> {
    in_pools(|| bert_layer_cases(dev))
}

/// `f` in a rayon pool of one thread and of eight: `linear`'s CPU product
/// is tiled from five threads (the layers' backward must recompute what
/// their forward ran either way).
fn in_pools(f: impl Fn() -> Result<()> + Sync) -> Result<()> {
    for threads in [1, 8] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().map_err(candle_core::Error::wrap)?;
        pool.install(&f)?;
    }
    Ok(())
}

fn bert_layer_cases(dev: &Device) -> Result<()> {
    let (c, i, heads, eps) = (64, 96, 2, 1e-12);
    let lens = [1u32, 37, 5, 64];
    let cu: Vec<u32> =
        std::iter::once(0).chain(lens.iter().scan(0, |a, &l| Some(*a + l).inspect(|s| *a = *s))).collect();
    let t = *cu.last().unwrap() as usize;
    let cu_dev = ms::nn::SeqOffsets::from_slice(&cu, dev)?;
    for (dt, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 1e-2)] {
        let what = format!("bert_layer {dt:?} on {dev:?}");
        let x0 = randn(&[t, c], dt, &Device::Cpu)?;
        let up = randn(&[t, c], DType::F64, &Device::Cpu)?;
        let vars = layer_vars(c, i, dev)?;
        let vt: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let x = Var::from_tensor(&x0.to_device(dev)?)?;
        let y = ms::nn::bert_layer(x.as_tensor(), &cu_dev, &weights(&vt), heads, eps)?;
        assert_eq!((y.dtype(), y.dims()), (dt, &[t, c][..]), "{what}");
        let (yf, gf) = run(&y, &up, &x, &vars)?;
        let (_, again) = run(&y, &up, &x, &vars)?;
        let yc = composed(x.as_tensor(), &cu_dev, &vt, heads, eps, false)?;
        let (yc, gc) = run(&yc, &up, &x, &vars)?;
        assert_eq!(max_abs_diff(&yf, &yc)?, 0.0, "{what}: forward differs from the composed ops");
        let names = ["x", "wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo", "n1w", "n1b", "wup", "bup", "wdown", "bdown"];
        let names = names.iter().chain(&["n2w", "n2b"]);
        // The same products and kernels in the same order: on the CPU the
        // same bits. On CUDA judged as rounding: 16-bit noise is ~4e-3 of a
        // value, so a gradient near zero is judged against 1 % of the largest.
        let (g_tol, floor) = if dt == DType::F32 { (1e-5, 1e-3) } else { (grad_tol(dt), 1e-2) };
        for (k, name) in names.enumerate() {
            let what = format!("{what} grad {name} vs composed");
            if dev.is_cpu() {
                assert_eq!(max_abs_diff(&gf[k], &gc[k])?, 0.0, "{what}");
            } else {
                close_grad(&what, &gf[k], &gc[k], &gc, g_tol, floor)?;
            }
            assert_eq!(max_abs_diff(&again[k], &gf[k])?, 0.0, "{what}, second backward");
        }
        if dt == DType::F32 {
            let f64v = |t: &Tensor| Var::from_tensor(&t.to_device(&Device::Cpu)?.to_dtype(DType::F64)?);
            let xn = f64v(x.as_tensor())?;
            let vn = vars.iter().map(|v| f64v(v.as_tensor())).collect::<Result<Vec<_>>>()?;
            let vnt: Vec<Tensor> = vn.iter().map(|v| v.as_tensor().clone()).collect();
            let cu_cpu = ms::nn::SeqOffsets::from_slice(&cu, &Device::Cpu)?;
            let yn = composed(xn.as_tensor(), &cu_cpu, &vnt, heads, eps, true)?;
            let (yn, gn) = run(&yn, &up, &xn, &vn)?;
            assert_close(&format!("{what} forward vs F64"), &yf, &yn, tol)?;
            for (k, (a, b)) in gf.iter().zip(&gn).enumerate() {
                close_grad(&format!("{what} gradient {k} vs F64"), a, b, &gn, 1e-4, 1e-3)?;
            }
        }
    }
    // No rows at all: an empty output and zero gradients.
    {
        let vars = layer_vars(c, i, dev)?;
        let vt: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let x = Var::from_tensor(&Tensor::zeros((0, c), DType::F32, dev)?)?;
        let y =
            ms::nn::bert_layer(x.as_tensor(), &ms::nn::SeqOffsets::from_slice(&[0], dev)?, &weights(&vt), heads, eps)?;
        assert_eq!(y.dims(), &[0, c]);
        let g = y.sum_all()?.backward()?;
        for v in &vars {
            if let Some(gv) = g.get(v.as_tensor()) {
                assert_eq!(max_abs_diff(gv, &gv.zeros_like()?)?, 0.0, "a weight's gradient from no rows");
            }
        }
    }
    // Bad input names the argument.
    let vars = layer_vars(c, i, dev)?;
    let mut vt: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let x = randn(&[t, c], DType::F32, dev)?;
    expect_err(ms::nn::bert_layer(&x.unsqueeze(0)?, &cu_dev, &weights(&vt), heads, eps), "x");
    expect_err(ms::nn::bert_layer(&x.to_dtype(DType::F64)?, &cu_dev, &weights(&vt), heads, eps), "x");
    expect_err(ms::nn::bert_layer(&x, &cu_dev, &weights(&vt), 3, eps), "heads");
    let short = ms::nn::SeqOffsets::from_slice(&[0, 5], dev)?;
    expect_err(ms::nn::bert_layer(&x, &short, &weights(&vt), heads, eps), "cu_seqlens");
    vt[12] = randn(&[c, c], DType::F32, dev)?;
    expect_err(ms::nn::bert_layer(&x, &cu_dev, &weights(&vt), heads, eps), "weights");
    Ok(())
}

test_device!(bert_layer_matches_composed, bert_layer_matches_composed_cpu, bert_layer_matches_composed_cuda);

/// A ModernBERT layer's weights as F32 variables: attention norm (with a
/// bias when `bias`; absent when `first`), wqkv, wo, MLP norm, wi, wo_mlp.
struct Modern {
    norm1: Option<(Var, Option<Var>)>,
    wqkv: Var,
    wo: Var,
    norm2: (Var, Option<Var>),
    wi: Var,
    wo_mlp: Var,
}

impl Modern {
    fn new(c: usize, i: usize, first: bool, bias: bool, dev: &Device) -> Result<Self> {
        let var = |s: &[usize], a: f64, b: f64| -> Result<Var> {
            Var::from_tensor(&Tensor::randn(0f32, 1., s, &Device::Cpu)?.affine(a, b)?.to_device(dev)?)
        };
        let norm = || -> Result<(Var, Option<Var>)> {
            Ok((var(&[c], 0.1, 1.0)?, if bias { Some(var(&[c], 0.1, 0.0)?) } else { None }))
        };
        Ok(Self {
            norm1: if first { None } else { Some(norm()?) },
            wqkv: var(&[3 * c, c], 0.1, 0.0)?,
            wo: var(&[c, c], 0.1, 0.0)?,
            norm2: norm()?,
            wi: var(&[2 * i, c], 0.1, 0.0)?,
            wo_mlp: var(&[c, i], 0.1, 0.0)?,
        })
    }
    fn vars(&self) -> Vec<&Var> {
        let mut v = Vec::new();
        if let Some((w, b)) = &self.norm1 {
            v.push(w);
            v.extend(b);
        }
        v.extend([&self.wqkv, &self.wo, &self.norm2.0]);
        v.extend(&self.norm2.1);
        v.extend([&self.wi, &self.wo_mlp]);
        v
    }
    fn weights(&self) -> ms::nn::ModernBertLayerWeights<'_> {
        ms::nn::ModernBertLayerWeights {
            attention_norm: self.norm1.as_ref().map(|(w, b)| (w.as_tensor(), b.as_ref().map(|b| b.as_tensor()))),
            wqkv: self.wqkv.as_tensor(),
            wo: self.wo.as_tensor(),
            mlp_norm: (self.norm2.0.as_tensor(), self.norm2.1.as_ref().map(|b| b.as_tensor())),
            wi: self.wi.as_tensor(),
            wo_mlp: self.wo_mlp.as_tensor(),
        }
    }
}

/// The ModernBERT layer composed of the public ops (`reference`'s in F64 when `naive`).
#[allow(clippy::too_many_arguments)]
fn modern_composed(
    x: &Tensor,
    cu: &ms::nn::SeqOffsets,
    w: &ms::nn::ModernBertLayerWeights<'_>,
    heads: usize,
    window: Option<usize>,
    (cos, sin): (&Tensor, &Tensor),
    eps: f64,
    naive: bool,
) -> Result<Tensor> {
    let dt = x.dtype();
    let scale = ((x.dim(1)? / heads) as f64).powf(-0.5);
    let c = x.dim(1)?;
    if naive {
        use reference::nn as r;
        let xn = match w.attention_norm {
            Some((nw, nb)) => r::layer_norm(x, nw, nb, eps)?,
            None => x.clone(),
        };
        let qkv = r::rotary_qk(&r::linear(&xn, &w.wqkv.to_dtype(dt)?, None)?, cos, sin, heads)?;
        let part = |k: usize| qkv.narrow(1, k * c, c);
        let a = r::attention_varlen(&part(0)?, &part(1)?, &part(2)?, cu.tensor(), heads, scale, window)?;
        let x1 = (x + r::linear(&a, &w.wo.to_dtype(dt)?, None)?)?;
        let up = r::linear(&r::layer_norm(&x1, w.mlp_norm.0, w.mlp_norm.1, eps)?, &w.wi.to_dtype(dt)?, None)?;
        return &x1 + r::linear(&r::geglu(&up)?, &w.wo_mlp.to_dtype(dt)?, None)?;
    }
    use ms::nn as n;
    let xn = match w.attention_norm {
        Some((nw, nb)) => n::layer_norm(x, nw, nb, eps)?,
        None => x.clone(),
    };
    let qkv = n::rotary_qk(&n::linear(&xn, &w.wqkv.to_dtype(dt)?, None)?, cos, sin, heads)?;
    let a = n::attention_varlen_qkv_offsets(&qkv, cu, heads, scale, window)?;
    let x1 = (x + n::linear(&a, &w.wo.to_dtype(dt)?, None)?)?;
    let up = n::linear(&n::layer_norm(&x1, w.mlp_norm.0, w.mlp_norm.1, eps)?, &w.wi.to_dtype(dt)?, None)?;
    &x1 + n::linear(&n::geglu(&up)?, &w.wo_mlp.to_dtype(dt)?, None)?
}

/// `modernbert_layer` as `bert_layer` is tested: ragged sequences, two heads
/// of 32, an intermediate width of 48, the first layer (no attention norm)
/// and a later one, norms with and without a bias, a sliding window and
/// none, every dtype; forward equal to the composed ops, gradients equal on
/// the CPU (to rounding on CUDA), in F32 within 1e-4 of the F64 reference.
fn modernbert_layer_matches_composed(dev: &Device) -> Result<()> {
    in_pools(|| modernbert_layer_cases(dev))
}

fn modernbert_layer_cases(dev: &Device) -> Result<()> {
    let (c, i, heads, eps) = (64, 48, 2, 1e-5);
    let lens = [1u32, 37, 5, 64];
    let cu: Vec<u32> =
        std::iter::once(0).chain(lens.iter().scan(0, |a, &l| Some(*a + l).inspect(|s| *a = *s))).collect();
    let t = *cu.last().unwrap() as usize;
    let offsets = ms::nn::SeqOffsets::from_slice(&cu, dev)?;
    let angle = (Tensor::rand(0f32, 1., (t, c / heads / 2), &Device::Cpu)? * 30.0)?;
    let (cos, sin) = (angle.cos()?.to_device(dev)?, angle.sin()?.to_device(dev)?);
    for (first, bias, window) in [(true, false, None), (false, false, Some(8)), (false, true, None)] {
        for (dt, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 1e-2)] {
            let what = format!("modernbert_layer first {first} bias {bias} window {window:?} {dt:?} on {dev:?}");
            let m = Modern::new(c, i, first, bias, dev)?;
            let vars: Vec<Var> = m.vars().into_iter().cloned().collect();
            let x = Var::from_tensor(&randn(&[t, c], dt, &Device::Cpu)?.to_device(dev)?)?;
            let up = randn(&[t, c], DType::F64, &Device::Cpu)?;
            let y = ms::nn::modernbert_layer(x.as_tensor(), &offsets, &m.weights(), heads, window, (&cos, &sin), eps)?;
            assert_eq!((y.dtype(), y.dims()), (dt, &[t, c][..]), "{what}");
            let (yf, gf) = run(&y, &up, &x, &vars)?;
            let (_, again) = run(&y, &up, &x, &vars)?;
            let yc = modern_composed(x.as_tensor(), &offsets, &m.weights(), heads, window, (&cos, &sin), eps, false)?;
            let (yc, gc) = run(&yc, &up, &x, &vars)?;
            assert_eq!(max_abs_diff(&yf, &yc)?, 0.0, "{what}: forward differs from the composed ops");
            let (g_tol, floor) = if dt == DType::F32 { (1e-5, 1e-3) } else { (grad_tol(dt), 1e-2) };
            for k in 0..gf.len() {
                let what = format!("{what} gradient {k} vs composed");
                if dev.is_cpu() {
                    assert_eq!(max_abs_diff(&gf[k], &gc[k])?, 0.0, "{what}");
                } else {
                    close_grad(&what, &gf[k], &gc[k], &gc, g_tol, floor)?;
                }
                assert_eq!(max_abs_diff(&again[k], &gf[k])?, 0.0, "{what}, second backward");
            }
            if dt == DType::F32 {
                let f64v = |v: &Var| Var::from_tensor(&v.as_tensor().to_device(&Device::Cpu)?.to_dtype(DType::F64)?);
                let xn = f64v(&x)?;
                let vn = vars.iter().map(f64v).collect::<Result<Vec<_>>>()?;
                let mut it = vn.iter().map(|v| v.as_tensor());
                let mut take = || it.next().expect("a weight");
                let norm1 = if first { None } else { Some((take(), if bias { Some(take()) } else { None })) };
                let (wqkv, wo, n2w) = (take(), take(), take());
                let n2b = if bias { Some(take()) } else { None };
                let wn = ms::nn::ModernBertLayerWeights {
                    attention_norm: norm1,
                    wqkv,
                    wo,
                    mlp_norm: (n2w, n2b),
                    wi: take(),
                    wo_mlp: take(),
                };
                let cpu = ms::nn::SeqOffsets::from_slice(&cu, &Device::Cpu)?;
                let rot = (cos.to_device(&Device::Cpu)?, sin.to_device(&Device::Cpu)?);
                let yn = modern_composed(xn.as_tensor(), &cpu, &wn, heads, window, (&rot.0, &rot.1), eps, true)?;
                let (yn, gn) = run(&yn, &up, &xn, &vn)?;
                assert_close(&format!("{what} forward vs F64"), &yf, &yn, tol)?;
                for (k, (a, b)) in gf.iter().zip(&gn).enumerate() {
                    close_grad(&format!("{what} gradient {k} vs F64"), a, b, &gn, 1e-4, 1e-3)?;
                }
            }
        }
    }
    let m = Modern::new(c, i, false, false, dev)?;
    let mut w = m.weights();
    let bad = randn(&[c, c], DType::F32, dev)?;
    w.wi = &bad;
    let x = randn(&[t, c], DType::F32, dev)?;
    expect_err(ms::nn::modernbert_layer(&x, &offsets, &w, heads, None, (&cos, &sin), eps), "weights");
    let w = m.weights();
    let run = |x: &Tensor, offsets: &ms::nn::SeqOffsets, heads: usize, window: Option<usize>| {
        ms::nn::modernbert_layer(x, offsets, &w, heads, window, (&cos, &sin), eps)
    };
    expect_err(run(&x.to_dtype(DType::F64)?, &offsets, heads, None), "x");
    expect_err(run(&x.unsqueeze(0)?, &offsets, heads, None), "x");
    expect_err(run(&x, &offsets, heads, Some(0)), "window");
    expect_err(run(&x, &ms::nn::SeqOffsets::from_slice(&[0, 5], dev)?, heads, None), "cu_seqlens");
    expect_err(run(&x, &offsets, 4, None), "cos");
    Ok(())
}

test_device!(
    modernbert_layer_matches_composed,
    modernbert_layer_matches_composed_cpu,
    modernbert_layer_matches_composed_cuda
);
