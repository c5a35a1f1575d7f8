//! An HTTP search service over a [`PlaidIndex`]: queries as text (encoded
//! by a [`ColBert`] model) or as embeddings, dynamic batching of concurrent
//! requests into one index search, document metadata in SQLite with SQL
//! filters, and document additions and deletions that survive a crash.
//!
//! [`Service`] holds the index, the model and the [`Metadata`] store and
//! answers searches and updates (usable without HTTP); [`router`] and
//! [`serve`] put it behind axum. The endpoints are described in the
//! crate's README and in `GET /openapi.json`.
//!
//! The metadata store alone:
//!
//! ```
//! use candle_maxsim_serve::Metadata;
//! use serde_json::json;
//! # let dir = std::env::temp_dir().join(format!("serve-doc-{}", std::process::id()));
//! # std::fs::create_dir_all(&dir).unwrap();
//! let mut meta = Metadata::open(dir.join("meta.sqlite"), std::time::Duration::from_secs(2))?;
//! let rows = [json!({"year": 2021, "source": "pubmed"}), json!({"year": 2019, "source": "arxiv"})];
//! meta.add(&[0, 1], &rows.map(|r| r.as_object().cloned()))?;
//! let ids = meta.filter("year > ? AND source = ?", &[json!(2020), json!("pubmed")])?;
//! assert_eq!(*ids, [0]);
//! assert_eq!(meta.get(&ids)?[0].as_ref().map(|m| &m["source"]), Some(&json!("pubmed")));
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok::<(), candle_maxsim_serve::Error>(())
//! ```
//!
//! ## Crash safety
//!
//! The index commits an add or a delete atomically on disk (a new version
//! of its directory renamed into place); SQLite commits a transaction
//! atomically. The two commits are ordered so that the one left behind by
//! a process killed between them is undone (or completed) when the service
//! opens again ([`Metadata::reconcile`]):
//!
//! - add: the metadata rows of the new ids (`num_documents..`) are
//!   committed first, then the index add. Killed in between, the rows name
//!   ids the index does not have; on open, rows with `_id >= num_documents`
//!   are deleted: the add is rolled back whole.
//! - delete: the index delete first, then the rows. Killed in between, the
//!   index lists the ids as deleted; on open, rows of deleted ids are
//!   removed: the delete is completed.
//!
//! A write is acknowledged only after both commits (`synchronous = FULL`),
//! so an acknowledged write is there after a restart. Writes are
//! serialized among themselves; an add or a delete takes the index's write
//! lock only for the index update, between two search batches.

mod api;
mod batch;
mod error;
mod metadata;
mod metrics;

pub use api::{router, serve, serve_blocking, serve_with_shutdown};
pub use error::{Error, Result};
pub use metadata::{Metadata, Row};

use batch::{Job, Queries};
use candle_core::{Device, Tensor};
use candle_maxsim_colbert::ColBert;
use candle_maxsim_plaid::{PackedDocuments, PlaidIndex, SearchParams};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// The most tokens a query may have (`PlaidIndex::search`'s limit).
pub const MAX_QUERY_TOKENS: usize = 64;
/// The largest `top_k` (the engine's top-k limit).
pub const MAX_TOP_K: usize = 4096;

/// The service's knobs.
#[derive(Clone, Debug)]
pub struct Config {
    /// How long the batcher gathers requests after the first one arrives
    /// while no batch runs (default none: requests arriving while a batch
    /// runs join the next one anyway, and a lone request should not wait).
    pub batch_window: Duration,
    /// Queries per batch at most: a batch is searched as soon as it has
    /// this many (a larger request is searched alone).
    pub max_batch: usize,
    /// Request bodies larger than this are refused (413).
    pub max_body_bytes: usize,
    /// Queries per search request at most.
    pub max_queries: usize,
    /// Documents per add request at most.
    pub max_documents: usize,
    /// Tokens per added document at most.
    pub max_document_tokens: usize,
    /// The key writes need (`x-api-key` or `Authorization: Bearer`); `None`: open.
    pub api_key: Option<String>,
    /// Whether reads (search, stats, metrics, openapi) need the key too
    /// (`/health` never does).
    pub protect_reads: bool,
    /// Documents per chunk file written by an add.
    pub chunk_documents: usize,
    /// A filter running longer than this is interrupted (400).
    pub filter_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            batch_window: Duration::ZERO,
            max_batch: 256,
            max_body_bytes: 32 << 20,
            max_queries: 256,
            max_documents: 10_000,
            max_document_tokens: 8192,
            api_key: None,
            protect_reads: false,
            chunk_documents: 25_000,
            filter_timeout: Duration::from_secs(2),
        }
    }
}

/// `Err` (422) naming `field` unless `n` is 1 to `max` tokens (`what`: "a
/// query", "a document").
fn token_count(n: usize, max: usize, what: &str, field: &str) -> Result<()> {
    if n == 0 || n > max {
        return Err(Error::unprocessable(format!("{field}: {n} tokens, {what} has 1 to {max}")));
    }
    Ok(())
}

/// The type of the values in `embeddings_base64`.
#[derive(Clone, Copy)]
enum Wire {
    F32,
    F16,
    Bf16,
}

impl Wire {
    /// `embeddings_dtype` of a request (default f32); `Err` (422) when
    /// unknown or given without `embeddings_base64`.
    fn of(dtype: Option<&str>, has_bytes: bool) -> Result<Self> {
        match (dtype, has_bytes) {
            (Some(_), false) => Err(Error::unprocessable("embeddings_dtype: only with embeddings_base64")),
            (None | Some("f32"), true) | (None, false) => Ok(Wire::F32),
            (Some("f16"), true) => Ok(Wire::F16),
            (Some("bf16"), true) => Ok(Wire::Bf16),
            (Some(d), true) => Err(Error::unprocessable(format!("embeddings_dtype: `{d}` is none of f32, f16, bf16"))),
        }
    }
}

/// The values of `text` (base64 of little-endian `wire` values) as F32.
fn decode_values(text: &str, wire: Wire, field: &str) -> Result<Vec<f32>> {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| Error::bad_request(format!("{field}: not base64: {e}")))?;
    let (width, name) = match wire {
        Wire::F32 => (4, "f32"),
        Wire::F16 => (2, "f16"),
        Wire::Bf16 => (2, "bf16"),
    };
    if bytes.len() % width != 0 {
        return Err(Error::unprocessable(format!(
            "{field}: {} bytes, not a whole number of {name} values",
            bytes.len()
        )));
    }
    let chunks = bytes.chunks_exact(width);
    Ok(match wire {
        Wire::F32 => chunks.map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Wire::F16 => chunks.map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Wire::Bf16 => chunks.map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
    })
}

/// A metadata filter: an SQL condition over the metadata columns with `?`
/// placeholders, and the values bound to them in order.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Filter {
    /// The condition, e.g. `year > ? AND source = ?`.
    #[serde(rename = "where")]
    pub condition: String,
    /// The values of its placeholders.
    #[serde(default)]
    pub params: Vec<serde_json::Value>,
}

/// A search: `queries` (texts) or `embeddings` (`[Nq][Lq][dim]`), and the
/// optional search parameters (fast-plaid's names and defaults).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SearchRequest {
    /// Query texts, encoded with the model.
    pub queries: Option<Vec<String>>,
    /// Query embeddings: per query, 1 to 64 token vectors of the index's dim.
    pub embeddings: Option<Vec<Vec<Vec<f32>>>>,
    /// Query embeddings as bytes: per query, base64 (standard alphabet,
    /// padded) of its `Lq · dim` little-endian values, row-major, in
    /// `embeddings_dtype`. A quarter to a ninth of the bytes of JSON numbers,
    /// and no number parsing.
    pub embeddings_base64: Option<Vec<String>>,
    /// The values' type in `embeddings_base64`: `f32` (default), `f16` or `bf16`.
    pub embeddings_dtype: Option<String>,
    /// Results per query (default 10).
    pub top_k: Option<usize>,
    /// Centroids probed per query token (default 8).
    pub n_ivf_probe: Option<usize>,
    /// Candidates kept by approximate score (default 4096).
    pub n_full_scores: Option<usize>,
    /// PLAID's centroid pruning threshold (default none).
    pub centroid_score_threshold: Option<f32>,
    /// Only documents whose metadata satisfies this.
    pub filter: Option<Filter>,
    /// Whether hits carry their metadata (default true).
    pub include_metadata: Option<bool>,
}

/// One result.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct Hit {
    /// The document id.
    pub id: u32,
    /// Its MaxSim score.
    pub score: f32,
    /// Its metadata, when it has some and the request asked for it.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub metadata: Option<Row>,
}

/// Documents to add: `texts` (encoded with the model) or `embeddings`
/// (`[N][Ld][dim]`), and optionally one metadata object (or null) each.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AddRequest {
    /// Document texts.
    pub texts: Option<Vec<String>>,
    /// Document embeddings: per document, its token vectors.
    pub embeddings: Option<Vec<Vec<Vec<f32>>>>,
    /// Document embeddings as bytes: per document, base64 of its `Ld · dim`
    /// little-endian values, row-major, in `embeddings_dtype` (as
    /// [`SearchRequest::embeddings_base64`]).
    pub embeddings_base64: Option<Vec<String>>,
    /// The values' type in `embeddings_base64`: `f32` (default), `f16` or `bf16`.
    pub embeddings_dtype: Option<String>,
    /// Per document, its metadata object (or null).
    pub metadata: Option<Vec<Option<Row>>>,
}

/// The service: index, model, metadata store and batcher.
#[derive(Clone)]
pub struct Service {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    index: RwLock<PlaidIndex>,
    model: Option<ColBert>,
    metadata: RwLock<Metadata>,
    /// Serializes writes (the id range of an add is read, then committed, under it).
    write_lock: Mutex<()>,
    config: Config,
    metrics: metrics::Metrics,
    jobs: mpsc::Sender<Job>,
    /// The batcher's end of the channel until the batcher starts.
    jobs_rx: Mutex<Option<mpsc::Receiver<Job>>>,
    dim: usize,
}

/// Locks `m`, recovering the data of a poisoned lock (a panic elsewhere
/// leaves the data consistent: every update commits before it changes it).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// [`lock`] for reading an `RwLock` (concurrent readers: metadata filters).
fn read<T>(m: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

/// [`lock`] for writing an `RwLock`.
fn write<T>(m: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}

/// A string of a device.
fn device_name(d: &Device) -> String {
    match d {
        Device::Cpu => "cpu".into(),
        Device::Cuda(_) => "cuda".into(),
        Device::Metal(_) => "metal".into(),
    }
}

/// Runs `f` on a blocking thread; a panic there is a 500.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Error::internal(format!("worker: {e}")))?
}

impl Service {
    /// A service over `index` (its metadata in `metadata`, reconciled with
    /// the index first: see the crate docs), with an optional `model` for
    /// text queries and documents. `Err` if the model's embedding dim or
    /// query length does not fit the index.
    pub fn new(index: PlaidIndex, model: Option<ColBert>, mut metadata: Metadata, config: Config) -> Result<Self> {
        let dim = index.dim();
        if let Some(m) = &model {
            if m.dim() != dim {
                return Err(Error::internal(format!("model: embeddings of dim {}, the index's are {dim}", m.dim())));
            }
            if m.config.query_length > MAX_QUERY_TOKENS {
                return Err(Error::internal(format!(
                    "model: query_length {} exceeds the search's {MAX_QUERY_TOKENS} tokens",
                    m.config.query_length
                )));
            }
        }
        if config.max_batch == 0 || config.max_queries == 0 || config.chunk_documents == 0 {
            return Err(Error::internal("config: max_batch, max_queries and chunk_documents must be at least 1"));
        }
        metadata.reconcile(index.num_documents(), index.deleted())?;
        let (tx, rx) = mpsc::channel(4096);
        Ok(Self {
            inner: Arc::new(Inner {
                index: RwLock::new(index),
                model,
                metadata: RwLock::new(metadata),
                write_lock: Mutex::new(()),
                config,
                metrics: metrics::Metrics::new(),
                jobs: tx,
                jobs_rx: Mutex::new(Some(rx)),
                dim,
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Starts the batcher on the current tokio runtime (once).
    fn start(&self) -> Result<()> {
        let mut rx = lock(&self.inner.jobs_rx);
        if let Some(r) = rx.take() {
            let handle = tokio::runtime::Handle::try_current()
                .map_err(|e| Error::internal(format!("service: needs a tokio runtime: {e}")))?;
            handle.spawn(batch::run(Arc::downgrade(&self.inner), r));
        }
        Ok(())
    }

    /// The search parameters of `req`, checked.
    fn params(&self, req: &SearchRequest) -> Result<SearchParams> {
        let d = SearchParams::default();
        let p = SearchParams {
            top_k: req.top_k.unwrap_or(d.top_k),
            n_ivf_probe: req.n_ivf_probe.unwrap_or(d.n_ivf_probe),
            n_full_scores: req.n_full_scores.unwrap_or(d.n_full_scores),
            centroid_score_threshold: req.centroid_score_threshold,
            batch_size: 0,
        };
        let range = |name: &str, v: usize, max: usize| match (1..=max).contains(&v) {
            true => Ok(()),
            false => Err(Error::unprocessable(format!("{name}: must be between 1 and {max}, got {v}"))),
        };
        range("top_k", p.top_k, MAX_TOP_K)?;
        range("n_ivf_probe", p.n_ivf_probe, 1 << 16)?;
        range("n_full_scores", p.n_full_scores, 1 << 20)?;
        if p.centroid_score_threshold.is_some_and(|t| !t.is_finite()) {
            return Err(Error::unprocessable("centroid_score_threshold: must be finite"));
        }
        Ok(p)
    }

    /// The queries of `req`, checked against the limits and the index's dim.
    fn queries(&self, req: &SearchRequest) -> Result<Queries> {
        let max = self.inner.config.max_queries;
        let count = |n: usize, field: &str| match n {
            0 => Err(Error::unprocessable(format!("{field}: no queries"))),
            n if n > max => Err(Error::unprocessable(format!("{field}: {n} queries, at most {max} per request"))),
            _ => Ok(()),
        };
        let wire = Wire::of(req.embeddings_dtype.as_deref(), req.embeddings_base64.is_some())?;
        match (&req.queries, &req.embeddings, &req.embeddings_base64) {
            (Some(texts), None, None) => {
                count(texts.len(), "queries")?;
                if self.inner.model.is_none() {
                    return Err(Error::unprocessable(
                        "queries: the service has no model (start it with --model); send embeddings",
                    ));
                }
                Ok(Queries::Texts(texts.clone()))
            }
            (None, Some(emb), None) => {
                count(emb.len(), "embeddings")?;
                let mut out = Vec::with_capacity(emb.len());
                for (i, q) in emb.iter().enumerate() {
                    token_count(q.len(), MAX_QUERY_TOKENS, "a query", &format!("embeddings[{i}]"))?;
                    out.push((self.flatten(q, &format!("embeddings[{i}]"), false)?, q.len()));
                }
                Ok(Queries::Embeddings(out))
            }
            (None, None, Some(b64)) => {
                count(b64.len(), "embeddings_base64")?;
                let mut out = Vec::with_capacity(b64.len());
                for (i, q) in b64.iter().enumerate() {
                    let field = format!("embeddings_base64[{i}]");
                    out.push(self.tokens_from_base64(q, wire, &field, MAX_QUERY_TOKENS, "a query", false)?);
                }
                Ok(Queries::Embeddings(out))
            }
            _ => Err(Error::unprocessable("queries, embeddings, embeddings_base64: give exactly one of the three")),
        }
    }

    /// The token vectors `rows` as one row-major buffer, each checked: the
    /// index's dim, finite values, and (`nonzero`) not all zeros.
    fn flatten(&self, rows: &[Vec<f32>], field: &str, nonzero: bool) -> Result<Vec<f32>> {
        let dim = self.inner.dim;
        let mut flat = Vec::with_capacity(rows.len() * dim);
        for (j, r) in rows.iter().enumerate() {
            if r.len() != dim {
                return Err(Error::unprocessable(format!(
                    "{field}[{j}]: {} values, the index's dim is {dim}",
                    r.len()
                )));
            }
            if r.iter().any(|v| !v.is_finite()) {
                return Err(Error::unprocessable(format!("{field}[{j}]: values must be finite")));
            }
            if nonzero && r.iter().all(|&v| v == 0.0) {
                return Err(Error::unprocessable(format!("{field}[{j}]: a token vector of zeros cannot be indexed")));
            }
            flat.extend_from_slice(r);
        }
        Ok(flat)
    }

    /// Token vectors sent as bytes (`text`: base64 of little-endian `wire`
    /// values): a whole number of the index's dim, 1 to `max` of them
    /// (`what` has), finite and (`nonzero`) none all zeros. Returns the
    /// row-major values and their number of tokens.
    fn tokens_from_base64(
        &self,
        text: &str,
        wire: Wire,
        field: &str,
        max: usize,
        what: &str,
        nonzero: bool,
    ) -> Result<(Vec<f32>, usize)> {
        let flat = decode_values(text, wire, field)?;
        let dim = self.inner.dim;
        if flat.len() % dim != 0 {
            return Err(Error::unprocessable(format!(
                "{field}: {} values, not a whole number of token vectors of the index's dim {dim}",
                flat.len()
            )));
        }
        let n = flat.len() / dim;
        token_count(n, max, what, field)?;
        for (j, row) in flat.chunks_exact(dim).enumerate() {
            if row.iter().any(|v| !v.is_finite()) {
                return Err(Error::unprocessable(format!("{field}: token {j}: values must be finite")));
            }
            if nonzero && row.iter().all(|&v| v == 0.0) {
                return Err(Error::unprocessable(format!("{field}: token {j}: a vector of zeros cannot be indexed")));
            }
        }
        Ok((flat, n))
    }

    /// Searches: per query its hits, best first. Concurrent calls are
    /// batched (see the module `batch`).
    pub async fn search(&self, req: SearchRequest) -> Result<Vec<Vec<Hit>>> {
        self.start()?;
        let params = self.params(&req)?;
        let queries = self.queries(&req)?;
        let nq = queries.len();
        let subset = match &req.filter {
            None => None,
            Some(f) => {
                let svc = self.inner.clone();
                let f2 = f.clone();
                let ids = blocking(move || read(&svc.metadata).filter(&f2.condition, &f2.params)).await?;
                if ids.is_empty() {
                    return Ok(vec![Vec::new(); nq]);
                }
                Some(ids)
            }
        };
        let (reply, rx) = oneshot::channel();
        let job = Job { queries, params, subset, reply };
        self.inner.jobs.send(job).await.map_err(|_| Error::internal("search: the batcher stopped"))?;
        let results = rx.await.map_err(|_| Error::internal("search: the batch failed"))??;
        let mut hits: Vec<Vec<Hit>> = results
            .into_iter()
            .map(|r| r.into_iter().map(|(id, score)| Hit { id, score, metadata: None }).collect())
            .collect();
        if req.include_metadata.unwrap_or(true) {
            let ids: Vec<u32> = hits.iter().flatten().map(|h| h.id).collect();
            if !ids.is_empty() {
                let svc = self.inner.clone();
                let rows = blocking(move || read(&svc.metadata).get(&ids)).await?;
                for (h, m) in hits.iter_mut().flatten().zip(rows) {
                    h.metadata = m;
                }
            }
        }
        Ok(hits)
    }

    /// Adds documents; returns their ids. Acknowledged after both the
    /// metadata and the index committed (see the crate docs).
    pub async fn add(&self, req: AddRequest) -> Result<Vec<u32>> {
        let cfg = &self.inner.config;
        const EXACTLY_ONE: &str = "texts, embeddings, embeddings_base64: give exactly one of the three";
        let (n, field) = match (&req.texts, &req.embeddings, &req.embeddings_base64) {
            (Some(t), None, None) => (t.len(), "texts"),
            (None, Some(e), None) => (e.len(), "embeddings"),
            (None, None, Some(b)) => (b.len(), "embeddings_base64"),
            _ => return Err(Error::unprocessable(EXACTLY_ONE)),
        };
        let wire = Wire::of(req.embeddings_dtype.as_deref(), req.embeddings_base64.is_some())?;
        if n == 0 || n > cfg.max_documents {
            return Err(Error::unprocessable(format!(
                "{field}: {n} documents, a request adds 1 to {}",
                cfg.max_documents
            )));
        }
        let rows = match req.metadata {
            None => vec![None; n],
            Some(m) if m.len() == n => m,
            Some(m) => {
                return Err(Error::unprocessable(format!("metadata: {} objects for {n} documents", m.len())));
            }
        };
        Metadata::check_rows(&rows)?;
        let packed = |flat: Vec<f32>, lens: &[u32]| -> Result<PackedDocuments> {
            let t = flat.len() / self.inner.dim;
            Ok(PackedDocuments::new(Tensor::from_vec(flat, (t, self.inner.dim), &Device::Cpu)?, lens)?)
        };
        let max = cfg.max_document_tokens;
        let docs = match (req.texts, req.embeddings, req.embeddings_base64) {
            (Some(texts), _, _) => {
                let svc = self.inner.clone();
                blocking(move || encode_documents(&svc, &texts)).await?
            }
            (_, Some(emb), _) => {
                let mut flat = Vec::new();
                let mut lens = Vec::with_capacity(n);
                for (i, d) in emb.iter().enumerate() {
                    token_count(d.len(), max, "a document", &format!("embeddings[{i}]"))?;
                    flat.extend(self.flatten(d, &format!("embeddings[{i}]"), true)?);
                    lens.push(d.len() as u32);
                }
                packed(flat, &lens)?
            }
            (_, _, Some(b64)) => {
                let mut flat = Vec::new();
                let mut lens = Vec::with_capacity(n);
                for (i, d) in b64.iter().enumerate() {
                    let field = format!("embeddings_base64[{i}]");
                    let (values, len) = self.tokens_from_base64(d, wire, &field, max, "a document", true)?;
                    flat.extend(values);
                    lens.push(len as u32);
                }
                packed(flat, &lens)?
            }
            _ => return Err(Error::unprocessable(EXACTLY_ONE)),
        };
        let svc = self.inner.clone();
        blocking(move || {
            let _w = lock(&svc.write_lock);
            let first = svc.index.read().unwrap_or_else(|e| e.into_inner()).num_documents() as u32;
            let ids: Vec<u32> = (first..first + n as u32).collect();
            // 1. The metadata rows, committed.
            write(&svc.metadata).add(&ids, &rows)?;
            // 2. The index add, committed (a search batch in flight finishes first).
            let added = {
                let mut index = svc.index.write().unwrap_or_else(|e| e.into_inner());
                index.add(&docs, svc.config.chunk_documents)
            };
            match added {
                Ok(r) if r == (first..first + n as u32) => Ok(ids),
                Ok(r) => {
                    Err(Error::internal(format!("index: added ids {r:?}, expected {first}..{}", first + n as u32)))
                }
                Err(e) => {
                    // Undo the rows now (the next open would too).
                    let _ = write(&svc.metadata).delete(&ids);
                    Err(Error::internal(format!("index: add failed: {e}")))
                }
            }
        })
        .await
    }

    /// Deletes documents `ids` (already deleted ones are ignored); returns
    /// how many were live. Acknowledged after both commits.
    pub async fn delete(&self, ids: Vec<u32>) -> Result<usize> {
        if ids.len() > 1_000_000 {
            return Err(Error::unprocessable(format!("ids: {} ids, at most 1000000 per request", ids.len())));
        }
        let svc = self.inner.clone();
        blocking(move || {
            let _w = lock(&svc.write_lock);
            let (nd, live) = {
                let index = svc.index.read().unwrap_or_else(|e| e.into_inner());
                let nd = index.num_documents();
                if let Some((i, &d)) = ids.iter().enumerate().find(|(_, &d)| d as usize >= nd) {
                    return Err(Error::unprocessable(format!("ids[{i}]: {d} is not a document id (there are {nd})")));
                }
                let mut fresh: Vec<u32> =
                    ids.iter().copied().filter(|d| index.deleted().binary_search(d).is_err()).collect();
                fresh.sort_unstable();
                fresh.dedup();
                (nd, fresh)
            };
            let _ = nd;
            if live.is_empty() {
                return Ok(0);
            }
            // 1. The index delete, committed.
            svc.index.write().unwrap_or_else(|e| e.into_inner()).delete(&live)?;
            // 2. The rows (left behind by a crash here, removed on the next open).
            write(&svc.metadata).delete(&live)?;
            Ok(live.len())
        })
        .await
    }

    /// Folds added and deleted documents into the index's inverted file
    /// (`PlaidIndex::compact`): the layout fast-plaid reads.
    pub async fn compact(&self) -> Result<()> {
        let svc = self.inner.clone();
        blocking(move || {
            let _w = lock(&svc.write_lock);
            svc.index.write().unwrap_or_else(|e| e.into_inner()).compact()?;
            Ok(())
        })
        .await
    }

    /// Counts and shapes: documents, live documents, tokens, dim, centroids, device.
    pub fn stats(&self) -> Result<serde_json::Value> {
        // The metadata lock is never taken under the index lock.
        let columns = read(&self.inner.metadata).columns().to_vec();
        let index = self.inner.index.read().unwrap_or_else(|e| e.into_inner());
        let tokens: u64 = index.doc_lens().iter().map(|&l| l as u64).sum();
        Ok(serde_json::json!({
            "documents": index.num_documents(),
            "live_documents": index.num_documents() - index.deleted().len(),
            "deleted_documents": index.deleted().len(),
            "tokens": tokens,
            "dim": index.dim(),
            "centroids": index.num_centroids(),
            "device": device_name(index.device()),
            "model": self.inner.model.is_some(),
            "metadata_columns": columns,
            "batch_window_ms": self.inner.config.batch_window.as_secs_f64() * 1e3,
            "max_batch": self.inner.config.max_batch,
        }))
    }

    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }
}

/// Texts encoded as the index takes them (scored tokens only, packed), on the host.
fn encode_documents(svc: &Inner, texts: &[String]) -> Result<PackedDocuments> {
    let Some(model) = &svc.model else {
        return Err(Error::unprocessable("texts: the service has no model (start it with --model); send embeddings"));
    };
    let mut parts = Vec::new();
    let mut lens = Vec::with_capacity(texts.len());
    for (c, chunk) in texts.chunks(64).enumerate() {
        let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
        let (x, l) = model
            .encode_documents_packed(&refs)
            .map_err(|e| Error::internal(format!("texts: encoding failed: {e}")))?;
        if let Some(i) = l.iter().position(|&n| n == 0) {
            return Err(Error::unprocessable(format!("texts[{}]: no token to index", c * 64 + i)));
        }
        parts.push(x.to_dtype(candle_core::DType::F32)?.to_device(&Device::Cpu)?);
        lens.extend(l);
    }
    let x = Tensor::cat(&parts, 0)?;
    Ok(PackedDocuments::new(x, &lens)?)
}
