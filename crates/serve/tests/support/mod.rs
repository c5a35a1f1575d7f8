//! A small random index built on the CPU, the service started on it on a
//! free loopback port, and a blocking HTTP client for the tests.
#![allow(dead_code)]

use candle_core::{Device, Tensor};
use candle_maxsim_plaid::{create, IndexConfig, PackedDocuments, PlaidIndex};
use candle_maxsim_serve::{Config, Metadata, Service};
use serde_json::Value;
use std::path::{Path, PathBuf};

pub const DIM: usize = 32;

pub use candle_maxsim_testing::tmpdir;

/// `n` random documents of 4 to 16 unit token vectors of dim `dim` (fresh
/// random values each run): per document, its rows.
pub fn random_docs(n: usize, dim: usize) -> Vec<Vec<Vec<f32>>> {
    use rand::Rng;
    let mut rng = rand::rng();
    (0..n)
        .map(|_| {
            let len = rng.random_range(4..=16);
            (0..len)
                .map(|_| {
                    let v: Vec<f32> = (0..dim).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
                    v.into_iter().map(|x| x / norm).collect()
                })
                .collect()
        })
        .collect()
}

/// The documents packed as the index takes them.
pub fn packed(docs: &[Vec<Vec<f32>>]) -> PackedDocuments {
    let lens: Vec<u32> = docs.iter().map(|d| d.len() as u32).collect();
    let flat: Vec<f32> = docs.iter().flatten().flatten().copied().collect();
    let dim = docs[0][0].len();
    let x = Tensor::from_vec(flat, (lens.iter().sum::<u32>() as usize, dim), &Device::Cpu).unwrap();
    PackedDocuments::new(x, &lens).unwrap()
}

/// An index of `docs` in `dir/index` (32 centroids, 4 bits).
pub fn build_index(dir: &Path, docs: &[Vec<Vec<f32>>]) -> PlaidIndex {
    let config = IndexConfig { n_centroids: Some(32), ..Default::default() };
    create(dir.join("index"), &packed(docs), &config, &Device::Cpu).unwrap()
}

/// A running service and its base URL.
pub struct Server {
    pub url: String,
    pub service: Service,
    pub dir: PathBuf,
}

impl Server {
    /// Builds an index of `n` random documents in a fresh directory and
    /// serves it with `config`; returns the server and the documents.
    pub fn start(name: &str, n: usize, config: Config) -> (Server, Vec<Vec<Vec<f32>>>) {
        let dir = tmpdir(name);
        let docs = random_docs(n, DIM);
        let index = build_index(&dir, &docs);
        (Self::serve(dir, index, None, config), docs)
    }

    /// Serves `index` (its metadata in `dir/meta.sqlite`) on a free port.
    pub fn serve(
        dir: PathBuf,
        index: PlaidIndex,
        model: Option<candle_maxsim_colbert::ColBert>,
        config: Config,
    ) -> Server {
        let meta = Metadata::open(dir.join("meta.sqlite"), config.filter_timeout).unwrap();
        let service = Service::new(index, model, meta, config).unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let svc = service.clone();
        std::thread::spawn(move || candle_maxsim_serve::serve_blocking(listener, svc));
        Server { url, service, dir }
    }

    /// The index as the library opens it from disk now.
    pub fn reopen(&self) -> PlaidIndex {
        PlaidIndex::load(self.dir.join("index"), &Device::Cpu).unwrap()
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        request("POST", &format!("{}{path}", self.url), Some(&body.to_string()), &[])
    }

    pub fn get(&self, path: &str) -> (u16, Value) {
        request("GET", &format!("{}{path}", self.url), None, &[])
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One HTTP request: `(status, body as JSON, or as a JSON string when it is not JSON)`.
pub fn request(method: &str, url: &str, body: Option<&str>, headers: &[(&str, &str)]) -> (u16, Value) {
    let (status, text) = request_text(method, url, body, headers);
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, v)
}

/// One HTTP request: `(status, body text)`.
pub fn request_text(method: &str, url: &str, body: Option<&str>, headers: &[(&str, &str)]) -> (u16, String) {
    let mut req = ureq::request(method, url).timeout(std::time::Duration::from_secs(120));
    for (k, v) in headers {
        req = req.set(k, v);
    }
    let res = match body {
        Some(b) => req.set("content-type", "application/json").send_string(b),
        None => req.call(),
    };
    match res {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
        Err(e) => panic!("{method} {url}: {e}"),
    }
}

/// The hits of one query in a `/search` response: `(id, score)`.
pub fn hits(results: &Value, q: usize) -> Vec<(u32, f32)> {
    results["results"][q]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| (h["id"].as_u64().unwrap() as u32, h["score"].as_f64().unwrap() as f32))
        .collect()
}

/// Queries `[Nq][Lq][dim]` as one zero-padded `[Nq, Lmax, dim]` tensor (the
/// service's batch layout).
pub fn padded(queries: &[Vec<Vec<f32>>]) -> Tensor {
    let lmax = queries.iter().map(|q| q.len()).max().unwrap();
    let dim = queries[0][0].len();
    let mut data = vec![0f32; queries.len() * lmax * dim];
    for (i, q) in queries.iter().enumerate() {
        for (j, row) in q.iter().enumerate() {
            data[(i * lmax + j) * dim..(i * lmax + j + 1) * dim].copy_from_slice(row);
        }
    }
    Tensor::from_vec(data, (queries.len(), lmax, dim), &Device::Cpu).unwrap()
}

/// Asserts two result lists equal: the same ids, scores within `1e-4`.
pub fn assert_same(what: &str, got: &[(u32, f32)], want: &[(u32, f32)]) {
    let ids = |r: &[(u32, f32)]| r.iter().map(|h| h.0).collect::<Vec<_>>();
    assert_eq!(ids(got), ids(want), "{what}: ids");
    for (g, w) in got.iter().zip(want) {
        assert!((g.1 - w.1).abs() <= 1e-4 * w.1.abs().max(1.0), "{what}: score of {} {} vs {}", g.0, g.1, w.1);
    }
}

/// Asserts `(status, body)` is an error of `status` whose message contains `text`.
pub fn assert_error(what: &str, got: &(u16, Value), status: u16, text: &str) {
    assert_eq!(got.0, status, "{what}: status (body {})", got.1);
    let msg = got.1["error"].as_str().unwrap_or_else(|| panic!("{what}: no error message in {}", got.1));
    assert!(msg.contains(text), "{what}: `{msg}` lacks `{text}`");
}
