"""PulseCol column selection: per head, the key columns that hold the most attention mass.

Column importance of key j in head h is sum over query rows i of p[i, j] (each row's softmax over
all keys), over a deterministic sample of query rows or all of them; the top ``keep`` fraction of
columns is kept: K = min(Sk, max(1, ceil(keep * Sk))) columns per (batch, head), ties to the lowest
index. Every query of the head then attends to exactly those columns (``dlm_ops.column_sparse_attn``).
When to refresh is the step cache's business (``caches.PulseColCache``).

Sampled rows: ``sample_rows=n`` takes rows floor(i * Sq / n), i < n (evenly spread, row 0
included, the same rows on every call); a 1-D int tensor names the rows (a repeated row counts
each time); None takes all. GQA: query head h scores with kv head h // (H / Hkv) and keeps its own
columns (the query heads sharing a kv head are not summed).

The mass is the custom op ``dlm::sparse_column_mass`` (dlm_ops/ops/sparse_select.py), two QK^T
passes over the sampled rows and never the S x S matrix, with a backend from the "sparse_select"
registry: on CUDA the Triton kernels (templates/column_mass.py: each row's LSE, then one program
per key tile summing exp(s - lse) over the rows, deterministic, no atomics); elsewhere, or for
head dims that are not multiples of 8, chunked PyTorch (``_pooling.pooled_mass`` with key blocks
of 1, working memory bounded by ``_pooling.CHUNK_BYTES``). ``backend="torch"`` / ``"triton"``
forces one.
"""

from __future__ import annotations

import math

import torch

from ..ops.sparse_select import check_selection_inputs, sparse_column_mass
from .sparsed import check_fraction
from .tables import topk_indices


def sample_rows_index(seqlen_q: int, sample_rows, device) -> torch.Tensor | None:
    """The query rows PulseCol scores with (None: all). A tensor's values are range-checked by
    the op (``dlm::sparse_column_mass``, one host sync); the rows made from an int need no check."""
    if sample_rows is None:
        return None
    if isinstance(sample_rows, torch.Tensor):
        if sample_rows.dim() != 1 or sample_rows.dtype not in (torch.int32, torch.int64) \
                or sample_rows.numel() < 1:
            raise ValueError(f"sample_rows must be a non-empty 1-D int tensor, an int or None, got "
                             f"{sample_rows.dtype} shape {tuple(sample_rows.shape)}")
        return sample_rows.to(device=device, dtype=torch.long)
    if isinstance(sample_rows, bool) or not isinstance(sample_rows, int) or sample_rows < 1:
        raise ValueError(f"sample_rows must be an int >= 1, a 1-D int tensor or None, got {sample_rows!r}")
    if sample_rows >= seqlen_q:
        return None
    return torch.arange(sample_rows, device=device) * seqlen_q // sample_rows


def keep_count(seqlen_k: int, keep: float) -> int:
    return min(seqlen_k, max(1, math.ceil(keep * seqlen_k)))


def pulsecol_column_mass(q, k, *, sample_rows=None, softmax_scale=None, chunk_rows=None,
                         chunk_k=None, backend=None) -> torch.Tensor:
    """fp32 (B, H, Sk): attention mass per key column over the (sampled) query rows.

    ``backend``: None takes the Triton kernels on CUDA and the chunked torch path elsewhere
    (``chunk_rows``/``chunk_k`` apply to it); "torch" / "triton" force one."""
    check_selection_inputs(q, k, 1, 1)
    rows = sample_rows_index(q.shape[1], sample_rows, q.device)
    return sparse_column_mass(q, k, rows, isinstance(sample_rows, torch.Tensor), softmax_scale,
                              chunk_rows, chunk_k, backend)


def pulsecol_select(q, k, *, keep: float, sample_rows=None, softmax_scale=None, chunk_rows=None,
                    chunk_k=None, backend=None):
    """PulseCol selection -> (kv_indices int32 (B, H, K), kv_counts int32 (B, H)) for
    ``dlm_ops.column_sparse_attn``; q (B, Sq, H, D), k (B, Sk, Hkv, D). ``backend``: see
    ``pulsecol_column_mass``."""
    check_fraction("keep", keep)
    mass = pulsecol_column_mass(q, k, sample_rows=sample_rows, softmax_scale=softmax_scale,
                                chunk_rows=chunk_rows, chunk_k=chunk_k, backend=backend)
    idx = topk_indices(mass, keep_count(k.shape[1], keep)).to(torch.int32)
    return idx, torch.full(idx.shape[:-1], idx.shape[-1], dtype=torch.int32, device=idx.device)
