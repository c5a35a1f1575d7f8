//! A ColBERT model whose every weight is a `Var` of a `VarMap`: loaded from
//! any checkpoint [`crate::ColBert::load`] reads, given a projection and the
//! query / document markers when it has none (as PyLate does for a plain
//! encoder), and saved in the PyLate layout.

use crate::checkpoint::{safetensors_bytes, write_dir, Checkpoint, Layout};
use crate::encoder::Encoder;
use crate::{ColBert, EncodeConfig, Projection};
use candle_core::{bail, DType, Device, Error, Result, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::Path;
use tokenizers::{AddedToken, Tokenizer};

/// The name of the projection in the `VarMap` (its file is `1_Dense/model.safetensors`).
const DENSE: &str = "1_Dense.linear.weight";

/// A trainable ColBERT model: [`ColBert`] over `Var`s.
pub struct TrainableColBert {
    /// The model (its encoder and projection read the `Var`s).
    pub model: ColBert,
    varmap: VarMap,
    /// `config.json` of the encoder (its `vocab_size` counts added markers).
    config: serde_json::Value,
    tokenizer: Tokenizer,
    encode: EncodeConfig,
    /// Other files of the source checkpoint's tokenizer, copied when saving.
    tokenizer_files: Vec<(String, Vec<u8>)>,
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Msg(format!("tokenizer: {e}"))
}

impl TrainableColBert {
    /// Loads `dir` into F32 `Var`s on `device`; the model computes in `dtype`.
    /// A checkpoint without a projection (a plain BERT / ModernBERT) gets a
    /// `[dim, hidden]` one (PyTorch's default init, seeded) and PyLate's
    /// markers `[Q] ` / `[D] ` as two new tokens, their embeddings the mean
    /// of the others plus seeded noise.
    pub fn load(dir: impl AsRef<Path>, device: &Device, dtype: DType, dim: usize, seed: u64) -> Result<Self> {
        let ck = Checkpoint::open(dir.as_ref())?;
        let mut config = ck.config.clone();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut tensors = candle_core::safetensors::load(&ck.weights, device)?;
        for t in tensors.values_mut() {
            if t.dtype().is_float() {
                *t = t.to_dtype(DType::F32)?;
            }
        }
        let mut tokenizer = ck.tokenizer()?;
        let mut encode = ck.encode_config()?;
        let hidden = config.get("hidden_size").and_then(|v| v.as_u64()).unwrap_or(0) as usize;
        match ck.layout {
            Layout::PyLate => {
                let d = candle_core::safetensors::load(ck.dir.join("1_Dense/model.safetensors"), device)?;
                let Some(w) = d.get("linear.weight") else {
                    bail!("model_dir: 1_Dense/model.safetensors has no linear.weight")
                };
                if d.contains_key("linear.bias") {
                    bail!("model_dir: a projection with a bias is not supported for training")
                }
                tensors.insert(DENSE.into(), w.to_dtype(DType::F32)?);
            }
            Layout::ColBertAi => {
                let w = tensors.remove("linear.weight").expect("the layout has it");
                tensors.insert(DENSE.into(), w);
            }
            Layout::Plain => {
                // PyTorch's nn.Linear init: U(-1/√fan_in, 1/√fan_in).
                let bound = 1.0 / (hidden as f32).sqrt();
                let w: Vec<f32> = (0..dim * hidden).map(|_| rng.random_range(-bound..bound)).collect();
                tensors.insert(DENSE.into(), Tensor::from_vec(w, (dim, hidden), device)?);
                encode = EncodeConfig::default();
                let model_type = config.get("model_type").and_then(|v| v.as_str()).unwrap_or("bert");
                let table = format!(
                    "{}{}",
                    ck.prefix,
                    if model_type == "modernbert" {
                        "embeddings.tok_embeddings.weight"
                    } else {
                        "embeddings.word_embeddings.weight"
                    }
                );
                let Some(emb) = tensors.get(&table).cloned() else { bail!("model_dir: no token embeddings {table}") };
                let mut added = 0;
                for m in [&encode.query_prefix, &encode.document_prefix] {
                    if tokenizer.token_to_id(m).is_none() {
                        added += tokenizer
                            .add_tokens(vec![AddedToken::from(m.as_str(), false).normalized(true)])
                            .map_err(tok_err)?;
                    }
                }
                let vocab = tokenizer.get_vocab_size(true);
                if added > 0 {
                    let rows = emb.dim(0)?;
                    let mean = emb.mean_keepdim(0)?;
                    let std = emb.broadcast_sub(&mean)?.sqr()?.mean_all()?.sqrt()?.to_scalar::<f32>()?;
                    let n_new = vocab.saturating_sub(rows).max(added);
                    let noise: Vec<f32> =
                        (0..n_new * hidden).map(|_| rng.random_range(-1f32..1.0) * 0.1 * std).collect();
                    let new = mean.broadcast_add(&Tensor::from_vec(noise, (n_new, hidden), device)?)?;
                    tensors.insert(table, Tensor::cat(&[&emb, &new], 0)?);
                    config["vocab_size"] = serde_json::json!(rows + n_new);
                }
            }
        }
        let varmap = VarMap::new();
        {
            let mut data = varmap.data().lock().unwrap();
            for (name, t) in tensors {
                if t.dtype().is_float() {
                    data.insert(name, Var::from_tensor(&t)?);
                }
            }
        }
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, device);
        let encoder = Encoder::load(ck.encoder_vb(vb.clone()), &config)?;
        let weight = varmap.data().lock().unwrap()[DENSE].as_tensor().clone();
        let mut tokenizer_files = Vec::new();
        for f in ["tokenizer_config.json", "special_tokens_map.json", "vocab.txt"] {
            if let Ok(b) = std::fs::read(ck.dir.join(f)) {
                tokenizer_files.push((f.to_string(), b));
            }
        }
        let model = ColBert::new(
            encoder,
            Some(Projection { weight, bias: None }),
            tokenizer.clone(),
            encode.clone(),
            device,
            dtype,
        )?;
        Ok(Self { model, varmap, config, tokenizer, encode, tokenizer_files })
    }

    /// Sets the projection to the top `dim` principal directions of the
    /// encoder's document token states over `texts` (the eigenvectors of
    /// their uncentred second moment, largest first): of all `dim`-row
    /// projections with orthonormal rows, the one that keeps the most of
    /// the tokens' inner products, so that a new head starts from the
    /// encoder's own token similarities instead of a random projection's.
    /// Only scored tokens count (no padding, no skiplist).
    pub fn init_projection_pca(&self, texts: &[&str], batch: usize) -> Result<()> {
        if texts.is_empty() {
            bail!("texts: no documents to take the principal directions of")
        }
        let m = &self.model;
        let w = self.varmap.data().lock().unwrap()[DENSE].clone();
        let (dim, hidden) = w.as_tensor().dims2()?;
        let mut moment = Tensor::zeros((hidden, hidden), DType::F32, m.device())?;
        for chunk in texts.chunks(batch.max(1)) {
            let tok = m.tokenize_documents(chunk)?;
            let states =
                m.encoder.forward(&m.to_tensor(&tok.ids)?, &m.to_tensor(&tok.attention)?, DType::F32)?.detach();
            let (n, l, h) = states.dims3()?;
            let keep = m.mask_tensor(&tok.score_mask)?.to_dtype(DType::F32)?.reshape((n * l, 1))?;
            let x = states.reshape((n * l, h))?.broadcast_mul(&keep)?;
            moment = (moment + x.t()?.matmul(&x)?)?;
        }
        let c: Vec<f64> = moment.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let (values, vectors) = symmetric_eigen(c, hidden);
        let mut order: Vec<usize> = (0..hidden).collect();
        order.sort_by(|&a, &b| values[b].total_cmp(&values[a]));
        let rows: Vec<f32> = order
            .iter()
            .take(dim)
            .flat_map(|&j| (0..hidden).map(move |i| (i, j)))
            .map(|(i, j)| vectors[i * hidden + j] as f32)
            .collect();
        if rows.len() != dim * hidden {
            bail!("dim: the projection's {dim} rows exceed the encoder's hidden size {hidden}")
        }
        w.set(&Tensor::from_vec(rows, (dim, hidden), w.device())?)
    }

    /// Every trainable `Var`, by name (sorted).
    pub fn vars(&self) -> Vec<(String, Var)> {
        let data = self.varmap.data().lock().unwrap();
        let mut v: Vec<(String, Var)> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// The encoding rules (lengths, markers, skiplist).
    pub fn encode_config(&self) -> &EncodeConfig {
        &self.encode
    }

    /// The files of the checkpoint in the PyLate layout (see [`Self::save`]).
    pub(crate) fn files(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let data = self.varmap.data().lock().unwrap();
        let host = |t: &Tensor| t.to_device(&Device::Cpu);
        let mut encoder = HashMap::new();
        let mut dense = HashMap::new();
        for (name, var) in data.iter() {
            if name == DENSE {
                dense.insert("linear.weight".to_string(), host(var.as_tensor())?);
            } else {
                encoder.insert(name.clone(), host(var.as_tensor())?);
            }
        }
        let Some(w) = dense.get("linear.weight") else { bail!("model: no projection") };
        let (dout, din) = w.dims2()?;
        let json = |v: serde_json::Value| serde_json::to_vec_pretty(&v).map_err(|e| Error::Msg(format!("json: {e}")));
        let e = &self.encode;
        let mut files = vec![
            ("config.json".to_string(), json(self.config.clone())?),
            ("model.safetensors".to_string(), safetensors_bytes(&encoder)?),
            ("tokenizer.json".to_string(), self.tokenizer.to_string(true).map_err(tok_err)?.into_bytes()),
            (
                "modules.json".to_string(),
                json(serde_json::json!([
                    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                    {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}
                ]))?,
            ),
            (
                "sentence_bert_config.json".to_string(),
                json(serde_json::json!({"max_seq_length": e.document_length, "do_lower_case": false}))?,
            ),
            (
                "config_sentence_transformers.json".to_string(),
                json(serde_json::json!({
                    "model_type": "ColBERT",
                    "prompts": {"query": "", "document": ""},
                    "default_prompt_name": null,
                    "similarity_fn_name": "MaxSim",
                    "query_prefix": e.query_prefix,
                    "document_prefix": e.document_prefix,
                    "query_length": e.query_length,
                    "document_length": e.document_length,
                    "attend_to_expansion_tokens": e.attend_to_expansion_tokens,
                    "skiplist_words": e.skiplist_words,
                    "do_query_expansion": e.do_query_expansion,
                }))?,
            ),
            (
                "1_Dense/config.json".to_string(),
                json(serde_json::json!({"in_features": din, "out_features": dout, "bias": false,
                    "activation_function": "torch.nn.modules.linear.Identity", "use_residual": false}))?,
            ),
            ("1_Dense/model.safetensors".to_string(), safetensors_bytes(&dense)?),
        ];
        files.extend(self.tokenizer_files.iter().cloned());
        Ok(files)
    }

    /// Saves the model to `dir` in the PyLate layout (config.json,
    /// model.safetensors, tokenizer files, modules.json,
    /// config_sentence_transformers.json, 1_Dense/), F32 weights; written
    /// beside `dir` and renamed into place, so that a failure leaves no
    /// partial checkpoint.
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<()> {
        write_dir(dir.as_ref(), &self.files()?)
    }
}

/// Eigenvalues and eigenvectors (the columns of the row-major `n × n`
/// result) of the symmetric row-major matrix `a`, by cyclic Jacobi
/// rotations until the off-diagonal mass is below 1e-14 of the total.
fn symmetric_eigen(mut a: Vec<f64>, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut v = vec![0f64; n * n];
    for i in 0..n {
        v[i * n + i] = 1.0;
    }
    let total: f64 = a.iter().map(|x| x * x).sum::<f64>().max(f64::MIN_POSITIVE);
    for _sweep in 0..50 {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * n + j].powi(2))
            .sum();
        if off <= 1e-14 * total {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq.abs() < 1e-300 {
                    continue;
                }
                let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                let t = if theta >= 0.0 { 1.0 } else { -1.0 } / (theta.abs() + (theta * theta + 1.0).sqrt());
                let (c, s) = (1.0 / (t * t + 1.0).sqrt(), t / (t * t + 1.0).sqrt());
                for k in 0..n {
                    let (akp, akq) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
                for k in 0..n {
                    let (vkp, vkq) = (v[k * n + p], v[k * n + q]);
                    v[k * n + p] = c * vkp - s * vkq;
                    v[k * n + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    ((0..n).map(|i| a[i * n + i]).collect(), v)
}

#[cfg(test)]
mod tests {
    use super::symmetric_eigen;

    /// A·v = λ·v for every pair, on a random symmetric matrix.
    #[test]
    fn symmetric_eigen_satisfies_its_definition() {
        let n = 24;
        let mut x: u64 = 7;
        let mut rnd = || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        };
        let b: Vec<f64> = (0..n * n).map(|_| rnd()).collect();
        let a: Vec<f64> = (0..n * n).map(|k| (0..n).map(|t| b[k / n * n + t] * b[k % n * n + t]).sum()).collect();
        let (values, v) = symmetric_eigen(a.clone(), n);
        for j in 0..n {
            for i in 0..n {
                let av: f64 = (0..n).map(|k| a[i * n + k] * v[k * n + j]).sum();
                assert!((av - values[j] * v[i * n + j]).abs() < 1e-9, "column {j}, row {i}");
            }
        }
    }
}
