#!/usr/bin/env python3
"""Load generator for the search service (crates/serve) and for any service
of the same API shape (bench/serve_peer.py serves fast-plaid that way).

N concurrent clients, each on one HTTP/1.1 keep-alive connection, send
`POST /search` back to back for T seconds; per client count it prints one
JSON line: clients, requests, failures, throughput (requests and queries per
second), latency p50 / p90 / p99 / mean in ms. Pure Python (asyncio and the
standard library) plus numpy, so it runs on a bare GPU machine. The clients
are spread over `--processes` processes (one asyncio loop each): one Python
loop saturates at a few thousand requests per second.

With `--oha PATH` the requests are sent by oha (a Rust load generator,
`cargo install oha`; the same bodies, one per line, cycled through) and its
JSON report is read back: the Python clients' own time is then out of the
latencies (one asyncio loop spends ~0.1 ms of its own per request).

Queries are rows of a `.npy` of shape [Nq, Lq, dim] (float16 or float32;
all-zero token rows are dropped as padding) or lines of a text file (for a
service started with --model); each request takes the next ones in turn.

    python3 bench/serve_load.py --url http://127.0.0.1:8080 --queries q.npy \\
        --clients 1,8,32,128 --seconds 20 [--queries-per-request 1] \\
        [--filter-where "year > ?" --filter-params '[2020]'] [--api-key KEY]
"""

import argparse
import asyncio
import base64
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse

import numpy as np


def bodies(args):
    """The request bodies, one per group of queries (cycled through)."""
    extra = {"top_k": args.top_k}
    if args.n_ivf_probe:
        extra["n_ivf_probe"] = args.n_ivf_probe
    if args.n_full_scores:
        extra["n_full_scores"] = args.n_full_scores
    if args.filter_where:
        extra["filter"] = {"where": args.filter_where, "params": json.loads(args.filter_params)}
    if not args.include_metadata:
        extra["include_metadata"] = False
    k = args.queries_per_request
    out = []
    if args.texts:
        lines = [l.strip() for l in open(args.texts, encoding="utf-8") if l.strip()]
        for i in range(0, min(len(lines), args.max_bodies * k), k):
            out.append(json.dumps({"queries": lines[i : i + k], **extra}).encode())
    else:
        q = np.load(args.queries).astype(np.float32)
        if q.ndim != 3:
            sys.exit(f"--queries: expected [Nq, Lq, dim], got shape {q.shape}")
        for i in range(0, min(q.shape[0], args.max_bodies * k), k):
            group = []
            for row in q[i : i + k]:
                row = row[np.abs(row).max(axis=1) > 0]  # padding rows out
                if args.base64:
                    group.append(base64.b64encode(row.astype("<f2" if args.base64 == "f16" else "<f4").tobytes()).decode())
                else:
                    group.append(np.round(row, 6).tolist())
            if args.base64:
                out.append(json.dumps({"embeddings_base64": group, "embeddings_dtype": args.base64, **extra}).encode())
            else:
                out.append(json.dumps({"embeddings": group, **extra}).encode())
    if not out:
        sys.exit("no queries")
    return out


async def read_response(reader):
    """(status, body bytes) of one HTTP/1.1 response (Content-Length or chunked)."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("connection closed")
    status = int(status_line.split()[1])
    length, chunked, close = None, False, False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "transfer-encoding" and "chunked" in value:
            chunked = True
        elif name == "connection" and value == "close":
            close = True
    if chunked:
        body = b""
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                break
            body += await reader.readexactly(size)
            await reader.readline()
    else:
        body = await reader.readexactly(length or 0)
    return status, body, close


async def client(i, args, url, payloads, deadline, stats):
    host, port, path = url.hostname, url.port or 80, url.path.rstrip("/") + "/search"
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    if args.api_key:
        head += f"x-api-key: {args.api_key}\r\n"
    reader = writer = None
    n = i  # clients start at different queries
    while time.perf_counter() < deadline:
        body = payloads[n % len(payloads)]
        n += args.clients_now
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            t = time.perf_counter()
            writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            status, resp, close = await read_response(reader)
            ms = (time.perf_counter() - t) * 1e3
            if status == 200:
                stats["lat"].append(ms)
                stats["queries"] += args.queries_per_request
            else:
                stats["failures"] += 1
                if len(stats["errors"]) < 3:
                    stats["errors"].append(f"{status}: {resp[:200].decode(errors='replace')}")
            if close:
                writer.close()
                reader = writer = None
        except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
            stats["failures"] += 1
            if len(stats["errors"]) < 3:
                stats["errors"].append(repr(e))
            if writer is not None:
                writer.close()
            reader = writer = None
            await asyncio.sleep(0.01)
    if writer is not None:
        writer.close()


async def run(args, clients, seconds, payloads, first=0, stride=None, start_at=None):
    """Clients `first, first + stride, ...` below `clients` for `seconds`
    from the wall-clock time `start_at` (default: now)."""
    url = urllib.parse.urlparse(args.url)
    stats = {"lat": [], "failures": 0, "queries": 0, "errors": []}
    args.clients_now = clients
    if start_at is not None:
        await asyncio.sleep(max(0.0, start_at - time.time()))
    start = time.perf_counter()
    deadline = start + seconds
    ids = range(first, clients, stride or 1)
    await asyncio.gather(*(client(i, args, url, payloads, deadline, stats) for i in ids))
    return stats, time.perf_counter() - start


def run_part(args, clients, seconds, payloads, first, stride, start_at):
    """One process's share of the clients (see `measure`)."""
    return asyncio.run(run(args, clients, seconds, payloads, first, stride, start_at))


def measure(args, clients, seconds, payloads, pool):
    """`clients` clients for `seconds`, spread over the pool's processes,
    all starting at the same moment; their stats merged."""
    procs = min(args.processes, clients)
    if procs <= 1:
        return asyncio.run(run(args, clients, seconds, payloads))
    start_at = time.time() + 0.5
    parts = [pool.submit(run_part, args, clients, seconds, payloads, i, procs, start_at) for i in range(procs)]
    stats = {"lat": [], "failures": 0, "queries": 0, "errors": []}
    elapsed = 0.0
    for f in parts:
        s, e = f.result()
        stats["lat"] += s["lat"]
        stats["failures"] += s["failures"]
        stats["queries"] += s["queries"]
        stats["errors"] += s["errors"][: 3 - len(stats["errors"])]
        elapsed = max(elapsed, e)
    return stats, elapsed


def measure_oha(args, clients, seconds, body_file):
    """`clients` oha connections for `seconds`; stats as `measure`'s (the
    latencies as oha's percentiles, requests cut by the deadline not counted)."""
    url = args.url.rstrip("/") + "/search"
    cmd = [args.oha, "-z", f"{seconds}s", "-c", str(clients), "-m", "POST", "-H", "content-type: application/json",
           "-Z", body_file, "--no-tui", "--output-format", "json", url]
    if args.api_key:
        cmd[1:1] = ["-H", f"x-api-key: {args.api_key}"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    codes = {int(k): v for k, v in out.get("statusCodeDistribution", {}).items()}
    errors = {k: v for k, v in out.get("errorDistribution", {}).items() if "deadline" not in k}
    pct = out["latencyPercentiles"]
    ms = lambda k: round((pct.get(k) or float("nan")) * 1e3, 3)
    ok = codes.get(200, 0)
    return {
        "requests": ok,
        "failures": sum(v for c, v in codes.items() if c != 200) + sum(errors.values()),
        "seconds": round(out["summary"]["total"], 3),
        "p50_ms": ms("p50"), "p90_ms": ms("p90"), "p99_ms": ms("p99"),
        "mean_ms": round((out["summary"].get("average") or float("nan")) * 1e3, 3),
        "errors": [f"{k}: {v}" for k, v in errors.items()][:3],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--queries", help=".npy of [Nq, Lq, dim] query embeddings")
    src.add_argument("--texts", help="text file, one query per line")
    p.add_argument("--clients", default="1,8,32", help="comma-separated client counts, one run each")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each measured run")
    p.add_argument("--queries-per-request", type=int, default=1)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--n-ivf-probe", type=int)
    p.add_argument("--n-full-scores", type=int)
    p.add_argument("--filter-where")
    p.add_argument("--filter-params", default="[]", help="JSON list")
    p.add_argument("--include-metadata", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--api-key")
    p.add_argument("--max-bodies", type=int, default=4096, help="distinct request bodies at most")
    p.add_argument("--label", default="", help="copied into every output line")
    p.add_argument("--processes", type=int, default=4, help="client processes (each an asyncio loop)")
    p.add_argument("--oha", help="send the requests with this oha binary instead of Python clients")
    p.add_argument("--base64", choices=("f32", "f16"), help="send embeddings as base64 bytes of this type")
    args = p.parse_args()
    payloads = bodies(args)
    if args.oha:
        with tempfile.NamedTemporaryFile("wb", suffix=".jsonl", delete=False) as f:
            f.write(b"\n".join(payloads) + b"\n")
        try:
            for clients in [int(c) for c in args.clients.split(",")]:
                if args.warmup > 0:
                    measure_oha(args, clients, args.warmup, f.name)
                r = measure_oha(args, clients, args.seconds, f.name)
                line = {"label": args.label, "url": args.url, "clients": clients, "client": "oha",
                        "queries_per_request": args.queries_per_request, **r,
                        "throughput_rps": round(r["requests"] / r["seconds"], 2),
                        "queries_per_s": round(r["requests"] * args.queries_per_request / r["seconds"], 2)}
                if not line["errors"]:
                    del line["errors"]
                print(json.dumps(line), flush=True)
        finally:
            os.unlink(f.name)
        return
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.processes))
    for clients in [int(c) for c in args.clients.split(",")]:
        if args.warmup > 0:
            measure(args, clients, args.warmup, payloads, pool)
        stats, elapsed = measure(args, clients, args.seconds, payloads, pool)
        lat = np.array(stats["lat"]) if stats["lat"] else np.array([float("nan")])
        line = {
            "label": args.label,
            "url": args.url,
            "clients": clients,
            "queries_per_request": args.queries_per_request,
            "processes": min(args.processes, clients),
            "seconds": round(elapsed, 3),
            "requests": len(stats["lat"]),
            "failures": stats["failures"],
            "throughput_rps": round(len(stats["lat"]) / elapsed, 2),
            "queries_per_s": round(stats["queries"] / elapsed, 2),
            "p50_ms": round(float(np.percentile(lat, 50)), 3),
            "p90_ms": round(float(np.percentile(lat, 90)), 3),
            "p99_ms": round(float(np.percentile(lat, 99)), 3),
            "mean_ms": round(float(lat.mean()), 3),
        }
        if stats["errors"]:
            line["errors"] = stats["errors"]
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
