"""``python -m tests.sass_blocks LIB KERNEL_REGEX``: one kernel's SASS as basic blocks, each with
its address, length, the counts of the instructions that say what it does (HGMMA, MUFU.EX2,
FMNMX, FSEL, STS, ...) and its last instruction.

LIB: an extension's shared library, a cubin, or a build directory (as tests.sass_diff). The first
kernel whose mangled name matches KERNEL_REGEX is shown. Why: the static map locates a kernel's
loops (the back branches), its softmax (EX2 and FMNMX blocks), its epilogue (STS / STG blocks)
and what they cost per visit, on the workstation: session 27 read the D = 128 forward so (per
visited tile ~300 softmax instructions per thread unmasked, ~510 masked; the TMA-store epilogue
~240), where an ncu source page needs a device call. Needs cuobjdump, no GPU.
"""

from __future__ import annotations

import collections
import re
import sys

from tests.sass_diff import cuobjdump, library, parse_sass_lines, run_cuobjdump

OPCODES = ("HGMMA", "MUFU.EX2", "MUFU.RCP", "FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "F2FP", "SHFL",
           "LDS", "STS", "LDG", "STG", "SYNCS", "BAR")
_TARGET = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s.*?(0x[0-9a-f]+)\s*$")


def kernel_lines(sass: str, pattern: str) -> tuple[str, list[tuple[int, str]]]:
    """(mangled name, [(address, instruction)]) of the first kernel whose name matches pattern."""
    for name, lines in parse_sass_lines(sass).items():
        if re.search(pattern, name):
            return name, lines
    raise SystemExit(f"no kernel matches {pattern!r}")


def basic_blocks(lines: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Split at branch targets and after branches and exits."""
    targets = {int(m.group(1), 16) for _, ins in lines if (m := _TARGET.search(ins))}
    blocks: list[list[tuple[int, str]]] = []
    current: list[tuple[int, str]] = []
    for address, ins in lines:
        if address in targets and current:
            blocks.append(current)
            current = []
        current.append((address, ins))
        if re.search(r"\b(BRA|EXIT|RET)\b", ins):
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    return blocks


def opcode(ins: str) -> str:
    words = ins.split()
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def summary(block: list[tuple[int, str]]) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for _, ins in block:
        op = opcode(ins)
        for name in OPCODES:
            if op == name or op.startswith(name + "."):
                counts[name] += 1
                break
    return counts


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        raise SystemExit("usage: python -m tests.sass_blocks LIB KERNEL_REGEX")
    tool = cuobjdump()
    if tool is None:
        print("cuobjdump not found: set CUDA_HOME, or install triton (its wheel carries one)")
        return 2
    name, lines = kernel_lines(run_cuobjdump(tool, "-sass", library(argv[0])), argv[1])
    blocks = basic_blocks(lines)
    print(f"{name}: {len(lines)} instructions, {len(blocks)} blocks")
    for block in blocks:
        counts = " ".join(f"{k}:{v}" for k, v in summary(block).items())
        back = " (back)" if (m := _TARGET.search(block[-1][1])) and int(m.group(1), 16) <= block[0][0] else ""
        print(f"{block[0][0]:6x} n={len(block):4d}  {counts:64s} | {block[-1][1][:60]}{back}")
    return 0


if __name__ == "__main__":
    import signal
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly
    raise SystemExit(main(sys.argv[1:]))
