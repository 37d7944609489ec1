"""Pattern formats: boolean tables <-> the index lists the sparse ops take, and the top-k rule.

Block patterns: a boolean table (B, H, nQb, nKb) (what SparseD builds) <-> (kv_block_indices int32
(B, H, nQb, max_blocks), kv_block_counts int32 (B, H, nQb)), the inputs of
``dlm_ops.block_sparse_attn``. Column patterns: a boolean (B, H, Sk) <-> (kv_indices int32
(B, H, K), kv_counts int32 (B, H)), the inputs of ``dlm_ops.column_sparse_attn``.

Conventions (every selector in this package produces them, the tests check them):
  - the first ``count`` entries of a row are the selected indices in ascending order, unique;
  - the entries past ``count`` (padding) are 0, so a kernel that reads one by mistake stays in
    range and the tables of two identical patterns compare equal;
  - ``max_blocks`` / ``K`` is the largest count, and at least 1 (a zero-width last dim would give
    the kernels a degenerate stride and the fake functions a 0-sized tensor to special-case).
"""

from __future__ import annotations

import torch

PAD = 0  # the value of the entries past each row's count (see the module docstring)


def _check_bool(name: str, t, rank: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bool or t.dim() != rank:
        got = f"{t.dtype} shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {rank}-D bool tensor {layout}, got {got}")


def mask_to_indices(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean (..., N) -> (indices int32 (..., max(1, max count)), counts int32 (...)).

    Selected positions come first in ascending order; the rest is ``PAD``. One stable sort: the
    key puts selected entries (key = position) before unselected ones (key = N + position).
    """
    n = mask.shape[-1]
    counts = mask.sum(-1, dtype=torch.int32)
    width = max(1, int(counts.max())) if counts.numel() else 1
    pos = torch.arange(n, device=mask.device)
    key = torch.where(mask, pos, pos + n)
    order = key.argsort(dim=-1)[..., :width] if n else mask.new_zeros((*mask.shape[:-1], 0), dtype=torch.long)
    if order.shape[-1] < width:  # N == 0: pad up to the minimum width of 1
        order = torch.nn.functional.pad(order, (0, width - order.shape[-1]))
    keep = torch.arange(width, device=mask.device) < counts.unsqueeze(-1)
    return torch.where(keep, order, PAD).to(torch.int32), counts


def indices_to_mask(indices: torch.Tensor, counts: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of ``mask_to_indices``: (..., W) int indices and (...) counts -> bool (..., n)."""
    width = indices.shape[-1]
    valid = torch.arange(width, device=indices.device) < counts.unsqueeze(-1).long()
    mask = torch.zeros((*indices.shape[:-1], n + 1), dtype=torch.bool, device=indices.device)
    # Invalid slots write to a spare column n that is dropped, so padding never sets a real entry.
    mask.scatter_(-1, torch.where(valid, indices.long(), n), True)
    return mask[..., :n]


def block_table_to_indices(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean (B, H, nQb, nKb) block table -> (kv_block_indices int32 (B, H, nQb, max_blocks),
    kv_block_counts int32 (B, H, nQb)) for ``dlm_ops.block_sparse_attn``.

    Selected key blocks are listed in ascending order; entries past a row's count are 0;
    max_blocks = the largest count, at least 1.
    """
    _check_bool("table", table, 4, "(B, H, nQb, nKb)")
    return mask_to_indices(table)


def indices_to_block_table(kv_block_indices, kv_block_counts, num_key_blocks: int) -> torch.Tensor:
    """The inverse of ``block_table_to_indices``: -> bool (B, H, nQb, num_key_blocks)."""
    return indices_to_mask(kv_block_indices, kv_block_counts, num_key_blocks)


def column_mask_to_indices(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean (B, H, Sk) column mask -> (kv_indices int32 (B, H, K), kv_counts int32 (B, H)) for
    ``dlm_ops.column_sparse_attn``, with the same conventions as ``block_table_to_indices``."""
    _check_bool("mask", mask, 3, "(B, H, Sk)")
    return mask_to_indices(mask)


def indices_to_column_mask(kv_indices, kv_counts, seqlen_k: int) -> torch.Tensor:
    """The inverse of ``column_mask_to_indices``: -> bool (B, H, seqlen_k)."""
    return indices_to_mask(kv_indices, kv_counts, seqlen_k)


def topk_mask(scores: torch.Tensor, k, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask of the ``k`` largest ``scores`` along the last dim, ties to the lowest index.

    ``torch.topk`` leaves the order of equal values unspecified (it differs between CPU and CUDA),
    so this takes a stable descending sort: among equal scores the earlier position sorts first and
    wins. ``k`` is an int or a tensor broadcastable to ``scores.shape[:-1]`` (per-row k);
    ``valid`` (bool, like scores) excludes positions, which then never count towards k.
    """
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    rank_ok = torch.arange(scores.shape[-1], device=scores.device) < torch.as_tensor(
        k, device=scores.device).unsqueeze(-1)
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, rank_ok.expand_as(order))
    return mask if valid is None else mask & valid


def topk_indices(scores: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
    """The ``k`` largest ``scores`` along the last dim as int64 positions (+ ``offset``), in
    ascending order, ties to the lowest index (stable sort, as ``topk_mask``). The width is k for
    every row, so nothing depends on the data: usable inside torch.compile(fullgraph=True)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values + offset
