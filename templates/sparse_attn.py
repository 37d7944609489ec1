"""Triton kernels for sparse attention: block-sparse and column-sparse, forward, dQ and dK/dV.

Notation
--------
    B, H, Hkv, G      batch, query heads, kv heads, G = H // Hkv query heads per kv head (GQA)
    Sq, Sk            query and key lengths (may differ; only the last block of each is partial)
    D, BLOCK_D        head dim, and its power-of-two padding (loads mask the padding)
    BSQ, BSK          selection block sizes (powers of two, 16..256; dlm_ops/ops/sparse.py)
    BLOCK_M, BLOCK_N  kernel tile: rows (queries) and columns (keys), powers of two. BLOCK_M divides
                      BSQ: SUB_M = BSQ // BLOCK_M row tiles make one query block (a row tile never
                      straddles two blocks, whose lists differ). Columns of the gather-side kernels
                      (forward, dQ): BLOCK_N <= BSK gives SUB_N = BSK // BLOCK_N contiguous tiles
                      per listed block; BLOCK_N > BSK gathers BLOCK_N // BSK listed blocks into one
                      tile (_key_tile). dK/dV owns BLOCK_N <= BSK keys of one block
    IDX, CNT          block-sparse: int32 (B, H, nQb, max_blocks) key blocks listed per query block,
                      and their counts (B, H, nQb). Column-sparse: int32 (B, H, K) keys listed per
                      head, and their counts (B, H)
    ORDER             int32 (B, H, nQb): each head's query blocks by decreasing count (a stable
                      argsort), so the longest lists start first and do not finish last
    REV_OFF, REV_Q    block-sparse backward, the transposed index in CSR form: the query blocks of
                      head h that list key block kb are REV_Q[REV_OFF[i] : REV_OFF[i + 1]] with
                      i = (b * H + h) * nKb + kb (built with torch ops by the backend, sorted, so
                      the dK/dV sums run in a fixed order)
    LSE, DELTA        contiguous float32 (B, H, Sq); natural log outside, base 2 inside (exp2 is
                      one instruction): s2 = logits * log2(e), lse2 = lse * log2(e)

Forward: a FlashAttention forward whose key loop walks an index list: one flat loop over
(listed block, column tile) pairs, tl.load of the block index, then pointer arithmetic. A query
block with count 0 runs no iteration and writes out 0, lse -inf. Grids put (batch, head) on axis 0
(fastest), so the G query heads of a kv head run side by side and share K/V in L2 where their
lists overlap.

Backward, deterministic without atomics: dQ per query tile over its listed key tiles; dK/dV per
key tile of a kv head over the G query heads and, for each, the query blocks that list the key
block (REV_*). Column-sparse dK/dV: per head and tile of its LISTED keys over all query rows, into
a compact (B, H, K, D) float32 buffer; the lists of one head are disjoint (no duplicates), and the
backend sums the G heads of a group into dK/dV with one scatter per head index g, in a fixed order.
"""

import triton
import triton.language as tl

from .diffusion_attn import _dot


@triton.jit
def _num_key_tiles(count, BSK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles over ``count`` listed blocks: SUB_N per block, or gathered tiles of BLOCK_N keys
    spanning BLOCK_N // BSK blocks when the blocks are smaller than the tile."""
    if BSK >= BLOCK_N:
        return count * (BSK // BLOCK_N)
    else:
        return (count * BSK + BLOCK_N - 1) // BLOCK_N


@triton.jit
def _key_tile(idx_row, it, count, Sk, BSK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key positions of key tile ``it`` of a list, which of them are real keys, and whether any
    is not (the element mask is then needed).

    BSK >= BLOCK_N: one block index (a scalar load), contiguous columns; only the last block of
    the sequence can be partial. BSK < BLOCK_N (small selection blocks): the tile gathers its
    columns from BLOCK_N // BSK consecutive list entries, like the column-sparse kernels, so a
    16-key block does not force 16-column dots."""
    if BSK >= BLOCK_N:
        SUB_N: tl.constexpr = BSK // BLOCK_N
        kb = tl.load(idx_row + it // SUB_N)
        c0 = kb * BSK + (it % SUB_N) * BLOCK_N
        cols = c0 + tl.arange(0, BLOCK_N)
        return cols, cols < Sk, c0 + BLOCK_N > Sk
    else:
        slots = it * BLOCK_N + tl.arange(0, BLOCK_N)
        entry = slots // BSK
        listed = entry < count
        kb = tl.load(idx_row + entry, mask=listed, other=0)
        cols = kb * BSK + slots % BSK
        return cols, listed & (cols < Sk), it >= 0  # always masked (a runtime true)


@triton.jit
def block_sparse_fwd_kernel(
    Q, K, V, O, LSE, IDX, CNT, ORDER,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
    H, G, Sq, Sk, nQb, max_blocks, scale,
    D: tl.constexpr, BSQ: tl.constexpr, BSK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    SUB_M: tl.constexpr = BSQ // BLOCK_M
    bh, t = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    qb = tl.load(ORDER + bh * nQb + t // SUB_M)  # longest lists first
    rows = qb * BSQ + (t % SUB_M) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < Sq, dims < D
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    count = tl.load(CNT + bh * nQb + qb)
    idx_row = IDX + (bh * nQb + qb) * max_blocks

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    qk_scale = scale * 1.4426950408889634
    for it in range(0, _num_key_tiles(count, BSK, BLOCK_N)):
        cols, real, partial = _key_tile(idx_row, it, count, Sk, BSK, BLOCK_N)
        kv_mask = real[:, None] & dim_ok[None, :]
        k = tl.load(k_base + cols[:, None] * sks + dims[None, :], mask=kv_mask, other=0.0)
        s2 = _dot(q, tl.trans(k), IEEE) * qk_scale
        if partial:  # the last key block may be partial
            s2 = tl.where(real[None, :], s2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked first tile
        p = tl.exp2(s2 - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svs + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # count 0: acc is 0, out 0
    tl.store(O + b * sob + h * soh + rows[:, None] * sos + dims[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # count 0: -inf + log2(0) = -inf
    tl.store(LSE + bh * Sq + rows, lse, mask=row_ok)


@triton.jit
def block_sparse_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, IDX, CNT, ORDER,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdqb, sdqs, sdqh,
    H, G, Sq, Sk, nQb, max_blocks, scale,
    D: tl.constexpr, BSQ: tl.constexpr, BSK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    """One query tile of one head: dQ over its listed key tiles (count 0: dQ = 0)."""
    SUB_M: tl.constexpr = BSQ // BLOCK_M
    bh, t = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    qb = tl.load(ORDER + bh * nQb + t // SUB_M)  # longest lists first
    rows = qb * BSQ + (t % SUB_M) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < Sq, dims < D
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + dims[None, :], mask=q_mask,
                 other=0.0)
    lse2 = tl.load(LSE + bh * Sq + rows, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + bh * Sq + rows, mask=row_ok, other=0.0)
    count = tl.load(CNT + bh * nQb + qb)
    idx_row = IDX + (bh * nQb + qb) * max_blocks

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    qk_scale = scale * 1.4426950408889634
    for it in range(0, _num_key_tiles(count, BSK, BLOCK_N)):
        cols, real, partial = _key_tile(idx_row, it, count, Sk, BSK, BLOCK_N)
        kv_mask = real[:, None] & dim_ok[None, :]
        k = tl.load(k_base + cols[:, None] * sks + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * svs + dims[None, :], mask=kv_mask, other=0.0)
        p = tl.exp2(_dot(q, tl.trans(k), IEEE) * qk_scale - lse2[:, None])
        if partial:
            p = tl.where(real[None, :], p, 0.0)
        ds = p * (_dot(do, tl.trans(v), IEEE) - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE)

    tl.store(DQ + b * sdqb + h * sdqh + rows[:, None] * sdqs + dims[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


@triton.jit
def block_sparse_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, REV_OFF, REV_Q,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh,
    sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
    H, Hkv, G, Sq, Sk, nKb, scale,
    D: tl.constexpr, BSQ: tl.constexpr, BSK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    """One key tile (BLOCK_N keys of key block kb) of one kv head: dK, dV over the G query heads
    and, per head, the query blocks that list kb. Rows past Sq get lse = +inf, so P = 0 there."""
    SUB_M: tl.constexpr = BSQ // BLOCK_M
    SUB_N: tl.constexpr = BSK // BLOCK_N
    bkv, t = tl.program_id(0), tl.program_id(1)
    b, kvh = bkv // Hkv, bkv % Hkv
    kb = t // SUB_N
    cols = kb * BSK + (t % SUB_N) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok, dim_ok = cols < Sk, dims < D
    kv_mask = col_ok[:, None] & dim_ok[None, :]
    k = tl.load(K + b * skb + kvh * skh + cols[:, None] * sks + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + kvh * svh + cols[:, None] * svs + dims[None, :], mask=kv_mask, other=0.0)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    qk_scale = scale * 1.4426950408889634
    for g in range(0, G):
        h = kvh * G + g
        bh = b * H + h
        r = bh * nKb + kb
        r0, r1 = tl.load(REV_OFF + r), tl.load(REV_OFF + r + 1)
        for it in range(0, (r1 - r0) * SUB_M):
            qb = tl.load(REV_Q + r0 + it // SUB_M)
            rows = qb * BSQ + (it % SUB_M) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < Sq
            q_mask = row_ok[:, None] & dim_ok[None, :]
            q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=q_mask,
                        other=0.0)
            do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + dims[None, :],
                         mask=q_mask, other=0.0)
            lse2 = tl.load(LSE + bh * Sq + rows, mask=row_ok, other=float("inf")) * 1.4426950408889634
            delta = tl.load(DELTA + bh * Sq + rows, mask=row_ok, other=0.0)
            # Columns past Sk (k = v = 0) only touch their own dK/dV rows, which are not stored.
            p = tl.exp2(_dot(k, tl.trans(q), IEEE) * qk_scale - lse2[None, :])  # (N, M)
            dv += _dot(p.to(do.dtype), do, IEEE)
            ds = p * (_dot(v, tl.trans(do), IEEE) - delta[None, :])
            dk += _dot(ds.to(q.dtype), q, IEEE)

    tl.store(DK + b * sdkb + kvh * sdkh + cols[:, None] * sdks + dims[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * sdvb + kvh * sdvh + cols[:, None] * sdvs + dims[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def column_sparse_fwd_kernel(
    Q, K, V, O, LSE, IDX, CNT,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
    H, G, Sq, max_cols, scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One query tile of one head over the head's listed keys, BLOCK_N gathered rows at a time."""
    bh, t = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < Sq, dims < D
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    count = tl.load(CNT + bh)
    idx_row = IDX + bh * max_cols

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    qk_scale = scale * 1.4426950408889634
    for start in range(0, count, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        listed = slots < count
        cols = tl.load(idx_row + slots, mask=listed, other=0)
        kv_mask = listed[:, None] & dim_ok[None, :]
        k = tl.load(k_base + cols[:, None] * sks + dims[None, :], mask=kv_mask, other=0.0)
        s2 = _dot(q, tl.trans(k), IEEE) * qk_scale
        if start + BLOCK_N > count:
            s2 = tl.where(listed[None, :], s2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        p = tl.exp2(s2 - m_new[:, None])  # every tile has a listed key: m_new is finite
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svs + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + b * sob + h * soh + rows[:, None] * sos + dims[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(LSE + bh * Sq + rows, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


@triton.jit
def column_sparse_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, IDX, CNT,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdqb, sdqs, sdqh,
    H, G, Sq, max_cols, scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    bh, t = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < Sq, dims < D
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + dims[None, :], mask=q_mask,
                 other=0.0)
    lse2 = tl.load(LSE + bh * Sq + rows, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + bh * Sq + rows, mask=row_ok, other=0.0)
    count = tl.load(CNT + bh)
    idx_row = IDX + bh * max_cols

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    qk_scale = scale * 1.4426950408889634
    for start in range(0, count, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        listed = slots < count
        cols = tl.load(idx_row + slots, mask=listed, other=0)
        kv_mask = listed[:, None] & dim_ok[None, :]
        k = tl.load(k_base + cols[:, None] * sks + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * svs + dims[None, :], mask=kv_mask, other=0.0)
        p = tl.exp2(_dot(q, tl.trans(k), IEEE) * qk_scale - lse2[:, None])
        p = tl.where(listed[None, :], p, 0.0)
        ds = p * (_dot(do, tl.trans(v), IEEE) - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE)

    tl.store(DQ + b * sdqb + h * sdqh + rows[:, None] * sdqs + dims[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


@triton.jit
def column_sparse_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DKP, DVP, IDX, CNT,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh,
    H, G, Sq, max_cols, scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    """BLOCK_N listed keys of one query head: their dK, dV over every query row, into the compact
    float32 DKP, DVP (B, H, max_cols, D). Slots past the count are not written."""
    bh, t = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    count = tl.load(CNT + bh)
    slots = t * BLOCK_N + tl.arange(0, BLOCK_N)
    listed = slots < count
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    cols = tl.load(IDX + bh * max_cols + slots, mask=listed, other=0)
    kv_mask = listed[:, None] & dim_ok[None, :]
    k = tl.load(K + b * skb + kvh * skh + cols[:, None] * sks + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + kvh * svh + cols[:, None] * svs + dims[None, :], mask=kv_mask, other=0.0)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    qk_scale = scale * 1.4426950408889634
    n_rows = tl.where(t * BLOCK_N < count, Sq, 0)  # a tile with no listed key has nothing to do
    for r0 in range(0, n_rows, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < Sq
        q_mask = row_ok[:, None] & dim_ok[None, :]
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=q_mask,
                    other=0.0)
        do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + dims[None, :], mask=q_mask,
                     other=0.0)
        lse2 = tl.load(LSE + bh * Sq + rows, mask=row_ok, other=float("inf")) * 1.4426950408889634
        delta = tl.load(DELTA + bh * Sq + rows, mask=row_ok, other=0.0)
        p = tl.exp2(_dot(k, tl.trans(q), IEEE) * qk_scale - lse2[None, :])  # (N, M)
        dv += _dot(p.to(do.dtype), do, IEEE)
        ds = p * (_dot(v, tl.trans(do), IEEE) - delta[None, :])
        dk += _dot(ds.to(q.dtype), q, IEEE)

    out = (bh * max_cols + slots)[:, None] * D + dims[None, :]
    tl.store(DKP + out, dk * scale, mask=kv_mask)
    tl.store(DVP + out, dv, mask=kv_mask)
