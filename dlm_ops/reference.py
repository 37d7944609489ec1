"""Dense eager references, one per op: the ground truth for tests and benchmarks.

They materialise the full S x S score matrix and build their masks straight from the definition in
DESIGN.md section 1 (never from ``dlm_ops.geometry``, so a geometry bug cannot hide behind them).
``compute_dtype`` picks the arithmetic: float32/float64 for ground truth, or the inputs' own
low precision for the "plain PyTorch" baseline that the accuracy rule compares against. Inputs of
any dtype are accepted; results come back in ``compute_dtype`` and are differentiable by autograd.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "block_diffusion_mask",
    "block_causal_mask",
    "masked_attention_ref",
    "diffusion_attn_ref",
    "block_causal_attn_ref",
    "diffusion_attn_varlen_ref",
]


def block_diffusion_mask(seqlen: int, block_size: int, device=None) -> torch.Tensor:
    """Boolean (2n, 2n) BD3-LM mask, written as the definition reads."""
    n = seqlen // 2
    i = torch.arange(seqlen, device=device)
    clean = i >= n
    block = (i - clean.long() * n) // block_size
    cq, ck = clean[:, None], clean[None, :]
    bq, bk = block[:, None], block[None, :]
    same_half_same_block = (cq == ck) & (bq == bk)
    noisy_sees_earlier_clean = ~cq & ck & (bk < bq)
    clean_sees_clean_up_to_own = cq & ck & (bk <= bq)
    return same_half_same_block | noisy_sees_earlier_clean | clean_sees_clean_up_to_own


def block_causal_mask(seqlen: int, block_size: int, device=None) -> torch.Tensor:
    """Boolean (S, S): key block <= query block."""
    block = torch.arange(seqlen, device=device) // block_size
    return block[None, :] <= block[:, None]


def masked_attention_ref(q, k, v, mask, *, softmax_scale=None, softcap=0.0,
                         compute_dtype=torch.float32):
    """Attention of q (B, S, H, D) over k, v (B, S, Hkv, D) under a boolean (S, S) mask.

    Returns out (B, S, H, D) and lse (B, H, S) in ``compute_dtype``; rows that see no key get
    out 0 and lse -inf.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.to(compute_dtype).transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1).masked_fill(lse.unsqueeze(-1) == -math.inf, 0))
    out = probs @ vf
    return out.transpose(1, 2), lse


def diffusion_attn_ref(q, k, v, block_size, **kw):
    """Block-diffusion attention over (B, 2n, H, D) ``[noisy | clean]`` sequences."""
    return masked_attention_ref(q, k, v, block_diffusion_mask(q.shape[1], block_size, q.device), **kw)


def block_causal_attn_ref(q, k, v, block_size, **kw):
    """Block-causal attention over (B, S, H, D)."""
    return masked_attention_ref(q, k, v, block_causal_mask(q.shape[1], block_size, q.device), **kw)


def diffusion_attn_varlen_ref(q, k, v, cu_seqlens, block_size, **kw):
    """Packed samples: q (total, H, D), k/v (total, Hkv, D); returns out (total, H, D), lse (H, total)."""
    dtype = kw.get("compute_dtype", torch.float32)
    outs = [q.new_zeros((0, *q.shape[1:]), dtype=dtype)]  # so that zero samples still concatenate
    lses = [q.new_zeros((q.shape[1], 0), dtype=dtype)]
    cu = cu_seqlens.tolist()
    for s0, s1 in zip(cu[:-1], cu[1:]):
        o, l = diffusion_attn_ref(q[None, s0:s1], k[None, s0:s1], v[None, s0:s1], block_size, **kw)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


# -- sparse attention (dlm_ops/ops/sparse.py) ------------------------------------------------------
# The masks are rebuilt from the index lists as the op definitions read: query i of head h sees key
# j iff j's block (j // block_size_k) is among the first count entries listed for i's block
# (i // block_size_q); for column sparsity, iff j is among the first count keys listed for head h.


def block_sparse_mask(kv_block_indices, kv_block_counts, seqlen_q, seqlen_k, block_size_q,
                      block_size_k) -> torch.Tensor:
    """Boolean (B, H, Sq, Sk) from the block lists."""
    b, h, nqb, m = kv_block_indices.shape
    nkb = -(-seqlen_k // block_size_k)
    listed = torch.arange(m, device=kv_block_indices.device) < kv_block_counts[..., None]
    table = torch.zeros((b, h, nqb, nkb + 1), dtype=torch.bool, device=kv_block_indices.device)
    table.scatter_(-1, torch.where(listed, kv_block_indices.long(), nkb), True)  # nkb: unlisted
    rows = torch.arange(seqlen_q, device=table.device) // block_size_q
    cols = torch.arange(seqlen_k, device=table.device) // block_size_k
    return table[:, :, rows][..., cols]


def column_sparse_mask(kv_indices, kv_counts, seqlen_q, seqlen_k) -> torch.Tensor:
    """Boolean (B, H, Sq, Sk) from the column lists (every query of a head sees the same keys)."""
    b, h, m = kv_indices.shape
    listed = torch.arange(m, device=kv_indices.device) < kv_counts[..., None]
    table = torch.zeros((b, h, seqlen_k + 1), dtype=torch.bool, device=kv_indices.device)
    table.scatter_(-1, torch.where(listed, kv_indices.long(), seqlen_k), True)
    return table[:, :, None, :seqlen_k].expand(b, h, seqlen_q, seqlen_k)


def block_sparse_attn_ref(q, k, v, kv_block_indices, kv_block_counts, block_size_q, block_size_k,
                          **kw):
    """Block-sparse attention: q (B, Sq, H, D), k/v (B, Sk, Hkv, D); dense with the explicit mask."""
    mask = block_sparse_mask(kv_block_indices, kv_block_counts, q.shape[1], k.shape[1],
                             block_size_q, block_size_k)
    return masked_attention_ref(q, k, v, mask, **kw)


def column_sparse_attn_ref(q, k, v, kv_indices, kv_counts, **kw):
    """Column-sparse attention: q (B, Sq, H, D), k/v (B, Sk, Hkv, D); dense with the explicit mask."""
    return masked_attention_ref(q, k, v, column_sparse_mask(kv_indices, kv_counts, q.shape[1],
                                                            k.shape[1]), **kw)


__all__ += ["block_sparse_mask", "column_sparse_mask", "block_sparse_attn_ref",
            "column_sparse_attn_ref"]
