//! ColBERT models in candle: load a checkpoint, encode queries and documents
//! as the reference implementations (PyLate, colbert-ai) do, rank with
//! candle-maxsim's MaxSim, and fine-tune the whole model ([`train`]).
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

mod checkpoint;
pub mod encoder;
pub mod train;

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_maxsim::{l2_normalize, maxsim};
use candle_nn::VarBuilder;
use checkpoint::{Checkpoint, Layout};
use encoder::Encoder;
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

/// Documents tokenized for the packed encoder: ids back to back, their
/// offsets, the packed rows that are scored, and each document's count of them.
struct PackedBatch {
    ids: Vec<u32>,
    cu: Vec<u32>,
    keep: Vec<u32>,
    lens: Vec<u32>,
}

/// A linear projection `[dout, din]` (and bias).
#[derive(Clone, Debug)]
pub(crate) struct Projection {
    pub(crate) weight: Tensor,
    pub(crate) bias: Option<Tensor>,
}

/// A ColBERT model: encoder, optional projection, tokenizer and encoding rules.
pub struct ColBert {
    encoder: Encoder,
    projection: Option<Projection>,
    tokenizer: Tokenizer,
    pub config: EncodeConfig,
    query_marker: Option<u32>,
    document_marker: Option<u32>,
    mask_id: u32,
    pad_id: u32,
    sep_id: Option<u32>,
    skip_ids: Vec<u32>,
    device: Device,
    /// The dtype the encoder computes in.
    dtype: DType,
    out_dtype: DType,
    /// Whether [`ColBert::embed`] runs the encoder on packed sequences where it can.
    packed: bool,
}

fn tok_err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("tokenizer: {e}"))
}

impl ColBert {
    /// Loads a checkpoint directory (see the module docs for the layouts);
    /// the encoder computes and the embeddings come out in `dtype`
    /// (F16 and BF16 included: the encoders' masks stay finite).
    pub fn load(dir: impl AsRef<Path>, device: &Device, dtype: DType) -> Result<Self> {
        let ck = Checkpoint::open(dir.as_ref())?;
        // SAFETY: the file is memory-mapped read-only for the model's lifetime.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&ck.weights], dtype, device)? };
        let encoder = Encoder::load(ck.encoder_vb(vb.clone()), &ck.config)?;
        let projection = match ck.layout {
            Layout::PyLate => Some(Self::load_dense(ck.dir.as_path(), device, dtype)?),
            Layout::ColBertAi => Some(Projection { weight: vb.get_unchecked("linear.weight")?, bias: None }),
            Layout::Plain => None,
        };
        Self::from_parts(encoder, projection, &ck, device, dtype)
    }

    /// The model of checkpoint `ck` with `encoder` and `projection`: the
    /// tokenizer and encoding rules read from the checkpoint.
    pub(crate) fn from_parts(
        encoder: Encoder,
        projection: Option<Projection>,
        ck: &Checkpoint,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let hidden = ck.config.get("hidden_size").and_then(|v| v.as_u64()).unwrap_or(0) as usize;
        if let (Some(p), true) = (&projection, hidden > 0) {
            if p.weight.dim(1)? != hidden {
                bail!("projection: weight {:?} does not take the encoder's hidden size {hidden}", p.weight.dims())
            }
        }
        Self::new(encoder, projection, ck.tokenizer()?, ck.encode_config()?, device, dtype)
    }

    /// `1_Dense/` of a Sentence Transformers checkpoint.
    fn load_dense(dir: &Path, device: &Device, dtype: DType) -> Result<Projection> {
        let file = dir.join("1_Dense/model.safetensors");
        // SAFETY: read-only memory map.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&file], dtype, device)? };
        let weight = vb.get_unchecked("linear.weight")?;
        let bias = if vb.contains_tensor("linear.bias") { Some(vb.get_unchecked("linear.bias")?) } else { None };
        Ok(Projection { weight, bias })
    }

    pub(crate) fn new(
        encoder: Encoder,
        projection: Option<Projection>,
        tokenizer: Tokenizer,
        config: EncodeConfig,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let id = |t: &str| tokenizer.token_to_id(t);
        let marker = |prefix: &str| -> Result<Option<u32>> {
            let t = prefix.trim();
            if t.is_empty() {
                return Ok(None);
            }
            // PyLate adds the prefix itself ("[Q] ", trailing space included) as a token.
            match id(prefix).or_else(|| id(t)) {
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
            encoder,
            projection,
            tokenizer,
            config,
            mask_id,
            pad_id,
            skip_ids,
            device: device.clone(),
            dtype,
            out_dtype: dtype,
            packed: true,
        })
    }

    /// Token ids of each text with the marker after the first special
    /// token, truncated to `max_len` (the closing `[SEP]` kept). The texts are
    /// encoded in parallel (the tokenizer's thread pool): one at a time, a
    /// training batch of 288 passages took 90 ms, as long as its step.
    fn ids(&self, texts: &[&str], marker: Option<u32>, max_len: usize) -> Result<Vec<Vec<u32>>> {
        let encs = self.tokenizer.encode_batch(texts.to_vec(), true).map_err(tok_err)?;
        Ok(encs
            .into_iter()
            .map(|enc| {
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
                ids
            })
            .collect())
    }

    /// Query token ids and masks: `[N, query_length]` with `[MASK]` expansion.
    pub fn tokenize_queries(&self, texts: &[&str]) -> Result<Tokenized> {
        let lq = self.config.query_length;
        let mut out = Tokenized { ids: vec![], attention: vec![], score_mask: vec![] };
        let mut longest = 0;
        let rows = self.ids(texts, self.query_marker, lq)?;
        for ids in &rows {
            longest = longest.max(ids.len());
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
        let rows = self.ids(texts, self.document_marker, self.config.document_length)?;
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

    /// Contextual token embeddings, projected and L2-normalized: `[N, L, dim]`
    /// (differentiable when the weights are `Var`s: see [`train`]).
    ///
    /// Where every row attends to a prefix of itself and scores only
    /// attended positions (documents; queries whose `[MASK]` expansion is
    /// attended), the encoder runs on the packed sequences
    /// ([`encoder::Encoder::forward_packed`]): padding costs no compute and
    /// no memory, forward or backward, and its rows come out as zeros.
    /// Otherwise (queries with unattended expansion, whose `[MASK]` rows are
    /// scored) it runs padded. Both compute the same function at the rows
    /// that are scored; [`ColBert::set_packed_encoder`] chooses.
    pub fn embed(&self, tok: &Tokenized) -> Result<Tensor> {
        match self.packed.then(|| packed_lengths(tok)).flatten() {
            Some(lens) => self.embed_packed(tok, &lens),
            None => self.embed_padded(tok),
        }
    }

    /// Whether [`ColBert::embed`] may run the encoder on packed sequences
    /// (the default) or always pads: for comparisons and measurements.
    pub fn set_packed_encoder(&mut self, packed: bool) {
        self.packed = packed;
    }

    /// [`ColBert::embed`] on packed sequences of `lens` tokens: one gather
    /// puts the rows back at their padded positions (a zero row at padding).
    fn embed_packed(&self, tok: &Tokenized, lens: &[usize]) -> Result<Tensor> {
        let (n, l) = (tok.ids.len(), tok.ids.first().map_or(0, Vec::len));
        let t: usize = lens.iter().sum();
        let (mut ids, mut cu, mut at) = (Vec::with_capacity(t), vec![0u32], Vec::with_capacity(n * l));
        for (row, &len) in tok.ids.iter().zip(lens) {
            let start = ids.len() as u32;
            ids.extend_from_slice(&row[..len]);
            cu.push(ids.len() as u32);
            at.extend((start..start + len as u32).chain(std::iter::repeat_n(t as u32, l - len)));
        }
        let dev = &self.device;
        let offsets = candle_maxsim::nn::SeqOffsets::from_slice(&cu, dev)?;
        let hidden = self.encoder.forward_packed_offsets(&Tensor::from_vec(ids, t, dev)?, &offsets, self.dtype)?;
        let rows = self.head(&hidden)?;
        let rows = Tensor::cat(&[&rows, &Tensor::zeros((1, rows.dim(1)?), rows.dtype(), dev)?], 0)?;
        // A row gather whose backward is a row scatter-add (candle's
        // `index_select` backward took 27 ms for 34 000 rows on an H200).
        candle_maxsim::nn::embedding(&rows, &Tensor::from_vec(at, (n, l), dev)?)
    }

    /// [`ColBert::embed`] with every row padded to the batch's length.
    pub fn embed_padded(&self, tok: &Tokenized) -> Result<Tensor> {
        let ids = self.to_tensor(&tok.ids)?;
        let att = self.to_tensor(&tok.attention)?;
        let hidden = self.encoder.forward(&ids, &att, self.dtype)?;
        let (n, l, h) = hidden.dims3()?;
        self.head(&hidden.reshape((n * l, h))?)?.reshape((n, l, ()))
    }

    /// The projection and L2 normalization of hidden rows `[R, H]` → `[R, dim]`.
    fn head(&self, hidden: &Tensor) -> Result<Tensor> {
        // One graph node (product and bias), as the encoder's projections.
        let x = match &self.projection {
            Some(p) => candle_maxsim::nn::linear(hidden, &p.weight.to_dtype(hidden.dtype())?, p.bias.as_ref())?,
            None => hidden.clone(),
        };
        l2_normalize(&x)?.to_dtype(self.out_dtype)
    }

    /// A `[N, L]` U8 mask (a [`Tokenized`] field) as a tensor on the model's device.
    pub fn mask_tensor(&self, rows: &[Vec<u8>]) -> Result<Tensor> {
        self.to_tensor(rows)
    }

    /// Whether token `id` is one the encoding adds (`[CLS]`, `[SEP]`, padding,
    /// `[MASK]`, the markers): not text.
    pub fn is_special(&self, id: u32) -> bool {
        Some(id) == self.query_marker
            || Some(id) == self.document_marker
            || Some(id) == self.sep_id
            || id == self.mask_id
            || id == self.pad_id
            || self.tokenizer.id_to_token(id).is_some_and(|t| t == "[CLS]" || t == "<s>" || t == "</s>")
    }

    /// The embeddings' dimension: the projection's output, or the
    /// encoder's hidden size where there is no projection.
    pub fn dim(&self) -> usize {
        match &self.projection {
            Some(p) => p.weight.dims()[0],
            None => self.encoder.token_embeddings().dims()[1],
        }
    }

    /// The dtype the encoder computes in.
    pub fn compute_dtype(&self) -> DType {
        self.dtype
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        &self.device
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

    /// One batch of documents as an index takes them: the scored tokens only
    /// (padding and skiplist dropped), packed, `(embeddings [T, dim], lengths [N])`.
    /// The encoder runs on the packed sequences ([`encoder::Encoder::forward_packed`]):
    /// no padding is computed; the rows equal [`ColBert::encode_documents`]'
    /// scored rows up to rounding.
    pub fn encode_documents_packed(&self, texts: &[&str]) -> Result<(Tensor, Vec<u32>)> {
        self.encode_packed(self.tokenize_packed(texts)?)
    }

    /// The host's part of [`ColBert::encode_documents_packed`]: tokenized,
    /// packed, the scored rows listed.
    fn tokenize_packed(&self, texts: &[&str]) -> Result<PackedBatch> {
        let docs = self.ids(texts, self.document_marker, self.config.document_length)?;
        let (mut cu, mut keep, mut lens) = (vec![0u32], Vec::new(), Vec::with_capacity(docs.len()));
        for ids in &docs {
            let start = *cu.last().unwrap();
            let kept = (0..ids.len() as u32).filter(|&k| !self.skip_ids.contains(&ids[k as usize]));
            let before = keep.len();
            keep.extend(kept.map(|k| start + k));
            lens.push((keep.len() - before) as u32);
            cu.push(start + ids.len() as u32);
        }
        Ok(PackedBatch { ids: docs.concat(), cu, keep, lens })
    }

    /// The device's part: enqueued, not waited for (the offsets go to the
    /// device from the host, never back).
    fn encode_packed(&self, b: PackedBatch) -> Result<(Tensor, Vec<u32>)> {
        if b.keep.is_empty() {
            return Ok((Tensor::zeros((0, self.dim()), self.out_dtype, &self.device)?, b.lens));
        }
        let dev = &self.device;
        let offsets = candle_maxsim::nn::SeqOffsets::from_slice(&b.cu, dev)?;
        let t = b.ids.len();
        let hidden = self.encoder.forward_packed_offsets(&Tensor::from_vec(b.ids, t, dev)?, &offsets, self.dtype)?;
        let n = b.keep.len();
        self.head(&hidden.index_select(&Tensor::from_vec(b.keep, n, dev)?, 0)?).map(|x| (x, b.lens))
    }

    /// [`ColBert::encode_documents_packed`] over a whole collection, `batch`
    /// documents at a time, each batch's result handed to `sink` in order:
    /// the next batch is tokenized on the host while the device encodes the
    /// current one (`sink` reading a batch back waits for that batch only).
    /// What an index build from text runs.
    pub fn encode_documents_stream(
        &self,
        texts: &[&str],
        batch: usize,
        sink: &mut dyn FnMut(Tensor, Vec<u32>) -> Result<()>,
    ) -> Result<()> {
        if batch == 0 {
            bail!("batch: must be at least 1")
        }
        let mut chunks = texts.chunks(batch);
        let mut next = chunks.next().map(|c| self.tokenize_packed(c)).transpose()?;
        while let Some(b) = next.take() {
            let (x, lens) = self.encode_packed(b)?;
            next = chunks.next().map(|c| self.tokenize_packed(c)).transpose()?;
            sink(x, lens)?;
        }
        Ok(())
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

/// Each row's attended length when the batch can run packed: every row
/// attends to a prefix of itself and scores nothing beyond it.
fn packed_lengths(tok: &Tokenized) -> Option<Vec<usize>> {
    tok.attention
        .iter()
        .zip(&tok.score_mask)
        .map(|(a, s)| {
            let len = a.iter().take_while(|&&x| x != 0).count();
            (a[len..].iter().all(|&x| x == 0) && s[len..].iter().all(|&x| x == 0)).then_some(len)
        })
        .collect::<Option<Vec<usize>>>()
        .filter(|lens| lens.iter().any(|&l| l > 0))
}

/// The documents of a text file, one per line: lines trimmed, blank ones
/// skipped. Errors name the file, also when it holds no document (empty or
/// blank lines only), which nothing could be ranked or indexed from.
pub fn read_documents(path: impl AsRef<Path>) -> Result<Vec<String>> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path)
        .map_err(|e| candle_core::Error::Msg(format!("{}: cannot read: {e}", path.display())))?;
    let docs: Vec<String> = text.lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_string).collect();
    if docs.is_empty() {
        bail!("{}: no documents (the file is empty or holds only blank lines; one document per line)", path.display())
    }
    Ok(docs)
}

/// Indices and values of the `k` largest scores, best first, ties by index.
pub fn top_k_of(scores: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.into_iter().take(k).map(|i| (i, scores[i])).collect()
}
