"""Compile the sparse Triton kernels (attention and selection) for sm90 without a GPU and report
their resource usage.

Run by tests/test_sparse_attn.py in a subprocess without TRITON_INTERPRET (the interpreter never
lowers a kernel, so it cannot catch a GPU compile error). Prints one line per kernel:
``name smem_bytes registers stack_bytes``. The tile configs are the backend's first choices, with
the strides marked divisible by 16 as Triton's launcher specialises them.
"""

import sys

import dlm_ops.backends.sparse_triton as backend
from dlm_ops.sparsity import _select_backend as select_backend
from dlm_ops.templates import column_mass as column_kernels
from dlm_ops.templates import sparse_attn as kernels
from dlm_ops.templates import sparse_select as select_kernels
from tests import sm90_build

INT = {"IDX", "CNT", "ORDER", "REV_OFF", "REV_Q"}
FLOAT32 = {"LSE", "DELTA", "DKP", "DVP", "LSE2", "MASS"}
TENSORS = INT | FLOAT32 | {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}


def compile_sm90(fn, constexprs, warps, stages, dtype="bf16"):
    """The signature by this script's argument-name rules; the compile itself: tests/sm90_build."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in TENSORS:
            sig[name] = "*" + ("i32" if name in INT else "fp32" if name in FLOAT32 else dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "scale2"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("s"):  # strides
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sm90_build.compile_sm90(fn, sig, attrs, constexprs, warps, stages)


def main():
    be = backend.TritonSparseBackend()
    cases = [  # (label, kernel, role, caps, block sizes)
        ("fwd bs128", kernels.block_sparse_fwd_kernel, "fwd", (128, backend.MAX_TILE), (128, 128)),
        ("fwd bs16 gathered", kernels.block_sparse_fwd_kernel, "fwd", (16, backend.MAX_TILE), (16, 16)),
        ("dq bs128", kernels.block_sparse_dq_kernel, "dq", (128, backend.MAX_TILE), (128, 128)),
        ("dkdv bs128", kernels.block_sparse_dkdv_kernel, "dkdv", (128, 128), (128, 128)),
        ("column fwd", kernels.column_sparse_fwd_kernel, "column fwd", (128, 128), None),
        ("column dkdv", kernels.column_sparse_dkdv_kernel, "column dkdv", (128, 128), None),
    ]
    for label, fn, role, caps, blocks in cases:
        bm, bn, warps, stages = be._candidates(role, 128, *caps)[0]
        consts = dict(D=128, BLOCK_D=128, IEEE=False, BLOCK_M=bm, BLOCK_N=bn)
        if blocks:
            consts.update(BSQ=blocks[0], BSK=blocks[1])
        smem, regs, stack = sm90_build.resources(compile_sm90(fn, consts, warps, stages))
        print(f"{label.replace(' ', '_')} {smem} {regs} {stack}", flush=True)
    # Selection: SparseD's block mass at 128 x 128 blocks (8 warps, the launcher's choice there),
    # PulseCol's row LSE and column mass with the backend's bf16 tiles at D = 128 and 256 (fp32's
    # FMA dots spill at every tile: see _select_backend.column_tiles).
    consts = dict(D=128, BLOCK_D=128, IEEE=False, BLOCK_M=128, BLOCK_N=128)
    smem, regs, stack = sm90_build.resources(compile_sm90(select_kernels.block_mass_kernel, consts, 8, 3))
    print(f"block_mass_bs128 {smem} {regs} {stack}", flush=True)
    for d in (128, 256):
        for fn, (bm, bn, warps, stages) in zip(
                (column_kernels.row_lse_kernel, column_kernels.column_mass_kernel),
                select_backend.column_tiles(d, 2, interpret=False)):
            consts = dict(D=d, BLOCK_D=d, IEEE=False, BLOCK_M=bm, BLOCK_N=bn)
            smem, regs, stack = sm90_build.resources(compile_sm90(fn, consts, warps, stages))
            print(f"{fn.__name__.removesuffix('_kernel')}_d{d} {smem} {regs} {stack}", flush=True)

if __name__ == "__main__":
    backend.INTERPRET = False  # the backend's GPU tile choices, not the interpreter's
    sys.exit(main())
