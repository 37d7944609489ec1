"""Backend registry and dispatch.

Each backend declares what it supports as data (``base.Capabilities``); ``select`` picks the
highest-priority eligible one, or the one ``backend=`` forces, and otherwise raises
``UnsupportedConfig`` with every backend's reason. New backends (triton, cutlass) register here and
the op modules do not change.
"""

from __future__ import annotations

from ..errors import UnsupportedConfig
from .base import Backend, Problem
from .torch_tiled import TorchTiledBackend
from .triton_backend import TritonBackend

BACKENDS: dict[str, Backend] = {b.name: b for b in (TritonBackend(), TorchTiledBackend())}


def _auto_reasons(b: Backend, problem: Problem) -> list[str]:
    reasons = b.not_supported_reasons(problem)
    if not reasons and b.auto_device_types is not None and problem.device_type not in b.auto_device_types:
        reasons.append(f"chosen automatically only on {sorted(b.auto_device_types)} "
                       f"(force it with backend={b.name!r})")
    return reasons


def select(problem: Problem, forced: str | None = None) -> Backend:
    if forced is not None:
        if forced not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)} or None, got {forced!r}")
        reasons = BACKENDS[forced].not_supported_reasons(problem)
        if reasons:
            raise UnsupportedConfig(f"backend {forced!r} cannot run {problem}: " + "; ".join(reasons))
        return BACKENDS[forced]
    eligible = [b for b in BACKENDS.values() if not _auto_reasons(b, problem)]
    if not eligible:
        raise UnsupportedConfig(f"no backend can run {problem}:\n" + report(problem))
    return max(eligible, key=lambda b: b.priority)


def report(problem: Problem) -> str:
    """One line per backend: usable for ``problem``, or why not."""
    lines = []
    for b in sorted(BACKENDS.values(), key=lambda b: -b.priority):
        reasons = _auto_reasons(b, problem)
        lines.append(f"  {b.name}: " + ("usable" if not reasons else "; ".join(reasons)))
    return "\n".join(lines)


__all__ = ["BACKENDS", "Backend", "Problem", "select", "report"]
