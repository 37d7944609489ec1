"""SparseD block selection: per head, pooled attention mass per tile, top blocks per query block.

SparseD (Wang et al. 2025) runs full attention for the early denoising steps, then selects a
block-sparse pattern per head once and reuses it. For each query block I it keeps the key blocks J
with the largest pooled attention probability, and it selects *prompt* keys and *generation* keys
separately ("isolated selection") so that the generation region, whose keys are mostly mask
tokens, is never crowded out by a long prompt (or the reverse).

Definitions here (our own; where SparseD's public code differs, said so):
  - Key parts. The key blocks are split at ``nPb = ceil(prompt_len / block_size_k)``: blocks
    [0, nPb) are the prompt part (a block straddling the boundary counts as prompt, as in
    SparseD), [nPb, nKb) the generation part. ``prompt_len`` None / 0 / >= Sk: one part.
  - Score. mass[I, J] = sum over i in I, j in J of p[i, j], p the softmax over the keys of J's
    part only (each part normalised on its own). SparseD's code normalises the generation part on
    its own but the prompt part over all keys; we normalise both the same way so that neither
    part's ranking depends on how much mass the other holds. The mass equals SparseD's padded tile
    mean times block_q x block_k, so both rank identically for full tiles. Logits use the
    attention's own scale (softmax_scale, default 1/sqrt(D)); SparseD's code divides by
    sqrt(num_heads) instead, which flattens or sharpens the probabilities it pools.
  - How rho applies. Each part keeps ``min(n_part, int(n_part * rho) + 1)`` blocks, SparseD's
    ``int(nKb * rho) + 1`` applied to each part's own block count (SparseD's code takes the top
    int(nKb * rho) + 1 over *all* blocks and then drops those in the generation part, so its
    prompt part keeps a data-dependent number of blocks). Every query block therefore keeps
    exactly k_prompt + k_gen blocks, at least one of each part that exists.
  - Ties go to the lowest block index (a stable sort, ``tables.topk_indices``).

Cost: the mass is computed in chunks (``_pooling.pooled_mass``): 2x the QK^T of one attention
forward, working memory bounded by ``_pooling.CHUNK_BYTES`` (256 MiB), never S x S.
"""

from __future__ import annotations

import torch

from ..ops.sparse_select import check_selection_inputs, sparse_block_mass
from .tables import topk_indices


def check_fraction(name: str, x) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 <= x <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {x!r}")


def prompt_blocks(prompt_len: int | None, seqlen_k: int, block_size_k: int) -> int:
    """nPb: how many key blocks form the prompt part (0 or nKb: a single part)."""
    nkb = -(-seqlen_k // block_size_k)  # integer ceil: seqlen_k may be a SymInt under compile
    if prompt_len is None:
        return 0
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 0:
        raise ValueError(f"prompt_len must be an int >= 0 or None, got {prompt_len!r}")
    return min(nkb, -(-prompt_len // block_size_k))


def part_k(n_part: int, rho: float) -> int:
    """Blocks one part keeps: SparseD's int(n * rho) + 1, at most the part's size."""
    return min(n_part, int(n_part * rho) + 1) if n_part else 0


def sparsed_block_mass(q, k, *, block_size_q: int, block_size_k: int, prompt_len=None,
                       softmax_scale=None, chunk_q=None, chunk_k=None, backend=None) -> torch.Tensor:
    """The score SparseD ranks: fp32 (B, H, nQb, nKb) tile masses, each key part normalised alone.

    ``backend``: None takes the fused Triton kernel on CUDA when the block sizes are powers of two
    in [16, 128] and the chunked torch path otherwise (``chunk_q``/``chunk_k`` apply to it);
    "torch" / "triton" force one (ValueError / UnsupportedConfig when it cannot run the call).
    """
    check_selection_inputs(q, k, block_size_q, block_size_k)
    sk = k.shape[1]
    npb = prompt_blocks(prompt_len, sk, block_size_k)
    split = min(sk, npb * block_size_k) if npb else sk
    return sparse_block_mass(q, k, block_size_q, block_size_k, split, softmax_scale, chunk_q,
                             chunk_k, backend)


def _part_parts(nkb: int, num_prompt_blocks: int) -> list[tuple[int, int]]:
    npb = num_prompt_blocks if 0 < num_prompt_blocks < nkb else 0
    return [(0, npb), (npb, nkb)] if npb else [(0, nkb)]


def sparsed_indices_from_mass(mass: torch.Tensor, rho: float, num_prompt_blocks: int):
    """(kv_block_indices, kv_block_counts) of each part's top ``part_k`` blocks per query block.

    Every row keeps exactly k = sum of part_k, so the width is k and the indices come straight
    from a stable sort (ties to the lowest index), no data-dependent shape: this runs inside
    torch.compile(fullgraph=True). Same result as ``tables.block_table_to_indices`` of the table.
    """
    check_fraction("rho", rho)
    idx = torch.cat([topk_indices(mass[..., a:b], part_k(b - a, rho), offset=a)
                     for a, b in _part_parts(mass.shape[-1], num_prompt_blocks)], dim=-1)
    idx = idx.to(torch.int32)  # parts are consecutive ranges: the concatenation stays ascending
    return idx, torch.full(mass.shape[:-1], idx.shape[-1], dtype=torch.int32, device=mass.device)


def sparsed_select(q, k, *, block_size_q: int, block_size_k: int, rho: float, prompt_len=None,
                   softmax_scale=None, chunk_q=None, chunk_k=None, backend=None):
    """SparseD selection -> (kv_block_indices int32 (B, H, nQb, W), kv_block_counts int32
    (B, H, nQb)) for ``dlm_ops.block_sparse_attn`` (same block sizes).

    q (B, Sq, H, D), k (B, Sk, Hkv, D) (GQA: query head h uses kv head h // (H // Hkv)).
    ``rho`` in [0, 1]: each key part keeps min(n, int(n * rho) + 1) of its n blocks (module
    docstring). ``backend``: see ``sparsed_block_mass``.
    """
    check_fraction("rho", rho)
    mass = sparsed_block_mass(q, k, block_size_q=block_size_q, block_size_k=block_size_k,
                              prompt_len=prompt_len, softmax_scale=softmax_scale, chunk_q=chunk_q,
                              chunk_k=chunk_k, backend=backend)
    npb = prompt_blocks(prompt_len, k.shape[1], block_size_k)
    return sparsed_indices_from_mass(mass, rho, npb)
