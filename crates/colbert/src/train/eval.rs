//! Retrieval quality as Sentence Transformers' `InformationRetrievalEvaluator`
//! computes it: every query ranks the whole corpus by MaxSim (equal scores:
//! lower corpus id first); MRR@10 is the mean over queries of 1 / rank of the
//! first relevant document in the top 10 (0 if none), Recall@10 the mean of
//! the fraction of a query's relevant documents in its top 10.

use super::data::Example;
use crate::ColBert;
use candle_core::Result;
use candle_maxsim::{maxsim, TopK};
use std::collections::HashMap;

/// Queries, a corpus and the relevant corpus documents of each query.
#[derive(Clone, Debug)]
pub struct EvalSet {
    pub queries: Vec<String>,
    pub corpus: Vec<String>,
    /// `relevant[i]`: corpus ids relevant to query `i`.
    pub relevant: Vec<Vec<usize>>,
}

impl EvalSet {
    /// From examples: the corpus is every distinct document of them (positives
    /// and negatives), a query's positive its relevant document.
    pub fn from_examples(examples: &[Example]) -> Self {
        let mut ids: HashMap<String, usize> = HashMap::new();
        let mut corpus = Vec::new();
        let mut id_of = |d: &str, corpus: &mut Vec<String>| -> usize {
            *ids.entry(d.to_string()).or_insert_with(|| {
                corpus.push(d.to_string());
                corpus.len() - 1
            })
        };
        let mut relevant = Vec::new();
        for e in examples {
            let pos = id_of(&e.documents[0], &mut corpus);
            for d in &e.documents[1..] {
                id_of(d, &mut corpus);
            }
            relevant.push(vec![pos]);
        }
        Self { queries: examples.iter().map(|e| e.query.clone()).collect(), corpus, relevant }
    }
}

/// MRR@10 and Recall@10.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Metrics {
    pub mrr_at_10: f64,
    pub recall_at_10: f64,
}

/// Ranks `set`'s corpus for each of its queries with `model` (documents
/// encoded `batch` at a time) and scores the rankings.
pub fn evaluate(model: &ColBert, set: &EvalSet, batch: usize) -> Result<Metrics> {
    let refs: Vec<&str> = set.queries.iter().map(String::as_str).collect();
    let mut qs = Vec::new();
    for chunk in refs.chunks(batch.max(1)) {
        qs.push(model.encode_queries(chunk)?);
    }
    let nq = set.queries.len();
    let k = 10.min(set.corpus.len());
    let mut tops: Vec<TopK> = qs.iter().map(|(q, _)| TopK::new(q.dim(0).unwrap_or(0), k)).collect();
    let docs: Vec<&str> = set.corpus.iter().map(String::as_str).collect();
    let mut base = 0;
    for chunk in docs.chunks(batch.max(1)) {
        let (d, dm) = model.encode_documents(chunk)?;
        for ((q, qm), top) in qs.iter().zip(tops.iter_mut()) {
            let s = maxsim(q, &d, Some(qm), Some(&dm))?;
            top.push(&s, |j| (base + j) as u32)?;
        }
        base += chunk.len();
    }
    let (mut mrr, mut recall) = (0.0, 0.0);
    let mut qi = 0;
    for top in tops {
        let (_, ids) = top.finish(&candle_core::Device::Cpu)?;
        for row in ids.to_vec2::<u32>()? {
            let rel = &set.relevant[qi];
            if let Some(r) = row.iter().position(|&d| rel.contains(&(d as usize))) {
                mrr += 1.0 / (r + 1) as f64;
            }
            recall += row.iter().filter(|&&d| rel.contains(&(d as usize))).count() as f64 / rel.len().max(1) as f64;
            qi += 1;
        }
    }
    Ok(Metrics { mrr_at_10: mrr / nq.max(1) as f64, recall_at_10: recall / nq.max(1) as f64 })
}
