"""Sustained clock and power of the sparse preset's contenders: ``python -m benchmarks.power``.

Each contender runs back to back for ``--seconds`` while ``nvidia-smi`` samples the SM clock, the
board power and the temperature every 20 ms; the report is the time per call and the medians of
the samples after the first third (the clock settles). Bf16, B 1, H 32/8, D 128, S 16K
(``--seqlen``): dense cuDNN (the goal's denominator), cuDNN over the equal-work keys, and our block-
and column-sparse ops at 10 % and 50 % (benchmarks/sparse.py's patterns). Session 23 (csrc/NOTES.md):
every one of them draws 688-691 W, the H200's cap, so the clock is what differs (dense cuDNN
1635 MHz, ours 1665-1770), and the goal's ratio moves with how hard a machine throttles the dense
baseline.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess

import torch

from . import sparse

QUERY = "clocks.sm,power.draw,temperature.gpu"


def settled(samples: list[str]) -> tuple[float, float, float]:
    """Medians of (MHz, W, C) over nvidia-smi's csv lines after the first third."""
    rows = [tuple(float(x) for x in line.split(",")) for line in samples if line.count(",") == 2]
    tail = rows[len(rows) // 3:]
    if not tail:
        return float("nan"), float("nan"), float("nan")
    return tuple(statistics.median(r[i] for r in tail) for i in range(3))


def sample(fn, seconds: float) -> tuple[float, float, float, float, int]:
    """(ms per call, MHz, W, C, samples) over ~``seconds`` of back-to-back calls."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    calls = max(1, int(seconds * 1e3 / start.elapsed_time(end)))
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                            "-lms", "20"], stdout=subprocess.PIPE, text=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    return (start.elapsed_time(end) / calls, *settled(lines), len(lines))


def contenders(seqlen: int) -> dict:
    case = sparse.SparseCase(seqlen, 0.1)
    q, k, v = sparse._inputs(case)
    fns = {f"dense cudnn {seqlen // 1024}K": sparse.make_dense(case, q, k, v)}
    for density in (0.1, 0.5):
        c = sparse.SparseCase(seqlen, density)
        label = f"{seqlen // 1024}K / {density:.0%}"
        fns[f"cudnn equal work {label}"] = sparse.make_equal_work(c, q, k, v)
        fns[f"dlm_ops block {label}"] = sparse.make_ours(c, q, k, v, *sparse.block_pattern(c))
        fns[f"dlm_ops column {label}"] = sparse.make_column(c, q, k, v, *sparse.column_pattern(c))
    return fns


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.power needs a CUDA GPU (and nvidia-smi)")
    fns = contenders(a.seqlen)
    print("| contender | ms per call | SM MHz | W | C | samples |\n|---|---|---|---|---|---|")
    for _ in range(a.rounds):
        for name, fn in fns.items():
            ms, mhz, watts, celsius, n = sample(fn, a.seconds)
            print(f"| {name} | {ms:.3f} | {mhz:.0f} | {watts:.0f} | {celsius:.0f} | {n} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
