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
    "HYBRID_EPS",
    "hybrid_feature_map_ref",
    "block_hybrid_attn_ref",
    "hybrid_state_update_ref",
    "block_hybrid_train_attn_ref",
    "block_decode_attn_ref",
    "merge_attn_states_ref",
    "flashblock_attn_ref",
    "flashblock_refresh_ref",
    "block_sparse_mask",
    "column_sparse_mask",
    "block_sparse_attn_ref",
    "column_sparse_attn_ref",
    "attention_mass_ref",
    "column_mass_ref",
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

# -- block-hybrid attention (LLaDA-Hybrid, issue #6 item 4) ---------------------------------------
# Written from the definitions in dlm_ops/ops/hybrid.py's docstring: phi_h(x) = [softmax(x W_h),
# softmax(-x W_h)], per-query-head state S (2F, D), Z (2F,), unnormalised in-block exponentials
# a_ij = exp(s_ij - max_j s_ij), gate w_h = sigmoid(gate_h), and each denominator term clamped at
# HYBRID_EPS. Everything runs in ``compute_dtype`` (states included), like the references above.

HYBRID_EPS = 1e-6


def hybrid_feature_map_ref(x, feature_weight, compute_dtype=torch.float32):
    """phi of x (B, H, S, D) with feature_weight (H, D, F): (B, H, S, 2F) in ``compute_dtype``."""
    u = torch.einsum("bhsd,hdf->bhsf", x.to(compute_dtype), feature_weight.to(compute_dtype))
    return torch.cat([torch.softmax(u, dim=-1), torch.softmax(-u, dim=-1)], dim=-1)


def _heads_first(x, heads, compute_dtype):
    """(B, S, Hkv, D) -> (B, H, S, D): query head h reads kv head h // (H / Hkv)."""
    return x.to(compute_dtype).repeat_interleave(heads // x.shape[2], dim=2).transpose(1, 2)


def block_hybrid_attn_ref(q, k, v, state_s, state_z, feature_weight, gate, *, softmax_scale=None,
                          compute_dtype=torch.float32):
    """One active block: q (B, bs, H, D), k/v (B, bs, Hkv, D), state_s (B, H, 2F, D),
    state_z (B, H, 2F). Returns out (B, bs, H, D) in ``compute_dtype``."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    heads = q.shape[2]
    qf = q.to(compute_dtype).transpose(1, 2)
    kf, vf = _heads_first(k, heads, compute_dtype), _heads_first(v, heads, compute_dtype)
    s = (qf @ kf.transpose(-1, -2)) * scale
    a = torch.exp(s - s.amax(dim=-1, keepdim=True))
    w = torch.sigmoid(gate.to(compute_dtype))[None, :, None]  # (1, H, 1)
    phi_q = hybrid_feature_map_ref(qf, feature_weight, compute_dtype)
    num = w[..., None] * (a @ vf) + phi_q @ state_s.to(compute_dtype)
    lin = (phi_q * state_z.to(compute_dtype)[:, :, None, :]).sum(-1)
    den = torch.clamp(w * a.sum(-1), min=HYBRID_EPS) + torch.clamp(lin, min=HYBRID_EPS)
    return (num / den[..., None]).transpose(1, 2)


def hybrid_state_update_ref(state_s, state_z, k, v, feature_weight, compute_dtype=None):
    """Commit a block: S + sum_j phi(k_j)^T v_j, Z + sum_j phi(k_j) (in the state's dtype)."""
    compute_dtype = compute_dtype or state_s.dtype
    heads = state_s.shape[1]
    phi_k = hybrid_feature_map_ref(_heads_first(k, heads, compute_dtype), feature_weight,
                                   compute_dtype)
    vf = _heads_first(v, heads, compute_dtype)
    return (state_s.to(compute_dtype) + phi_k.transpose(-1, -2) @ vf,
            state_z.to(compute_dtype) + phi_k.sum(dim=-2))


def block_hybrid_train_attn_ref(q, k, v, feature_weight, gate, block_size, *, softmax_scale=None,
                                compute_dtype=torch.float32):
    """Training form on (B, 2n, H, D) [noisy | clean]: a loop over blocks. The queries of block b
    in either half read the state of clean blocks 0..b-1 and attend within their own block of their
    own half. Returns out (B, 2n, H, D) in ``compute_dtype``."""
    b, seqlen, heads, d = q.shape
    n, f = seqlen // 2, feature_weight.shape[-1]
    state_s = q.new_zeros((b, heads, 2 * f, d), dtype=compute_dtype)
    state_z = q.new_zeros((b, heads, 2 * f), dtype=compute_dtype)
    noisy, clean = [q.new_zeros((b, 0, heads, d), dtype=compute_dtype)], []
    for start in range(0, n, block_size):
        end = min(start + block_size, n)
        for half, outs in ((0, noisy), (n, clean)):
            blk = slice(half + start, half + end)
            outs.append(block_hybrid_attn_ref(q[:, blk], k[:, blk], v[:, blk], state_s, state_z,
                                              feature_weight, gate, softmax_scale=softmax_scale,
                                              compute_dtype=compute_dtype))
        state_s, state_z = hybrid_state_update_ref(state_s, state_z, k[:, n + start:n + end],
                                                   v[:, n + start:n + end], feature_weight,
                                                   compute_dtype)
    return torch.cat(noisy + clean, dim=1)

# -- cached-block attention (dlm_ops/ops/cached.py) ----------------------------------------------
# Written from the definitions: attention over an explicit key set given as a per-sample boolean
# validity mask, and the merge as logaddexp plus softmax-weighted outputs.



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


