"""Two builds of the diffusion extension, each timed against cuDNN in its own processes:
``python -m benchmarks.build_ab OTHER_DIR [--repeats 3] [--rounds 6] [--cases 0,5] [--modes fwd]``.

A kernel change A/B through torch. OTHER_DIR is a build directory of the extension (e.g. the
build of the commit before the change, under DLM_OPS_BUILD_DIR); this checkout's sources name the
other. Both cannot share one process: there a call through the second-loaded module failed with
"invalid argument" (session 25; likely their kernels' identical symbol names, not confirmed, with
the forward's shared memory 80 bytes larger in one). So the builds alternate, one process each
(``--repeats`` times), and each process times ours against cuDNN causal on the halves in shuffled
rounds, the yardstick measured beside it (DESIGN.md section 5); the table compares the builds'
median ratios to cuDNN: bf16, 16K tokens, D = 64 / 128 / 256, GQA 32/8,
block sizes 4 and 16; forward, backward and step. ``--modes`` and ``--cases`` (indices into
CASES) time a subset, so a second look at a few rows costs a fraction of the full table. Needs an
sm90 GPU.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import subprocess
import sys

CASES = ((8, 1024, 16, 16, 128, 16), (8, 1024, 16, 16, 128, 4), (4, 2048, 16, 16, 128, 16),
         (1, 8192, 16, 16, 128, 16), (4, 2048, 32, 8, 128, 16), (4, 2048, 16, 16, 64, 16),
         (4, 2048, 16, 16, 256, 16),
         # A control: block 128 takes none of the paths for block sizes dividing 64 (the forward's
         # narrow diagonal visit, session 29), so it shows what such a change costs everything else.
         (4, 2048, 16, 16, 128, 128),
         # n = 1K at D = 64 and with GQA 32/8: where the forward's narrow kernel runs (halves up to
         # 1024, cutlass_diffusion.NARROW_DIAG_MAX_HALF), besides cases 0 and 1.
         (8, 1024, 16, 16, 64, 16), (8, 1024, 32, 8, 128, 16))
MODES = ("fwd", "bwd", "step")


def load_build(directory: str):
    """The diffusion extension built in ``directory`` (any source hash)."""
    from pathlib import Path

    from dlm_ops.backends import cutlass

    return cutlass.load_built(*cutlass.built_library("dlm_diffusion_sm90", Path(directory)))


def selected(cases: str | None, modes: str | None) -> tuple[tuple, tuple]:
    """The CASES and MODES named by the comma lists ``cases`` (indices) and ``modes`` (None: all)."""
    shapes = CASES if cases is None else tuple(CASES[int(i)] for i in cases.split(","))
    chosen = MODES if modes is None else tuple(modes.split(","))
    if bad := [m for m in chosen if m not in MODES]:
        raise SystemExit(f"--modes: {bad} not among {MODES}")
    return shapes, chosen


def one_process(other: str | None, rounds: int, shapes=CASES, modes=MODES) -> None:
    """Print 'case|mode|ours ms|cudnn ms' lines for this checkout's build, or ``other``'s."""
    import torch
    from torch.nn.attention import SDPBackend

    from dlm_ops.backends import cutlass_diffusion as cd

    from .__main__ import _calls_per_measurement, _time_once, shuffled_rounds
    from .contenders import Case, causal_halves, ours

    if other:
        cd._EXT = load_build(other)
    elif cd._extension() is None:
        raise SystemExit("this checkout's extension did not build")
    for shape in shapes:
        case = Case(*shape)
        runs = {"ours": ours(case), "cudnn": causal_halves(case, SDPBackend.CUDNN_ATTENTION)}
        keys = [(c, m) for c in runs for m in modes]
        iters = {}
        for c, m in keys:
            _time_once(*runs[c][m], 2)
            iters[c, m] = _calls_per_measurement(*runs[c][m])
        times = shuffled_rounds(keys, rounds, lambda k: _time_once(*runs[k[0]][k[1]], iters[k]))
        for m in modes:
            t_ours, t_cudnn = (statistics.median(times[c, m]) for c in ("ours", "cudnn"))
            print(f"{case.label}|{m}|{t_ours:.4f}|{t_cudnn:.4f}", flush=True)
        del runs
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.build_ab", description=__doc__.splitlines()[0])
    p.add_argument("other", help="the other build directory")
    p.add_argument("--repeats", type=int, default=3, help="processes per build, alternating")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--cases", help="comma list of indices into CASES (default: all)")
    p.add_argument("--modes", help="comma list of fwd, bwd, step (default: all)")
    p.add_argument("--one", choices=("this", "other"), help=argparse.SUPPRESS)  # a child process
    a = p.parse_args(argv)
    try:
        shapes, modes = selected(a.cases, a.modes)
    except (IndexError, ValueError):
        raise SystemExit(f"--cases: indices into the {len(CASES)} CASES, got {a.cases!r}") from None
    if a.one:
        one_process(a.other if a.one == "other" else None, a.rounds, shapes, modes)
        return 0
    ratios = collections.defaultdict(list)  # (build, case, mode) -> cuDNN time / ours, per process
    for _ in range(a.repeats):
        for build in ("other", "this"):
            subset = [*(["--cases", a.cases] if a.cases else []),
                      *(["--modes", a.modes] if a.modes else [])]
            out = subprocess.run([sys.executable, "-m", "benchmarks.build_ab", a.other, "--one", build,
                                  "--rounds", str(a.rounds), *subset],
                                 capture_output=True, text=True, check=True)
            for line in out.stdout.splitlines():
                label, mode, t_ours, t_cudnn = line.split("|")
                ratios[build, label, mode].append(float(t_cudnn) / float(t_ours))
    print(f"other: {a.other}; medians over {a.repeats} processes per build of {a.rounds} rounds each")
    print("| case | mode | other / cuDNN | this / cuDNN | this / other |\n|---|---|---|---|---|")
    for (build, label, mode), values in ratios.items():
        if build == "other":
            o, t = statistics.median(values), statistics.median(ratios["this", label, mode])
            print(f"| {label} | {mode} | {o:.3f} | {t:.3f} | {t / o:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
