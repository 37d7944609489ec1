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


# --- Pattern selection (dlm_ops.sparsity): the scores the selectors rank, materialised ----------
# Written from the definitions (sparsity/_pooling.py, sparsed.py, pulsecol.py): the full S x S
# probabilities in float64, then pooled. The selectors compute the same numbers in chunks.


def attention_mass_ref(q, k, *, block_size_q, block_size_k, split=None, softmax_scale=None):
    """Tile mass float64 (B, H, ceil(Sq/bq), ceil(Sk/bk)): sum over the tile of p[i, j], p the
    softmax of scale * q.k over keys [0, split) and [split, Sk) separately (split None: all)."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kf = k.double().repeat_interleave(h // k.shape[2], dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), kf) * scale
    split = sk if split is None else split
    probs = torch.cat([torch.softmax(scores[..., :split], -1),
                       torch.softmax(scores[..., split:], -1)], dim=-1)
    tile_q = torch.arange(sq) // block_size_q
    tile_k = torch.arange(sk) // block_size_k
    onehot_q = torch.nn.functional.one_hot(tile_q).double().to(q.device)  # (Sq, nQb)
    onehot_k = torch.nn.functional.one_hot(tile_k).double().to(q.device)  # (Sk, nKb)
    return torch.einsum("bhij,iI,jJ->bhIJ", probs, onehot_q, onehot_k)


def column_mass_ref(q, k, rows=None, softmax_scale=None):
    """Column mass float64 (B, H, Sk): sum over query ``rows`` (None: all) of the softmax over all keys."""
    q = q if rows is None else q[:, rows]
    return attention_mass_ref(q, k, block_size_q=q.shape[1], block_size_k=1,
                              softmax_scale=softmax_scale)[:, :, 0]
