//! Acknowledged writes survive a SIGKILL: the real binary serves an index,
//! adds and deletes documents, and is killed right after each
//! acknowledgement; restarted, it has every acknowledged write (index and
//! metadata alike).

mod support;

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use support::*;

/// Starts the binary on `dir/index` on a free port; returns it and its URL.
fn start(dir: &Path) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_candle-maxsim-serve"))
        .args(["--index", dir.join("index").to_str().unwrap(), "--port", "0", "--batch-window-ms", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in `{line}`"))
        .to_string();
    (child, url)
}

fn kill(mut child: Child) {
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
}

fn post(url: &str, path: &str, body: Value) -> Value {
    let (status, res) = request("POST", &format!("{url}{path}"), Some(&body.to_string()), &[]);
    assert_eq!(status, 200, "{path}: {res}");
    res
}

#[test]
fn acknowledged_writes_survive_sigkill() {
    let dir = tmpdir("crash");
    let docs = random_docs(80, DIM);
    drop(build_index(&dir, &docs));
    let new = random_docs(3, DIM);
    // Each round: one write, acknowledged, then SIGKILL at once.
    let (child, url) = start(&dir);
    let res = post(&url, "/documents", json!({"embeddings": [new[0], new[1]], "metadata": [{"k": "a"}, {"k": "b"}]}));
    assert_eq!(res["ids"], json!([80, 81]));
    kill(child);
    let (child, url) = start(&dir);
    post(&url, "/documents/delete", json!({"ids": [3, 80]}));
    kill(child);
    let (child, url) = start(&dir);
    let res = post(&url, "/documents", json!({"embeddings": [new[2]], "metadata": [{"k": "c"}]}));
    assert_eq!(res["ids"], json!([82]));
    kill(child);

    // Restarted: every write is there.
    let (child, url) = start(&dir);
    let (_, stats) = request("GET", &format!("{url}/stats"), None, &[]);
    assert_eq!(stats["documents"], 83, "{stats}");
    assert_eq!(stats["live_documents"], 81);
    let qs = json!({"embeddings": [docs[3], new[0], new[1], new[2]], "top_k": 10});
    let res = post(&url, "/search", qs);
    let ids = |q: usize| hits(&res, q).iter().map(|h| h.0).collect::<Vec<_>>();
    assert!(!ids(0).contains(&3) && !ids(1).contains(&80), "deleted ids returned: {:?} {:?}", ids(0), ids(1));
    assert_eq!(ids(2)[0], 81);
    assert_eq!(res["results"][2][0]["metadata"], json!({"k": "b"}));
    assert_eq!(ids(3)[0], 82);
    assert_eq!(res["results"][3][0]["metadata"], json!({"k": "c"}));
    // The metadata agrees: no row for the deleted ids.
    let f = json!({"embeddings": [new[0]], "filter": {"where": "k IS NOT NULL"}, "top_k": 10});
    let res = post(&url, "/search", f);
    let mut got = hits(&res, 0).iter().map(|h| h.0).collect::<Vec<_>>();
    got.sort_unstable();
    assert_eq!(got, vec![81, 82]);
    kill(child);
    let _ = std::fs::remove_dir_all(&dir);
}
