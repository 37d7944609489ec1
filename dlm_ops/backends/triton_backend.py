"""The Triton backend: block-diffusion kernels for every CUDA GPU (templates/diffusion_attn.py).

Tile tables are built here from ``dlm_ops.geometry`` once per (mask, tile shape, device) and
cached. With ``TRITON_INTERPRET=1`` in the environment (before triton is imported) the same kernels
run on CPU tensors through Triton's interpreter: that is how CI, which has no GPU, tests them. The
interpreter is far too slow to be chosen automatically, so on CPU the backend runs only when forced
with ``backend="triton"``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..errors import UnsupportedConfig
from ..geometry import SequenceMask, VarlenMask, most_expensive_first
from .base import DETERMINISTIC, GQA, SOFTCAP, VARLEN, Capabilities, DiffusionBackend, new_output

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

try:
    import triton
    import triton.testing
    from triton.runtime.errors import OutOfResources

    from ..templates import diffusion_attn as kernels

    _IMPORT_ERROR = None
except Exception as e:  # triton missing or broken: the backend reports why and stays out of the way
    triton = kernels = None
    OutOfResources = RuntimeError  # never raised: the backend reports itself unavailable
    _IMPORT_ERROR = f"triton unavailable ({type(e).__name__}: {e})"


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # the tile the program owns (queries; keys for dK/dV)
    block_n: int  # the tiles it visits
    num_warps: int = 4
    num_stages: int = 2


_T = TileConfig
# Candidate tiles per kernel role, best first as measured on the H200 by
# ``python -m benchmarks.tune_tiles`` (bf16, bs=16, n=1K and 4K; log in
# benchmarks/results/tune_tiles_h200.log): 64x64 / 4 warps won the forward at every head dim
# (128x128 / 8 warps tied at n=4K and lost 13% at 1K); backward candidates were within 3% of each
# other at D<=128. Later entries need less shared memory (fewer stages, smaller tiles): a GPU whose
# shared memory cannot hold a config (sm86/sm89 have 100 KB, sm80 164 KB, sm90 228 KB) raises
# OutOfResources at launch and the next candidate is taken, so every CUDA GPU gets a config that
# fits. DLM_OPS_AUTOTUNE=1 times every fitting candidate per shape class instead.
_SMALL = [_T(32, 32, 4, 2), _T(32, 16, 4, 2), _T(16, 16, 4, 1)]
_CANDIDATES = {
    ("fwd", 128): [_T(64, 64, 4, 3), _T(128, 128, 8, 3), _T(128, 64, 8, 3), _T(64, 64, 4, 2)],
    ("fwd", 256): [_T(64, 64, 4, 3), _T(64, 32, 4, 3), _T(64, 32, 4, 2)],
    ("dkdv", 128): [_T(64, 64, 4, 2), _T(128, 64, 8, 2), _T(64, 32, 4, 3), _T(64, 32, 4, 2)],
    ("dkdv", 256): [_T(64, 64, 4, 2), _T(64, 32, 4, 3), _T(64, 32, 4, 2)],
    ("dq", 64): [_T(64, 32, 4, 3), _T(64, 64, 4, 2), _T(64, 32, 4, 2)],
    ("dq", 128): [_T(128, 32, 4, 3), _T(128, 64, 8, 3), _T(64, 32, 4, 3), _T(64, 32, 4, 2)],
    ("dq", 256): [_T(128, 32, 8, 2), _T(64, 32, 4, 3), _T(64, 32, 4, 2)],
}
ROLES = ("fwd", "dkdv", "dq")
AUTOTUNE = os.environ.get("DLM_OPS_AUTOTUNE") == "1"


def candidates(role: str, head_dim: int) -> list[TileConfig]:
    """Tile configs to try for ``role`` at ``head_dim``, best first (see _CANDIDATES)."""
    if INTERPRET:  # numpy per program: fewer, mid-sized programs run fastest
        return [_T(32, 32)]
    dims = sorted(d for r, d in _CANDIDATES if r == role)
    d = next((x for x in dims if head_dim <= x), dims[-1])
    return _CANDIDATES[(role, d)] + _SMALL


_CHOSEN: dict[tuple, TileConfig] = {}  # (role, head_dim, dtype, device[, shape class]) -> config


@lru_cache(maxsize=128)
def tile_tables(masks: tuple[tuple[int, SequenceMask], ...], own: int, other: int, transpose: bool,
                device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 TILES (T, 8) and VISITS (V, 4) for ``masks`` ((offset, mask) per sample), most
    expensive tile first (see the notation in templates/diffusion_attn.py)."""
    rows, visits = [], []
    for off, mask in masks:
        plans = mask.bwd_tiles(other, own) if transpose else mask.fwd_tiles(own, other)
        for plan in plans:
            begin = len(visits)
            for v in plan.visits:
                full = int(v.full and v.end - v.start == other)  # full width: no element mask
                visits.append((off + v.start, off + v.end, full, 0))
            rows.append((plan.area, (off + plan.start, off + plan.end, off, mask.n_noisy,
                                     mask.n_clean, begin, len(visits), 0)))
    rows = [rows[i][1] for i in most_expensive_first([area for area, _ in rows])]
    tiles = torch.tensor(rows or [[0] * 8], dtype=torch.int32)
    visits_t = torch.tensor(visits or [[0] * 4], dtype=torch.int32)
    return tiles[: len(rows)].to(device), visits_t.to(device)


def _last_dim_contiguous(*ts):
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def _s(t):
    """(batch, seq, head) strides of a (B, S, H, D) tensor."""
    return t.stride(0), t.stride(1), t.stride(2)


TRITON_DEVICES = frozenset({"cuda", "cpu"} if INTERPRET else {"cuda"})
TRITON_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})


class TritonEligibility:
    """What every Triton backend refuses, whatever its family: CPU tensors unless the interpreter
    is on (and then only when forced: ``auto_device_types``), GPUs older than sm75, bf16 before
    sm80. Mixed in before the family's Backend class."""

    priority = 10
    auto_device_types = frozenset({"cuda"})

    def unavailable_reason(self) -> str | None:
        return _IMPORT_ERROR

    def not_supported_reasons(self, problem):
        reasons = super().not_supported_reasons(problem)
        if problem.device_type == "cpu" and not INTERPRET:
            reasons.append("TRITON_INTERPRET=1 runs the kernels on CPU, slowly, for tests")
        if problem.device_type == "cuda" and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            if (major, minor) < (7, 5):
                reasons.append(f"Triton needs compute capability >= 7.5, this GPU has {major}.{minor}")
            elif problem.dtype == torch.bfloat16 and major < 8:
                reasons.append(f"bfloat16 needs compute capability >= 8.0, this GPU has {major}.{minor}")
        return reasons


class TritonBackend(TritonEligibility, DiffusionBackend):
    name = "triton"
    capabilities = Capabilities(
        device_types=TRITON_DEVICES,
        dtypes=TRITON_DTYPES,
        max_head_dim=256,
        head_dim_multiple=8,
        features=frozenset({SOFTCAP, GQA, VARLEN, DETERMINISTIC}),
    )

    def __init__(self, configs=None):
        self._configs = configs  # (fwd, dkdv, dq) forced by tests; None picks per GPU and head dim

    def _run(self, role: str, q: torch.Tensor, seqlen: int, launch) -> None:
        """Call ``launch(config)`` with the config for ``role``: the first candidate that fits this
        GPU (remembered), or with DLM_OPS_AUTOTUNE=1 the fastest per power-of-two seqlen class."""
        if self._configs:
            return launch(self._configs[ROLES.index(role)])
        d = q.shape[-1]
        key = (role, d, q.dtype, str(q.device)) + ((triton.next_power_of_2(seqlen),) if AUTOTUNE else ())
        if key in _CHOSEN:
            return launch(_CHOSEN[key])
        fitting = []
        for cfg in candidates(role, d):
            try:
                launch(cfg)  # compiles, then raises before running if the GPU cannot hold it
            except OutOfResources:
                continue
            if not AUTOTUNE or q.device.type != "cuda":
                _CHOSEN[key] = cfg
                return
            fitting.append(cfg)
        if not fitting:
            raise UnsupportedConfig(f"no Triton tile config for {role} at head_dim {d} fits this GPU")
        # Every launch rewrites the same outputs from the same inputs, so timing in place is safe.
        times = [(triton.testing.do_bench(lambda c=c: launch(c), return_mode="median"), i)
                 for i, c in enumerate(fitting)]
        _CHOSEN[key] = fitting[min(times)[1]]

    @staticmethod
    def _flags(q, softcap):
        d = q.shape[-1]
        return dict(D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), SOFTCAP=softcap > 0,
                    IEEE=q.dtype == torch.float32)

    def _fwd(self, q, k, v, masks, scale, softcap, out=None):
        """``out``: a preallocated (B, S, H, D) view to write (any strides, last dim contiguous)."""
        q, k, v = _last_dim_contiguous(q, k, v)
        b, s, h, d = q.shape
        hkv = k.shape[2]
        out = new_output(q, (b, s, h, d)) if out is None else out
        lse = new_output(q, (b, h, s), torch.float32)
        bs = masks[0][1].block_size if masks else 1

        def launch(cfg):
            tiles, visits = tile_tables(masks, cfg.block_m, cfg.block_n, False, str(q.device))
            if len(tiles) and b * h:
                kernels.diffusion_fwd_kernel[(b * h, len(tiles))](
                    q, k, v, out, lse, tiles, visits, *_s(q), *_s(k), *_s(v), *_s(out),
                    lse.stride(0), lse.stride(1), h, h // hkv, bs, scale, softcap,
                    BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages, **self._flags(q, softcap))

        self._run("fwd", q, s, launch)
        return out, lse

    def _bwd(self, dout, q, k, v, out, lse, dlse, masks, scale, softcap, grads=None):
        """``grads``: preallocated (dq, dk, dv) views to write, like ``_fwd``'s ``out``. Always
        bitwise deterministic (templates/diffusion_attn.py says why there is no atomic variant)."""
        dout, q, k, v, out = _last_dim_contiguous(dout, q, k, v, out)
        b, s, h, d = q.shape
        hkv = k.shape[2]
        flags = self._flags(q, softcap)
        # delta_i = sum_d dO * O (FlashAttention); an upstream dlse folds in: dS = P (dP - delta + dlse).
        lse = lse.float().contiguous()
        dlse = None if dlse is None else dlse.float().contiguous()
        delta = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
        if b * h * s:
            kernels.bwd_delta_kernel[(b * h, triton.cdiv(s, 64))](
                out, dout, lse if dlse is None else dlse, delta, *_s(out), *_s(dout), s, h,
                D=d, BLOCK_M=64, BLOCK_D=flags["BLOCK_D"], HAS_DLSE=dlse is not None)
        dq, dk, dv = grads or (new_output(q, q.shape), new_output(k, k.shape), new_output(v, v.shape))
        bs = masks[0][1].block_size if masks else 1
        dev = str(q.device)

        def launch_dkdv(cfg):  # cfg.block_m keys owned, cfg.block_n queries visited
            tiles, visits = tile_tables(masks, cfg.block_m, cfg.block_n, True, dev)
            if len(tiles) and b * hkv:
                kernels.diffusion_bwd_dkdv_kernel[(b * hkv, len(tiles))](
                    q, k, v, dout, lse, delta, dk, dv, tiles, visits, *_s(q), *_s(k), *_s(v),
                    *_s(dout), *_s(dk), *_s(dv), lse.stride(0), lse.stride(1), hkv, h // hkv, bs,
                    scale, softcap, BLOCK_M=cfg.block_n, BLOCK_N=cfg.block_m,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)

        def launch_dq(cfg):
            tiles, visits = tile_tables(masks, cfg.block_m, cfg.block_n, False, dev)
            if len(tiles) and b * h:
                kernels.diffusion_bwd_dq_kernel[(b * h, len(tiles))](
                    q, k, v, dout, lse, delta, dq, tiles, visits, *_s(q), *_s(k), *_s(v),
                    *_s(dout), *_s(dq), lse.stride(0), lse.stride(1), h, h // hkv, bs, scale,
                    softcap, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)

        self._run("dkdv", q, s, launch_dkdv)
        self._run("dq", q, s, launch_dq)
        return dq, dk, dv

    # -- the four entry points ------------------------------------------------------------------

    def fwd(self, q, k, v, mask: SequenceMask, scale, softcap, deterministic):
        return self._fwd(q, k, v, ((0, mask),), scale, softcap)

    def bwd(self, dout, q, k, v, out, lse, dlse, mask: SequenceMask, scale, softcap, deterministic):
        return self._bwd(dout, q, k, v, out, lse, dlse, ((0, mask),), scale, softcap)

    def varlen_fwd(self, q, k, v, mask: VarlenMask, scale, softcap, deterministic):
        out, lse = self._fwd(q[None], k[None], v[None], tuple(mask.samples), scale, softcap)
        return out[0], lse[0]

    def varlen_bwd(self, dout, q, k, v, out, lse, dlse, mask: VarlenMask, scale, softcap,
                   deterministic):
        grads = self._bwd(dout[None], q[None], k[None], v[None], out[None], lse[None],
                          None if dlse is None else dlse[None], tuple(mask.samples), scale, softcap)
        return tuple(g[0] for g in grads)
