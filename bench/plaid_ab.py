"""Two builds of the PLAID engine side by side on one GPU: the same generated
collection (bench/plaid_engine.py's generator), each build's index build time
and search latency at 1 / 32 / 256 queries, interleaved over rounds, and the
ratio of the medians. For checking that a change leaves the engine's speed
where it was.

    python3 bench/plaid_ab.py --a BIN_A --b BIN_B [--docs 100000] [--rounds 2]

BIN_A / BIN_B are plaid_bench binaries (crates/plaid/examples/plaid_bench.rs,
built with --features cuda). Prints JSON lines, then a table.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plaid_engine import generate  # noqa: E402


def lines(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = []
    for l in out.splitlines():
        try:
            rows.append(json.loads(l))
        except ValueError:
            pass
    return [r for r in rows if isinstance(r, dict)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="plaid_bench binary A (e.g. before a change)")
    ap.add_argument("--b", required=True, help="plaid_bench binary B (e.g. after it)")
    ap.add_argument("--work", default="/tmp/plaid_ab")
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    w = a.work
    os.makedirs(w, exist_ok=True)
    if not os.path.exists(f"{w}/queries.npy"):
        generate(w, a.docs)
    col = ["--docs", f"{w}/emb.npy", "--lens", f"{w}/lens.npy"]
    times = {"a": {}, "b": {}}
    for r in range(a.rounds):
        for who, bin_ in (("a", a.a), ("b", a.b)) if r % 2 == 0 else (("b", a.b), ("a", a.a)):
            index = f"{w}/index_{who}"
            subprocess.run(["rm", "-rf", index], check=True)
            for row in lines([bin_, "build"] + col + ["--index", index, "--cuda"]):
                if row.get("phase") == "build":
                    times[who].setdefault("build s", []).append(row["seconds"])
            for row in lines([bin_, "search", "--index", index, "--queries", f"{w}/queries.npy", "--cuda"]):
                if row.get("phase") == "search":
                    times[who].setdefault(f"search {row['batch']} ms", []).append(row["median_ms"])
            print(json.dumps({"round": r, "build": who, **{k: v[-1] for k, v in times[who].items()}}), flush=True)
    print()
    print("| measurement | A (median) | B (median) | B vs A |")
    print("|---|---|---|---|")
    for k in times["a"]:
        ma, mb = statistics.median(times["a"][k]), statistics.median(times["b"].get(k, [float("nan")]))
        print(f"| {k} | {ma:.4g} | {mb:.4g} | {ma / mb:.3f}x |")


if __name__ == "__main__":
    main()
