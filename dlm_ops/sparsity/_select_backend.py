"""Which implementation computes the pooled tile mass: the chunked torch path (any device) or the
fused Triton kernel (templates/sparse_select.py; CUDA, or CPU under TRITON_INTERPRET=1 when forced)."""

from __future__ import annotations

from .sparsed import sparsed_block_mass

BACKENDS = ("torch",)


def block_mass(q, k, *, backend=None, **kw):
    if backend not in (None, *BACKENDS):
        raise ValueError(f"backend must be one of {list(BACKENDS)} or None, got {backend!r}")
    return sparsed_block_mass(q, k, **kw)
