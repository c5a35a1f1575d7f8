//! The HTTP API (axum): routes, the JSON body extractor, the API key
//! check and the request metrics.

use crate::error::{Error, Result};
use crate::{AddRequest, SearchRequest, Service};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{header, Method};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::future::Future;
use std::time::Instant;

/// The OpenAPI 3 description of the endpoints.
const OPENAPI: &str = include_str!("openapi.json");

/// A JSON body: any content type, errors as `{"error": ...}` naming the
/// field at fault (400), or the size limit (413).
struct Body<T>(T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Body<T> {
    type Rejection = Error;

    async fn from_request(req: Request, state: &S) -> Result<Self> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|r| Error { status: r.status().as_u16(), message: format!("body: {}", r.body_text()) })?;
        // Objects only (serde would also take a struct's fields as an array).
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(Error::bad_request("body: must be a JSON object"));
        }
        // Parsed without tracking the path first (path tracking costs ~15 %
        // of parsing a body of embeddings); a body that fails is parsed
        // again with it, for a message naming the field.
        if let Ok(value) = serde_json::from_slice::<T>(&bytes) {
            return Ok(Body(value));
        }
        let mut de = serde_json::Deserializer::from_slice(&bytes);
        let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            if e.inner().is_syntax() || e.inner().is_eof() {
                return Error::bad_request(format!("body: malformed JSON: {}", e.inner()));
            }
            let path = e.path().to_string();
            let field = if path == "." { "body".to_string() } else { path };
            Error::bad_request(format!("{field}: {}", e.inner()))
        })?;
        de.end().map_err(|e| Error::bad_request(format!("body: {e}")))?;
        Ok(Body(value))
    }
}

/// `{"ids": [...]}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Ids {
    ids: Vec<u32>,
}

fn json(value: serde_json::Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], value.to_string()).into_response()
}

async fn search(State(svc): State<Service>, Body(req): Body<SearchRequest>) -> Result<Response> {
    let results = svc.search(req).await?;
    Ok(json(serde_json::json!({ "results": results })))
}

async fn add(State(svc): State<Service>, Body(req): Body<AddRequest>) -> Result<Response> {
    let ids = svc.add(req).await?;
    Ok(json(serde_json::json!({ "ids": ids })))
}

async fn delete(State(svc): State<Service>, Body(req): Body<Ids>) -> Result<Response> {
    let n = svc.delete(req.ids).await?;
    Ok(json(serde_json::json!({ "deleted": n })))
}

async fn compact(State(svc): State<Service>) -> Result<Response> {
    svc.compact().await?;
    Ok(json(serde_json::json!({ "compacted": true })))
}

async fn stats(State(svc): State<Service>) -> Result<Response> {
    Ok(json(svc.stats()?))
}

async fn health() -> Response {
    json(serde_json::json!({ "status": "ok" }))
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

async fn metrics(State(svc): State<Service>) -> Response {
    let mut extra: Vec<(&str, &str, f64)> = Vec::new();
    let gpu = gpu_memory(&svc);
    if let Some((free, total)) = gpu {
        extra.push((
            "maxsim_gpu_memory_used_bytes",
            "Device memory in use on the index's GPU.",
            total.saturating_sub(free) as f64,
        ));
        extra.push(("maxsim_gpu_memory_total_bytes", "Device memory of the index's GPU.", total as f64));
    }
    let text = svc.inner().metrics.render(&extra);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// `(free, total)` bytes of the index's GPU, where it is on one.
#[cfg(feature = "cuda")]
fn gpu_memory(svc: &Service) -> Option<(usize, usize)> {
    let index = svc.inner().index.read().unwrap_or_else(|e| e.into_inner());
    let candle_core::Device::Cuda(d) = index.device() else { return None };
    let stream = d.cuda_stream();
    // Binds the context to this (tokio worker) thread before asking.
    stream.context().mem_get_info().ok()
}

#[cfg(not(feature = "cuda"))]
fn gpu_memory(_: &Service) -> Option<(usize, usize)> {
    None
}

async fn not_found() -> Error {
    Error { status: 404, message: "path: no such endpoint (see GET /openapi.json)".into() }
}

/// Whether a request to `path` changes the index.
fn is_write(path: &str) -> bool {
    path.starts_with("/documents") || path == "/compact"
}

/// The API key check: writes need it when one is set, reads too with
/// `protect_reads` (never `/health`).
async fn auth(State(svc): State<Service>, req: Request, next: Next) -> Response {
    let cfg = svc.config();
    if let Some(key) = &cfg.api_key {
        let path = req.uri().path();
        let needs = is_write(path) || (cfg.protect_reads && path != "/health");
        if needs {
            let h = req.headers();
            let given = h
                .get("x-api-key")
                .and_then(|v| v.to_str().ok())
                .or_else(|| h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok())?.strip_prefix("Bearer "));
            let ok = given.is_some_and(|g| constant_time_eq(g.trim().as_bytes(), key.as_bytes()));
            if !ok {
                let message = match given {
                    None => "x-api-key: missing (or send Authorization: Bearer KEY)",
                    Some(_) => "x-api-key: wrong key",
                };
                let mut r = Error { status: 401, message: message.into() }.into_response();
                r.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
                // Read the body (within the body limit) before answering: a
                // reply sent while the client still writes makes the server
                // close the connection under it, and the client sees a broken
                // pipe instead of the 401.
                let _ = axum::body::to_bytes(req.into_body(), cfg.max_body_bytes).await;
                return r;
            }
        }
    }
    next.run(req).await
}

/// Compares without stopping at the first difference (no timing hint).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The routes, as labelled in the metrics.
const ROUTES: &[&str] =
    &["/search", "/documents", "/documents/delete", "/compact", "/stats", "/health", "/metrics", "/openapi.json"];

/// Counts every request by route and status, and its latency.
async fn track(State(svc): State<Service>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = match *req.method() {
        Method::GET | Method::POST | Method::DELETE | Method::PUT | Method::HEAD => req.method().as_str(),
        _ => "other",
    }
    .to_string();
    // Known routes by name; anything else under one label (bounded cardinality).
    let route = ROUTES.iter().find(|r| **r == req.uri().path()).copied().unwrap_or("unmatched").to_string();
    let resp = next.run(req).await;
    svc.inner().metrics.request(&method, &route, resp.status().as_u16(), started.elapsed().as_secs_f64());
    resp
}

/// The routes of `svc` (its batcher started on the current runtime):
/// `POST /search`, `POST /documents`, `DELETE /documents`,
/// `POST /documents/delete`, `POST /compact`, `GET /stats`, `GET /health`,
/// `GET /metrics`, `GET /openapi.json`.
pub fn router(svc: Service) -> Result<Router> {
    svc.start()?;
    let limit = svc.config().max_body_bytes;
    Ok(Router::new()
        .route("/search", post(search))
        .route("/documents", post(add).delete(delete))
        .route("/documents/delete", post(delete))
        .route("/compact", post(compact))
        .route("/stats", get(stats))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .fallback(not_found)
        .method_not_allowed_fallback(|| async {
            Error { status: 405, message: "method: not allowed on this path (see GET /openapi.json)".into() }
        })
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(svc.clone(), auth))
        // Outermost: the 401s of `auth` are counted too.
        .layer(middleware::from_fn_with_state(svc.clone(), track))
        .with_state(svc))
}

/// Serves `svc` on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, svc: Service) -> std::io::Result<()> {
    serve_with_shutdown(listener, svc, std::future::pending()).await
}

/// Serves `svc` on a std `listener` from the calling thread, on a runtime
/// of its own, until the process ends (for callers without a runtime).
pub fn serve_blocking(listener: std::net::TcpListener, svc: Service) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move { serve(tokio::net::TcpListener::from_std(listener)?, svc).await })
}

/// Serves `svc` on `listener` until `shutdown` completes, then finishes
/// the requests in flight.
pub async fn serve_with_shutdown(
    listener: tokio::net::TcpListener,
    svc: Service,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    let app = router(svc).map_err(std::io::Error::other)?;
    // Replies go out at once: with Nagle's algorithm a small response waits
    // for the client's delayed ACK (~40 ms on Linux).
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}
