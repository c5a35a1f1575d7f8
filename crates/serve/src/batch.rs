//! Dynamic batching: search requests arrive on a channel; one task gathers
//! them for a bounded window (flushing early at `max_batch` queries),
//! encodes every text query of the batch in one `encode_queries` call, and
//! runs one `PlaidIndex::search` per group of requests sharing search
//! parameters (and being filtered or not) on a blocking thread, then hands
//! each request its own rows of the results. Batches run one at a time;
//! the next one gathers while the current one runs.

use crate::error::{Error, Result};
use crate::Inner;
use candle_core::{DType, Device, Tensor};
use candle_maxsim_plaid::{SearchParams, SearchResults, Subset};
use std::sync::{Arc, Weak};
use tokio::sync::{mpsc, oneshot};

/// One query: its `Lq · dim` values (F32, row-major) and `Lq`.
pub(crate) type Query = (Vec<f32>, usize);

/// A job with its queries as embeddings.
type Ready = (Job, Vec<Query>);

/// The queries of one request.
pub(crate) enum Queries {
    /// Texts, encoded by the model in the batch.
    Texts(Vec<String>),
    /// Per query, its embeddings.
    Embeddings(Vec<Query>),
}

impl Queries {
    pub fn len(&self) -> usize {
        match self {
            Queries::Texts(t) => t.len(),
            Queries::Embeddings(e) => e.len(),
        }
    }
}

/// One search request waiting for its batch.
pub(crate) struct Job {
    pub queries: Queries,
    pub params: SearchParams,
    /// The ids the filter allows (ascending). Requests with the same filter
    /// between two writes share one list (the store keeps it), which is how
    /// a batch tells them apart from others.
    pub subset: Option<Arc<Vec<u32>>>,
    pub reply: oneshot::Sender<Result<SearchResults>>,
}

/// Requests sharing one index search call.
#[derive(Clone, Debug, PartialEq)]
struct GroupKey {
    top_k: usize,
    n_ivf_probe: usize,
    n_full_scores: usize,
    threshold: Option<u32>,
    filtered: bool,
}

impl GroupKey {
    fn of(job: &Job) -> Self {
        let p = &job.params;
        Self {
            top_k: p.top_k,
            n_ivf_probe: p.n_ivf_probe,
            n_full_scores: p.n_full_scores,
            threshold: p.centroid_score_threshold.map(f32::to_bits),
            filtered: job.subset.is_some(),
        }
    }
}

/// The batching loop: runs until every sender is gone (the service dropped).
/// The next batch gathers while the current one runs: it closes when its
/// window has passed and the current batch is done (or at `max_batch`
/// queries), then runs. Under load, requests answered by one batch come
/// back while the next runs and join the one after, instead of each batch
/// closing on whatever arrived within one window of an idle device.
pub(crate) async fn run(inner: Weak<Inner>, mut rx: mpsc::Receiver<Job>) {
    let mut carry: Option<Job> = None;
    let mut running: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        // The running batch (if any) is awaited in the gathering below, not
        // here: what arrives while it runs joins this batch.
        let first = match carry.take() {
            Some(j) => j,
            None => match rx.recv().await {
                Some(j) => j,
                None => {
                    if let Some(h) = running.take() {
                        let _ = h.await;
                    }
                    return;
                }
            },
        };
        let Some(svc) = inner.upgrade() else { return };
        let (window, max_batch) = (svc.config.batch_window, svc.config.max_batch.max(1));
        let deadline = tokio::time::Instant::now() + window;
        let mut queries = first.queries.len();
        let mut jobs = vec![first];
        let mut closed = false; // the channel is gone
        while queries < max_batch && !closed {
            let window_open = tokio::time::Instant::now() < deadline;
            if !window_open && running.is_none() {
                break;
            }
            tokio::select! {
                j = rx.recv() => match j {
                    Some(j) if queries + j.queries.len() > max_batch => {
                        carry = Some(j);
                        break;
                    }
                    Some(j) => {
                        queries += j.queries.len();
                        jobs.push(j);
                    }
                    None => closed = true,
                },
                _ = tokio::time::sleep_until(deadline), if window_open => {}
                _ = async { running.as_mut().expect("guarded").await }, if running.is_some() => running = None,
            }
        }
        // One batch on the device at a time.
        if let Some(h) = running.take() {
            let _ = h.await;
        }
        // A panic in the batch drops its reply senders: those requests get a 500.
        running = Some(tokio::task::spawn_blocking(move || run_batch(&svc, jobs)));
        if closed {
            if let Some(h) = running.take() {
                let _ = h.await;
            }
            return;
        }
    }
}

/// Encodes, groups and searches one batch, replying to every job.
fn run_batch(svc: &Inner, jobs: Vec<Job>) {
    let dim = svc.dim;
    // 1. Every text query of the batch in one encode_queries call.
    let texts: Vec<&str> = jobs
        .iter()
        .filter_map(|j| match &j.queries {
            Queries::Texts(t) => Some(t.iter().map(String::as_str)),
            _ => None,
        })
        .flatten()
        .collect();
    let mut encoded = match texts.is_empty() {
        true => Ok(Vec::new().into_iter()),
        false => encode(svc, &texts).map(Vec::into_iter),
    };
    let mut ready: Vec<Ready> = Vec::with_capacity(jobs.len());
    for job in jobs {
        match &job.queries {
            Queries::Embeddings(e) => {
                let e = e.clone();
                ready.push((job, e));
            }
            Queries::Texts(t) => match &mut encoded {
                Ok(rows) => {
                    let mine: Vec<_> = rows.by_ref().take(t.len()).collect();
                    ready.push((job, mine));
                }
                Err(e) => {
                    let _ = job.reply.send(Err(e.clone()));
                }
            },
        }
    }
    // 2. Groups of equal parameters, in arrival order.
    let mut groups: Vec<(GroupKey, Vec<Ready>)> = Vec::new();
    for (job, q) in ready {
        let key = GroupKey::of(&job);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push((job, q)),
            None => groups.push((key, vec![(job, q)])),
        }
    }
    // 3. One search per group; each job gets its rows.
    for (_, group) in groups {
        let counts: Vec<usize> = group.iter().map(|(_, q)| q.len()).collect();
        let result = search_group(svc, &group, dim);
        let mut results = match result {
            Ok(r) => r.into_iter(),
            Err(e) => {
                for (job, _) in group {
                    let _ = job.reply.send(Err(e.clone()));
                }
                continue;
            }
        };
        for ((job, _), n) in group.into_iter().zip(counts) {
            let _ = job.reply.send(Ok(results.by_ref().take(n).collect()));
        }
    }
}

/// The query embeddings of `texts`: per query its `Lq · dim` F32 values,
/// the positions outside the score mask zeroed (padding to the search).
fn encode(svc: &Inner, texts: &[&str]) -> Result<Vec<Query>> {
    let Some(model) = &svc.model else {
        return Err(Error::unprocessable("queries: the service has no model (start it with --model); send embeddings"));
    };
    let run = || -> candle_core::Result<Vec<Query>> {
        let (emb, mask) = model.encode_queries(texts)?;
        let emb = emb.to_dtype(DType::F32)?.broadcast_mul(&mask.to_dtype(DType::F32)?.unsqueeze(2)?)?;
        let (n, lq, d) = emb.dims3()?;
        let flat = emb.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
        Ok((0..n).map(|i| (flat[i * lq * d..(i + 1) * lq * d].to_vec(), lq)).collect())
    };
    run().map_err(|e| Error::internal(format!("queries: encoding failed: {e}")))
}

/// One `PlaidIndex::search` over the queries of `group` (zero-padded to
/// their longest), under the index's read lock.
fn search_group(svc: &Inner, group: &[Ready], dim: usize) -> Result<SearchResults> {
    let start = std::time::Instant::now();
    let queries: Vec<&Query> = group.iter().flat_map(|(_, q)| q.iter()).collect();
    let nq = queries.len();
    if nq == 0 {
        return Ok(Vec::new());
    }
    let lmax = queries.iter().map(|q| q.1).max().unwrap_or(1).max(1);
    let mut data = vec![0f32; nq * lmax * dim];
    for (i, (rows, lq)) in queries.iter().enumerate() {
        data[i * lmax * dim..i * lmax * dim + lq * dim].copy_from_slice(&rows[..lq * dim]);
    }
    let params = SearchParams { batch_size: 0, ..group[0].0.params.clone() };
    let index = svc.index.read().unwrap_or_else(|e| e.into_inner());
    // On a GPU in F16, as the index: the exact-scoring kernel takes F16 or
    // BF16 queries; F32 ones are scored through its host fallback (~40 ms
    // per batch at 17 M tokens, H200). Converted there: on the host it is a
    // loop over every value of the batch.
    let q = Tensor::from_vec(data, (nq, lmax, dim), index.device())?;
    let q = if index.device().is_cuda() { q.to_dtype(DType::F16)? } else { q };
    let nd = index.num_documents() as u32;
    // Rows written by an add whose index commit is in flight may name ids
    // the index does not have yet: they are not searchable, so dropped.
    let clip = |s: &Arc<Vec<u32>>| -> Vec<u32> { s.iter().copied().take_while(|&d| d < nd).collect() };
    let subsets: Vec<&Arc<Vec<u32>>> = group.iter().filter_map(|(j, _)| j.subset.as_ref()).collect();
    let engine = std::time::Instant::now();
    let results = if subsets.is_empty() {
        index.search(&q, &params, None)
    } else if subsets.iter().all(|s| Arc::ptr_eq(s, subsets[0])) {
        index.search(&q, &params, Some(Subset::Shared(&clip(subsets[0]))))
    } else {
        let mut lists = Vec::with_capacity(nq);
        for (job, q) in group {
            let ids = job.subset.as_ref().map(clip).unwrap_or_default();
            lists.extend(std::iter::repeat_n(ids, q.len()));
        }
        index.search(&q, &params, Some(Subset::PerQuery(&lists)))
    };
    drop(index);
    svc.metrics.batch(nq, start.elapsed().as_secs_f64(), engine.elapsed().as_secs_f64());
    results.map_err(|e| Error::internal(format!("search: {e}")))
}
