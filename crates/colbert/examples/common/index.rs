//! The colbert example's `--index DIR`: a PLAID index of `--docs` and, next
//! to it, `built_from.json`, the record of what it was built from (the
//! documents' SHA-256 and count, the model, its dim). The index holds only
//! embeddings and ids: without the record, a run with other documents of the
//! same count would print their texts next to the indexed ones' scores.

use anyhow::{anyhow, bail, Context, Result};
use candle_core::Device;
use candle_maxsim_plaid::{create, Documents, DocumentsWriter, IndexConfig, PlaidIndex};
use std::io::{ErrorKind, Write};
use std::path::Path;

/// The record's file name in the index directory.
pub const RECORD: &str = "built_from.json";

const HINT: &str = "pass --rebuild to rebuild it from --docs, or another --index directory";

/// What an index was built from.
#[derive(Clone, Debug, PartialEq)]
pub struct BuiltFrom {
    /// The documents file as given (for messages).
    pub docs: String,
    /// [`docs_sha256`] of its documents.
    pub docs_sha256: String,
    pub num_documents: usize,
    /// The model directory, canonical.
    pub model: String,
    /// The embeddings' dimension.
    pub dim: usize,
}

impl BuiltFrom {
    pub fn new(docs_file: &Path, docs: &[String], model_dir: &Path, dim: usize) -> Self {
        let model = std::fs::canonicalize(model_dir).unwrap_or_else(|_| model_dir.to_path_buf());
        Self {
            docs: docs_file.display().to_string(),
            docs_sha256: docs_sha256(docs),
            num_documents: docs.len(),
            model: model.display().to_string(),
            dim,
        }
    }

    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "docs": self.docs, "docs_sha256": self.docs_sha256, "num_documents": self.num_documents,
            "model": self.model, "dim": self.dim,
        })
    }

    fn from_json(v: &serde_json::Value) -> Option<Self> {
        let s = |k: &str| v.get(k)?.as_str().map(str::to_string);
        let n = |k: &str| v.get(k)?.as_u64().map(|x| x as usize);
        Some(Self {
            docs: s("docs")?,
            docs_sha256: s("docs_sha256")?,
            num_documents: n("num_documents")?,
            model: s("model")?,
            dim: n("dim")?,
        })
    }
}

/// SHA-256 of the documents, each followed by a newline: the file's own
/// SHA-256 (`sha256sum`) when it has no blank lines nor surrounding spaces.
pub fn docs_sha256(docs: &[String]) -> String {
    let mut bytes = Vec::with_capacity(docs.iter().map(|d| d.len() + 1).sum());
    for d in docs {
        bytes.extend_from_slice(d.as_bytes());
        bytes.push(b'\n');
    }
    sha256_hex(&bytes)
}

/// Whether `--index DIR` holds an index: `Ok(false)` where one can be built
/// (absent, or an empty directory), an error naming the flag where it is
/// neither (a file, a directory of other files: never overwritten).
pub fn holds_index(dir: &Path) -> Result<bool> {
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
        Err(e) => bail!("--index {}: {e}", dir.display()),
    };
    if !meta.is_dir() {
        bail!(
            "--index {}: is a file, not an index directory; pass a directory (a new or empty one is built into)",
            dir.display()
        )
    }
    if dir.join("metadata.json").is_file() {
        return Ok(true);
    }
    let empty = std::fs::read_dir(dir).with_context(|| format!("--index {}", dir.display()))?.next().is_none();
    if !empty {
        bail!(
            "--index {}: is a directory of other files, not an index (no metadata.json); \
             pass a new or empty directory to build an index in",
            dir.display()
        )
    }
    Ok(false)
}

/// The record in `dir`, `None` where there is none.
pub fn read_record(dir: &Path) -> Result<Option<BuiltFrom>> {
    let path = dir.join(RECORD);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("--index: cannot read {}", path.display())),
    };
    let record = serde_json::from_str(&text).ok().and_then(|v| BuiltFrom::from_json(&v));
    record
        .map(Some)
        .ok_or_else(|| anyhow!("--index {}: {} is not a valid record; {HINT}", dir.display(), path.display()))
}

/// Writes the record into `dir` atomically (a temporary file renamed over it):
/// a crash leaves the old record or the new one, never half of one.
pub fn write_record(dir: &Path, record: &BuiltFrom) -> Result<()> {
    let path = dir.join(RECORD);
    let tmp = dir.join(format!(".{RECORD}.tmp-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(serde_json::to_string_pretty(&record.to_json())?.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    write()
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
        .with_context(|| format!("--index: cannot write {}", path.display()))
}

/// Why an index built from `found` cannot serve a run with `want`; `None` when it can.
pub fn mismatch(found: &BuiltFrom, want: &BuiltFrom) -> Option<String> {
    let mut why = Vec::new();
    if found.dim != want.dim {
        why.push(format!("the model and the index disagree: model dim {} vs index dim {}", want.dim, found.dim));
    }
    if found.model != want.model {
        why.push(format!("it was built with the model {}, this run uses {}", found.model, want.model));
    }
    if (&found.docs_sha256, found.num_documents) != (&want.docs_sha256, want.num_documents) {
        let short = |h: &str| h.chars().take(12).collect::<String>();
        why.push(format!(
            "it was built from other documents ({}: {} documents, sha256 {}), not those of --docs {} ({} documents, sha256 {})",
            found.docs,
            found.num_documents,
            short(&found.docs_sha256),
            want.docs,
            want.num_documents,
            short(&want.docs_sha256)
        ));
    }
    (!why.is_empty()).then(|| why.join("; "))
}

/// The index in `dir` for the documents and model of `want`: opened when its
/// record matches; built from `encode()`'s `(embeddings [T, dim], lengths)`
/// where `dir` holds none, or with `rebuild`; refused otherwise. Also
/// returns whether it was built.
pub fn open_or_build(
    dir: &Path,
    want: &BuiltFrom,
    rebuild: bool,
    config: &IndexConfig,
    device: &Device,
    encode: impl FnOnce(&mut DocumentsWriter) -> Result<()>,
) -> Result<(PlaidIndex, bool)> {
    let at = || format!("--index {}", dir.display());
    if holds_index(dir)? && !rebuild {
        let Some(found) = read_record(dir)? else {
            bail!(
                "{}: the index there has no {RECORD}, the record of the documents and model it was built from \
                 (its build was interrupted, or another program built it); {HINT}",
                at()
            )
        };
        if let Some(why) = mismatch(&found, want) {
            bail!("{}: {why}; {HINT}", at())
        }
        let index = PlaidIndex::load(dir, device).with_context(at)?;
        // The record says what the index was meant to hold; check what its files hold.
        if index.dim() != want.dim {
            bail!(
                "{}: the model and the index disagree: model dim {} vs index dim {}; {HINT}",
                at(),
                want.dim,
                index.dim()
            )
        }
        if index.num_documents() != want.num_documents {
            bail!("{}: holds {} documents, --docs has {}; {HINT}", at(), index.num_documents(), want.num_documents)
        }
        return Ok((index, false));
    }
    // The documents are encoded batch by batch into a file beside the
    // index (never all in memory), which the build then reads.
    let name = dir.file_name().map_or("index".into(), |n| n.to_string_lossy().into_owned());
    let spool = dir.parent().unwrap_or(Path::new(".")).join(format!(".{name}.documents.npy"));
    let mut writer = DocumentsWriter::create(&spool, want.dim).with_context(at)?;
    let encoded = encode(&mut writer);
    let docs = encoded.and_then(|()| Ok(writer.finish()?));
    let docs = match docs {
        Ok(d) if d.len() == want.num_documents => d,
        Ok(d) => {
            let _ = std::fs::remove_file(&spool);
            bail!("{}: encoded {} documents, expected {}", at(), d.len(), want.num_documents)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&spool);
            return Err(e).with_context(at);
        }
    };
    // The old record goes before the index is replaced: an index left without
    // one (a failed build) is refused, never taken for the one recorded.
    match std::fs::remove_file(dir.join(RECORD)) {
        Err(e) if e.kind() != ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("--index: cannot remove {}", dir.join(RECORD).display()))
        }
        _ => {}
    }
    let index = create(dir, &docs, config, device).with_context(at);
    drop(docs);
    let _ = std::fs::remove_file(&spool);
    let index = index?;
    write_record(dir, want)?;
    Ok((index, true))
}

/// SHA-256 (FIPS 180-4) of `data` in lowercase hex: a stable content hash
/// for the record, without a hashing crate among the dependencies.
pub fn sha256_hex(data: &[u8]) -> String {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
        0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
        0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
        0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
        0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
        0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
        0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] =
        [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];
    let mut compress = |block: &[u8]| {
        let mut w = [0u32; 64];
        for (wi, b) in w.iter_mut().zip(block.chunks_exact(4)) {
            *wi = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16].wrapping_add(s0).wrapping_add(w[i - 7]).wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for (k, wi) in K.iter().zip(w) {
            let t1 = hh
                .wrapping_add(e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25))
                .wrapping_add((e & f) ^ (!e & g))
                .wrapping_add(*k)
                .wrapping_add(wi);
            let t2 =
                (a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22)).wrapping_add((a & b) ^ (a & c) ^ (b & c));
            (hh, g, f, e, d, c, b, a) = (g, f, e, d.wrapping_add(t1), c, b, a, t1.wrapping_add(t2));
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    };
    let mut blocks = data.chunks_exact(64);
    for block in &mut blocks {
        compress(block);
    }
    // The tail, a 1 bit, zeros, and the length in bits: one or two blocks.
    let mut tail = blocks.remainder().to_vec();
    tail.push(0x80);
    tail.resize(if tail.len() <= 56 { 56 } else { 120 }, 0);
    tail.extend_from_slice(&(data.len() as u64 * 8).to_be_bytes());
    for block in tail.chunks_exact(64) {
        compress(block);
    }
    h.iter().map(|x| format!("{x:08x}")).collect()
}
