"""Triton kernels for block-diffusion attention: forward, dK/dV and dQ.

Notation
--------
    B, H, Hkv, G      batch, query heads, kv heads, G = H // Hkv query heads per kv head (GQA)
    D, BLOCK_D        head dim, and its power-of-two padding (loads mask the padding)
    BLOCK_M, BLOCK_N  rows (queries) and columns (keys) of one tile
    nn, nc, bs        the sequence's noisy and clean lengths and block size (dlm_ops.geometry)
    TILES             int32 (T, 8): one work tile per row, [start, end, seq_start, nn, nc,
                      visit_begin, visit_end, 0], ordered most expensive first
    VISITS            int32 (V, 4): the tiles of the other side it meets, [start, end, full, 0];
                      full = every pair visible AND the visited tile is full width, so the kernel
                      skips the element mask (it always masks loads past ``end``)
    lse               natural log on the outside; the kernels work in base 2 (exp2 is one
                      instruction): s2 = logits * log2(e), lse2 = lse * log2(e)

The tables come from ``dlm_ops.geometry`` (built once per shape by the triton backend); the element
mask of PARTIAL tiles uses the same interval formulas as ``SequenceMask.row_intervals`` /
``col_intervals``, relative to the tile's sequence start. One launch serves the batched layout (the
same table for every batch entry) and varlen (batch 1, one table row per tile of every sample).

Grids put (batch, head) on axis 0 and the tile on axis 1: blocks launch in linear order with axis 0
fastest, so every head's most expensive tiles start first, and the G query heads that share a kv
head run side by side (their K/V tiles stay in L2).

The backward is two kernels with disjoint writes (no atomics), so it is always bitwise
deterministic: dK/dV per key tile over the query tiles that see it, looping over the G query heads
of its kv head (K and V are loaded once for the whole group), and dQ per query tile over its key
tiles. Fusing dQ into the dK/dV kernel with fp32 atomics (5 matmuls per tile pair instead of 7) was
measured on the H200 and ran 2x slower (benchmarks/results/NOTES.md), so there is no faster
non-deterministic path: deterministic=True and the default take the same kernels.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): exact limits at +-inf, and the interpreter runs it too (no libdevice).
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _logits2(s, scale, softcap, SOFTCAP: tl.constexpr):
    """Raw q.k -> base-2 logits, and the capped natural logits the softcap backward needs."""
    if SOFTCAP:
        capped = softcap * _tanh(s * (scale / softcap))
        return capped * 1.4426950408889634, capped
    return s * (scale * 1.4426950408889634), s


@triton.jit
def _row_intervals(r, nn, nc, bs):
    """Keys seen by local query rows r: [lo1, hi1) and [nn, hi2) (geometry.row_intervals)."""
    noisy = r < nn
    blk = tl.where(noisy, r, r - nn) // bs
    lo1 = tl.where(noisy, blk * bs, nn)
    hi1 = tl.where(noisy, tl.minimum((blk + 1) * bs, nn), nn + tl.minimum((blk + 1) * bs, nc))
    hi2 = tl.where(noisy, nn + tl.minimum(blk * bs, nc), nn)
    return lo1, hi1, hi2


@triton.jit
def _col_intervals(c, nn, nc, bs):
    """Rows that see local keys c: [lo1, hi1) and [lo2, nn + nc) (geometry.col_intervals)."""
    noisy = c < nn
    blk = tl.where(noisy, c, c - nn) // bs
    lo1 = tl.where(noisy, blk * bs, tl.minimum((blk + 1) * bs, nn))
    hi1 = tl.where(noisy, tl.minimum((blk + 1) * bs, nn), nn)
    lo2 = tl.where(noisy, nn + nc, nn + tl.minimum(blk * bs, nc))
    return lo1, hi1, lo2


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # fp32 inputs: exact fp32 products instead of Triton's default tf32
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def diffusion_fwd_kernel(
    Q, K, V, O, LSE, TILES, VISITS,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, slb, slh,
    H, G, bs, scale, softcap,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
):
    bh, tile = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    t = TILES + tile * 8
    q0, q1, seq0, nn, nc = tl.load(t), tl.load(t + 1), tl.load(t + 2), tl.load(t + 3), tl.load(t + 4)
    v_begin, v_end = tl.load(t + 5), tl.load(t + 6)

    rows = q0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < q1, dims < D
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    lo1, hi1, hi2 = _row_intervals(rows - seq0, nn, nc, bs)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    for i in range(v_begin, v_end):
        vis = VISITS + i * 4
        c0, c1, full = tl.load(vis), tl.load(vis + 1), tl.load(vis + 2)
        cols = c0 + tl.arange(0, BLOCK_N)
        kv_mask = (cols < c1)[:, None] & dim_ok[None, :]
        k = tl.load(k_base + cols[:, None] * sks + dims[None, :], mask=kv_mask, other=0.0)
        s2, _ = _logits2(_dot(q, tl.trans(k), IEEE), scale, softcap, SOFTCAP)
        if full == 0:
            c = (cols - seq0)[None, :]
            seen = ((c >= lo1[:, None]) & (c < hi1[:, None])) | ((c >= nn) & (c < hi2[:, None]))
            s2 = tl.where(seen & (cols < c1)[None, :], s2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s2 - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svs + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(O + b * sob + h * soh + rows[:, None] * sos + dims[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(LSE + b * slb + h * slh + rows, lse, mask=row_ok)


@triton.jit
def bwd_delta_kernel(
    O, DO, DLSE, DELTA, sob, sos, soh, sdob, sdos, sdoh, S, H,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """delta = rowsum(dO * O) - dlse, fp32 (B, H, S): the backward's per-row constant, one read
    of O and dO (the PyTorch expression costs three fp32 temporaries)."""
    bh, blk = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows < S)[:, None] & (dims < D)[None, :]
    o = tl.load(O + b * sob + h * soh + rows[:, None] * sos + dims[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + dims[None, :], mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + bh * S + rows, mask=rows < S, other=0.0)
    tl.store(DELTA + bh * S + rows, delta, mask=rows < S)


@triton.jit
def diffusion_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, TILES, VISITS,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh,
    sdkb, sdks, sdkh, sdvb, sdvs, sdvh, slb, slh,
    Hkv, G, bs, scale, softcap,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
):
    """One key tile of one kv head: dK, dV over every query tile that sees it, for all G heads."""
    bh, tile = tl.program_id(0), tl.program_id(1)
    b, kvh = bh // Hkv, bh % Hkv
    t = TILES + tile * 8
    k0, k1, seq0, nn, nc = tl.load(t), tl.load(t + 1), tl.load(t + 2), tl.load(t + 3), tl.load(t + 4)
    v_begin, v_end = tl.load(t + 5), tl.load(t + 6)

    cols = k0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok, dim_ok = cols < k1, dims < D
    kv_mask = col_ok[:, None] & dim_ok[None, :]
    k = tl.load(K + b * skb + kvh * skh + cols[:, None] * sks + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + kvh * svh + cols[:, None] * svs + dims[None, :], mask=kv_mask, other=0.0)
    lo1, hi1, lo2 = _col_intervals(cols - seq0, nn, nc, bs)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(0, G):
        h = kvh * G + g
        for i in range(v_begin, v_end):
            vis = VISITS + i * 4
            r0, r1, full = tl.load(vis), tl.load(vis + 1), tl.load(vis + 2)
            rows = r0 + tl.arange(0, BLOCK_M)
            row_ok = rows < r1
            q_mask = row_ok[:, None] & dim_ok[None, :]
            q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=q_mask,
                        other=0.0)
            do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + dims[None, :],
                         mask=q_mask, other=0.0)
            # Rows past the tile get lse = +inf, so their probabilities are exactly 0.
            lse2 = tl.load(LSE + b * slb + h * slh + rows, mask=row_ok, other=float("inf")) * 1.4426950408889634
            delta = tl.load(DELTA + b * slb + h * slh + rows, mask=row_ok, other=0.0)
            s2, capped = _logits2(_dot(k, tl.trans(q), IEEE), scale, softcap, SOFTCAP)  # (N, M)
            p = tl.exp2(s2 - lse2[None, :])
            if full == 0:
                r = (rows - seq0)[None, :]
                seen = ((r >= lo1[:, None]) & (r < hi1[:, None])) | ((r >= lo2[:, None]) & (r < nn + nc))
                p = tl.where(seen & row_ok[None, :], p, 0.0)
            dv += _dot(p.to(do.dtype), do, IEEE)
            ds = p * (_dot(v, tl.trans(do), IEEE) - delta[None, :])
            if SOFTCAP:  # d(c * tanh(x / c)) / dx = 1 - tanh^2
                ds = ds * (1.0 - (capped / softcap) * (capped / softcap))
            dk += _dot(ds.to(q.dtype), q, IEEE)

    tl.store(DK + b * sdkb + kvh * sdkh + cols[:, None] * sdks + dims[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * sdvb + kvh * sdvh + cols[:, None] * sdvs + dims[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def diffusion_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, TILES, VISITS,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdqb, sdqs, sdqh, slb, slh,
    H, G, bs, scale, softcap,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
):
    """One query tile of one head: dQ over the key tiles it sees."""
    bh, tile = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    t = TILES + tile * 8
    q0, q1, seq0, nn, nc = tl.load(t), tl.load(t + 1), tl.load(t + 2), tl.load(t + 3), tl.load(t + 4)
    v_begin, v_end = tl.load(t + 5), tl.load(t + 6)

    rows = q0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < q1, dims < D
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + dims[None, :], mask=q_mask,
                 other=0.0)
    lse2 = tl.load(LSE + b * slb + h * slh + rows, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + b * slb + h * slh + rows, mask=row_ok, other=0.0)
    lo1, hi1, hi2 = _row_intervals(rows - seq0, nn, nc, bs)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    for i in range(v_begin, v_end):
        vis = VISITS + i * 4
        c0, c1, full = tl.load(vis), tl.load(vis + 1), tl.load(vis + 2)
        cols = c0 + tl.arange(0, BLOCK_N)
        kv_mask = (cols < c1)[:, None] & dim_ok[None, :]
        k = tl.load(k_base + cols[:, None] * sks + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * svs + dims[None, :], mask=kv_mask, other=0.0)
        s2, capped = _logits2(_dot(q, tl.trans(k), IEEE), scale, softcap, SOFTCAP)
        p = tl.exp2(s2 - lse2[:, None])
        if full == 0:
            c = (cols - seq0)[None, :]
            seen = ((c >= lo1[:, None]) & (c < hi1[:, None])) | ((c >= nn) & (c < hi2[:, None]))
            p = tl.where(seen & (cols < c1)[None, :], p, 0.0)
        ds = p * (_dot(do, tl.trans(v), IEEE) - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - (capped / softcap) * (capped / softcap))
        dq += _dot(ds.to(k.dtype), k, IEEE)

    tl.store(DQ + b * sdqb + h * sdqh + rows[:, None] * sdqs + dims[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)
