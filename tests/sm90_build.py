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
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+).*?STACK:(\d+)", usage, re.S).groups()
    return compiled.metadata.shared, int(regs), int(stack)
