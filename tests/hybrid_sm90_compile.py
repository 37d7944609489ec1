"""Compile the block-hybrid training kernels for sm90 without a GPU and report their resources.

Run by tests/test_hybrid_attn.py in a subprocess without TRITON_INTERPRET (the interpreter never
lowers a kernel), or by hand, also from a bare triton venv (the GPU machine's triton 3.6):
``PYTHONPATH=. python -m tests.hybrid_sm90_compile [--only fwd_bs32,...] [--warps 4]``.
Prints one line per kernel: ``name smem_bytes registers stack_bytes sp_reads warps stages``
(sp_reads: SASS instructions computing with the stack pointer, the ptxas 12.8 miscompile of issue
6, sm90_build.stack_pointer_reads; it must be 0), at the
benchmark's shape (bf16, D=128, F=64, bs=32: one block per tile), packed small blocks (bs=4: eight
blocks per 64-row tile, the intra-tile term), and the largest shapes the backend accepts (bs=64
at D=128, F=64; D=256 at F=32), with the backend's launch configs.
"""

import argparse
import re
import sys

from tests import sm90_build

try:  # the backend's own tile rules; without torch (a bare triton venv) the same rules, spelled out
    from dlm_ops.backends import hybrid_train as launch
    from dlm_ops.templates import hybrid_train as kernels
except ImportError:
    launch = None
    from templates import hybrid_train as kernels

LOW = {"Q", "K", "V", "O", "DO", "DQ", "X", "Y"}  # input-dtype tensors; every other pointer is fp32
STRIDE = re.compile(r"^s[a-z][bsh]$")


# Example values of the integer arguments, specialised as the JIT does on a GPU (an int equal to 1
# becomes a constexpr, a multiple of 16 gets tt.divisibility 16): issue 6's miscompile showed only
# with the GPU's own specialisation (G=1 of an MHA call among others), not with a generic one.
EXAMPLE = dict(H=4, G=1, gy=1, n=300, u_off=300, row_off=0, seqlen=600, total=1200, split_len=1216)


def compile_sm90(fn, constexprs, warps, stages, dtype="bf16", ints=None):
    """The signature by this script's argument-name rules and the JIT's specialisation of the
    example ints; the compile itself: tests/sm90_build."""
    sig, attrs, constexprs = {}, {}, dict(constexprs)
    ints = dict(EXAMPLE, **(ints or {}))
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.isupper() and name not in ("H", "G", "F"):  # H, G, F are counts
            sig[name] = "*" + (dtype if name in LOW else "fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "eps"):
            sig[name] = "fp32"
        elif name in ints and ints[name] == 1:
            sig[name], constexprs[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if STRIDE.match(name) or (name in ints and ints[name] % 16 == 0):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sm90_build.compile_sm90(fn, sig, attrs, constexprs, warps, stages)


SHAPES = (("bs32", 32, 128, 64), ("bs4", 4, 128, 64), ("bs64", 64, 128, 64),
          ("d256", 32, 256, 32))


def _tile(bs):
    """(BLOCK_T, MULTI, tile_len, num_tiles) of a block length at n = EXAMPLE["n"]:
    launch.geometry's rule."""
    n = EXAMPLE["n"]
    if launch is not None:
        geo = launch.geometry(n, bs)
        return geo.block_t, geo.multi, geo.tile_len, geo.num_tiles
    block_t, multi = (32, True) if bs <= 16 else (max(16, 1 << (bs - 1).bit_length()), False)
    tile_len = bs * (32 // bs) if multi else bs
    return block_t, multi, tile_len, -(-n // tile_len)


def _config(role, block_f, block_d):
    if launch is not None:
        return launch.launch_config(role, block_f, block_d)
    return (8 if block_f * block_d >= 64 * 128 else 4), 1


def cases(warps=None, stages=None, slice_d=None):
    """(label, kernel, constexprs, warps, stages) of every kernel at every SHAPES entry."""
    for label, bs, d, f in SHAPES:
        block_t, multi, tile_len, num_tiles = _tile(bs)
        ints = dict(bs=bs, tile_len=tile_len, num_tiles=num_tiles, F=f)
        bd, bf = max(16, d), max(16, f)
        ds = min(bd, slice_d or (launch.SLICE_D if launch is not None else 16))
        walk = dict(D=d, BLOCK_T=block_t, BLOCK_D=bd, DS=ds, BLOCK_F=bf, MULTI=multi, IEEE=False)
        scan = dict(BLOCK_T=block_t, D=d, DS=ds, BLOCK_F=bf, FIRST_HALF=0, NUM_HALVES=2,
                    REVERSE=True, HAS_RS=True, IEEE=False)
        rows = dict(D=d, BLOCK_N=64, BLOCK_D=bd, BLOCK_F=bf, IEEE=False)
        bwd_k = {c: v for c, v in walk.items() if c != "BLOCK_D"}
        for role, fn, consts in (("fwd", kernels.hybrid_train_fwd_kernel, walk),
                                 ("scan", kernels.hybrid_scan_kernel, scan),
                                 ("bwd_q", kernels.hybrid_train_bwd_q_kernel, walk),
                                 ("bwd_k", kernels.hybrid_train_bwd_k_kernel, bwd_k),
                                 ("logits", kernels.hybrid_logits_kernel, rows),
                                 ("dW", kernels.hybrid_feature_grad_kernel, rows)):
            if role in ("logits", "dW") and label not in ("bs32", "d256"):
                continue  # they do not depend on the block length
            w, s = _config(role, bf, bd)
            yield f"{role}_{label}", fn, consts, warps or w, stages or s, ints


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="", help="comma-separated labels")
    p.add_argument("--warps", type=int)
    p.add_argument("--stages", type=int)
    p.add_argument("--ds", type=int, help="D slice (the backend's SLICE_D by default)")
    a = p.parse_args(argv)
    for label, fn, consts, warps, stages, ints in cases(a.warps, a.stages, a.ds):
        if a.only and label not in a.only.split(","):
            continue
        compiled = compile_sm90(fn, consts, warps, stages, ints=ints)
        smem, regs, stack = sm90_build.resources(compiled)
        sp = len(sm90_build.stack_pointer_reads(compiled))
        print(f"{label} {smem} {regs} {stack} {sp} warps={warps} stages={stages}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
