"""Triton kernels for block-hybrid (LLaDA-Hybrid) decoding: the step of one active block against
a linear-attention state, and the commit of a block into the state (definitions in
dlm_ops/ops/hybrid.py).

Notation
--------
    B, H, Hkv, G      batch, query heads, kv heads, G = H // Hkv (query head h reads kv head h // G)
    bs, BLOCK_S       active-block length (its queries and its keys) and its power-of-two padding
    D, BLOCK_D        head dim and its padding;  F, BLOCK_F  features per sign (phi has 2F)
    W                 feature_weight (H, D, F) contiguous: W[h] maps a head's q or k to F logits
    S, Z              state (B, H, 2F, D), (B, H, 2F) fp32 contiguous: rows [0, F) belong to
                      softmax(xW), rows [F, 2F) to softmax(-xW)
    gate              (H,) pre-sigmoid gate; w = sigmoid(gate[h])

One program per (batch, query head) does the whole block: the in-block scores and their
unnormalised exponentials a = exp(s - rowmax) (base 2 inside), phi(q) from q @ W[h] in fp32, the
state terms phi(q) S and phi(q) . Z, and the shared normalisation. The state is the big read
(2F * D * 4 bytes = 64 KB per head at F=64, D=128, against 8 KB for q, k or v of a 32-token bf16
block), so the kernel is bandwidth-bound on it; one program per head reads it once. The commit
kernel is laid out the same way: one program per (batch, query head) forms phi(k) with that head's
W[h] and writes S + phi(k)^T v and Z + sum phi(k) to new tensors (the op is functional).

Precision: fp32 inputs take IEEE fp32 dots everywhere. Low-precision inputs take the attention
dots in the input dtype (fp32 accumulation, a in the input dtype for a @ v, as FlashAttention
does) and the fp32 dots of the linear part (q @ W, phi @ S) in "tf32x3" (three tf32 passes, about
fp32 accuracy): plain tf32 would round S and phi to 10 mantissa bits, as coarse as fp16 itself.
"""

import triton
import triton.language as tl


@triton.jit
def _dot32(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _softmax_rows(u, ok):
    """Softmax over axis 1 of an fp32 tile, lanes where ``ok`` is false excluded."""
    u = tl.where(ok, u, float("-inf"))
    p = tl.exp2((u - tl.max(u, 1)[:, None]) * 1.4426950408889634)
    return p / tl.sum(p, 1)[:, None]


@triton.jit
def hybrid_decode_kernel(
    Q, K, V, O, S, Z, W, GATE,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
    H, G, bs, F, scale, eps,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
    IEEE: tl.constexpr,
):
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    kvh = h // G
    rows = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    feats = tl.arange(0, BLOCK_F)
    row_ok, dim_ok, feat_ok = rows < bs, dims < D, feats < F
    tile_ok = row_ok[:, None] & dim_ok[None, :]

    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=tile_ok, other=0.0)
    k = tl.load(K + b * skb + kvh * skh + rows[:, None] * sks + dims[None, :], mask=tile_ok, other=0.0)
    v = tl.load(V + b * svb + kvh * svh + rows[:, None] * svs + dims[None, :], mask=tile_ok, other=0.0)

    # In-block part: a_ij = exp(s_ij - max_j s_ij) over the block's own keys, not normalised.
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s2 = tl.where(row_ok[None, :], s * (scale * 1.4426950408889634), float("-inf"))
    a = tl.exp2(s2 - tl.max(s2, 1)[:, None])
    l = tl.sum(a, 1)
    if IEEE:
        o_loc = tl.dot(a, v, input_precision="ieee")
    else:
        o_loc = tl.dot(a.to(v.dtype), v)
    w = 1.0 / (1.0 + tl.exp2(-tl.load(GATE + h).to(tl.float32) * 1.4426950408889634))

    # phi(q) = [softmax(q W_h), softmax(-q W_h)] in fp32.
    w_tile = tl.load(W + h * D * F + dims[:, None] * F + feats[None, :],
                     mask=dim_ok[:, None] & feat_ok[None, :], other=0.0).to(tl.float32)
    u = _dot32(q.to(tl.float32), w_tile, IEEE)
    pos = _softmax_rows(u, feat_ok[None, :])
    neg = _softmax_rows(-u, feat_ok[None, :])

    # State part: phi(q) S = pos @ S[:F] + neg @ S[F:], phi(q) . Z likewise.
    s_base = S + bh * 2 * F * D
    s_mask = feat_ok[:, None] & dim_ok[None, :]
    s_pos = tl.load(s_base + feats[:, None] * D + dims[None, :], mask=s_mask, other=0.0)
    lin_num = _dot32(pos, s_pos, IEEE)
    s_neg = tl.load(s_base + (F + feats[:, None]) * D + dims[None, :], mask=s_mask, other=0.0)
    lin_num += _dot32(neg, s_neg, IEEE)
    z_pos = tl.load(Z + bh * 2 * F + feats, mask=feat_ok, other=0.0)
    z_neg = tl.load(Z + bh * 2 * F + F + feats, mask=feat_ok, other=0.0)
    lin_den = tl.sum(pos * z_pos[None, :], 1) + tl.sum(neg * z_neg[None, :], 1)

    den = tl.maximum(w * l, eps) + tl.maximum(lin_den, eps)
    out = (w * o_loc + lin_num) / den[:, None]
    tl.store(O + b * sob + h * soh + rows[:, None] * sos + dims[None, :],
             out.to(O.dtype.element_ty), mask=tile_ok)


@triton.jit
def hybrid_state_update_kernel(
    S, Z, K, V, W, S_OUT, Z_OUT,
    skb, sks, skh, svb, svs, svh,
    H, G, bs, F,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Commit a block for one (batch, query head): S_OUT = S + phi(k)^T v, Z_OUT = Z + sum phi(k),
    with phi from this query head's W[h] applied to its kv head's keys."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    kvh = h // G
    rows = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    feats = tl.arange(0, BLOCK_F)
    row_ok, dim_ok, feat_ok = rows < bs, dims < D, feats < F
    tile_ok = row_ok[:, None] & dim_ok[None, :]
    k = tl.load(K + b * skb + kvh * skh + rows[:, None] * sks + dims[None, :], mask=tile_ok, other=0.0)
    v = tl.load(V + b * svb + kvh * svh + rows[:, None] * svs + dims[None, :], mask=tile_ok, other=0.0)
    w_tile = tl.load(W + h * D * F + dims[:, None] * F + feats[None, :],
                     mask=dim_ok[:, None] & feat_ok[None, :], other=0.0).to(tl.float32)
    u = _dot32(k.to(tl.float32), w_tile, IEEE)
    keep = row_ok[:, None].to(tl.float32)  # padded key rows add nothing
    pos = _softmax_rows(u, feat_ok[None, :]) * keep
    neg = _softmax_rows(-u, feat_ok[None, :]) * keep
    v32 = v.to(tl.float32)

    s_mask = feat_ok[:, None] & dim_ok[None, :]
    s_offs = bh * 2 * F * D + feats[:, None] * D + dims[None, :]
    s_pos = tl.load(S + s_offs, mask=s_mask, other=0.0) + _dot32(tl.trans(pos), v32, IEEE)
    tl.store(S_OUT + s_offs, s_pos, mask=s_mask)
    s_neg = tl.load(S + F * D + s_offs, mask=s_mask, other=0.0) + _dot32(tl.trans(neg), v32, IEEE)
    tl.store(S_OUT + F * D + s_offs, s_neg, mask=s_mask)
    z_offs = bh * 2 * F + feats
    tl.store(Z_OUT + z_offs, tl.load(Z + z_offs, mask=feat_ok, other=0.0) + tl.sum(pos, 0),
             mask=feat_ok)
    tl.store(Z_OUT + F + z_offs, tl.load(Z + F + z_offs, mask=feat_ok, other=0.0) + tl.sum(neg, 0),
             mask=feat_ok)
