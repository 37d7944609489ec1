"""The ``cutlass`` backend of the block-diffusion family: the Hopper kernels of
csrc/hopper/diffusion_fwd.cuh and diffusion_bwd.cuh (TMA, wgmma, a producer and two consumer
warpgroups), JIT-built on first use by ``cutlass.build``; everything else runs the Triton kernels
(this backend subclasses the Triton one).

Which kernel runs where is data (FORWARD_HEAD_DIMS, BACKWARD_HEAD_DIMS below): each CUTLASS kernel
runs for the head dims where it measured faster than Triton's on the H200, the forward at D = 128 /
256 and the backward at D = 64 / 128 (Triton's forward at D = 64, its backward at D = 256). Both
kernels need
sm90, fp16/bf16, the batched layout, no softcap (declared capabilities: such calls select
``triton``) and, checked per call, both halves multiples of 128 long (every tile starts on a TMA
tile boundary) with 16-byte aligned rows; a call outside that runs Triton's kernel, counted in
``STATS``. The backward (preprocess, dK/dV per key tile, dQ per query tile: three kernels with
disjoint writes) is bitwise deterministic, so ``deterministic=True`` takes it too.

The build happens at the first call (one WARNING line; 80-90 s on the H200 machine's 16 cores, 13
translation units compiled in parallel by ninja). If it fails, the failure is remembered, reported
by ``unavailable_reason`` (so ``python -m dlm_ops`` shows it and dispatch picks Triton from then
on) and warned once. Dispatch picks this backend automatically wherever it can be built;
``DLM_OPS_CUTLASS=0`` opts out (no build, Triton everywhere) and ``backend="cutlass"`` forces it.
GPU tests: tests/test_gpu.py (test_cutlass_*), torch-free harnesses in tests/cuda; results and
versions in csrc/NOTES.md.
"""

from __future__ import annotations

import os
import warnings
from functools import lru_cache

import torch

from . import cutlass, register
from .base import DETERMINISTIC, GQA, Capabilities, new_output
from .triton_backend import TritonBackend

SOURCES = [
    "bindings/diffusion_sm90.cpp",
    "bindings/diffusion_fwd_sm90.cu",
    "bindings/diffusion_bwd_sm90.cu",
] + [f"hopper/diffusion_{d}_{t}_d{h}.cu"
     for d, dims in (("fwd", (64, 128, 256)), ("bwd", (64, 128)))
     for t in ("bf16", "fp16") for h in dims]
TILE = 128  # the kernels' largest tile: both halves must be multiples of it
# CUTLASS calls run, and calls handed to Triton, per direction
STATS = {"fwd": 0, "fwd_fallback": 0, "bwd": 0, "bwd_fallback": 0}

_EXT = None
_BUILD_ERROR: str | None = None
_TOOLCHAIN: list = []  # [cutlass.unavailable_reason()] once computed: it runs `ninja --version`
# in a subprocess and dispatch asks on every call. On the H200 a 0.4 ms forward took 2.6 ms per
# call, a constant 2.2 ms at every size, before this cache (not re-measured since: csrc/NOTES.md)


def _extension():
    """The built extension (built on the first call), or None after a failed build."""
    global _EXT, _BUILD_ERROR
    if _EXT is None and _BUILD_ERROR is None:
        try:
            _EXT = cutlass.build("dlm_diffusion_sm90", SOURCES)
        except Exception as e:  # a compiler error must not take the op down: Triton still runs
            _BUILD_ERROR = f"the sm90 build failed ({type(e).__name__}: {str(e)[-300:]})"
            warnings.warn(f"dlm_ops: {_BUILD_ERROR}; the triton backend runs instead")
    return _EXT


@lru_cache(maxsize=64)
def _tile_order(n_noisy: int, n_clean: int, block_size: int, head_dim: int,
                device: str) -> torch.Tensor:
    return _EXT.tile_order(n_noisy, n_clean, block_size, head_dim).to(device)


# Which head dims run which CUTLASS kernel; the rest run Triton's. Measured on the H200 through torch
# in one process (bf16, H=16, 16K tokens, csrc/NOTES.md): the CUTLASS backward beats Triton's (n = 1K:
# 210 vs 180 TFLOPS, n = 8K: 388 vs 283); the forward v5 does at D = 128 (287 vs 256, 542 vs 376) and
# D = 256 (n = 2K: 439 vs 243) but not at D = 64 (n = 2K: 257 vs 292). The kernels cover every head
# dim listed in SUPPORTED_HEAD_DIMS.
SUPPORTED_HEAD_DIMS = {"fwd": (64, 128, 256), "bwd": (64, 128)}
FORWARD_HEAD_DIMS = (128, 256)
BACKWARD_HEAD_DIMS = (64, 128)

# The forward's grid: one CTA per SM walking its work items (the next item's Q and K/V load while
# this one's last P V and stores run) when both halves are at most PERSISTENT_MAX_HALF long, else
# one CTA per query tile. Forward v5 on the H200 (standalone, bf16 D=128, 16K tokens), persistent
# against one CTA per tile: +7.5% at n = 1K, +1.7% at 2K, -0.6% at 4K, -3.7% at 8K, +7% for GQA
# 32/8 at 2K: short halves give items of few key tiles, whose prologue and epilogue the persistent
# loop overlaps; long ones balance worse under its static round-robin than under the hardware's
# CTA scheduler.
PERSISTENT_MAX_HALF = 2048


@lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _max_ctas(mask, device: torch.device) -> int:
    """The forward's grid bound: the SM count (persistent) or 0 (one CTA per work item)."""
    return _sm_count(device) if max(mask.n_noisy, mask.n_clean) <= PERSISTENT_MAX_HALF else 0


@lru_cache(maxsize=64)
def _bwd_tile_orders(n_noisy: int, n_clean: int, block_size: int, device: str):
    """(key tiles of the dK/dV kernel, query tiles of the dQ kernel), most expensive first."""
    return tuple(t.to(device) for t in _EXT.bwd_tile_orders(n_noisy, n_clean, block_size))


def _tma_ready(t: torch.Tensor) -> bool:
    """Viewable as the kernel's (S, D, H, B) TMA tensor: unit stride in D, 16-byte aligned."""
    size = t.element_size()
    return (t.stride(3) == 1 and t.data_ptr() % 16 == 0
            and all((t.stride(i) * size) % 16 == 0 for i in range(3)))


class CutlassDiffusionBackend(TritonBackend):
    name = "cutlass"
    priority = 20  # above triton: preferred where it can run
    capabilities = Capabilities(
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        max_head_dim=256,
        head_dim_multiple=64,  # 64, 128, 256 (the forward; the backward 64, 128): 192 runs Triton
        features=frozenset({GQA, DETERMINISTIC}),
    )

    opt_in = "DLM_OPS_CUTLASS is not 0"

    @property
    def auto_device_types(self):  # DLM_OPS_CUTLASS=0 opts out (no JIT build): the module docstring
        return frozenset() if os.environ.get("DLM_OPS_CUTLASS") == "0" else frozenset({"cuda"})

    def unavailable_reason(self) -> str | None:
        if not _TOOLCHAIN:
            _TOOLCHAIN.append(cutlass.unavailable_reason())
        return super().unavailable_reason() or _TOOLCHAIN[0] or _BUILD_ERROR

    @staticmethod
    def _covers(mask, head_dims, *tensors) -> bool:
        return not (mask.n_noisy % TILE or mask.n_clean % TILE
                    or tensors[0].shape[-1] not in head_dims
                    or not all(_tma_ready(t) for t in tensors))

    def fwd(self, q, k, v, mask, scale, softcap, deterministic):
        ext = _extension() if softcap == 0 else None
        if ext is None or not self._covers(mask, FORWARD_HEAD_DIMS, q, k, v):
            STATS["fwd_fallback"] += 1
            return super().fwd(q, k, v, mask, scale, softcap, deterministic)
        b, s, h, _ = q.shape
        out = new_output(q, q.shape)
        lse = new_output(q, (b, h, s), torch.float32)
        order = _tile_order(mask.n_noisy, mask.n_clean, mask.block_size, q.shape[-1], str(q.device))
        ext.fwd(q, k, v, out, lse, order, mask.n_noisy, mask.block_size, scale, _max_ctas(mask, q.device))
        STATS["fwd"] += 1
        return out, lse

    def bwd(self, dout, q, k, v, out, lse, dlse, mask, scale, softcap, deterministic):
        ext = _extension() if softcap == 0 else None
        if ext is not None and not _tma_ready(dout):
            # dout comes from autograd in any layout (an expand, a transpose): one copy makes it
            # TMA-ready rather than handing the whole backward to Triton.
            dout = dout.contiguous()
        if ext is None or not self._covers(mask, BACKWARD_HEAD_DIMS, q, k, v, dout, out):
            STATS["bwd_fallback"] += 1
            return super().bwd(dout, q, k, v, out, lse, dlse, mask, scale, softcap, deterministic)
        b, s, h, _ = q.shape
        lse = lse.float().contiguous()
        dlse = None if dlse is None else dlse.float().contiguous()
        dq, dk, dv = new_output(q, q.shape), new_output(k, k.shape), new_output(v, v.shape)
        lse2 = torch.empty((b, h, s), dtype=torch.float32, device=q.device)  # scratch
        delta = torch.empty_like(lse2)
        dkdv_order, dq_order = _bwd_tile_orders(mask.n_noisy, mask.n_clean, mask.block_size,
                                                str(q.device))
        ext.bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, lse2, delta, dkdv_order, dq_order,
                mask.n_noisy, mask.block_size, scale)
        STATS["bwd"] += 1
        return dq, dk, dv


register(CutlassDiffusionBackend())
