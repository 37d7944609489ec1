"""``python -m benchmarks``: contenders interleaved in rounds inside one process (DESIGN.md 5).

Every round times each (contender, mode) once, round r opening with the r-th and taking the rest
in a seeded shuffle (shuffled_rounds), so clock and neighbour drift hits all alike; the report is
the median over rounds, TFLOPS on visible pairs, and ratios against the cuDNN causal-on-halves
yardstick and compiled FlexAttention measured in the same process. Results land in ``--out`` as
JSON rows, a markdown table and a plot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from .contenders import (CONTENDERS, EXACT_CONTENDERS, VARLEN_CONTENDERS, YARDSTICK, Case,
                         ExactCase, VarlenCase)

TOKENS = 16 * 1024  # per batch, DESIGN.md section 5


def _preset(name: str) -> list[Case]:
    def main_case(n, bs, d=128, h=16, hkv=16):
        return Case(max(1, TOKENS // (2 * n)), n, h, hkv, d, bs)

    if name == "quick":
        return [main_case(n, 16) for n in (1024, 4096)]
    if name == "main":
        cases = [main_case(n, bs) for bs in (16, 4) for n in (1024, 2048, 4096, 8192)]
        cases += [main_case(2048, 16, d=d) for d in (64, 256)]
        return cases + [main_case(n, 16, h=32, hkv=8) for n in (2048, 8192)]
    if name == "odd":  # halves that are not multiples of 128: the CUTLASS kernels' kStartAny tiles
        return [main_case(n, 16) for n in (1000, 4000)] + [main_case(2000, 16, d=64)]
    if name == "varlen":  # packed samples, 16K tokens: equal ones (the batched work), odd, mixed
        mixed, total, i = [], 0, 0
        while True:  # halves in [1, 2048), a fixed pseudo-random mix, up to 8K halves in all
            n = 1 + (7919 * i * i + 104729 * i + 13) % 2047
            if total + n >= TOKENS // 2:
                mixed.append(TOKENS // 2 - total)  # the rest: 16K tokens in all
                break
            mixed.append(n)
            total, i = total + n, i + 1
        return [VarlenCase("equal", (1024,) * 8), VarlenCase("equal", (4096,) * 2),
                VarlenCase("odd", (1000,) * 8), VarlenCase("mixed", tuple(mixed)),
                VarlenCase("mixed", tuple(mixed), heads=32, kv_heads=8)]
    if name == "exact":  # dlm_ops.attention against SDPA, DESIGN.md's shape budget
        return [ExactCase(max(1, TOKENS // s), 16, s, d, causal)
                for causal in (True, False) for d in (64, 128) for s in (1024, 4096, 8192)]
    if name == "sweep":
        cases = [main_case(n, bs) for bs in (4, 16, 64) for n in (512, 1024, 2048, 4096, 8192, 16384)]
        cases += [main_case(n, 16, d=d) for d in (64, 256) for n in (1024, 4096)]
        cases += [main_case(n, 16, h=32, hkv=8) for n in (1024, 4096)]
        return cases
    raise SystemExit(f"unknown preset {name!r}")


def _time_once(setup, fn, iters: int) -> float:
    if setup:
        setup()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


# GPU time per measurement. The start event fires before the first call is dispatched, so one
# call's host latency lands in every measurement: with 3 calls per measurement (sessions 1-3) that
# cost our op, whose eager dispatch takes ~0.13 ms, 10-25% at n = 1K (H200, session 4: Triton
# forward 201 TFLOPS in the benchmark against 266 over 30 back-to-back calls). 25 ms of work
# makes it < 1% for every contender.
MEASURE_MS = 25.0


def _calls_per_measurement(setup, fn) -> int:
    """How many back-to-back calls make MEASURE_MS of GPU time (3 to 500), from one short run."""
    ms = _time_once(setup, fn, 3)
    return max(3, min(500, math.ceil(MEASURE_MS / max(ms, 1e-3))))


def shuffled_rounds(keys: list, rounds: int, measure, seed: int = 0) -> dict:
    """{key: [one measurement per round]}: every round measures every key once; round r opens with
    key r (mod the count) and takes the others in a fresh seeded shuffle. A fixed order let the
    GPU's state at a position (clocks ramping up after an idle setup, or power throttling after a
    heavy neighbour) favour one contender: in session 7's kernel A/Bs that alone moved a result by
    up to 15 %. Rotating a fixed order (sessions 7-15) still gave every key the same predecessor,
    and the predecessor matters: at S = 32K the column-sparse op read 5-11 % above its own gather +
    kernel when it always followed a cuDNN call, 2-4 % below when it followed Triton's column
    kernel, and level alone (session 16, H200; it explains the 5-10 % "outside the kernel" of
    benchmarks.sparse since session 15 put the cuDNN equal-work contender before it)."""
    times = {key: [] for key in keys}
    rng = random.Random(seed)
    for r in range(rounds if keys else 0):
        i = r % len(keys)
        rest = keys[:i] + keys[i + 1:]
        rng.shuffle(rest)
        for key in [keys[i], *rest]:
            times[key].append(measure(key))
    return times


def bench_case(case, contenders: dict, modes: list[str], rounds: int,
               refs: tuple[str, ...]) -> list[dict]:
    built, iters = {}, {}
    for name, make in contenders.items():
        if name == "sdpa dense mask" and case.n > 4096:
            continue  # (2n)^2 scores per head: minutes per round, and not a contender at this size
        try:
            built[name] = make(case)
            for mode in modes:  # warm-up: compilation, autotuning, allocator
                setup, fn = built[name][mode]
                _time_once(setup, fn, 2)
                iters[name, mode] = _calls_per_measurement(setup, fn)
        except Exception as e:  # a contender that cannot run this case is reported, not fatal
            print(f"  {name}: skipped ({type(e).__name__}: {str(e)[:120]})", flush=True)
            built.pop(name, None)
    times = shuffled_rounds([(c, m) for c in built for m in modes], rounds,
                            lambda key: _time_once(*built[key[0]][key[1]], iters[key]))
    rows = []
    for (c, m), ts in times.items():
        ms = statistics.median(ts)
        rows.append(dict(case=case.label, contender=c, mode=m, ms=ms,
                         tflops=case.flops(m) / ms / 1e9,
                         **dict(case.__dict__, dtype=str(case.dtype).removeprefix("torch."))))
    for r in rows:
        for ref in refs:
            base = next((x for x in rows if x["contender"] == ref and x["mode"] == r["mode"]), None)
            r[f"ratio_vs_{ref}"] = base["ms"] / r["ms"] if base else None
    return rows


def _markdown(rows: list[dict], modes: list[str], refs: tuple[str, ...]) -> str:
    contenders = list(dict.fromkeys(r["contender"] for r in rows))
    head = ["case", "mode", *[f"{c} TFLOPS" for c in contenders],
            *[f"dlm_ops / {ref}" for ref in refs]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in dict.fromkeys(r["case"] for r in rows):
        for mode in modes:
            cell = {r["contender"]: r for r in rows if r["case"] == case and r["mode"] == mode}
            if not cell:
                continue
            ours = cell.get("dlm_ops", {})
            fmt = lambda x: "-" if x is None else f"{x:.2f}"
            lines.append("| " + " | ".join([case, mode, *[
                f"{cell[c]['tflops']:.0f}" if c in cell else "-" for c in contenders],
                *[fmt(ours.get(f"ratio_vs_{ref}")) for ref in refs]]) + " |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (pip install -e '.[bench]')")
        return
    sel = [r for r in rows if r["mode"] == "step" and r["head_dim"] == 128
           and r.get("kv_heads") == r["heads"]]
    if not sel:
        return
    block_sizes = sorted({r["block_size"] for r in sel})
    fig, axes = plt.subplots(1, len(block_sizes), figsize=(6 * len(block_sizes), 4), squeeze=False)
    for ax, bs in zip(axes[0], block_sizes):
        for c in dict.fromkeys(r["contender"] for r in sel):
            pts = sorted((r["n"], r["tflops"]) for r in sel if r["contender"] == c and r["block_size"] == bs)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=c)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("n (tokens per half)")
        ax.set_ylabel("training step TFLOPS (visible pairs)")
        ax.set_title(f"bf16 D=128 H=16, 16K tokens/batch, block_size {bs}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_meta(**extra) -> dict:
    """What every result row carries: GPU, torch, triton, the commit and the CUDA sources' hash.
    The device machine may get a copy of the tree whose .git is missing or stale (session 16's
    rows read a commit three behind): DLM_COMMIT names the commit there, and ``csrc`` (the hash
    in the extensions' build directories) says which kernel sources ran either way."""
    import triton

    from dlm_ops.backends import cutlass

    commit = os.environ.get("DLM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                commit=commit or "unknown", csrc=cutlass.source_hash(), **extra)


def write_results(folder, tag: str, rows: list[dict], meta: dict, what: str, table: str) -> None:
    """``tag``.json (the rows) and ``tag``.md (a header line naming the machine, then ``what``,
    then the table) into ``folder``; the table is printed last."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{tag}.md").write_text(f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
                                   f"commit {meta['commit']}, csrc {meta.get('csrc', '-')}; "
                                   f"{what}\n\n{table}\n")
    print("\n" + table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="main", choices=["quick", "main", "sweep", "exact", "odd", "varlen"],
                   help="exact: dlm_ops.attention vs SDPA; the others: block diffusion")
    p.add_argument("--contenders", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--modes", default="fwd,bwd,step")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="file name stem of the results (default h200_PRESET)")
    p.add_argument("--only", default=None,
                   help="keep the preset's cases whose label contains this text (e.g. 'bs=16')")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the benchmarks need a CUDA GPU")
        return 1
    meta = run_meta()
    cases, modes = _preset(a.preset), a.modes.split(",")
    if a.only:
        cases = [c for c in cases if a.only in c.label]
    table_of = {"exact": EXACT_CONTENDERS, "varlen": VARLEN_CONTENDERS}.get(a.preset, CONTENDERS)
    refs = {"exact": ("sdpa cudnn", "sdpa flash"),
            "varlen": ("dlm_ops triton", "dlm_ops batched", YARDSTICK)}.get(
                a.preset, (YARDSTICK, "flex BD3"))
    names = a.contenders.split(",") if a.contenders else list(table_of)
    contenders = {n: table_of[n] for n in names}
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = lambda x, **kw: x
    rows = []
    for case in tqdm(cases, desc="cases", file=sys.stdout):
        print(f"\n{case.label}", flush=True)
        rows += [dict(meta, **r) for r in bench_case(case, contenders, modes, a.rounds, refs)]
        torch.cuda.empty_cache()
    out, tag = Path(a.out), a.tag or f"h200_{a.preset}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(rows, indent=1))
    table = _markdown(rows, modes, refs)
    (out / f"{tag}.md").write_text(
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}, "
        f"csrc {meta['csrc']}; median of {a.rounds} interleaved rounds; TFLOPS on visible "
        f"pairs.\n\n{table}\n")
    if a.preset != "varlen":  # the plot's x axis is n
        _plot(rows, out / f"{tag}.png")
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
