"""Selection family: SparseD's pooled tile mass and PulseCol's column mass as custom ops.

    dlm::sparse_block_mass(q, k, block_size_q, block_size_k, split, softmax_scale, chunk_q,
                           chunk_k, backend) -> mass fp32 (B, H, ceil(Sq/bq), ceil(Sk/bk))
    dlm::sparse_column_mass(q, k, sample_rows, check_rows, softmax_scale, chunk_rows, chunk_k,
                            backend) -> mass fp32 (B, H, Sk)

Block mass: mass[b, h, I, J] = sum over the tile of p, p the softmax over keys [0, split) or
[split, Sk) (whichever holds J; split = Sk: one softmax). Column mass: mass[b, h, j] = sum over
the rows i in ``sample_rows`` (a 1-D int tensor of query rows, repeats counted; None: all rows)
of p[b, h, i, j], p the softmax over all keys; per query head (GQA heads are not summed);
``check_rows`` range-checks the rows with one host sync (as ``check_indices`` in the sparse ops;
PulseCol skips it for the rows it generates itself). The output shapes depend on shapes only,
so both have fake functions and run inside torch.compile(fullgraph=True) graphs. No autograd: a
selection score is not differentiated (a pattern is discrete). The backend (torch chunked /
Triton fused) comes from the "sparse_select" registry (dlm_ops/sparsity/_select_backend.py);
chunk_* apply to the torch path only.

No ``from __future__ import annotations``: torch.library reads the annotations as types.
"""

import math
from typing import Optional

import torch
from torch import Tensor

from ..sparsity import _select_backend


def check_selection_inputs(q, k, block_size_q, block_size_k) -> None:
    """q (B, Sq, H, D), k (B, Sk, Hkv, D) floating, H a multiple of Hkv; block sizes ints >= 1.
    Shared by every selector in dlm_ops.sparsity."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            got = f"{t.dtype} shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D floating tensor (batch, seqlen, heads, head_dim), "
                             f"got {got}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or k.shape[1] < 1:
        raise ValueError(f"k must have shape ({q.shape[0]}, Sk >= 1, Hkv, {q.shape[3]}) to match q, "
                         f"got {tuple(k.shape)}")
    if k.shape[2] < 1 or q.shape[2] % k.shape[2]:
        raise ValueError(f"q's head count ({q.shape[2]}) must be a multiple of k's ({k.shape[2]})")
    if k.device != q.device:
        raise ValueError(f"k must be on q's device ({q.device}), got {k.device}")
    for name, bs in (("block_size_q", block_size_q), ("block_size_k", block_size_k)):
        if isinstance(bs, bool) or not isinstance(bs, (int, torch.SymInt)) or bs < 1:
            raise ValueError(f"{name} must be an int >= 1, got {bs!r}")


def check_block_mass_args(q, k, block_size_q, block_size_k, split, softmax_scale) -> None:
    check_selection_inputs(q, k, block_size_q, block_size_k)
    if not 0 <= split <= k.shape[1] or (split % block_size_k and split != k.shape[1]):
        raise ValueError(f"split must be a multiple of block_size_k ({block_size_k}) in "
                         f"[0, Sk = {k.shape[1]}], or Sk, got {split}")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0 or None (1/sqrt(head_dim)), got {softmax_scale}")


@torch.library.custom_op("dlm::sparse_block_mass", mutates_args=())
def sparse_block_mass(q: Tensor, k: Tensor, block_size_q: int, block_size_k: int, split: int,
                      softmax_scale: Optional[float], chunk_q: Optional[int],
                      chunk_k: Optional[int], backend: Optional[str]) -> Tensor:
    check_block_mass_args(q, k, block_size_q, block_size_k, split, softmax_scale)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # split 0 would leave the first part empty: the same as one part over all keys.
    split = k.shape[1] if split == 0 else split
    return _select_backend.block_mass(q, k, block_size_q, block_size_k, split, scale, chunk_q,
                                      chunk_k, backend)


@sparse_block_mass.register_fake
def _(q, k, block_size_q, block_size_k, split, softmax_scale, chunk_q, chunk_k, backend):
    check_block_mass_args(q, k, block_size_q, block_size_k, split, softmax_scale)
    b, sq, h, _ = q.shape
    nqb, nkb = (sq + block_size_q - 1) // block_size_q, (k.shape[1] + block_size_k - 1) // block_size_k
    return q.new_empty((b, h, nqb, nkb), dtype=torch.float32)


def check_column_mass_args(q, k, sample_rows, softmax_scale, chunk_rows, chunk_k) -> None:
    """Everything but the row values (those need a host sync: the op body checks them)."""
    check_selection_inputs(q, k, 1, 1)
    if sample_rows is not None and (
            not isinstance(sample_rows, torch.Tensor) or sample_rows.dim() != 1
            or sample_rows.dtype not in (torch.int32, torch.int64) or sample_rows.numel() < 1
            or sample_rows.device != q.device):
        got = (f"{sample_rows.dtype} shape {tuple(sample_rows.shape)} on {sample_rows.device}"
               if isinstance(sample_rows, torch.Tensor) else type(sample_rows).__name__)
        raise ValueError(f"sample_rows must be None or a non-empty 1-D int32/int64 tensor on "
                         f"{q.device}, got {got}")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0 or None (1/sqrt(head_dim)), got {softmax_scale}")
    for name, c in (("chunk_rows", chunk_rows), ("chunk_k", chunk_k)):
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {c!r}")


@torch.library.custom_op("dlm::sparse_column_mass", mutates_args=())
def sparse_column_mass(q: Tensor, k: Tensor, sample_rows: Optional[Tensor], check_rows: bool,
                       softmax_scale: Optional[float], chunk_rows: Optional[int],
                       chunk_k: Optional[int], backend: Optional[str]) -> Tensor:
    check_column_mass_args(q, k, sample_rows, softmax_scale, chunk_rows, chunk_k)
    if sample_rows is not None:
        if check_rows:
            lo, hi = (int(x) for x in sample_rows.aminmax())
            if lo < 0 or hi >= q.shape[1]:
                raise ValueError(f"sample_rows must lie in [0, {q.shape[1]}), got [{lo}, {hi}]")
        q = q.index_select(1, sample_rows)  # (B, R, H, D): the kernels see only the scored rows
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _select_backend.column_mass(q, k, scale, chunk_rows, chunk_k, backend)


@sparse_column_mass.register_fake
def _(q, k, sample_rows, check_rows, softmax_scale, chunk_rows, chunk_k, backend):
    check_column_mass_args(q, k, sample_rows, softmax_scale, chunk_rows, chunk_k)
    return q.new_empty((q.shape[0], q.shape[2], k.shape[1]), dtype=torch.float32)
