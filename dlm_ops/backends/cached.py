"""Backends of the cached-block family (dlm_ops/ops/cached.py): tiled PyTorch on any device, and
the Triton kernels of templates/cached_attn.py on CUDA (on CPU only forced, under
TRITON_INTERPRET=1, for tests).

Three entry points, all on validated tensors in the public layouts:

    decode(q, k_cache, v_cache, lens, k_new, v_new, scale, want_ext)
        -> out (B, bs, H, D), lse (B, H, bs), and with want_ext the cache-only (ext_out fp32,
           ext_lse); lens None means every cache slot is valid
    block(q, k_block, v_block, cached_out, cached_lse, dirty, scale) -> out, lse
    merge(out_a, lse_a, out_b, lse_b) -> out, lse

A FlashBlock refresh (decode with want_ext) computes the cache part, then runs the reuse path
(``block``) on it: reuse on an unchanged block equals refresh bitwise, on each backend, by
construction.
"""

from __future__ import annotations

import math

import torch

from ..errors import UnsupportedConfig
from . import register
from .base import GQA, Backend, Capabilities, lse_dtype, new_output
from .torch_tiled import _group_rows, _ungroup_rows
from .triton_backend import (_IMPORT_ERROR, INTERPRET, TRITON_DEVICES, TRITON_DTYPES,
                             OutOfResources, TritonEligibility, _s)

if _IMPORT_ERROR is None:
    import triton

    from ..templates import cached_attn as kernels

_ALL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


class CachedBackend(Backend):
    family = "cached"

    def decode(self, q, k_cache, v_cache, lens, k_new, v_new, scale, want_ext):
        raise NotImplementedError

    def block(self, q, k_block, v_block, cached_out, cached_lse, dirty, scale):
        raise NotImplementedError

    def merge(self, out_a, lse_a, out_b, lse_b):
        raise NotImplementedError


# -- torch ------------------------------------------------------------------------------------


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_states(o_a, l_a, o_b, l_b):
    """Merge two normalised partials (B, Hkv, M, D) / (B, Hkv, M) in the compute dtype."""
    m = torch.maximum(l_a, l_b)
    m_use = torch.where(m == -math.inf, torch.zeros_like(m), m)
    w_a, w_b = torch.exp(l_a - m_use), torch.exp(l_b - m_use)
    tot = w_a + w_b
    seen = tot > 0
    inv = 1.0 / torch.where(seen, tot, torch.ones_like(tot))
    zero = o_a.new_zeros(())
    # A side with weight 0 is dropped, not multiplied by 0: its output may be anything (NaN).
    out = (torch.where((w_a > 0)[..., None], o_a * (w_a * inv)[..., None], zero)
           + torch.where((w_b > 0)[..., None], o_b * (w_b * inv)[..., None], zero))
    lse = torch.where(seen, m_use + torch.log(torch.where(seen, tot, torch.ones_like(tot))),
                      torch.full_like(tot, -math.inf))
    return out, lse


def _attend(qg, k, v, valid, scale):
    """qg (B, Hkv, M, D) over k, v (B, Hkv, N, D), keys where ``valid`` (B, 1, 1, N) or all:
    normalised output and natural LSE, (0, -inf) for rows that see nothing."""
    s = (qg @ k.transpose(-1, -2)) * scale
    if valid is not None:
        s = s.masked_fill(~valid, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(lse == -math.inf, torch.zeros_like(lse), lse)[..., None])
    return p @ v, lse


def _to_rows(t, hkv):
    """(B, H, bs) -> (B, Hkv, G*bs), matching ``_group_rows``."""
    return t.reshape(t.shape[0], hkv, -1)


class TorchCachedBackend(CachedBackend):
    name = "torch"
    priority = 0
    capabilities = Capabilities(device_types=None, dtypes=_ALL_DTYPES, max_head_dim=256,
                                head_dim_multiple=1, features=frozenset({GQA}))
    CHUNK = 4096  # cache keys per matmul: (B, Hkv, M, CHUNK) scores bound the temporary memory

    def decode(self, q, k_cache, v_cache, lens, k_new, v_new, scale, want_ext):
        b, bs, h, d = q.shape
        smax, hkv = k_cache.shape[1], k_cache.shape[2]
        cd = _compute_dtype(q.dtype)
        qg = _group_rows(q, 0, bs, hkv, cd)
        o = qg.new_zeros(qg.shape)
        l = qg.new_full(qg.shape[:-1], -math.inf)
        for c0 in range(0, smax, self.CHUNK):
            c1 = min(c0 + self.CHUNK, smax)
            valid = None
            if lens is not None:
                valid = (torch.arange(c0, c1, device=q.device) < lens[:, None])[:, None, None, :]
            part = _attend(qg, k_cache[:, c0:c1].to(cd).transpose(1, 2),
                           v_cache[:, c0:c1].to(cd).transpose(1, 2), valid, scale)
            o, l = merge_states(o, l, *part)
        if want_ext:  # FlashBlock refresh: the cache part, then the reuse path on it
            lt = lse_dtype(q.dtype)
            ext_out = new_output(q, q.shape, lt).copy_(_ungroup_rows(o, bs))
            ext_lse = new_output(q, (b, h, bs), lt).copy_(l.reshape(b, h, bs))
            return (*self.block(q, k_new, v_new, ext_out, ext_lse, None, scale), ext_out, ext_lse)
        if k_new is not None:
            new = _attend(qg, k_new.to(cd).transpose(1, 2), v_new.to(cd).transpose(1, 2), None,
                          scale)
            o, l = merge_states(o, l, *new)
        return (*self._write(q, o, l, bs), None, None)

    def block(self, q, k_block, v_block, cached_out, cached_lse, dirty, scale):
        b, bs, h, d = q.shape
        hkv = k_block.shape[2]
        cd = _compute_dtype(q.dtype)
        qg = _group_rows(q, 0, bs, hkv, cd)
        new = _attend(qg, k_block.to(cd).transpose(1, 2), v_block.to(cd).transpose(1, 2), None,
                      scale)
        l_c = _to_rows(cached_lse, hkv).to(cd)
        if dirty is not None:  # (B, bs) -> rows (B, 1, G*bs) in _group_rows order (g, token)
            rows = dirty[:, None, :].expand(b, h // hkv, bs).reshape(b, 1, -1)
            l_c = l_c.masked_fill(rows, -math.inf)
        o, l = merge_states(_group_rows(cached_out, 0, bs, hkv, cd), l_c, *new)
        return self._write(q, o, l, bs)

    def merge(self, out_a, lse_a, out_b, lse_b):
        cd = _compute_dtype(out_a.dtype)
        t = lambda x: x.transpose(1, 2).to(cd)  # (B, S, H, D) -> (B, H, S, D)
        o, l = merge_states(t(out_a), lse_a.to(cd), t(out_b), lse_b.to(cd))
        out = new_output(out_a, out_a.shape)
        lse = new_output(lse_a, lse_a.shape, lse_a.dtype)
        out.copy_(o.transpose(1, 2))
        lse.copy_(l)
        return out, lse

    @staticmethod
    def _write(q, o, l, bs):
        b, _, h, d = q.shape
        out = new_output(q, q.shape)
        lse = new_output(q, (b, h, bs), lse_dtype(q.dtype))
        out.copy_(_ungroup_rows(o, bs))
        lse.copy_(l.reshape(b, h, bs))
        return out, lse


# -- triton -----------------------------------------------------------------------------------

LOG2E = 1.4426950408889634


def tiles(m: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for M = G*bs packed rows, for every kernel of the
    family. Decode is bound by reading K/V, and every row tile of a (batch, kv head) reads all
    of it, so BLOCK_M covers M in one tile up to 128 (bs 32 x G 4, 8 warps: a 128x128 fp32
    accumulator is 64 registers per thread); 16 is tl.dot's minimum. Shared memory, compiled for
    sm90 (228 KB): bf16 at D=128 takes 98 KB (BLOCK_M 128) and 22 KB (16); fp32 at BLOCK_N 64
    took 270-330 KB, so fp32 (tests, and the rare fp32 user) runs 64x32 tiles with 2 stages. At
    D=256 the accumulator and K tiles double: BLOCK_M stops at 64 and BLOCK_N drops to 32."""
    wide = dtype == torch.float32 or head_dim > 128
    block_m = min(64 if wide else 128, max(16, triton.next_power_of_2(max(m, 1))))
    block_n = 32 if wide else 64
    if INTERPRET:  # numpy per program: small tiles keep the interpreter fast
        block_m, block_n = min(block_m, 32), 16
    return block_m, block_n, 8 if block_m == 128 else 4, 2 if wide else 3


def smaller(cfg: tuple[int, int, int, int]) -> tuple[int, int, int, int] | None:
    """The next config to try when ``cfg`` does not fit a GPU's shared memory (sm86 / sm89 hold
    ~100 KB per block against sm90's 228 KB, for which ``tiles`` is sized; sm75 64 KB): fewer
    stages first (same tiles), then half as many keys per step, then half as many rows; None
    below (16, 16, 1 stage)."""
    block_m, block_n, warps, stages = cfg
    if stages > 1:
        return block_m, block_n, warps, stages - 1
    if block_n > 16:
        return block_m, block_n // 2, warps, 2
    if block_m > 16:
        return block_m // 2, block_n, 4, 2
    return None


_FITTING: dict = {}  # (kernel, head dim, dtype, device, first config) -> the config that fits


def launch_fitting(kernel: str, q: torch.Tensor, first: tuple, launch) -> None:
    """``launch(config)`` with ``first`` or, where the GPU cannot hold it (Triton raises
    OutOfResources at launch, before anything runs), the first ``smaller`` config that fits;
    remembered per kernel, head dim, dtype, device and first config."""
    key = (kernel, q.shape[-1], q.dtype, str(q.device), first)
    cfg = _FITTING.get(key, first)
    while cfg is not None:
        try:
            launch(cfg)
        except OutOfResources:
            cfg = smaller(cfg)
            continue
        _FITTING[key] = cfg
        return
    raise UnsupportedConfig(f"no tile config of the {kernel} kernel fits this GPU's shared memory "
                            f"(head_dim {q.shape[-1]}, {q.dtype})")


def num_splits(programs: int, smax: int, sm_count: int, min_keys: int = 512,
               max_splits: int = 64) -> int:
    """Cache splits per (batch, kv head, row tile). ``programs`` = B * Hkv * row tiles: with
    B * Hkv = 1024 (B=128, Hkv=8) one wave already covers the H200's 132 SMs, so the cache is not
    split (each split costs a partial write and a combine read). With B * Hkv = 8 (B=1) a 64K
    cache would run on 8 SMs; splitting it into ~2 waves of programs (2 * 132 / 8 = 33 splits
    of ~2K keys) fills the GPU, and 2 waves rather than 1 evens out samples of unequal length.
    A split keeps >= ``min_keys`` keys: below that its fixed cost (the q tile load, the
    partial write, the combine's read of M*D fp32) rivals its attention work."""
    if programs <= 0 or programs >= sm_count:
        return 1
    want = -(-2 * sm_count // programs)
    return max(1, min(want, smax // min_keys, max_splits))


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a pretend GPU of 4 SMs so that tests split small caches
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _contig(t):
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


class TritonCachedBackend(TritonEligibility, CachedBackend):
    name = "triton"
    capabilities = Capabilities(
        device_types=TRITON_DEVICES,
        dtypes=TRITON_DTYPES,
        max_head_dim=256, head_dim_multiple=8, features=frozenset({GQA}))

    def __init__(self, splits: int | None = None, min_keys: int | None = None):
        self._splits = splits  # forced by tests; None chooses with num_splits
        self._min_keys = min_keys if min_keys is not None else (16 if INTERPRET else 512)

    @staticmethod
    def _flags(q):
        d = q.shape[-1]
        return dict(D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), IEEE=q.dtype == torch.float32)

    def decode(self, q, k_cache, v_cache, lens, k_new, v_new, scale, want_ext):
        if want_ext:  # FlashBlock refresh: the cache part, then the reuse kernel on it
            ext_out = new_output(q, q.shape, torch.float32)
            ext_lse = new_output(q, (q.shape[0], q.shape[2], q.shape[1]), torch.float32)
            self._decode(q, k_cache, v_cache, lens, None, None, scale, ext_out, ext_lse)
            out, lse = self.block(q, k_new, v_new, ext_out, ext_lse, None, scale)
            return out, lse, ext_out, ext_lse
        out = new_output(q, q.shape)
        lse = new_output(q, (q.shape[0], q.shape[2], q.shape[1]), torch.float32)
        self._decode(q, k_cache, v_cache, lens, k_new, v_new, scale, out, lse)
        return out, lse, None, None

    def _decode(self, q, k_cache, v_cache, lens, k_new, v_new, scale, out, lse):
        """Split-KV attention of q over the cache (and k_new), written into out / lse."""
        q, k_cache, v_cache, k_new, v_new = map(_contig, (q, k_cache, v_cache, k_new, v_new))
        b, bs, h, d = q.shape
        hkv = k_cache.shape[2]
        m = (h // hkv) * bs
        if b * hkv * m == 0:
            return
        launch_fitting("decode", q, tiles(m, d, q.dtype), lambda cfg: self._decode_with(
            cfg, q, k_cache, v_cache, lens, k_new, v_new, scale, out, lse))

    def _decode_with(self, cfg, q, k_cache, v_cache, lens, k_new, v_new, scale, out, lse):
        b, bs, h, d = q.shape
        smax, hkv = k_cache.shape[1], k_cache.shape[2]
        g, m = h // hkv, (h // hkv) * bs
        block_m, block_n, warps, stages = cfg
        m_tiles = triton.cdiv(m, block_m)
        splits = self._splits or num_splits(b * hkv * m_tiles, smax, _sm_count(q.device),
                                            self._min_keys)
        has_new = k_new is not None
        kn, vn = (k_new, v_new) if has_new else (k_cache, v_cache)
        flags = self._flags(q)
        lens_arg = lens.contiguous() if lens is not None else lse  # placeholder when None
        if splits == 1:  # one program per row tile reads its whole cache: no partials
            kernels.decode_fused_kernel[(m_tiles, b * hkv)](
                q, k_cache, v_cache, kn, vn, lens_arg, out, lse,
                *_s(q), *_s(k_cache), *_s(v_cache), *_s(kn), *_s(vn), *_s(out),
                lse.stride(0), lse.stride(1), hkv, g, m, smax, bs, scale * LOG2E,
                HAS_NEW=has_new, HAS_LENS=lens is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                num_warps=warps, num_stages=stages, **flags)
            return
        po = torch.empty((b * hkv, splits + 1, m, d), dtype=torch.float32, device=q.device)
        pl = torch.empty((b * hkv, splits + 1, m), dtype=torch.float32, device=q.device)
        kernels.decode_partial_kernel[(splits + has_new, m_tiles, b * hkv)](
            q, k_cache, v_cache, kn, vn, lens_arg, po, pl,
            *_s(q), *_s(k_cache), *_s(v_cache), *_s(kn), *_s(vn),
            hkv, g, m, smax, bs, scale * LOG2E,
            NSPLIT=splits, HAS_LENS=lens is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=warps, num_stages=stages, **flags)
        kernels.decode_combine_kernel[(m_tiles, b * hkv)](
            po, pl, out, lse, *_s(out), lse.stride(0), lse.stride(1), hkv, g, m,
            NSPLIT=splits, HAS_NEW=has_new, D=d, BLOCK_M=block_m, BLOCK_D=flags["BLOCK_D"],
            num_warps=warps)

    def block(self, q, k_block, v_block, cached_out, cached_lse, dirty, scale):
        q, k_block, v_block, cached_out = map(_contig, (q, k_block, v_block, cached_out))
        b, bs, h, d = q.shape
        hkv = k_block.shape[2]
        g, m = h // hkv, (h // hkv) * bs
        out = new_output(q, q.shape)
        lse = new_output(q, (b, h, bs), torch.float32)
        if b * hkv * m == 0:
            return out, lse
        cl = cached_lse.float().contiguous()
        dirty_u8 = dirty.to(torch.uint8) if dirty is not None else None
        dptr = dirty_u8 if dirty is not None else cl
        dstr = (dirty_u8.stride(0), dirty_u8.stride(1)) if dirty is not None else (0, 0)

        def launch(cfg):
            block_m, block_n, warps, stages = cfg
            kernels.flashblock_kernel[(triton.cdiv(m, block_m), b * hkv)](
                q, k_block, v_block, cached_out, cl, dptr, out, lse,
                *_s(q), *_s(k_block), *_s(v_block), *_s(cached_out), *dstr,
                lse.stride(0), lse.stride(1), *_s(out), cl.stride(0), cl.stride(1),
                hkv, g, m, bs, scale * LOG2E,
                HAS_DIRTY=dirty is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                num_stages=stages, **self._flags(q))

        launch_fitting("flashblock", q, tiles(m, d, q.dtype), launch)
        return out, lse

    def merge(self, out_a, lse_a, out_b, lse_b):
        out_a, out_b, lse_a, lse_b = map(_contig, (out_a, out_b, lse_a, lse_b))
        b, s, h, d = out_a.shape
        out = new_output(out_a, out_a.shape)
        lse = new_output(lse_a, lse_a.shape, torch.float32)
        if b * s * h == 0:
            return out, lse
        block_s = 32
        kernels.merge_kernel[(triton.cdiv(s, block_s), b * h)](
            out_a, lse_a, out_b, lse_b, out, lse, *_s(out_a), *_s(out_b), *_s(out),
            lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
            lse.stride(0), lse.stride(1), s, h, D=d, BLOCK_S=block_s,
            BLOCK_D=max(16, triton.next_power_of_2(d)))
        return out, lse


for _b in (TritonCachedBackend(), TorchCachedBackend()):
    register(_b)
