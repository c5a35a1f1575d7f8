//! Training: the gradients of every loss against the same loss over
//! candle-maxsim's `reference` scoring, the gradient cache against the plain
//! contrastive loss, checkpoints that reload bit for bit, a resumed run that
//! continues the uninterrupted one, a loss that falls, and bad data named by
//! file and line. On tiny generated checkpoints, on the CPU and, under the
//! `cuda` feature, on the GPU.

mod support;

use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::reference;
use candle_maxsim_colbert::train::{self, Example, Loss, TrainConfig, TrainableColBert};
use candle_maxsim_colbert::ColBert;
use candle_maxsim_testing::*;
use std::path::Path;
use support::*;

/// Queries and documents from the tiny vocabulary, each query's positive
/// sharing its words, two hard negatives that do not.
fn examples(n: usize) -> Vec<Example> {
    let words = ["cat", "dog", "mat", "ball", "red", "big", "small", "runs", "fast", "sat"];
    (0..n)
        .map(|i| {
            let (a, b) = (words[i % words.len()], words[(i * 3 + 1) % words.len()]);
            let (c, d) = (words[(i + 5) % words.len()], words[(i * 7 + 2) % words.len()]);
            Example {
                query: format!("the {a} {b}"),
                documents: vec![format!("a {a} is {b} on the mat."), format!("the {c} runs."), format!("{d} {c}!")],
                scores: Some(vec![3.0 + (i % 3) as f32, 1.0, 0.5]),
                origin: format!("example {i}"),
            }
        })
        .collect()
}

/// A plain tiny checkpoint (random weights, made once per call).
fn checkpoint() -> Result<std::path::PathBuf> {
    plain_checkpoint().map_err(|e| candle_core::Error::Msg(e.to_string()))
}

fn model(ckpt: &Path, dev: &Device) -> Result<TrainableColBert> {
    TrainableColBert::load(ckpt, dev, DType::F32, 16, 7)
}

/// The loss of one batch with scores from `score` (ours or the reference), and its gradients by var name.
fn loss_and_grads(
    m: &TrainableColBert,
    ex: &[Example],
    loss: Loss,
    score: &dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Result<(f32, Vec<(String, Tensor)>)> {
    let cm = &m.model;
    let q: Vec<&str> = ex.iter().map(|e| e.query.as_str()).collect();
    let d: Vec<&str> = ex.iter().flat_map(|e| e.documents.iter().map(String::as_str)).collect();
    let (qe, qm) = cm.encode_queries(&q)?;
    let (de, dm) = cm.encode_documents(&d)?;
    let n = ex[0].documents.len();
    let dev = cm.device();
    let l = match loss {
        Loss::Contrastive { scale } | Loss::Cached { scale, .. } => {
            let s = score(&qe, &de, &qm, &dm)?;
            let t = Tensor::new((0..ex.len() as u32).map(|i| i * n as u32).collect::<Vec<_>>(), dev)?;
            train::loss::contrastive(&s, &t, scale)?
        }
        _ => {
            let (_, ld, dim) = de.dims3()?;
            let s = score(&qe, &de.reshape((ex.len(), n, ld, dim))?, &qm, &dm.reshape((ex.len(), n, ld))?)?;
            let t: Vec<f32> = ex.iter().flat_map(|e| e.scores.clone().unwrap()).collect();
            let t = Tensor::from_vec(t, (ex.len(), n), dev)?;
            match loss {
                Loss::Distill { temperature } => train::loss::distill_kl(&s, &t, temperature)?,
                _ => train::loss::margin_mse(&s, &t)?,
            }
        }
    };
    let g = l.backward()?;
    let grads = m.vars().into_iter().filter_map(|(n, v)| g.get(v.as_tensor()).map(|t| (n, t.clone()))).collect();
    Ok((l.to_scalar()?, grads))
}

/// Gradients `(name, tensor)` equal within 2e-3 of the larger of their own
/// largest entry and 1 % of the largest entry of all (a gradient that is 0 in
/// exact arithmetic, as a key bias's, is rounding noise).
fn assert_same_gradients(what: &str, a: &[(String, Tensor)], b: &[(String, Tensor)]) -> Result<()> {
    let mut gmax = 0f64;
    for (_, t) in b {
        gmax = gmax.max(max_abs(t)?);
    }
    for ((n, x), (m, y)) in a.iter().zip(b) {
        assert_eq!(n, m, "{what}: the same vars");
        let e = max_abs_diff(x, y)? / max_abs(y)?.max(1e-2 * gmax);
        assert!(e < 2e-3, "{what}: gradient of {n} differs by {e:e}");
    }
    Ok(())
}

/// Every loss: the gradients of the model's weights through candle-maxsim's
/// MaxSim equal those through `reference`.
fn loss_gradients_match_reference(dev: &Device) -> Result<()> {
    let m = model(&checkpoint()?, dev)?;
    let ex = examples(3);
    for loss in [
        Loss::Contrastive { scale: 1.0 },
        Loss::Contrastive { scale: 20.0 },
        Loss::Distill { temperature: 0.5 },
        Loss::MarginMse,
    ] {
        let ours = |q: &Tensor, d: &Tensor, qm: &Tensor, dm: &Tensor| candle_maxsim::maxsim(q, d, Some(qm), Some(dm));
        let naive = |q: &Tensor, d: &Tensor, qm: &Tensor, dm: &Tensor| reference::maxsim(q, d, Some(qm), Some(dm));
        let (lo, go) = loss_and_grads(&m, &ex, loss, &ours)?;
        let (lr, gr) = loss_and_grads(&m, &ex, loss, &naive)?;
        assert!((lo - lr).abs() <= 1e-4 * lr.abs().max(1.0), "{loss:?}: loss {lo} vs {lr}");
        assert_eq!(go.len(), gr.len(), "{loss:?}: the same vars get gradients");
        assert!(go.len() > 10, "{loss:?}: gradients reach the encoder");
        assert_same_gradients(&format!("{loss:?}"), &go, &gr)?;
    }
    Ok(())
}

test_device!(loss_gradients_match_reference, loss_gradients_match_reference_cpu, loss_gradients_match_reference_cuda);

/// The gradient cache (mini-batches of 2 and of 4) has the plain
/// contrastive loss's value and gradients.
fn cached_equals_contrastive(dev: &Device) -> Result<()> {
    let ex = examples(6);
    let m = model(&checkpoint()?, dev)?;
    let sorted = |g: std::collections::HashMap<String, Tensor>| {
        let mut v: Vec<(String, Tensor)> = g.into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let (l0, g0) = train::loss_and_gradients(&m, &ex, Loss::Contrastive { scale: 5.0 })?;
    for mini_batch in [2, 4] {
        let (l, g) = train::loss_and_gradients(&m, &ex, Loss::Cached { scale: 5.0, mini_batch })?;
        assert!((l - l0).abs() < 1e-4 * l0.abs().max(1.0), "mini-batch {mini_batch}: loss {l} vs {l0}");
        assert_same_gradients(&format!("cached, mini-batch {mini_batch}"), &sorted(g), &sorted(g0.clone()))?;
    }
    Ok(())
}

test_device!(cached_equals_contrastive, cached_equals_contrastive_cpu, cached_equals_contrastive_cuda);

/// A short run lowers the loss; its checkpoint reloads with identical
/// embeddings (as a ColBert and as a TrainableColBert); a run resumed from
/// a mid-run checkpoint continues the uninterrupted run's losses.
fn train_save_resume(dev: &Device) -> Result<()> {
    let ex = examples(24);
    let cfg = TrainConfig {
        batch_size: 4,
        lr: 2e-3,
        epochs: 2,
        warmup_ratio: 0.1,
        save_steps: Some(4),
        ..Default::default()
    };
    let out = tmpdir("run");
    let ckpt = checkpoint()?;
    let mut m = model(&ckpt, dev)?;
    let full = train::train(&mut m, &ex, None, &cfg, &out, None)?;
    assert_eq!(full.steps.len(), 12);
    let first: f32 = full.steps[..3].iter().map(|s| s.1).sum();
    let last: f32 = full.steps[9..].iter().map(|s| s.1).sum();
    assert!(last < first, "the loss falls: {first} -> {last}");
    // The saved model encodes exactly as the trained one.
    let texts = ["the cat sat", "a red ball is big."];
    let (q0, _) = m.model.encode_queries(&texts)?;
    let (d0, _) = m.model.encode_documents(&texts)?;
    let back = ColBert::load(&out, dev, DType::F32)?;
    assert_eq!(max_abs_diff(&back.encode_queries(&texts)?.0, &q0)?, 0.0, "reloaded query embeddings");
    assert_eq!(max_abs_diff(&back.encode_documents(&texts)?.0, &d0)?, 0.0, "reloaded document embeddings");
    let again = TrainableColBert::load(&out, dev, DType::F32, 16, 7)?;
    assert_eq!(max_abs_diff(&again.model.encode_queries(&texts)?.0, &q0)?, 0.0, "reloaded trainable model");
    // Resume from step 4: the same losses from step 5 on.
    let mut r = model(&ckpt, dev)?;
    let resumed = train::train(&mut r, &ex, None, &cfg, &tmpdir("resumed"), Some(&out.join("checkpoint-4")))?;
    assert_eq!(resumed.steps.len(), 12);
    for (a, b) in full.steps[4..].iter().zip(&resumed.steps[4..]) {
        let tol = if dev.is_cuda() { 1e-3 } else { 1e-5 };
        assert!((a.1 - b.1).abs() <= tol * a.1.abs().max(1.0), "step {}: {} vs resumed {}", a.0, a.1, b.1);
    }
    Ok(())
}

test_device!(train_save_resume, train_save_resume_cpu, train_save_resume_cuda);

/// The encoder on packed sequences computes and trains as the padded one:
/// the documents' scored rows of `embed` equal `embed_padded`'s and its
/// padding rows are zero; three steps of plain gradient descent from one
/// start (the documents packed, the queries, whose `[MASK]` expansion is
/// not attended, padded) reach the same weights. 32-wide heads, so that the
/// fused attention runs where it is built (CPU F32; CUDA F32 composes it).
fn packed_and_padded_train_alike(dev: &Device) -> Result<()> {
    let ckpt = plain_checkpoint_wide_heads().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let ex = examples(12);
    let m = model(&ckpt, dev)?;
    let docs: Vec<&str> = ex.iter().flat_map(|e| e.documents.iter().map(String::as_str)).collect();
    let tok = m.model.tokenize_documents(&docs)?;
    let (packed, padded) = (m.model.embed(&tok)?, m.model.embed_padded(&tok)?);
    let att = m.model.mask_tensor(&tok.attention)?.to_dtype(DType::F32)?.unsqueeze(2)?;
    let pad = (1.0 - &att)?;
    let at_padding = packed.broadcast_mul(&pad)?;
    assert_eq!(max_abs_diff(&at_padding, &at_padding.zeros_like()?)?, 0.0, "padding rows of the packed embedding");
    let e = max_abs_diff(&packed, &padded.broadcast_mul(&att)?)?;
    assert!(e < 1e-5, "attended rows: packed and padded differ by {e:e}");
    let lr = 0.5;
    let mut weights = Vec::new();
    for on in [true, false] {
        let mut m = model(&ckpt, dev)?;
        m.model.set_packed_encoder(on);
        let start: Vec<Tensor> = m.vars().iter().map(|(_, v)| v.as_tensor().copy()).collect::<Result<_>>()?;
        for step in 0..3 {
            let (_, g) = train::loss_and_gradients(&m, &ex[step * 4..step * 4 + 4], Loss::Contrastive { scale: 5.0 })?;
            for (name, v) in m.vars() {
                if let Some(g) = g.get(&name) {
                    v.set(&(v.as_tensor() - (g * lr)?)?)?;
                }
            }
        }
        let moved: Vec<(String, Tensor, Tensor)> = m
            .vars()
            .into_iter()
            .zip(start)
            .map(|((n, v), s)| Ok((n, v.as_tensor().copy()?, (v.as_tensor() - s)?)))
            .collect::<Result<_>>()?;
        weights.push(moved);
    }
    let mut most = 0f64;
    for (_, _, d) in &weights[1] {
        most = most.max(max_abs(d)?);
    }
    assert!(most > 1e-3, "the steps move the weights ({most:e})");
    for ((n, a, _), (_, b, d)) in weights[0].iter().zip(&weights[1]) {
        let e = max_abs_diff(a, b)? / max_abs(d)?.max(1e-2 * most);
        assert!(e < 2e-3, "{n}: packed and padded training differ by {e:e} of the update");
    }
    Ok(())
}

test_device!(packed_and_padded_train_alike, packed_and_padded_train_alike_cpu, packed_and_padded_train_alike_cuda);

/// Bad data: each error names the file and line; a failed save leaves no
/// partial checkpoint.
#[test]
fn bad_data_names_file_and_line() -> anyhow::Result<()> {
    let dir = tmpdir("data");
    let file = |name: &str, text: &str| -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let err = |r: Result<Vec<Example>>| match r {
        Err(e) => e.to_string(),
        Ok(_) => panic!("expected an error"),
    };
    let e = err(train::read_triples(file(
        "missing.jsonl",
        "{\"query\": \"a\", \"positive\": \"b\"}\n{\"query\": \"c\"}\n",
    )));
    assert!(e.contains("missing.jsonl:2") && e.contains("positive"), "{e}");
    let e = err(train::read_triples(file("empty.jsonl", "\n\n")));
    assert!(e.contains("empty.jsonl") && e.contains("empty"), "{e}");
    let e = err(train::read_triples(file(
        "bad.jsonl",
        "{\"query\": \"a\", \"positive\": \"b\", \"negative\": [\"c\"]}\n{\"query\": \"a\", \"positive\": \"b\"}\n",
    )));
    assert!(e.contains("bad.jsonl:2") && e.contains("negatives"), "{e}");
    let q = file("q.jsonl", "{\"query_id\": 1, \"text\": \"the cat\"}\n");
    let d = file("d.jsonl", "{\"document_id\": \"a\", \"text\": \"x\"}\n{\"document_id\": \"b\", \"text\": \"y\"}\n");
    let t = file("kd.jsonl", "{\"query_id\": 1, \"document_ids\": [\"a\", \"b\"], \"scores\": [1.0, 2.0]}\n{\"query_id\": 1, \"document_ids\": [\"a\", \"b\"], \"scores\": [1.0]}\n");
    let e = err(train::read_distillation(&t, &q, &d, 32));
    assert!(e.contains("kd.jsonl:2") && e.contains("2 document_ids but 1 scores"), "{e}");
    // A query with no tokens after tokenization (zero-width spaces, which BERT's normalizer drops).
    let ex = vec![Example {
        query: "\u{200b}\u{200b}".into(),
        documents: vec!["the cat".into(), "a dog".into()],
        scores: None,
        origin: "data.jsonl:7".into(),
    }];
    let mut m = model(&checkpoint()?, &Device::Cpu)?;
    let e = match train::train(&mut m, &ex, None, &TrainConfig::default(), &dir.join("out"), None) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("expected an error"),
    };
    assert!(e.contains("data.jsonl:7") && e.contains("no tokens"), "{e}");
    // Saving into a path whose parent is a file fails and leaves nothing behind.
    let blocker = file("blocker", "not a directory");
    assert!(m.save(blocker.join("ckpt")).is_err());
    assert!(!Path::new(&blocker.join("ckpt")).exists());
    Ok(())
}

#[test]
fn beir_eval_set() -> anyhow::Result<()> {
    let dir = tmpdir("beir");
    std::fs::create_dir_all(dir.join("qrels"))?;
    let write = |name: &str, text: &str| std::fs::write(dir.join(name), text);
    write(
        "corpus.jsonl",
        "{\"_id\": \"d1\", \"title\": \"Cats\", \"text\": \"the cat sat\"}\n{\"_id\": \"d2\", \"title\": \"\", \"text\": \"a dog ran\"}\n{\"_id\": 3, \"text\": \"birds fly\"}\n",
    )?;
    write("queries.jsonl", "{\"_id\": \"q1\", \"text\": \"cat\"}\n{\"_id\": \"q2\", \"text\": \"dog or bird\"}\n{\"_id\": \"q3\", \"text\": \"fish\"}\n")?;
    write("qrels/dev.tsv", "query-id\tcorpus-id\tscore\nq2\td2\t1\nq1\td1\t2\nq2\t3\t1\nq3\td1\t0\n")?;
    let set = train::read_beir(&dir, "dev")?;
    assert_eq!(set.corpus, ["Cats the cat sat", "a dog ran", "birds fly"]);
    assert_eq!(set.queries, ["dog or bird", "cat"]);
    assert_eq!(set.relevant, [vec![1, 2], vec![0]]);
    let err = |text: &str| -> String {
        write("qrels/bad.tsv", text).unwrap();
        match train::read_beir(&dir, "bad") {
            Err(e) => e.to_string(),
            Ok(_) => panic!("expected an error for {text:?}"),
        }
    };
    let e = err("query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td9\t1\n");
    assert!(e.contains("bad.tsv:3") && e.contains("d9"), "{e}");
    let e = err("q1\td1\n");
    assert!(e.contains("bad.tsv:1") && e.contains("3 tab-separated"), "{e}");
    let e = err("q1\td1\thigh\n");
    assert!(e.contains("bad.tsv:1") && e.contains("high"), "{e}");
    let e = err("q1\td1\t0\n");
    assert!(e.contains("no query"), "{e}");
    assert!(train::read_beir(&dir, "test").is_err_and(|e| e.to_string().contains("test.tsv")));
    write("corpus.jsonl", "{\"_id\": \"d1\", \"text\": \"x\"}\n{\"_id\": \"d1\", \"text\": \"y\"}\n")?;
    assert!(train::read_beir(&dir, "dev").is_err_and(|e| e.to_string().contains("corpus.jsonl:2")));
    Ok(())
}
