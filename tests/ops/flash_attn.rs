//! `nn::attention_varlen` (src/ops/flash_attn.rs) against the composed
//! softmax attention of `reference` in F64: forward values and, through
//! candle's autograd of the reference, the gradients of q, k and v; the
//! packed batch against the padded `nn::attention`; column slices of a
//! fused QKV projection; bad input.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_maxsim::{self as ms, reference};

fn offsets(lens: &[usize], dev: &Device) -> Result<(Tensor, usize)> {
    let mut cu = vec![0u32];
    for &l in lens {
        cu.push(cu.last().unwrap() + l as u32);
    }
    let t = *cu.last().unwrap() as usize;
    Ok((Tensor::new(cu, dev)?, t))
}

/// Output and gradients of Σ w ⊙ out for q, k, v against the reference,
/// at the usual scale 1/√dh.
fn varlen_case(dev: &Device, lens: &[usize], heads: usize, dh: usize, window: Option<usize>, dt: DType) -> Result<()> {
    varlen_case_scaled(dev, lens, heads, dh, window, dt, 1.0 / (dh as f64).sqrt())
}

/// [`varlen_case`] at any scale (a negative one turns the softmax's
/// largest score into the smallest product).
fn varlen_case_scaled(
    dev: &Device,
    lens: &[usize],
    heads: usize,
    dh: usize,
    window: Option<usize>,
    dt: DType,
    scale: f64,
) -> Result<()> {
    let cpu = Device::Cpu;
    let what = format!("attention_varlen lens {lens:?} {heads}x{dh} window {window:?} scale {scale} {dt:?} on {dev:?}");
    let (cu, t) = offsets(lens, &cpu)?;
    let hd = heads * dh;
    let [q, k, v] = [0; 3].map(|_| randn(&[t, hd], dt, &cpu).expect("randn"));
    let w = randn(&[t, hd], DType::F64, &cpu)?;
    let refs = [&q, &k, &v].map(|x| Var::from_tensor(&x.to_dtype(DType::F64).expect("f64")).expect("a var"));
    let want = reference::nn::attention_varlen(
        refs[0].as_tensor(),
        refs[1].as_tensor(),
        refs[2].as_tensor(),
        &cu,
        heads,
        scale,
        window,
    )?;
    let grf = want.mul(&w)?.sum_all()?.backward()?;
    let g = |x: &Tensor| x.to_device(dev);
    let vars = [&q, &k, &v].map(|x| Var::from_tensor(&g(x).expect("to device")).expect("a var"));
    let out = ms::nn::attention_varlen(
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
        &g(&cu)?,
        heads,
        scale,
        window,
    )?;
    assert_eq!(out.dtype(), dt);
    let tol = match dt {
        DType::F32 => 1e-5,
        DType::F16 => 3e-3,
        _ => 2e-2,
    };
    assert_close(&format!("{what} forward"), &out, &want, tol)?;
    let gr = out.to_dtype(DType::F64)?.mul(&g(&w)?)?.sum_all()?.backward()?;
    for (name, (ours, theirs)) in ["q", "k", "v"].iter().zip(vars.iter().zip(&refs)) {
        let a = gr.get(ours.as_tensor()).expect("a gradient").to_device(&cpu)?;
        let e = grf.get(theirs.as_tensor()).expect("a gradient");
        assert_close(&format!("{what} grad {name}"), &a, e, tol.max(grad_tol(dt)))?;
    }
    Ok(())
}

/// Ragged lengths with 1 and 0 among them, every head dim and dtype, no
/// window and windows narrower than a sequence; on CUDA also lengths across
/// several 64-row blocks and windows across block edges; and a negative
/// scale, with and without a window.
fn attention_varlen_matches_reference(dev: &Device) -> Result<()> {
    for dt in DTYPES {
        for dh in ms::nn::ATTENTION_HEAD_DIMS {
            // The widest windows limit nothing (the CUDA kernels' row ranges are 32-bit).
            for window in [None, Some(3), Some(i32::MAX as usize), Some(usize::MAX)] {
                varlen_case(dev, &[7, 1, 0, 20], 2, dh, window, dt)?;
            }
            let lens: &[usize] = if gpu_cases(dev) { &[65, 1, 300, 128, 0, 33] } else { &[7, 1, 0, 20] };
            if gpu_cases(dev) {
                for window in [None, Some(1), Some(64), Some(100)] {
                    varlen_case(dev, lens, 3, dh, window, dt)?;
                }
            }
            for window in [None, Some(64)] {
                varlen_case_scaled(dev, lens, 3, dh, window, dt, -0.8 / (dh as f64).sqrt())?;
            }
        }
    }
    Ok(())
}

test_device!(
    attention_varlen_matches_reference,
    attention_varlen_matches_reference_cpu,
    attention_varlen_matches_reference_cuda
);

/// The packed batch equals the padded one through `nn::attention` with a
/// key mask, row for row.
fn attention_varlen_equals_padded(dev: &Device) -> Result<()> {
    let dt = if dev.is_cuda() { DType::F16 } else { DType::F32 };
    let (heads, dh, lens) = (2, 32, [5usize, 1, 12]);
    let (cu, t) = offsets(&lens, dev)?;
    let hd = heads * dh;
    let [q, k, v] = [0; 3].map(|_| randn(&[t, hd], dt, dev).expect("randn"));
    let packed = ms::nn::attention_varlen(&q, &k, &v, &cu, heads, 0.2, None)?;
    let lmax = *lens.iter().max().unwrap();
    let pad = |x: &Tensor| -> Result<Tensor> {
        let mut rows = Vec::new();
        let mut s = 0;
        for &l in &lens {
            rows.push(x.narrow(0, s, l)?.pad_with_zeros(0, 0, lmax - l)?);
            s += l;
        }
        Tensor::stack(&rows, 0)
    };
    let mask: Vec<f32> =
        lens.iter().flat_map(|&l| (0..lmax).map(move |j| if j < l { 0.0 } else { f32::MIN })).collect();
    let bias = Tensor::from_vec(mask, (lens.len(), 1, 1, lmax), dev)?;
    let padded = ms::nn::attention(&pad(&q)?, &pad(&k)?, &pad(&v)?, &bias, heads, 0.2)?;
    let mut s = 0;
    for (b, &l) in lens.iter().enumerate() {
        let a = packed.narrow(0, s, l)?;
        let e = padded.get(b)?.narrow(0, 0, l)?;
        assert_close(&format!("sequence {b} of {lens:?} on {dev:?}"), &a, &e, score_tol(dev, dt))?;
        s += l;
    }
    Ok(())
}

test_device!(attention_varlen_equals_padded, attention_varlen_equals_padded_cpu, attention_varlen_equals_padded_cuda);

/// q, k and v as column slices of one `[T, 3·H·dh]` projection, and the
/// whole projection through `attention_varlen_qkv` (offsets as a tensor, or
/// checked once as `SeqOffsets`), give the same values and the same
/// gradient of the projection as contiguous copies; no rows at all give an
/// empty output and gradient.
fn attention_varlen_takes_fused_qkv(dev: &Device) -> Result<()> {
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let (heads, dh) = (2, 64);
        let hd = heads * dh;
        let (cu, t) = offsets(&[9, 70, 3], dev)?;
        let w = randn(&[t, hd], DType::F32, dev)?;
        let x = randn(&[t, 3 * hd], dt, dev)?;
        let run = |how: usize| -> Result<(Tensor, Tensor)> {
            let qkv = Var::from_tensor(&x.copy()?)?;
            let part = |i: usize| -> Result<Tensor> {
                let p = qkv.as_tensor().narrow(1, i * hd, hd)?;
                if how == 1 {
                    p.contiguous()
                } else {
                    Ok(p)
                }
            };
            let out = if how == 2 {
                ms::nn::attention_varlen_qkv(qkv.as_tensor(), &cu, heads, 0.125, Some(8))?
            } else if how == 3 {
                let offsets = ms::nn::SeqOffsets::new(&cu)?;
                ms::nn::attention_varlen_qkv_offsets(qkv.as_tensor(), &offsets, heads, 0.125, Some(8))?
            } else {
                ms::nn::attention_varlen(&part(0)?, &part(1)?, &part(2)?, &cu, heads, 0.125, Some(8))?
            };
            let g = out.to_dtype(DType::F32)?.mul(&w)?.sum_all()?.backward()?;
            Ok((out, g.get(qkv.as_tensor()).expect("a gradient").clone()))
        };
        let (want, gw) = run(1)?;
        for (how, what) in [(0, "column slices"), (2, "attention_varlen_qkv"), (3, "attention_varlen_qkv_offsets")] {
            let (out, g) = run(how)?;
            assert_close(&format!("{what} forward {dt:?} on {dev:?}"), &out, &want, 1e-6)?;
            assert_close(&format!("{what} gradient {dt:?} on {dev:?}"), &g, &gw, 1e-6)?;
        }
    }
    // No rows: an empty output, and a backward that gives zeros.
    for dt in [DType::F32, DType::BF16] {
        let qkv = Var::from_tensor(&Tensor::zeros((0, 3 * 128), dt, dev)?)?;
        let out = ms::nn::attention_varlen_qkv(qkv.as_tensor(), &Tensor::new(&[0u32], dev)?, 2, 0.125, None)?;
        assert_eq!(out.dims(), &[0, 128]);
        // Summed in its own dtype: candle's CUDA cast launches an empty grid
        // on no elements (an invalid launch), whatever the op before it.
        let g = out.sum_all()?.backward()?;
        assert_eq!(g.get(qkv.as_tensor()).expect("a gradient").dims(), &[0, 3 * 128]);
    }
    let ok = Tensor::new(&[0u32, 6], dev)?;
    expect_err(ms::nn::attention_varlen_qkv(&randn(&[6, 64], DType::F32, dev)?, &ok, 2, 1.0, None), "qkv");
    expect_err(ms::nn::attention_varlen_qkv(&randn(&[6, 3 * 48], DType::F32, dev)?, &ok, 2, 1.0, None), "qkv");
    Ok(())
}

test_device!(
    attention_varlen_takes_fused_qkv,
    attention_varlen_takes_fused_qkv_cpu,
    attention_varlen_takes_fused_qkv_cuda
);

/// Bad offsets, windows, head dims and operands are errors naming the argument.
fn attention_varlen_rejects_bad_input(dev: &Device) -> Result<()> {
    let x = |t: usize, w: usize| randn(&[t, w], DType::F32, dev);
    let cu = |v: Vec<u32>| Tensor::new(v, dev);
    let (q, k, v) = (x(6, 64)?, x(6, 64)?, x(6, 64)?);
    let run =
        |cu: &Tensor, heads: usize, window: Option<usize>| ms::nn::attention_varlen(&q, &k, &v, cu, heads, 1.0, window);
    expect_err(run(&cu(vec![0, 4, 2, 6])?, 2, None), "cu_seqlens");
    expect_err(run(&cu(vec![0, 4, 5])?, 2, None), "cu_seqlens");
    expect_err(run(&cu(vec![1, 6])?, 2, None), "cu_seqlens");
    expect_err(run(&Tensor::new(&[0i64, 6], dev)?, 2, None), "cu_seqlens");
    for bad in [vec![0, 4, 2, 6], vec![1, 6], vec![]] {
        expect_err(ms::nn::SeqOffsets::from_slice(&bad, dev), "cu_seqlens");
    }
    expect_err(ms::nn::SeqOffsets::new(&Tensor::new(&[0f32, 6.], dev)?), "cu_seqlens");
    let offsets = ms::nn::SeqOffsets::from_slice(&[0, 4, 5], dev)?;
    let qkv = x(6, 3 * 64)?;
    expect_err(ms::nn::attention_varlen_qkv_offsets(&qkv, &offsets, 2, 1.0, None), "cu_seqlens");
    expect_err(run(&cu(vec![0, 6])?, 2, Some(0)), "window");
    expect_err(run(&cu(vec![0, 6])?, 3, None), "heads");
    expect_err(run(&cu(vec![0, 6])?, 4, None), "q");
    let ok = cu(vec![0, 6])?;
    expect_err(ms::nn::attention_varlen(&q, &x(5, 64)?, &v, &ok, 2, 1.0, None), "k");
    expect_err(ms::nn::attention_varlen(&q, &k, &v.to_dtype(DType::F16)?, &ok, 2, 1.0, None), "v");
    expect_err(ms::nn::attention_varlen(&q, &k, &v, &ok, 2, f64::NAN, None), "scale");
    Ok(())
}

test_device!(
    attention_varlen_rejects_bad_input,
    attention_varlen_rejects_bad_input_cpu,
    attention_varlen_rejects_bad_input_cuda
);
