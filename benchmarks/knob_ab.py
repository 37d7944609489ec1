"""A backend knob through torch, one setting against another: ``python -m benchmarks.knob_ab KNOB``.

The knobs are module attributes of dlm_ops.backends.cutlass_diffusion (or cutlass_sparse) that
every call reads, so one process can time both settings on the same inputs: ``--rounds`` shuffled
rounds (the main preset's method, benchmarks/__main__.py), medians, bf16, 16K tokens per case
(the sparse ones: benchmarks.sparse's cases, B 1, H 32/8). Needs an sm90 GPU.

    dkdv-rule    PERSISTENT_DKDV_MAX_HALF 1024 (session 12's rule) against 2048 (shipped since
                 session 13); the n = 1K case runs the persistent kernel under both: its ratio is
                 the noise.
    short-order  SHORT_HALF_ORDER: the plain order (0, 0) against the slot-major walk (1, 4) of
                 short halves (session 21); the n = 2K case walks the plain order under both.
    short-order-dims  SHORT_HALF_MAX: the walk at D = 128 alone against D = 64 and 256 too, halves
                 up to 1024 (their forwards; at D = 256 the dS backward's dK/dV kernel, one CTA
                 per key tile); the D = 128 case walks under both.
    short-max    SHORT_HALF_MAX 1024 against 4096 at D = 128 and 256: the walk at n = 2K and 4K.
    split-tail   cutlass_sparse.SPLIT_PARTS 0 (no split) against 4 (session 22), the block- and
                 column-sparse forwards; the H = 33 case has no tail (4224 items, 32 rounds of 132
                 CTAs): its ratio is the noise.
    narrow-diag  NARROW_DIAG_MAX_HALF 0 (the forward without the narrow diagonal visit) against
                 1024 (session 29); the n = 2K case runs the kernel without it under both.
    narrow-diag-varlen  NARROW_DIAG_VARLEN off against on: packed samples (halves <= 1024), and
                 one of 2K halves, which runs the kernel without it under both.
    narrow-diag-dims  NARROW_DIAG_HEAD_DIMS (128,) against (64, 128): D = 64 at n = 1K and 512;
                 the D = 128 case runs the narrow kernel under both.
    packed-ds    DS_SCRATCH_MAX_BYTES 0 (the two-kernel backward) against 8 GiB (shipped): batched
                 BD3 halves off the 128 grid, whose dS backward runs as packed samples (session
                 24), at D = 128 and 256.

The speed column is the second setting's speed over the first's; the A/A column times the first
setting a second time, as an arm of its own in the same shuffled rounds, and gives that arm's speed
over the first: how far the harness alone moves a ratio in that case (session 29: A/A rows read
0.97-1.04x, by the shuffle's seed, so a speed within a few per cent of the A/A one is noise).
"""

from __future__ import annotations

import argparse
import statistics
from typing import NamedTuple

import torch

from dlm_ops.backends import cutlass_diffusion as cd
from dlm_ops.backends import cutlass_sparse as cs

from . import sparse
from .__main__ import _calls_per_measurement, _time_once, shuffled_rounds
from .contenders import Case, VarlenCase, ours, ours_varlen


class Knob(NamedTuple):
    attribute: str  # of module
    settings: tuple
    modes: tuple[str, ...]  # of runs(case)
    cases: tuple
    module: object = cd


def sparse_runs(case: sparse.SparseCase) -> dict:
    """{mode: (setup, fn)} of the sparse forwards at one case: "block" (block_sparse_attn over
    benchmarks.sparse's block pattern) and "column" (column_sparse_attn over its column pattern)."""
    q, k, v = sparse._inputs(case)
    idx, counts = sparse.block_pattern(case)
    cidx, ccounts = sparse.column_pattern(case)
    return {"block": (None, sparse.make_ours(case, q, k, v, idx, counts)),
            "column": (None, sparse.make_column(case, q, k, v, cidx, ccounts))}


KNOBS = {
    "dkdv-rule": Knob("PERSISTENT_DKDV_MAX_HALF", (1024, 2048), ("bwd", "step"),
                      (Case(4, 2048, 16, 16, 128, 16), Case(4, 2048, 16, 16, 128, 4),
                       Case(4, 2048, 32, 8, 128, 16), Case(4, 2048, 16, 16, 64, 16),
                       Case(8, 1024, 16, 16, 128, 16))),
    "short-order": Knob("SHORT_HALF_ORDER", (cd.PLAIN_ORDER, (1, 4)), ("fwd", "bwd", "step"),
                        (Case(8, 1024, 16, 16, 128, 16), Case(8, 1024, 16, 16, 128, 4),
                         Case(8, 1024, 32, 8, 128, 16), Case(16, 512, 16, 16, 128, 16),
                         Case(4, 2048, 16, 16, 128, 16))),
    "short-order-dims": Knob("SHORT_HALF_MAX", ({128: 1024}, {64: 1024, 128: 1024, 256: 1024}),
                             ("fwd", "bwd", "step"),
                             (Case(8, 1024, 16, 16, 64, 16), Case(16, 512, 16, 16, 64, 16),
                              Case(8, 1024, 16, 16, 256, 16), Case(16, 512, 16, 16, 256, 16),
                              Case(8, 1024, 16, 16, 128, 16))),
    "short-max": Knob("SHORT_HALF_MAX", ({128: 1024, 256: 1024}, {128: 4096, 256: 4096}),
                      ("fwd", "bwd", "step"),
                      (Case(4, 2048, 16, 16, 256, 16), Case(2, 4096, 16, 16, 256, 16),
                       Case(4, 2048, 16, 16, 128, 16), Case(2, 4096, 16, 16, 128, 16))),
    "narrow-diag": Knob("NARROW_DIAG_MAX_HALF", (0, 1024), ("fwd", "step"),
                        (Case(8, 1024, 16, 16, 128, 16), Case(8, 1024, 16, 16, 128, 4),
                         Case(8, 1024, 32, 8, 128, 16), Case(16, 512, 16, 16, 128, 16),
                         Case(4, 2048, 16, 16, 128, 16))),
    "narrow-diag-varlen": Knob("NARROW_DIAG_VARLEN", (False, True), ("fwd", "step"),
                               (VarlenCase("8 x 1K", (1024,) * 8),
                                VarlenCase("mixed", (1000, 37, 640, 512, 129, 1024, 300, 900, 800,
                                                     700, 256, 600, 1000, 294)),
                                VarlenCase("4 x 2K", (2048,) * 4))),
    "narrow-diag-dims": Knob("NARROW_DIAG_HEAD_DIMS", ((128,), (64, 128)), ("fwd", "step"),
                             (Case(8, 1024, 16, 16, 64, 16), Case(8, 1024, 16, 16, 64, 4),
                              Case(16, 512, 16, 16, 64, 16), Case(8, 1024, 16, 16, 128, 16))),
    "packed-ds": Knob("DS_SCRATCH_MAX_BYTES", (0, cd.DS_SCRATCH_MAX_BYTES), ("bwd", "step"),
                      (Case(8, 1000, 16, 16, 128, 16), Case(8, 1000, 16, 16, 128, 4),
                       Case(2, 4000, 16, 16, 128, 16), Case(8, 1000, 32, 8, 128, 16),
                       Case(8, 1000, 16, 16, 256, 16), Case(2, 4000, 16, 16, 256, 16))),
    "split-tail": Knob("SPLIT_PARTS", (0, 4), ("block", "column"),
                       (sparse.SparseCase(16384, 0.1), sparse.SparseCase(16384, 0.3),
                        sparse.SparseCase(32768, 0.1), sparse.SparseCase(65536, 0.1),
                        sparse.SparseCase(16384, 0.1, heads=33, kv_heads=11)), cs),
}


def arms(settings: tuple) -> tuple:
    """The A/B's arms: the two settings, then the first one again (the A/A arm)."""
    return (*settings, settings[0])


def speeds(times: dict, mode: str) -> tuple[float, float, float, float]:
    """(first ms, second ms, speed second / first, speed A/A) from the medians of ``times``
    ({(arm index, mode): [ms per round]})."""
    t0, t1, t2 = (statistics.median(times[i, mode]) for i in range(3))
    return t0, t1, t0 / t1, t0 / t2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("knob", choices=sorted(KNOBS))
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--only", default=None, help="keep the knob's cases whose label contains this text")
    p.add_argument("--seed", type=int, default=0,
                   help="the rounds' shuffle (session 29: with seed 0 three A/A rows read the second "
                        "setting 1.02x faster)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    knob = KNOBS[a.knob]
    first, second = knob.settings
    module = knob.module
    saved = getattr(module, knob.attribute)
    print(f"{knob.attribute}: {first} against {second}; medians of {a.rounds} shuffled rounds")
    print(f"| case | mode | {first} ms | {second} ms | speed {second} / {first} | A/A |")
    print("|---|---|---|---|---|---|")
    settings = arms(knob.settings)
    try:
        for case in (c for c in knob.cases if not a.only or a.only in c.label):
            runs = (sparse_runs(case) if isinstance(case, sparse.SparseCase) else
                    ours_varlen(case) if isinstance(case, VarlenCase) else ours(case))
            iters = {}
            for mode in knob.modes:
                _time_once(*runs[mode], 2)
                iters[mode] = _calls_per_measurement(*runs[mode])

            def measure(key):
                arm, mode = key
                setattr(module, knob.attribute, settings[arm])  # read by every call
                return _time_once(*runs[mode], iters[mode])

            keys = [(i, m) for i in range(len(settings)) for m in knob.modes]
            times = shuffled_rounds(keys, a.rounds, measure, a.seed)
            for mode in knob.modes:
                t0, t1, speed, aa = speeds(times, mode)
                print(f"| {case.label} | {mode} | {t0:.3f} | {t1:.3f} | {speed:.3f} | {aa:.3f} |",
                      flush=True)
            torch.cuda.empty_cache()
    finally:
        setattr(module, knob.attribute, saved)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
