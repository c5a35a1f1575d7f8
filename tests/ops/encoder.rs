//! `attention_softmax`, `attention`, `linear`, `layer_norm`, `embedding` and `rotary_qk`
//! (src/ops/encoder.rs, src/ops/linear.rs, src/ops/rows.rs) against their naive versions in `reference`: forward
//! values and, through candle's autograd of the naive side in F64, every
//! gradient.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_maxsim::{self as ms, reference};

/// A random additive mask `[b, 1, lb, lk]`: 0 where attended, `f32::MIN`
/// elsewhere, every row keeping its first key (plus, in batch 0, a fully
/// masked row when `lb > 1`).
fn mask_bias(b: usize, lb: usize, lk: usize, dev: &Device) -> Result<Tensor> {
    let keep = Tensor::rand(0f32, 1f32, (b, 1, lb, lk), &Device::Cpu)?.ge(0.3)?.to_dtype(DType::F32)?;
    let mut v: Vec<f32> = keep.flatten_all()?.to_vec1()?;
    for (i, x) in v.iter_mut().enumerate() {
        let (row, col) = (i / lk, i % lk);
        *x = if col == 0 || *x > 0.5 { 0.0 } else { f32::MIN };
        if lb > 1 && row == 1 {
            *x = f32::MIN;
        }
    }
    Tensor::from_vec(v, (b, 1, lb, lk), dev)
}

fn softmax_case(
    dev: &Device,
    (b, h, lq, lk): (usize, usize, usize, usize),
    lb: usize,
    dt: DType,
    tol: f64,
) -> Result<()> {
    let cpu = Device::Cpu;
    let what = format!("attention_softmax [{b}, {h}, {lq}, {lk}] bias rows {lb} {dt:?} on {dev:?}");
    let s = (randn(&[b, h, lq, lk], DType::F32, &cpu)? * 3.0)?.to_dtype(dt)?;
    let bias = mask_bias(b, lb, lk, &cpu)?;
    let w = randn(&[b, h, lq, lk], dt, &cpu)?.to_dtype(DType::F64)?;
    let scale = 0.125;
    let sv = Var::from_tensor(&s.to_device(dev)?)?;
    let p = ms::nn::attention_softmax(sv.as_tensor(), &bias.to_device(dev)?, scale)?;
    assert_eq!(p.dtype(), dt);
    let g = p.to_dtype(DType::F64)?.mul(&w.to_device(dev)?)?.sum_all()?.backward()?;
    let gs = g.get(sv.as_tensor()).expect("grad of scores").to_device(&cpu)?;
    let sn = Var::from_tensor(&s.to_dtype(DType::F64)?)?;
    let pn = reference::nn::attention_softmax(sn.as_tensor(), &bias, scale)?;
    let gn = pn.mul(&w)?.sum_all()?.backward()?.get(sn.as_tensor()).expect("grad").clone();
    assert_close(&format!("{what} forward"), &p, &pn, tol)?;
    assert_close(&format!("{what} grad"), &gs, &gn, tol)?;
    Ok(())
}

/// Key lengths within one and across several 32-lane passes, a bias per
/// batch (`[B, 1, 1, Lk]`, BERT's padding) and per query row (ModernBERT's
/// window), masked keys and a fully masked row.
fn attention_softmax_matches_reference(dev: &Device) -> Result<()> {
    for (dt, tol) in [(DType::F32, 1e-5), (DType::F16, 2e-3), (DType::BF16, 1e-2)] {
        for (shape, lb) in [((2, 3, 5, 7), 1), ((2, 2, 9, 40), 9), ((3, 4, 33, 180), 1), ((1, 2, 4, 700), 4)] {
            softmax_case(dev, shape, lb, dt, tol)?;
        }
    }
    Ok(())
}

test_device!(
    attention_softmax_matches_reference,
    attention_softmax_matches_reference_cpu,
    attention_softmax_matches_reference_cuda
);

/// Multi-head attention against the composed reference in F64: the fused
/// CPU op (F32, no gradient), and the composed path with a gradient, on
/// every dtype; batch and per-row biases with masked keys, one head and
/// several, key lengths of one and of several 32-lane passes.
fn attention_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for (dt, tol) in [(DType::F32, 1e-5), (DType::F16, 3e-3), (DType::BF16, 2e-2)] {
        for &(b, lq, lk, heads, dh, lb) in &[(2, 5, 7, 2, 4, 1), (3, 9, 40, 4, 8, 9), (1, 33, 70, 1, 16, 1)] {
            let what = format!("attention [{b}, {lq}/{lk}, {heads}x{dh}] bias rows {lb} {dt:?} on {dev:?}");
            let rnd = |l: usize| randn(&[b, l, heads * dh], dt, &cpu);
            let (q, k, v) = (rnd(lq)?, rnd(lk)?, rnd(lk)?);
            let bias = mask_bias(b, lb, lk, &cpu)?;
            let want = reference::nn::attention(&q, &k, &v, &bias, heads, 0.3)?;
            let g = |t: &Tensor| t.to_device(dev);
            let out = ms::nn::attention(&g(&q)?, &g(&k)?, &g(&v)?, &g(&bias)?, heads, 0.3)?;
            assert_close(&format!("{what} inference"), &out, &want, tol)?;
            // Gradients of Σ w ⊙ out to q, k and v against candle's autograd through the reference.
            let w = randn(&[b, lq, heads * dh], DType::F64, &cpu)?;
            let vars = [&q, &k, &v].map(|t| g(t).and_then(|t| Var::from_tensor(&t)));
            let [qv, kv, vv] = vars.map(|r| r.expect("a var"));
            let tr = ms::nn::attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &g(&bias)?, heads, 0.3)?;
            assert_close(&format!("{what} with a gradient"), &tr, &want, tol)?;
            let gr = tr.to_dtype(DType::F64)?.mul(&g(&w)?)?.sum_all()?.backward()?;
            let refs = [&q, &k, &v].map(|t| Var::from_tensor(&t.to_dtype(DType::F64).expect("f64")).expect("a var"));
            let rf = reference::nn::attention(
                refs[0].as_tensor(),
                refs[1].as_tensor(),
                refs[2].as_tensor(),
                &bias,
                heads,
                0.3,
            )?;
            let grf = rf.mul(&w)?.sum_all()?.backward()?;
            for (name, (ours, theirs)) in ["q", "k", "v"].iter().zip([&qv, &kv, &vv].iter().zip(&refs)) {
                let a = gr.get(ours.as_tensor()).expect("a gradient").to_device(&cpu)?;
                let e = grf.get(theirs.as_tensor()).expect("a gradient");
                assert_close(&format!("{what} grad {name}"), &a, e, tol.max(grad_tol(dt)))?;
            }
        }
    }
    let t = |l: usize, w: usize| randn(&[2, l, w], DType::F32, dev);
    let bias = mask_bias(2, 1, 6, dev)?;
    expect_err(ms::nn::attention(&t(5, 8)?, &t(6, 8)?, &t(6, 8)?, &bias, 3, 1.0), "heads");
    expect_err(ms::nn::attention(&t(5, 8)?, &t(6, 4)?, &t(6, 8)?, &bias, 2, 1.0), "k");
    expect_err(ms::nn::attention(&t(5, 8)?, &t(6, 8)?, &t(7, 8)?, &bias, 2, 1.0), "v");
    expect_err(ms::nn::attention(&t(5, 8)?, &t(6, 8)?, &t(6, 8)?, &mask_bias(2, 1, 5, dev)?, 2, 1.0), "bias");
    Ok(())
}

test_device!(attention_matches_reference, attention_matches_reference_cpu, attention_matches_reference_cuda);

/// Bad shapes and dtypes are errors naming the argument.
fn attention_softmax_rejects_bad_input(dev: &Device) -> Result<()> {
    let s = randn(&[2, 3, 4, 5], DType::F32, dev)?;
    let err = |r: Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err(ms::nn::attention_softmax(&s, &Tensor::zeros((2, 1, 1, 4), DType::F32, dev)?, 1.0)).starts_with("bias"));
    assert!(err(ms::nn::attention_softmax(&s, &Tensor::zeros((2, 1, 1, 5), DType::F16, dev)?, 1.0)).starts_with("bias"));
    assert!(err(ms::nn::attention_softmax(&s.get(0)?, &Tensor::zeros((1, 1, 5), DType::F32, dev)?, 1.0))
        .starts_with("scores"));
    Ok(())
}

test_device!(
    attention_softmax_rejects_bad_input,
    attention_softmax_rejects_bad_input_cpu,
    attention_softmax_rejects_bad_input_cuda
);

/// `layer_norm` (or with `residual`, `residual_layer_norm` of x and a
/// residual, against the reference's norm of their sum; both get its gradient).
/// `x` is read through a view one element into its buffer when `shifted`
/// (rows off 16-byte alignment).
#[allow(clippy::too_many_arguments)]
fn layer_norm_case(
    dev: &Device,
    rows: usize,
    c: usize,
    bias: bool,
    residual: bool,
    shifted: bool,
    dt: DType,
    tol: f64,
) -> Result<()> {
    let cpu = Device::Cpu;
    let what = format!("layer_norm {rows}x{c} bias {bias} residual {residual} shifted {shifted} {dt:?} on {dev:?}");
    let x = randn(&[rows, 1, c], DType::F32, &cpu)?.affine(2.0, 0.5)?.to_dtype(dt)?;
    let r = randn(&[rows, 1, c], DType::F32, &cpu)?.to_dtype(dt)?;
    let rv = Var::from_tensor(&r.to_device(dev)?)?;
    let rn = Var::from_tensor(&r.to_dtype(DType::F64)?)?;
    let w = randn(&[c], DType::F32, &cpu)?.affine(0.5, 1.0)?;
    let b = randn(&[c], DType::F32, &cpu)?;
    let up = randn(&[rows, 1, c], dt, &cpu)?.to_dtype(DType::F64)?;
    let eps = 1e-5;
    let (xv, wv, bv) = (
        Var::from_tensor(&x.to_device(dev)?)?,
        Var::from_tensor(&w.to_device(dev)?)?,
        Var::from_tensor(&b.to_device(dev)?)?,
    );
    let xs = if shifted {
        let f = xv.as_tensor().flatten_all()?;
        Tensor::cat(&[&f.narrow(0, 0, 1)?, &f], 0)?.narrow(0, 1, rows * c)?.reshape((rows, 1, c))?
    } else {
        xv.as_tensor().clone()
    };
    let y = if residual {
        ms::nn::residual_layer_norm(&xs, rv.as_tensor(), wv.as_tensor(), bias.then_some(bv.as_tensor()), eps)?
    } else {
        ms::nn::layer_norm(&xs, wv.as_tensor(), bias.then_some(bv.as_tensor()), eps)?
    };
    assert_eq!(y.dtype(), dt);
    let g = y.to_dtype(DType::F64)?.mul(&up.to_device(dev)?)?.sum_all()?.backward()?;
    let (xn, wn, bn) = (
        Var::from_tensor(&x.to_dtype(DType::F64)?)?,
        Var::from_tensor(&w.to_dtype(DType::F64)?)?,
        Var::from_tensor(&b.to_dtype(DType::F64)?)?,
    );
    let input = if residual { (xn.as_tensor() + rn.as_tensor())? } else { xn.as_tensor().clone() };
    let yn = reference::nn::layer_norm(&input, wn.as_tensor(), bias.then_some(bn.as_tensor()), eps)?;
    let gn = yn.mul(&up)?.sum_all()?.backward()?;
    assert_close(&format!("{what} forward"), &y, &yn, tol)?;
    let grad = |g: &candle_core::backprop::GradStore, v: &Var| g.get(v.as_tensor()).expect("grad").to_device(&cpu);
    assert_close(&format!("{what} dx"), &grad(&g, &xv)?, &grad(&gn, &xn)?, tol)?;
    if residual {
        assert_close(&format!("{what} dres"), &grad(&g, &rv)?, &grad(&gn, &rn)?, tol)?;
    }
    // dw and db sum over rows: relative to the sum of |terms|, as the sum's size grows with them.
    let tol_w = tol * (rows as f64).sqrt();
    assert_close(&format!("{what} dw"), &grad(&g, &wv)?, &grad(&gn, &wn)?, tol_w)?;
    if bias {
        assert_close(&format!("{what} db"), &grad(&g, &bv)?, &grad(&gn, &bn)?, tol_w)?;
    } else {
        assert!(g.get(bv.as_tensor()).is_none());
    }
    Ok(())
}

/// Row widths within one and across several lanes' passes (BERT's 384 and
/// 768; on CUDA 1 024, the widest row held in registers, and 1 536 past
/// it), more rows than the CUDA grid has warps, with and without a bias,
/// alone and after a residual, rows aligned to 16 bytes and not; bad input
/// names the argument.
fn layer_norm_matches_reference(dev: &Device) -> Result<()> {
    for (dt, tol) in [(DType::F32, 1e-5), (DType::F16, 3e-3), (DType::BF16, 2e-2)] {
        let cases = [
            (7, 5, true),
            (37, 33, false),
            (300, 384, true),
            (5000, 96, true),
            (40, 768, false),
            (9, 1024, true),
            (6, 1536, false),
        ];
        for (rows, c, bias) in cases {
            for residual in [false, true] {
                layer_norm_case(dev, rows, c, bias, residual, false, dt, tol)?;
            }
        }
        for residual in [false, true] {
            layer_norm_case(dev, 12, 384, true, residual, true, dt, tol)?;
        }
    }
    let t = |s: &[usize]| randn(s, DType::F32, dev);
    let w = t(&[6])?;
    expect_err(ms::nn::residual_layer_norm(&t(&[4, 6])?, &t(&[4, 5])?, &w, None, 1e-5), "res");
    expect_err(ms::nn::residual_layer_norm(&t(&[4, 6])?, &t(&[4, 6])?.to_dtype(DType::F16)?, &w, None, 1e-5), "res");
    expect_err(ms::nn::residual_layer_norm(&t(&[4, 6])?, &t(&[4, 6])?, &t(&[5])?, None, 1e-5), "w");
    Ok(())
}

test_device!(layer_norm_matches_reference, layer_norm_matches_reference_cpu, layer_norm_matches_reference_cuda);

/// The embedding gather and its scatter-add backward (repeated ids sum);
/// out-of-range ids (every 9th, in the second pass) give zero rows whose
/// gradient goes nowhere, as masked rows of an in-range lookup would.
fn embedding_matches_index_select(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for (dt, outside) in [(DType::F32, false), (DType::F16, false), (DType::BF16, false), (DType::F32, true)] {
        let table = randn(&[50, 24], dt, &cpu)?;
        let out_of_range = |i: usize| outside && i % 9 == 4;
        let ids: Vec<u32> = (0..3 * 70)
            .map(|i| if out_of_range(i) { 50 + (i % 13) as u32 } else { (i * 7 + i / 5) as u32 % 50 })
            .collect();
        let inside: Vec<u32> = ids.iter().map(|&i| if i >= 50 { 0 } else { i }).collect();
        let keep: Vec<f32> = (0..3 * 70).map(|i| if out_of_range(i) { 0.0 } else { 1.0 }).collect();
        let ids = Tensor::from_vec(ids, (3, 70), &cpu)?;
        let up = randn(&[3, 70, 24], DType::F32, &cpu)?;
        let tv = Var::from_tensor(&table.to_device(dev)?)?;
        let e = ms::nn::embedding(tv.as_tensor(), &ids.to_device(dev)?)?;
        assert_eq!(e.dims(), [3, 70, 24]);
        let g = e.to_dtype(DType::F32)?.mul(&up.to_device(dev)?)?.sum_all()?.backward()?;
        let tn = Var::from_tensor(&table.to_dtype(DType::F32)?)?;
        let en = reference::nn::embedding(tn.as_tensor(), &Tensor::from_vec(inside, (3, 70), &cpu)?)?
            .broadcast_mul(&Tensor::from_vec(keep, (3, 70, 1), &cpu)?)?;
        let gn = en.mul(&up)?.sum_all()?.backward()?;
        let what = format!("embedding {dt:?}{} on {dev:?}", if outside { " with ids out of range" } else { "" });
        assert_close(&what, &e.to_dtype(DType::F32)?, &en, 1e-7)?;
        let tol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
        let gt = g.get(tv.as_tensor()).expect("grad").to_device(&cpu)?;
        assert_eq!(gt.dtype(), dt);
        assert_close(&format!("{what}: grad"), &gt, gn.get(tn.as_tensor()).expect("grad"), tol)?;
    }
    Ok(())
}

test_device!(embedding_matches_index_select, embedding_matches_index_select_cpu, embedding_matches_index_select_cuda);

/// The linear projection against `x · wᵀ + b` in F64: rank-2 and rank-3
/// inputs, row counts below, at and across the CPU op's 512-row tiles, an
/// odd output width (unequal column tiles), with and without a bias, and
/// `linear_gelu` against GELU of the same in F64; the gradients of x, w and b through candle's autograd of the reference. In
/// a pool of one thread and of eight: the CPU op tiles from five threads.
fn linear_matches_reference(dev: &Device) -> Result<()> {
    for threads in [1, 8] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().map_err(candle_core::Error::wrap)?;
        pool.install(|| linear_cases(dev))?;
    }
    let t = |s: &[usize]| randn(s, DType::F32, dev);
    expect_err(ms::nn::linear(&t(&[4, 6])?, &t(&[3, 5])?, None), "w");
    expect_err(ms::nn::linear(&t(&[4, 6])?, &t(&[3, 6, 1])?, None), "w");
    expect_err(ms::nn::linear(&t(&[4, 6])?, &t(&[3, 6])?, Some(&t(&[4])?)), "b");
    expect_err(ms::nn::linear_gelu(&t(&[4, 6])?, &t(&[3, 6])?, &t(&[3, 1])?), "b");
    expect_err(ms::nn::linear_gelu(&t(&[4, 6])?, &t(&[3, 5])?, &t(&[3])?), "w");
    Ok(())
}

fn linear_cases(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for (dt, tol) in [(DType::F32, 1e-5), (DType::F16, 3e-3), (DType::BF16, 2e-2)] {
        let cases = [
            (&[3][..], 5, 7, true, false),
            (&[2, 300][..], 24, 33, false, false),
            (&[1030][..], 17, 1, true, false),
            (&[3][..], 5, 7, true, true),
            (&[2, 300][..], 24, 33, true, true),
            (&[1030][..], 17, 5, true, true),
            // Several 32-wide K steps with a remainder, columns past a
            // 32-column block (the BF16 engines' blocks on CPUs that have them).
            (&[70][..], 100, 40, true, false),
            (&[2, 40][..], 384, 96, true, true),
        ];
        for &(lead, k, n, bias, gelu) in &cases {
            let what = format!("linear {lead:?}x{k} -> {n} bias {bias} gelu {gelu} {dt:?} on {dev:?}");
            let xs: Vec<usize> = lead.iter().copied().chain([k]).collect();
            let (x, w, b) = (randn(&xs, dt, &cpu)?, randn(&[n, k], dt, &cpu)?, randn(&[n], DType::F32, &cpu)?);
            let b = bias.then_some(&b);
            let reference = |x: &Tensor, w: &Tensor, b: Option<&Tensor>| match b {
                Some(b) if gelu => reference::nn::linear_gelu(x, w, b),
                b => reference::nn::linear(x, w, b),
            };
            let want = reference(&x, &w, b)?;
            let g = |t: &Tensor| t.to_device(dev);
            let vars = [&x, &w].map(|t| g(t).and_then(|t| Var::from_tensor(&t)).expect("a var"));
            let bv = b.map(|b| Var::from_tensor(&g(b)?)).transpose()?;
            let (xt, wt) = (vars[0].as_tensor(), vars[1].as_tensor());
            let y = match &bv {
                Some(bv) if gelu => ms::nn::linear_gelu(xt, wt, bv.as_tensor())?,
                bv => ms::nn::linear(xt, wt, bv.as_ref().map(|v| v.as_tensor()))?,
            };
            assert_eq!(y.dims(), want.dims(), "{what}");
            assert_close(&what, &y, &want, tol)?;
            // Without gradients (inference; on the CPU in BF16 with AMX or
            // AVX512-BF16 its own fused path): the same values, bit for bit.
            let (xd, wd, bd) = (g(&x)?, g(&w)?, b.map(g).transpose()?);
            let yi = match &bd {
                Some(bd) if gelu => ms::nn::linear_gelu(&xd, &wd, bd)?,
                bd => ms::nn::linear(&xd, &wd, bd.as_ref())?,
            };
            assert_eq!(
                yi.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?,
                y.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?,
                "{what}: inference against training"
            );
            let wt = randn(want.dims(), DType::F64, &cpu)?;
            let gr = y.to_dtype(DType::F64)?.mul(&g(&wt)?)?.sum_all()?.backward()?;
            let f64v = |t: &Tensor| Var::from_tensor(&t.to_dtype(DType::F64).expect("f64")).expect("a var");
            let (xr, wr, br) = (f64v(&x), f64v(&w), b.map(f64v));
            let yr = reference(xr.as_tensor(), wr.as_tensor(), br.as_ref().map(|v| v.as_tensor()))?;
            let grf = yr.mul(&wt)?.sum_all()?.backward()?;
            // Each gradient is a sum of products of both signs (over the
            // outputs for x, over the rows for w and b), judged against the
            // same sum of absolute values: a sum near 0 by cancellation has
            // no relative error of its own (b's, for one output, often).
            let (wa, xa) = (wt.abs()?.reshape(((), n))?, xr.as_tensor().abs()?.reshape(((), k))?);
            let scales = [wa.matmul(&wr.as_tensor().abs()?)?, wa.t()?.matmul(&xa)?, wa.sum(0)?];
            let mut pairs = vec![("x", &vars[0], &xr, &scales[0]), ("w", &vars[1], &wr, &scales[1])];
            if let (Some(bv), Some(br)) = (&bv, &br) {
                pairs.push(("b", bv, br, &scales[2]));
            }
            for (name, ours, theirs, scale) in pairs {
                let a = gr.get(ours.as_tensor()).expect("a gradient").to_device(&cpu)?;
                let e = grf.get(theirs.as_tensor()).expect("a gradient");
                assert_close_scaled(&format!("{what} grad {name}"), &a, e, scale, tol.max(grad_tol(dt)))?;
            }
        }
    }
    Ok(())
}

test_device!(linear_matches_reference, linear_matches_reference_cpu, linear_matches_reference_cuda);

/// `rotary_qk`, forward and the gradient of qkv, against the composed F64
/// reference on fresh random rows and angles: head dims 8, 32 and 64,
/// every dtype, more elements than the CUDA grid; bad shapes name the argument.
fn rotary_qk_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for (dt, tol) in [(DType::F32, 1e-6), (DType::F16, 2e-3), (DType::BF16, 1e-2)] {
        for (t, heads, dh) in [(1, 1, 8), (37, 3, 32), (2000, 12, 64)] {
            let qkv = randn(&[t, 3 * heads * dh], dt, &cpu)?;
            let angle = (Tensor::rand(0f32, 1., (t, dh / 2), &cpu)? * 40.0)?;
            let (cos, sin) = (angle.cos()?, angle.sin()?);
            let up = randn(&[t, 3 * heads * dh], dt, &cpu)?.to_dtype(DType::F64)?;
            let xv = Var::from_tensor(&qkv.to_device(dev)?)?;
            let y = ms::nn::rotary_qk(xv.as_tensor(), &cos.to_device(dev)?, &sin.to_device(dev)?, heads)?;
            assert_eq!((y.dtype(), y.dims()), (dt, qkv.dims()));
            let g = y.to_dtype(DType::F64)?.mul(&up.to_device(dev)?)?.sum_all()?.backward()?;
            let xn = Var::from_tensor(&qkv.to_dtype(DType::F64)?)?;
            let yn = reference::nn::rotary_qk(xn.as_tensor(), &cos, &sin, heads)?;
            let gn = yn.mul(&up)?.sum_all()?.backward()?;
            let what = format!("rotary_qk {t}x{heads}x{dh} {dt:?} on {dev:?}");
            assert_close(&format!("{what} forward"), &y, &yn, tol)?;
            let dx = g.get(xv.as_tensor()).expect("grad").to_device(&cpu)?;
            assert_close(&format!("{what} dqkv"), &dx, gn.get(xn.as_tensor()).expect("grad"), tol)?;
        }
    }
    let x = randn(&[4, 3 * 2 * 8], DType::F32, dev)?;
    let tab = Tensor::zeros((4, 4), DType::F32, dev)?;
    expect_err(ms::nn::rotary_qk(&x, &tab, &tab, 3), "heads");
    expect_err(ms::nn::rotary_qk(&x, &tab.narrow(1, 0, 3)?, &tab, 2), "cos");
    expect_err(ms::nn::rotary_qk(&x, &tab, &tab.to_dtype(DType::F16)?, 2), "sin");
    expect_err(ms::nn::rotary_qk(&x.flatten_all()?, &tab, &tab, 2), "qkv");
    Ok(())
}

test_device!(rotary_qk_matches_reference, rotary_qk_matches_reference_cpu, rotary_qk_matches_reference_cuda);
