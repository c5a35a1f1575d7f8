"""Other MaxSim implementations on the GPU, one JSON line per (case, impl), same
shapes and dtype as examples/bench.rs:

    lik     late-interaction-kernels (pinned: 0.4.5), `maxsim`
    flash   flash-maxsim (pinned: 0.3.0), `flash_maxsim_batched`
    pylate  PyLate's colbert_scores formula in torch (einsum, max, sum)

    python3 bench/peers.py [--case NAME]... [--impl lik|flash|pylate]... [--fresh N] [--dtype f16] [--dim D]
    python3 bench/peers.py --train [--fresh N]     # late-interaction-kernels fwd+bwd, backward=unified and lowmem

Each (case, impl) runs in `--fresh N` fresh processes and the best median is
kept: late-interaction-kernels and flash-maxsim autotune once per process, and
their times vary between processes. Inputs: standard-normal tensors, seed 0.
Timing: triton.testing.do_bench (L2 flushed, CUDA events), median. Each line
carries the package version it measured. Needs torch and triton.
"""
import argparse
import json
import subprocess
import sys

DISTS = {"lik": "late-interaction-kernels", "flash": "flash-maxsim", "pylate": "torch"}


def version(impl):
    """Installed version of the package behind `impl` (None if unknown)."""
    from importlib import metadata

    try:
        return metadata.version(DISTS[impl])
    except metadata.PackageNotFoundError:
        return None

CASES = {
    "colpali_inbatch": (128, 128, 128, 1024, 128),
    "colbert_inbatch": (256, 256, 32, 256, 128),
    "rerank_colbert_1q": (1, 1000, 32, 300, 128),
    "rerank_colpali_1q": (1, 1000, 128, 1024, 128),
    "longdoc": (16, 32, 32, 8192, 128),
    "scan_32q_10k": (32, 10000, 32, 256, 128),
}


TRAIN_CASES = {"colpali_train": (128, 128, 128, 1024, 128), "colbert_train": (256, 256, 32, 256, 128)}


def run_train(case, shape, mode, dtype):
    """late-interaction-kernels fwd+bwd (sum of scores, backward) with backward=mode."""
    import torch
    import triton.testing
    import late_interaction_kernels as lik

    nq, nd, lq, ld, dim = shape
    dt = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    torch.manual_seed(0)
    q = torch.randn(nq, lq, dim, device="cuda", dtype=dt, requires_grad=True)
    d = torch.randn(nd, ld, dim, device="cuda", dtype=dt, requires_grad=True)

    def f():
        q.grad = None
        d.grad = None
        lik.maxsim(q, d, backward=mode).sum().backward()

    f()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    f()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 1e6
    ms = triton.testing.do_bench(f, warmup=100, rep=500, return_mode="median")
    return {"case": case, "impl": "lik_" + mode, "version": version("lik"), "device": torch.cuda.get_device_name(),
            "shape": list(shape), "dtype": dtype, "median_ms": round(ms, 4), "peak_mem_mb": round(peak, 1)}


def run_one(case, shape, impl, dtype):
    import torch
    import triton.testing

    nq, nd, lq, ld, dim = shape
    dt = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    torch.manual_seed(0)
    q = torch.randn(nq, lq, dim, device="cuda", dtype=dt)
    d = torch.randn(nd, ld, dim, device="cuda", dtype=dt)
    if impl == "lik":
        import late_interaction_kernels as lik

        f = lambda: lik.maxsim(q, d)  # noqa: E731
    elif impl == "flash":
        import flash_maxsim

        f = lambda: flash_maxsim.flash_maxsim_batched(q, d)  # noqa: E731
    else:  # PyLate's colbert_scores formula (materializes [Nq, Nd, Lq, Ld])
        if nq * nd * lq * ld * 2 > 40e9:
            return None
        f = lambda: torch.einsum("ash,bth->abst", q, d).max(axis=3).values.sum(axis=2)  # noqa: E731
    f()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    f()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 1e6
    ms = triton.testing.do_bench(f, warmup=100, rep=500, return_mode="median")
    flop = 2 * nq * nd * lq * ld * dim
    return {"case": case, "impl": impl, "version": version(impl), "device": torch.cuda.get_device_name(),
            "shape": list(shape), "dtype": dtype, "median_ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1),
            "peak_mem_mb": round(peak, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append")
    ap.add_argument("--impl", action="append")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--dim", type=int, help="override the embedding dim of every case")
    ap.add_argument("--fresh", type=int, default=2)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--train", action="store_true", help="fwd+bwd of late-interaction-kernels, each backward mode")
    a = ap.parse_args()
    ap_train = a.train
    impls = a.impl or (["train_unified", "train_lowmem"] if ap_train else ["lik", "flash", "pylate"])
    cases = a.case or list(TRAIN_CASES if ap_train else CASES)
    if a.child:
        for c in cases:
            for i in impls:
                r = run_train(c, TRAIN_CASES[c], i[len("train_"):], a.dtype) if i.startswith("train_") \
                    else run_one(c, CASES[c][:4] + (a.dim or CASES[c][4],), i, a.dtype)
                if r:
                    print(json.dumps(r), flush=True)
        return
    for c in cases:
        for i in impls:
            best = None
            for _ in range(a.fresh if i != "pylate" else 1):
                cmd = [sys.executable, __file__, "--child", "--case", c, "--impl", i, "--dtype", a.dtype]
                out = subprocess.run(cmd + (["--dim", str(a.dim)] if a.dim else []), capture_output=True, text=True)
                for line in out.stdout.splitlines():
                    if line.startswith("{"):
                        r = json.loads(line)
                        if best is None or r["median_ms"] < best["median_ms"]:
                            best = r
                if out.returncode != 0:
                    print(json.dumps({"case": c, "impl": i, "error": out.stderr[-400:]}), flush=True)
            if best:
                print(json.dumps(best), flush=True)


if __name__ == "__main__":
    main()
