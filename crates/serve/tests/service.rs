//! The service over HTTP: searches equal the library's, updates, filters,
//! concurrent clients, bad requests, the API key, and the descriptive
//! endpoints. Each test builds its own small random index on the CPU and
//! serves it on a free loopback port.

mod support;

use candle_maxsim_plaid::{SearchParams, Subset};
use candle_maxsim_serve::Config;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::time::Duration;
use support::*;

/// A query from document `d`: its tokens (at most 64).
fn query_of(doc: &[Vec<f32>]) -> Vec<Vec<f32>> {
    doc.iter().take(64).cloned().collect()
}

/// Searches by embeddings (queries of different lengths, some not drawn
/// from documents) give what `PlaidIndex::search` gives on the same batch.
#[test]
fn search_by_embeddings_equals_library() {
    let (srv, docs) = Server::start("equal", 300, Config::default());
    let mut queries: Vec<Vec<Vec<f32>>> = (0..6).map(|i| query_of(&docs[i * 40])).collect();
    queries.extend(random_docs(3, DIM));
    let params = SearchParams { top_k: 7, n_ivf_probe: 4, n_full_scores: 256, ..Default::default() };
    let body = json!({"embeddings": queries, "top_k": 7, "n_ivf_probe": 4, "n_full_scores": 256});
    let (status, res) = srv.post("/search", &body);
    assert_eq!(status, 200, "{res}");
    let want = srv.reopen().search(&padded(&queries), &params, None).unwrap();
    for (q, w) in want.iter().enumerate() {
        assert_same(&format!("query {q}"), &hits(&res, q), w);
        assert_eq!(w.len(), 7);
    }
    // The default parameters, and the centroid threshold, each alone too.
    for (extra, p) in [
        (json!({}), SearchParams::default()),
        (
            json!({"centroid_score_threshold": 0.3}),
            SearchParams { centroid_score_threshold: Some(0.3), ..Default::default() },
        ),
    ] {
        let mut body = json!({"embeddings": [queries[0].clone()]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, res) = srv.post("/search", &body);
        assert_eq!(status, 200, "{res}");
        let want = srv.reopen().search(&padded(&queries[..1]), &p, None).unwrap();
        assert_same("one query", &hits(&res, 0), &want[0]);
        // Each query's own document first.
        assert_eq!(hits(&res, 0)[0].0, 0);
    }
}

/// Queries sent as base64 bytes: F32 gives the JSON request's results
/// exactly; F16 and BF16 those of the library on the values rounded to them.
/// Bad bytes, lengths, types and values are refused naming the field.
#[test]
fn search_by_base64_embeddings() {
    use base64::Engine;
    let (srv, docs) = Server::start("base64", 200, Config::default());
    let mut queries: Vec<Vec<Vec<f32>>> = (0..4).map(|i| query_of(&docs[i * 50])).collect();
    queries.extend(random_docs(2, DIM));
    let b64 = |bytes: Vec<u8>| base64::engine::general_purpose::STANDARD.encode(bytes);
    let enc = |q: &[Vec<f32>], dtype: &str| -> String {
        let vals = q.iter().flatten();
        b64(match dtype {
            "f32" => vals.flat_map(|v| v.to_le_bytes()).collect(),
            "f16" => vals.flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(),
            _ => vals.flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(),
        })
    };
    let (_, json_res) = srv.post("/search", &json!({"embeddings": queries, "top_k": 5}));
    let params = SearchParams { top_k: 5, ..Default::default() };
    for dtype in ["f32", "f16", "bf16"] {
        let body = json!({"embeddings_base64": queries.iter().map(|q| enc(q, dtype)).collect::<Vec<_>>(),
            "embeddings_dtype": dtype, "top_k": 5});
        let (status, res) = srv.post("/search", &body);
        assert_eq!(status, 200, "{dtype}: {res}");
        if dtype == "f32" {
            assert_eq!(res, json_res, "f32 bytes give the JSON request's results");
        }
        let round = |v: f32| match dtype {
            "f16" => half::f16::from_f32(v).to_f32(),
            "bf16" => half::bf16::from_f32(v).to_f32(),
            _ => v,
        };
        let rounded: Vec<Vec<Vec<f32>>> =
            queries.iter().map(|q| q.iter().map(|r| r.iter().map(|&v| round(v)).collect()).collect()).collect();
        let want = srv.reopen().search(&padded(&rounded), &params, None).unwrap();
        for (q, w) in want.iter().enumerate() {
            assert_same(&format!("{dtype} query {q}"), &hits(&res, q), w);
        }
    }
    let q0 = &queries[0];
    let nan: Vec<Vec<f32>> = vec![vec![f32::NAN; DIM]];
    let long: Vec<Vec<f32>> = vec![vec![0.5; DIM]; 65];
    for (what, body, status, text) in [
        ("not base64", json!({"embeddings_base64": ["%%%"]}), 400, "embeddings_base64[0]: not base64"),
        ("a partial f32", json!({"embeddings_base64": [b64(vec![0, 0, 0])]}), 422, "whole number of f32"),
        ("a partial token", json!({"embeddings_base64": [b64(vec![0; 4 * (DIM + 1)])]}), 422, "whole number of token"),
        ("no tokens", json!({"embeddings_base64": [""]}), 422, "embeddings_base64[0]: 0 tokens"),
        ("65 tokens", json!({"embeddings_base64": [enc(&long, "f32")]}), 422, "1 to 64"),
        ("NaN", json!({"embeddings_base64": [enc(q0, "f32"), enc(&nan, "f32")]}), 422, "embeddings_base64[1]: token 0"),
        (
            "a bad dtype",
            json!({"embeddings_base64": [enc(q0, "f32")], "embeddings_dtype": "f64"}),
            422,
            "embeddings_dtype",
        ),
        ("a dtype alone", json!({"embeddings": [q0], "embeddings_dtype": "f16"}), 422, "embeddings_dtype"),
        ("two kinds", json!({"embeddings": [q0], "embeddings_base64": [enc(q0, "f32")]}), 422, "exactly one"),
    ] {
        assert_error(what, &srv.post("/search", &body), status, text);
    }
}

/// Documents added as base64 bytes are the documents added as JSON: the
/// same document both ways scores the same for its own query, an F16 one
/// is found by its own; zero vectors, empty documents and two kinds at
/// once are refused naming the field.
#[test]
fn add_by_base64_embeddings() {
    use base64::Engine;
    let (srv, _) = Server::start("add-base64", 200, Config::default());
    let new = random_docs(2, DIM);
    let b64 = |d: &[Vec<f32>], f16: bool| -> String {
        let vals = d.iter().flatten();
        let bytes: Vec<u8> = match f16 {
            false => vals.flat_map(|v| v.to_le_bytes()).collect(),
            true => vals.flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(),
        };
        base64::engine::general_purpose::STANDARD.encode(bytes)
    };
    let (status, res) = srv.post("/documents", &json!({"embeddings": [new[0].clone()]}));
    assert_eq!((status, &res["ids"]), (200, &json!([200])), "{res}");
    let (status, res) =
        srv.post("/documents", &json!({"embeddings_base64": [b64(&new[0], false)], "metadata": [{"n": 1}]}));
    assert_eq!((status, &res["ids"]), (200, &json!([201])), "{res}");
    let body = json!({"embeddings_base64": [b64(&new[1], true)], "embeddings_dtype": "f16"});
    let (status, res) = srv.post("/documents", &body);
    assert_eq!((status, &res["ids"]), (200, &json!([202])), "{res}");
    let (_, res) = srv.post("/search", &json!({"embeddings": [query_of(&new[0]), query_of(&new[1])], "top_k": 3}));
    let (a, b) = (hits(&res, 0), hits(&res, 1));
    let top2: HashSet<u32> = a[..2].iter().map(|h| h.0).collect();
    assert_eq!(top2, HashSet::from([200, 201]), "{a:?}");
    assert_eq!(a[0].1.to_bits(), a[1].1.to_bits(), "the same document, the same score: {a:?}");
    assert_eq!(b[0].0, 202, "{b:?}");
    assert_eq!(
        res["results"][0].as_array().unwrap().iter().find(|h| h["id"] == 201).unwrap()["metadata"],
        json!({"n": 1})
    );
    let zeros = vec![vec![0.0f32; DIM]; 2];
    for (what, body, text) in [
        (
            "zeros",
            json!({"embeddings_base64": [b64(&new[0], false), b64(&zeros, false)]}),
            "embeddings_base64[1]: token 0: a vector of zeros",
        ),
        ("empty", json!({"embeddings_base64": [""]}), "embeddings_base64[0]: 0 tokens, a document has"),
        (
            "two kinds",
            json!({"embeddings": [new[0].clone()], "embeddings_base64": [b64(&new[0], false)]}),
            "exactly one",
        ),
        ("a dtype alone", json!({"embeddings": [new[0].clone()], "embeddings_dtype": "f16"}), "embeddings_dtype"),
    ] {
        assert_error(what, &srv.post("/documents", &body), 422, text);
    }
    assert_eq!(srv.get("/stats").1["documents"], 203, "refused adds wrote nothing");
}

/// Added documents get the next ids, are found by their own embeddings and
/// carry their metadata; deleted ones are never returned again.
#[test]
fn add_then_delete() {
    let (srv, docs) = Server::start("add", 200, Config::default());
    let new = random_docs(3, DIM);
    let meta = json!([{"year": 2021, "source": "pubmed", "tags": ["a", "b"]}, null, {"title": "x"}]);
    let (status, res) = srv.post("/documents", &json!({"embeddings": new, "metadata": meta}));
    assert_eq!(status, 200, "{res}");
    assert_eq!(res["ids"], json!([200, 201, 202]));
    let (_, res) = srv.post("/search", &json!({"embeddings": [query_of(&new[0]), query_of(&new[1])], "top_k": 3}));
    assert_eq!(hits(&res, 0)[0].0, 200);
    assert_eq!(hits(&res, 1)[0].0, 201);
    assert_eq!(res["results"][0][0]["metadata"], meta[0], "metadata returned as given");
    assert!(res["results"][1][0].get("metadata").is_none(), "no metadata: no key");
    // include_metadata: false leaves it out.
    let (_, res) = srv.post("/search", &json!({"embeddings": [query_of(&new[0])], "include_metadata": false}));
    assert!(res["results"][0][0].get("metadata").is_none());

    // Delete two old documents and a new one (twice: the second time deletes nothing).
    for (round, want) in [(0, 3), (1, 0)] {
        for path in ["/documents/delete", "/documents"] {
            let body = json!({"ids": [5, 17, 200]}).to_string();
            let method = if path == "/documents" { "DELETE" } else { "POST" };
            let (status, res) = request(method, &format!("{}{path}", srv.url), Some(&body), &[]);
            assert_eq!(status, 200, "{res}");
            let expect = if round == 0 && path == "/documents/delete" { want } else { 0 };
            assert_eq!(res["deleted"], json!(expect), "{path} round {round}");
        }
    }
    let qs = vec![query_of(&docs[5]), query_of(&docs[17]), query_of(&new[0])];
    let (_, res) = srv.post("/search", &json!({"embeddings": qs, "top_k": 50}));
    for q in 0..3 {
        let ids: Vec<u32> = hits(&res, q).iter().map(|h| h.0).collect();
        assert!(!ids.iter().any(|d| [5, 17, 200].contains(d)), "query {q}: a deleted id in {ids:?}");
    }
    let (_, stats) = srv.get("/stats");
    assert_eq!(stats["documents"], 203);
    assert_eq!(stats["live_documents"], 200);
    // The index on disk agrees.
    let index = srv.reopen();
    assert_eq!(index.num_documents(), 203);
    assert_eq!(index.deleted(), &[5, 17, 200]);
    // Out of range: 422 naming the entry, nothing deleted.
    let got = srv.post("/documents/delete", &json!({"ids": [1, 999]}));
    assert_error("out of range", &got, 422, "ids[1]");
    assert_eq!(srv.reopen().deleted(), &[5, 17, 200]);
    // Compact: the same results after.
    let q = json!({"embeddings": [query_of(&docs[3]), query_of(&new[2])], "top_k": 5});
    let (_, before) = srv.post("/search", &q);
    let (status, _) = srv.post("/compact", &json!({}));
    assert_eq!(status, 200);
    let (_, after) = srv.post("/search", &q);
    assert_eq!(before, after);
}

/// Documents with metadata, and a filter: the hits are in the filter's set
/// and equal the library's search of that subset (shared, and per query
/// when concurrent requests of different filters share a batch).
#[test]
fn filters_select_the_subset() {
    let config = Config { batch_window: Duration::from_millis(30), ..Default::default() };
    let (srv, _) = Server::start("filter", 100, config);
    let new = random_docs(60, DIM);
    let meta: Vec<Value> = (0..60)
        .map(|i| {
            let source = ["pubmed", "arxiv", "web"][i % 3];
            json!({"year": 1990 + i % 35, "source": source, "score": i as f64 / 7.0})
        })
        .collect();
    let (status, res) = srv.post("/documents", &json!({"embeddings": new, "metadata": meta}));
    assert_eq!(status, 200, "{res}");
    let set = |f: &dyn Fn(usize) -> bool| -> Vec<u32> { (0..60).filter(|&i| f(i)).map(|i| 100 + i as u32).collect() };
    let cases: Vec<(Value, Vec<u32>)> = vec![
        (
            json!({"where": "year > ? AND source = ?", "params": [2005, "pubmed"]}),
            set(&|i| 1990 + i % 35 > 2005 && i % 3 == 0),
        ),
        (json!({"where": "source IN (?, ?)", "params": ["arxiv", "web"]}), set(&|i| i % 3 != 0)),
        (json!({"where": "score < 2.0"}), set(&|i| (i as f64 / 7.0) < 2.0)),
    ];
    let queries: Vec<Vec<Vec<f32>>> = [0, 1, 2, 3, 30, 59].iter().map(|&i| query_of(&new[i])).collect();
    let index = srv.reopen();
    let params = SearchParams { top_k: 5, ..Default::default() };
    // One request at a time: a shared subset.
    for (filter, ids) in &cases {
        let (status, res) = srv.post("/search", &json!({"embeddings": queries, "top_k": 5, "filter": filter}));
        assert_eq!(status, 200, "{res}");
        let want = index.search(&padded(&queries), &params, Some(Subset::Shared(ids))).unwrap();
        for (q, w) in want.iter().enumerate() {
            let got = hits(&res, q);
            assert!(got.iter().all(|h| ids.contains(&h.0)), "{filter}: {got:?} outside the filter");
            assert_same(&format!("{filter} query {q}"), &got, w);
        }
        // A query drawn from a document in the set finds it first.
        if let Some(q) = [0usize, 1, 2, 3, 30, 59].iter().position(|&i| ids.contains(&(100 + i as u32))) {
            assert!(ids.contains(&hits(&res, q)[0].0));
        }
    }
    // Concurrent requests of the three filters (and one without): batched
    // together, each gets its own subset's results.
    let threads: Vec<_> = (0..4)
        .map(|c| {
            let (url, queries, filter) = (srv.url.clone(), queries.clone(), cases.get(c).map(|x| x.0.clone()));
            std::thread::spawn(move || {
                let mut body = json!({"embeddings": queries, "top_k": 5});
                if let Some(f) = filter {
                    body["filter"] = f;
                }
                request("POST", &format!("{url}/search"), Some(&body.to_string()), &[])
            })
        })
        .collect();
    for (c, t) in threads.into_iter().enumerate() {
        let (status, res) = t.join().unwrap();
        assert_eq!(status, 200, "{res}");
        let subset = cases.get(c).map(|x| x.1.clone());
        let want = index.search(&padded(&queries), &params, subset.as_deref().map(Subset::Shared)).unwrap();
        for (q, w) in want.iter().enumerate() {
            assert_same(&format!("concurrent filter {c} query {q}"), &hits(&res, q), w);
        }
    }
    // A filter that matches nothing: empty results for every query.
    let (status, res) =
        srv.post("/search", &json!({"embeddings": queries, "filter": {"where": "year > ?", "params": [3000]}}));
    assert_eq!(status, 200);
    assert!(res["results"].as_array().unwrap().iter().all(|r| r.as_array().unwrap().is_empty()));
    assert_eq!(res["results"].as_array().unwrap().len(), queries.len());
}

/// Many client threads at once: each gets its own results (its query is a
/// distinct document's embeddings: that document first), and the batcher
/// served them in fewer index searches than requests.
#[test]
fn concurrent_clients_get_their_own_results() {
    concurrent_clients("concurrent", Duration::from_millis(5));
}

/// The same without a window: requests arriving while a batch runs still
/// join the next one (no batch waits for company when the device is idle).
#[test]
fn requests_arriving_during_a_batch_join_the_next() {
    concurrent_clients("concurrent-no-window", Duration::ZERO);
}

fn concurrent_clients(name: &str, batch_window: Duration) {
    let config = Config { batch_window, ..Default::default() };
    let (srv, docs) = Server::start(name, 240, config);
    let (clients, per_client) = (12, 10);
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let url = srv.url.clone();
            let docs = docs.clone();
            std::thread::spawn(move || {
                let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(120)).build();
                for r in 0..per_client {
                    let d = (c * per_client + r) * 2 % 240;
                    // One or two queries per request.
                    let nq = 1 + r % 2;
                    let qs: Vec<Vec<Vec<f32>>> = (0..nq).map(|k| query_of(&docs[(d + k) % 240])).collect();
                    let body = json!({"embeddings": qs, "top_k": 3}).to_string();
                    let resp = agent.post(&format!("{url}/search")).send_string(&body).unwrap();
                    let res: Value = serde_json::from_str(&resp.into_string().unwrap()).unwrap();
                    for k in 0..nq {
                        assert_eq!(hits(&res, k)[0].0 as usize, (d + k) % 240, "client {c} request {r} query {k}");
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let (_, text) = request_text("GET", &format!("{}/metrics", srv.url), None, &[]);
    let count = |name: &str| -> f64 {
        let line = text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} in {text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let batches = count("maxsim_search_batch_queries_count");
    let queries = count("maxsim_search_batch_queries_sum");
    assert_eq!(queries as usize, clients * (per_client / 2) * 3, "every query searched once");
    assert!(batches < (clients * per_client) as f64, "{batches} searches for {} requests", clients * per_client);
    assert!(text.contains("maxsim_requests_total{endpoint=\"/search\",method=\"POST\",status=\"200\"} 120"));
}

/// Bad requests get a 4xx with a message naming the field, and the service
/// keeps serving.
#[test]
fn bad_requests_are_refused_with_a_message() {
    let config = Config {
        max_body_bytes: 64 << 10,
        filter_timeout: Duration::from_millis(300),
        max_queries: 8,
        ..Default::default()
    };
    let (srv, docs) = Server::start("bad", 60, config);
    let (status, res) =
        srv.post("/documents", &json!({"embeddings": [docs[0].clone()], "metadata": [{"source": "pubmed"}]}));
    assert_eq!(status, 200, "{res}");
    let q = query_of(&docs[0]);
    let raw = |body: &str| request("POST", &format!("{}/search", srv.url), Some(body), &[]);
    assert_error("malformed JSON", &raw("{\"embeddings\": [[[0.1, 0.2"), 400, "body");
    assert_error("not an object", &raw("[1, 2]"), 400, "body");
    assert_error("trailing data", &raw("{} {}"), 400, "body");
    assert_error("unknown field", &raw("{\"embedings\": []}"), 400, "embedings");
    assert_error("wrong type", &raw("{\"embeddings\": [[[\"a\"]]]}"), 400, "embeddings[0][0][0]");
    assert_error("negative top_k", &srv.post("/search", &json!({"embeddings": [q], "top_k": -1})), 400, "top_k");
    assert_error("top_k 0", &srv.post("/search", &json!({"embeddings": [q], "top_k": 0})), 422, "top_k");
    let mut short = q.clone();
    short[1].pop();
    assert_error("wrong dim", &srv.post("/search", &json!({"embeddings": [q, short]})), 422, "embeddings[1][1]");
    let long: Vec<Vec<f32>> = (0..65).map(|i| q[i % q.len()].clone()).collect();
    assert_error("65 tokens", &srv.post("/search", &json!({"embeddings": [long]})), 422, "embeddings[0]");
    assert_error("no tokens", &srv.post("/search", &json!({"embeddings": [[]]})), 422, "embeddings[0]");
    assert_error("no queries", &srv.post("/search", &json!({"embeddings": []})), 422, "embeddings");
    let many: Vec<_> = (0..9).map(|_| q[..2].to_vec()).collect();
    assert_error("too many queries", &srv.post("/search", &json!({"embeddings": many})), 422, "at most 8");
    assert_error("both", &srv.post("/search", &json!({"embeddings": [q], "queries": ["x"]})), 422, "exactly one");
    assert_error("text without model", &srv.post("/search", &json!({"queries": ["x"]})), 422, "no model");
    // Oversize body: 413. Just over the limit: the service reads it all
    // before answering, so the client is not cut off while still sending.
    let big = json!({"queries": ["x".repeat(66 << 10)]});
    assert_error("oversize", &srv.post("/search", &big), 413, "body");
    // Adds: a zero vector, dim, metadata keys, counts.
    let mut zero = docs[1].clone();
    zero[2] = vec![0.0; DIM];
    assert_error("zero token", &srv.post("/documents", &json!({"embeddings": [zero]})), 422, "embeddings[0][2]");
    let meta_bad = json!({"embeddings": [docs[1].clone()], "metadata": [{"bad key": 1}]});
    assert_error("bad key", &srv.post("/documents", &meta_bad), 422, "metadata[0]");
    let reserved = json!({"embeddings": [docs[1].clone()], "metadata": [{"_id": 1}]});
    assert_error("reserved key", &srv.post("/documents", &reserved), 422, "metadata[0]");
    let count = json!({"embeddings": [docs[1].clone()], "metadata": [{}, {}]});
    assert_error("metadata count", &srv.post("/documents", &count), 422, "metadata");
    // Filters: bad SQL, a second statement, a write, wrong parameter count, a runaway query.
    let search = |f: Value| srv.post("/search", &json!({"embeddings": [q.clone()], "filter": f}));
    assert_error("bad SQL", &search(json!({"where": "year >>> ?", "params": [1]})), 400, "filter.where");
    assert_error("unknown column", &search(json!({"where": "nope = 1"})), 400, "filter.where");
    assert_error("two statements", &search(json!({"where": "1=1; DROP TABLE metadata"})), 400, "filter.where");
    assert_error("comment", &search(json!({"where": "1=1) --"})), 400, "filter.where");
    assert_error("params count", &search(json!({"where": "source = ?", "params": []})), 400, "filter.params");
    assert_error("param type", &search(json!({"where": "source = ?", "params": [[1]]})), 400, "filter.params[0]");
    let runaway = "_id IN (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c)";
    assert_error("runaway", &search(json!({"where": runaway})), 400, "longer than");
    // Injection through a parameter is a value, not SQL: no match, the table intact.
    let inj = search(json!({"where": "source = ?", "params": ["x' OR '1'='1"]}));
    assert_eq!(inj.0, 200);
    assert!(inj.1["results"][0].as_array().unwrap().is_empty());
    let inj = search(json!({"where": "source = ?", "params": ["pubmed'; DROP TABLE metadata; --"]}));
    assert_eq!(inj.0, 200);
    let ok = search(json!({"where": "source = ?", "params": ["pubmed"]}));
    assert_eq!(ok.0, 200, "{}", ok.1);
    assert_eq!(hits(&ok.1, 0)[0].0, 60, "the table survived");
    // Unknown path and method.
    assert_error("unknown path", &srv.get("/nope"), 404, "path");
    assert_error("wrong method", &srv.get("/search"), 405, "method");
    // Still serving.
    assert_eq!(srv.get("/health").0, 200);
    let (status, res) = srv.post("/search", &json!({"embeddings": [q]}));
    assert_eq!(status, 200);
    assert_eq!(hits(&res, 0)[0].0, 0);
}

/// With a key: writes need it (`x-api-key` or a bearer token); reads need it
/// only with `protect_reads`; `/health` never.
#[test]
fn api_key_protects_writes_and_optionally_reads() {
    for protect_reads in [false, true] {
        let config = Config { api_key: Some("s3cret".into()), protect_reads, ..Default::default() };
        let (srv, docs) = Server::start("auth", 40, config);
        let add = json!({"embeddings": [docs[0].clone()]}).to_string();
        let url = |p: &str| format!("{}{p}", srv.url);
        assert_error("no key", &request("POST", &url("/documents"), Some(&add), &[]), 401, "missing");
        let wrong = [("x-api-key", "nope")];
        assert_error("wrong key", &request("POST", &url("/documents"), Some(&add), &wrong), 401, "wrong");
        let del = json!({"ids": [0]}).to_string();
        assert_eq!(request("POST", &url("/documents/delete"), Some(&del), &[]).0, 401);
        assert_eq!(request("DELETE", &url("/documents"), Some(&del), &[]).0, 401);
        assert_eq!(request("POST", &url("/compact"), Some("{}"), &[]).0, 401);
        assert_eq!(request("POST", &url("/documents"), Some(&add), &[("x-api-key", "s3cret")]).0, 200);
        let bearer = [("authorization", "Bearer s3cret")];
        assert_eq!(request("POST", &url("/documents"), Some(&add), &bearer).0, 200);
        let search = json!({"embeddings": [query_of(&docs[1])]}).to_string();
        let read = request("POST", &url("/search"), Some(&search), &[]).0;
        assert_eq!(read, if protect_reads { 401 } else { 200 });
        assert_eq!(request("GET", &url("/stats"), None, &[]).0, if protect_reads { 401 } else { 200 });
        assert_eq!(request("POST", &url("/search"), Some(&search), &bearer).0, 200);
        assert_eq!(request("GET", &url("/health"), None, &[]).0, 200);
        assert_eq!(srv.reopen().num_documents(), 42);
    }
}

/// `/openapi.json` describes every route and method; `/stats`, `/health`
/// and `/metrics` answer.
#[test]
fn descriptive_endpoints() {
    let (srv, docs) = Server::start("describe", 50, Config::default());
    let (status, api) = srv.get("/openapi.json");
    assert_eq!(status, 200);
    assert!(api["openapi"].as_str().unwrap().starts_with("3."));
    for (path, method) in [
        ("/search", "post"),
        ("/documents", "post"),
        ("/documents", "delete"),
        ("/documents/delete", "post"),
        ("/compact", "post"),
        ("/stats", "get"),
        ("/health", "get"),
        ("/metrics", "get"),
        ("/openapi.json", "get"),
    ] {
        let op = &api["paths"][path][method];
        assert!(op["responses"]["200"].is_object(), "{method} {path} not described");
    }
    let (status, health) = srv.get("/health");
    assert_eq!((status, health), (200, json!({"status": "ok"})));
    let _ = srv.post("/search", &json!({"embeddings": [query_of(&docs[0])]}));
    let _ = srv.post("/search", &json!({"embeddings": "x"}));
    let (_, stats) = srv.get("/stats");
    let tokens: usize = docs.iter().map(|d| d.len()).sum();
    assert_eq!(stats["documents"], 50);
    assert_eq!(stats["live_documents"], 50);
    assert_eq!(stats["tokens"], tokens);
    assert_eq!(stats["dim"], DIM);
    assert_eq!(stats["centroids"], 32);
    assert_eq!(stats["device"], "cpu");
    let (status, text) = request_text("GET", &format!("{}/metrics", srv.url), None, &[]);
    assert_eq!(status, 200);
    for line in [
        "maxsim_requests_total{endpoint=\"/search\",method=\"POST\",status=\"200\"} 1",
        "maxsim_requests_total{endpoint=\"/search\",method=\"POST\",status=\"400\"} 1",
        "maxsim_request_duration_seconds_bucket{endpoint=\"/search\",le=\"+Inf\"} 2",
        "maxsim_search_batch_queries_count 1",
        "maxsim_search_batch_seconds_count 1",
        "maxsim_search_index_seconds_count 1",
    ] {
        assert!(text.lines().any(|l| l == line), "`{line}` not in\n{text}");
    }
    let sum = |name: &str| -> f64 {
        let l = text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} in {text}"));
        l.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let (batch, index) = (sum("maxsim_search_batch_seconds_sum"), sum("maxsim_search_index_seconds_sum"));
    assert!(0.0 < index && index <= batch, "the index search is part of its batch: {index} of {batch}");
    let seen: HashSet<&str> = text.lines().filter(|l| l.starts_with("# TYPE")).collect();
    assert_eq!(seen.len(), 5, "{text}");
}
