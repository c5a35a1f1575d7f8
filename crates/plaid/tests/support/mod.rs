//! A random fast-plaid index written in its on-disk format, and the fixture
//! written by the real fast-plaid package.

use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{self as ms, BitOrder, ResidualCodec};
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

/// The fast-plaid fixture `name` (`nb2`, `nb4`) written by tests/fixtures/make_plaid_fixture.py, if present.
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
