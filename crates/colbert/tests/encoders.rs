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
