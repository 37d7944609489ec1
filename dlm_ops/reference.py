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


# -- cached-block attention (dlm_ops/ops/cached.py) ----------------------------------------------
# Written from the definitions: attention over an explicit key set given as a per-sample boolean
# validity mask, and the merge as logaddexp plus softmax-weighted outputs.

__all__ += ["block_decode_attn_ref", "merge_attn_states_ref", "flashblock_attn_ref",
            "flashblock_refresh_ref"]


def _keyset_attention(q, k, v, valid, softmax_scale, compute_dtype):
    """q (B, bs, H, D) over k, v (B, N, Hkv, D) restricted to keys where ``valid`` (B, N)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.to(compute_dtype).transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    scores = ((qf @ kf.transpose(-1, -2)) * scale).masked_fill(~valid[:, None, None, :],
                                                                float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1).masked_fill(lse.unsqueeze(-1) == -math.inf, 0))
    return (probs @ vf).transpose(1, 2), lse


def block_decode_attn_ref(q, k_cache, v_cache, cache_seqlens=None, k_new=None, v_new=None, *,
                          softmax_scale=None, compute_dtype=torch.float32):
    """The block q (B, bs, H, D) attends, unmasked, to the first cache_seqlens[b] cache entries of
    its sample and to the block's own keys (k_new, v_new) as if appended. Returns (out, lse)."""
    b, smax = k_cache.shape[:2]
    lens = torch.full((b,), smax) if cache_seqlens is None else cache_seqlens.cpu().long()
    valid = (torch.arange(smax)[None, :] < lens[:, None]).to(q.device)
    k, v = k_cache, v_cache
    if k_new is not None:
        k, v = torch.cat([k_cache, k_new], dim=1), torch.cat([v_cache, v_new], dim=1)
        valid = torch.cat([valid, valid.new_ones((b, k_new.shape[1]))], dim=1)
    return _keyset_attention(q, k, v, valid, softmax_scale, compute_dtype)


def merge_attn_states_ref(out_a, lse_a, out_b, lse_b, *, compute_dtype=torch.float32):
    """lse = log(exp(lse_a) + exp(lse_b)); out = sum_x exp(lse_x - lse) out_x over the sides with
    lse_x > -inf (both -inf: out 0, lse -inf). out (B, S, H, D), lse (B, H, S)."""
    la, lb = lse_a.to(compute_dtype), lse_b.to(compute_dtype)
    lse = torch.logaddexp(la, lb)
    out = torch.zeros(out_a.shape, dtype=compute_dtype, device=out_a.device)
    for o, l in ((out_a, la), (out_b, lb)):
        w = torch.where(l > -math.inf, torch.exp(l - lse.masked_fill(lse == -math.inf, 0)), 0.0)
        out = out + torch.where(w.transpose(1, 2)[..., None] > 0,
                                w.transpose(1, 2)[..., None] * o.to(compute_dtype), 0.0)
    return out, lse


def flashblock_attn_ref(q, k_block, v_block, cached_out, cached_lse, dirty=None, *,
                        softmax_scale=None, compute_dtype=torch.float32):
    """Attention over the block's own keys, merged with the cached block-external (out, lse) on
    the rows that are not dirty."""
    valid = torch.ones(k_block.shape[:2], dtype=torch.bool, device=q.device)
    o, l = _keyset_attention(q, k_block, v_block, valid, softmax_scale, compute_dtype)
    lse_c = cached_lse.to(compute_dtype)
    if dirty is not None:
        lse_c = lse_c.masked_fill(dirty[:, None, :], -math.inf)
    return merge_attn_states_ref(cached_out, lse_c, o, l, compute_dtype=compute_dtype)


def flashblock_refresh_ref(q, k_cache, v_cache, k_block, v_block, cache_seqlens=None, *,
                           softmax_scale=None, compute_dtype=torch.float32):
    """(out, lse) over cache + block, and (out, lse) over the cache alone."""
    kw = dict(softmax_scale=softmax_scale, compute_dtype=compute_dtype)
    full = block_decode_attn_ref(q, k_cache, v_cache, cache_seqlens, k_block, v_block, **kw)
    ext = block_decode_attn_ref(q, k_cache, v_cache, cache_seqlens, **kw)
    return (*full, *ext)
