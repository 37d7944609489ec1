"""Backends of the sparse family (dlm_ops/ops/sparse.py): tiled PyTorch on any device (here), the
Triton kernels of templates/sparse_attn.py on CUDA (sparse_triton.py), and on sm90 the CUTLASS
block-sparse forward (cutlass_sparse.py: forwards only, block-sparse at selection blocks 128 and
column-sparse over gathered keys; Triton otherwise).

All are deterministic: none sums with atomics (the CUTLASS forward writes each query block from
one CTA; its backwards are Triton's). The block-sparse backward of torch and Triton walks the
transposed index (``transpose_block_index``: per key block, the query blocks that list it), built
with torch ops once per call; the column-sparse backward sums the G query heads of a kv head into
dK/dV with one collision-free read-add-write per head index g (``scatter_group_sum``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import register
from .base import GQA, Backend, Capabilities, lse_dtype, new_output

MAX_TILE = 256  # no cap: a key tile of the gather-side kernels may span several small blocks
# Elements of the largest score tensor the torch backend forms per chunk (float32: 64 MiB).
_CHUNK_ELEMENTS = 1 << 24


class SparseBackend(Backend):
    """The sparse family's entry points; tensors arrive validated, in the public layouts."""

    family = "sparse"

    def block_fwd(self, q, k, v, idx, counts, bsq, bsk, scale):
        raise NotImplementedError

    def block_bwd(self, dout, q, k, v, out, lse, dlse, idx, counts, bsq, bsk, scale):
        raise NotImplementedError

    def column_fwd(self, q, k, v, idx, counts, scale):
        raise NotImplementedError

    def column_bwd(self, dout, q, k, v, out, lse, dlse, idx, counts, scale):
        raise NotImplementedError


# -- shared index plumbing ----------------------------------------------------------------------


def transpose_block_index(idx: torch.Tensor, counts: torch.Tensor, num_kv_blocks: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR of the transposed pattern: for row r = (b * H + h) * nKb + kb, the query blocks of head
    h that list key block kb are ``rev_q[rev_off[r]:rev_off[r + 1]]``, ascending.

    One sort of the listed (row, query block) keys (unique: no duplicates within a list, so the
    order is fully determined) and one bincount; no host sync. int32 outputs."""
    b, h, nqb, m = idx.shape
    dev = idx.device
    listed = torch.arange(m, device=dev) < counts.unsqueeze(-1).long()
    bh = torch.arange(b * h, device=dev).view(b, h, 1, 1)
    qb = torch.arange(nqb, device=dev).view(1, 1, nqb, 1)
    key = ((bh * num_kv_blocks + idx.long()) * nqb + qb)[listed]
    key = key.sort().values
    rows = key // max(nqb, 1)
    rev_q = (key - rows * nqb).to(torch.int32)
    per_row = torch.bincount(rows, minlength=b * h * num_kv_blocks)
    rev_off = torch.zeros(b * h * num_kv_blocks + 1, dtype=torch.int64, device=dev)
    rev_off[1:] = per_row.cumsum(0)
    return rev_off.to(torch.int32), rev_q


def scatter_group_sum(part: torch.Tensor, idx: torch.Tensor, counts: torch.Tensor, seqlen_k: int,
                      kv_heads: int) -> torch.Tensor:
    """Per-query-head gradients of listed keys, part (B, H, K, D), summed over each GQA group into
    (B, Sk, Hkv, D) float. One read-add-write per head index g: within one, every target is
    distinct (distinct kv heads, no duplicates within a list), so no two writes collide and the
    result does not depend on scheduling; unlisted slots land in a spare row Sk that is dropped."""
    b, h, m, d = part.shape
    g_count = h // kv_heads
    listed = torch.arange(m, device=idx.device) < counts.unsqueeze(-1).long()
    target = torch.where(listed, idx.long(), seqlen_k).view(b, kv_heads, g_count, m)
    part = part.view(b, kv_heads, g_count, m, d)
    acc = torch.zeros((b, kv_heads, seqlen_k + 1, d), dtype=part.dtype, device=part.device)
    bi = torch.arange(b, device=part.device).view(b, 1, 1)
    hi = torch.arange(kv_heads, device=part.device).view(1, kv_heads, 1)
    for g in range(g_count):  # a gather and a plain index_put: no accumulate, no atomics
        t = target[:, :, g]
        acc[bi, hi, t] = acc[bi, hi, t] + part[:, :, g]
    return acc[:, :, :seqlen_k].transpose(1, 2)


# -- torch backend ------------------------------------------------------------------------------


def _blocks(x: torch.Tensor, bs: int, n_blocks: int, dtype) -> torch.Tensor:
    """(B, S, Hx, D) -> (B, Hx, n_blocks, bs, D) in ``dtype``, zero-padded past S."""
    b, s, hx, d = x.shape
    x = F.pad(x.to(dtype), (0, 0, 0, 0, 0, n_blocks * bs - s))
    return x.view(b, n_blocks, bs, hx, d).permute(0, 3, 1, 2, 4)


def _unblock(x: torch.Tensor, s: int) -> torch.Tensor:
    """(B, Hx, n_blocks, bs, D) -> (B, s, Hx, D)."""
    b, hx, nb, bs, d = x.shape
    return x.reshape(b, hx, nb * bs, d)[:, :, :s].transpose(1, 2)


def _trim(idx: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """idx cut to the longest list (one host sync): the gathers then cost what is listed, not
    max_blocks (callers often pass nKb-wide tables)."""
    longest = int(counts.max()) if counts.numel() else 0
    return idx[..., :longest]


def _chunk(total: int, per_item: int) -> int:
    return max(1, min(total, _CHUNK_ELEMENTS // max(per_item, 1)))


class TorchSparseBackend(SparseBackend):
    """Gathers the listed key blocks (or columns) of every query block into dense batched matmuls,
    chunked so that no score tensor exceeds _CHUNK_ELEMENTS; the CPU path and the reference-like
    fallback everywhere. Accumulates in float32 (float64 for float64 inputs)."""

    name = "torch"
    priority = 0
    capabilities = Capabilities(
        device_types=None,
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        max_head_dim=256, head_dim_multiple=8, features=frozenset({GQA}))

    @staticmethod
    def _acc(q):
        return torch.float64 if q.dtype == torch.float64 else torch.float32

    @staticmethod
    def _gather_kv(kb, vb, idx, counts, bsk, sk):
        """The listed K and V blocks of query blocks idx (B, H, c, M) out of kb, vb (B, H, nKb,
        bsk, D) (already expanded to query heads), flattened to (B, H, c, M * bsk, D), and which
        of those columns are real keys (B, H, c, 1, M * bsk)."""
        b, h, _, m = idx.shape
        listed = torch.arange(m, device=idx.device) < counts.unsqueeze(-1).long()
        safe = torch.where(listed, idx.long(), 0)
        bi = torch.arange(b, device=idx.device).view(b, 1, 1, 1)
        hi = torch.arange(h, device=idx.device).view(1, h, 1, 1)
        ks, vs = kb[bi, hi, safe].flatten(3, 4), vb[bi, hi, safe].flatten(3, 4)
        pos = safe.unsqueeze(-1) * bsk + torch.arange(bsk, device=idx.device)
        real = (listed.unsqueeze(-1) & (pos < sk)).flatten(3, 4).unsqueeze(3)
        return ks, vs, real

    def _prepare(self, q, k, v, bsq, bsk, nqb):
        """Blocked q (B, H, nQb, bsq, D) and K, V (B, H, nKb, bsk, D) repeated for the G query
        heads of each kv head (a copy: the gathers then index one head axis), in the accumulation
        dtype."""
        acc = self._acc(q)
        h, hkv = q.shape[2], k.shape[2]
        nkb = -(-k.shape[1] // bsk)
        expand = lambda x: x.unsqueeze(2).expand(-1, -1, h // hkv, -1, -1, -1).flatten(1, 2)
        return (_blocks(q, bsq, nqb, acc), expand(_blocks(k, bsk, nkb, acc)),
                expand(_blocks(v, bsk, nkb, acc)))

    def block_fwd(self, q, k, v, idx, counts, bsq, bsk, scale):
        b, sq, h, d = q.shape
        idx = _trim(idx, counts)
        nqb, m = idx.shape[2], idx.shape[3]
        qb, kb, vb = self._prepare(q, k, v, bsq, bsk, nqb)
        o = torch.empty_like(qb)
        l = qb.new_empty((b, h, nqb, bsq))
        step = _chunk(nqb, b * h * bsq * m * bsk)
        for c0 in range(0, nqb, step):
            c = slice(c0, c0 + step)
            ks, vs, real = self._gather_kv(kb, vb, idx[:, :, c], counts[:, :, c], bsk, k.shape[1])
            o[:, :, c], lc = _masked_softmax_attn(qb[:, :, c], ks, vs, real, scale)
            l[:, :, c] = lc.squeeze(-1)
        out = new_output(q, q.shape)
        lse = new_output(q, (b, h, sq), lse_dtype(q.dtype))
        out.copy_(_unblock(o, sq))
        lse.copy_(l.flatten(2, 3)[:, :, :sq])
        return out, lse

    def block_bwd(self, dout, q, k, v, out, lse, dlse, idx, counts, bsq, bsk, scale):
        acc = self._acc(q)
        idx = _trim(idx, counts)
        b, sq, h, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        nqb, m, nkb = idx.shape[2], idx.shape[3], -(-sk // bsk)
        if sq == 0:  # no query: every gradient is 0 (and the gathers below need a block)
            return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
        delta, lse_inf = _row_stats(dout, out, lse, dlse, acc)
        qb, kb, vb = self._prepare(q, k, v, bsq, bsk, nqb)
        dob = _blocks(dout, bsq, nqb, acc)
        stat = lambda x: F.pad(x, (0, nqb * bsq - sq)).view(b, h, nqb, bsq)
        lse_b, delta_b = stat(lse_inf), stat(delta)

        # dQ: gather side, like the forward.
        dqb = torch.empty_like(qb)
        step = _chunk(nqb, b * h * bsq * m * bsk)
        for c0 in range(0, nqb, step):
            c = slice(c0, c0 + step)
            ks, vs, real = self._gather_kv(kb, vb, idx[:, :, c], counts[:, :, c], bsk, sk)
            # where, not a product: an unlisted column's exp may overflow, and inf * 0 is NaN.
            s = (qb[:, :, c] @ ks.transpose(-1, -2)) * scale
            p = torch.where(real, torch.exp(s - lse_b[:, :, c, :, None]), 0.0)
            ds = p * (dob[:, :, c] @ vs.transpose(-1, -2) - delta_b[:, :, c, :, None])
            dqb[:, :, c] = (ds @ ks) * scale

        # dK, dV: per key block over the query blocks that list it (transposed index, padded to
        # the longest list on the host: this backend runs where a sync is cheap), then summed
        # over the G query heads of each kv head.
        rev_off, rev_q = transpose_block_index(idx, counts, nkb)
        lens = (rev_off[1:] - rev_off[:-1]).long()
        t = max(int(lens.max()) if lens.numel() else 0, 1)
        row_of = torch.arange(b * h * nkb, device=q.device).repeat_interleave(lens)
        slot = torch.arange(rev_q.numel(), device=q.device) - rev_off[:-1].long()[row_of]
        rev = torch.zeros(b * h * nkb, t, dtype=torch.long, device=q.device)
        rev[row_of, slot] = rev_q.long()
        rev, lens = rev.view(b, h, nkb, t), lens.view(b, h, nkb)
        dkb = torch.empty_like(kb)
        dvb = torch.empty_like(vb)
        step = _chunk(nkb, b * h * bsk * t * bsq)
        for c0 in range(0, nkb, step):
            c = slice(c0, c0 + step)
            r = rev[:, :, c]
            real = (torch.arange(t, device=q.device) < lens[:, :, c, None]).unsqueeze(-1)
            rows = r.unsqueeze(-1) * bsq + torch.arange(bsq, device=q.device)
            real = (real & (rows < sq)).flatten(3, 4)  # (B, H, c, T * bsq)
            bi = torch.arange(b, device=q.device).view(b, 1, 1, 1)
            hi = torch.arange(h, device=q.device).view(1, h, 1, 1)
            qs, dos = qb[bi, hi, r].flatten(3, 4), dob[bi, hi, r].flatten(3, 4)
            lse_s = lse_b[bi, hi, r].flatten(3, 4).masked_fill(~real, float("inf"))
            delta_s = delta_b[bi, hi, r].flatten(3, 4)
            pt = torch.exp((kb[:, :, c] @ qs.transpose(-1, -2)) * scale - lse_s.unsqueeze(-2))
            dvb[:, :, c] = pt @ dos
            dst = pt * (vb[:, :, c] @ dos.transpose(-1, -2) - delta_s.unsqueeze(-2))
            dkb[:, :, c] = (dst @ qs) * scale
        group = lambda x: x.view(b, hkv, h // hkv, nkb, bsk, d).sum(2)
        grads = (new_output(q, q.shape), new_output(k, k.shape), new_output(v, v.shape))
        for g, x in zip(grads, (_unblock(dqb, sq), _unblock(group(dkb), sk),
                                _unblock(group(dvb), sk))):
            g.copy_(x)
        return grads

    def column_fwd(self, q, k, v, idx, counts, scale):
        acc = self._acc(q)
        idx = _trim(idx, counts)
        b, sq, h, d = q.shape
        ks, vs, real = self._column_gather(k, v, idx, counts, h, acc)
        out = new_output(q, q.shape)
        lse = new_output(q, (b, h, sq), lse_dtype(q.dtype))
        step = _chunk(sq, b * h * idx.shape[2])
        for r0 in range(0, sq, step):
            qt = q[:, r0:r0 + step].to(acc).transpose(1, 2)  # (B, H, rows, D)
            o, l = _masked_softmax_attn(qt, ks, vs, real, scale)
            out[:, r0:r0 + step] = o.transpose(1, 2)
            lse[:, :, r0:r0 + step] = l.squeeze(-1)
        return out, lse

    @staticmethod
    def _column_gather(k, v, idx, counts, h, acc):
        b, m = idx.shape[0], idx.shape[2]
        listed = torch.arange(m, device=k.device) < counts.unsqueeze(-1).long()  # (B, H, K)
        safe = torch.where(listed, idx.long(), 0)
        bi = torch.arange(b, device=k.device).view(b, 1, 1)
        hi = (torch.arange(h, device=k.device) // (h // k.shape[2])).view(1, h, 1)
        ks = k.to(acc).transpose(1, 2)[bi, hi, safe]  # (B, H, K, D)
        vs = v.to(acc).transpose(1, 2)[bi, hi, safe]
        return ks, vs, listed.unsqueeze(-2)

    def column_bwd(self, dout, q, k, v, out, lse, dlse, idx, counts, scale):
        acc = self._acc(q)
        idx = _trim(idx, counts)
        b, sq, h, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        delta, lse_inf = _row_stats(dout, out, lse, dlse, acc)
        ks, vs, real = self._column_gather(k, v, idx, counts, h, acc)
        dq = new_output(q, q.shape)
        dks = torch.zeros_like(ks)
        dvs = torch.zeros_like(vs)
        step = _chunk(sq, b * h * idx.shape[2])
        for r0 in range(0, sq, step):
            r1 = min(sq, r0 + step)
            qt = q[:, r0:r1].to(acc).transpose(1, 2)
            dot = dout[:, r0:r1].to(acc).transpose(1, 2)
            p = torch.where(real, torch.exp((qt @ ks.transpose(-1, -2)) * scale
                                            - lse_inf[:, :, r0:r1, None]), 0.0)
            ds = p * (dot @ vs.transpose(-1, -2) - delta[:, :, r0:r1, None])
            dq[:, r0:r1] = ((ds @ ks) * scale).transpose(1, 2)
            dvs += p.transpose(-1, -2) @ dot
            dks += (ds.transpose(-1, -2) @ qt) * scale
        dk, dv = new_output(k, k.shape), new_output(v, v.shape)
        dk.copy_(scatter_group_sum(dks, idx, counts, sk, hkv))
        dv.copy_(scatter_group_sum(dvs, idx, counts, sk, hkv))
        return dq, dk, dv


def _masked_softmax_attn(q, ks, vs, real, scale):
    """Exact softmax of q (.., M, D) over the columns of ks/vs (.., N, D) where ``real``; rows with
    no real column get out 0, lse -inf. Returns out (.., M, D), lse (.., M, 1)."""
    s = (q @ ks.transpose(-1, -2)) * scale
    s = s.masked_fill(~real, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0))
    return p @ vs, lse


def _row_stats(dout, out, lse, dlse, acc):
    """delta (B, H, Sq) = rowsum(dO * O) - dlse (FlashAttention's backward constant; an upstream
    dlse folds in since d lse / d s = P), and lse with -inf (empty rows) replaced by +inf so that
    their recomputed probabilities are exactly 0."""
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    lse = lse.to(acc)
    return delta, lse.masked_fill(lse == float("-inf"), float("inf"))


register(TorchSparseBackend())
