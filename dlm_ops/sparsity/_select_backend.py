"""Backends of the selection family ("sparse_select"): who computes SparseD's pooled tile mass
and PulseCol's column mass.

    torch   chunked PyTorch (_pooling.pooled_mass), any device, any block size: the CPU path
    triton  SparseD: templates/sparse_select.py, one fused two-pass kernel; PulseCol:
            templates/column_mass.py, a row-LSE kernel then a per-key-tile mass kernel. CUDA
            (chosen there), or CPU under TRITON_INTERPRET=1 when forced (tests)

Why a kernel pays (estimate for S = 32K, H = 32, D = 128, bf16 on an H200): both paths do the
QK^T twice (2 x 8.8 TFLOP). The torch path upcasts to fp32 (exact logits, ~50 TFLOPS without
tensor-core bf16: ~0.35 s) and writes and re-reads every fp32 score and probability (137 GB per
pass, several times: ~0.2 s more); the kernel runs bf16 tensor-core dots with fp32 accumulation,
keeps each tile in registers and writes only (B, H, nQb, nKb) floats, so it should sit near two
attention forwards (~0.05 s). benchmarks/sparse_quality.py measures both against cuDNN SDPA.
PulseCol's column mass is the same two QK^T passes over its R scored rows (R = S/8 in the
benchmarks: together a quarter of one QK^T of the full matrix); its torch path measured 5.9 dense
attentions at 32K with R = S/8 (sparse_quality_cuda.md), the same fp32 upcast and score round
trips as above, so the kernels should bring it near 2.0 x R / S dense attentions (~0.25).
"""

from __future__ import annotations

import math

import torch

from ..backends import register, select
from ..backends.base import GQA, Backend, Capabilities, Problem, new_output
from ..backends import triton_backend
from ..backends.triton_backend import TRITON_DEVICES, TRITON_DTYPES, TritonEligibility
from ._pooling import pooled_mass

FAMILY = "sparse_select"
# A feature a call needs when its selection blocks are not powers of two in [16, 128]: the
# kernel makes one selection block one tile (tl.dot needs >= 16 and power-of-two shapes, and
# 128 x 128 fp32 tiles are the most a program holds in registers).
ANY_BLOCK_SIZE = "any_block_size"
KERNEL_BLOCKS = (16, 32, 64, 128)



try:
    import triton

    from ..templates import column_mass as column_kernels
    from ..templates import sparse_select as kernels
    _IMPORT_ERROR = None
except Exception as e:  # triton missing or broken: the backend reports why and stays out of the way
    triton = kernels = column_kernels = None
    _IMPORT_ERROR = f"triton unavailable ({type(e).__name__}: {e})"


class SelectBackend(Backend):
    family = FAMILY

    def block_mass(self, q, k, block_q: int, block_k: int, split: int, scale: float,
                   chunk_q, chunk_k) -> torch.Tensor:
        """fp32 (B, H, nQb, nKb) tile mass; keys [0, split) and [split, Sk) normalised apart."""
        raise NotImplementedError

    def column_mass(self, q, k, scale: float, chunk_rows, chunk_k) -> torch.Tensor:
        """fp32 (B, H, Sk): sum over all rows of q (already the scored rows) of each row's softmax."""
        raise NotImplementedError


class TorchSelectBackend(SelectBackend):
    name = "torch"
    priority = 0
    capabilities = Capabilities(device_types=None, dtypes=frozenset(
        {torch.float16, torch.bfloat16, torch.float32, torch.float64}), max_head_dim=1024,
        head_dim_multiple=1, features=frozenset({GQA, ANY_BLOCK_SIZE}))

    def block_mass(self, q, k, block_q, block_k, split, scale, chunk_q, chunk_k):
        return pooled_mass(q, k, block_q, block_k, scale, split, chunk_q, chunk_k)

    def column_mass(self, q, k, scale, chunk_rows, chunk_k):
        # One query "block" per chunk of rows: pooled_mass sums the rows of a block, so the
        # (B, H, n_chunks, Sk) result only needs a sum over its chunks.
        block = max(1, min(q.shape[1], chunk_rows or 256))  # R = 0: an empty sum
        return pooled_mass(q, k, block, 1, scale, None, block, chunk_k).sum(2)


class TritonSelectBackend(TritonEligibility, SelectBackend):
    name = "triton"
    capabilities = Capabilities(device_types=TRITON_DEVICES, dtypes=TRITON_DTYPES, max_head_dim=256,
                                head_dim_multiple=8, features=frozenset({GQA}))

    def unavailable_reason(self):
        return _IMPORT_ERROR

    def block_mass(self, q, k, block_q, block_k, split, scale, chunk_q, chunk_k):
        b, sq, h, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        nqb, nkb = math.ceil(sq / block_q), math.ceil(sk / block_k)
        mass = new_output(q, (b, h, nqb, nkb), dtype=torch.float32)
        npb = split // block_k if split < sk else 0
        # 4 warps up to 64 x 64 tiles; 128-row or -column tiles (16K fp32 logits) want 8.
        warps = 8 if block_q * block_k >= 128 * 64 else 4
        kernels.block_mass_kernel[(b * h, nqb)](
            q, k, mass, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
            k.stride(2), mass.stride(0), mass.stride(1), mass.stride(2),
            sq, sk, h, h // hkv, nkb, npb, scale * 1.4426950408889634,
            D=d, BLOCK_M=block_q, BLOCK_N=block_k, BLOCK_D=max(16, triton.next_power_of_2(d)),
            IEEE=q.dtype == torch.float32, num_warps=warps)
        return mass

    def column_mass(self, q, k, scale, chunk_rows, chunk_k):
        b, r, h, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        lse2 = new_output(q, (b, h, r), dtype=torch.float32)
        mass = new_output(q, (b, h, sk), dtype=torch.float32)
        flags = dict(D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), IEEE=q.dtype == torch.float32)
        common = (r, sk, h, h // hkv, scale * 1.4426950408889634)
        (lm, ln, lw, ls), (mm, mn, mw, ms) = column_tiles(d, q.element_size(), triton_backend.INTERPRET)
        if b * h * r:  # R = 0 rows: no LSE to compute, and the mass below is an empty sum, 0
            column_kernels.row_lse_kernel[(triton.cdiv(r, lm), b * h)](
                q, k, lse2, *q.stride()[:3], *k.stride()[:3], *lse2.stride()[:2], *common,
                BLOCK_M=lm, BLOCK_N=ln, num_warps=lw, num_stages=ls, **flags)
        if b * h:
            column_kernels.column_mass_kernel[(triton.cdiv(sk, mn), b * h)](
                q, k, lse2, mass, *q.stride()[:3], *k.stride()[:3], *lse2.stride()[:2],
                *mass.stride()[:2], *common, BLOCK_M=mm, BLOCK_N=mn, num_warps=mw,
                num_stages=ms, **flags)
        return mass


def column_tiles(head_dim: int, itemsize: int, interpret: bool):
    """(BLOCK_M, BLOCK_N, warps, stages) of the row-LSE and the column-mass kernels.

    Not timed on a GPU yet; chosen by compiling for sm90 (tests/sparse_sm90_compile.py, Triton 3.6
    and 3.9) so that nothing spills and shared memory stays within 227 KiB. The row-LSE pass is a
    flash forward without P@V: 128 x 128 logits over 8 warps (64 fp32 per thread), its Q tile
    resident beside 3 stages of K tiles (128 KiB at D=128, bf16). The mass pass holds a
    (BLOCK_M, BLOCK_N) accumulator beside the logits, so it walks 64-row query tiles past 128
    resident keys (80 KiB). D=256 halves the tiles and drops a stage.

    fp32 inputs take IEEE dots, which Triton lowers to FMA loops where each thread holds whole
    rows of both operands: at D >= 128 the mass kernel spills at every tile tried (16 x 16 to
    64 x 64: 200 B to 9 KB of stack; the row-LSE kernel is spill-free at 32 x 32), so fp32 gets
    small tiles that spill least. fp32 on a GPU is for checking results, not for speed. The
    interpreter runs 16 x 16 tiles so that the tests' short sequences span several tiles."""
    if interpret:
        return (16, 16, 4, 1), (16, 16, 4, 1)
    if itemsize > 2:
        return (32, 32, 4, 2), (32, 32, 8, 2)
    if head_dim > 128:
        return (64, 64, 4, 2), (32, 128, 8, 2)
    return (128, 128, 8, 3), (64, 128, 8, 3)


for _b in (TorchSelectBackend(), TritonSelectBackend()):
    register(_b)


def block_mass(q, k, block_q: int, block_k: int, split: int, scale: float, chunk_q=None,
               chunk_k=None, backend=None) -> torch.Tensor:
    """Pick a backend for checked inputs (sparsed.sparsed_block_mass) and compute the tile mass."""
    features = {GQA} if k.shape[2] != q.shape[2] else set()
    if block_q not in KERNEL_BLOCKS or block_k not in KERNEL_BLOCKS:
        features.add(ANY_BLOCK_SIZE)
    impl = select(Problem(q.device.type, q.dtype, q.shape[-1], frozenset(features)), backend,
                  family=FAMILY)
    return impl.block_mass(q.contiguous(), k.contiguous(), block_q, block_k, split, scale,
                           chunk_q, chunk_k)


def column_mass(q, k, scale: float, chunk_rows=None, chunk_k=None, backend=None) -> torch.Tensor:
    """Pick a backend for checked inputs (q: the scored rows only) and compute the column mass."""
    features = {GQA} if k.shape[2] != q.shape[2] else set()
    impl = select(Problem(q.device.type, q.dtype, q.shape[-1], frozenset(features)), backend,
                  family=FAMILY)
    return impl.column_mass(q.contiguous(), k.contiguous(), scale, chunk_rows, chunk_k)
