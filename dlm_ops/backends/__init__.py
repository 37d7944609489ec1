"""Backend registries and dispatch, one registry per op family.

Each backend declares what it supports as data (``base.Capabilities``) and the family it serves
(``Backend.family``); ``select`` picks the highest-priority eligible backend of that family, or the
one ``backend=`` forces, and otherwise raises ``UnsupportedConfig`` with every backend's reason.
An op family adds its backends with ``register`` (from the module that defines them); the op
modules never name a backend class.
"""

from __future__ import annotations

from ..errors import UnsupportedConfig
from .base import Backend, Problem
from .torch_tiled import TorchTiledBackend
from .triton_backend import TritonBackend

REGISTRIES: dict[str, dict[str, Backend]] = {}


def register(backend: Backend) -> Backend:
    """Add ``backend`` to its family's registry (a later registration of the same name replaces it)."""
    REGISTRIES.setdefault(backend.family, {})[backend.name] = backend
    return backend


for _b in (TritonBackend(), TorchTiledBackend()):
    register(_b)
BACKENDS = REGISTRIES["diffusion"]  # the block-diffusion family (and exact attention's fallbacks)
from . import cutlass_diffusion  # noqa: E402,F401  registers "cutlass" (needs register above)


def _auto_reasons(b: Backend, problem: Problem) -> list[str]:
    reasons = b.not_supported_reasons(problem)
    auto = b.auto_device_types  # read once: a property that may read the environment
    if not reasons and auto is not None and problem.device_type not in auto:
        where = (f"only on {sorted(auto)}" if auto
                 else f"only when {b.opt_in}" if b.opt_in else "never")
        reasons.append(f"chosen automatically {where} (force it with backend={b.name!r})")
    return reasons


def select(problem: Problem, forced: str | None = None, family: str = "diffusion") -> Backend:
    backends = REGISTRIES[family]
    if forced is not None:
        if forced not in backends:
            raise ValueError(f"backend must be one of {sorted(backends)} or None, got {forced!r}")
        reasons = backends[forced].not_supported_reasons(problem)
        if reasons:
            raise UnsupportedConfig(f"backend {forced!r} cannot run {problem}: " + "; ".join(reasons))
        return backends[forced]
    # The first eligible one by priority (registration order among equals, as max() picked): the
    # others' checks are not run (each op call selects; on the host of a training step this is
    # a few of its microseconds).
    for b in sorted(backends.values(), key=lambda b: -b.priority):
        if not _auto_reasons(b, problem):
            return b
    raise UnsupportedConfig(f"no backend can run {problem}:\n" + report(problem, family))


def report(problem: Problem, family: str = "diffusion") -> str:
    """One line per backend of ``family``: usable for ``problem``, or why not."""
    lines = []
    for b in sorted(REGISTRIES[family].values(), key=lambda b: -b.priority):
        reasons = _auto_reasons(b, problem)
        lines.append(f"  {b.name}: " + ("usable" if not reasons else "; ".join(reasons)))
    return "\n".join(lines)


__all__ = ["BACKENDS", "REGISTRIES", "Backend", "Problem", "register", "select", "report"]
