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
    mean times block_q x block_k, so both rank identically for full tiles.
  - How rho applies. Each part keeps ``min(n_part, int(n_part * rho) + 1)`` blocks, SparseD's
    ``int(nKb * rho) + 1`` applied to each part's own block count (SparseD's code takes the top
    int(nKb * rho) + 1 over *all* blocks and then drops those in the generation part, so its
    prompt part keeps a data-dependent number of blocks). Every query block therefore keeps
    exactly k_prompt + k_gen blocks, at least one of each part that exists.
  - Ties go to the lowest block index (``tables.topk_mask``).

Cost: the mass is computed in chunks (``_pooling.pooled_mass``): 2x the QK^T of one attention
forward, working memory bounded by ``_pooling.CHUNK_BYTES`` (256 MiB), never S x S.
"""

from __future__ import annotations

import math

import torch

from . import _select_backend
from .tables import mask_to_indices, topk_mask


def check_selection_inputs(q, k, block_size_q: int, block_size_k: int) -> None:
    """q (B, Sq, H, D), k (B, Sk, Hkv, D) floating, H a multiple of Hkv; block sizes >= 1."""
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
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"{name} must be an int >= 1, got {bs!r}")


def check_fraction(name: str, x) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 <= x <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {x!r}")


def prompt_blocks(prompt_len: int | None, seqlen_k: int, block_size_k: int) -> int:
    """nPb: how many key blocks form the prompt part (0 or nKb: a single part)."""
    nkb = math.ceil(seqlen_k / block_size_k)
    if prompt_len is None:
        return 0
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 0:
        raise ValueError(f"prompt_len must be an int >= 0 or None, got {prompt_len!r}")
    return min(nkb, math.ceil(prompt_len / block_size_k))


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
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _select_backend.block_mass(q, k, block_size_q, block_size_k, split, scale, chunk_q,
                                      chunk_k, backend)


def sparsed_table_from_mass(mass: torch.Tensor, rho: float, num_prompt_blocks: int) -> torch.Tensor:
    """Boolean (B, H, nQb, nKb) table: each part's top ``part_k`` blocks per query block."""
    check_fraction("rho", rho)
    nkb = mass.shape[-1]
    npb = num_prompt_blocks if 0 < num_prompt_blocks < nkb else 0
    parts = [(0, npb), (npb, nkb)] if npb else [(0, nkb)]
    return torch.cat([topk_mask(mass[..., a:b], part_k(b - a, rho)) for a, b in parts], dim=-1)


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
    return mask_to_indices(sparsed_table_from_mass(mass, rho, npb))
