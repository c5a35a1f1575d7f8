"""Where a command's device time goes, kernel by kernel: totals by kernel
name from Nsight Compute's CSV of `gpu__time_duration.sum`, largest first,
with each kernel family's share (cuBLAS GEMMs, this crate's kernels,
candle's own).

    ncu --csv --cache-control none --clock-control none --metrics gpu__time_duration.sum CMD... > k.csv
    python3 bench/kernel_breakdown.py k.csv [--top 30] [--per N]

`--per N` divides the totals by N (the number of steps the command ran).
Prints a Markdown table, then one JSON line per kernel name.
"""
import argparse
import csv
import json
import re
import sys
from collections import defaultdict

UNITS = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}


# The extern "C" kernel names of kernels/*.cu, by prefix.
OURS = (
    r"(flash_|maxsim_|residual_|plaid_|hidden_|topk_|adamw_|add_bias|attn_softmax|gather_rows|geglu|gelu_bwd|"
    r"l2norm|layer_norm|rotary_qk|scatter_add_rows|sum_parts|sum_rows)"
)


def family(name):
    n = name.lower()
    if "gemm" in n or "cublas" in n or "cutlass" in n or n.startswith(("sm90_", "sm80_", "nvjet")):
        return "cuBLAS"
    if re.match(OURS, n):
        return "candle-maxsim"
    return "candle / other"


def short(name):
    # The parameter list makes one kernel many names; templates tell GEMMs apart.
    name = re.sub(r"^void ", "", name.strip())
    depth, end = 0, len(name)
    for i, ch in enumerate(name):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            end = i
            break
    return name[:end][:110]


def rows(path):
    text = open(path, newline="").read() if path != "-" else sys.stdin.read()
    # ncu prints its own log lines (==PROF==) before the CSV header.
    lines = [l for l in text.splitlines() if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = UNITS.get(r.get("Metric Unit", ""), None)
        if unit is None:
            raise SystemExit(f"unknown unit {r.get('Metric Unit')!r}")
        yield short(r["Kernel Name"]), float(r["Metric Value"].replace(",", "")) * unit


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--per", type=float, default=1.0)
    a = ap.parse_args()
    ms, count = defaultdict(float), defaultdict(int)
    for name, t in rows(a.csv):
        ms[name] += t / a.per
        count[name] += 1
    total = sum(ms.values())
    if total == 0:
        raise SystemExit("no kernel durations in the input")
    fams = defaultdict(float)
    for n, t in ms.items():
        fams[family(n)] += t
    print(f"total {total:.3f} ms" + (f" per step (/{a.per:g})" if a.per != 1 else ""))
    print("| family | ms | share |\n|---|---|---|")
    for f, t in sorted(fams.items(), key=lambda x: -x[1]):
        print(f"| {f} | {t:.3f} | {100 * t / total:.1f} % |")
    print("\n| kernel | launches | ms | share |\n|---|---|---|---|")
    ranked = sorted(ms.items(), key=lambda x: -x[1])
    for n, t in ranked[: a.top]:
        print(f"| `{n}` | {count[n] / a.per:g} | {t:.3f} | {100 * t / total:.1f} % |")
    for n, t in ranked:
        print(json.dumps({"kernel": n, "family": family(n), "launches": count[n] / a.per, "ms": t}))


if __name__ == "__main__":
    main()
