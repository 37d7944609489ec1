"""Triton kernels for the training form of block-hybrid attention (LLaDA-Hybrid), forward and
backward (definitions in dlm_ops/ops/hybrid.py; launched by dlm_ops/backends/hybrid_train.py).

Notation
--------
    B, H, Hkv, G    batch, query heads, kv heads, G = H // Hkv (query head h reads kv head h // G)
    n, bs           tokens per half ([noisy | clean], 2n in all) and block length (bs <= n)
    tile, R, TT     a tile is R whole blocks of one half, TT = R * bs tokens, held in BLOCK_T rows
                    (a power of two >= 16); row r belongs to block r // bs of the tile
    chunk           CT consecutive tiles walked in order by one program
    F, BLOCK_F      features per sign (phi has 2F);  D, BLOCK_D  head dim
    W               feature_weight as fp32 (H, D, F); w = sigmoid(gate[h])
    pos, neg        softmax(x W_h) and softmax(-x W_h): the two halves of phi(x), (rows, F)
    S, Z            the state of the clean blocks before the current tile, per query head, kept as
                    S_pos, S_neg (F, D) and Z_pos, Z_neg (F,) in fp32 registers
    P               intra-tile linear scores p_i . phi(k_j) of a query row i and a clean key j of
                    an EARLIER block of the same tile (mask ``earl``); only when R > 1 (MULTI)
    dU, dZ          the backward's reverse state: sum over later queries of p_i^T dN_i, dL_i p_i

Design
------
The queries of block b (either half) need the state of the clean blocks 0..b-1. A program owns one
(batch, query head, chunk) and walks the chunk's tiles in order, keeping S and Z in registers; at
each tile it computes both halves' queries (in-block softmax a = exp(s - rowmax) over their own
half's keys of the same block, the state term p S, the intra-tile term P v, the shared
normalisation) and then adds the tile's clean keys to the state. Nothing of size 2F x D per block
is written: the torch path materialises S for every block (B*H*nb*2F*D fp32, 0.27 GB at B*n=8K,
H=16) and makes a dozen passes over it.

Parallelism: B*H can be 32-64 programs against 132 SMs. Splitting D is cheap for the forward
but not for the backward (dp = S dN and dphi(k) = v dU^T both reduce over D), so the sequence is
split instead: the chunk kernel sums phi(k)^T v over each chunk's clean keys (one big-K matmul per
chunk, fully parallel), torch takes the exclusive prefix over chunks (nC x 2F x D per head, small),
and each program starts from its chunk's prefix. One chunk (B*H fills the GPU) skips that pass.

Small blocks: bs=4 in a 16-row tile would waste 3/4 of every dot and make n/4 serial steps. A tile
holds R = BLOCK_T // bs blocks instead; rows of a later block read the clean keys of earlier
blocks of the tile through P (the chunked linear-attention form), so the state is updated once
per tile. The extra (TT x 2F x TT) and (TT x TT x D) dots cost about what the state term costs.

Backward (three walks, no per-block state stored):
  bwd_q  forward walk with S, Z as above, recomputing the forward; writes everything on the
         query side: dq (in-block + phi(q) backward), the in-block dk, dv of both halves, dphi
         through softmax(xW) as du (for dW), and per row 1/den and dL (the clamp-gated gradient
         of the linear denominator), and the per-program gate gradient.
  chunk  the same chunk kernel sums p^T dN and dL p over each chunk's queries (both halves);
         torch takes the reverse exclusive prefix over chunks.
  bwd_k  reverse walk with dU, dZ: everything on the key side of the linear part: dv += phi(k) dU
         + P^T dN, dphi(k) = v dU^T + dZ + dP^T p, dk += du_k W^T; then dU += p^T dN.
  dW     one small kernel: dW[h] = sum over tokens of x^T du (q and clean k), split over tokens.
The rowmax inside a = exp(s - max s) does not cancel here (the state term is not rescaled with
it), so its gradient is kept and split among ties as torch.amax does.

Precision (as the decode kernels): fp32 inputs take IEEE fp32 dots everywhere. Low-precision
inputs take the attention dots (q k^T, a v, dO v^T, a^T dO, ds k, ds^T q) in the input dtype with
fp32 accumulation (FlashAttention's choice), and the dots of the linear part (x W, p S, phi^T v,
P, dN S^T, du W^T, ...) in "tf32x3", about fp32 accuracy: S sums thousands of terms and plain
tf32 would round it to 10 mantissa bits. Every state and accumulator is fp32.
"""

import triton
import triton.language as tl

from .diffusion_attn import _dot
from .hybrid_attn import _dot32, _softmax_rows

LOG2E = 1.4426950408889634


@triton.jit
def _phi(x, w_tile, feat_ok, keep, IEEE: tl.constexpr):
    """(pos, neg) of an input tile, rows multiplied by ``keep`` (0 for padding rows)."""
    u = _dot32(x.to(tl.float32), w_tile, IEEE)
    return (_softmax_rows(u, feat_ok[None, :]) * keep[:, None],
            _softmax_rows(-u, feat_ok[None, :]) * keep[:, None])


@triton.jit
def _attend(q, kh, vh, same, scale2, IEEE: tl.constexpr):
    """In-block part: a = exp(s - rowmax) over the keys where ``same``; (a, ties, l, o = a v)."""
    s2 = tl.where(same, _dot(q, tl.trans(kh), IEEE) * scale2, float("-inf"))
    m = tl.max(s2, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # a padding row with no key: a = 0, no NaN
    a = tl.where(same, tl.exp2(s2 - m[:, None]), 0.0)
    ties = same & (s2 == m[:, None])
    return a, ties, tl.sum(a, 1), _dot(a.to(vh.dtype), vh, IEEE)


@triton.jit
def _linear(pos, neg, s_pos, s_neg, z_pos, z_neg, pos_k, neg_k, vc32, earl,
            MULTI: tl.constexpr, IEEE: tl.constexpr):
    """State part of a query tile: (num = p S + P v, lin = p . Z + rowsum P)."""
    num = _dot32(pos, s_pos, IEEE) + _dot32(neg, s_neg, IEEE)
    lin = tl.sum(pos * z_pos[None, :], 1) + tl.sum(neg * z_neg[None, :], 1)
    if MULTI:
        pk = tl.where(earl, _dot32(pos, tl.trans(pos_k), IEEE) + _dot32(neg, tl.trans(neg_k), IEEE),
                      0.0)
        num += _dot32(pk, vc32, IEEE)
        lin += tl.sum(pk, 1)
    return num, lin


@triton.jit
def _phi_bwd(pos, neg, dpos, dneg):
    """du of u = x W given d(phi) = (dpos, dneg): softmax backward of both signs."""
    return (pos * (dpos - tl.sum(dpos * pos, 1)[:, None])
            - neg * (dneg - tl.sum(dneg * neg, 1)[:, None]))


@triton.jit
def _tile_rows(rows, t, tile_len, n, bs):
    """Sequence positions (within a half) of a tile's rows, their validity, and the masks."""
    seq = t * tile_len + rows
    ok = (rows < tile_len) & (seq < n)
    blk = rows // bs
    same = (blk[:, None] == blk[None, :]) & ok[None, :]
    earl = (blk[None, :] < blk[:, None]) & ok[None, :]
    return seq, ok, same, earl


@triton.jit
def _load_state(S0, Z0, idx, feats, dims, F, D, s_mask, feat_ok, HAS_S0: tl.constexpr,
                BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr):
    """(S_pos, S_neg, Z_pos, Z_neg) of chunk state ``idx`` (= (b * H + h) * nC + chunk)."""
    if HAS_S0:
        base = S0 + idx * 2 * F * D + feats[:, None] * D + dims[None, :]
        s_pos = tl.load(base, mask=s_mask, other=0.0)
        s_neg = tl.load(base + F * D, mask=s_mask, other=0.0)
        z_pos = tl.load(Z0 + idx * 2 * F + feats, mask=feat_ok, other=0.0)
        z_neg = tl.load(Z0 + idx * 2 * F + F + feats, mask=feat_ok, other=0.0)
    else:
        s_pos = tl.zeros([BLOCK_F, BLOCK_D], tl.float32)
        s_neg = tl.zeros([BLOCK_F, BLOCK_D], tl.float32)
        z_pos = tl.zeros([BLOCK_F], tl.float32)
        z_neg = tl.zeros([BLOCK_F], tl.float32)
    return s_pos, s_neg, z_pos, z_neg


@triton.jit
def hybrid_train_fwd_kernel(
    Q, K, V, O, W, GATE, S0, Z0,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
    H, G, n, bs, tile_len, chunk_tiles, num_tiles, F, scale, eps,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
    MULTI: tl.constexpr, HAS_S0: tl.constexpr, IEEE: tl.constexpr,
):
    bh, chunk = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    rows, dims, feats = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F)
    dim_ok, feat_ok = dims < D, feats < F
    s_mask = feat_ok[:, None] & dim_ok[None, :]
    s_pos, s_neg, z_pos, z_neg = _load_state(S0, Z0, bh * tl.num_programs(1) + chunk, feats, dims,
                                             F, D, s_mask, feat_ok, HAS_S0, BLOCK_F, BLOCK_D)
    w_tile = tl.load(W + h * D * F + dims[:, None] * F + feats[None, :],
                     mask=dim_ok[:, None] & feat_ok[None, :], other=0.0)
    w = 1.0 / (1.0 + tl.exp2(-tl.load(GATE + h).to(tl.float32) * LOG2E))
    scale2 = scale * LOG2E
    q_base, k_base, v_base = Q + b * sqb + h * sqh, K + b * skb + kvh * skh, V + b * svb + kvh * svh
    o_base = O + b * sob + h * soh
    t_lo = chunk * chunk_tiles
    for t in range(t_lo, tl.minimum(t_lo + chunk_tiles, num_tiles)):
        seq, ok, same, earl = _tile_rows(rows, t, tile_len, n, bs)
        tile_ok = ok[:, None] & dim_ok[None, :]
        kc = tl.load(k_base + (n + seq)[:, None] * sks + dims[None, :], mask=tile_ok, other=0.0)
        vc = tl.load(v_base + (n + seq)[:, None] * svs + dims[None, :], mask=tile_ok, other=0.0)
        pos_k, neg_k = _phi(kc, w_tile, feat_ok, ok.to(tl.float32), IEEE)
        vc32 = vc.to(tl.float32)
        for half in tl.static_range(2):
            tok = half * n + seq
            if half == 0:
                kh = tl.load(k_base + tok[:, None] * sks + dims[None, :], mask=tile_ok, other=0.0)
                vh = tl.load(v_base + tok[:, None] * svs + dims[None, :], mask=tile_ok, other=0.0)
            else:
                kh, vh = kc, vc
            q = tl.load(q_base + tok[:, None] * sqs + dims[None, :], mask=tile_ok, other=0.0)
            a, ties, l, o = _attend(q, kh, vh, same, scale2, IEEE)
            pos, neg = _phi(q, w_tile, feat_ok, ok.to(tl.float32), IEEE)
            num, lin = _linear(pos, neg, s_pos, s_neg, z_pos, z_neg, pos_k, neg_k, vc32, earl,
                               MULTI, IEEE)
            den = tl.maximum(w * l, eps) + tl.maximum(lin, eps)
            out = (w * o + num) / den[:, None]
            tl.store(o_base + tok[:, None] * sos + dims[None, :], out.to(O.dtype.element_ty),
                     mask=tile_ok)
        s_pos += _dot32(tl.trans(pos_k), vc32, IEEE)
        s_neg += _dot32(tl.trans(neg_k), vc32, IEEE)
        z_pos += tl.sum(pos_k, 0)
        z_neg += tl.sum(neg_k, 0)


@triton.jit
def hybrid_train_bwd_q_kernel(
    Q, K, V, DO, W, GATE, S0, Z0, DQ, DK, DV, DUQ, RDEN, DLIN, DGV,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
    H, G, n, bs, tile_len, chunk_tiles, num_tiles, F, scale, eps,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
    MULTI: tl.constexpr, HAS_S0: tl.constexpr, IEEE: tl.constexpr,
):
    """Forward walk of the backward: the query side. DQ (B, 2n, H, D) contiguous in q's dtype; DK, DV
    (B, 2n, H, D) fp32 per query head (in-block part; bwd_k adds the state part to the clean
    half); DUQ (B, 2n, H, F) fp32; RDEN, DLIN (B, H, 2n) fp32; DGV (B, H, nC) fp32."""
    bh, chunk = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    rows, dims, feats = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F)
    dim_ok, feat_ok = dims < D, feats < F
    s_mask = feat_ok[:, None] & dim_ok[None, :]
    s_pos, s_neg, z_pos, z_neg = _load_state(S0, Z0, bh * tl.num_programs(1) + chunk, feats, dims,
                                             F, D, s_mask, feat_ok, HAS_S0, BLOCK_F, BLOCK_D)
    w_tile = tl.load(W + h * D * F + dims[:, None] * F + feats[None, :],
                     mask=dim_ok[:, None] & feat_ok[None, :], other=0.0)
    w = 1.0 / (1.0 + tl.exp2(-tl.load(GATE + h).to(tl.float32) * LOG2E))
    scale2 = scale * LOG2E
    q_base, k_base, v_base = Q + b * sqb + h * sqh, K + b * skb + kvh * skh, V + b * svb + kvh * svh
    do_base = DO + b * sdb + h * sdh
    # The fp32 per-query-head buffers are contiguous (B, 2n, H, X).
    g_base, row_base = (b * 2 * n * H + h), bh * 2 * n
    dgv = 0.0
    t_lo = chunk * chunk_tiles
    for t in range(t_lo, tl.minimum(t_lo + chunk_tiles, num_tiles)):
        seq, ok, same, earl = _tile_rows(rows, t, tile_len, n, bs)
        tile_ok = ok[:, None] & dim_ok[None, :]
        kc = tl.load(k_base + (n + seq)[:, None] * sks + dims[None, :], mask=tile_ok, other=0.0)
        vc = tl.load(v_base + (n + seq)[:, None] * svs + dims[None, :], mask=tile_ok, other=0.0)
        pos_k, neg_k = _phi(kc, w_tile, feat_ok, ok.to(tl.float32), IEEE)
        vc32 = vc.to(tl.float32)
        for half in tl.static_range(2):
            tok = half * n + seq
            if half == 0:
                kh = tl.load(k_base + tok[:, None] * sks + dims[None, :], mask=tile_ok, other=0.0)
                vh = tl.load(v_base + tok[:, None] * svs + dims[None, :], mask=tile_ok, other=0.0)
            else:
                kh, vh = kc, vc
            q = tl.load(q_base + tok[:, None] * sqs + dims[None, :], mask=tile_ok, other=0.0)
            g = tl.load(do_base + tok[:, None] * sds + dims[None, :], mask=tile_ok,
                        other=0.0).to(tl.float32)
            # the forward again
            a, ties, l, o = _attend(q, kh, vh, same, scale2, IEEE)
            pos, neg = _phi(q, w_tile, feat_ok, ok.to(tl.float32), IEEE)
            num, lin = _linear(pos, neg, s_pos, s_neg, z_pos, z_neg, pos_k, neg_k, vc32, earl,
                               MULTI, IEEE)
            wl = w * l
            den = tl.maximum(wl, eps) + tl.maximum(lin, eps)
            out = (w * o + num) / den[:, None]
            # out = N / den: dN = g / den, dden = -(g . out) / den; each clamp passes its
            # gradient where its argument >= eps (torch.clamp's rule at the bound).
            dn = g / den[:, None]
            dden = -tl.sum(g * out, 1) / den
            dwl = tl.where(wl >= eps, dden, 0.0)
            dl = tl.where(lin >= eps, dden, 0.0)
            dgv += tl.sum(tl.sum(dn * o, 1) + dwl * l, 0)
            # in-block softmax backward (input-dtype dots, fp32 accumulation)
            do = w * dn
            da = _dot(do.to(vh.dtype), tl.trans(vh), IEEE) + (w * dwl)[:, None]
            dvh = _dot(tl.trans(a).to(q.dtype), do.to(q.dtype), IEEE)
            tt = a * da
            nties = tl.maximum(tl.sum(ties.to(tl.float32), 1), 1.0)
            ds = tt - tl.where(ties, 1.0, 0.0) * (tl.sum(tt, 1) / nties)[:, None]
            dq = scale * _dot(ds.to(kh.dtype), kh, IEEE)
            dkh = scale * _dot(tl.trans(ds).to(q.dtype), q, IEEE)
            # linear part, query side: dp = dN S^T + dL Z (+ dP phi(k) inside the tile)
            dpos = _dot32(dn, tl.trans(s_pos), IEEE) + dl[:, None] * z_pos[None, :]
            dneg = _dot32(dn, tl.trans(s_neg), IEEE) + dl[:, None] * z_neg[None, :]
            if MULTI:
                dp = tl.where(earl, _dot32(dn, tl.trans(vc32), IEEE) + dl[:, None], 0.0)
                dpos += _dot32(dp, pos_k, IEEE)
                dneg += _dot32(dp, neg_k, IEEE)
            du = _phi_bwd(pos, neg, dpos, dneg)
            dq += _dot32(du, tl.trans(w_tile), IEEE)
            buf = (g_base + tok * H)[:, None] * D + dims[None, :]
            tl.store(DQ + buf, dq.to(DQ.dtype.element_ty), mask=tile_ok)
            tl.store(DK + buf, dkh, mask=tile_ok)
            tl.store(DV + buf, dvh, mask=tile_ok)
            tl.store(DUQ + (g_base + tok * H)[:, None] * F + feats[None, :], du,
                     mask=ok[:, None] & feat_ok[None, :])
            tl.store(RDEN + row_base + tok, 1.0 / den, mask=ok)
            tl.store(DLIN + row_base + tok, dl, mask=ok)
        s_pos += _dot32(tl.trans(pos_k), vc32, IEEE)
        s_neg += _dot32(tl.trans(neg_k), vc32, IEEE)
        z_pos += tl.sum(pos_k, 0)
        z_neg += tl.sum(neg_k, 0)
    tl.store(DGV + bh * tl.num_programs(1) + chunk, dgv)


@triton.jit
def hybrid_train_bwd_k_kernel(
    Q, K, V, DO, W, DU0, DZ0, RDEN, DLIN, DK, DV, DUK,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
    H, G, n, bs, tile_len, chunk_tiles, num_tiles, F,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
    MULTI: tl.constexpr, HAS_S0: tl.constexpr, IEEE: tl.constexpr,
):
    """Reverse walk of the backward: the key side of the linear part. DU0, DZ0 hold each chunk's
    reverse state (the sum over the queries of later chunks); DK, DV get the clean keys' state
    gradients added; DUK (B, n, H, F) fp32 takes du of the clean keys (for dW)."""
    bh, chunk = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    rows, dims, feats = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F)
    dim_ok, feat_ok = dims < D, feats < F
    s_mask = feat_ok[:, None] & dim_ok[None, :]
    du_pos, du_neg, dz_pos, dz_neg = _load_state(DU0, DZ0, bh * tl.num_programs(1) + chunk, feats,
                                                 dims, F, D, s_mask, feat_ok, HAS_S0, BLOCK_F,
                                                 BLOCK_D)
    w_tile = tl.load(W + h * D * F + dims[:, None] * F + feats[None, :],
                     mask=dim_ok[:, None] & feat_ok[None, :], other=0.0)
    q_base, k_base, v_base = Q + b * sqb + h * sqh, K + b * skb + kvh * skh, V + b * svb + kvh * svh
    do_base = DO + b * sdb + h * sdh
    g_base, row_base = (b * 2 * n * H + h), bh * 2 * n
    t_lo = chunk * chunk_tiles
    t_hi = tl.minimum(t_lo + chunk_tiles, num_tiles)
    for i in range(0, t_hi - t_lo):
        t = t_hi - 1 - i
        seq, ok, same, earl = _tile_rows(rows, t, tile_len, n, bs)
        tile_ok = ok[:, None] & dim_ok[None, :]
        keep = ok.to(tl.float32)
        kc = tl.load(k_base + (n + seq)[:, None] * sks + dims[None, :], mask=tile_ok, other=0.0)
        vc = tl.load(v_base + (n + seq)[:, None] * svs + dims[None, :], mask=tile_ok, other=0.0)
        pos_k, neg_k = _phi(kc, w_tile, feat_ok, keep, IEEE)
        vc32 = vc.to(tl.float32)
        # U_c = phi(k)^T v reaches every later query: dphi(k) = v dU^T + dZ, dv = phi(k) dU.
        dpk = _dot32(vc32, tl.trans(du_pos), IEEE) + dz_pos[None, :]
        dnk = _dot32(vc32, tl.trans(du_neg), IEEE) + dz_neg[None, :]
        dvc = _dot32(pos_k, du_pos, IEEE) + _dot32(neg_k, du_neg, IEEE)
        for half in tl.static_range(2):
            tok = half * n + seq
            q = tl.load(q_base + tok[:, None] * sqs + dims[None, :], mask=tile_ok, other=0.0)
            g = tl.load(do_base + tok[:, None] * sds + dims[None, :], mask=tile_ok,
                        other=0.0).to(tl.float32)
            dn = g * tl.load(RDEN + row_base + tok, mask=ok, other=0.0)[:, None]
            dl = tl.load(DLIN + row_base + tok, mask=ok, other=0.0)
            pos, neg = _phi(q, w_tile, feat_ok, keep, IEEE)
            if MULTI:  # the tile's own queries of later blocks, through P
                pk = tl.where(earl, _dot32(pos, tl.trans(pos_k), IEEE)
                              + _dot32(neg, tl.trans(neg_k), IEEE), 0.0)
                dp = tl.where(earl, _dot32(dn, tl.trans(vc32), IEEE) + dl[:, None], 0.0)
                dpk += _dot32(tl.trans(dp), pos, IEEE)
                dnk += _dot32(tl.trans(dp), neg, IEEE)
                dvc += _dot32(tl.trans(pk), dn, IEEE)
            # this tile's queries join the reverse state of the tiles before it
            du_pos += _dot32(tl.trans(pos), dn, IEEE)
            du_neg += _dot32(tl.trans(neg), dn, IEEE)
            dz_pos += tl.sum(pos * dl[:, None], 0)
            dz_neg += tl.sum(neg * dl[:, None], 0)
        duk = _phi_bwd(pos_k, neg_k, dpk, dnk)
        buf = (g_base + (n + seq) * H)[:, None] * D + dims[None, :]
        tl.store(DK + buf, tl.load(DK + buf, mask=tile_ok, other=0.0)
                 + _dot32(duk, tl.trans(w_tile), IEEE), mask=tile_ok)
        tl.store(DV + buf, tl.load(DV + buf, mask=tile_ok, other=0.0) + dvc, mask=tile_ok)
        tl.store(DUK + ((b * n + seq) * H + h)[:, None] * F + feats[None, :], duk,
                 mask=ok[:, None] & feat_ok[None, :])


@triton.jit
def hybrid_chunk_state_kernel(
    X, Y, W, RS, ZC, S_OUT, Z_OUT,
    sxb, sxs, sxh, syb, sys, syh,
    H, GX, GY, n, chunk_len, F,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
    FIRST_HALF: tl.constexpr, NUM_HALVES: tl.constexpr, HAS_RS: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Per (b, h, chunk c): S_OUT = sum over the tokens of chunk c (positions [c * chunk_len, ...)
    of halves FIRST_HALF .. FIRST_HALF + NUM_HALVES - 1) of phi(X_t)^T (Y_t * RS_t) and Z_OUT = sum
    phi(X_t) * ZC_t, with phi from W[h]; RS, ZC (B, H, 2n) fp32, or 1 when not HAS_RS. Forward:
    X, Y = clean k, v. Backward: X, Y = q, dO of both halves, RS = 1/den, ZC = dL."""
    bh, chunk = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows, dims, feats = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F)
    dim_ok, feat_ok = dims < D, feats < F
    w_tile = tl.load(W + h * D * F + dims[:, None] * F + feats[None, :],
                     mask=dim_ok[:, None] & feat_ok[None, :], other=0.0)
    x_base, y_base = X + b * sxb + (h // GX) * sxh, Y + b * syb + (h // GY) * syh
    acc_pos = tl.zeros([BLOCK_F, BLOCK_D], tl.float32)
    acc_neg = tl.zeros([BLOCK_F, BLOCK_D], tl.float32)
    z_pos = tl.zeros([BLOCK_F], tl.float32)
    z_neg = tl.zeros([BLOCK_F], tl.float32)
    lo = chunk * chunk_len
    hi = tl.minimum(lo + chunk_len, n)
    for half in tl.static_range(NUM_HALVES):
        off = (FIRST_HALF + half) * n
        for p0 in range(lo, hi, BLOCK_N):
            seq = p0 + rows
            ok = seq < hi
            tile_ok = ok[:, None] & dim_ok[None, :]
            x = tl.load(x_base + (off + seq)[:, None] * sxs + dims[None, :], mask=tile_ok, other=0.0)
            y = tl.load(y_base + (off + seq)[:, None] * sys + dims[None, :], mask=tile_ok,
                        other=0.0).to(tl.float32)
            pos, neg = _phi(x, w_tile, feat_ok, ok.to(tl.float32), IEEE)
            if HAS_RS:
                y = y * tl.load(RS + bh * 2 * n + off + seq, mask=ok, other=0.0)[:, None]
                zc = tl.load(ZC + bh * 2 * n + off + seq, mask=ok, other=0.0)
                z_pos += tl.sum(pos * zc[:, None], 0)
                z_neg += tl.sum(neg * zc[:, None], 0)
            else:
                z_pos += tl.sum(pos, 0)
                z_neg += tl.sum(neg, 0)
            acc_pos += _dot32(tl.trans(pos), y, IEEE)
            acc_neg += _dot32(tl.trans(neg), y, IEEE)
    idx = bh * tl.num_programs(1) + chunk
    s_offs = idx * 2 * F * D + feats[:, None] * D + dims[None, :]
    s_mask = feat_ok[:, None] & dim_ok[None, :]
    tl.store(S_OUT + s_offs, acc_pos, mask=s_mask)
    tl.store(S_OUT + F * D + s_offs, acc_neg, mask=s_mask)
    tl.store(Z_OUT + idx * 2 * F + feats, z_pos, mask=feat_ok)
    tl.store(Z_OUT + idx * 2 * F + F + feats, z_neg, mask=feat_ok)


@triton.jit
def hybrid_feature_grad_kernel(
    X, DU, DW, sxb, sxs, sxh,
    H, G, seqlen, row_off, total, split_len, F,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
    IEEE: tl.constexpr,
):
    """DW[split, h] (D, F) = sum over the flattened tokens i = b * seqlen + s of the split of
    X[b, row_off + s, h // G]^T DU[b, s, h]; DU (B, seqlen, H, F) contiguous fp32."""
    h, split = tl.program_id(0), tl.program_id(1)
    rows, dims, feats = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F)
    dim_ok, feat_ok = dims < D, feats < F
    acc = tl.zeros([BLOCK_D, BLOCK_F], tl.float32)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, total)
    for p0 in range(lo, hi, BLOCK_N):
        idx = p0 + rows
        ok = idx < hi
        bb, ss = idx // seqlen, idx % seqlen
        x = tl.load(X + bb[:, None] * sxb + (row_off + ss)[:, None] * sxs + (h // G) * sxh
                    + dims[None, :], mask=ok[:, None] & dim_ok[None, :], other=0.0)
        du = tl.load(DU + (idx * H + h)[:, None] * F + feats[None, :],
                     mask=ok[:, None] & feat_ok[None, :], other=0.0)
        acc += _dot32(tl.trans(x.to(tl.float32)), du, IEEE)
    tl.store(DW + ((split * H + h) * D + dims[:, None]) * F + feats[None, :], acc,
             mask=dim_ok[:, None] & feat_ok[None, :])
