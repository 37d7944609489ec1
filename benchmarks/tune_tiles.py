"""``python -m benchmarks.tune_tiles``: time the Triton kernels' tile configs on this GPU.

Prints, per head dim, the fastest forward, dK/dV and dQ configurations over a few shapes (the
geomean of their times), to update ``dlm_ops.backends.triton_backend._configs`` from.
"""

from __future__ import annotations

import math
import sys

import torch
import triton

from dlm_ops.backends.triton_backend import ROLES, TileConfig, TritonBackend, candidates
from dlm_ops.geometry import SequenceMask

FWD = [TileConfig(*c) for c in [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                                (64, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3), (128, 64, 8, 4),
                                (64, 64, 4, 4), (64, 32, 4, 3), (128, 128, 4, 3)]]
BWD = [TileConfig(*c) for c in [(128, 32, 8, 2), (128, 32, 4, 3), (64, 32, 4, 3), (128, 64, 8, 2),
                                (64, 64, 4, 2), (128, 32, 4, 5), (64, 16, 4, 4), (128, 64, 8, 3),
                                (64, 64, 8, 3)]]


def _inputs(batch, n, heads, d):
    q, k, v, do = (torch.randn(batch, 2 * n, heads, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    return q, k, v, do


def _time(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def tune(d: int, shapes, block_size=16):
    base = tuple(candidates(role, d)[0] for role in ROLES)
    results = {"fwd": {}, "dkdv": {}, "dq": {}}
    for batch, n, heads in shapes:
        q, k, v, do = _inputs(batch, n, heads, d)
        mask = SequenceMask.block_diffusion(2 * n, block_size)
        scale = 1 / math.sqrt(d)
        out, lse = TritonBackend().fwd(q, k, v, mask, scale, 0.0, False)
        for part, cands in (("fwd", FWD), ("dkdv", BWD), ("dq", BWD)):
            for c in cands:
                cfgs = {"fwd": (c, base[1], base[2]), "dkdv": (base[0], c, base[2]),
                        "dq": (base[0], base[1], c)}[part]
                be = TritonBackend(configs=cfgs)
                fn = (lambda: be.fwd(q, k, v, mask, scale, 0.0, False)) if part == "fwd" else \
                    (lambda: be.bwd(do, q, k, v, out, lse, None, mask, scale, 0.0, True))
                try:
                    ms = _time(fn)
                except Exception as e:  # out of shared memory / registers: not a candidate
                    ms = float("inf")
                    print(f"  D={d} {part} {c}: {type(e).__name__}", file=sys.stderr)
                results[part].setdefault(c, []).append(ms)
    for part, by_cfg in results.items():
        ranked = sorted(by_cfg.items(), key=lambda kv: math.prod(kv[1]))
        print(f"D={d} {part}: " + "; ".join(
            f"{c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages}: "
            + "/".join(f"{t:.3f}" for t in ts) for c, ts in ranked[:4]))


if __name__ == "__main__":
    dims = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "128").split(",")]
    for d in dims:
        tune(d, [(8, 1024, 16), (2, 4096, 16)] if d <= 128 else [(4, 2048, 16)])
