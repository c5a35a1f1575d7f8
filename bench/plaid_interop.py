"""fast-plaid and this crate's PLAID engine searching each other's indexes,
on the CPU: each engine builds an index of the same documents, then each
searches both indexes with the same parameters; prints the top-10 overlap of
every pair with the index's own engine (the share of its top-10 documents
the other engine also returns in its top 10).

    python3 bench/plaid_interop.py --bench BIN --work DIR [--docs N]

BIN: the plaid_bench example (any build; runs on the CPU here). The
documents are plaid_bench's generated collection (`--generate N`), the
queries made from it (`plaid_bench queries`); fast-plaid (the version
importable, e.g. 1.4.6.2110 or 1.7.0.2110 from PyPI with torch 2.11) reads
them from the .npy files plaid_bench writes for it.
"""
import argparse
import json
import os
import subprocess
import sys
import types

import numpy as np
import torch

try:
    import usearch.index  # noqa: F401
except ImportError:  # only fast-plaid's update() uses it
    stub = types.ModuleType("usearch.index")
    stub.Index = None
    sys.modules["usearch"] = types.ModuleType("usearch")
    sys.modules["usearch.index"] = stub

from fast_plaid.search import FastPlaid  # noqa: E402

PARAMS = dict(top_k=10, n_ivf_probe=8, n_full_scores=4096)


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


def fp_search(index_dir, q):
    idx = FastPlaid(index=index_dir, device="cpu")
    res = idx.search(queries_embeddings=torch.from_numpy(q), show_progress=False, **PARAMS)
    return [[int(d) for d, _ in r] for r in res]


def ours_search(bench, index_dir, qpath, out):
    run([bench, "search", "--index", index_dir, "--queries", qpath, "--batch", "64", "--repeats", "1", "--out", out,
         "--top-k", str(PARAMS["top_k"]), "--n-ivf-probe", str(PARAMS["n_ivf_probe"]),
         "--n-full-scores", str(PARAMS["n_full_scores"])])
    return json.load(open(out))["ids"]


def overlap(a, b):
    return sum(len(set(x[:10]) & set(y[:10])) for x, y in zip(a, b)) / max(1, sum(len(x[:10]) for x in a))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--docs", type=int, default=3000)
    a = ap.parse_args()
    w = lambda *p: os.path.join(a.work, *p)
    os.makedirs(a.work, exist_ok=True)
    gen = ["--generate", str(a.docs)]
    run([a.bench, "queries", *gen, "--n", "64", "--out", w("q.npy")])
    q = np.load(w("q.npy")).astype(np.float16)
    run([a.bench, "build", *gen, "--index", w("ours")])
    docs = run_docs(a.bench, gen, w)
    fp = FastPlaid(index=w("theirs"), device="cpu")
    fp.create(documents_embeddings=docs, nbits=4, batch_size=25000, seed=42, use_triton_kmeans=False)
    rows = {}
    for name in ("ours", "theirs"):
        mine = ours_search(a.bench, w(name), w("q.npy"), w(name + "-ours.json"))
        theirs = fp_search(w(name), q)
        own, other = (mine, theirs) if name == "ours" else (theirs, mine)
        rows[name] = overlap(own, other)
    import importlib.metadata as md
    print(json.dumps({"fast_plaid": md.version("fast-plaid"), "documents": a.docs, **PARAMS,
                      "overlap_on_our_index": rows["ours"], "overlap_on_fast_plaid_index": rows["theirs"]}))


def run_docs(bench, gen, w):
    """The generated documents as torch tensors (F32), from plaid_bench's `dump` of them."""
    run([bench, "dump", *gen, "--out", w("emb.npy"), "--lens-out", w("lens.npy")])
    x, lens = np.load(w("emb.npy")), np.load(w("lens.npy"))
    cu = np.concatenate([[0], np.cumsum(lens)])
    return [torch.from_numpy(x[cu[i]:cu[i + 1]].astype(np.float32)) for i in range(len(lens))]


if __name__ == "__main__":
    main()
