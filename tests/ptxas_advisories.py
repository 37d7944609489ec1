"""``python -m tests.ptxas_advisories [TU ...]``: compile sm90 translation units of csrc/ with
``ptxas -v`` and fail on ptxas's performance advisories (C75xx), which a normal build does not print.

Why: one of them, C7515 ("wgmma.mma_async instructions are serialized due to non wgmma
instructions defining accumulator registers ..."), cost the forward 22-40 % in session 26 (an O
zeroing between two wgmmas; csrc/NOTES.md) and showed nowhere but under -v. Run it on a
workstation before a device call: it needs nvcc >= 12.3 and the CUTLASS headers, no GPU, no CUDA
build of torch and no extension build (about 40 s per forward unit, minutes per backward one). TU: paths under
csrc/ (default: the shipped bf16 forwards and the block-sparse forward). Also lists the kernels
that spill (two of the D = 128 backward's do, by 8 and 20 bytes: csrc/NOTES.md session 25). Exit status 1 when an
advisory shows, 2 when nothing could be compiled.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from dlm_ops.backends import cutlass

DEFAULT_UNITS = ("hopper/diffusion_fwd_bf16_d64.cu", "hopper/diffusion_fwd_bf16_d128.cu",
                 "hopper/diffusion_fwd_bf16_d256.cu", "hopper/block_sparse_fwd_bf16_d128.cu")


def check(unit: str) -> tuple[list[str], list[str]]:
    """(advisory lines, spill lines) of ptxas -v for csrc/``unit``."""
    found, include = cutlass.nvcc(), cutlass.cutlass_include()
    src = cutlass.csrc_dir()
    cmd = [found[0], *cutlass.ARCH_FLAGS, *cutlass.CUDA_FLAGS, "-std=c++17", f"-I{src}",
           f"-I{src / 'include'}", f"-I{include}", "-Xptxas", "-v", "-cubin", "-o", os.devnull,
           str(src / unit)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr[-4000:])
        raise SystemExit(f"{unit}: nvcc failed")
    return parse(out.stderr)


def parse(ptxas_output: str) -> tuple[list[str], list[str]]:
    """(advisory lines, lines of kernels that spill) in ptxas -v output."""
    lines = ptxas_output.splitlines()
    advisories = [line.strip() for line in lines if re.search(r"\(C75\d\d\)", line)]
    spills = [line.strip() for line in lines
              if "spill" in line and not re.search(r"\b0 bytes spill stores, 0 bytes spill loads", line)]
    return advisories, spills


def main(argv: list[str]) -> int:
    reason = cutlass.compiler_reason()
    if reason:
        print(f"cannot compile: {reason}")
        return 2
    bad = False
    for unit in argv or DEFAULT_UNITS:
        advisories, spills = check(unit)
        print(f"{unit}: {len(advisories)} ptxas advisories, {len(spills)} kernels spilling")
        for line in advisories + spills:
            print("   ", line[:300])
        bad |= bool(advisories)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
