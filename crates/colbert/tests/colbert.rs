//! ColBERT loading and encoding on tiny checkpoints generated here (random
//! weights, a real WordPiece tokenizer.json written by the `tokenizers`
//! crate), in the PyLate and the colbert-ai layouts, checked token by token.

mod support;

use candle_core::{DType, Device, Result};
use candle_maxsim_colbert::{read_documents, ColBert};
use support::*;

#[test]
fn pylate_layout_token_by_token() -> anyhow::Result<()> {
    let dir = pylate_checkpoint()?;
    let m = ColBert::load(&dir, &Device::Cpu, DType::F32)?;
    assert_eq!(m.config.query_length, 12);
    assert_eq!(m.config.document_length, 10);

    let q = m.tokenize_queries(&["The cat sat", "the cat sat on the mat a red ball is big small dog runs fast"])?;
    let (cls, sep, mask) = (id("[CLS]"), id("[SEP]"), id("[MASK]"));
    let mut want = vec![cls, id("[Q]"), id("the"), id("cat"), id("sat"), sep];
    want.resize(12, mask);
    assert_eq!(q.ids[0], want, "query augmentation with [MASK]");
    assert_eq!(q.attention[0], [vec![1u8; 6], vec![0u8; 6]].concat(), "expansion tokens not attended");
    assert_eq!(q.score_mask[0], vec![1u8; 12], "every query position is scored");
    assert_eq!(q.ids[1].len(), 12);
    assert_eq!((q.ids[1][0], q.ids[1][1], q.ids[1][11]), (cls, id("[Q]"), sep), "truncated, [SEP] kept");
    assert!(!q.ids[1].contains(&mask));

    let d = m.tokenize_documents(&["the dog, runs.", "a red ball is big small dog runs fast on the mat"])?;
    let (pad, d_m) = (id("[PAD]"), id("[D]"));
    assert_eq!(d.ids[0], vec![cls, d_m, id("the"), id("dog"), id(","), id("runs"), id("."), sep, pad, pad]);
    assert_eq!(d.score_mask[0], vec![1, 1, 1, 1, 0, 1, 0, 1, 0, 0], "punctuation and padding masked");
    assert_eq!(d.attention[0], vec![1, 1, 1, 1, 1, 1, 1, 1, 0, 0]);
    assert_eq!(d.ids[1].len(), 10);
    assert_eq!(d.ids[1][9], sep);

    // Embeddings: shapes, unit norm, and scoring through MaxSim.
    let (qe, qm) = m.encode_queries(&["the cat sat", "dog runs fast"])?;
    let docs = ["the cat sat on the mat", "a dog runs fast", "red ball, big ball"];
    let (de, dm) = m.encode_documents(&docs)?;
    assert_eq!(qe.dims(), &[2, 12, DOUT]);
    assert_eq!(de.dims()[0], 3);
    // Unit norm where the document has tokens; zero rows at its padding.
    let norms: Vec<f32> = de.sqr()?.sum(2)?.flatten_all()?.to_vec1()?;
    let tok = m.tokenize_documents(&docs)?;
    for (n, a) in norms.iter().zip(tok.attention.concat()) {
        let want = f32::from(a);
        assert!((n - want).abs() < 1e-4, "norm {n} at a row of attention {a}");
    }
    let want = candle_maxsim::reference::maxsim(&qe, &de, Some(&qm), Some(&dm))?;
    let ranked = m.rank("the cat sat", &docs, 3)?;
    let w0: Vec<f32> = want.get(0)?.to_vec1()?;
    assert_eq!(ranked.len(), 3);
    for w in ranked.windows(2) {
        assert!(w[0].1 >= w[1].1, "best first");
    }
    for (i, s) in &ranked {
        assert!((s - w0[*i]).abs() < 1e-4, "rank scores are MaxSim scores");
    }
    Ok(())
}

#[test]
fn colbert_ai_layout() -> anyhow::Result<()> {
    let dir = colbert_ai_checkpoint()?;
    let m = ColBert::load(&dir, &Device::Cpu, DType::F32)?;
    assert_eq!((m.config.query_length, m.config.document_length), (8, 9));
    let q = m.tokenize_queries(&["the cat"])?;
    let mask = id("[MASK]");
    assert_eq!(q.ids[0], vec![id("[CLS]"), id("[unused0]"), id("the"), id("cat"), id("[SEP]"), mask, mask, mask]);
    let d = m.tokenize_documents(&["the mat."])?;
    assert_eq!(d.ids[0], vec![id("[CLS]"), id("[unused1]"), id("the"), id("mat"), id("."), id("[SEP]")]);
    let (qe, _) = m.encode_queries(&["the cat"])?;
    assert_eq!(qe.dims(), &[1, 8, DOUT]);
    Ok(())
}

#[test]
fn bad_checkpoint_is_an_error() -> Result<()> {
    let dir = tmpdir("empty");
    assert!(ColBert::load(&dir, &Device::Cpu, DType::F32).is_err(), "no config.json");
    std::fs::write(dir.join("config.json"), bert_config().to_string())?;
    let e = ColBert::load(&dir, &Device::Cpu, DType::F32).err().expect("no weights").to_string();
    assert!(e.contains("model.safetensors"), "{e}");
    Ok(())
}

/// A checkpoint without tokenizer.json, or with a broken one: the error
/// names the file (the tokenizers crate's own names none).
#[test]
fn tokenizer_errors_name_the_file() -> anyhow::Result<()> {
    let dir = plain_checkpoint()?;
    let path = dir.join("tokenizer.json");
    std::fs::remove_file(&path)?;
    let e = ColBert::load(&dir, &Device::Cpu, DType::F32).err().expect("no tokenizer.json").to_string();
    assert!(e.contains(&dir.display().to_string()) && e.contains("tokenizer.json"), "{e}");
    std::fs::write(&path, "{ not a tokenizer")?;
    let e = ColBert::load(&dir, &Device::Cpu, DType::F32).err().expect("a broken tokenizer.json").to_string();
    assert!(e.contains(&path.display().to_string()), "{e}");
    let e = candle_maxsim_colbert::train::TrainableColBert::load(&dir, &Device::Cpu, DType::F32, DOUT, 0)
        .err()
        .expect("a broken tokenizer.json")
        .to_string();
    assert!(e.contains(&path.display().to_string()), "{e}");
    Ok(())
}

/// `dim`: the projection's output, the hidden size without one.
#[test]
fn embedding_dim() -> anyhow::Result<()> {
    for (dir, want) in [(pylate_checkpoint()?, DOUT), (colbert_ai_checkpoint()?, DOUT), (plain_checkpoint()?, HIDDEN)] {
        let m = ColBert::load(&dir, &Device::Cpu, DType::F32)?;
        let (d, _) = m.encode_documents(&["the cat"])?;
        assert_eq!((m.dim(), d.dim(2)?), (want, want), "{}", dir.display());
    }
    Ok(())
}

/// One document per line, trimmed, blank lines skipped; a file with none
/// (empty, or blank lines only) and an unreadable one are errors naming it.
#[test]
fn read_documents_of_a_file() -> anyhow::Result<()> {
    let dir = tmpdir("docs");
    let path = dir.join("docs.txt");
    std::fs::write(&path, "  the cat sat \n\n\t\na dog runs\r\n")?;
    assert_eq!(read_documents(&path)?, ["the cat sat", "a dog runs"]);
    for text in ["", "\n", "  \n\t\n \r\n"] {
        std::fs::write(&path, text)?;
        let e = read_documents(&path).expect_err("no documents").to_string();
        assert!(e.contains(&path.display().to_string()) && e.contains("no documents"), "{text:?}: {e}");
    }
    let missing = dir.join("missing.txt");
    let e = read_documents(&missing).expect_err("no file").to_string();
    assert!(e.contains(&missing.display().to_string()), "{e}");
    Ok(())
}

#[test]
fn half_precision_encoding() -> anyhow::Result<()> {
    let dir = pylate_checkpoint()?;
    let docs = ["the cat sat on the mat", "a dog runs fast"];
    let f32m = ColBert::load(&dir, &Device::Cpu, DType::F32)?;
    let (want, _) = f32m.encode_documents(&docs)?;
    for dt in [DType::F16, DType::BF16] {
        let m = ColBert::load(&dir, &Device::Cpu, dt)?;
        let (got, _) = m.encode_documents(&docs)?;
        assert_eq!(got.dtype(), dt);
        let err = (got.to_dtype(DType::F32)? - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(err < 3e-2, "{dt:?}: max |diff| {err} against F32");
    }
    Ok(())
}

/// The colbert example's path on the CPU (encode a query and documents,
/// rank by MaxSim) gives the same ranking and scores with one thread as with
/// several: the CPU ops split their rows over threads but compute each row
/// alone. Long enough documents that every parallel loop splits.
#[test]
fn cpu_ranking_does_not_depend_on_threads() -> anyhow::Result<()> {
    let dir = plain_checkpoint()?;
    let words: Vec<&str> = VOCAB.iter().copied().filter(|w| !w.starts_with('[') && !w.starts_with('#')).collect();
    let docs: Vec<String> = (0..64)
        .map(|i| (0..48).map(|k| words[(i * 7 + k * k * 3 + k) % words.len()]).collect::<Vec<_>>().join(" "))
        .collect();
    let docs: Vec<&str> = docs.iter().map(String::as_str).collect();
    let model = ColBert::load(&dir, &Device::Cpu, DType::F32)?;
    let run = |threads: usize| -> anyhow::Result<Vec<(usize, f32)>> {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
        Ok(pool.install(|| model.rank(&words[..6].join(" "), &docs, docs.len()))?)
    };
    let (one, many) = (run(1)?, run(8)?);
    assert_eq!(one.iter().map(|r| r.0).collect::<Vec<_>>(), many.iter().map(|r| r.0).collect::<Vec<_>>());
    for ((d, a), (_, b)) in one.iter().zip(&many) {
        assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "document {d}: {a} with one thread, {b} with eight");
    }
    Ok(())
}

/// The same checkpoints encoded and ranked on CUDA agree with the CPU
/// encoder: F32 and F16 (F32 encoder, cast) closely, BF16 (a BF16 encoder on
/// CUDA) in direction. Only built with the `cuda` feature, where it fails
/// without a GPU: a CPU run must not report it as passed.
#[cfg(feature = "cuda")]
#[test]
fn cuda_matches_cpu() -> anyhow::Result<()> {
    let gpu = candle_maxsim_testing::cuda_device();
    let docs = ["the cat sat on the mat.", "a dog runs fast!", "the mat is red", "cats and dogs"];
    for dir in [pylate_checkpoint()?, colbert_ai_checkpoint()?] {
        let cpu = ColBert::load(&dir, &Device::Cpu, DType::F32)?;
        let (want_d, want_dm) = cpu.encode_documents(&docs)?;
        let (want_q, _) = cpu.encode_queries(&["the cat"])?;
        let want_scores = cpu.score("the cat", &docs, 2, &mut |_| {})?;
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let m = ColBert::load(&dir, &gpu, dt)?;
            let (d, dm) = m.encode_documents(&docs)?;
            let (q, _) = m.encode_queries(&["the cat"])?;
            assert!(d.device().is_cuda() && d.dtype() == dt, "{dt:?}: {:?} {:?}", d.device(), d.dtype());
            assert_eq!(dm.to_device(&Device::Cpu)?.to_vec2::<u8>()?, want_dm.to_vec2::<u8>()?, "{dt:?} doc mask");
            let scores = m.score("the cat", &docs, 2, &mut |_| {})?;
            let score_err = scores.iter().zip(&want_scores).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            for (got, want, what) in [(&d, &want_d, "documents"), (&q, &want_q, "queries")] {
                let got = got.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
                let err = (&got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                // Rows are unit vectors (or zero): the dot product is the cosine.
                let cos = (&got * want)?.sum(2)?.flatten_all()?.to_vec1::<f32>()?;
                let norms = want.sqr()?.sum(2)?.flatten_all()?.to_vec1::<f32>()?;
                let min_cos = cos.iter().zip(&norms).filter(|(_, n)| **n > 0.5).map(|(c, _)| *c).fold(1f32, f32::min);
                println!("{} {dt:?} {what}: max |cuda - cpu| {err:.2e}, min cosine {min_cos:.5}, max score diff {score_err:.2e}", dir.display());
                assert!(err.is_finite() && score_err.is_finite(), "{dt:?} {what}: non-finite output on CUDA");
                match dt {
                    DType::F32 => assert!(err < 1e-3 && score_err < 1e-2, "F32 {what}: {err} {score_err}"),
                    DType::F16 => assert!(err < 3e-2 && score_err < 0.2, "F16 {what}: {err} {score_err}"),
                    _ => assert!(min_cos > 0.97, "BF16 {what}: min cosine {min_cos}"),
                }
            }
        }
    }
    Ok(())
}

/// `encode_documents_packed` (the packed encoder, no padding) gives the
/// scored rows of `encode_documents`, in order, up to rounding.
#[test]
fn packed_documents_are_the_scored_rows() -> anyhow::Result<()> {
    let dir = colbert_ai_checkpoint()?;
    let m = ColBert::load(&dir, &Device::Cpu, DType::F32)?;
    let docs = ["the mat.", "the cat the mat", "cat"];
    let (d, dm) = m.encode_documents(&docs)?;
    let (packed, lens) = m.encode_documents_packed(&docs)?;
    let (d, dm): (Vec<Vec<Vec<f32>>>, Vec<Vec<u8>>) = (d.to_vec3()?, dm.to_vec2()?);
    let want: Vec<Vec<f32>> = d
        .iter()
        .zip(&dm)
        .flat_map(|(rows, mask)| rows.iter().zip(mask).filter(|(_, &k)| k != 0).map(|(r, _)| r.clone()))
        .collect();
    assert_eq!(lens, dm.iter().map(|m| m.iter().map(|&k| k as u32).sum::<u32>()).collect::<Vec<_>>());
    let want = candle_core::Tensor::new(want, &Device::Cpu)?;
    candle_maxsim_testing::assert_close("packed documents", &packed, &want, 1e-5)?;
    Ok(())
}

/// `encode_documents_stream` hands over, in order, exactly what
/// `encode_documents_packed` gives batch by batch (a last short batch and
/// an empty collection included); a batch of 0 is an error naming it.
#[test]
fn streamed_documents_are_the_batches() -> anyhow::Result<()> {
    let dir = colbert_ai_checkpoint()?;
    let m = ColBert::load(&dir, &Device::Cpu, DType::F32)?;
    let docs = ["the mat.", "the cat the mat", "cat", "a cat on the mat", "mat mat"];
    let mut got = Vec::new();
    m.encode_documents_stream(&docs, 2, &mut |x, lens| {
        got.push((x.to_vec2::<f32>()?, lens));
        Ok(())
    })?;
    let want: Vec<_> = docs
        .chunks(2)
        .map(|c| m.encode_documents_packed(c).and_then(|(x, l)| Ok((x.to_vec2::<f32>()?, l))))
        .collect::<candle_core::Result<_>>()?;
    assert_eq!(got, want);
    let mut calls = 0;
    m.encode_documents_stream(&[], 2, &mut |_, _| {
        calls += 1;
        Ok(())
    })?;
    assert_eq!(calls, 0, "no documents, no batch");
    let err = m.encode_documents_stream(&docs, 0, &mut |_, _| Ok(())).unwrap_err().to_string();
    assert!(err.contains("batch"), "{err}");
    Ok(())
}
