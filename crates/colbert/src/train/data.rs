//! Training and evaluation data: JSONL files with PyLate's column
//! conventions, read and validated (every error names the file and line).
//!
//! - Contrastive rows: `query` (or `anchor`), `positive`, and the hard
//!   negatives as `negative` (a string or a list of strings) or
//!   `negative_1`, `negative_2`, …; every row has the same number.
//! - Distillation rows: `query_id`, `document_ids` (a list), `scores` (a
//!   list of the teacher's scores, as long as `document_ids`), with the texts
//!   in a queries file (`query_id`, `text`) and a documents file
//!   (`document_id`, `text`).
//! - Evaluation sets in the BEIR layout ([`read_beir`]): `corpus.jsonl`
//!   (`_id`, `title`, `text`), `queries.jsonl` (`_id`, `text`) and
//!   `qrels/SPLIT.tsv` (`query-id`, `corpus-id`, `score`, a header line).

use candle_core::{bail, Error, Result};
use std::collections::HashMap;
use std::path::Path;

/// One training example: a query and its documents (the positive first),
/// with the teacher's scores of them for distillation.
#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    /// The query text.
    pub query: String,
    /// The documents: the positive, then the negatives (contrastive); the
    /// scored documents (distillation).
    pub documents: Vec<String>,
    /// The teacher's scores of `documents` (distillation only).
    pub scores: Option<Vec<f32>>,
    /// Where it came from, `FILE:LINE`, for error messages.
    pub origin: String,
}

/// The non-empty lines of a JSONL file, parsed, with their line numbers.
fn jsonl(path: &Path) -> Result<Vec<(usize, serde_json::Map<String, serde_json::Value>)>> {
    let text =
        std::fs::read_to_string(path).map_err(|e| Error::Msg(format!("{}: cannot read: {e}", path.display())))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<serde_json::Value>(line) {
            Ok(serde_json::Value::Object(m)) => rows.push((i + 1, m)),
            Ok(_) => bail!("{}:{}: expected a JSON object", path.display(), i + 1),
            Err(e) => bail!("{}:{}: not valid JSON: {e}", path.display(), i + 1),
        }
    }
    if rows.is_empty() {
        bail!("{}: no examples (the file is empty)", path.display())
    }
    Ok(rows)
}

fn text(path: &Path, line: usize, row: &serde_json::Map<String, serde_json::Value>, keys: &[&str]) -> Result<String> {
    for k in keys {
        match row.get(*k) {
            Some(serde_json::Value::String(s)) => {
                if s.trim().is_empty() {
                    bail!("{}:{line}: `{k}` is empty", path.display())
                }
                return Ok(s.clone());
            }
            Some(v) => bail!("{}:{line}: `{k}` must be a string, got {v}", path.display()),
            None => {}
        }
    }
    bail!("{}:{line}: missing field `{}`", path.display(), keys[0])
}

/// Contrastive examples (see the [module docs](self)).
pub fn read_triples(path: impl AsRef<Path>) -> Result<Vec<Example>> {
    let path = path.as_ref();
    let mut out = Vec::new();
    let mut n_neg = None;
    for (line, row) in jsonl(path)? {
        let query = text(path, line, &row, &["query", "anchor"])?;
        let mut documents = vec![text(path, line, &row, &["positive"])?];
        match row.get("negative") {
            Some(serde_json::Value::Array(list)) => {
                for (k, v) in list.iter().enumerate() {
                    match v.as_str() {
                        Some(s) if !s.trim().is_empty() => documents.push(s.to_string()),
                        _ => bail!("{}:{line}: `negative[{k}]` must be a non-empty string", path.display()),
                    }
                }
            }
            Some(_) => documents.push(text(path, line, &row, &["negative"])?),
            None => {
                let mut k = 1;
                while row.contains_key(&format!("negative_{k}")) {
                    documents.push(text(path, line, &row, &[&format!("negative_{k}")])?);
                    k += 1;
                }
            }
        }
        match n_neg {
            None => n_neg = Some(documents.len()),
            Some(n) if n != documents.len() => bail!(
                "{}:{line}: {} negatives, but the rows before have {}",
                path.display(),
                documents.len() - 1,
                n - 1
            ),
            _ => {}
        }
        out.push(Example { query, documents, scores: None, origin: format!("{}:{line}", path.display()) });
    }
    Ok(out)
}

/// `id → text` of a queries or documents file.
fn texts(path: &Path, id_key: &str) -> Result<HashMap<String, String>> {
    let mut out = HashMap::new();
    for (line, row) in jsonl(path)? {
        let id = match row.get(id_key) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => bail!("{}:{line}: missing field `{id_key}`", path.display()),
        };
        out.insert(id, text(path, line, &row, &["text"])?);
    }
    Ok(out)
}

fn id_string(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Distillation examples (see the [module docs](self)): at most `n_ways`
/// documents of each row (its first ones, as PyLate's `KDProcessing`).
pub fn read_distillation(
    train: impl AsRef<Path>,
    queries: impl AsRef<Path>,
    documents: impl AsRef<Path>,
    n_ways: usize,
) -> Result<Vec<Example>> {
    let (path, qs, ds) =
        (train.as_ref(), texts(queries.as_ref(), "query_id")?, texts(documents.as_ref(), "document_id")?);
    let mut out = Vec::new();
    for (line, row) in jsonl(path)? {
        let Some(qid) = row.get("query_id").and_then(id_string) else {
            bail!("{}:{line}: missing field `query_id`", path.display())
        };
        let Some(query) = qs.get(&qid) else {
            bail!("{}:{line}: query_id {qid} is not in {}", path.display(), queries.as_ref().display())
        };
        let (Some(ids), Some(scores)) =
            (row.get("document_ids").and_then(|v| v.as_array()), row.get("scores").and_then(|v| v.as_array()))
        else {
            bail!("{}:{line}: `document_ids` and `scores` must both be lists", path.display())
        };
        if ids.len() != scores.len() {
            bail!("{}:{line}: {} document_ids but {} scores", path.display(), ids.len(), scores.len())
        }
        if ids.len() < 2 {
            bail!("{}:{line}: distillation needs at least 2 documents per query, got {}", path.display(), ids.len())
        }
        let mut docs = Vec::new();
        let mut sc = Vec::new();
        for (k, (id, s)) in ids.iter().zip(scores).enumerate().take(n_ways.max(2)) {
            let id = id_string(id)
                .ok_or_else(|| Error::Msg(format!("{}:{line}: document_ids[{k}] is not an id", path.display())))?;
            let Some(t) = ds.get(&id) else {
                bail!("{}:{line}: document_id {id} is not in {}", path.display(), documents.as_ref().display())
            };
            let Some(s) = s.as_f64() else { bail!("{}:{line}: scores[{k}] is not a number", path.display()) };
            docs.push(t.clone());
            sc.push(s as f32);
        }
        out.push(Example {
            query: query.clone(),
            documents: docs,
            scores: Some(sc),
            origin: format!("{}:{line}", path.display()),
        });
    }
    let n = out[0].documents.len();
    if out.iter().any(|e| e.documents.len() != n) {
        bail!("{}: every row needs the same number of documents (at most n_ways = {n_ways})", path.display())
    }
    Ok(out)
}

/// A BEIR-layout evaluation set (see the [module docs](self)): the queries
/// of `qrels/{split}.tsv` with a positive score, in file order, ranked over
/// the whole corpus. A document's text is `title text` (the title left out
/// when empty), as Sentence Transformers' BEIR loaders join them.
pub fn read_beir(dir: impl AsRef<Path>, split: &str) -> Result<super::EvalSet> {
    let dir = dir.as_ref();
    let (cp, qp) = (dir.join("corpus.jsonl"), dir.join("queries.jsonl"));
    let rp = dir.join("qrels").join(format!("{split}.tsv"));
    let field =
        |path: &Path, line: usize, row: &serde_json::Map<String, serde_json::Value>, k: &str| -> Result<String> {
            match row.get(k) {
                Some(v) => {
                    id_string(v).ok_or_else(|| Error::Msg(format!("{}:{line}: `{k}` must be a string", path.display())))
                }
                None => bail!("{}:{line}: missing field `{k}`", path.display()),
            }
        };
    let mut corpus = Vec::new();
    let mut corpus_id = HashMap::new();
    for (line, row) in jsonl(&cp)? {
        let id = field(&cp, line, &row, "_id")?;
        let body = text(&cp, line, &row, &["text"])?;
        let title = match row.get("title") {
            Some(serde_json::Value::String(t)) => t.trim().to_string(),
            None | Some(serde_json::Value::Null) => String::new(),
            Some(v) => bail!("{}:{line}: `title` must be a string, got {v}", cp.display()),
        };
        if corpus_id.insert(id.clone(), corpus.len()).is_some() {
            bail!("{}:{line}: duplicate `_id` {id}", cp.display())
        }
        corpus.push(if title.is_empty() { body } else { format!("{title} {body}") });
    }
    let mut query_text = HashMap::new();
    for (line, row) in jsonl(&qp)? {
        query_text.insert(field(&qp, line, &row, "_id")?, text(&qp, line, &row, &["text"])?);
    }
    let tsv = std::fs::read_to_string(&rp).map_err(|e| Error::Msg(format!("{}: cannot read: {e}", rp.display())))?;
    let (mut queries, mut relevant) = (Vec::new(), Vec::<Vec<usize>>::new());
    let mut slot: HashMap<String, usize> = HashMap::new();
    for (i, l) in tsv.lines().enumerate() {
        let cols: Vec<&str> = l.split('\t').map(str::trim).collect();
        if l.trim().is_empty() || (i == 0 && cols.first() == Some(&"query-id")) {
            continue;
        }
        let &[q, d, score] = cols.as_slice() else {
            bail!("{}:{}: expected 3 tab-separated columns (query-id, corpus-id, score)", rp.display(), i + 1)
        };
        let score: f64 = score
            .parse()
            .map_err(|_| Error::Msg(format!("{}:{}: score `{score}` is not a number", rp.display(), i + 1)))?;
        let Some(&doc) = corpus_id.get(d) else {
            bail!("{}:{}: corpus-id {d} is not in {}", rp.display(), i + 1, cp.display())
        };
        let Some(qt) = query_text.get(q) else {
            bail!("{}:{}: query-id {q} is not in {}", rp.display(), i + 1, qp.display())
        };
        if score <= 0.0 {
            continue;
        }
        let k = *slot.entry(q.to_string()).or_insert_with(|| {
            queries.push(qt.clone());
            relevant.push(Vec::new());
            queries.len() - 1
        });
        if !relevant[k].contains(&doc) {
            relevant[k].push(doc);
        }
    }
    if queries.is_empty() {
        bail!("{}: no query with a relevant document", rp.display())
    }
    Ok(super::EvalSet { queries, corpus, relevant })
}
