//! ColBERT inference: load a checkpoint, encode queries and documents as
//! the reference implementations (PyLate, colbert-ai) do, and rank with this
//! crate's MaxSim.
//!
//! Layouts read by [`ColBert::load`]:
//! - PyLate / Sentence Transformers: `config.json`, `model.safetensors`,
//!   `tokenizer.json`, `config_sentence_transformers.json` (prefixes,
//!   lengths, skiplist), `1_Dense/` (the projection); BERT or ModernBERT.
//! - colbert-ai (the original ColBERTv2 checkpoints): `bert.*` and
//!   `linear.weight` in one `model.safetensors`, markers `[unused0]` /
//!   `[unused1]`, lengths from `artifact.metadata` when present.
//! - A plain BERT encoder (no projection): token embeddings, L2-normalized.
//!
//! Encoding: the query / document marker goes right after `[CLS]`; queries
//! are truncated to `query_length` and padded with `[MASK]` up to it (query
//! augmentation; every query position is scored, the expansion tokens are
//! not attended to by the encoder unless `attend_to_expansion_tokens`);
//! documents are truncated to `document_length`, and padding and skiplist
//! tokens (punctuation) are masked out of the max.

use candle_core::{bail, DType, Device, Module, Result, Tensor};
use candle_maxsim::{l2_normalize, maxsim};
use candle_nn::{Linear, VarBuilder};
use candle_transformers::models::{bert, modernbert};
use std::path::Path;
use tokenizers::Tokenizer;

/// How text becomes token ids (PyLate's `config_sentence_transformers.json` keys).
#[derive(Clone, Debug, PartialEq)]
pub struct EncodeConfig {
    pub query_prefix: String,
    pub document_prefix: String,
    pub query_length: usize,
    pub document_length: usize,
    pub do_query_expansion: bool,
    pub attend_to_expansion_tokens: bool,
    /// Tokens masked out of the document side of MaxSim.
    pub skiplist_words: Vec<String>,
}

impl Default for EncodeConfig {
    fn default() -> Self {
        Self {
            query_prefix: "[Q] ".into(),
            document_prefix: "[D] ".into(),
            query_length: 32,
            document_length: 180,
            do_query_expansion: true,
            attend_to_expansion_tokens: false,
            // Python's string.punctuation, as PyLate and colbert-ai use.
            skiplist_words: "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~".chars().map(|c| c.to_string()).collect(),
        }
    }
}

/// Token ids and masks of a batch, padded to a common length.
#[derive(Clone, Debug)]
pub struct Tokenized {
    /// `[N, L]` token ids.
    pub ids: Vec<Vec<u32>>,
    /// `[N, L]` what the encoder attends to.
    pub attention: Vec<Vec<u8>>,
    /// `[N, L]` which positions take part in MaxSim.
    pub score_mask: Vec<Vec<u8>>,
}

enum Backbone {
    Bert(Box<bert::BertModel>),
    ModernBert(modernbert::ModernBert),
}

/// A ColBERT model: backbone, optional projection, tokenizer and encoding rules.
pub struct ColBert {
    backbone: Backbone,
    projection: Option<Linear>,
    tokenizer: Tokenizer,
    pub config: EncodeConfig,
    query_marker: Option<u32>,
    document_marker: Option<u32>,
    mask_id: u32,
    pad_id: u32,
    sep_id: Option<u32>,
    skip_ids: Vec<u32>,
    device: Device,
    out_dtype: DType,
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))
}

fn tok_err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("tokenizer: {e}"))
}

impl ColBert {
    /// Loads a checkpoint directory (see the module docs for the layouts).
    /// Embeddings come out in `dtype`; the encoder always runs in F32:
    /// candle's BERT builds its attention bias from `f32::MIN`, which rounds
    /// to -inf in F16 and BF16 and turns attended positions into NaN (0 x
    /// -inf); NaN embeddings were seen on CPU and on CUDA (H200) in both
    /// (candle-transformers 0.11).
    pub fn load(dir: impl AsRef<Path>, device: &Device, dtype: DType) -> Result<Self> {
        let dir = dir.as_ref();
        let out_dtype = dtype;
        let dtype = DType::F32;
        let config = read_json(&dir.join("config.json"))?;
        let weights = dir.join("model.safetensors");
        if !weights.exists() {
            bail!("model_dir: {} has no model.safetensors", dir.display())
        }
        // SAFETY: the file is memory-mapped read-only for the model's lifetime.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&weights], dtype, device)? };
        let model_type = config.get("model_type").and_then(|v| v.as_str()).unwrap_or("bert");
        let hidden = config.get("hidden_size").and_then(|v| v.as_u64()).unwrap_or(0) as usize;
        let backbone = if model_type == "modernbert" {
            let c: modernbert::Config = serde_json::from_value(config.clone())
                .map_err(|e| candle_core::Error::Msg(format!("config.json: {e}")))?;
            Backbone::ModernBert(modernbert::ModernBert::load(vb.clone(), &c)?)
        } else {
            let c: bert::Config = serde_json::from_value(config.clone())
                .map_err(|e| candle_core::Error::Msg(format!("config.json: {e}")))?;
            Backbone::Bert(Box::new(bert::BertModel::load(vb.clone(), &c)?))
        };

        let st = dir.join("config_sentence_transformers.json");
        let colbert_ir = vb.contains_tensor("linear.weight");
        let dense = Self::load_dense(dir, device, dtype)?;
        // A plain encoder (no projection head): token embeddings, no markers, no expansion.
        let plain = dense.is_none() && !colbert_ir;
        let mut enc = if plain {
            EncodeConfig {
                query_prefix: String::new(),
                document_prefix: String::new(),
                do_query_expansion: false,
                ..Default::default()
            }
        } else {
            EncodeConfig::default()
        };
        let projection = if let Some(p) = dense {
            Some(p)
        } else if colbert_ir {
            // colbert-ai: `linear.weight` [dim, hidden] next to the encoder, markers [unused0]/[unused1].
            let w = vb.get_unchecked("linear.weight")?;
            enc.query_prefix = "[unused0]".into();
            enc.document_prefix = "[unused1]".into();
            Some(Linear::new(w, None))
        } else {
            None
        };
        if st.exists() {
            let v = read_json(&st)?;
            let s = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
            let n = |k: &str| v.get(k).and_then(|x| x.as_u64()).map(|x| x as usize);
            let b = |k: &str| v.get(k).and_then(|x| x.as_bool());
            if let Some(x) = s("query_prefix") {
                enc.query_prefix = x;
            }
            if let Some(x) = s("document_prefix") {
                enc.document_prefix = x;
            }
            if let Some(x) = n("query_length") {
                enc.query_length = x;
            }
            if let Some(x) = n("document_length") {
                enc.document_length = x;
            }
            if let Some(x) = b("do_query_expansion") {
                enc.do_query_expansion = x;
            }
            if let Some(x) = b("attend_to_expansion_tokens") {
                enc.attend_to_expansion_tokens = x;
            }
            if let Some(words) = v.get("skiplist_words").and_then(|x| x.as_array()) {
                enc.skiplist_words = words.iter().filter_map(|w| w.as_str().map(str::to_string)).collect();
            }
        } else if colbert_ir && dir.join("artifact.metadata").exists() {
            let m = read_json(&dir.join("artifact.metadata"))?;
            if let Some(x) = m.get("query_maxlen").and_then(|x| x.as_u64()) {
                enc.query_length = x as usize;
            }
            if let Some(x) = m.get("doc_maxlen").and_then(|x| x.as_u64()) {
                enc.document_length = x as usize;
            }
        }
        if let (Some(p), true) = (&projection, hidden > 0) {
            if p.weight().dim(1)? != hidden {
                bail!("projection: weight {:?} does not take the encoder's hidden size {hidden}", p.weight().dims())
            }
        }
        let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).map_err(tok_err)?;
        // Lengths, padding and masks are ours to decide (tokenizer.json files often pad to 128).
        tokenizer.with_padding(None);
        tokenizer.with_truncation(None).map_err(tok_err)?;
        Self::new(backbone, projection, tokenizer, enc, device, out_dtype)
    }

    /// `1_Dense/` of a Sentence Transformers checkpoint, if there is one.
    fn load_dense(dir: &Path, device: &Device, dtype: DType) -> Result<Option<Linear>> {
        let d = dir.join("1_Dense");
        let file = d.join("model.safetensors");
        if !file.exists() {
            return Ok(None);
        }
        // SAFETY: read-only memory map.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&file], dtype, device)? };
        let w = vb.get_unchecked("linear.weight")?;
        let b = if vb.contains_tensor("linear.bias") { Some(vb.get_unchecked("linear.bias")?) } else { None };
        Ok(Some(Linear::new(w, b)))
    }

    fn new(
        backbone: Backbone,
        projection: Option<Linear>,
        tokenizer: Tokenizer,
        config: EncodeConfig,
        device: &Device,
        out_dtype: DType,
    ) -> Result<Self> {
        let id = |t: &str| tokenizer.token_to_id(t);
        let marker = |prefix: &str| -> Result<Option<u32>> {
            let t = prefix.trim();
            if t.is_empty() {
                return Ok(None);
            }
            match id(t) {
                Some(i) => Ok(Some(i)),
                None => bail!("tokenizer: the prefix {t:?} is not a single token of the vocabulary"),
            }
        };
        let mask_id = id("[MASK]").or_else(|| id("<mask>")).ok_or_else(|| tok_err("no [MASK] token"))?;
        let pad_id = id("[PAD]").or_else(|| id("<pad>")).unwrap_or(0);
        let skip_ids = config.skiplist_words.iter().filter_map(|w| id(w)).collect();
        Ok(Self {
            query_marker: marker(&config.query_prefix)?,
            document_marker: marker(&config.document_prefix)?,
            sep_id: id("[SEP]").or_else(|| id("</s>")),
            backbone,
            projection,
            tokenizer,
            config,
            mask_id,
            pad_id,
            skip_ids,
            device: device.clone(),
            out_dtype,
        })
    }

    /// Token ids with the marker after the first special token, truncated to
    /// `max_len` (the closing `[SEP]` kept).
    fn ids(&self, text: &str, marker: Option<u32>, max_len: usize) -> Result<Vec<u32>> {
        let enc = self.tokenizer.encode(text, true).map_err(tok_err)?;
        let mut ids = enc.get_ids().to_vec();
        if let Some(m) = marker {
            ids.insert(1.min(ids.len()), m);
        }
        if ids.len() > max_len {
            let last = *ids.last().unwrap();
            ids.truncate(max_len);
            if Some(last) == self.sep_id && max_len > 0 {
                ids[max_len - 1] = last;
            }
        }
        Ok(ids)
    }

    /// Query token ids and masks: `[N, query_length]` with `[MASK]` expansion.
    pub fn tokenize_queries(&self, texts: &[&str]) -> Result<Tokenized> {
        let lq = self.config.query_length;
        let mut out = Tokenized { ids: vec![], attention: vec![], score_mask: vec![] };
        let mut longest = 0;
        let mut rows = Vec::with_capacity(texts.len());
        for t in texts {
            let ids = self.ids(t, self.query_marker, lq)?;
            longest = longest.max(ids.len());
            rows.push(ids);
        }
        let len = if self.config.do_query_expansion { lq } else { longest };
        for ids in rows {
            let n = ids.len();
            let mut full = ids;
            let expand = self.config.do_query_expansion;
            full.resize(len, if expand { self.mask_id } else { self.pad_id });
            let attend_exp = u8::from(self.config.attend_to_expansion_tokens);
            out.attention.push(
                (0..len)
                    .map(|k| {
                        if k < n {
                            1
                        } else if expand {
                            attend_exp
                        } else {
                            0
                        }
                    })
                    .collect(),
            );
            out.score_mask.push((0..len).map(|k| u8::from(k < n || expand)).collect());
            out.ids.push(full);
        }
        Ok(out)
    }

    /// Document token ids and masks: `[N, longest]`, padding and skiplist masked from scoring.
    pub fn tokenize_documents(&self, texts: &[&str]) -> Result<Tokenized> {
        let rows: Vec<Vec<u32>> = texts
            .iter()
            .map(|t| self.ids(t, self.document_marker, self.config.document_length))
            .collect::<Result<_>>()?;
        let len = rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut out = Tokenized { ids: vec![], attention: vec![], score_mask: vec![] };
        for ids in rows {
            let n = ids.len();
            out.attention.push((0..len).map(|k| u8::from(k < n)).collect());
            out.score_mask.push((0..len).map(|k| u8::from(k < n && !self.skip_ids.contains(&ids[k]))).collect());
            let mut full = ids;
            full.resize(len, self.pad_id);
            out.ids.push(full);
        }
        Ok(out)
    }

    fn to_tensor<T: candle_core::WithDType>(&self, rows: &[Vec<T>]) -> Result<Tensor> {
        let n = rows.len();
        let l = rows.first().map_or(0, Vec::len);
        Tensor::from_vec(rows.concat(), (n, l), &self.device)
    }

    /// Contextual token embeddings, projected and L2-normalized: `[N, L, dim]`.
    pub fn embed(&self, tok: &Tokenized) -> Result<Tensor> {
        let ids = self.to_tensor(&tok.ids)?;
        let att = self.to_tensor(&tok.attention)?;
        let hidden = match &self.backbone {
            Backbone::Bert(m) => m.forward(&ids, &ids.zeros_like()?, Some(&att.to_dtype(DType::U32)?))?,
            Backbone::ModernBert(m) => m.forward(&ids, &att.to_dtype(DType::U32)?)?,
        };
        let x = match &self.projection {
            Some(p) => p.forward(&hidden)?,
            None => hidden,
        };
        l2_normalize(&x)?.to_dtype(self.out_dtype)
    }

    /// `(embeddings [N, query_length, dim], score mask [N, query_length] U8)`.
    pub fn encode_queries(&self, texts: &[&str]) -> Result<(Tensor, Tensor)> {
        let t = self.tokenize_queries(texts)?;
        Ok((self.embed(&t)?, self.to_tensor(&t.score_mask)?))
    }

    /// `(embeddings [N, L, dim], score mask [N, L] U8)` for one batch of documents.
    pub fn encode_documents(&self, texts: &[&str]) -> Result<(Tensor, Tensor)> {
        let t = self.tokenize_documents(texts)?;
        Ok((self.embed(&t)?, self.to_tensor(&t.score_mask)?))
    }

    /// MaxSim scores of one query against `docs`, encoded `batch` at a time.
    /// `progress` is called with the number of documents done.
    pub fn score(&self, query: &str, docs: &[&str], batch: usize, progress: &mut dyn FnMut(usize)) -> Result<Vec<f32>> {
        let (q, qm) = self.encode_queries(&[query])?;
        let mut scores = Vec::with_capacity(docs.len());
        for chunk in docs.chunks(batch.max(1)) {
            let (d, dm) = self.encode_documents(chunk)?;
            let s = maxsim(&q, &d, Some(&qm), Some(&dm))?;
            scores.extend(s.flatten_all()?.to_vec1::<f32>()?);
            progress(scores.len());
        }
        Ok(scores)
    }

    /// The `top_k` best documents for `query`: `(index, score)`, best first
    /// (equal scores: lower index first).
    pub fn rank(&self, query: &str, docs: &[&str], top_k: usize) -> Result<Vec<(usize, f32)>> {
        let scores = self.score(query, docs, 32, &mut |_| {})?;
        Ok(top_k_of(&scores, top_k))
    }
}

/// Indices and values of the `k` largest scores, best first, ties by index.
pub fn top_k_of(scores: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.into_iter().take(k).map(|i| (i, scores[i])).collect()
}
