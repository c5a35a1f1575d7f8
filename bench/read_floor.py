"""What a memory-bound reader can reach when timed as every benchmark here
times it (an L2 flush by a 256 MB memset before each run, CUDA events
around the run, the median: `triton.testing.do_bench`'s method).

The memset leaves the L2 full of dirty lines; the timed kernel's reads
evict them, so it also pays for their write-back. Each probe (torch's
`amax` over the bytes a rerank reads, 1 000 documents x 300 or 1 024
tokens x 128 bf16) is timed twice: after the memset alone, and after the
memset plus a 256 MB read (the L2 then holds clean lines). The difference
is the method's write-back, a constant of the GPU, not of the kernel.

    python3 bench/read_floor.py

Prints one JSON line per probe, size and flush.
"""
import json

import torch


def median_ms(f, clean, runs=100, warmup=10):
    cache = torch.empty(64_000_000, dtype=torch.int32, device="cuda")
    other = torch.empty_like(cache)
    times = []
    for i in range(warmup + runs):
        cache.zero_()
        if clean:
            other.amax()  # evicts the memset's dirty lines with clean ones
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        f()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main():
    device = torch.cuda.get_device_name()
    for rows in (300_000, 1_024_000):
        x = torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16)
        for clean in (False, True):
            ms = median_ms(lambda: x.amax(), clean)
            mb = x.numel() * 2 / 1e6
            print(json.dumps({"device": device, "probe": "amax", "mb": mb,
                              "flush": "memset+read" if clean else "memset", "ms": ms, "tb_s": mb / ms / 1e6}))


if __name__ == "__main__":
    main()
