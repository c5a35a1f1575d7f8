"""CPU peers at the rerank shapes of benches/cpu.rs (1 query [32,128] against
1000 documents of 300 or 1024 tokens, dim 128, f32 unit vectors): maxsim-cpu 0.1.0 (mixedbread,
Rust + libxsmm) and numpy einsum. Median of 15 host-timed runs after a
warm-up; one JSON line each.

    pip install maxsim-cpu==0.1.0 numpy && python3 bench/cpu_peers.py
"""
import json
import time

import numpy as np


def unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def median_ms(f, iters=15):
    f()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


import maxsim_cpu  # noqa: E402
from importlib.metadata import version  # noqa: E402

VERSIONS = {"maxsim_cpu": version("maxsim-cpu"), "numpy_einsum": np.__version__}
rng = np.random.default_rng(0)
for case, ld in (("rerank_1q_1000", 300), ("rerank_1q_1000_ld1024", 1024)):
    q = unit(rng.standard_normal((32, 128)))
    d = unit(rng.standard_normal((1000, ld, 128)))
    flop = 2 * 32 * 1000 * ld * 128
    cases = {
        "maxsim_cpu": lambda: maxsim_cpu.maxsim_scores(q, d),
        "numpy_einsum": lambda: np.einsum("sh,bth->bst", q, d).max(axis=2).sum(axis=1),
    }
    ref = cases["numpy_einsum"]()
    assert np.allclose(cases["maxsim_cpu"](), ref, atol=1e-3)
    for name, f in cases.items():
        ms = median_ms(f)
        print(json.dumps({"case": case, "impl": name, "version": VERSIONS[name], "device": "cpu",
                          "shape": [1, 1000, 32, ld, 128],
                          "dtype": "F32", "median_ms": round(ms, 3), "gflops": round(flop / ms / 1e6, 1)}), flush=True)
