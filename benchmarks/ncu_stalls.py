"""Where a kernel's warps wait, instruction by instruction, from Nsight Compute's source page.
``python -m benchmarks.ncu_stalls FILE.csv [--top 30] [--executed]``

FILE.csv is what ``ncu --section SourceCounters --section WarpStateStats --page source
--print-source sass --csv -k regex:NAME --launch-count 1 PROGRAM`` prints (add
``--clock-control none`` on the lent H200, device METHOD.md). Printed: the share of the warp-stall
samples per opcode, then the most sampled instructions (all samples and not-issued samples, in %
of all). csrc/NOTES.md session 13 read the fused dK/dV/dQ kernel's register pressure off it: LDL /
STL 10.8 % of the samples, R2UR 13.9 %.

``--executed`` (session 25) prints what the instructions cost instead: warp instructions executed
per opcode (ncu's "Instructions Executed" column) and the stall samples grouped by how often each
instruction ran. In a persistent kernel those counts name the code's place: once per warp and work
item, per visited tile, per masked tile (csrc/NOTES.md "Session 25" read the forward's item set-up
off it against cuDNN's kernel).
"""

from __future__ import annotations

import argparse
import collections
import csv
from dataclasses import dataclass


@dataclass(frozen=True)
class Sampled:
    samples: float      # warp-stall samples at this instruction (all)
    not_issued: float   # of which the warp was not issued
    address: str
    sass: str
    executed: float = 0.0  # warp instructions executed (0 where the table lacks the column)

    @property
    def opcode(self) -> str:
        words = self.sass.split()
        return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words or [""])[0]


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() else 0.0


def read(lines: list[str]) -> list[Sampled]:
    """The instructions of the source page's CSV (the lines before its header are ncu's log)."""
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError("no source-page table: run ncu with --page source --print-source sass --csv")
    rows = list(csv.reader(lines[start:]))
    header = rows[0]

    def column(prefix: str) -> int | None:
        return next((i for i, h in enumerate(header) if h.startswith(prefix)), None)

    src, every = column("Source"), column("Warp Stall Sampling (All")
    idle, ran = column("Warp Stall Sampling (Not"), column("Instructions Executed")
    if src is None or every is None:
        raise ValueError(f"the table has no Source / Warp Stall Sampling columns: {header[:6]}")
    out = []
    for row in rows[1:]:
        # Shorter rows: a section's summary line, or the next kernel's name line and header where
        # the file holds several kernels' tables (they are read as one list).
        if len(row) <= max(c for c in (src, every, idle, ran) if c is not None):
            continue
        try:
            out.append(Sampled(_number(row[every]), _number(row[idle]) if idle is not None else 0.0,
                               row[0], row[src].strip(),
                               _number(row[ran]) if ran is not None else 0.0))
        except ValueError:  # a section's summary line, not an instruction
            continue
    return out


def report(instructions: list[Sampled], top: int = 30) -> str:
    total = sum(i.samples for i in instructions) or 1.0
    by_op = collections.Counter()
    for i in instructions:
        by_op[i.opcode] += i.samples
    lines = [f"{len(instructions)} instructions, {total:.0f} samples",
             "by opcode: " + ", ".join(f"{op} {100 * v / total:.1f}%" for op, v in by_op.most_common(14))]
    for i in sorted(instructions, key=lambda i: -i.samples)[:top]:
        lines.append(f"{100 * i.samples / total:5.1f}% {100 * i.not_issued / total:5.1f}% "
                     f"{i.address:>8} {i.sass[:90]}")
    return "\n".join(lines)


def executed(instructions: list[Sampled], top: int = 12) -> str:
    """Warp instructions executed per opcode (millions, opcode without modifiers), and the share of
    stall samples at the instructions that ran a given number of times."""
    total = sum(i.executed for i in instructions)
    samples = sum(i.samples for i in instructions) or 1.0
    by_op, by_count = collections.Counter(), collections.Counter()
    for i in instructions:
        by_op[i.opcode.split(".")[0]] += i.executed
        by_count[int(i.executed)] += i.samples
    lines = [f"{len(instructions)} instructions, {total / 1e6:.3f} M warp instructions executed",
             "executed by opcode (M): " + ", ".join(f"{op} {v / 1e6:.3f}" for op, v in by_op.most_common(top)),
             "stall samples by times run:"]
    lines += [f"  {count:>10}x: {100 * v / samples:5.1f}%" for count, v in by_count.most_common(top)]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ncu_stalls", description=__doc__.splitlines()[0])
    p.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    p.add_argument("--top", type=int, default=30, help="instructions to list")
    p.add_argument("--executed", action="store_true", help="instructions executed, not stalls")
    a = p.parse_args(argv)
    with open(a.csv) as f:
        instructions = read(f.read().splitlines())
    print(executed(instructions, a.top) if a.executed else report(instructions, a.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
