"""Where a training step's time goes beyond its forward and backward:
``python -m benchmarks.step_gap [--n 1024,2048,8192] [--rounds 5]``.

For each half length n (16K tokens per batch, H=16, D=128, bf16, block_size 16) and each of our
default backend and cuDNN causal on the halves (the benchmark's own callables,
benchmarks/contenders.py): the forward (no grad), the backward of a retained graph and the eager
step, and the same step captured once in a CUDA graph and replayed, which takes the host out of
the loop. All in shuffled rounds in one process (DESIGN.md section 5), medians in ms. The last two
columns divide the eager and the replayed step by forward + backward: the replayed ratio is the
GPU work a step adds (the ones_like fill of autograd's seed, the gaps between kernels), the eager
one adds what the host costs on top. Session 23 (csrc/NOTES.md): replayed 1.01x at n = 1K / 2K
for ours and cuDNN's alike, eager 1.08 / 1.05 for ours against 1.06 / 1.05 for cuDNN's.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from .__main__ import _calls_per_measurement, _time_once, shuffled_rounds
from .contenders import Case, causal_halves, ours

MODES = ("fwd", "bwd", "step", "graph step")
HEAD = ("| case | contender | fwd ms | bwd ms | fwd + bwd | step | graph step | step / (fwd + bwd) "
        "| graph / (fwd + bwd) |\n|---|---|---|---|---|---|---|---|---|")


def graphed(step):
    """``step`` captured once in a CUDA graph (after warm-up calls on a side stream, as capture
    requires): returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    return graph.replay


def row(label: str, contender: str, ms: dict) -> str:
    """One table line from {mode: ms}."""
    f, b, step, graph = (ms[m] for m in MODES)
    return (f"| {label} | {contender} | {f:.3f} | {b:.3f} | {f + b:.3f} | {step:.3f} | "
            f"{graph:.3f} | {step / (f + b):.3f} | {graph / (f + b):.3f} |")


def measure(case: Case, rounds: int) -> list[str]:
    from torch.nn.attention import SDPBackend

    fns = {}
    for name, modes in (("dlm_ops", ours(case)),
                        ("cudnn causal halves", causal_halves(case, SDPBackend.CUDNN_ATTENTION))):
        for mode in MODES[:3]:
            fns[name, mode] = modes[mode]
        fns[name, "graph step"] = (None, graphed(modes["step"][1]))
    iters = {}
    for key, (setup, fn) in fns.items():
        _time_once(setup, fn, 2)
        iters[key] = _calls_per_measurement(setup, fn)
    times = shuffled_rounds(list(fns), rounds, lambda key: _time_once(*fns[key], iters[key]))
    names = dict.fromkeys(name for name, _ in fns)
    return [row(case.label, name, {m: statistics.median(times[name, m]) for m in MODES})
            for name in names]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", default="1024,2048,8192", help="half lengths (16K tokens per batch)")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.step_gap needs a CUDA GPU")
    print(HEAD)
    for n in (int(x) for x in a.n.split(",")):
        for line in measure(Case(16 * 1024 // (2 * n), n, 16, 16, 128, 16), a.rounds):
            print(line, flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
