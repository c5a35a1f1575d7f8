"""torch's scaled_dot_product_attention on the cases of `bench --attention`.

    python3 bench/attention_peers.py [--dtype bf16|f16] [--iters 50]

One JSON line per case and implementation, as examples/bench.rs prints:
forward ("sdpa") and forward + backward of the output's sum
("sdpa_train"), timed by triton.testing.do_bench (L2 flushed, CUDA events,
median). q, k, v are [B, H, L, dh] (the layout SDPA's fused kernels take);
a window becomes a boolean mask, which SDPA runs on its memory-efficient
kernel.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

CASES = [
    (32, 180, 12, 32, None),
    (32, 512, 12, 64, None),
    (32, 512, 12, 64, 64),
    (16, 512, 16, 128, None),
    (4, 4096, 12, 64, None),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    dt = {"bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    for b, l, h, dh, window in CASES:
        q, k, v = (torch.randn(b, h, l, dh, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        mask = None
        if window is not None:
            i = torch.arange(l, device="cuda")
            mask = (i[:, None] - i[None, :]).abs() <= window
        pairs = l * l if window is None else int(mask.sum())
        fwd_flops = 4.0 * b * h * dh * pairs

        def fwd():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        def train():
            q.grad = k.grad = v.grad = None
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()

        for name, f, flops in [("sdpa", fwd, fwd_flops), ("sdpa_train", train, 3.5 * fwd_flops)]:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = do_bench(f, rep=200, return_mode="median")
            peak = (torch.cuda.max_memory_allocated() - base) / 1e6
            print(json.dumps({"case": "attention", "impl": name, "torch": torch.__version__, "dtype": a.dtype,
                              "shape": [b, l, h, dh], "window": window, "median_ms": round(ms, 4),
                              "tflops": round(flops / ms / 1e9, 1), "peak_mem_mb": round(peak, 1)}), flush=True)


if __name__ == "__main__":
    main()
