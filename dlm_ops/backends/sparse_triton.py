"""The Triton backend of the sparse family: the kernels of templates/sparse_attn.py on CUDA (on
CPU only forced, under TRITON_INTERPRET=1, as for the block-diffusion family). The index plumbing
it shares with the torch backend (transposed block index, GQA group sums) is in sparse.py.
"""

from __future__ import annotations

import torch

from . import register
from .base import GQA, Capabilities, new_output
from .sparse import MAX_TILE, SparseBackend, scatter_group_sum, transpose_block_index
from .triton_backend import (_IMPORT_ERROR, INTERPRET, TRITON_DEVICES, TRITON_DTYPES, OutOfResources,
                             TritonEligibility, _last_dim_contiguous)

if _IMPORT_ERROR is None:
    import triton

    from ..templates import diffusion_attn as dense_kernels
    from ..templates import sparse_attn as kernels


def _s(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _longest_first(counts: torch.Tensor) -> torch.Tensor:
    """int32 (B, H, nQb): each head's query blocks by decreasing count (stable: deterministic).
    The grid runs a head's tiles in this order, so the longest lists start in the first wave
    (one small argsort per call, no sync)."""
    return torch.argsort(counts, dim=-1, descending=True, stable=True).to(torch.int32).contiguous()


class TritonSparseBackend(TritonEligibility, SparseBackend):
    name = "triton"
    capabilities = Capabilities(
        device_types=TRITON_DEVICES,
        dtypes=TRITON_DTYPES,
        max_head_dim=256, head_dim_multiple=8, features=frozenset({GQA}))

    def __init__(self, tile: tuple[int, int] | None = None):
        self._tile = tile  # (BLOCK_M, BLOCK_N) forced by tests; None picks per role and head dim
        self._chosen: dict[tuple, tuple[int, int, int, int]] = {}

    def _candidates(self, role: str, d: int, bm_cap: int, bn_cap: int):
        """(BLOCK_M, BLOCK_N, warps, stages), best guess first, capped at bm_cap, bn_cap (block
        sizes, powers of two, so a capped tile still divides its block; a capped tile gets at
        most 4 warps). dkdv: BLOCK_M query rows visited, BLOCK_N keys owned.

        Not timed on a GPU yet. Chosen by compiling for sm90 (Triton 3.9, strides divisible by
        16 as the launcher specialises them) and reading the cubin's resource usage: every first
        choice pipelines K/V (cp.async, 2-3 stages), feeds wgmma and spills nothing; e.g. D=128
        forward 128x64 / 8 warps: 180 registers, 128 KiB shared. The dK/dV kernel spills at
        64x64 / 4 warps (255 registers + 56 B stack; the block-diffusion kernels' choice) but not
        with 8 warps (220), and at D=256 only 32x32 / 8 warps stays spill-free."""
        if self._tile:
            return [(min(self._tile[0], bm_cap), min(self._tile[1], bn_cap), 4, 1)]
        if INTERPRET:
            return [(min(32, bm_cap), min(32, bn_cap), 4, 1)]
        big = d > 128
        table = {
            "fwd": [(64, 64, 8, 2), (64, 32, 8, 2)] if big else [(128, 64, 8, 3), (64, 64, 4, 3)],
            "dq": [(64, 32, 8, 2)] if big else [(128, 32, 8, 3), (64, 32, 4, 3)],
            "dkdv": [(32, 32, 8, 2)] if big else [(64, 64, 8, 2), (32, 64, 4, 2)],
        }[role.removeprefix("column ")] + [(32, 32, 4, 2), (16, 16, 4, 1)]
        out = []
        for m, n, w, st in table:
            mc, nc = min(m, bm_cap), min(n, bn_cap)
            out.append((mc, nc, w if (mc, nc) == (m, n) else min(w, 4), st))
        return out

    def _run(self, role, q, bm_cap, bn_cap, launch):
        """Launch with the first candidate this GPU can hold (remembered per role, shape class)."""
        key = (role, q.shape[-1], q.dtype, str(q.device), bm_cap, bn_cap)
        if key in self._chosen:
            return launch(*self._chosen[key])
        for cfg in self._candidates(role, q.shape[-1], bm_cap, bn_cap):
            try:
                launch(*cfg)
            except OutOfResources:
                continue
            self._chosen[key] = cfg
            return
        raise RuntimeError(f"no Triton tile config for sparse {role} at head_dim {q.shape[-1]} fits")

    @staticmethod
    def _flags(q):
        d = q.shape[-1]
        return dict(D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), IEEE=q.dtype == torch.float32)

    def _delta(self, out, dout, lse, dlse):
        b, s, h, d = out.shape
        delta = torch.empty((b, h, s), dtype=torch.float32, device=out.device)
        if b * h * s:
            dense_kernels.bwd_delta_kernel[(b * h, triton.cdiv(s, 64))](
                out, dout, lse if dlse is None else dlse, delta, *_s(out), *_s(dout), s, h,
                D=d, BLOCK_M=64, BLOCK_D=self._flags(out)["BLOCK_D"], HAS_DLSE=dlse is not None)
        return delta

    # -- block-sparse ---------------------------------------------------------------------------

    def block_fwd(self, q, k, v, idx, counts, bsq, bsk, scale):
        q, k, v = _last_dim_contiguous(q, k, v)
        idx, counts = idx.contiguous(), counts.contiguous()
        b, sq, h, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        nqb, m = idx.shape[2], idx.shape[3]
        out = new_output(q, q.shape)
        lse = new_output(q, (b, h, sq), torch.float32)
        order = _longest_first(counts)

        def launch(bm, bn, warps, stages):
            if b * h * nqb:
                kernels.block_sparse_fwd_kernel[(b * h, nqb * (bsq // bm))](
                    q, k, v, out, lse, idx, counts, order, *_s(q), *_s(k), *_s(v), *_s(out),
                    h, h // hkv, sq, sk, nqb, m, scale, BSQ=bsq, BSK=bsk, BLOCK_M=bm, BLOCK_N=bn,
                    num_warps=warps, num_stages=stages, **self._flags(q))

        self._run("fwd", q, bsq, MAX_TILE, launch)  # BLOCK_N > bsk: gathered key tiles
        return out, lse

    def block_bwd(self, dout, q, k, v, out, lse, dlse, idx, counts, bsq, bsk, scale):
        dout, q, k, v, out = _last_dim_contiguous(dout, q, k, v, out)
        idx, counts = idx.contiguous(), counts.contiguous()
        b, sq, h, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        nqb, m, nkb = idx.shape[2], idx.shape[3], -(-sk // bsk)
        lse = lse.float().contiguous()
        dlse = None if dlse is None else dlse.float().contiguous()
        delta = self._delta(out, dout, lse, dlse)
        dq, dk, dv = new_output(q, q.shape), new_output(k, k.shape), new_output(v, v.shape)
        rev_off, rev_q = transpose_block_index(idx, counts, nkb)
        order = _longest_first(counts)
        flags = self._flags(q)

        def launch_dq(bm, bn, warps, stages):
            if b * h * nqb:
                kernels.block_sparse_dq_kernel[(b * h, nqb * (bsq // bm))](
                    q, k, v, dout, lse, delta, dq, idx, counts, order, *_s(q), *_s(k), *_s(v),
                    *_s(dout), *_s(dq), h, h // hkv, sq, sk, nqb, m, scale, BSQ=bsq, BSK=bsk,
                    BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **flags)

        def launch_dkdv(bm, bn, warps, stages):  # bn keys owned, bm query rows visited
            if b * hkv * nkb:
                kernels.block_sparse_dkdv_kernel[(b * hkv, nkb * (bsk // bn))](
                    q, k, v, dout, lse, delta, dk, dv, rev_off, rev_q, *_s(q), *_s(k), *_s(v),
                    *_s(dout), *_s(dk), *_s(dv), h, hkv, h // hkv, sq, sk, nkb, scale, BSQ=bsq,
                    BSK=bsk, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **flags)

        self._run("dq", q, bsq, MAX_TILE, launch_dq)
        self._run("dkdv", q, bsq, bsk, launch_dkdv)
        return dq, dk, dv

    # -- column-sparse --------------------------------------------------------------------------

    def column_fwd(self, q, k, v, idx, counts, scale):
        q, k, v = _last_dim_contiguous(q, k, v)
        idx, counts = idx.contiguous(), counts.contiguous()
        b, sq, h, d = q.shape
        m = idx.shape[2]
        out = new_output(q, q.shape)
        lse = new_output(q, (b, h, sq), torch.float32)

        def launch(bm, bn, warps, stages):
            if b * h * sq:
                kernels.column_sparse_fwd_kernel[(b * h, triton.cdiv(sq, bm))](
                    q, k, v, out, lse, idx, counts, *_s(q), *_s(k), *_s(v), *_s(out),
                    h, h // k.shape[2], sq, m, scale, BLOCK_M=bm, BLOCK_N=bn,
                    num_warps=warps, num_stages=stages, **self._flags(q))

        self._run("column fwd", q, 128, 128, launch)
        return out, lse

    def column_bwd(self, dout, q, k, v, out, lse, dlse, idx, counts, scale):
        dout, q, k, v, out = _last_dim_contiguous(dout, q, k, v, out)
        idx, counts = idx.contiguous(), counts.contiguous()
        b, sq, h, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        m = idx.shape[2]
        lse = lse.float().contiguous()
        dlse = None if dlse is None else dlse.float().contiguous()
        delta = self._delta(out, dout, lse, dlse)
        dq = new_output(q, q.shape)
        # Compact per-query-head gradients of the listed keys; slots past a count stay unwritten
        # and scatter_group_sum drops them.
        dkp = torch.empty((b, h, m, d), dtype=torch.float32, device=q.device)
        dvp = torch.empty_like(dkp)
        flags = self._flags(q)

        def launch_dq(bm, bn, warps, stages):
            if b * h * sq:
                kernels.column_sparse_dq_kernel[(b * h, triton.cdiv(sq, bm))](
                    q, k, v, dout, lse, delta, dq, idx, counts, *_s(q), *_s(k), *_s(v),
                    *_s(dout), *_s(dq), h, h // hkv, sq, m, scale, BLOCK_M=bm, BLOCK_N=bn,
                    num_warps=warps, num_stages=stages, **flags)

        def launch_dkdv(bm, bn, warps, stages):
            if b * h * m:
                kernels.column_sparse_dkdv_kernel[(b * h, triton.cdiv(m, bn))](
                    q, k, v, dout, lse, delta, dkp, dvp, idx, counts, *_s(q), *_s(k), *_s(v),
                    *_s(dout), h, h // hkv, sq, m, scale, BLOCK_M=bm, BLOCK_N=bn,
                    num_warps=warps, num_stages=stages, **flags)

        self._run("column dq", q, 128, 128, launch_dq)
        self._run("column dkdv", q, 128, 128, launch_dkdv)
        dk, dv = new_output(k, k.shape), new_output(v, v.shape)
        dk.copy_(scatter_group_sum(dkp, idx, counts, sk, hkv))
        dv.copy_(scatter_group_sum(dvp, idx, counts, sk, hkv))
        return dq, dk, dv


register(TritonSparseBackend())
