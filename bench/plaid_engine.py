"""The PLAID engine against fast-plaid 1.7 on one GPU, same collection, same
queries, same parameters: index build time, search latency (1 query) and
throughput (32 and 256 queries), recall@10 against exhaustive exact MaxSim on
the uncompressed embeddings, search broken down by stage, peak host and
device memory of each phase, and interoperability both ways (each engine
searching the other's index).

    python3 bench/plaid_engine.py --bench BIN [--work DIR] [--docs 100000]

BIN is the plaid_bench example (crates/plaid/examples/plaid_bench.rs, built
with --features cuda). fast-plaid 1.7.0.2110 and its dependencies
(fastkmeans 0.5.0, joblib, usearch, numkong) must be importable, with torch.

The collection (generated here, seeded, on the GPU): 100 000 documents of
100-260 tokens (about 18 M), dim 128; a vocabulary of 1000 topics x 60 word
vectors plus 2000 common ones; 70 % of a document's tokens from its topic's
words, the rest common words, contextual noise on every token, L2-normalized.
Queries: 256, each 32 tokens drawn from one document's tokens (the planted
answer) with noise, normalized.

Each phase runs in its own process (its peak memory its own): host peak RSS
from wait4, device memory as the peak of `nvidia-smi` memory.used during the
phase minus the idle value before it. Prints JSON lines, then a summary.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

SETTINGS = [(8, 4096), (4, 2048), (2, 1024)]  # (n_ivf_probe, n_full_scores): fast-plaid's default, two cheaper
BATCHES = [1, 32, 256]


def gpu_used_mb():
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    ).stdout
    return float(out.split()[0]) if out.strip() else 0.0


def run(cmd, what):
    """Runs `cmd`, returning (its stdout JSON lines, peak host RSS MB, peak device MB above idle)."""
    idle = gpu_used_mb()
    peak = [idle]
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            peak[0] = max(peak[0], gpu_used_mb())
            time.sleep(0.05)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    stop.set()
    t.join()
    if status != 0:
        print(json.dumps({"phase": what, "error": f"exit status {status}", "cmd": cmd}), flush=True)
    lines = []
    for l in out.splitlines():
        try:
            lines.append(json.loads(l))
        except ValueError:  # other output (a library's log lines)
            pass
    lines = [l for l in lines if isinstance(l, dict)]
    mem = {"phase": what, "peak_host_mb": usage.ru_maxrss / 1024, "peak_device_mb": peak[0] - idle}
    print(json.dumps(mem), flush=True)
    for l in lines:
        l["of"] = what
        print(json.dumps(l), flush=True)
    return lines, mem


# ---------------------------------------------------------------------------
# The collection.
# ---------------------------------------------------------------------------


def generate(work, n_docs, seed=0):
    import numpy as np
    import torch

    dim, topics, words, common = 128, 1000, 60, 2000
    g = torch.Generator(device="cuda").manual_seed(seed)
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)
    centers = unit(torch.randn(topics, dim, generator=g, device="cuda"))
    topic_words = unit(centers[:, None, :] + 0.6 * torch.randn(topics, words, dim, generator=g, device="cuda") / dim**0.5)
    common_words = unit(torch.randn(common, dim, generator=g, device="cuda"))
    vocab = torch.cat([topic_words.reshape(-1, dim), common_words])  # [topics*words + common, dim]
    lens = torch.randint(100, 261, (n_docs,), generator=g, device="cuda")
    doc_topic = torch.randint(0, topics, (n_docs,), generator=g, device="cuda")
    total = int(lens.sum())
    emb = np.lib.format.open_memmap(f"{work}/emb.npy", mode="w+", dtype=np.float16, shape=(total, dim))
    at = 0
    step = 5000
    for a in range(0, n_docs, step):
        l = lens[a : a + step]
        n = int(l.sum())
        owner = torch.repeat_interleave(torch.arange(len(l), device="cuda"), l)
        topic = doc_topic[a : a + step][owner]
        from_topic = torch.rand(n, generator=g, device="cuda") < 0.7
        w = torch.where(
            from_topic,
            topic * words + torch.randint(0, words, (n,), generator=g, device="cuda"),
            topics * words + torch.randint(0, common, (n,), generator=g, device="cuda"),
        )
        x = unit(vocab[w] + 0.35 * torch.randn(n, dim, generator=g, device="cuda") / dim**0.5)
        emb[at : at + n] = x.half().cpu().numpy()
        at += n
    emb.flush()
    np.save(f"{work}/lens.npy", lens.cpu().numpy().astype(np.int64))
    # Queries: 32 tokens of one document each, with noise.
    nq, lq = 256, 32
    src = torch.randint(0, n_docs, (nq,), generator=g, device="cuda")
    starts = torch.cat([torch.zeros(1, device="cuda", dtype=torch.long), torch.cumsum(lens, 0)[:-1]])
    rows = starts[src][:, None] + (torch.rand(nq, lq, generator=g, device="cuda") * lens[src][:, None]).long()
    q = torch.from_numpy(np.asarray(emb[rows.reshape(-1).cpu().numpy()])).cuda().float().reshape(nq, lq, dim)
    q = unit(q + 0.3 * torch.randn(q.shape, generator=g, device="cuda") / dim**0.5)
    np.save(f"{work}/queries.npy", q.half().cpu().numpy())
    np.save(f"{work}/planted.npy", src.cpu().numpy())
    print(json.dumps({"phase": "generate", "documents": n_docs, "tokens": total}), flush=True)


# ---------------------------------------------------------------------------
# fast-plaid phases (run in their own processes through `main`).
# ---------------------------------------------------------------------------


def fp_docs(work):
    import numpy as np
    import torch

    emb = np.load(f"{work}/emb.npy", mmap_mode="r")
    lens = np.load(f"{work}/lens.npy")
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    return [torch.from_numpy(np.asarray(emb[s : s + l])) for s, l in zip(starts, lens)]


def fp_build(work, index, seed=42):
    from fast_plaid import search

    docs = fp_docs(work)
    t = time.time()
    search.FastPlaid(index=index, device="cuda:0").create(documents_embeddings=docs, nbits=4, seed=seed)
    print(json.dumps({"phase": "build", "seconds": time.time() - t}), flush=True)


def fp_search(work, index, out, timed=True):
    import numpy as np
    import torch
    from fast_plaid import search

    t = time.time()
    fp = search.FastPlaid(index=index, device="cuda:0")
    torch.cuda.synchronize()
    print(json.dumps({"phase": "load", "seconds": time.time() - t}), flush=True)
    q = torch.from_numpy(np.load(f"{work}/queries.npy")).cuda()
    fp.search(queries_embeddings=q[:1], top_k=10, show_progress=False)  # warm-up
    results = {}
    for probe, full in SETTINGS:
        for b in BATCHES if timed else ():
            times = []
            for r in range(5 if b < 256 else 3):
                start = (r * b) % (q.shape[0] - b + 1)
                torch.cuda.synchronize()
                t = time.perf_counter()
                fp.search(queries_embeddings=q[start : start + b], top_k=10, n_ivf_probe=probe,
                          n_full_scores=full, show_progress=False)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t) * 1e3)
            ms = sorted(times)[len(times) // 2]
            print(json.dumps({"phase": "search", "batch": b, "median_ms": ms, "queries_per_s": b / ms * 1e3,
                              "n_ivf_probe": probe, "n_full_scores": full}), flush=True)
        res = []
        for i in range(0, q.shape[0], 256):
            res += fp.search(queries_embeddings=q[i : i + 256], top_k=10, n_ivf_probe=probe, n_full_scores=full,
                             show_progress=False)
        results[f"{probe},{full}"] = {"ids": [[int(i) for i, _ in r] for r in res],
                                      "scores": [[float(s) for _, s in r] for r in res]}
    json.dump(results, open(out, "w"))


# ---------------------------------------------------------------------------
# The driver.
# ---------------------------------------------------------------------------


def recall(got, exact, k=10):
    hits = sum(len(set(g[:k]) & set(e[:k])) for g, e in zip(got, exact))
    return hits / sum(min(k, len(e)) for e in exact)


def overlap(a, b, k=10):
    return sum(len(set(x[:k]) & set(y[:k])) for x, y in zip(a, b)) / sum(min(k, len(y)) for y in b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True, help="the plaid_bench binary")
    ap.add_argument("--work", default="/tmp/plaid_engine")
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--collection", help="a directory of emb.npy, lens.npy, queries.npy to index instead of the generated one")
    ap.add_argument("--seeds", help="comma-separated build seeds: recall@10 of both engines' indexes per seed, nothing timed")
    ap.add_argument("--ours-only", action="store_true", help="with --seeds: build and search our index only")
    ap.add_argument("--seed", type=int, default=42, help=argparse.SUPPRESS)
    ap.add_argument("--untimed", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--index", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.phase == "fp-build":
        return fp_build(a.work, a.index, a.seed)
    if a.phase == "fp-search":
        return fp_search(a.work, a.index, a.out, timed=not a.untimed)
    w = a.work
    os.makedirs(w, exist_ok=True)
    if a.collection:
        for f in ("emb.npy", "lens.npy", "queries.npy"):
            if not os.path.exists(f"{w}/{f}"):
                os.symlink(os.path.abspath(f"{a.collection}/{f}"), f"{w}/{f}")
    elif not os.path.exists(f"{w}/queries.npy"):
        generate(w, a.docs)
    me = [sys.executable, os.path.abspath(__file__), "--bench", a.bench, "--work", w]
    col = ["--docs", f"{w}/emb.npy", "--lens", f"{w}/lens.npy"]
    B = [a.bench]
    run(B + ["exact"] + col + ["--queries", f"{w}/queries.npy", "--out", f"{w}/exact.json", "--cuda"], "exact")
    exact = json.load(open(f"{w}/exact.json"))["ids"]
    if a.seeds or a.collection:
        # Quality only: each engine's index per seed, searched at every setting.
        rows = []
        for seed in [int(x) for x in (a.seeds or "42").split(",")]:
            fp_i, ours_i = f"{w}/fp_s{seed}", f"{w}/ours_s{seed}"
            if not a.ours_only:
                run(me + ["--phase", "fp-build", "--index", fp_i, "--seed", str(seed)], f"fast-plaid build seed {seed}")
            run(B + ["build"] + col + ["--index", ours_i, "--seed", str(seed), "--cuda"], f"ours build seed {seed}")
            if not a.ours_only:
                run(me + ["--phase", "fp-search", "--untimed", "--index", fp_i, "--out", f"{fp_i}.json"], f"fast-plaid search seed {seed}")
            theirs = None if a.ours_only else json.load(open(f"{fp_i}.json"))
            row = {"seed": seed}
            for probe, full in SETTINGS:
                out = f"{ours_i}_{probe}_{full}.json"
                run(B + ["search", "--index", ours_i, "--queries", f"{w}/queries.npy", "--out", out, "--cuda", "--batch", "256",
                         "--repeats", "1", "--n-ivf-probe", str(probe), "--n-full-scores", str(full)], f"ours search seed {seed}")
                row[f"{probe},{full}"] = {"recall_ours": recall(json.load(open(out))["ids"], exact),
                                          "recall_fast_plaid": theirs and recall(theirs[f"{probe},{full}"]["ids"], exact)}
            rows.append(row)
            print(json.dumps({"phase": "quality", "collection": a.collection or "generated", **row}), flush=True)
        for probe, full in SETTINGS:
            k = f"{probe},{full}"
            mean = lambda who: None if a.ours_only and who == "recall_fast_plaid" else sum(r[k][who] for r in rows) / len(rows)
            print(json.dumps({"phase": "quality_summary", "setting": k, "seeds": len(rows), "collection": a.collection or "generated",
                              "recall_ours_mean": mean("recall_ours"), "recall_fast_plaid_mean": mean("recall_fast_plaid"),
                              "recall_ours": [r[k]["recall_ours"] for r in rows],
                              "recall_fast_plaid": [r[k]["recall_fast_plaid"] for r in rows]}), flush=True)
        return
    run(me + ["--phase", "fp-build", "--index", f"{w}/fp"], "fast-plaid build")
    run(B + ["build"] + col + ["--index", f"{w}/ours", "--cuda"], "ours build")
    run(me + ["--phase", "fp-search", "--index", f"{w}/fp", "--out", f"{w}/fp_results.json"], "fast-plaid search")
    fp_res = json.load(open(f"{w}/fp_results.json"))
    summary = {}
    for probe, full in SETTINGS:
        ps = ["--n-ivf-probe", str(probe), "--n-full-scores", str(full)]
        out_ours = f"{w}/ours_{probe}_{full}.json"
        run(B + ["search", "--index", f"{w}/ours", "--queries", f"{w}/queries.npy", "--out", out_ours, "--cuda"] + ps,
            f"ours search {probe},{full}")
        out_x = f"{w}/ours_on_fp_{probe}_{full}.json"
        run(B + ["search", "--index", f"{w}/fp", "--queries", f"{w}/queries.npy", "--out", out_x, "--cuda",
                 "--batch", "256", "--repeats", "1"] + ps, f"ours on fast-plaid's index {probe},{full}")
        ours = json.load(open(out_ours))["ids"]
        ours_on_fp = json.load(open(out_x))["ids"]
        theirs = fp_res[f"{probe},{full}"]["ids"]
        summary[f"{probe},{full}"] = {
            "recall_ours": recall(ours, exact), "recall_fast_plaid": recall(theirs, exact),
            "overlap_ours_on_fp_index_vs_fast_plaid": overlap(ours_on_fp, theirs),
        }
    run(B + ["stages", "--index", f"{w}/ours", "--queries", f"{w}/queries.npy", "--cuda"], "ours stages")
    # fast-plaid on our index (it rewrites an index's chunk files on load: a copy).
    subprocess.run(["cp", "-r", f"{w}/ours", f"{w}/ours_copy"], check=True)
    run(me + ["--phase", "fp-search", "--index", f"{w}/ours_copy", "--out", f"{w}/fp_on_ours.json"],
        "fast-plaid on our index")
    fp_on_ours = json.load(open(f"{w}/fp_on_ours.json"))["8,4096"]["ids"]
    summary["fast_plaid_on_our_index_recall"] = recall(fp_on_ours, exact)
    print(json.dumps({"phase": "summary", **summary}), flush=True)


if __name__ == "__main__":
    main()
