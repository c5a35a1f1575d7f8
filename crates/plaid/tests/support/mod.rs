//! A random fast-plaid index written in its on-disk format, the fixture
//! written by the real fast-plaid package, and a clustered collection to
//! build indexes from (each test target uses a part of it).
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{
    self as ms,
    residual::{BitOrder, ResidualCodec},
};
use candle_maxsim_testing::{rand_offsets, randn};
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Layout {
    /// `{i}.codes.npy` / `{i}.residuals.npy` per chunk (fast-plaid < 1.7, or FAST_PLAID_KEEP_SHARDS=1).
    Shards,
    /// fast-plaid ≥ 1.7: `merged_*.npy` with its fixed 192-byte header, padding rows and manifest.
    Merged,
}

/// What a synthetic index holds, to check the loaded one against.
pub struct Synth {
    pub dir: PathBuf,
    pub codec: ResidualCodec,
    pub codes: Tensor,
    pub residuals: Tensor,
    pub lens: Vec<usize>,
}

impl Drop for Synth {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("candle_maxsim_plaid_{}_{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn write_json(path: &Path, v: &serde_json::Value) {
    std::fs::write(path, serde_json::to_string(v).unwrap()).unwrap();
}

/// An .npy file as fast-plaid ≥ 1.7 writes its merged files: npy 1.0 with the
/// prologue padded to exactly 192 bytes.
pub fn write_fixed_header_npy(path: &Path, descr: &str, shape: &[usize], bytes: &[u8]) {
    let shape = match shape {
        [n] => format!("({n},)"),
        s => format!("({})", s.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let body = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let header = format!("{body}{}\n", " ".repeat(192 - 10 - body.len() - 1));
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    out.extend(bytes);
    std::fs::write(path, out).unwrap();
}

/// A random index of `chunk_docs[i]` documents per chunk (lengths 0..=12, one
/// empty document), dim 32, 24 F16 unit centroids.
pub fn write_index(name: &str, nbits: usize, chunk_docs: &[usize], layout: Layout) -> Result<Synth> {
    let dev = Device::Cpu;
    let dir = temp_dir(name);
    let (dim, n_c) = (32, 24);
    let centroids = ms::l2_normalize(&randn(&[n_c, dim], DType::F32, &dev)?)?.to_dtype(DType::F16)?;
    let n_b = 1usize << nbits;
    let weights: Vec<f32> = (0..n_b).map(|k| (k as f32 - n_b as f32 / 2.0 + 0.5) * 0.04).collect();
    let bucket_weights = Tensor::new(weights, &dev)?;
    centroids.write_npy(dir.join("centroids.npy"))?;
    bucket_weights.write_npy(dir.join("bucket_weights.npy"))?;
    Tensor::zeros(n_b - 1, DType::F32, &dev)?.write_npy(dir.join("bucket_cutoffs.npy"))?;
    Tensor::zeros(dim, DType::F32, &dev)?.write_npy(dir.join("avg_residual.npy"))?;

    let width = dim * nbits / 8;
    let mut seed = nbits as u64 * 31 + chunk_docs.len() as u64;
    let (mut all_codes, mut all_res, mut lens) = (vec![], vec![], vec![]);
    let mut manifest_codes = serde_json::Map::new();
    let mut manifest_res = serde_json::Map::new();
    for (i, &n) in chunk_docs.iter().enumerate() {
        seed += 1;
        let (cu, _) = rand_offsets(n, 12, seed);
        let chunk_lens: Vec<usize> = cu.windows(2).map(|w| (w[1] - w[0]) as usize).collect();
        let t: usize = chunk_lens.iter().sum();
        let codes = Tensor::rand(0f32, n_c as f32, t.max(1), &dev)?.to_dtype(DType::U32)?.to_dtype(DType::I64)?;
        let codes = codes.narrow(0, 0, t)?;
        let res = Tensor::rand(0f32, 256., (t.max(1), width), &dev)?.to_dtype(DType::U8)?.narrow(0, 0, t)?;
        if layout == Layout::Shards {
            codes.write_npy(dir.join(format!("{i}.codes.npy")))?;
            res.write_npy(dir.join(format!("{i}.residuals.npy")))?;
        }
        manifest_codes.insert(format!("{i}.codes.npy"), serde_json::json!({"rows": t, "merged": true, "mtime": null}));
        manifest_res
            .insert(format!("{i}.residuals.npy"), serde_json::json!({"rows": t, "merged": true, "mtime": null}));
        write_json(&dir.join(format!("doclens.{i}.json")), &serde_json::json!(chunk_lens));
        write_json(
            &dir.join(format!("{i}.metadata.json")),
            &serde_json::json!({"num_documents": n, "num_embeddings": t}),
        );
        all_codes.extend(codes.to_vec1::<i64>()?);
        all_res.extend(res.flatten_all()?.to_vec1::<u8>()?);
        lens.extend(chunk_lens);
    }
    let total = all_codes.len();
    let mut meta = serde_json::json!({
        "num_chunks": chunk_docs.len(), "nbits": nbits, "num_partitions": n_c,
        "num_embeddings": total, "avg_doclen": total as f64 / lens.len() as f64, "num_documents": lens.len(),
    });
    if layout == Layout::Merged {
        // Padding rows after the data, as fast-plaid appends them (never read).
        let pad = 3;
        let codes_bytes: Vec<u8> = all_codes.iter().chain(&vec![-1i64; pad]).flat_map(|c| c.to_le_bytes()).collect();
        write_fixed_header_npy(&dir.join("merged_codes.npy"), "<i8", &[total + pad], &codes_bytes);
        let res_bytes: Vec<u8> = all_res.iter().copied().chain(vec![0xAB; pad * width]).collect();
        write_fixed_header_npy(&dir.join("merged_residuals.npy"), "|u1", &[total + pad, width], &res_bytes);
        write_json(&dir.join("merged_codes.manifest.json"), &manifest_codes.into());
        write_json(&dir.join("merged_residuals.manifest.json"), &manifest_res.into());
        meta["frozen"] = true.into();
        meta["mutable"] = true.into();
    }
    write_json(&dir.join("metadata.json"), &meta);
    Ok(Synth {
        dir,
        codec: ResidualCodec { centroids, bucket_weights, nbits, bit_order: BitOrder::ColBert },
        codes: Tensor::new(all_codes, &dev)?,
        residuals: Tensor::from_vec(all_res, (total, width), &dev)?,
        lens,
    })
}

/// The fast-plaid fixture `name` (`nb2`, `nb4`: fast-plaid 1.7.0; `fp146`: 1.4.6) written by
/// tests/fixtures/make_plaid_fixture.py, if present.
pub fn fixture(name: &str) -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/plaid").join(name);
    if dir.join("index/metadata.json").exists() {
        Some(dir)
    } else {
        eprintln!(
            "skipped: no fast-plaid fixture at {} (tests/fixtures/make_plaid_fixture.py writes it)",
            dir.display()
        );
        None
    }
}

/// A clustered collection with the structure of ColBERT embeddings:
/// `n_topics` random unit topic directions, each with `words` word vectors
/// near it; a document draws a topic and 70 % of its tokens from that
/// topic's words (the rest from all words), each token with contextual
/// noise, normalized. Returns `(embeddings [T, dim] F32, lengths, topic of
/// each document)`.
pub fn clustered(n_docs: usize, dim: usize, n_topics: usize, seed: u64) -> Result<(Tensor, Vec<u32>, Vec<usize>)> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dev = Device::Cpu;
    let words = 12;
    let topics = ms::l2_normalize(&Tensor::randn(0f32, 1., (n_topics, dim), &dev)?)?;
    let noise = Tensor::randn(0f32, 0.5 / (dim as f32).sqrt(), (n_topics, words, dim), &dev)?;
    let vocab = ms::l2_normalize(&topics.unsqueeze(1)?.broadcast_add(&noise)?)?.reshape((n_topics * words, dim))?;
    let (mut rows, mut lens, mut doc_topics) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..n_docs {
        let t = rng.random_range(0..n_topics);
        let len = rng.random_range(8..40u32);
        for _ in 0..len {
            let w = if rng.random::<f32>() < 0.7 {
                t * words + rng.random_range(0..words)
            } else {
                rng.random_range(0..n_topics * words)
            };
            rows.push(w as u32);
        }
        lens.push(len);
        doc_topics.push(t);
    }
    let n = rows.len();
    let x = vocab.index_select(&Tensor::from_vec(rows, n, &dev)?, 0)?;
    let x = ms::l2_normalize(&(x + Tensor::randn(0f32, 0.3 / (dim as f32).sqrt(), (n, dim), &dev)?)?)?;
    Ok((x, lens, doc_topics))
}

/// Queries built from documents `targets`: `lq` of the document's tokens
/// (with repeats) plus noise, normalized: `[targets.len(), lq, dim]`.
pub fn queries_from(x: &Tensor, lens: &[u32], targets: &[usize], lq: usize, seed: u64) -> Result<Tensor> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut cu = vec![0usize];
    for &l in lens {
        cu.push(cu.last().unwrap() + l as usize);
    }
    let mut rows = Vec::new();
    for &t in targets {
        for _ in 0..lq {
            rows.push((cu[t] + rng.random_range(0..lens[t] as usize)) as u32);
        }
    }
    let n = rows.len();
    let dim = x.dim(1)?;
    let q = x.index_select(&Tensor::from_vec(rows, n, x.device())?, 0)?;
    let q = ms::l2_normalize(&(q + Tensor::randn(0f32, 0.2 / (dim as f32).sqrt(), (n, dim), x.device())?)?)?;
    q.reshape((targets.len(), lq, dim))
}
