"""What a backend declares about itself, and how a call is matched against it.

Capabilities are data (xFormers-style): dispatch reads them, derives the reasons a backend cannot
take a call, and when nothing fits raises with every backend's reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Features a call may need; a backend lists the ones it implements.
SOFTCAP = "softcap"
GQA = "gqa"
VARLEN = "varlen"
DETERMINISTIC = "deterministic"


# Tests set this so that every output a backend allocates starts as NaN: an element a kernel forgets
# to write then fails loudly instead of passing with whatever memory held.
POISON_OUTPUTS = False


def new_output(like: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    """Allocate a kernel output (poisoned with NaN when ``POISON_OUTPUTS``)."""
    out = like.new_empty(shape, dtype=dtype)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """LSE is float32 (natural log) for every training dtype; float64 inputs keep float64 so that
    their backward (which rebuilds probabilities from the LSE) stays float64-accurate."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Problem:
    """What dispatch needs to know about one call."""

    device_type: str
    dtype: torch.dtype
    head_dim: int
    features: frozenset[str] = frozenset()

    def __str__(self) -> str:
        extra = f" with {', '.join(sorted(self.features))}" if self.features else ""
        return f"{str(self.dtype).removeprefix('torch.')} head_dim {self.head_dim} on {self.device_type}{extra}"


@dataclass(frozen=True)
class Capabilities:
    device_types: frozenset[str] | None  # None: any device torch runs on
    dtypes: frozenset[torch.dtype]
    max_head_dim: int
    head_dim_multiple: int
    features: frozenset[str] = field(default_factory=frozenset)

    def reasons(self, p: Problem) -> list[str]:
        out = []
        if self.device_types is not None and p.device_type not in self.device_types:
            out.append(f"device {p.device_type!r} not in {sorted(self.device_types)}")
        if p.dtype not in self.dtypes:
            out.append(f"dtype {p.dtype} not in {sorted(str(d) for d in self.dtypes)}")
        if p.head_dim > self.max_head_dim or p.head_dim % self.head_dim_multiple:
            out.append(f"head_dim {p.head_dim} not a multiple of {self.head_dim_multiple} "
                       f"<= {self.max_head_dim}")
        missing = p.features - self.features
        if missing:
            out.append(f"features {sorted(missing)} not implemented")
        return out


class Backend:
    """A way to run one op family (``family``). Subclasses set the class attributes and add the
    family's entry points; all tensors arrive validated and in the public layouts."""

    name: str
    family: str = "diffusion"  # which registry in dlm_ops.backends it joins
    priority: int  # higher wins among eligible backends
    capabilities: Capabilities
    auto_device_types: frozenset[str] | None = None  # where dispatch may pick it unforced (None: anywhere)
    opt_in: str | None = None  # when dispatch may pick it unforced, if a setting decides ("X is set")

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run in this process at all (missing package, no GPU), or None."""
        return None

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        why = self.unavailable_reason()
        return ([why] if why else []) + self.capabilities.reasons(problem)


class DiffusionBackend(Backend):
    """The block-diffusion family (dlm_ops/ops/diffusion.py): four entry points."""

    family = "diffusion"

    # Batched: q (B, S, H, D), k/v (B, S, Hkv, D) -> out (B, S, H, D), lse (B, H, S) lse_dtype.
    def fwd(self, q, k, v, mask, scale, softcap, deterministic):
        raise NotImplementedError

    def bwd(self, dout, q, k, v, out, lse, dlse, mask, scale, softcap, deterministic):
        raise NotImplementedError

    # Varlen: q (total, H, D), k/v (total, Hkv, D) -> out (total, H, D), lse (H, total) lse_dtype.
    def varlen_fwd(self, q, k, v, mask, scale, softcap, deterministic):
        raise NotImplementedError

    def varlen_bwd(self, dout, q, k, v, out, lse, dlse, mask, scale, softcap, deterministic):
        raise NotImplementedError
