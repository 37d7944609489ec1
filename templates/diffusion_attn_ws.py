"""Warp-specialized block-diffusion forward for Hopper (sm90): TMA loads, a producer warp and two
consumer warpgroups, built by Triton's own Hopper warp specialization (``tl.range(...,
warp_specialize=True)``, triton >= 3.6).

Why a second forward kernel: the portable one (diffusion_attn.py) compiles on sm90 to one
warpgroup that issues the loads, waits on each wgmma at once (pendings = 0) and then runs the
softmax, so the tensor cores idle during every softmax. Here the compiler splits the loop into a
producer (TMA copies of K and V into a 2-3 stage ring, mbarrier handshakes) and two consumer
warpgroups that each own 64 of the tile's 128 query rows: while one runs its softmax the other's
wgmma runs (FlashAttention-3's overlap, without its explicit ping-pong barriers).

What the Hopper pass accepts shaped this kernel (triton 3.6, checked by compiling for sm90):
- K, V and Q come through host tensor descriptors (``triton.tools.tensor_descriptor``); pointer
  loads leave the loop unspecialized.
- The loop body has no runtime branch: an ``if`` on the visit's "full" flag made the pass give up
  (and spill 700 B), so every visited tile takes the element mask. The mask is the same interval
  test as the portable kernel (a few integer ops per element, overlapped with the other
  warpgroup's matmuls).
- One specialized loop per kernel: a second one (full tiles, then partial tiles) crashed the pass.
- 2D descriptors over the (B*S, H*D) view of a (B, S, H, D) tensor; 4D ones crashed the pass. A
  tile that runs past its sample therefore loads the next sample's rows (or zeros past the end of
  the tensor): they get probability exactly 0, so they cannot change the result unless they hold
  Inf/NaN (0 * NaN); the portable kernel masks them at load time instead.

Tables and notation are those of diffusion_attn.py (TILES, VISITS, base-2 logits, lse in natural
log outside); the grid is the same (batch x head on axis 0, tiles longest first on axis 1).
"""

import triton
import triton.language as tl

from .diffusion_attn import _logits2, _row_intervals


@triton.jit
def diffusion_fwd_ws_kernel(
    Q, K, V, O, LSE, TILES, VISITS,
    sob, sos, soh, slb, slh,
    S, H, G, bs, scale, softcap,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
):
    bh, tile = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    t = TILES + tile * 8
    q0, q1, seq0, nn, nc = tl.load(t), tl.load(t + 1), tl.load(t + 2), tl.load(t + 3), tl.load(t + 4)
    v_begin, v_end = tl.load(t + 5), tl.load(t + 6)

    row0 = b * S  # first row of this batch entry in the (B*S, H*D) views
    q = Q.load([row0 + q0, h * D])
    rows = q0 + tl.arange(0, BLOCK_M)
    lo1, hi1, hi2 = _row_intervals(rows - seq0, nn, nc, bs)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for i in tl.range(v_begin, v_end, warp_specialize=True):
        c0, c1 = tl.load(VISITS + i * 4), tl.load(VISITS + i * 4 + 1)
        k = K.load([row0 + c0, kvh * D])
        s2, _ = _logits2(tl.dot(q, tl.trans(k)), scale, softcap, SOFTCAP)
        cols = c0 + tl.arange(0, BLOCK_N)
        c = (cols - seq0)[None, :]
        seen = ((c >= lo1[:, None]) & (c < hi1[:, None])) | ((c >= nn) & (c < hi2[:, None]))
        s2 = tl.where(seen & (cols < c1)[None, :], s2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s2 - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = V.load([row0 + c0, kvh * D])
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new

    out = acc / l_i[:, None]
    row_ok = rows < q1
    dims = tl.arange(0, D)
    tl.store(O + b * sob + h * soh + rows[:, None] * sos + dims[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(LSE + b * slb + h * slh + rows, lse, mask=row_ok)
