"""Compile a Triton kernel for sm90 without a GPU and read its resources: the shared half of
tests/sparse_sm90_compile.py and tests/hybrid_sm90_compile.py (each keeps its own signature rules,
which follow its kernels' argument names). Needs triton only, so it runs in a bare triton venv too
(the GPU machine's triton 3.6)."""

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(fn, signature, attrs, constexprs, warps, stages):
    """``fn`` compiled for sm90 with the given signature and argument attributes."""
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def resources(compiled):
    """(shared memory bytes, registers per thread, stack bytes per thread) of a compiled kernel."""
    tool = _tool("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+).*?STACK:(\d+)", usage, re.S).groups()
    return compiled.metadata.shared, int(regs), int(stack)


def _tool(name):
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


_SP = re.compile(r"R1(\.reuse)?")


def stack_pointer_reads(compiled):
    """SASS instructions that read R1, the stack pointer, as a value rather than as a local-memory
    address [R1+x] (the prologue's R1 = stack top - frame aside). Issue 6: ptxas 12.8 (triton 3.6)
    built a wgmma shared-memory descriptor as R1 + 2 in a spilling kernel, and the wgmma read
    shared memory out of bounds; correct code never computes with the stack pointer."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True,
                              text=True).stdout
    bad = []
    for line in sass.splitlines():
        ins = line.split("*/", 1)[-1].strip().rstrip(" ;")
        if ins.startswith("@"):
            ins = ins.split(" ", 1)[-1]
        ops = [o.strip() for o in ins.partition(" ")[2].split(",")]
        if len(ops) > 1 and ops[0] != "R1" and any(_SP.fullmatch(o) for o in ops[1:]):
            bad.append(ins)
    return bad
