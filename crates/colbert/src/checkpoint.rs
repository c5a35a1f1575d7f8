//! Checkpoint directories: what [`crate::ColBert::load`] reads (PyLate /
//! Sentence Transformers with `1_Dense/`, colbert-ai, a plain encoder), and
//! the PyLate layout the trainer writes, which PyLate's `models.ColBERT` and
//! Sentence Transformers 6's `MultiVectorEncoder` load too.

use crate::EncodeConfig;
use candle_core::{bail, Error, Result, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// How a checkpoint stores its projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// `1_Dense/model.safetensors` (`linear.weight`, maybe `linear.bias`).
    PyLate,
    /// `linear.weight` next to the encoder in `model.safetensors`.
    ColBertAi,
    /// No projection: token embeddings as they are.
    Plain,
}

pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::Msg(format!("{}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| Error::Msg(format!("{}: {e}", path.display())))
}

/// A checkpoint directory, read but not loaded.
pub(crate) struct Checkpoint {
    pub dir: PathBuf,
    pub config: serde_json::Value,
    pub weights: PathBuf,
    pub layout: Layout,
    /// The encoder's prefix in `names` (`""`, `"bert."`, `"model."`).
    pub prefix: &'static str,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        let config = read_json(&dir.join("config.json"))?;
        let weights = dir.join("model.safetensors");
        if !weights.exists() {
            bail!("model_dir: {} has no model.safetensors", dir.display())
        }
        // SAFETY: read-only memory map, only the header is read here.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(&weights)? };
        let names: Vec<String> = st.tensors().into_iter().map(|(n, _)| n).collect();
        let layout = if dir.join("1_Dense/model.safetensors").exists() {
            Layout::PyLate
        } else if names.iter().any(|n| n == "linear.weight") {
            Layout::ColBertAi
        } else {
            Layout::Plain
        };
        let model_type = config.get("model_type").and_then(|v| v.as_str()).unwrap_or("bert").to_string();
        let prefix = crate::encoder::weight_prefix(&names, &model_type);
        Ok(Self { dir: dir.to_path_buf(), config, weights, layout, prefix })
    }

    /// `tokenizer.json`, padding and truncation off: lengths, padding and
    /// masks are ours to decide (tokenizer.json files often pad to 128).
    /// Errors name the file: the tokenizers crate's own say only what failed.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        let path = self.dir.join("tokenizer.json");
        if !path.is_file() {
            bail!("model_dir: {} has no tokenizer.json", self.dir.display())
        }
        let err = |e: tokenizers::Error| Error::Msg(format!("tokenizer: {}: {e}", path.display()));
        let mut tokenizer = Tokenizer::from_file(&path).map_err(err)?;
        tokenizer.with_padding(None);
        tokenizer.with_truncation(None).map_err(err)?;
        Ok(tokenizer)
    }

    /// `vb` at the encoder's prefix.
    pub fn encoder_vb<'a>(&self, vb: VarBuilder<'a>) -> VarBuilder<'a> {
        match self.prefix.trim_end_matches('.') {
            "" => vb,
            p => vb.pp(p),
        }
    }

    /// The encoding rules: PyLate's `config_sentence_transformers.json`,
    /// colbert-ai's markers and `artifact.metadata`, or none for a plain encoder.
    pub fn encode_config(&self) -> Result<EncodeConfig> {
        let mut enc = match self.layout {
            Layout::Plain => EncodeConfig {
                query_prefix: String::new(),
                document_prefix: String::new(),
                do_query_expansion: false,
                ..Default::default()
            },
            Layout::ColBertAi => EncodeConfig {
                query_prefix: "[unused0]".into(),
                document_prefix: "[unused1]".into(),
                ..Default::default()
            },
            Layout::PyLate => EncodeConfig::default(),
        };
        let st = self.dir.join("config_sentence_transformers.json");
        if st.exists() {
            let v = read_json(&st)?;
            let s = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
            let n = |k: &str| v.get(k).and_then(|x| x.as_u64()).map(|x| x as usize);
            let b = |k: &str| v.get(k).and_then(|x| x.as_bool());
            if let Some(x) = s("query_prefix") {
                enc.query_prefix = x;
            }
            if let Some(x) = s("document_prefix") {
                enc.document_prefix = x;
            }
            if let Some(x) = n("query_length") {
                enc.query_length = x;
            }
            if let Some(x) = n("document_length") {
                enc.document_length = x;
            }
            if let Some(x) = b("do_query_expansion") {
                enc.do_query_expansion = x;
            }
            if let Some(x) = b("attend_to_expansion_tokens") {
                enc.attend_to_expansion_tokens = x;
            }
            if let Some(words) = v.get("skiplist_words").and_then(|x| x.as_array()) {
                enc.skiplist_words = words.iter().filter_map(|w| w.as_str().map(str::to_string)).collect();
            }
        } else if self.layout == Layout::ColBertAi && self.dir.join("artifact.metadata").exists() {
            let m = read_json(&self.dir.join("artifact.metadata"))?;
            if let Some(x) = m.get("query_maxlen").and_then(|x| x.as_u64()) {
                enc.query_length = x as usize;
            }
            if let Some(x) = m.get("doc_maxlen").and_then(|x| x.as_u64()) {
                enc.document_length = x as usize;
            }
        }
        Ok(enc)
    }
}

/// Writes `files` (name relative to `dir` → bytes) as a new checkpoint
/// directory `dir`: into a staging directory beside it, then renamed into
/// place, so a failure leaves no partial checkpoint (and an old one intact).
/// The old directory's `checkpoint-*` subdirectories (a training run's) are
/// moved into the new one.
pub(crate) fn write_dir(dir: &Path, files: &[(String, Vec<u8>)]) -> Result<()> {
    let io = |p: &Path, e: std::io::Error| Error::Msg(format!("out: cannot write {}: {e}", p.display()));
    let name = dir.file_name().ok_or_else(|| Error::Msg(format!("out: {} has no name", dir.display())))?;
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    let staging = parent.join(format!(".{}.staging-{}", name.to_string_lossy(), std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    let result = (|| {
        for (rel, bytes) in files {
            let p = staging.join(rel);
            if let Some(d) = p.parent() {
                std::fs::create_dir_all(d).map_err(|e| io(d, e))?;
            }
            std::fs::write(&p, bytes).map_err(|e| io(&p, e))?;
        }
        let old = staging.with_extension("old");
        let _ = std::fs::remove_dir_all(&old);
        let mut kept = Vec::new();
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let name = e.file_name();
                if e.path().is_dir() && name.to_string_lossy().starts_with("checkpoint-") {
                    std::fs::rename(e.path(), staging.join(&name)).map_err(|err| io(&e.path(), err))?;
                    kept.push(name);
                }
            }
        }
        let give_back = |kept: &[std::ffi::OsString]| {
            for name in kept {
                let _ = std::fs::rename(staging.join(name), dir.join(name));
            }
        };
        if dir.exists() {
            if let Err(e) = std::fs::rename(dir, &old) {
                give_back(&kept);
                return Err(io(dir, e));
            }
        }
        if let Err(e) = std::fs::rename(&staging, dir) {
            let _ = std::fs::rename(&old, dir);
            give_back(&kept);
            return Err(io(dir, e));
        }
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result
}

/// A safetensors file of `tensors` (F32 on the host), as bytes.
pub(crate) fn safetensors_bytes(tensors: &HashMap<String, Tensor>) -> Result<Vec<u8>> {
    let tmp =
        std::env::temp_dir().join(format!("candle-maxsim-colbert-{}-{}.safetensors", std::process::id(), unique()));
    candle_core::safetensors::save(tensors, &tmp)?;
    let bytes = std::fs::read(&tmp).map_err(|e| Error::Msg(format!("{}: {e}", tmp.display())))?;
    let _ = std::fs::remove_file(&tmp);
    Ok(bytes)
}

fn unique() -> usize {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}
