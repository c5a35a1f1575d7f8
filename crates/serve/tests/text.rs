//! The text paths, with the tiny random PyLate checkpoint that the ColBERT
//! crate's tests generate (a real WordPiece tokenizer, random BERT weights,
//! dim 8): text queries equal the library's search of `encode_queries`,
//! and texts added are encoded as `encode_documents_packed` encodes them.

mod support;

#[path = "../../colbert/tests/support/mod.rs"]
mod colbert_support;

use candle_core::{DType, Device, Tensor};
use candle_maxsim_colbert::ColBert;
use candle_maxsim_plaid::{create, IndexConfig, PackedDocuments, SearchParams};
use candle_maxsim_serve::Config;
use rand::Rng;
use serde_json::json;
use support::*;

/// `n` random sentences over the fixture's vocabulary.
fn sentences(n: usize) -> Vec<String> {
    let words: Vec<&str> =
        colbert_support::VOCAB.iter().copied().filter(|w| w.chars().all(char::is_alphabetic)).collect();
    let mut rng = rand::rng();
    (0..n)
        .map(|_| {
            let len = rng.random_range(3..8);
            (0..len).map(|_| words[rng.random_range(0..words.len())]).collect::<Vec<_>>().join(" ")
        })
        .collect()
}

#[test]
fn text_search_and_text_add() {
    let ckpt = colbert_support::pylate_checkpoint().unwrap();
    let model = ColBert::load(&ckpt, &Device::Cpu, DType::F32).unwrap();
    let texts = sentences(80);
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let (x, lens) = model.encode_documents_packed(&refs).unwrap();
    let dir = tmpdir("text");
    let config = IndexConfig { n_centroids: Some(16), ..Default::default() };
    let index = create(dir.join("index"), &PackedDocuments::new(x, &lens).unwrap(), &config, &Device::Cpu).unwrap();
    let srv =
        Server::serve(dir, index, Some(ColBert::load(&ckpt, &Device::Cpu, DType::F32).unwrap()), Config::default());

    // Text queries: the library's search of the encoded queries (score-mask applied).
    let queries = ["the cat sat on the mat", "a red ball", "dog runs fast"];
    let (status, res) = srv.post("/search", &json!({"queries": queries, "top_k": 5}));
    assert_eq!(status, 200, "{res}");
    let (q, mask) = model.encode_queries(&queries).unwrap();
    let q = q.broadcast_mul(&mask.to_dtype(DType::F32).unwrap().unsqueeze(2).unwrap()).unwrap();
    let params = SearchParams { top_k: 5, ..Default::default() };
    let want = srv.reopen().search(&q, &params, None).unwrap();
    for (i, w) in want.iter().enumerate() {
        assert_same(&format!("text query {i}"), &hits(&res, i), w);
    }

    // Text documents: added with metadata, stored as the model encodes them.
    let new = ["small cat is big", "the red dog sat on a ball"];
    let (status, res) = srv.post("/documents", &json!({"texts": new, "metadata": [{"lang": "en"}, {"lang": "de"}]}));
    assert_eq!(status, 200, "{res}");
    assert_eq!(res["ids"], json!([80, 81]));
    let index = srv.reopen();
    assert_eq!(index.num_documents(), 82);
    let (x, lens) = model.encode_documents_packed(&new).unwrap();
    assert_eq!(index.doc_lens()[80..], lens[..]);
    // The decompressed tokens are the encoded ones up to the 4-bit residuals.
    let stored = Tensor::cat(&[index.embeddings(80).unwrap(), index.embeddings(81).unwrap()], 0).unwrap();
    let cos: Vec<f32> = (stored * &x).unwrap().sum(1).unwrap().to_vec1().unwrap();
    // (A token far from every centroid of this tiny random index can lose more.)
    let mean = cos.iter().sum::<f32>() / cos.len() as f32;
    assert!(mean > 0.95 && cos.iter().all(|&c| c > 0.5), "stored tokens far from the encoded ones: {cos:?}");
    // Found by a filtered text search, with their metadata.
    let f = json!({"queries": ["the red dog"], "filter": {"where": "lang = ?", "params": ["de"]}});
    let (status, res) = srv.post("/search", &f);
    assert_eq!(status, 200, "{res}");
    assert_eq!(hits(&res, 0).iter().map(|h| h.0).collect::<Vec<_>>(), vec![81]);
    assert_eq!(res["results"][0][0]["metadata"], json!({"lang": "de"}));
    // Text queries batched with embedding queries: each the same as alone.
    let emb = json!({"embeddings": [[x.get(0).unwrap().to_vec1::<f32>().unwrap()]], "top_k": 3});
    let (_, alone) = srv.post("/search", &emb);
    let threads: Vec<_> = (0..6)
        .map(|i| {
            let url = srv.url.clone();
            let body = if i % 2 == 0 { json!({"queries": ["dog runs fast"], "top_k": 5}) } else { emb.clone() };
            std::thread::spawn(move || request("POST", &format!("{url}/search"), Some(&body.to_string()), &[]))
        })
        .collect();
    let (_, text_alone) = srv.post("/search", &json!({"queries": ["dog runs fast"], "top_k": 5}));
    for (i, t) in threads.into_iter().enumerate() {
        let (status, res) = t.join().unwrap();
        assert_eq!(status, 200);
        if i % 2 == 1 {
            assert_eq!(res, alone, "an embedding query batched with others: the same bits");
            continue;
        }
        // A text query encoded in a batch of texts goes through other GEMM
        // shapes than alone (another summation order): the same documents,
        // scores equal to F32 rounding (1e-7 relative seen).
        let (got, want) = (hits(&res, 0), hits(&text_alone, 0));
        assert_eq!(got.iter().map(|h| h.0).collect::<Vec<_>>(), want.iter().map(|h| h.0).collect::<Vec<_>>());
        for (g, w) in got.iter().zip(&want) {
            assert!((g.1 - w.1).abs() <= 1e-5 * w.1.abs(), "text query {i}: score {} vs {} alone", g.1, w.1);
        }
    }
    let _ = std::fs::remove_dir_all(&ckpt);
}
