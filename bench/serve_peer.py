#!/usr/bin/env python3
"""fast-plaid behind the search service's API, for load tests with the same
client (bench/serve_load.py): `POST /search` with `{"embeddings": [...]}`,
optional `top_k`, `n_ivf_probe`, `n_full_scores` and
`filter: {"where": ..., "params": [...]}`; with `--model DIR` also
`{"queries": ["text", ...]}`, encoded by Sentence Transformers 6's
`MultiVectorEncoder.encode_query` (the model in F16); `GET /health`,
`GET /stats`.

Python's standard library only (plus fast-plaid 1.7, torch and numpy):
`http.server.ThreadingHTTPServer` with HTTP/1.1 keep-alive, one thread per
connection, and one `FastPlaid.search` per request under a lock (the
engine is not shared between concurrent searches). Filters are evaluated as
the Rust service evaluates them: `SELECT _id FROM metadata WHERE (<where>)`
with the parameters bound, on a read-only SQLite connection (`--metadata`,
e.g. the database the Rust service keeps beside the index), passed to
fast-plaid as `subset`.

    python3 bench/serve_peer.py --index DIR [--device cuda:0] [--port 8081] [--metadata DB] [--model DIR]
"""

import argparse
import json
import sqlite3
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch

LOCK = threading.Lock()
STATE = {}
LOCAL = threading.local()


def metadata_conn():
    """A read-only connection of this thread (sqlite3 connections stay on their thread)."""
    if not STATE["metadata"]:
        raise ValueError("filter: this service was started without --metadata")
    if getattr(LOCAL, "conn", None) is None:
        LOCAL.conn = sqlite3.connect(f"file:{STATE['metadata']}?mode=ro", uri=True)
        LOCAL.conn.execute("PRAGMA query_only = ON")
    return LOCAL.conn


def search(req):
    texts = req.get("queries")
    if texts is not None and STATE["model"] is not None:
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("queries: a non-empty list of strings is needed")
        with LOCK:
            enc = STATE["model"].encode_query(texts, batch_size=len(texts))
        queries = [torch.as_tensor(q, device=STATE["device"]).float() for q in enc]
    else:
        emb = req.get("embeddings")
        if not isinstance(emb, list) or not emb:
            raise ValueError("embeddings: a non-empty [Nq][Lq][dim] list is needed")
        queries = [torch.tensor(np.asarray(q, dtype=np.float32), device=STATE["device"]) for q in emb]
    if any(q.ndim != 2 or q.shape[1] != STATE["dim"] for q in queries):
        raise ValueError(f"embeddings: each query must be [Lq][{STATE['dim']}]")
    subset = None
    f = req.get("filter")
    if f is not None:
        where = f.get("where", "")
        if ";" in where:
            raise ValueError("filter.where: `;` is not allowed")
        try:
            rows = metadata_conn().execute(f"SELECT _id FROM metadata WHERE ({where}\n)", f.get("params", []))
            subset = [int(r[0]) for r in rows]
        except sqlite3.Error as e:
            raise ValueError(f"filter.where: {e}") from e
        if not subset:  # fast-plaid reads an empty subset as "no subset"
            return [[] for _ in queries]
    kwargs = {"top_k": int(req.get("top_k", 10)), "show_progress": False}
    for k in ("n_ivf_probe", "n_full_scores"):
        if k in req:
            kwargs[k] = int(req[k])
    # Equal lengths: one tensor (fast-plaid's fastest path); else the list form.
    if len({q.shape[0] for q in queries}) == 1:
        q = torch.stack(queries)
    else:
        q = queries
    with LOCK:
        res = STATE["engine"].search(queries_embeddings=q, subset=subset, **kwargs)
    return [[{"id": int(i), "score": float(s)} for i, s in r] for r in res]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every response has a Content-Length

    def log_message(self, *args):
        pass

    def reply(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self.reply(200, {"status": "ok"})
        elif self.path == "/stats":
            self.reply(200, {"device": STATE["device"], "dim": STATE["dim"], "engine": "fast-plaid"})
        else:
            self.reply(404, {"error": "path: no such endpoint"})

    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        raw = self.rfile.read(length)
        if self.path != "/search":
            self.reply(404, {"error": "path: no such endpoint"})
            return
        try:
            req = json.loads(raw)
        except ValueError as e:
            self.reply(400, {"error": f"body: malformed JSON: {e}"})
            return
        try:
            self.reply(200, {"results": search(req)})
        except ValueError as e:
            self.reply(422, {"error": str(e)})
        except Exception as e:  # the engine's own errors
            self.reply(500, {"error": f"search: {e}"})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8081)
    p.add_argument("--metadata", help="SQLite database with a `metadata(_id, ...)` table, for filters")
    p.add_argument("--model", help="ColBERT checkpoint (PyLate layout) for text queries")
    args = p.parse_args()
    model = None
    if args.model:
        from sentence_transformers import MultiVectorEncoder

        model = MultiVectorEncoder(args.model, device=args.device).half()
    from fast_plaid import search as fp_search

    t = time.time()
    engine = fp_search.FastPlaid(index=args.index, device=args.device)
    centroids = np.load(f"{args.index}/centroids.npy", mmap_mode="r")
    STATE.update(engine=engine, device=args.device, dim=int(centroids.shape[1]), metadata=args.metadata, model=model)
    # Warm-up: the first search loads the index onto the device.
    engine.search(queries_embeddings=torch.randn(1, 8, STATE["dim"], device=args.device), top_k=1,
                  show_progress=False)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"listening on http://{args.host}:{server.server_address[1]} (fast-plaid, loaded in "
          f"{time.time() - t:.1f} s)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
