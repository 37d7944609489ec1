"""Triton kernels for the training form of block-hybrid attention (LLaDA-Hybrid), forward and
backward (definitions in dlm_ops/ops/hybrid.py; launched by dlm_ops/backends/hybrid_train.py).

Notation
--------
    B, H, Hkv, G    batch, query heads, kv heads, G = H // Hkv (query head h reads kv head h // G)
    n, bs           tokens per half ([noisy | clean], 2n in all) and block length (bs <= n)
    tile, R, TT     a tile is R whole blocks of one half, TT = R * bs tokens, held in BLOCK_T rows
                    (a power of two >= 16); row r belongs to block r // bs of the tile
    F, BLOCK_F      features per sign (phi has 2F);  D, BLOCK_D  head dim
    DS              a slice of D columns: the state is split into D slices across programs
    u               the feature logits x W_h, fp32 (B, S, H, F), precomputed once per call
    pos, neg        softmax(u) and softmax(-u): the two halves of phi(x), (rows, F)
    S, Z            the state of the clean tiles before the current one, per query head:
                    S_pos, S_neg (F, DS) per program, Z_pos, Z_neg (F,), fp32
    P               intra-tile linear scores p_i . phi(k_j) of a query row and a clean key of an
                    EARLIER block of the same tile (mask ``earl``); only when R > 1 (MULTI)
    dU, dZ          the backward's reverse state: sums over later queries of p^T dN and dL p

Design (why it is shaped this way, from the sm90 compile of a first version)
----------------------------------------------------------------------------
The queries of block b (either half) need the state of the clean blocks 0..b-1. A first version
walked the blocks with the whole (2F x D) fp32 state in registers per (b, h): at F=64, D=128 it
took 255 registers plus 1.5-4 KB of spills per thread and 155-345 KB of shared memory (> 227 KB:
it would not launch). Tiles of 32 rows run on mma.sync, whose operands all live in registers, and
tf32x3 keeps a high and a low copy of each fp32 operand: the state alone is 3 x 64 KB. So:

  * the state is split along D: a program owns (b, h, D slice of DS=16 columns), holding
    2 x F x DS fp32 (8 KB at F=64). Everything reduced over D that the state does not enter
    (scores q k^T, the feature logits) is computed on full-D tiles, redundantly per slice (cheap:
    bs x bs x D per block); the logits u = x W are precomputed by one parallel kernel so that W
    never sits in a walk.
  * forward: one walk per (b, h, slice) over the tiles in order; per tile both halves' queries
    (in-block softmax a = exp(s - rowmax) over their own half's keys of the same block, the state
    term p S, the intra-tile term P v, the shared normalisation), then the tile's clean keys join
    the state. No state is written.
  * backward: dp = dN S^T and dphi(k) = v dU^T reduce over D, which a D-sliced walk cannot finish
    on its own, so the backward writes the state of every tile (exclusive prefix S_t, Z_t; reverse
    suffix dU_t, dZ_t: B*H*nt*2F*D fp32 each, nt = n / TT) with a D-sliced scan kernel, and two
    parallel kernels, one program per (tile, b, h) (bwd_q: per half too), loop over D slices
    reading them:
      scan fwd  S_t, Z_t from the clean keys
      bwd_q     everything on the query side: recompute den (not out: dO . out comes from the
                D reductions, see the kernel), dN, the clamp-gated dL, the gate gradient, in-block
                dq/dk/dv, dp -> du (softmax backward of both signs), dq += du W^T; 1/den and dL
                for the reverse scan
      scan rev  dU_t, dZ_t from the queries (p^T (dO / den), dL p)
      bwd_k     the clean keys' state gradients: dphi(k) = v dU_t^T + dZ_t (+ intra), dv += phi(k)
                dU_t, du_k, dk += du_k W^T
      dW        one kernel: sum over tokens of x^T du (q and clean k), split over tokens
    The rowmax inside a = exp(s - max s) does not cancel (the state term is not rescaled with it),
    so its gradient is kept and split among ties as torch.amax does.

Parallelism: the walks and scans run B*H*(D/DS) programs (256 at B*H=32, D=128); the per-tile
kernels B*H*nt. Small blocks: a 32-row tile packs R = 32 // bs blocks of bs <= 16 (the chunked
linear-attention form), so a bs=4 call makes n/32 serial steps, not n/4; longer blocks take one
tile each (32 rows for bs <= 32, 64 up to bs = 64). 32-row tiles run on mma.sync; 64-row tiles
on wgmma (hybrid_train.geometry says why packed tiles are no longer 64 rows: issue 6).

Registers: every (rows, F) fp32 tile costs F/2 registers per thread (16 rows per warp, whatever
the warp count: a chain of dots puts every warp along the rows), and the kernels hold several
(phi of q and k, both signs, their gradients), so at F=64, D=128 the walks and the per-tile
kernels still spill on sm90 (triton 3.6, the GPU's own specialisation): 0.1-0.2 KB per thread
at bs=32, 0.8-1.1 KB with packed small blocks, 0.2-1.2 KB at bs=64
(tests/hybrid_sm90_compile.py prints the numbers; hybrid_train.SLICE_D and launch_config discuss
them); the scans, the logits and the dW kernels do not.
The key-side intra-tile terms sit in bwd_k, not bwd_q, for the same reason.

Precision (as the decode kernels): fp32 inputs take IEEE fp32 dots everywhere. Low-precision
inputs take the attention dots (q k^T, a v, dN v^T for da, a^T dO, ds k, ds^T q) in the input
dtype with fp32 accumulation (FlashAttention's choice) and the dots of the linear part (x W,
p S, P, P v, dN S^T, dP phi, v dU^T, du W^T, the state updates) in "tf32x3", about fp32: S sums
thousands of terms and plain tf32 would round it to 10 mantissa bits. States are fp32.
"""

import triton
import triton.language as tl

from .diffusion_attn import _dot
from .hybrid_attn import _dot32, _softmax_rows

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _phi_u(U, row, h, H, F, ok, feats, feat_ok):
    """(pos, neg) of the logits rows ``row`` of U (B*S, H, F) fp32; padding rows give 0."""
    u = tl.load(U + (row * H + h)[:, None] * F + feats[None, :],
                mask=ok[:, None] & feat_ok[None, :], other=0.0)
    keep = ok.to(tl.float32)[:, None]
    return (_softmax_rows(u, feat_ok[None, :]) * keep,
            _softmax_rows(-u, feat_ok[None, :]) * keep)


@triton.jit
def _scores(q, kh, same, scale2, IEEE: tl.constexpr):
    """In-block exponentials a = exp(s - rowmax) over the keys where ``same``: (a, ties, l)."""
    s2 = tl.where(same, _dot(q, tl.trans(kh), IEEE) * scale2, float("-inf"))
    m = tl.max(s2, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # a padding row with no key: a = 0, no NaN
    a = tl.where(same, tl.exp2(s2 - m[:, None]), 0.0)
    return a, same & (s2 == m[:, None]), tl.sum(a, 1)


@triton.jit
def _phi_bwd(pos, neg, dpos, dneg):
    """du of u = x W given d(phi) = (dpos, dneg): softmax backward of both signs."""
    return (pos * (dpos - tl.sum(dpos * pos, 1)[:, None])
            - neg * (dneg - tl.sum(dneg * neg, 1)[:, None]))


@triton.jit
def _tile_rows(rows, t, tile_len, n, bs):
    """Positions (within a half) of a tile's rows, their validity, the in-block and the
    earlier-block masks (over valid keys)."""
    seq = t * tile_len + rows
    ok = (rows < tile_len) & (seq < n)
    blk = rows // bs
    same = (blk[:, None] == blk[None, :]) & ok[None, :]
    earl = (blk[None, :] < blk[:, None]) & ok[None, :]
    return seq, ok, same, earl


@triton.jit
def _gate(GATE, h):
    return 1.0 / (1.0 + tl.exp2(-tl.load(GATE + h).to(tl.float32) * LOG2E))


@triton.jit
def hybrid_logits_kernel(
    X, W, U, sxb, sxs, sxh,
    H, G, seqlen, row_off, total, F,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
    IEEE: tl.constexpr,
):
    """U[i, h] = X[b, row_off + s, h // G] @ W[h] for the flattened tokens i = b * seqlen + s;
    U (B * seqlen, H, F) fp32."""
    pid, h = tl.program_id(0), tl.program_id(1)
    rows, dims, feats = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F)
    dim_ok, feat_ok = dims < D, feats < F
    idx = pid * BLOCK_N + rows
    ok = idx < total
    bb, ss = idx // seqlen, idx % seqlen
    x = tl.load(X + bb[:, None] * sxb + (row_off + ss)[:, None] * sxs + (h // G) * sxh
                + dims[None, :], mask=ok[:, None] & dim_ok[None, :], other=0.0)
    w_tile = tl.load(W + h * D * F + dims[:, None] * F + feats[None, :],
                     mask=dim_ok[:, None] & feat_ok[None, :], other=0.0)
    tl.store(U + (idx * H + h)[:, None] * F + feats[None, :],
             _dot32(x.to(tl.float32), w_tile, IEEE), mask=ok[:, None] & feat_ok[None, :])


@triton.jit
def hybrid_train_fwd_kernel(
    Q, K, V, O, UQ, UK, GATE,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
    H, G, n, bs, tile_len, num_tiles, F, scale, eps,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, DS: tl.constexpr,
    BLOCK_F: tl.constexpr, MULTI: tl.constexpr, IEEE: tl.constexpr,
):
    """One program per (b, h, D slice) walks the tiles in order with its state slice."""
    bh, dsi = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    rows, full, feats = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F)
    dims = dsi * DS + tl.arange(0, DS)
    full_ok, dim_ok, feat_ok = full < D, dims < D, feats < F
    s_pos = tl.zeros([BLOCK_F, DS], tl.float32)
    s_neg = tl.zeros([BLOCK_F, DS], tl.float32)
    z_pos = tl.zeros([BLOCK_F], tl.float32)
    z_neg = tl.zeros([BLOCK_F], tl.float32)
    w = _gate(GATE, h)
    scale2 = scale * LOG2E
    q_base, k_base, v_base = Q + b * sqb + h * sqh, K + b * skb + kvh * skh, V + b * svb + kvh * svh
    o_base = O + b * sob + h * soh
    for t in range(num_tiles):
        seq, ok, same, earl = _tile_rows(rows, t, tile_len, n, bs)
        f_ok, s_ok = ok[:, None] & full_ok[None, :], ok[:, None] & dim_ok[None, :]
        vc = tl.load(v_base + (n + seq)[:, None] * svs + dims[None, :], mask=s_ok, other=0.0)
        for half in tl.static_range(2):
            tok = half * n + seq
            kh = tl.load(k_base + tok[:, None] * sks + full[None, :], mask=f_ok, other=0.0)
            q = tl.load(q_base + tok[:, None] * sqs + full[None, :], mask=f_ok, other=0.0)
            a, ties, l = _scores(q, kh, same, scale2, IEEE)
            if half == 0:
                vh = tl.load(v_base + tok[:, None] * svs + dims[None, :], mask=s_ok, other=0.0)
            else:
                vh = vc
            num = _dot(a.to(vh.dtype), vh, IEEE) * w
            # One sign at a time, phi(k) recomputed from the logits where it is needed: at
            # F=64 every (rows, F) fp32 tile costs 32 registers per thread (16 rows per warp).
            pos, neg = _phi_u(UQ, b * 2 * n + tok, h, H, F, ok, feats, feat_ok)
            num += _dot32(pos, s_pos, IEEE)
            lin = tl.sum(pos * z_pos[None, :], 1)
            if MULTI:
                pos_k, neg_k = _phi_u(UK, b * n + seq, h, H, F, ok, feats, feat_ok)
                pk = _dot32(pos, tl.trans(pos_k), IEEE)
            num += _dot32(neg, s_neg, IEEE)
            lin += tl.sum(neg * z_neg[None, :], 1)
            if MULTI:
                pk = tl.where(earl, pk + _dot32(neg, tl.trans(neg_k), IEEE), 0.0)
                num += _dot32(pk, vc.to(tl.float32), IEEE)
                lin += tl.sum(pk, 1)
            den = tl.maximum(w * l, eps) + tl.maximum(lin, eps)
            tl.store(o_base + tok[:, None] * sos + dims[None, :],
                     (num / den[:, None]).to(O.dtype.element_ty), mask=s_ok)
        pos_k, neg_k = _phi_u(UK, b * n + seq, h, H, F, ok, feats, feat_ok)
        vc32 = vc.to(tl.float32)
        s_pos += _dot32(tl.trans(pos_k), vc32, IEEE)
        z_pos += tl.sum(pos_k, 0)
        s_neg += _dot32(tl.trans(neg_k), vc32, IEEE)
        z_neg += tl.sum(neg_k, 0)


@triton.jit
def hybrid_scan_kernel(
    U, Y, RS, ZC, S_OUT, Z_OUT, syb, sys, syh,
    H, gy, n, u_off, tile_len, num_tiles, F,
    BLOCK_T: tl.constexpr, D: tl.constexpr, DS: tl.constexpr, BLOCK_F: tl.constexpr,
    FIRST_HALF: tl.constexpr, NUM_HALVES: tl.constexpr, REVERSE: tl.constexpr,
    HAS_RS: tl.constexpr, IEEE: tl.constexpr,
):
    """Per (b, h, D slice), tiles in order (REVERSE: backwards): write the state before the tile
    to S_OUT (B, H, nt, 2F, D) and Z_OUT (B, H, nt, 2F), then add the tile's rows:
    S += phi^T (Y * RS), Z += sum phi * ZC over halves FIRST_HALF .. + NUM_HALVES - 1, phi from U
    rows (half * n - u_off + position). Forward: U = u(clean k), Y = v. Reverse: U = u(q),
    Y = dO, RS = 1/den, ZC = dL (B, H, 2n) fp32."""
    bh, dsi = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows, feats = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_F)
    dims = dsi * DS + tl.arange(0, DS)
    dim_ok, feat_ok = dims < D, feats < F
    s_mask = feat_ok[:, None] & dim_ok[None, :]
    s_pos = tl.zeros([BLOCK_F, DS], tl.float32)
    s_neg = tl.zeros([BLOCK_F, DS], tl.float32)
    z_pos = tl.zeros([BLOCK_F], tl.float32)
    z_neg = tl.zeros([BLOCK_F], tl.float32)
    y_base = Y + b * syb + (h // gy) * syh
    u_rows = 2 * n - u_off  # rows of U per sample
    for i in range(num_tiles):
        t = num_tiles - 1 - i if REVERSE else i
        idx = (bh * num_tiles + t).to(tl.int64)
        s_offs = idx * 2 * F * D + feats[:, None] * D + dims[None, :]
        tl.store(S_OUT + s_offs, s_pos, mask=s_mask)
        tl.store(S_OUT + F * D + s_offs, s_neg, mask=s_mask)
        if dsi == 0:
            tl.store(Z_OUT + idx * 2 * F + feats, z_pos, mask=feat_ok)
            tl.store(Z_OUT + idx * 2 * F + F + feats, z_neg, mask=feat_ok)
        seq = t * tile_len + rows
        ok = (rows < tile_len) & (seq < n)
        for half in tl.static_range(NUM_HALVES):
            tok = (FIRST_HALF + half) * n + seq
            pos, neg = _phi_u(U, b * u_rows + tok - u_off, h, H, F, ok, feats, feat_ok)
            y = tl.load(y_base + tok[:, None] * sys + dims[None, :],
                        mask=ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
            if HAS_RS:
                y = y * tl.load(RS + bh * 2 * n + tok, mask=ok, other=0.0)[:, None]
                zc = tl.load(ZC + bh * 2 * n + tok, mask=ok, other=0.0)
                z_pos += tl.sum(pos * zc[:, None], 0)
                z_neg += tl.sum(neg * zc[:, None], 0)
            else:
                z_pos += tl.sum(pos, 0)
                z_neg += tl.sum(neg, 0)
            s_pos += _dot32(tl.trans(pos), y, IEEE)
            s_neg += _dot32(tl.trans(neg), y, IEEE)


@triton.jit
def _row_state(q_base, k_base, UQ, UK, sqs, sks, z_pos, z_neg, tok, seq, ok, same, earl, full,
               f_ok, b, h, H, n, F, feats, feat_ok, scale2,
               MULTI: tl.constexpr, IEEE: tl.constexpr):
    """What a query row of the tile needs besides the D reductions: (a, ties, l) of the in-block
    softmax, phi(q) = (pos, neg), the intra-tile P (MULTI, else 0) and lin = phi(q).Z + sum P."""
    q = tl.load(q_base + tok[:, None] * sqs + full[None, :], mask=f_ok, other=0.0)
    kh = tl.load(k_base + tok[:, None] * sks + full[None, :], mask=f_ok, other=0.0)
    a, ties, l = _scores(q, kh, same, scale2, IEEE)
    pos, neg = _phi_u(UQ, b * 2 * n + tok, h, H, F, ok, feats, feat_ok)
    lin = tl.sum(pos * z_pos[None, :], 1) + tl.sum(neg * z_neg[None, :], 1)
    if MULTI:
        pos_k, neg_k = _phi_u(UK, b * n + seq, h, H, F, ok, feats, feat_ok)
        pk = tl.where(earl, _dot32(pos, tl.trans(pos_k), IEEE)
                      + _dot32(neg, tl.trans(neg_k), IEEE), 0.0)
        lin += tl.sum(pk, 1)
    else:
        pk = tl.zeros_like(a)
    return a, ties, l, pos, neg, pk, lin


@triton.jit
def hybrid_train_bwd_q_kernel(
    Q, K, V, DO, UQ, UK, W, GATE, S_ST, Z_ST, DQ, DK, DV, DUQ, RDEN, DLIN, DGV,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
    H, G, n, bs, tile_len, num_tiles, F, scale, eps,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, DS: tl.constexpr,
    BLOCK_F: tl.constexpr, MULTI: tl.constexpr, IEEE: tl.constexpr,
):
    """The queries of one half (program axis 2: 0 noisy, 1 clean) of one (tile, b, h). Writes DQ
    (B, 2n, H, D) contiguous in q's dtype (final); DK, DV (B, 2n, H, D) fp32 per query head, the
    in-block part (bwd_k adds the linear part of the clean keys, intra-tile terms included); DUQ
    (B, 2n, H, F) fp32; RDEN, DLIN (B, H, 2n); DGV (B, H, nt, 2).

    Pass 1 over D slices accumulates only the four products that reduce over D (dN v^T over the
    own half's and the clean keys, dN S^T of both signs). The output row itself is not rebuilt:
    dO . out = w * sum(a * g1) + sum(pos * dp_pos) + sum(neg * dp_neg) + sum(P * g2) with
    g1 = dN v^T etc. (each term of out = (w a v + phi S + P v) / den, contracted with dN = dO / den
    over D first), so no dot of the forward (a v, phi S, P v) runs here. A first version rebuilt
    out per slice: with the split operands of tf32x3 live across the loop it took 255 registers
    and 1-3 KB of spills per thread, and ptxas 12.8 (triton 3.6) then built a wgmma descriptor
    from the stack pointer: the illegal shared read of issue 6."""
    t, bh, half = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    kvh = h // G
    rows, full, feats = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_F)
    sl = tl.arange(0, DS)
    full_ok, feat_ok = full < D, feats < F
    seq, ok, same, earl = _tile_rows(rows, t, tile_len, n, bs)
    f_ok = ok[:, None] & full_ok[None, :]
    w = _gate(GATE, h)
    scale2 = scale * LOG2E
    q_base, k_base, v_base = Q + b * sqb + h * sqh, K + b * skb + kvh * skh, V + b * svb + kvh * svh
    do_base = DO + b * sdb + h * sdh
    st = (bh * num_tiles + t).to(tl.int64)  # the state buffers pass 2^31 floats at ~8 GB
    z_pos = tl.load(Z_ST + st * 2 * F + feats, mask=feat_ok, other=0.0)
    z_neg = tl.load(Z_ST + st * 2 * F + F + feats, mask=feat_ok, other=0.0)
    s_base = S_ST + st * 2 * F * D
    buf_row = b * 2 * n * H + h  # + position * H: a row of a contiguous (B, 2n, H, X) buffer
    tok = half * n + seq
    a, ties, l, pos, neg, pk, lin = _row_state(
        q_base, k_base, UQ, UK, sqs, sks, z_pos, z_neg, tok, seq, ok, same, earl, full, f_ok,
        b, h, H, n, F, feats, feat_ok, scale2, MULTI, IEEE)
    wl = w * l
    rden = 1.0 / (tl.maximum(wl, eps) + tl.maximum(lin, eps))
    # Pass 1 over D slices: the reductions over D.
    dp_pos = tl.zeros([BLOCK_T, BLOCK_F], tl.float32)
    dp_neg = tl.zeros([BLOCK_T, BLOCK_F], tl.float32)
    g1 = tl.zeros([BLOCK_T, BLOCK_T], tl.float32)  # dN v^T over the own half's keys
    g2 = tl.zeros([BLOCK_T, BLOCK_T], tl.float32)  # dN v^T over the clean keys (MULTI)
    for d0 in range(0, D, DS):
        dims = d0 + sl
        dim_ok = dims < D
        s_ok = ok[:, None] & dim_ok[None, :]
        vh = tl.load(v_base + tok[:, None] * svs + dims[None, :], mask=s_ok, other=0.0)
        dn = tl.load(do_base + tok[:, None] * sds + dims[None, :], mask=s_ok,
                     other=0.0).to(tl.float32) * rden[:, None]
        sm = feat_ok[:, None] & dim_ok[None, :]
        sp = tl.load(s_base + feats[:, None] * D + dims[None, :], mask=sm, other=0.0)
        sn = tl.load(s_base + F * D + feats[:, None] * D + dims[None, :], mask=sm, other=0.0)
        if MULTI:
            vc32 = tl.load(v_base + (n + seq)[:, None] * svs + dims[None, :], mask=s_ok,
                           other=0.0).to(tl.float32)
            g2 += _dot32(dn, tl.trans(vc32), IEEE)
        dp_pos += _dot32(dn, tl.trans(sp), IEEE)
        dp_neg += _dot32(dn, tl.trans(sn), IEEE)
        g1 += _dot(dn.to(vh.dtype), tl.trans(vh), IEEE)
    # out = N / den: dN = dO / den, dden = -(dO . out) / den; each clamp passes its gradient
    # where its argument >= eps (torch.clamp's rule at the bound).
    dno = tl.sum(a * g1, 1)  # dN . (a v)
    gout = w * dno + tl.sum(pos * dp_pos, 1) + tl.sum(neg * dp_neg, 1)
    if MULTI:
        gout += tl.sum(pk * g2, 1)
    dden = -gout * rden
    dwl = tl.where(wl >= eps, dden, 0.0)
    dl = tl.where(lin >= eps, dden, 0.0)
    dgv = tl.sum(dno + dwl * l, 0)
    tt = a * (w * g1 + (w * dwl)[:, None])
    nties = tl.maximum(tl.sum(ties.to(tl.float32), 1), 1.0)
    ds = tt - tl.where(ties, 1.0, 0.0) * (tl.sum(tt, 1) / nties)[:, None]
    dp_pos += dl[:, None] * z_pos[None, :]
    dp_neg += dl[:, None] * z_neg[None, :]
    if MULTI:  # dP = dN v^T + dL over the earlier blocks' clean keys
        dpm = tl.where(earl, g2 + dl[:, None], 0.0)
        pos_k, neg_k = _phi_u(UK, b * n + seq, h, H, F, ok, feats, feat_ok)
        dp_pos += _dot32(dpm, pos_k, IEEE)
        dp_neg += _dot32(dpm, neg_k, IEEE)
    du = _phi_bwd(pos, neg, dp_pos, dp_neg)
    tl.store(DUQ + (buf_row + tok * H)[:, None] * F + feats[None, :], du,
             mask=ok[:, None] & feat_ok[None, :])
    tl.store(RDEN + bh * 2 * n + tok, rden, mask=ok)
    tl.store(DLIN + bh * 2 * n + tok, dl, mask=ok)
    tl.store(DGV + st * 2 + half, dgv)
    # Pass 2 over D slices: the (rows, D) outputs.
    for d0 in range(0, D, DS):
        dims = d0 + sl
        dim_ok = dims < D
        s_ok = ok[:, None] & dim_ok[None, :]
        k_s = tl.load(k_base + tok[:, None] * sks + dims[None, :], mask=s_ok, other=0.0)
        q_s = tl.load(q_base + tok[:, None] * sqs + dims[None, :], mask=s_ok, other=0.0)
        dn = tl.load(do_base + tok[:, None] * sds + dims[None, :], mask=s_ok,
                     other=0.0).to(tl.float32) * rden[:, None]
        wt = tl.load(W + h * D * F + dims[:, None] * F + feats[None, :],
                     mask=dim_ok[:, None] & feat_ok[None, :], other=0.0)
        dq = scale * _dot(ds.to(k_s.dtype), k_s, IEEE) + _dot32(du, tl.trans(wt), IEEE)
        buf = (buf_row + tok * H)[:, None] * D + dims[None, :]
        tl.store(DQ + buf, dq.to(DQ.dtype.element_ty), mask=s_ok)
        tl.store(DK + buf, scale * _dot(tl.trans(ds).to(q_s.dtype), q_s, IEEE), mask=s_ok)
        tl.store(DV + buf, _dot(tl.trans(a).to(q_s.dtype), (w * dn).to(q_s.dtype), IEEE),
                 mask=s_ok)


@triton.jit
def hybrid_train_bwd_k_kernel(
    V, DO, UQ, UK, W, DU_ST, DZ_ST, RDEN, DLIN, DK, DV, DUK, svb, svs, svh, sdb, sds, sdh,
    H, G, n, bs, tile_len, num_tiles, F,
    D: tl.constexpr, BLOCK_T: tl.constexpr, DS: tl.constexpr, BLOCK_F: tl.constexpr,
    MULTI: tl.constexpr, IEEE: tl.constexpr,
):
    """The clean keys of one (tile, b, h), linear part: against the reverse state of the later
    tiles, dphi(k) = v dU_t^T + dZ_t and dv += phi(k) dU_t; against the later blocks of the same
    tile (MULTI), dphi(k) += dP^T p and dv += P^T dN for both halves' queries (dP = dN v^T + dL,
    with 1/den and dL from bwd_q). Then du_k -> DUK (B, n, H, F) and dk += du_k W^T."""
    t, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    rows, feats, sl = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_F), tl.arange(0, DS)
    feat_ok = feats < F
    seq, ok, same, earl = _tile_rows(rows, t, tile_len, n, bs)
    pos_k, neg_k = _phi_u(UK, b * n + seq, h, H, F, ok, feats, feat_ok)
    st = (bh * num_tiles + t).to(tl.int64)  # the state buffers pass 2^31 floats at ~8 GB
    dpk = tl.zeros([BLOCK_T, BLOCK_F], tl.float32) + tl.load(
        DZ_ST + st * 2 * F + feats, mask=feat_ok, other=0.0)[None, :]
    dnk = tl.zeros([BLOCK_T, BLOCK_F], tl.float32) + tl.load(
        DZ_ST + st * 2 * F + F + feats, mask=feat_ok, other=0.0)[None, :]
    if MULTI:  # P of the noisy (0) and clean (1) queries against these keys
        pos0, neg0 = _phi_u(UQ, b * 2 * n + seq, h, H, F, ok, feats, feat_ok)
        pk0 = tl.where(earl, _dot32(pos0, tl.trans(pos_k), IEEE)
                       + _dot32(neg0, tl.trans(neg_k), IEEE), 0.0)
        pos1, neg1 = _phi_u(UQ, b * 2 * n + n + seq, h, H, F, ok, feats, feat_ok)
        pk1 = tl.where(earl, _dot32(pos1, tl.trans(pos_k), IEEE)
                       + _dot32(neg1, tl.trans(neg_k), IEEE), 0.0)
        rden0 = tl.load(RDEN + bh * 2 * n + seq, mask=ok, other=0.0)
        rden1 = tl.load(RDEN + bh * 2 * n + n + seq, mask=ok, other=0.0)
        g20 = tl.zeros([BLOCK_T, BLOCK_T], tl.float32)
        g21 = tl.zeros([BLOCK_T, BLOCK_T], tl.float32)
    u_base = DU_ST + st * 2 * F * D
    v_base, do_base = V + b * svb + kvh * svh, DO + b * sdb + h * sdh
    buf_row = b * 2 * n * H + h + (n + seq) * H  # the clean rows of (B, 2n, H, D)
    for d0 in range(0, D, DS):
        dims = d0 + sl
        dim_ok = dims < D
        s_ok = ok[:, None] & dim_ok[None, :]
        sm = feat_ok[:, None] & dim_ok[None, :]
        vc = tl.load(v_base + (n + seq)[:, None] * svs + dims[None, :], mask=s_ok,
                     other=0.0).to(tl.float32)
        up = tl.load(u_base + feats[:, None] * D + dims[None, :], mask=sm, other=0.0)
        un = tl.load(u_base + F * D + feats[:, None] * D + dims[None, :], mask=sm, other=0.0)
        dpk += _dot32(vc, tl.trans(up), IEEE)
        dnk += _dot32(vc, tl.trans(un), IEEE)
        dv = _dot32(pos_k, up, IEEE) + _dot32(neg_k, un, IEEE)
        if MULTI:
            dn0 = tl.load(do_base + seq[:, None] * sds + dims[None, :], mask=s_ok,
                          other=0.0).to(tl.float32) * rden0[:, None]
            dn1 = tl.load(do_base + (n + seq)[:, None] * sds + dims[None, :], mask=s_ok,
                          other=0.0).to(tl.float32) * rden1[:, None]
            g20 += _dot32(dn0, tl.trans(vc), IEEE)
            g21 += _dot32(dn1, tl.trans(vc), IEEE)
            dv += _dot32(tl.trans(pk0), dn0, IEEE) + _dot32(tl.trans(pk1), dn1, IEEE)
        buf = buf_row[:, None] * D + dims[None, :]
        tl.store(DV + buf, tl.load(DV + buf, mask=s_ok, other=0.0) + dv, mask=s_ok)
    if MULTI:
        dpm = tl.where(earl, g20 + tl.load(DLIN + bh * 2 * n + seq, mask=ok, other=0.0)[:, None],
                       0.0)
        pos0, neg0 = _phi_u(UQ, b * 2 * n + seq, h, H, F, ok, feats, feat_ok)
        dpk += _dot32(tl.trans(dpm), pos0, IEEE)
        dnk += _dot32(tl.trans(dpm), neg0, IEEE)
        dpm = tl.where(earl, g21 + tl.load(DLIN + bh * 2 * n + n + seq, mask=ok,
                                           other=0.0)[:, None], 0.0)
        pos1, neg1 = _phi_u(UQ, b * 2 * n + n + seq, h, H, F, ok, feats, feat_ok)
        dpk += _dot32(tl.trans(dpm), pos1, IEEE)
        dnk += _dot32(tl.trans(dpm), neg1, IEEE)
    duk = _phi_bwd(pos_k, neg_k, dpk, dnk)
    tl.store(DUK + ((b * n + seq) * H + h)[:, None] * F + feats[None, :], duk,
             mask=ok[:, None] & feat_ok[None, :])
    for d0 in range(0, D, DS):
        dims = d0 + sl
        dim_ok = dims < D
        s_ok = ok[:, None] & dim_ok[None, :]
        wt = tl.load(W + h * D * F + dims[:, None] * F + feats[None, :],
                     mask=dim_ok[:, None] & feat_ok[None, :], other=0.0)
        buf = buf_row[:, None] * D + dims[None, :]
        tl.store(DK + buf, tl.load(DK + buf, mask=s_ok, other=0.0)
                 + _dot32(duk, tl.trans(wt), IEEE), mask=s_ok)


@triton.jit
def hybrid_feature_grad_kernel(
    X, DU, DW, sxb, sxs, sxh,
    H, G, seqlen, row_off, total, split_len, F,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
    IEEE: tl.constexpr,
):
    """DW[split, h] (D, F) = sum over the flattened tokens i = b * seqlen + s of the split of
    X[b, row_off + s, h // G]^T DU[i, h]; DU (B * seqlen, H, F) contiguous fp32."""
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
