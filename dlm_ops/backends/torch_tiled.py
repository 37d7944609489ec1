"""The portable backend: tiled PyTorch on any device, the CPU path and the fallback everywhere.

It walks each query tile and only the key tiles that ``geometry`` lists for it, never forming the
S x S matrix. Consecutive key tiles that touch and agree on FULL/PARTIAL are merged into one
matmul of at most ``max_run`` keys (Python overhead per launch dominates small tiles), FULL runs go
unmasked, PARTIAL runs take their element mask from ``geometry.SequenceMask.visible``. Everything
accumulates in float32 (float64 for float64 inputs) with an online softmax; the backward recomputes
probabilities from the saved LSE. All loops run in a fixed order, so it is deterministic.

Layout inside the loops: a query tile of M rows becomes (B, Hkv, G*M, D) with G = H // Hkv query
heads per kv head, so a key tile (B, Hkv, N, D) is read once for its whole group (GQA).
"""

from __future__ import annotations

import torch

from ..geometry import SequenceMask, VarlenMask, Visit
from .base import (DETERMINISTIC, GQA, SOFTCAP, VARLEN, Capabilities, DiffusionBackend, lse_dtype,
                   new_output)


def _merge_runs(visits: tuple[Visit, ...], max_cols: int) -> list[Visit]:
    runs: list[Visit] = []
    for v in visits:
        last = runs[-1] if runs else None
        if last and last.full == v.full and last.end == v.start and v.end - last.start <= max_cols:
            runs[-1] = Visit(last.start, v.end, v.full)
        else:
            runs.append(v)
    return runs


def _group_rows(x: torch.Tensor, r0: int, r1: int, kv_heads: int, dtype) -> torch.Tensor:
    """(B, S, H, D)[:, r0:r1] -> (B, Hkv, G*M, D) in ``dtype``; query head h = kv_head*G + g."""
    b, _, h, d = x.shape
    t = x[:, r0:r1].to(dtype).reshape(b, r1 - r0, kv_heads, h // kv_heads, d)
    return t.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, d)


def _ungroup_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of ``_group_rows``: (B, Hkv, G*M, D) -> (B, M, H, D)."""
    b, hkv, gm, d = t.shape
    return t.reshape(b, hkv, gm // rows, rows, d).permute(0, 3, 1, 2, 4).reshape(b, rows, -1, d)


def _kv_tile(x: torch.Tensor, c0: int, c1: int, dtype) -> torch.Tensor:
    """(B, S, Hkv, D)[:, c0:c1] -> (B, Hkv, N, D) in ``dtype``."""
    return x[:, c0:c1].to(dtype).transpose(1, 2)


def _row_stat(x: torch.Tensor, r0: int, r1: int, kv_heads: int) -> torch.Tensor:
    """(B, H, S)[:, :, r0:r1] -> (B, Hkv, G*M, 1), matching ``_group_rows``."""
    b, h, _ = x.shape
    return x[:, :, r0:r1].reshape(b, kv_heads, -1, 1)


class TorchTiledBackend(DiffusionBackend):
    name = "torch"
    priority = 0
    capabilities = Capabilities(
        device_types=None,
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        max_head_dim=256,
        head_dim_multiple=8,
        features=frozenset({SOFTCAP, GQA, VARLEN, DETERMINISTIC}),
    )

    def __init__(self, block_m: int = 128, block_n: int = 128, max_run: int = 1024):
        self.block_m, self.block_n, self.max_run = block_m, block_n, max_run

    def _scores(self, qt, kt, mask: SequenceMask, r0, r1, run: Visit, scale, softcap, keep_capped):
        """Logits of one run, (B, Hkv, G*M, N), -inf where hidden, for the caller to overwrite in
        place; with ``keep_capped`` and a softcap, also a copy of the unmasked capped logits (the
        softcap backward needs them finite), else None."""
        s = torch.matmul(qt, kt.transpose(-1, -2)).mul_(scale)
        if softcap > 0:
            s = s.div_(softcap).tanh_().mul_(softcap)
        capped = s.clone() if keep_capped and softcap > 0 else None
        if not run.full:
            rows = torch.arange(r0, r1, device=s.device)
            cols = torch.arange(run.start, run.end, device=s.device)
            hidden = ~mask.visible(rows, cols)  # (M, N), broadcast over the G heads of each group
            b, hkv, gm, n = s.shape
            s.view(b, hkv, gm // (r1 - r0), r1 - r0, n).masked_fill_(hidden, float("-inf"))
        return s, capped

    def _runs(self, plan):
        return _merge_runs(plan.visits, self.max_run)

    def fwd(self, q, k, v, mask, scale, softcap, deterministic):
        b, s, h, d = q.shape
        hkv = k.shape[2]
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = new_output(q, (b, s, h, d))
        lse = new_output(q, (b, h, s), lse_dtype(q.dtype))
        for plan in mask.fwd_tiles(self.block_m, self.block_n):
            r0, r1 = plan.start, plan.end
            qt = _group_rows(q, r0, r1, hkv, acc_dtype)
            row_max = qt.new_full((*qt.shape[:-1], 1), float("-inf"))
            row_sum = qt.new_zeros((*qt.shape[:-1], 1))
            acc = torch.zeros_like(qt)
            for run in self._runs(plan):
                p, _ = self._scores(qt, _kv_tile(k, run.start, run.end, acc_dtype), mask,
                                    r0, r1, run, scale, softcap, keep_capped=False)
                new_max = torch.maximum(row_max, p.amax(dim=-1, keepdim=True))
                safe_max = new_max.masked_fill(new_max == float("-inf"), 0.0)  # rows with no key yet
                p = p.sub_(safe_max).exp_()
                rescale = torch.exp(row_max - safe_max)
                row_sum = row_sum * rescale + p.sum(dim=-1, keepdim=True)
                acc = acc * rescale + p @ _kv_tile(v, run.start, run.end, acc_dtype)
                row_max = new_max
            out[:, r0:r1] = _ungroup_rows(acc / row_sum, r1 - r0).to(q.dtype)
            lse[:, :, r0:r1] = (row_max + torch.log(row_sum)).reshape(b, h, r1 - r0)
        return out, lse

    def bwd(self, dout, q, k, v, out, lse, dlse, mask, scale, softcap, deterministic):
        hkv = k.shape[2]
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        # d lse_i / d s_ij = P_ij, so an upstream dlse folds into delta: dS = P * (dP - (delta - dlse)).
        delta = (dout.to(acc_dtype) * out.to(acc_dtype)).sum(-1).transpose(1, 2)
        if dlse is not None:
            delta = delta - dlse.to(acc_dtype)
        lse = lse.to(acc_dtype).masked_fill(lse == float("-inf"), float("inf"))  # empty rows: P = 0
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
        for plan in mask.fwd_tiles(self.block_m, self.block_n):
            r0, r1 = plan.start, plan.end
            qt = _group_rows(q, r0, r1, hkv, acc_dtype)
            dot = _group_rows(dout, r0, r1, hkv, acc_dtype)
            lse_t, delta_t = _row_stat(lse, r0, r1, hkv), _row_stat(delta, r0, r1, hkv)
            dqt = torch.zeros_like(qt)
            for run in self._runs(plan):
                c0, c1 = run.start, run.end
                kt, vt = _kv_tile(k, c0, c1, acc_dtype), _kv_tile(v, c0, c1, acc_dtype)
                p, capped = self._scores(qt, kt, mask, r0, r1, run, scale, softcap,
                                         keep_capped=True)
                p = p.sub_(lse_t).exp_()
                dv[:, c0:c1] += (p.transpose(-1, -2) @ dot).transpose(1, 2)
                ds = torch.matmul(dot, vt.transpose(-1, -2)).sub_(delta_t).mul_(p)
                if softcap > 0:  # d(c*tanh(x/c))/dx = 1 - tanh^2
                    ds = ds.mul_(1 - (capped / softcap) ** 2)
                dqt += (ds @ kt) * scale
                dk[:, c0:c1] += ((ds.transpose(-1, -2) @ qt) * scale).transpose(1, 2)
            dq[:, r0:r1] = _ungroup_rows(dqt, r1 - r0)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def varlen_fwd(self, q, k, v, mask: VarlenMask, scale, softcap, deterministic):
        out = new_output(q, q.shape)
        lse = new_output(q, (q.shape[1], q.shape[0]), lse_dtype(q.dtype))
        for start, sample in mask.samples:
            end = start + sample.seqlen
            o, l = self.fwd(q[None, start:end], k[None, start:end], v[None, start:end],
                            sample, scale, softcap, deterministic)
            out[start:end], lse[:, start:end] = o[0], l[0]
        return out, lse

    def varlen_bwd(self, dout, q, k, v, out, lse, dlse, mask: VarlenMask, scale, softcap,
                   deterministic):
        dq, dk, dv = new_output(q, q.shape), new_output(k, k.shape), new_output(v, v.shape)
        for start, sample in mask.samples:
            end = start + sample.seqlen
            rows = slice(start, end)
            grads = self.bwd(dout[None, rows], q[None, rows], k[None, rows], v[None, rows],
                             out[None, rows], lse[None, :, rows],
                             None if dlse is None else dlse[None, :, rows],
                             sample, scale, softcap, deterministic)
            dq[rows], dk[rows], dv[rows] = (g[0] for g in grads)
        return dq, dk, dv
