"""The PLAID engine at growing collection sizes, for the scaling table:
per size, the build (seconds, tokens/s, peak host and device memory, index
size on disk), search latency at 1 / 32 / 256 queries, recall@10 against
exhaustive exact MaxSim of the uncompressed embeddings on a sample of the
queries, search with the index on the device and within a device budget of
a quarter of it (residuals in host memory), and the cost of adding 0.1 %
more documents and of deleting 100 (then the compaction); and fast-plaid on
the same documents up to `--fast-plaid-max-tokens` (fast-plaid on the GPU, as
bench/plaid_engine.py runs it).

    python3 bench/plaid_scale.py --bench BIN --work DIR [--docs 136000,544000,2176000,8000000] [--cuda]
        [--nbits 4] [--euclidean] [--fast-plaid-max-tokens 70000000] [--skip budget,update]

BIN is the plaid_bench example. The collections are plaid_bench's generated
ones (`--generate N`, 60-190 tokens per document, about 125 on average:
136 000 documents are about 17 M tokens, 8 000 000 about 1 B), never
written to disk except for fast-plaid, which reads them from .npy. Each
phase runs in its own process (plaid_engine.run: peak RSS from wait4,
device memory from nvidia-smi, 0 without a GPU). Prints JSON lines.
"""
import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
import plaid_engine  # noqa: E402
from plaid_engine import recall  # noqa: E402


def du_mb(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--docs", default="136000,544000,2176000,8000000")
    ap.add_argument("--nbits", type=int, default=4)
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--euclidean", action="store_true", help="Euclidean k-means (plaid_bench build --euclidean)")
    ap.add_argument("--exact-queries", type=int, default=32, help="queries scored exhaustively for recall")
    ap.add_argument("--fast-plaid-max-tokens", type=int, default=0, help="fast-plaid builds up to this size (0: never)")
    ap.add_argument("--skip", default="", help="phases left out: budget, update (compaction needs the index's size free on disk)")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    if skip - {"budget", "update"}:
        sys.exit(f"--skip: unknown phases {sorted(skip - {'budget', 'update'})}")
    dev = ["--cuda"] if a.cuda else []
    B = a.bench
    os.makedirs(a.work, exist_ok=True)
    if not a.cuda:
        plaid_engine.gpu_used_mb = lambda: 0.0
    for n in [int(x) for x in a.docs.split(",")]:
        w = lambda *p: os.path.join(a.work, f"n{n}", *p)  # noqa: E731
        os.makedirs(w(), exist_ok=True)
        gen = ["--generate", str(n)]
        idx = w("ours")
        shutil.rmtree(idx, ignore_errors=True)
        sph = ["--euclidean"] if a.euclidean else []
        rows, mem = plaid_engine.run([B, *dev, "build", *gen, "--index", idx, "--nbits", str(a.nbits), *sph], f"build {n}")
        build = next(r for r in rows if r.get("phase") == "build")
        plaid_engine.run([B, *dev, "queries", *gen, "--n", "256", "--out", w("q.npy")], f"queries {n}")
        rows, _ = plaid_engine.run([B, *dev, "search", "--index", idx, "--queries", w("q.npy"), "--out", w("ours.json")],
                                   f"search {n}")
        # Exact top-10 of the first queries on the uncompressed embeddings.
        q = np.load(w("q.npy"))
        np.save(w("q_exact.npy"), q[: a.exact_queries])
        plaid_engine.run([B, *dev, "exact", *gen, "--queries", w("q_exact.npy"), "--out", w("exact.json")], f"exact {n}")
        got = json.load(open(w("ours.json")))["ids"][: a.exact_queries]
        exact = json.load(open(w("exact.json")))["ids"]
        meta = json.load(open(os.path.join(idx, "metadata.json")))
        tokens = meta["num_embeddings"]
        summary = {"documents": n, "tokens": tokens, "spherical_kmeans": not a.euclidean, "build_s": build["seconds"], "tokens_per_s": tokens / build["seconds"], "open_s": build.get("open_seconds"),
                   "build_peak_host_mb": mem["peak_host_mb"], "build_peak_device_mb": mem["peak_device_mb"],
                   "index_mb": du_mb(idx), "recall@10": recall(got, exact),
                   "search_ms": {r["batch"]: r["median_ms"] for r in rows if r.get("phase") == "search"}}
        # The same searches within a quarter of the device memory the index needs whole.
        if "budget" not in skip:
            rows, _ = plaid_engine.run([B, *dev, "search", "--index", idx, "--queries", w("q.npy"), "--out", w("budget.json"),
                                        "--device-budget-fraction", "0.25"], f"search {n}, device budget 1/4")
            summary["budget_quarter"] = {
                "search_ms": {r["batch"]: r["median_ms"] for r in rows if r.get("phase") == "search"},
                "same_results": json.load(open(w("budget.json"))) == json.load(open(w("ours.json"))),
            }
        if "update" not in skip:
            rows, _ = plaid_engine.run([B, *dev, "update", *gen, "--index", idx, "--add", str(max(1, n // 1000)),
                                        "--delete", "100"], f"update {n}")
            upd = next((r for r in rows if r.get("phase") == "update"), {})
            summary.update({k: upd.get(k) for k in ("add_seconds", "add_again_seconds", "add_one_seconds", "delete_seconds", "compact_seconds")})
            if summary.get("add_seconds") is not None:
                summary["add_over_build"] = summary["add_seconds"] / build["seconds"]
        if tokens <= a.fast_plaid_max_tokens:
            plaid_engine.run([B, *dev, "dump", *gen, "--out", w("emb.npy"), "--lens-out", w("lens.npy")], f"dump {n}")
            shutil.copy(w("q.npy"), w("queries.npy"))
            me = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "plaid_engine.py"), "--bench", B,
                  "--work", w()]
            fp_idx = w("theirs")
            shutil.rmtree(fp_idx, ignore_errors=True)
            rows, fmem = plaid_engine.run(me + ["--phase", "fp-build", "--index", fp_idx], f"fast-plaid build {n}")
            fb = next((r for r in rows if r.get("phase") == "build"), None)
            if fb:
                summary.update({"fast_plaid_build_s": fb["seconds"], "fast_plaid_peak_host_mb": fmem["peak_host_mb"],
                                "fast_plaid_peak_device_mb": fmem["peak_device_mb"], "fast_plaid_index_mb": du_mb(fp_idx)})
                # fast-plaid's search of the same queries, default parameters, and its recall.
                rows, _ = plaid_engine.run(me + ["--phase", "fp-search", "--index", fp_idx, "--out", w("theirs.json")],
                                           f"fast-plaid search {n}")
                default = {r["batch"]: r["median_ms"] for r in rows
                           if r.get("phase") == "search" and (r["n_ivf_probe"], r["n_full_scores"]) == (8, 4096)}
                theirs = json.load(open(w("theirs.json"))).get("8,4096", {}).get("ids", [])[: a.exact_queries]
                summary.update({"fast_plaid_search_ms": default, "fast_plaid_recall@10": recall(theirs, exact)})
            for f in ("emb.npy", "lens.npy"):
                os.remove(w(f))
        print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
