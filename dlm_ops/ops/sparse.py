"""Sparse attention family: block-sparse and column-sparse attention (SparseD, BA-Att, PulseCol).

    dlm::block_sparse_attn_fwd / _bwd    each query block attends to a listed set of key blocks
    dlm::column_sparse_attn_fwd / _bwd   every query of a head attends to a listed set of key columns

Both take q (B, Sq, H, D) and k, v (B, Sk, Hkv, D) with H % Hkv == 0 (GQA: head h reads kv head
h // (H / Hkv)); Sq and Sk may differ. The patterns are int32 index lists with a count per list:
only the first ``count`` entries of a list are read, the rest may hold anything. Softmax is exact
over the listed keys; a list with count 0 gives out 0 and lse -inf (and zero gradients). Forward
ops return (out, lse), lse float32 (float64 for float64 inputs) natural log (B, H, Sq); backward ops
take the upstream gradient of lse too.

Selection block sizes are powers of two in [16, 256], independent of the kernels' tiles: a query
block splits into row tiles of BLOCK_M (a power of two <= block_size_q, so a row tile never mixes
two lists); the forward and dQ kernels split each listed key block into BLOCK_N-column tiles, or,
for blocks smaller than BLOCK_N, gather several listed blocks into one tile
(templates/sparse_attn.py). Only the last block of each side may be partial (Sq, Sk need not be
multiples). Powers of two keep every tile inside one block without per-element block arithmetic;
16 is the smallest tile tl.dot takes, 256 the largest block a tile table was checked for.

Checks. Shapes, dtypes and devices are checked everywhere (also in the fake functions, so compiled
graphs fail at trace time). The index VALUES (in range, counts in [0, max], no duplicate among the
first ``count`` entries: a duplicate would count its keys twice) need the data, so they are checked
in the op body (``check_index_values``: two min / max reductions, a sort of the lists and one host
sync, so that a bad list raises at the call with its values); ``check_indices=False`` skips that
in hot loops where the selector is trusted. What it costs is mostly the sync: the GPU drains, then
waits while the host launches the call's kernels. On the H200 (benchmarks.sparse ``check_ms``, B 1,
H 32, S 16K-32K) it added 0.3-0.7 ms to a 1-16 ms call (block- and column-sparse alike).

No ``from __future__ import annotations``: torch.library reads the annotations as types.
"""

import math
from typing import Optional

import torch
from torch import Tensor

from ..backends import select
from ..backends import sparse as _sparse_torch  # noqa: F401  (register the "sparse" family)
from ..backends import sparse_triton as _sparse_triton  # noqa: F401
from ..backends import cutlass_sparse as _cutlass_sparse  # noqa: F401  (sm90; after triton's)
from ..backends.base import GQA, Problem, lse_dtype
from .eager import EagerOp
from .validation import DTYPES, MAX_HEAD_DIM

MIN_BLOCK, MAX_BLOCK = 16, 256
BLOCK_SIZES = (16, 32, 64, 128, 256)  # powers of two in [MIN_BLOCK, MAX_BLOCK]


def _scale(softmax_scale: Optional[float], q: Tensor) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _problem(q: Tensor, k: Tensor) -> Problem:
    features = {GQA} if k.shape[2] != q.shape[2] else set()
    return Problem(q.device.type, q.dtype, q.shape[-1], frozenset(features))


# -- validation ---------------------------------------------------------------------------------


def _check_qkv(q, k, v) -> None:
    """q (B, Sq, H, D), k and v (B, Sk, Hkv, D): Sq != Sk is allowed, unlike the dense families."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape "
                             f"{tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype must be one of {[str(d) for d in DTYPES]}, got {t.dtype}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got "
                             f"{t.dtype}, {t.device}")
    if k.shape != v.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k must have shape ({q.shape[0]}, Sk, Hkv, {q.shape[3]}) to match q, got "
                         f"{tuple(k.shape)}")
    if k.shape[1] < 1:
        raise ValueError("k must hold at least one key (seqlen >= 1), got shape "
                         f"{tuple(k.shape)}")
    h, hkv, d = q.shape[2], k.shape[2], q.shape[3]
    if hkv < 1 or h % hkv:
        raise ValueError(f"q's head count ({h}) must be a multiple of k's ({hkv}) (GQA/MQA), with "
                         "at least one kv head")
    if d < 8 or d > MAX_HEAD_DIM or d % 8:
        raise ValueError(f"head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {d}")


def _check_block_size(name, x) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, torch.SymInt)) or x not in BLOCK_SIZES:
        raise ValueError(f"{name} must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], got {x!r}")


def _check_scale(softmax_scale) -> None:
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float))
                                          and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float or None (1/sqrt(head_dim)), "
                         f"got {softmax_scale!r}")


def _check_index_tensor(name, t, shape, q) -> None:
    if not isinstance(t, Tensor) or t.dtype != torch.int32:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an int32 tensor, got {got}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")


def _check_block(q, k, v, idx, counts, block_size_q, block_size_k, softmax_scale) -> None:
    _check_qkv(q, k, v)
    _check_block_size("block_size_q", block_size_q)
    _check_block_size("block_size_k", block_size_k)
    _check_scale(softmax_scale)
    b, sq, h, _ = q.shape
    nqb = -(-sq // block_size_q)
    if not isinstance(idx, Tensor) or idx.dim() != 4:
        raise ValueError("kv_block_indices must be a 4-D int32 tensor (B, H, ceil(Sq/block_size_q), "
                         f"max_blocks), got {getattr(idx, 'shape', type(idx).__name__)}")
    _check_index_tensor("kv_block_indices", idx, (b, h, nqb, idx.shape[3]), q)
    _check_index_tensor("kv_block_counts", counts, (b, h, nqb), q)


def _check_column(q, k, v, idx, counts, softmax_scale) -> None:
    _check_qkv(q, k, v)
    _check_scale(softmax_scale)
    b, _, h, _ = q.shape
    if not isinstance(idx, Tensor) or idx.dim() != 3:
        raise ValueError("kv_indices must be a 3-D int32 tensor (B, H, K), got "
                         f"{getattr(idx, 'shape', type(idx).__name__)}")
    _check_index_tensor("kv_indices", idx, (b, h, idx.shape[2]), q)
    _check_index_tensor("kv_counts", counts, (b, h), q)


def check_index_values(idx: Tensor, counts: Tensor, limit: int, idx_name: str,
                       counts_name: str) -> None:
    """Counts in [0, max], the first ``count`` entries of every list in [0, limit) and distinct.

    Raised at the call with the offending values, so the answer must reach the host: one sync
    (a device-side assert would end the CUDA context instead). Before it, ~12 launches on idx's
    device: two min / max reductions and one sort per list (duplicates: entries past the count
    become distinct negative stand-ins, -1 - slot, and a duplicate is an equal neighbour); the
    five answers come back in one copy. ``limit`` >= 1 (Sk or its block count)."""
    if counts.numel() == 0:
        return  # no list at all (a zero batch, head or query-block count)
    m = idx.shape[-1]
    answers = list(counts.aminmax())
    if m:
        slot = torch.arange(m, dtype=idx.dtype, device=idx.device)  # int32: a cheaper sort
        listed = slot < counts.unsqueeze(-1)
        # 0 stands in for the unlisted entries: inside [0, limit), so an extreme outside the
        # range is a listed entry's.
        answers += list(torch.where(listed, idx, 0).aminmax())
        ordered = torch.where(listed, idx, ~slot).sort(dim=-1).values
        answers.append((ordered[..., 1:] == ordered[..., :-1]).any())  # False when m < 2
    values = torch.stack(answers).tolist()  # the sync
    c_lo, c_hi = values[:2]
    lo, hi, dup = values[2:] if m else (0, 0, False)
    if c_lo < 0 or c_hi > m:
        raise ValueError(f"{counts_name} must lie in [0, {m}] ({idx_name}.shape[-1]), got values in "
                         f"[{c_lo}, {c_hi}]")
    if lo < 0 or hi >= limit:
        raise ValueError(f"{idx_name}: the first count entries of every list must lie in "
                         f"[0, {limit}), found {lo if lo < 0 else hi}")
    if dup:
        raise ValueError(f"{idx_name}: the first count entries of a list must be distinct (a "
                         "duplicate would count its keys twice), found a duplicate")


# -- block-sparse ops ---------------------------------------------------------------------------


# Each forward op's body is its shape check and then its run (the index values check included); the
# public functions check the shapes first and their eager way (EagerOp, below) calls the run alone.
def _block_run(q, k, v, kv_block_indices, kv_block_counts, block_size_q, block_size_k,
               softmax_scale, check_indices, backend):
    if check_indices:
        check_index_values(kv_block_indices, kv_block_counts, -(-k.shape[1] // block_size_k),
                           "kv_block_indices", "kv_block_counts")
    impl = select(_problem(q, k), backend, family="sparse")
    return impl.block_fwd(q, k, v, kv_block_indices, kv_block_counts, block_size_q, block_size_k,
                          _scale(softmax_scale, q))


def _block_forward(q: Tensor, k: Tensor, v: Tensor, kv_block_indices: Tensor,
                   kv_block_counts: Tensor, block_size_q: int, block_size_k: int,
                   softmax_scale: Optional[float], check_indices: bool, backend: Optional[str]
                  ) -> tuple[Tensor, Tensor]:
    _check_block(q, k, v, kv_block_indices, kv_block_counts, block_size_q, block_size_k,
                 softmax_scale)
    return _block_run(q, k, v, kv_block_indices, kv_block_counts, block_size_q, block_size_k,
                      softmax_scale, check_indices, backend)


block_sparse_attn_fwd = torch.library.custom_op("dlm::block_sparse_attn_fwd",
                                                mutates_args=())(_block_forward)


@block_sparse_attn_fwd.register_fake
def _(q, k, v, kv_block_indices, kv_block_counts, block_size_q, block_size_k, softmax_scale,
      check_indices, backend):
    _check_block(q, k, v, kv_block_indices, kv_block_counts, block_size_q, block_size_k,
                 softmax_scale)
    b, s, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=lse_dtype(q.dtype))


def _block_backward_body(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         dlse: Optional[Tensor], kv_block_indices: Tensor, kv_block_counts: Tensor,
                         block_size_q: int, block_size_k: int, softmax_scale: Optional[float],
                         backend: Optional[str]) -> tuple[Tensor, Tensor, Tensor]:
    impl = select(_problem(q, k), backend, family="sparse")
    return impl.block_bwd(dout, q, k, v, out, lse, dlse, kv_block_indices, kv_block_counts,
                          block_size_q, block_size_k, _scale(softmax_scale, q))


block_sparse_attn_bwd = torch.library.custom_op("dlm::block_sparse_attn_bwd",
                                                mutates_args=())(_block_backward_body)


@block_sparse_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, kv_block_indices, kv_block_counts, block_size_q,
      block_size_k, softmax_scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _block_setup_context(ctx, inputs, output):
    (q, k, v, kv_block_indices, kv_block_counts, block_size_q, block_size_k, softmax_scale,
     check_indices, backend) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_block_indices, kv_block_counts)
    ctx.block_size_q, ctx.block_size_k = block_size_q, block_size_k
    ctx.softmax_scale, ctx.backend = softmax_scale, backend


def _block_backward_with(bwd_call):
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, kv_block_indices, kv_block_counts = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = bwd_call(dout, q, k, v, out, lse, dlse, kv_block_indices, kv_block_counts,
                              ctx.block_size_q, ctx.block_size_k, ctx.softmax_scale, ctx.backend)
        return dq, dk, dv, None, None, None, None, None, None, None
    return backward


block_sparse_attn_fwd.register_autograd(_block_backward_with(block_sparse_attn_bwd),
                                        setup_context=_block_setup_context)
_block_sparse_attn = EagerOp("block_sparse_attn", block_sparse_attn_fwd, _block_run,
                             _block_setup_context, _block_backward_with(_block_backward_body))


# -- column-sparse ops --------------------------------------------------------------------------


def _column_run(q, k, v, kv_indices, kv_counts, softmax_scale, check_indices, backend):
    if check_indices:
        check_index_values(kv_indices, kv_counts, k.shape[1], "kv_indices", "kv_counts")
    impl = select(_problem(q, k), backend, family="sparse")
    return impl.column_fwd(q, k, v, kv_indices, kv_counts, _scale(softmax_scale, q))


def _column_forward(q: Tensor, k: Tensor, v: Tensor, kv_indices: Tensor, kv_counts: Tensor,
                    softmax_scale: Optional[float], check_indices: bool, backend: Optional[str]
                   ) -> tuple[Tensor, Tensor]:
    _check_column(q, k, v, kv_indices, kv_counts, softmax_scale)
    return _column_run(q, k, v, kv_indices, kv_counts, softmax_scale, check_indices, backend)


column_sparse_attn_fwd = torch.library.custom_op("dlm::column_sparse_attn_fwd",
                                                 mutates_args=())(_column_forward)


@column_sparse_attn_fwd.register_fake
def _(q, k, v, kv_indices, kv_counts, softmax_scale, check_indices, backend):
    _check_column(q, k, v, kv_indices, kv_counts, softmax_scale)
    b, s, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=lse_dtype(q.dtype))


def _column_backward_body(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          dlse: Optional[Tensor], kv_indices: Tensor, kv_counts: Tensor,
                          softmax_scale: Optional[float], backend: Optional[str]
                         ) -> tuple[Tensor, Tensor, Tensor]:
    impl = select(_problem(q, k), backend, family="sparse")
    return impl.column_bwd(dout, q, k, v, out, lse, dlse, kv_indices, kv_counts,
                           _scale(softmax_scale, q))


column_sparse_attn_bwd = torch.library.custom_op("dlm::column_sparse_attn_bwd",
                                                 mutates_args=())(_column_backward_body)


@column_sparse_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, kv_indices, kv_counts, softmax_scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _column_setup_context(ctx, inputs, output):
    q, k, v, kv_indices, kv_counts, softmax_scale, check_indices, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_indices, kv_counts)
    ctx.softmax_scale, ctx.backend = softmax_scale, backend


def _column_backward_with(bwd_call):
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, kv_indices, kv_counts = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = bwd_call(dout, q, k, v, out, lse, dlse, kv_indices, kv_counts,
                              ctx.softmax_scale, ctx.backend)
        return dq, dk, dv, None, None, None, None, None
    return backward


column_sparse_attn_fwd.register_autograd(_column_backward_with(column_sparse_attn_bwd),
                                         setup_context=_column_setup_context)
_column_sparse_attn = EagerOp("column_sparse_attn", column_sparse_attn_fwd, _column_run,
                              _column_setup_context, _column_backward_with(_column_backward_body))


# -- public API ---------------------------------------------------------------------------------


def block_sparse_attn(q, k, v, kv_block_indices, kv_block_counts, *, block_size_q, block_size_k,
                      softmax_scale=None, return_lse=False, check_indices=True, backend=None):
    """Block-sparse attention: each query block attends exactly to its listed key blocks.

    q: (B, Sq, H, D); k, v: (B, Sk, Hkv, D) with H % Hkv == 0 (GQA).
    kv_block_indices: int32 (B, H, ceil(Sq / block_size_q), max_blocks); query block i of head h
        attends to key blocks kv_block_indices[b, h, i, :kv_block_counts[b, h, i]] (distinct, in
        [0, ceil(Sk / block_size_k)), any order); key block j holds keys
        [j * block_size_k, min((j + 1) * block_size_k, Sk)).
    kv_block_counts: int32 (B, H, ceil(Sq / block_size_q)), each in [0, max_blocks]. A count of 0
        gives out 0 and lse -inf for that query block.
    block_size_q, block_size_k: selection block sizes, powers of two in [16, 256].
    softmax_scale: multiplies q.k; None means 1/sqrt(head_dim).
    return_lse: also return the float32 natural-log LSE (B, H, Sq) (differentiable).
    check_indices: check the index values (a sort of the lists and one host sync: 0.3-0.7 ms per
        call on the H200 at S = 16K-32K, see the module's "Checks"); False skips it for trusted
        selectors (an invalid list then gives undefined results).
    backend: force "cutlass", "triton" or "torch"; None picks the best eligible one (on sm90
        ``cutlass`` where it builds: its forward at block sizes 128, Triton's everywhere else).
    Returns out (B, Sq, H, D), or (out, lse).
    """
    _check_block(q, k, v, kv_block_indices, kv_block_counts, block_size_q, block_size_k,
                 softmax_scale)
    out, lse = _block_sparse_attn((q, k, v, kv_block_indices, kv_block_counts), q, k, v,
                                  kv_block_indices, kv_block_counts, block_size_q, block_size_k,
                                  softmax_scale, bool(check_indices), backend)
    return (out, lse) if return_lse else out


def column_sparse_attn(q, k, v, kv_indices, kv_counts, *, softmax_scale=None, return_lse=False,
                       check_indices=True, backend=None):
    """Column-sparse attention: every query of head h attends exactly to its head's listed keys.

    q: (B, Sq, H, D); k, v: (B, Sk, Hkv, D) with H % Hkv == 0 (head h reads kv head h // (H/Hkv)).
    kv_indices: int32 (B, H, K); head h attends to keys kv_indices[b, h, :kv_counts[b, h]]
        (distinct, in [0, Sk), any order).
    kv_counts: int32 (B, H), each in [0, K]; 0 gives out 0 and lse -inf for the whole head.
    softmax_scale, return_lse, check_indices, backend: as in ``block_sparse_attn`` (on sm90
        ``cutlass`` runs the forward at head dims 64 / 128 over the K listed keys of every head,
        copied: keep K near the longest count; the backward is Triton's).
    Returns out (B, Sq, H, D), or (out, lse (B, H, Sq)).
    """
    _check_column(q, k, v, kv_indices, kv_counts, softmax_scale)
    out, lse = _column_sparse_attn((q, k, v, kv_indices, kv_counts), q, k, v, kv_indices,
                                   kv_counts, softmax_scale, bool(check_indices), backend)
    return (out, lse) if return_lse else out
