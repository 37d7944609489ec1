"""Triton kernels for PulseCol's selection score: attention mass per key column.

Notation
--------
    B, H, Hkv, G      batch, query heads, kv heads, G = H // Hkv query heads per kv head (GQA)
    R                 query rows scored (PulseCol's sampled rows, gathered beforehand, or all Sq)
    D, BLOCK_D        head dim, and its power-of-two padding (>= 16 for tl.dot; loads mask it)
    BLOCK_M, BLOCK_N  query rows and keys per tile
    s2, lse2          logits and log-sum-exp in base 2 (exp2 is one instruction): s2 = s*log2(e)
    LSE2              fp32 (B, H, R): each scored row's lse2 over all Sk keys (pass 1's output)
    MASS              fp32 (B, H, Sk): MASS[b, h, j] = sum over rows i of exp2(s2[i, j] - lse2[i]),
                      i.e. sum_i p[i, j] with p each row's softmax over all keys; see
                      dlm_ops/sparsity/pulsecol.py for the definition and the torch version

Two kernels, each one QK^T pass (so the selection costs two QK^T of the scored rows):

    row_lse_kernel      one program per (row tile, b, h): an online (max, sum) over all key
                        tiles, as in a flash-attention forward that stops before P@V.
    column_mass_kernel  one program per (key tile, b, h): its K tile stays resident while it walks
                        every query tile, adding exp2(s2 - lse2) into a (BLOCK_M, BLOCK_N) fp32
                        accumulator; one reduction over the rows at the end (a per-tile row sum
                        would put a cross-warp reduction in every iteration).

Every program writes its own outputs (no atomics: the mass is bitwise deterministic). GQA: query
head h reads kv head h // G; its mass is its own (the G heads are not summed: a column pattern
is per query head). Grids put the tile index on axis 0 (fastest-varying), so the programs that run
side by side belong to one (b, h) and stream the same K (pass 1) or Q and LSE2 (pass 2) through L2:
8 MiB per head at 32K rows, D=128, bf16. Offsets use 64-bit batch and head bases: B*S*H*D passes
2^31 at B=8, S=64K, H=32, D=128.
"""

import triton
import triton.language as tl

from .diffusion_attn import _dot


@triton.jit
def row_lse_kernel(
    Q, K, LSE2,
    sqb, sqs, sqh, skb, sks, skh, slb, slh,
    R, Sk, H, G, scale2,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < R, dims < D
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    k_base = K + b * skb + (h // G) * skh

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, Sk, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < Sk
        k = tl.load(k_base + cols[:, None] * sks + dims[None, :],
                    mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        s2 = _dot(q, tl.trans(k), IEEE) * scale2
        s2 = tl.where(col_ok[None, :], s2, float("-inf"))  # column `start` is valid: m finite
        m_new = tl.maximum(m, tl.max(s2, 1))
        l = l * tl.exp2(m - m_new) + tl.sum(tl.exp2(s2 - m_new[:, None]), 1)
        m = m_new
    tl.store(LSE2 + b * slb + h * slh + rows, m + tl.log2(l), mask=row_ok)


@triton.jit
def column_mass_kernel(
    Q, K, LSE2, MASS,
    sqb, sqs, sqh, skb, sks, skh, slb, slh, smb, smh,
    R, Sk, H, G, scale2,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok, dim_ok = cols < Sk, dims < D
    # Columns past Sk load zero keys: they gather mass like any column but are never stored.
    k = tl.load(K + b * skb + (h // G) * skh + cols[:, None] * sks + dims[None, :],
                mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
    q_base = Q + b * sqb + h * sqh
    lse_base = LSE2 + b * slb + h * slh

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, R, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < R
        q = tl.load(q_base + rows[:, None] * sqs + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        # Rows past R: lse2 = +inf makes their exp2 exactly 0, no mask on the tile needed.
        lse2 = tl.load(lse_base + rows, mask=row_ok, other=float("inf"))
        s2 = _dot(q, tl.trans(k), IEEE) * scale2
        acc += tl.exp2(s2 - lse2[:, None])
    tl.store(MASS + b * smb + h * smh + cols, tl.sum(acc, 0), mask=col_ok)
