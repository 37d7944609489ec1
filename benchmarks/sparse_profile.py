"""``python -m benchmarks.sparse_profile [--seqlens 16384 --densities 0.1,0.2]``: where the time of
the block- and column-sparse ops goes, kernel by kernel (torch.profiler), next to their CUDA-event
time per call (back-to-back calls, interleaved rounds as benchmarks.sparse runs them).

Why both: at the H200's power cap the two disagree by 6-10 % (session 39: the block-sparse op at
16K / 10 % took 0.783 ms per call by events and 0.729 ms of kernels under the profiler, which idles
the GPU between kernels and so lets it clock higher; csrc/NOTES.md "Session 39"). The kernel times
say how an op's kernels divide its work (the column op's gather, the attention kernel's two
launches, the fills); only the event times compare with benchmarks.sparse's ratios.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

import torch

from . import sparse as bs
from .__main__ import _time_once

PROFILED_CALLS = 30


def kernel_label(name: str) -> str:
    """A short name for a CUDA kernel of these ops (the profiler's demangled name)."""
    m = re.search(r"block_sparse_fwd_kernel<.*,\s*(true|false),\s*(true|false)\s*>", name)
    if m:
        return "attention" + (" (column form)" if m.group(1) == "true" else "") + (
            ", split tail" if m.group(2) == "true" else "")
    for key in ("column_gather", "work_order", "fill", "memset"):
        if key in name.lower():
            return key
    return name[:50]


def kernel_times(fn, label=kernel_label, calls: int = PROFILED_CALLS) -> tuple[dict, collections.Counter]:
    """Microseconds of GPU time per call of ``fn`` by ``label(kernel name)`` under torch.profiler
    (after 5 warm-up calls), and launches per call."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us, launches = collections.defaultdict(float), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[label(e.name)] += e.device_time / calls
            launches[label(e.name)] += 1
    return dict(us), collections.Counter({k: n // calls for k, n in launches.items()})


def event_ms(fn, calls: int = 40) -> float:
    """CUDA-event milliseconds per call over ``calls`` back-to-back calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    return _time_once(None, fn, calls)


def profile_case(case: bs.SparseCase, rounds: int = 5) -> list[str]:
    q, k, v = bs._inputs(case)
    bidx, bcnt = bs.block_pattern(case)
    cidx, ccnt = bs.column_pattern(case)
    fns = {"block op": bs.make_ours(case, q, k, v, bidx, bcnt),
           "column op": bs.make_column(case, q, k, v, cidx, ccnt),
           "column kernel": bs.make_column_kernel(case, q, k, v, cidx, ccnt),
           "column gather": bs.make_column_gather(case, k, v, cidx, ccnt)}
    fns = {name: fn for name, fn in fns.items() if fn is not None}
    times = collections.defaultdict(list)
    for r in range(rounds):  # forward and reversed in turn: no contender always first
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            times[name].append(event_ms(fns[name]))
    lines = [f"== {case.label}"]
    for name, fn in fns.items():
        us, launches = kernel_times(fn)
        parts = ", ".join(f"{label} {t:.1f} us (x{launches[label]})"
                          for label, t in sorted(us.items(), key=lambda x: -x[1]))
        median = sorted(times[name])[len(times[name]) // 2]
        lines.append(f"  {name:14s} event {median:.4f} ms / call, kernels {sum(us.values()) / 1e3:.4f}"
                     f" ms: {parts}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse_profile",
                                description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", default="16384")
    p.add_argument("--densities", default="0.1,0.2")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the profile needs a CUDA GPU")
        return 1
    for s in (int(x) for x in a.seqlens.split(",")):
        for d in (float(x) for x in a.densities.split(",")):
            print("\n".join(profile_case(bs.SparseCase(s, d))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
