"""late-interaction-kernels (pinned: 0.4.5) on the PLAID cases of
`examples/bench.rs --residual` and `--plaid-approx`, one JSON line each:

    python3 bench/peers_plaid.py

residual_varlen_nb{2,4}: `maxsim_residual_varlen`, 1 query (Lq 32, dim 128,
bf16) against 10 000 packed documents of 150..=300 tokens, 65 536 fp16
centroids, normalize=True. plaid_approx: `plaid_approx_score`, 65 536
centroids, Lq 32, 100 000 documents of 1..=64 codes. Timed with
triton.testing.do_bench (L2 flushed, CUDA events), median. Needs torch and triton.
"""
import json

import torch
import triton.testing
import late_interaction_kernels as lik
from late_interaction_kernels.plaid import maxsim_residual_varlen, plaid_approx_score

from importlib.metadata import version

VERSION = version("late-interaction-kernels")


def bench(f):
    f()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    f()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 1e6
    return triton.testing.do_bench(f, warmup=100, rep=500, return_mode="median"), peak


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(12345)
    n_c, dim, lq, nd = 65536, 128, 32, 10000
    lens = torch.randint(150, 301, (nd,), generator=g)
    cu = torch.zeros(nd + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    t = int(cu[-1])
    cu = cu.cuda()
    q = torch.nn.functional.normalize(torch.randn(1, lq, dim, device="cuda"), dim=-1).to(torch.bfloat16)
    cents = torch.nn.functional.normalize(torch.randn(n_c, dim, device="cuda"), dim=-1).to(torch.float16)
    codes = torch.randint(0, n_c, (t,), device="cuda", dtype=torch.int32)
    for nbits in (2, 4):
        res = torch.randint(0, 256, (t, dim * nbits // 8), device="cuda", dtype=torch.uint8)
        bw = ((torch.arange(1 << nbits, device="cuda", dtype=torch.float32) - ((1 << nbits) - 1) / 2) * 0.02)
        f = lambda: maxsim_residual_varlen(q, codes, res, cu, cents, bw, nbits, max_seqlen_d=300,  # noqa: E731
                                               normalize=True)
        ms, peak = bench(f)
        print(json.dumps({"case": f"residual_varlen_nb{nbits}", "impl": "lik", "version": VERSION,
                          "shape": [1, nd, lq, t, dim],
                          "median_ms": round(ms, 4), "peak_mem_mb": round(peak, 1)}), flush=True)
    b, ld = 100000, 64
    qcs = torch.randn(n_c, lq, device="cuda")
    lens = torch.randint(1, ld + 1, (b,), device="cuda")
    codes = torch.randint(0, n_c, (b, ld), device="cuda")
    ms, peak = bench(lambda: plaid_approx_score(qcs, codes, lens))
    print(json.dumps({"case": "plaid_approx", "impl": "lik", "version": VERSION, "shape": [n_c, lq, b, ld],
                      "median_ms": round(ms, 4),
                      "peak_mem_mb": round(peak, 1)}), flush=True)


if __name__ == "__main__":
    main()
