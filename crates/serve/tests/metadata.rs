//! The SQLite metadata store without HTTP: typed columns from JSON, filters
//! with bound parameters, lookups, and the reconciliation with the index
//! that finishes or undoes an update cut between its two commits.

mod support;

use candle_maxsim_serve::{Config, Metadata, Row, Service};
use serde_json::{json, Value};
use std::time::Duration;
use support::*;

fn row(v: Value) -> Option<Row> {
    match v {
        Value::Object(m) => Some(m),
        _ => None,
    }
}

fn open(dir: &std::path::Path) -> Metadata {
    Metadata::open(dir.join("meta.sqlite"), Duration::from_secs(2)).unwrap()
}

#[test]
fn typed_columns_and_filters() {
    let dir = tmpdir("meta-types");
    let mut m = open(&dir);
    let rows = vec![
        row(json!({"year": 2019, "source": "pubmed", "score": 0.5, "open": true, "info": {"lang": "en"}})),
        row(json!({"year": 2021, "source": "arxiv", "score": 1.5, "open": false, "info": {"lang": "fr"}})),
        None,
        row(json!({"Year": 2023, "source": null, "extra": [1, 2]})),
    ];
    m.add(&[0, 1, 2, 3], &rows).unwrap();
    assert_eq!(m.len().unwrap(), 4);
    let mut cols = m.columns().to_vec();
    cols.sort();
    assert_eq!(cols, ["extra", "info", "open", "score", "source", "year"]);
    let f = |m: &Metadata, cond: &str, params: Value| m.filter(cond, params.as_array().unwrap()).unwrap().to_vec();
    assert_eq!(f(&m, "year > ?", json!([2020])), vec![1, 3], "integers, and `Year` is column `year`");
    assert_eq!(f(&m, "score >= ? AND score < ?", json!([0.5, 1.0])), vec![0]);
    assert_eq!(f(&m, "open = ?", json!([true])), vec![0]);
    assert_eq!(f(&m, "source IS NULL", json!([])), vec![2, 3]);
    assert_eq!(f(&m, "json_extract(info, '$.lang') = ?", json!(["fr"])), vec![1]);
    assert_eq!(f(&m, "1 = 1", json!([])), vec![0, 1, 2, 3]);
    assert_eq!(f(&m, "source = :s", json!(["arxiv"])), vec![1], "named placeholders bind in order");
    // A parameter is a value, never SQL.
    assert!(f(&m, "source = ?", json!(["pubmed' OR '1'='1"])).is_empty());
    // get: the objects as given, in the order asked, None without metadata.
    let got = m.get(&[3, 2, 0, 99]).unwrap();
    assert_eq!(got[0], rows[3]);
    assert_eq!(got[1], None);
    assert_eq!(got[2], rows[0]);
    assert_eq!(got[3], None);
    // A row replaced; a row deleted; each seen by a filter asked before
    // (filters are kept until the next write).
    assert!(f(&m, "year < ?", json!([2000])).is_empty());
    m.add(&[1], &[row(json!({"year": 1999}))]).unwrap();
    assert_eq!(f(&m, "year < ?", json!([2000])), vec![1]);
    assert_eq!(m.delete(&[1, 42]).unwrap(), 1);
    assert!(f(&m, "year < ?", json!([2000])).is_empty());
    // Errors: 400 naming the field; nothing written.
    for (cond, params, field) in [
        ("", json!([]), "filter.where"),
        ("year > ?; DELETE FROM metadata", json!([1]), "filter.where"),
        ("year >", json!([]), "filter.where"),
        ("year > ?", json!([]), "filter.params"),
        ("year > ?", json!([{"a": 1}]), "filter.params[0]"),
    ] {
        let e = m.filter(cond, params.as_array().unwrap()).unwrap_err();
        assert_eq!(e.status, 400, "{cond}");
        assert!(e.message.starts_with(field), "{cond}: {}", e.message);
    }
    // The filter connection is read-only, whatever the expression.
    let e = m.filter("(SELECT 1 FROM pragma_query_only WHERE query_only = 1) = 1", &[]).unwrap();
    assert_eq!(e.len(), 3, "query_only is on for filters");
    let bad = m.add(&[7], &[row(json!({"no spaces": 1}))]).unwrap_err();
    assert_eq!(bad.status, 422);
    assert_eq!(m.len().unwrap(), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn reconcile_undoes_an_add_and_completes_a_delete() {
    let dir = tmpdir("meta-reconcile");
    let mut m = open(&dir);
    // An index of 10 documents, 3 and 4 deleted in the index only (a delete
    // cut before its metadata commit); rows 10 and 11 written by an add cut
    // before its index commit; no rows for 5..10 (documents built elsewhere).
    let ids: Vec<u32> = (0..5).chain(10..12).collect();
    let rows: Vec<Option<Row>> = ids.iter().map(|&i| row(json!({"n": i}))).collect();
    m.add(&ids, &rows).unwrap();
    assert_eq!(*m.filter("1 = 1", &[]).unwrap(), [0, 1, 2, 3, 4, 10, 11]);
    m.reconcile(10, &[3, 4]).unwrap();
    assert_eq!(*m.filter("1 = 1", &[]).unwrap(), [0, 1, 2, 5, 6, 7, 8, 9]);
    assert_eq!(*m.filter("n IS NOT NULL", &[]).unwrap(), [0, 1, 2]);
    // Idempotent.
    m.reconcile(10, &[3, 4]).unwrap();
    assert_eq!(m.len().unwrap(), 8);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A filter's ids are kept until the next write, and shared by requests
/// asking the same; one whose result can change from one run to the next is
/// run each time.
#[test]
fn filters_are_kept_until_a_write() {
    let dir = tmpdir("meta-cache");
    let mut m = open(&dir);
    let ids: Vec<u32> = (0..3000).collect();
    m.add(&ids, &ids.iter().map(|&i| row(json!({"g": i % 10}))).collect::<Vec<_>>()).unwrap();
    let a = m.filter("g = ?", &[json!(3)]).unwrap();
    let b = m.filter("g = ?", &[json!(3)]).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &b), "the second request reads the kept ids");
    assert_eq!(a.len(), 300);
    assert_eq!(m.filter("g = ?", &[json!(4)]).unwrap().len(), 300, "other params, other ids");
    m.add(&[5000], &[row(json!({"g": 3}))]).unwrap();
    assert_eq!(m.filter("g = ?", &[json!(3)]).unwrap().last(), Some(&5000), "an add is seen");
    m.delete(&[3, 5000]).unwrap();
    let c = m.filter("g = ?", &[json!(3)]).unwrap();
    assert_eq!((c.len(), c[0]), (299, 13), "a delete is seen");
    // 3000 coin flips: equal twice only if the first result was kept.
    let r = "abs(random()) % 2 = 0";
    assert_ne!(m.filter(r, &[]).unwrap(), m.filter(r, &[]).unwrap(), "random() is run each time");
    // `date(?)` with 'now' is today: never kept.
    let d = "g = 3 AND date(?) > '2000-01-01'";
    let (a, b) = (m.filter(d, &[json!("now")]).unwrap(), m.filter(d, &[json!("now")]).unwrap());
    assert!(!std::sync::Arc::ptr_eq(&a, &b) && a == b, "a date condition is run each time");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `Service::new` reconciles: rows of an add the index never committed are
/// gone, as are those of documents the index deleted.
#[test]
fn service_open_reconciles_with_the_index() {
    let dir = tmpdir("meta-open");
    let docs = random_docs(30, DIM);
    let mut index = build_index(&dir, &docs);
    index.delete(&[7]).unwrap();
    let mut m = open(&dir);
    let ids: Vec<u32> = vec![6, 7, 30, 31];
    m.add(&ids, &ids.iter().map(|&i| row(json!({"n": i}))).collect::<Vec<_>>()).unwrap();
    let _svc = Service::new(index, None, m, Config::default()).unwrap();
    let m = open(&dir);
    assert_eq!(*m.filter("n IS NOT NULL", &[]).unwrap(), [6]);
    assert_eq!(m.len().unwrap(), 29, "a row per live document");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Filters and lookups from many threads at once share one store (`&Metadata`
/// across threads): each gets what it gets alone, and a runaway filter on
/// one connection is interrupted without holding up the others.
#[test]
fn concurrent_filters_get_their_own_results() {
    let dir = tmpdir("meta-concurrent");
    let mut m = open(&dir);
    let ids: Vec<u32> = (0..3000).collect();
    let rows: Vec<Option<Row>> = ids.iter().map(|&i| row(json!({"g": i % 13, "h": i % 7}))).collect();
    m.add(&ids, &rows).unwrap();
    let alone = |g: u32| -> Vec<u32> { ids.iter().copied().filter(|i| i % 13 == g && i % 7 != 3).collect() };
    let m = &m;
    std::thread::scope(|s| {
        let slow = s.spawn(|| {
            let runaway = "g IN (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c)";
            m.filter(runaway, &[]).unwrap_err().to_string()
        });
        let workers: Vec<_> = (0..12u32)
            .map(|t| {
                s.spawn(move || {
                    for round in 0..20u32 {
                        let g = (t + round) % 13;
                        let got = m.filter("g = ? AND h != ?", &[json!(g), json!(3)]).unwrap();
                        assert_eq!(*got, alone(g), "thread {t}, round {round}");
                        let meta = m.get(&got[..got.len().min(5)]).unwrap();
                        assert!(meta.iter().all(|r| r.as_ref().unwrap()["g"] == json!(g)));
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        assert!(slow.join().unwrap().contains("filter.where"), "the runaway filter is interrupted");
    });
}
