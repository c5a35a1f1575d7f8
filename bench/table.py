"""Markdown tables from benchmark JSON lines: this crate's (examples/bench.rs,
benches/cpu.rs) and the peers' (bench/peers.py, bench/peers_plaid.py,
bench/attention_peers.py, bench/cpu_peers.py), all passed together.

    python3 bench/table.py forward|families|int8|train|plaid|head|attention|cpu FILE.jsonl...   (- reads stdin)
    python3 bench/table.py forward bench/results/h200-2026-11-30/*forward*.jsonl

Lines that are not JSON objects are ignored; lines with an "error" field are
reported on stderr and left out. An implementation timed more than once on a
case (ours runs before and after the peers) is shown by its slowest median.
Peers are named with the version in their JSON line, or else the version
bench/gpu.sh pins. Floors use the H200's measured peaks: 789 TFLOP/s dense
BF16/F16 and 4.3 TB/s HBM.
"""
import json
import math
import sys
from collections import defaultdict

PEAK_FLOPS = 789e12
PEAK_BYTES = 4.3e12
# plaid_approx's floor is measured, not computed: a bare L2 gather of the same
# 3.26 M score rows of 128 bytes (bench/micro/plaid_gather.cu, H200).
PLAID_GATHER_MS = 0.0518

PEERS = {
    "lik": ("late-interaction-kernels", "0.4.5"),
    "flash": ("flash-maxsim", "0.3.0"),
    "pylate": ("PyLate einsum (torch)", None),
    "maxsim_cpu": ("maxsim-cpu", "0.1.0"),
    "numpy_einsum": ("numpy einsum", None),
}
CASES = {
    (128, 128, 128, 1024): "colpali_inbatch",
    (256, 256, 32, 256): "colbert_inbatch",
    (1, 1000, 32, 300): "rerank_colbert_1q",
    (1, 1000, 128, 1024): "rerank_colpali_1q",
    (16, 32, 32, 8192): "longdoc",
    (32, 10000, 32, 256): "scan_32q_10k",
}


def load(paths):
    rows = []
    for p in paths:
        f = sys.stdin if p == "-" else open(p)
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if "error" in r:
                print(f"table.py: {r.get('case')} {r.get('impl')} failed: {r['error'][-200:]}", file=sys.stderr)
                continue
            if "median_ms" in r:
                rows.append(r)
    return rows


def peer_of(impl):
    """(peer key, mode) for a peer's impl ("lik", "lik_lowmem"), or None for ours."""
    base, _, mode = impl.partition("_")
    if impl in PEERS:
        return impl, ""
    if base in PEERS:
        return base, mode
    return None


def label(key, rows):
    name, pinned = PEERS[key]
    vs = {r["version"] for r in rows if r.get("version") and peer_of(r["impl"])[0] == key}
    v = "/".join(sorted(vs)) or pinned
    return f"{name} {v}" if v else name


class Times:
    """Slowest median and its row per (key, impl)."""

    def __init__(self, rows, key):
        self.t = defaultdict(dict)
        for r in rows:
            k = key(r)
            old = self.t[k].get(r["impl"])
            if old is None or r["median_ms"] > old["median_ms"]:
                self.t[k][r["impl"]] = r

    def keys(self):
        return list(self.t)

    def ms(self, k, impl):
        r = self.t[k].get(impl)
        return r and r["median_ms"]

    def row(self, k, impl):
        return self.t[k].get(impl)


def f_ms(x):
    if x is None:
        return "–"
    return f"{x:.4f}" if x < 1 else f"{x:.3f}" if x < 10 else f"{x:.2f}" if x < 100 else f"{x:.1f}"


def f_x(a, b, bold=True):
    """Speed-up b / a (ours a, other b)."""
    if a is None or b is None:
        return "–"
    s = f"{b / a:.2f}×"
    return f"**{s}**" if bold and b >= 1.02 * a else s


def f_mb(r):
    if r is None or r.get("peak_mem_mb") is None:
        return "–"
    x = r["peak_mem_mb"]
    return f"{x:.2f}" if 0 < x < 1 else f"{x:.1f}"


def md(head, body):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    print("\n".join(out))


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def dense_floor(shape, dtype):
    """max(compute, memory) floor in ms of a dense MaxSim forward, and which."""
    nq, nd, lq, ld, dim = shape
    if dtype.lower() not in ("bf16", "f16"):
        return None, ""
    flop = 2 * nq * nd * lq * ld * dim
    byts = (nq * lq + nd * ld) * dim * 2 + nq * nd * 4
    c, m = flop / PEAK_FLOPS * 1e3, byts / PEAK_BYTES * 1e3
    return (c, "compute") if c >= m else (m, "memory")


def forward(rows):
    ours = [r for r in rows if r["impl"] == "fused"]
    peers = [r for r in rows if peer_of(r["impl"])]
    t = Times(ours + peers, lambda r: (tuple(r["shape"]), r.get("dtype", "bf16").lower()))
    pk = sorted({peer_of(r["impl"])[0] for r in peers}, key=list(PEERS).index)
    std = [k for k in t.keys() if k[1] == "bf16" and k[0][4] == 128 and tuple(k[0][:4]) in CASES]
    std.sort(key=lambda k: list(CASES).index(tuple(k[0][:4])))
    other = [k for k in t.keys() if k not in std and t.ms(k, "fused")]
    for main, keys in ((True, std), (False, other)):
        if not keys:
            continue
        print("BF16, dim 128:\n" if main else "\nOther widths and dtypes:\n")
        head = ["case", "Nq,Nd,Lq,Ld"] + ([] if main else ["dim", "dtype"]) + ["ours ms", "TFLOP/s"]
        head += [f"{label(p, peers)} ms" for p in pk] + [f"ours vs {PEERS[p][0]}" for p in pk]
        head += ["floor ms", "ours / floor"]
        body, ratios = [], defaultdict(list)
        for k in keys:
            shape, dt = k
            o = t.ms(k, "fused")
            fl, kind = dense_floor(shape, dt)
            line = [CASES.get(tuple(shape[:4]), "custom"), ",".join(map(str, shape[:4]))]
            line += ([] if main else [shape[4], dt]) + [f_ms(o)]
            line.append(f"{2 * math.prod(shape) / (o * 1e-3) / 1e12:.0f}" if o else "–")
            line += [f_ms(t.ms(k, p)) for p in pk]
            for p in pk:
                line.append(f_x(o, t.ms(k, p)))
                if o and t.ms(k, p):
                    ratios[p].append(t.ms(k, p) / o)
            line += [f"{f_ms(fl)} ({kind})" if fl else "–", f"{o / fl:.2f}" if fl and o else "–"]
            body.append(line)
        md(head, body)
        for p in pk if main else ():
            g = geomean(ratios[p])
            if g and len(ratios[p]) > 1:
                print(f"\nGeometric mean, ours vs {label(p, peers)}: **{g:.2f}×** over {len(ratios[p])} shapes.")


def int8_floor(shape):
    """max(compute, memory) floor in ms of an 8-bit forward: the tensor cores'
    8-bit rate taken as twice the measured bf16 peak; 1-byte values plus a
    4-byte scale per token."""
    nq, nd, lq, ld, dim = shape
    c = 2 * nq * nd * lq * ld * dim / (2 * PEAK_FLOPS) * 1e3
    m = ((nq * lq + nd * ld) * (dim + 4) + nq * nd * 4) / PEAK_BYTES * 1e3
    return (c, "compute") if c >= m else (m, "memory")


def int8(rows):
    """`maxsim_quantized` (I8 and, where run, e4m3) against this crate's bf16 `maxsim`, same shapes, one invocation."""
    t = Times([r for r in rows if r["impl"] == "fused"], lambda r: (tuple(r["shape"]), r.get("dtype", "bf16").lower()))
    shapes = list(dict.fromkeys(k[0] for k in t.keys()))
    fmts = [f for f in ("i8", "e4m3") if any(k[1] == f for k in t.keys())]
    head = ["case", "Nq,Nd,Lq,Ld,dim", "bf16 ms"] + [f"{f} ms" for f in fmts] + [f"{f} TOPS" for f in fmts]
    head += [f"{f} vs bf16" for f in fmts] + ["floor ms"] + [f"{f} / floor" for f in fmts]
    body, ratios = [], {f: [] for f in fmts}
    for sh in shapes:
        b = t.ms((sh, "bf16"), "fused")
        q = {f: t.ms((sh, f), "fused") for f in fmts}
        fl, kind = int8_floor(sh)
        line = [CASES.get(tuple(sh[:4]), "custom") if sh[4] == 128 else "custom", ",".join(map(str, sh)), f_ms(b)]
        line += [f_ms(q[f]) for f in fmts]
        line += [f"{2 * math.prod(sh) / (q[f] * 1e-3) / 1e12:.0f}" if q[f] else "–" for f in fmts]
        line += [f_x(q[f], b) for f in fmts] + [f"{f_ms(fl)} ({kind})"]
        line += [f"{q[f] / fl:.2f}" if q[f] else "–" for f in fmts]
        for f in fmts:
            if b and q[f]:
                ratios[f].append(b / q[f])
        body.append(line)
    md(head, body)
    for f in fmts:
        g = geomean(ratios[f])
        if g:
            print(f"\nGeometric mean, {f} vs bf16: **{g:.2f}×** over {len(ratios[f])} shapes.")


def train(rows):
    rows = [r for r in rows if r["impl"] in ("unified", "lowmem", "lowmem_grads", "reference") or peer_of(r["impl"])]
    t = Times(rows, lambda r: tuple(r["shape"]))
    peers = [r for r in rows if peer_of(r["impl"])]
    pmodes = sorted({r["impl"] for r in peers}, key=lambda m: (peer_of(m)[0], peer_of(m)[1] != "unified", m))
    mine = [m for m in ("unified", "lowmem", "lowmem_grads", "reference") if any(r["impl"] == m for r in rows)]
    head = ["case", "Nq,Nd,Lq,Ld,dim"] + [f"ours {m} ms (peak MB)" for m in mine]
    head += [f"{label(peer_of(m)[0], peers)} {peer_of(m)[1]} ms (peak MB)" for m in pmodes]
    pn = " / ".join(sorted({PEERS[peer_of(m)[0]][0] for m in pmodes}))
    if pmodes:
        head += [f"ours, best autograd mode, vs {pn} best mode", f"ours lowmem_grads vs {pn} best mode"]
    body = []
    for k in sorted(t.keys(), key=lambda s: -math.prod(s)):
        name = next(r["case"] for r in rows if tuple(r["shape"]) == k)
        line = [name, ",".join(map(str, k))]
        line += [f"{f_ms(t.ms(k, m))} ({f_mb(t.row(k, m))})" for m in mine + pmodes]
        if pmodes:
            best_peer = min((t.ms(k, m) for m in pmodes if t.ms(k, m)), default=None)
            best_ours = min((t.ms(k, m) for m in ("unified", "lowmem") if t.ms(k, m)), default=None)
            line += [f_x(best_ours, best_peer), f_x(t.ms(k, "lowmem_grads"), best_peer)]
        body.append(line)
    md(head, body)


def plaid(rows):
    peers = [r for r in rows if peer_of(r["impl"])]
    t = Times(rows, lambda r: (r["case"], r.get("codes", "")))
    pk = sorted({peer_of(r["impl"])[0] for r in peers}, key=list(PEERS).index)
    head = ["case", "ours ms", "decompress + `maxsim_varlen` ms"] + [f"{label(p, peers)} ms" for p in pk]
    head += [f"ours vs {PEERS[p][0]}" for p in pk] + ["ours vs decompress", "floor ms", "ours / floor"]
    head += ["peak MB: ours / decompress / " + " / ".join(PEERS[p][0] for p in pk)]
    body = []
    order = lambda k: (k[0] != "plaid_approx", k[0], k[1] != "U32")  # noqa: E731
    for k in sorted((k for k in t.keys() if k[1] or k[0] != "plaid_approx"), key=order):
        case, codes = k
        o, dec = t.ms(k, "fused"), t.ms(k, "decompress_then_maxsim")
        pm = {p: t.ms((case, ""), p) for p in pk}
        fl = PLAID_GATHER_MS if case == "plaid_approx" else None
        line = [f"{case}, {codes} codes" if codes else case, f_ms(o), f_ms(dec)] + [f_ms(pm[p]) for p in pk]
        line += [f_x(o, pm[p]) for p in pk] + [f_x(o, dec), f_ms(fl), f"{o / fl:.2f}" if fl and o else "–"]
        line.append(" / ".join([f_mb(t.row(k, "fused")), f_mb(t.row(k, "decompress_then_maxsim"))]
                               + [f_mb(t.row((case, ""), p)) for p in pk]))
        body.append(line)
    md(head, body)


def head_floor(shape):
    nq, nd, lq, ld, dmodel, dout = shape
    flop = 2 * (nq * nd * lq * ld * dout + nd * ld * dmodel * dout)
    byts = 2 * (nd * ld * dmodel + nq * lq * dout + dout * dmodel) + 4 * nq * nd
    c, m = flop / PEAK_FLOPS * 1e3, byts / PEAK_BYTES * 1e3
    return (c, "compute") if c >= m else (m, "memory")


def head(rows):
    t = Times(rows, lambda r: tuple(r["shape"]))
    keys = t.keys()  # in order of first appearance
    name = {k: next(r["case"] for r in rows if tuple(r["shape"]) == k).removeprefix("hidden_") for k in keys}
    fwd = [k for k in keys if t.ms(k, "fused")]
    if fwd:
        body = []
        for k in fwd:
            o, u = t.ms(k, "fused"), t.ms(k, "unfused")
            fl, kind = head_floor(k)
            tf = t.row(k, "fused")["tflops"]
            mb = f"{f_mb(t.row(k, 'fused'))} / {f_mb(t.row(k, 'unfused'))}"
            body.append([name[k], ",".join(map(str, k[:4])), f_ms(o), f_ms(u), f_x(o, u), f"{tf:.0f}",
                         f"{f_ms(fl)} ({kind})", f"{o / fl:.1f}", mb])
        md(["case", "Nq,Nd,Lq,Ld", "fused ms", "unfused ms", "fused vs unfused", "fused TFLOP/s", "floor ms",
            "fused / floor", "peak MB fused / unfused"], body)
    trn = [k for k in keys if t.ms(k, "fused_train") or t.ms(k, "fused_grads")]
    if trn:
        if fwd:
            print("\nTraining step (forward, sum, backward to q, h, w and b):\n")
        body = []
        for k in trn:
            ft, ut, fg = (t.ms(k, m) for m in ("fused_train", "unfused_train", "fused_grads"))
            body.append([name[k], f"{f_ms(ft)} ({f_mb(t.row(k, 'fused_train'))})",
                         f"{f_ms(ut)} ({f_mb(t.row(k, 'unfused_train'))})", f_x(ft, ut),
                         f"{f_ms(fg)} ({f_mb(t.row(k, 'fused_grads'))})", f_x(fg, ut)])
        md(["case", "`fused_train` ms (peak MB)", "`unfused_train` ms (peak MB)", "fused vs unfused",
            "`fused_grads` ms (peak MB)", "`fused_grads` vs unfused"], body)


def cpu(rows):
    # This crate's BF16 rows are their own columns (F32 is the comparison with the other implementations).
    rows = [{**r, "impl": r["impl"] + "_" + r["dtype"].lower()} if r.get("dtype") in ("BF16", "I8") else r for r in rows]
    t = Times(rows, lambda r: r["case"])
    peers = [r for r in rows if peer_of(r["impl"])]
    pk = sorted({peer_of(r["impl"])[0] for r in peers}, key=list(PEERS).index)
    head = ["case", "Nq,Nd,Lq,Ld,dim", "ours ms (peak MB)", "reference ms (peak MB)", "ours vs reference"]
    head += [f"{label(p, peers)} ms" for p in pk] + [f"ours vs {PEERS[p][0]}" for p in pk]
    head += ["ours BF16 ms", "BF16 vs F32", "ours 8-bit ms", "8-bit vs F32", "8-bit top-10 overlap, max error", "ours with argmax ms"]
    body = []
    for k in t.keys():
        o = t.ms(k, "fused")
        shape = next(r["shape"] for r in rows if r["case"] == k)
        line = [k, ",".join(map(str, shape)), f"{f_ms(o)} ({f_mb(t.row(k, 'fused'))})",
                f"{f_ms(t.ms(k, 'reference'))} ({f_mb(t.row(k, 'reference'))})", f_x(o, t.ms(k, "reference"))]
        line += [f_ms(t.ms(k, p)) for p in pk] + [f_x(o, t.ms(k, p)) for p in pk]
        i8 = t.row(k, "fused_i8") or {}
        agree = f"{i8['top10_overlap_vs_f32']:.3f}, {i8['max_abs_err_vs_f32']:.3f}" if i8 else "–"
        line += [f_ms(t.ms(k, "fused_bf16")), f_x(t.ms(k, "fused_bf16"), o), f_ms(t.ms(k, "fused_i8")),
                 f_x(t.ms(k, "fused_i8"), o), agree, f_ms(t.ms(k, "fused_argmax"))]
        body.append(line)
    threads = {r.get("threads") for r in rows if r.get("threads")}
    if threads:
        print(f"Threads: {', '.join(map(str, sorted(threads)))}.\n")
    md(head, body)


def families(rows):
    """Scores and argmax forward per shape; rows tagged "build": "before" (an
    earlier build, timed in the same invocation) add the before/after ratios."""
    t = Times(rows, lambda r: (tuple(r["shape"]), r.get("build", "after")))
    shapes = list(dict.fromkeys(k[0] for k in t.keys()))
    before = any(k[1] == "before" for k in t.keys())
    head = ["Nq,Nd,Lq,Ld,dim", "scores ms", "TFLOP/s", "scores / floor", "argmax ms", "argmax / scores"]
    if before:
        head += ["scores before ms", "scores after vs before", "argmax after vs before"]
    body = []
    for sh in shapes:
        s, a = t.ms((sh, "after"), "fused"), t.ms((sh, "after"), "fused_argmax")
        fl, _ = dense_floor(sh, "bf16")
        line = [",".join(map(str, sh)), f_ms(s), f"{2 * math.prod(sh) / (s * 1e-3) / 1e12:.0f}", f"{s / fl:.2f}"]
        line += [f_ms(a), f"{a / s:.2f}" if a else "–"]
        if before:
            sb, ab = t.ms((sh, "before"), "fused"), t.ms((sh, "before"), "fused_argmax")
            line += [f_ms(sb), f_x(s, sb), f_x(a, ab)]
        body.append(line)
    md(head, body)


def attention(rows):
    """`bench --attention` (ours: varlen, varlen_train, padded_train) and
    bench/attention_peers.py (sdpa, sdpa_train) per case; the backward is
    train − forward. Floors: 4·B·H·pairs·dh FLOPs forward, 2.5× that
    backward (five products against two), or q, k, v, o (and their
    gradients) once through HBM, whichever is longer. Rows tagged
    "build": NAME (another kernel choice on the same GPU, e.g. "mma")
    add NAME's forward / train and its train speed-up over the default."""
    t = Times(rows, lambda r: (tuple(r["shape"]), r.get("window"), r.get("build", "")))
    cases = list(dict.fromkeys(k[:2] for k in t.keys()))
    others = list(dict.fromkeys(k[2] for k in t.keys() if k[2]))
    head = ["B, L, H×dh, window", "fwd ms", "fwd / floor", "SDPA fwd", "bwd ms", "bwd / floor", "SDPA bwd",
            "train ms", "SDPA train", "ours / SDPA train", "composed train", "peak MB train: ours / composed"]
    for o in others:
        head += [f"{o} fwd / train", f"{o} vs default train"]
    body = []
    for sh, w in cases:
        b, l, h, dh = sh
        pairs = l * l if w is None else sum(min(i, w) + min(l - 1 - i, w) + 1 for i in range(l))
        fwd_flop = 4 * b * h * pairs * dh
        tokens = b * l * h * dh * 2
        f_fl = max(fwd_flop / PEAK_FLOPS, 4 * tokens / PEAK_BYTES) * 1e3
        b_fl = max(2.5 * fwd_flop / PEAK_FLOPS, 9 * tokens / PEAK_BYTES) * 1e3
        k = (sh, w, "")
        f, tr, sf, st = t.ms(k, "varlen"), t.ms(k, "varlen_train"), t.ms(k, "sdpa"), t.ms(k, "sdpa_train")
        bw = tr - f if f and tr else None
        sb = st - sf if sf and st else None
        line = [f"{b}, {l}, {h}×{dh}" + (f", window {w}" if w is not None else ""), f_ms(f),
                f"{f / f_fl:.2f}" if f else "–", f_ms(sf), f_ms(bw), f"{bw / b_fl:.2f}" if bw else "–", f_ms(sb),
                f_ms(tr), f_ms(st), f_x(tr, st), f_ms(t.ms(k, "padded_train")),
                f"{f_mb(t.row(k, 'varlen_train'))} / {f_mb(t.row(k, 'padded_train'))}"]
        for o in others:
            ko = (sh, w, o)
            line += [f"{f_ms(t.ms(ko, 'varlen'))} / {f_ms(t.ms(ko, 'varlen_train'))}", f_x(t.ms(ko, "varlen_train"), tr)]
        body.append(line)
    md(head, body)


def main():
    tables = {"forward": forward, "families": families, "int8": int8, "train": train, "plaid": plaid, "head": head,
              "attention": attention, "cpu": cpu}
    if len(sys.argv) < 3 or sys.argv[1] not in tables:
        sys.exit(__doc__)
    tables[sys.argv[1]](load(sys.argv[2:]))


if __name__ == "__main__":
    main()
