//! The BERT and ModernBERT encoders against transformers: tiny random
//! checkpoints made by transformers 5.17 (tests/fixtures/make_encoder_fixture.py)
//! and its outputs for padded batches, reproduced in F32 within 1e-4 (padded
//! positions included); in F16 and BF16 no NaN and close to F32. On the CPU
//! and, under the `cuda` feature, on the GPU.

use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim_colbert::encoder::{weight_prefix, Encoder};
use candle_maxsim_testing::*;
use candle_nn::VarBuilder;
use std::path::Path;

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/encoders").join(name)
}

fn load(name: &str, dev: &Device) -> Result<Encoder> {
    let dir = fixture(name);
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?).unwrap();
    let file = dir.join("model.safetensors");
    let names: Vec<String> = candle_core::safetensors::load(&file, &Device::Cpu)?.into_keys().collect();
    // SAFETY: the fixture file is not modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&file], DType::F32, dev)? };
    let prefix = weight_prefix(&names, config["model_type"].as_str().unwrap());
    Encoder::load(if prefix.is_empty() { vb } else { vb.pp(prefix.trim_end_matches('.')) }, &config)
}

fn encoders_match_transformers(dev: &Device) -> Result<()> {
    for name in ["bert", "modernbert"] {
        let enc = load(name, dev)?;
        let io = fixture(name).join("io");
        let ids = Tensor::read_npy(io.join("input_ids.npy"))?.to_dtype(DType::U32)?.to_device(dev)?;
        let mask = Tensor::read_npy(io.join("attention_mask.npy"))?.to_dtype(DType::U8)?.to_device(dev)?;
        let want = Tensor::read_npy(io.join("last_hidden_state.npy"))?;
        let got = enc.forward(&ids, &mask, DType::F32)?;
        let err = max_abs_diff(&got, &want)?;
        assert!(err < 1e-4, "{name}: max |candle − transformers| = {err:e}");
        for dt in [DType::F16, DType::BF16] {
            let half = enc.forward(&ids, &mask, dt)?.to_dtype(DType::F32)?;
            let v: Vec<f32> = half.flatten_all()?.to_vec1()?;
            assert!(v.iter().all(|x| x.is_finite()), "{name} {dt:?}: non-finite outputs");
            let e = rel_err(&half, &want)?;
            assert!(e < 5e-2, "{name} {dt:?}: rel err {e:e} against F32");
        }
    }
    Ok(())
}

test_device!(encoders_match_transformers, encoders_match_transformers_cpu, encoders_match_transformers_cuda);

/// `forward_packed` of the sequences of a padded batch equals `forward`'s
/// rows at the attended positions.
fn check_packed(what: &str, enc: &Encoder, ids: &Tensor, mask: &Tensor, dt: DType, tol: f64) -> Result<()> {
    let padded = enc.forward(ids, mask, DType::F32)?;
    let lens: Vec<u32> = mask.to_dtype(DType::U32)?.sum(1)?.to_vec1()?;
    let mut cu = vec![0u32];
    let mut rows = Vec::new();
    for (b, &l) in lens.iter().enumerate() {
        cu.push(cu[b] + l);
        rows.push(ids.get(b)?.narrow(0, 0, l as usize)?);
    }
    let packed_ids = Tensor::cat(&rows, 0)?;
    let packed = enc.forward_packed(&packed_ids, &Tensor::new(cu.as_slice(), ids.device())?, dt)?;
    assert_eq!(packed.dtype(), dt);
    for (b, &l) in lens.iter().enumerate() {
        let got = packed.narrow(0, cu[b] as usize, l as usize)?.to_dtype(DType::F32)?;
        let want = padded.get(b)?.narrow(0, 0, l as usize)?;
        assert_close(&format!("{what} {dt:?} sequence {b} of {lens:?}"), &got, &want, tol)?;
    }
    Ok(())
}

/// A padded batch of sequences of `lens` tokens and a random weighting of
/// its attended rows, and both packed: the padding mask `[B, L]`, the
/// weights `up [B, L, H]` (0 at padding), the packed ids, weights and offsets.
struct Weighted {
    mask: Tensor,
    up: Tensor,
    packed_ids: Tensor,
    packed_up: Tensor,
    cu: Tensor,
}

impl Weighted {
    fn new(enc: &Encoder, ids: &Tensor, lens: &[u32]) -> Result<Self> {
        let (b, l) = ids.dims2()?;
        let dev = ids.device();
        let keep: Vec<u8> = lens.iter().flat_map(|&n| (0..l).map(move |i| u8::from(i < n as usize))).collect();
        let mask = Tensor::from_vec(keep, (b, l), dev)?;
        let h = enc.token_embeddings().dim(1)?;
        let up = Tensor::randn(0f32, 1., (b, l, h), dev)?.broadcast_mul(&mask.to_dtype(DType::F32)?.unsqueeze(2)?)?;
        let mut cu = vec![0u32];
        let (mut rows, mut ups) = (Vec::new(), Vec::new());
        for (i, &n) in lens.iter().enumerate() {
            cu.push(cu[i] + n);
            rows.push(ids.get(i)?.narrow(0, 0, n as usize)?);
            ups.push(up.get(i)?.narrow(0, 0, n as usize)?);
        }
        let (packed_ids, packed_up) = (Tensor::cat(&rows, 0)?, Tensor::cat(&ups, 0)?);
        Ok(Self { mask, up, packed_ids, packed_up, cu: Tensor::new(cu.as_slice(), dev)? })
    }
}

/// The gradients of every weight of `vars` through `forward_packed` (in
/// `dt`) equal those through the padded `forward` (F32) of a random
/// weighting of the attended rows.
fn check_packed_grads(
    what: &str,
    enc: &Encoder,
    vars: &candle_nn::VarMap,
    ids: &Tensor,
    lens: &[u32],
    dt: DType,
    tol: f64,
) -> Result<()> {
    let p = Weighted::new(enc, ids, lens)?;
    let padded = (enc.forward(ids, &p.mask, DType::F32)? * &p.up)?.sum_all()?.backward()?;
    let out = enc.forward_packed(&p.packed_ids, &p.cu, dt)?;
    let packed = (out.to_dtype(DType::F32)? * &p.packed_up)?.sum_all()?.backward()?;
    // Relative to the larger of the gradient's own largest entry and 1 % of
    // the largest of all: sums that cancel (a query bias's) keep F32 noise.
    let data = vars.data().lock().unwrap();
    let mut most = 0f64;
    for v in data.values() {
        most = most.max(max_abs(padded.get(v.as_tensor()).expect("a gradient"))?);
    }
    for (name, v) in data.iter() {
        let (Some(a), Some(e)) = (packed.get(v.as_tensor()), padded.get(v.as_tensor())) else {
            panic!("{what}: {name} has a gradient on both sides")
        };
        let err = max_abs_diff(a, e)? / max_abs(e)?.max(1e-2 * most);
        assert!(err < tol, "{what} {dt:?}: gradient of {name} differs by {err:e}");
    }
    Ok(())
}

/// A random encoder of `fixture`'s architecture with 2 heads of 32 (the
/// fused attention's head dims), every weight random.
fn wide(name: &str, dev: &Device) -> Result<(Encoder, candle_nn::VarMap)> {
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json"))?).unwrap();
    config["hidden_size"] = 64.into();
    config["intermediate_size"] = 128.into();
    config["num_attention_heads"] = 2.into();
    if name == "modernbert" {
        config["local_attention"] = 16.into();
    }
    let vars = candle_nn::VarMap::new();
    let enc = Encoder::load(VarBuilder::from_varmap(&vars, DType::F32, dev), &config)?;
    for v in vars.all_vars() {
        v.set(&(Tensor::randn(0f32, 1., v.shape(), dev)? * 0.3)?)?;
    }
    Ok((enc, vars))
}

/// The packed forward of BERT and ModernBERT against the padded one: the
/// transformers fixtures (head dim 8: attention composed of candle ops) in
/// F32, and random encoders with 32-wide heads (the fused varlen attention)
/// in F32 and, against their F32 padded rows, F16.
fn packed_forward_matches_padded(dev: &Device) -> Result<()> {
    for name in ["bert", "modernbert"] {
        let io = fixture(name).join("io");
        let ids = Tensor::read_npy(io.join("input_ids.npy"))?.to_dtype(DType::U32)?.to_device(dev)?;
        let mask = Tensor::read_npy(io.join("attention_mask.npy"))?.to_dtype(DType::U8)?.to_device(dev)?;
        check_packed(name, &load(name, dev)?, &ids, &mask, DType::F32, 1e-5)?;
        let (enc, vars) = wide(name, dev)?;
        let lens = [40u32, 17, 1];
        let ids = Tensor::rand(0f32, 100., (3, 40), dev)?.to_dtype(DType::U32)?;
        let keep: Vec<u8> = lens.iter().flat_map(|&l| (0..40).map(move |i| u8::from(i < l))).collect();
        let mask = Tensor::from_vec(keep, (3, 40), dev)?;
        check_packed(&format!("wide {name}"), &enc, &ids, &mask, DType::F32, 1e-5)?;
        check_packed(&format!("wide {name}"), &enc, &ids, &mask, DType::F16, 2e-2)?;
        check_packed_grads(&format!("wide {name}"), &enc, &vars, &ids, &lens, DType::F32, 1e-4)?;
        check_packed_grads(&format!("wide {name}"), &enc, &vars, &ids, &lens, DType::F16, 5e-2)?;
    }
    let enc = load("bert", dev)?;
    let ids = Tensor::new(&[3u32, 4, 5], dev)?;
    expect_err(enc.forward_packed(&ids, &Tensor::new(&[0u32, 2], dev)?, DType::F32), "cu_seqlens");
    expect_err(enc.forward_packed(&ids.unsqueeze(0)?, &Tensor::new(&[0u32, 3], dev)?, DType::F32), "ids");
    Ok(())
}

test_device!(packed_forward_matches_padded, packed_forward_matches_padded_cpu, packed_forward_matches_padded_cuda);

/// A few AdamW steps through `forward_packed` and through the padded
/// `forward` (F32), each from the same random weights, reach the same
/// weights: a loss quadratic in the attended rows (its gradient depends on
/// the weights, so each step sees the other side's drift if there is any).
fn packed_training_matches_padded(dev: &Device) -> Result<()> {
    use candle_maxsim_colbert::train::optim::AdamW;
    const STEPS: usize = 4;
    const LR: f64 = 1e-2;
    for name in ["bert", "modernbert"] {
        let (packed_enc, packed_vars) = wide(name, dev)?;
        let (padded_enc, padded_vars) = wide(name, dev)?;
        let start: std::collections::HashMap<String, Tensor> = {
            let src = packed_vars.data().lock().unwrap();
            let dst = padded_vars.data().lock().unwrap();
            for (k, v) in dst.iter() {
                v.set(src[k].as_tensor())?;
            }
            src.iter().map(|(k, v)| Ok((k.clone(), v.as_tensor().copy()?))).collect::<Result<_>>()?
        };
        let lens = [40u32, 23, 1, 9];
        let l = 40;
        let b = lens.len();
        let ids = Tensor::rand(0f32, 100., (b, l), dev)?.to_dtype(DType::U32)?;
        let Weighted { mask, up, packed_ids, packed_up, cu } = Weighted::new(&packed_enc, &ids, &lens)?;
        let named = |vars: &candle_nn::VarMap| -> Vec<(String, candle_core::Var)> {
            let mut v: Vec<_> = vars.data().lock().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        // eps well above F32 noise: a gradient that is zero in exact
        // arithmetic (the key bias's, softmax-invariant) stays a no-op.
        let adamw = |vars| {
            let mut o = AdamW::new(named(vars), 0.01);
            o.eps = 1e-3;
            o
        };
        let (mut opt_packed, mut opt_padded) = (adamw(&packed_vars), adamw(&padded_vars));
        for _ in 0..STEPS {
            let out = packed_enc.forward_packed(&packed_ids, &cu, DType::F32)?;
            let g = (out.sqr()? * &packed_up)?.sum_all()?.backward()?;
            let grads = opt_packed.collect(&g).into_iter().filter_map(|(n, g)| g.map(|g| (n, g))).collect();
            opt_packed.apply(&grads, LR, 1.0)?;
            let out = padded_enc.forward(&ids, &mask, DType::F32)?;
            let g = (out.sqr()? * &up)?.sum_all()?.backward()?;
            let grads = opt_padded.collect(&g).into_iter().filter_map(|(n, g)| g.map(|g| (n, g))).collect();
            opt_padded.apply(&grads, LR, 1.0)?;
        }
        // Every weight moved by up to STEPS · LR; the two sides agree to a
        // small part of that.
        let (a, e) = (packed_vars.data().lock().unwrap(), padded_vars.data().lock().unwrap());
        let mut moved = 0f64;
        for (k, v) in e.iter() {
            moved = moved.max(max_abs_diff(v.as_tensor(), &start[k])?);
            let err = max_abs_diff(a[k].as_tensor(), v.as_tensor())?;
            assert!(err < 1e-2 * LR, "{name}: {k} differs by {err:e} after {STEPS} steps");
        }
        assert!(moved > 0.5 * LR, "{name}: the weights barely moved ({moved:e})");
    }
    Ok(())
}

test_device!(packed_training_matches_padded, packed_training_matches_padded_cpu, packed_training_matches_padded_cuda);
