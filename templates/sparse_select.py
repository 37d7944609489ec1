"""Triton kernel for SparseD's selection score: attention mass pooled per (query block, key block).

Notation
--------
    B, H, Hkv, G      batch, query heads, kv heads, G = H // Hkv query heads per kv head (GQA)
    D, BLOCK_D        head dim, and its power-of-two padding (>= 16 for tl.dot; loads mask it)
    BLOCK_M, BLOCK_N  the selection blocks themselves: one program owns one query block of
                      BLOCK_M rows and walks the key blocks of BLOCK_N keys one at a time, so each
                      iteration's tile sum IS one output entry (no segmented reductions)
    nkb, npb          key blocks, and how many of them form the prompt part (0: a single part)
    MASS              fp32 (B, H, nQb, nKb): sum over the tile of p, p the softmax over the keys
                      of the key block's part ([0, npb) or [npb, nkb) blocks), see
                      dlm_ops/sparsity/_pooling.py for the definition and the torch version
    s2, lse2          logits and log-sum-exp in base 2 (exp2 is one instruction): s2 = s*log2(e)

Two passes over the keys per program, as in a flash-attention forward that stops before P@V:
pass 1 keeps an online (max, sum) per row for each part; pass 2 recomputes each tile's logits and
stores sum(exp2(s2 - lse2_part)) over its valid rows and columns. Every program writes its own row
of MASS (no atomics: deterministic) and holds one (BLOCK_M, BLOCK_N) fp32 tile at a time; the
S x S matrix never exists. Grid (B * H, nQb) with (batch, head) on axis 0, so the G query heads
that read the same kv head run side by side and share its K tiles in L2.
"""

import triton
import triton.language as tl

from .diffusion_attn import _dot


@triton.jit
def block_mass_kernel(
    Q, K, MASS,
    sqb, sqs, sqh, skb, sks, skh, smb, smh, smq,
    Sq, Sk, H, G, nkb, npb, scale2,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    bh, qblk = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    rows = qblk * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < Sq, dims < D
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    k_base = K + b * skb + kvh * skh

    # Pass 1: per row and part, the running max m and sum l of exp2(s2 - m).
    m0 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l0 = tl.zeros([BLOCK_M], tl.float32)
    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    for j in range(0, nkb):
        cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < Sk
        k = tl.load(k_base + cols[:, None] * sks + dims[None, :],
                    mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        s2 = _dot(q, tl.trans(k), IEEE) * scale2
        s2 = tl.where(col_ok[None, :], s2, float("-inf"))  # every key block has a valid column
        first = j < npb
        m_old = tl.where(first, m0, m1)
        l_old = tl.where(first, l0, l1)
        m_new = tl.maximum(m_old, tl.max(s2, 1))
        l_new = l_old * tl.exp2(m_old - m_new) + tl.sum(tl.exp2(s2 - m_new[:, None]), 1)
        m0 = tl.where(first, m_new, m0)
        l0 = tl.where(first, l_new, l0)
        m1 = tl.where(first, m1, m_new)
        l1 = tl.where(first, l1, l_new)
    # A part with no key block keeps m = -inf, l = 0 and is never read; the floor only spares
    # log2(0) (lse stays -inf).
    lse0 = m0 + tl.log2(tl.maximum(l0, 1e-30))
    lse1 = m1 + tl.log2(tl.maximum(l1, 1e-30))

    # Pass 2: each tile's probability mass, one output entry per key block.
    out = MASS + b * smb + h * smh + qblk * smq
    for j in range(0, nkb):
        cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < Sk
        k = tl.load(k_base + cols[:, None] * sks + dims[None, :],
                    mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        s2 = _dot(q, tl.trans(k), IEEE) * scale2
        lse = tl.where(j < npb, lse0, lse1)
        p = tl.exp2(s2 - lse[:, None])
        p = tl.where(row_ok[:, None] & col_ok[None, :], p, 0.0)
        tl.store(out + j, tl.sum(tl.sum(p, 1), 0))
