//! An index split into shards, each a complete index directory opened on
//! its own device (a GPU or the CPU), searched together: the queries go to
//! every shard, each runs the whole PLAID pipeline on its documents, and the
//! results are merged on the host. Shards share one codec, trained on the
//! whole collection, so their scores are comparable.

use crate::create::{progress, train, write_index, IndexConfig};
use crate::documents::Documents;
use crate::index::PlaidIndex;
use crate::search::{SearchParams, SearchResults, Subset};
use crate::store::{read_json, write_json};
use candle_core::{bail, Device, Error, Result, Tensor};
use std::path::Path;

/// The shards' list in a sharded index directory.
const SHARDS: &str = "shards.json";

/// Documents `start..start + len` of another collection.
struct Slice<'a> {
    docs: &'a dyn Documents,
    start: usize,
    len: usize,
}

impl Documents for Slice<'_> {
    fn len(&self) -> usize {
        self.len
    }
    fn dim(&self) -> usize {
        self.docs.dim()
    }
    fn doc_len(&self, i: usize) -> usize {
        self.docs.doc_len(self.start + i)
    }
    fn embeddings(&self, ids: &[u32]) -> Result<Tensor> {
        let ids: Vec<u32> = ids.iter().map(|&i| i + self.start as u32).collect();
        self.docs.embeddings(&ids)
    }
}

/// Shards on their devices; shard `s` holds the global ids `first[s]..`.
pub struct ShardedIndex {
    shards: Vec<PlaidIndex>,
    first: Vec<u32>,
}

impl ShardedIndex {
    /// Builds `docs` into `devices.len()` shards under `dir` (`shard_{s}/`,
    /// contiguous ranges of documents, one codec trained on `devices[0]`)
    /// and opens shard `s` on `devices[s]`.
    pub fn create(
        dir: impl AsRef<Path>,
        docs: &dyn Documents,
        config: &IndexConfig,
        devices: &[Device],
    ) -> Result<Self> {
        let dir = dir.as_ref();
        if devices.is_empty() {
            bail!("devices: at least one device (one shard each)")
        }
        let n = docs.len();
        let bar = progress(config.show_progress, n as u64, "sampling");
        let c = train(docs, config, &devices[0], &bar)?;
        std::fs::create_dir_all(dir).map_err(|e| crate::store::io_err(dir, "create", e))?;
        let per = n.div_ceil(devices.len());
        let mut list = Vec::new();
        for s in 0..devices.len() {
            let (start, len) = ((s * per).min(n), per.min(n.saturating_sub(s * per)));
            if len == 0 {
                bail!("devices: {} shards for {n} documents leave shard {s} empty", devices.len())
            }
            let name = format!("shard_{s}");
            write_index(&dir.join(&name), &Slice { docs, start, len }, &c, config.chunk_documents, &bar)?;
            list.push(serde_json::json!({"dir": name, "first_id": start, "num_documents": len}));
        }
        write_json(&dir.join(SHARDS), &serde_json::json!({ "shards": list }))?;
        bar.finish_and_clear();
        Self::load(dir, devices)
    }

    /// Opens the shards of `dir` (its `shards.json`), shard `s` on `devices[s]`.
    pub fn load(dir: impl AsRef<Path>, devices: &[Device]) -> Result<Self> {
        Self::load_budgeted(dir.as_ref(), devices, None)
    }

    /// [`Self::load`], each shard within `device_bytes` of its device's
    /// memory ([`PlaidIndex::load_with_device_budget`]).
    pub fn load_with_device_budget(dir: impl AsRef<Path>, devices: &[Device], device_bytes: usize) -> Result<Self> {
        Self::load_budgeted(dir.as_ref(), devices, Some(device_bytes))
    }

    fn load_budgeted(dir: &Path, devices: &[Device], budget: Option<usize>) -> Result<Self> {
        let path = dir.join(SHARDS);
        let meta = read_json(&path)?;
        let list = meta["shards"]
            .as_array()
            .ok_or_else(|| Error::Msg(format!("dir: {} has no `shards` list", path.display())))?;
        if list.len() != devices.len() {
            bail!("devices: {} devices for the {} shards of {}", devices.len(), list.len(), dir.display())
        }
        let (mut shards, mut first) = (Vec::new(), Vec::new());
        let mut next = 0u64;
        for (s, (entry, dev)) in list.iter().zip(devices).enumerate() {
            let (name, f) = (entry["dir"].as_str(), entry["first_id"].as_u64());
            let (Some(name), Some(f)) = (name, f) else {
                bail!("dir: {}: shard {s} needs `dir` and `first_id`", path.display())
            };
            if f != next {
                bail!("dir: {}: shard {s} starts at id {f}, the shards before it end at {next}", path.display())
            }
            let idx = match budget {
                None => PlaidIndex::load(dir.join(name), dev)?,
                Some(b) => PlaidIndex::load_with_device_budget(dir.join(name), dev, b)?,
            };
            next += idx.num_documents() as u64;
            first.push(f as u32);
            shards.push(idx);
        }
        Ok(Self { shards, first })
    }

    /// The shards, in id order.
    pub fn shards(&self) -> &[PlaidIndex] {
        &self.shards
    }

    /// Documents in all shards.
    pub fn num_documents(&self) -> usize {
        self.shards.iter().map(PlaidIndex::num_documents).sum()
    }

    /// [`PlaidIndex::search`] on every shard (the queries copied to each
    /// shard's device), merged: per query the best `top_k` over all shards,
    /// equal scores lower global id first. Subsets hold global ids.
    pub fn search(&self, q: &Tensor, params: &SearchParams, subset: Option<Subset>) -> Result<SearchResults> {
        let nq = q.dim(0)?;
        let mut merged: SearchResults = vec![Vec::new(); nq];
        for (idx, &first) in self.shards.iter().zip(&self.first) {
            let end = first + idx.num_documents() as u32;
            let local = |ids: &[u32]| -> Vec<u32> {
                ids.iter().filter(|&&d| d >= first && d < end).map(|&d| d - first).collect()
            };
            let (shared, per): (Option<Vec<u32>>, Option<Vec<Vec<u32>>>) = match subset {
                Some(Subset::Shared(s)) => (Some(local(s)), None),
                Some(Subset::PerQuery(s)) => (None, Some(s.iter().map(|l| local(l)).collect())),
                None => (None, None),
            };
            let sub = match (&shared, &per) {
                (Some(s), _) => Some(Subset::Shared(s)),
                (_, Some(p)) => Some(Subset::PerQuery(p)),
                _ => None,
            };
            let res = idx.search(&q.to_device(idx.device())?, params, sub)?;
            for (m, r) in merged.iter_mut().zip(res) {
                m.extend(r.into_iter().map(|(d, s)| (d + first, s)));
            }
        }
        for m in &mut merged {
            m.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            m.truncate(params.top_k);
        }
        Ok(merged)
    }
}
