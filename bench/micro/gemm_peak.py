"""Dense GEMM peaks of the GPU for the floors in BENCHMARKS.md: cuBLAS (through
PyTorch) on square M = N = K products, BF16 (`torch.matmul`), FP8 e4m3
(`torch._scaled_mm`, per-tensor scales, BF16 out, Hopper and later) and INT8
(`torch._int_mm`, s32 out), timed as `triton.testing.do_bench` (L2 flushed,
CUDA events, median). One JSON line per dtype and size:

    python3 bench/micro/gemm_peak.py [--sizes 4096,8192,16384]
"""

import argparse
import json

import torch
import triton.testing


def bench(fn):
    return triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,8192,16384")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    cap = torch.cuda.get_device_capability()
    for n in (int(s) for s in args.sizes.split(",")):
        a = torch.randn(n, n, device=dev)
        b = torch.randn(n, n, device=dev)
        cases = {}
        ab, bb = a.bfloat16(), b.bfloat16()
        cases["bf16"] = lambda: torch.matmul(ab, bb)
        if cap >= (8, 9):
            a8 = a.clamp(-448, 448).to(torch.float8_e4m3fn)
            b8 = b.clamp(-448, 448).to(torch.float8_e4m3fn).t().contiguous().t()  # column-major B
            one = torch.ones((), device=dev)
            cases["e4m3"] = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        ai = (a * 20).clamp(-127, 127).to(torch.int8)
        bi = (b * 20).clamp(-127, 127).to(torch.int8).t().contiguous().t()
        cases["i8"] = lambda: torch._int_mm(ai, bi)
        for dtype, fn in cases.items():
            ms = bench(fn)
            print(json.dumps({"bench": "gemm_peak", "gpu": torch.cuda.get_device_name(),
                              "dtype": dtype, "m": n, "n": n, "k": n, "ms": ms,
                              "tflops": 2 * n ** 3 / ms / 1e9}), flush=True)


if __name__ == "__main__":
    main()
