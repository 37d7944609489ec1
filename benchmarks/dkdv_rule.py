"""The persistent dK/dV kernel's length rule through torch: ``python -m benchmarks.dkdv_rule``.

The op's backward and the training step with cutlass_diffusion.PERSISTENT_DKDV_MAX_HALF at 1024
(session 12's rule) against 2048 (shipped since session 13 where each K / V head has one query
head), 10 shuffled rounds in one process (the main preset's method), bf16, 16K tokens. The n = 1K
case runs the persistent kernel under both settings: its ratio is the noise. Needs an sm90 GPU.
"""

from __future__ import annotations

import statistics

import torch

from dlm_ops.backends import cutlass_diffusion as cd

from .__main__ import _calls_per_measurement, _time_once, shuffled_rounds
from .contenders import Case, ours

CASES = [Case(4, 2048, 16, 16, 128, 16), Case(4, 2048, 16, 16, 128, 4), Case(4, 2048, 32, 8, 128, 16),
         Case(4, 2048, 16, 16, 64, 16), Case(8, 1024, 16, 16, 128, 16)]
RULES = (1024, 2048)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    saved = cd.PERSISTENT_DKDV_MAX_HALF
    print(f"| case | mode | rule {RULES[0]} ms | rule {RULES[1]} ms | {RULES[1]} / {RULES[0]} speed |")
    print("|---|---|---|---|---|")
    try:
        for case in CASES:
            runs = ours(case)
            iters = {}
            for mode in ("bwd", "step"):
                _time_once(*runs[mode], 2)
                iters[mode] = _calls_per_measurement(*runs[mode])

            def measure(key):
                rule, mode = key
                cd.PERSISTENT_DKDV_MAX_HALF = rule  # read by every backward call
                return _time_once(*runs[mode], iters[mode])

            times = shuffled_rounds([(r, m) for r in RULES for m in ("bwd", "step")], 10, measure)
            for mode in ("bwd", "step"):
                a, b = (statistics.median(times[r, mode]) for r in RULES)
                print(f"| {case.label} | {mode} | {a:.3f} | {b:.3f} | {a / b:.3f} |", flush=True)
            torch.cuda.empty_cache()
    finally:
        cd.PERSISTENT_DKDV_MAX_HALF = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
