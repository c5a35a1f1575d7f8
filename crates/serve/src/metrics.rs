//! Counters and histograms for `GET /metrics`, in Prometheus' text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

/// Request latency bucket bounds, seconds.
const LATENCY_BOUNDS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
/// Queries per index search call.
const BATCH_BOUNDS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0];

#[derive(Clone, Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// Per bound, observations `<=` it (not cumulative; summed when rendered).
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}", self.count);
        let braces = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

#[derive(Debug)]
struct State {
    requests: BTreeMap<(String, String, u16), u64>,
    latency: BTreeMap<String, Histogram>,
    batch: Histogram,
    batch_seconds: Histogram,
    search_seconds: Histogram,
}

/// The service's metrics.
#[derive(Debug)]
pub(crate) struct Metrics {
    state: Mutex<State>,
}

impl Metrics {
    pub fn new() -> Self {
        Self {
            state: Mutex::new(State {
                requests: BTreeMap::new(),
                latency: BTreeMap::new(),
                batch: Histogram::new(BATCH_BOUNDS),
                batch_seconds: Histogram::new(LATENCY_BOUNDS),
                search_seconds: Histogram::new(LATENCY_BOUNDS),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic elsewhere while holding the lock leaves counters only: keep them.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One request to route `endpoint` (`method` as sent) answered `status` after `seconds`.
    pub fn request(&self, method: &str, endpoint: &str, status: u16, seconds: f64) {
        let mut s = self.lock();
        *s.requests.entry((method.to_string(), endpoint.to_string(), status)).or_insert(0) += 1;
        s.latency.entry(endpoint.to_string()).or_insert_with(|| Histogram::new(LATENCY_BOUNDS)).observe(seconds);
    }

    /// One batch's index search of `queries` queries that took `seconds`
    /// from the queries' copy in to the results out, `search` of it in the
    /// index.
    pub fn batch(&self, queries: usize, seconds: f64, search: f64) {
        let mut s = self.lock();
        s.batch.observe(queries as f64);
        s.batch_seconds.observe(seconds);
        s.search_seconds.observe(search);
    }

    /// The text exposition, `extra` (gauges) appended.
    pub fn render(&self, extra: &[(&str, &str, f64)]) -> String {
        let s = self.lock();
        let mut out = String::new();
        out.push_str("# HELP maxsim_requests_total HTTP requests by route, method and status.\n");
        out.push_str("# TYPE maxsim_requests_total counter\n");
        for ((method, endpoint, status), n) in &s.requests {
            let _ = writeln!(
                out,
                "maxsim_requests_total{{endpoint=\"{}\",method=\"{}\",status=\"{status}\"}} {n}",
                escape(endpoint),
                escape(method)
            );
        }
        out.push_str("# HELP maxsim_request_duration_seconds Time from request to response, by route.\n");
        out.push_str("# TYPE maxsim_request_duration_seconds histogram\n");
        for (endpoint, h) in &s.latency {
            h.render(&mut out, "maxsim_request_duration_seconds", &format!("endpoint=\"{}\"", escape(endpoint)));
        }
        out.push_str("# HELP maxsim_search_batch_queries Queries per index search call (dynamic batching).\n");
        out.push_str("# TYPE maxsim_search_batch_queries histogram\n");
        s.batch.render(&mut out, "maxsim_search_batch_queries", "");
        out.push_str(
            "# HELP maxsim_search_batch_seconds Time of each batch's index search, queries in and results out.\n",
        );
        out.push_str("# TYPE maxsim_search_batch_seconds histogram\n");
        s.batch_seconds.render(&mut out, "maxsim_search_batch_seconds", "");
        out.push_str("# HELP maxsim_search_index_seconds The index search part of each batch.\n");
        out.push_str("# TYPE maxsim_search_index_seconds histogram\n");
        s.search_seconds.render(&mut out, "maxsim_search_index_seconds", "");
        for (name, help, v) in extra {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        out
    }
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}
