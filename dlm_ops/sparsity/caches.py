"""Step caches: when to run full attention, when to select a sparse pattern, when to reuse it.

One policy for every method, per layer (each layer's pattern, per sample and head, is its own):

    step <  n_full = int(skip * num_steps)     "full"    dense attention (torch SDPA)
    step == n_full, or a refresh step,         "select"  select from this step's q, k, then run the
      or no pattern held for the layer yet               sparse op with the fresh pattern
    any other step                             "reuse"   the sparse op with the held pattern

SparseD's code runs full attention up to and including step int(skip * steps) + 1 and selects at
that last full step; here the selecting step already runs sparse (the selection pass costs ~2
attention forwards of QK^T; a dense attention on top would add a third). Refresh steps (PulseCol's
"pulses"; also accepted by the others) re-select at the given steps >= n_full.

A sampler loop stays two lines:

    cache = SparseDCache(num_steps=64, skip=0.2, rho=0.3, block_size=64, prompt_len=p)
    out = cache.attend(layer, step, q, k, v)     # inside each attention layer, every step

q (B, S, H, D), k/v (B, S, Hkv, D) as in ``dlm_ops``. Batch-aware: patterns are held per sample;
when a sampler drops finished samples, pass ``samples`` (indices into the batch the patterns were
selected on) and each remaining sample keeps its own pattern. ``history`` records every decision
as (layer, step, decision) and ``memory_bytes()`` the bytes of the patterns held. The sparse ops
are imported at call time (``dlm_ops.block_sparse_attn`` / ``column_sparse_attn``);
``sparse_attention=`` substitutes any callable with the same signature (tests, other kernels).

The ops check index values with a host sync (0.3-0.7 ms per call on the H200 at S = 16K-32K,
``check_indices``). A held pattern is checked at its first sparse step and again only when the
key or query length changes (a reuse step with the same shapes cannot make it invalid: the cache
holds the tensors, and ``samples=`` only picks rows of them); with ``sparse_attention=`` the
callable is called as given, without ``check_indices``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .ba_att import METHODS, ba_att_select
from .pulsecol import pulsecol_select
from .sparsed import check_fraction, sparsed_select

FULL, SELECT, REUSE = "full", "select", "reuse"


class StepCache:
    """The shared policy; subclasses define ``_select`` and ``_sparse``."""

    op_name: str  # the dlm_ops function sparse steps call

    def __init__(self, *, num_steps: int, skip: float, refresh_steps=(), softmax_scale=None,
                 sparse_attention=None):
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
        check_fraction("skip", skip)
        refresh = sorted(set(refresh_steps))
        if any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < num_steps
               for s in refresh):
            raise ValueError(f"refresh_steps must be ints in [0, {num_steps}), got {refresh_steps!r}")
        self.num_steps = num_steps
        self.n_full = int(skip * num_steps)
        self.refresh_steps = frozenset(refresh)
        self.softmax_scale = softmax_scale
        self.sparse_attention = sparse_attention
        self.patterns: dict = {}  # layer -> tuple of int32 tensors, leading dims (B, H)
        self.history: list[tuple] = []
        self._checked: dict = {}  # layer -> (Sq, Sk) its pattern's values were checked for

    def decide(self, layer, step: int) -> str:
        """What ``attend`` does at (layer, step): "full", "select" or "reuse"."""
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < self.num_steps:
            raise ValueError(f"step must be an int in [0, {self.num_steps}), got {step!r}")
        if step < self.n_full:
            return FULL
        if step == self.n_full or step in self.refresh_steps or layer not in self.patterns:
            return SELECT
        return REUSE

    def attend(self, layer, step: int, q, k, v, *, samples=None):
        """Attention output (B, S, H, D) for this layer at this denoising step."""
        decision = self.decide(layer, step)
        self.history.append((layer, step, decision))
        if decision == FULL:
            return self._full(q, k, v)
        if decision == SELECT:
            with torch.no_grad():
                self.patterns[layer] = tuple(self._select(q, k))
            self._checked.pop(layer, None)
            pattern = self.patterns[layer]
        else:
            pattern = self._for_batch(self.patterns[layer], q.shape[0], samples)
        lengths = (q.shape[1], k.shape[1])
        out = self._sparse(q, k, v, *pattern, **self._check_kwargs(self._checked.get(layer) != lengths))
        self._checked[layer] = lengths
        return out[0] if isinstance(out, tuple) else out

    def memory_bytes(self) -> int:
        """Bytes of the patterns held (index and count tensors, every layer)."""
        return sum(t.numel() * t.element_size() for p in self.patterns.values() for t in p)

    def reset(self) -> None:
        """Forget every pattern (a new generation starts)."""
        self.patterns.clear()
        self.history.clear()
        self._checked.clear()

    def _check_kwargs(self, check: bool) -> dict:
        """The op's ``check_indices`` (this package's ops only: a substitute is called as given)."""
        return {} if self.sparse_attention is not None else {"check_indices": check}

    @staticmethod
    def _for_batch(pattern, batch: int, samples):
        if samples is not None:
            idx = torch.as_tensor(samples, dtype=torch.long, device=pattern[0].device)
            if idx.dim() != 1 or idx.numel() != batch:
                raise ValueError(f"samples must be 1-D with one index per sample of q ({batch}), "
                                 f"got shape {tuple(idx.shape)}")
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= pattern[0].shape[0]):
                raise ValueError(f"samples must index the {pattern[0].shape[0]} samples the "
                                 f"pattern was selected for, got {idx.tolist()}")
            return tuple(t.index_select(0, idx) for t in pattern)
        if pattern[0].shape[0] != batch:
            raise ValueError(f"q has {batch} samples but the pattern was selected for "
                             f"{pattern[0].shape[0]}: pass samples= (which of them remain)")
        return pattern

    def _full(self, q, k, v):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=self.softmax_scale,
            enable_gqa=k.shape[2] != q.shape[2])
        return out.transpose(1, 2)

    def _op(self):
        if self.sparse_attention is not None:
            return self.sparse_attention
        import dlm_ops  # noqa: PLC0415 (at call time: the sparse ops register in their own module)

        op = getattr(dlm_ops, self.op_name, None)
        if op is None:
            raise RuntimeError(f"dlm_ops.{self.op_name} is not available in this build; pass "
                               "sparse_attention= to the cache")
        return op

    def _select(self, q, k):
        raise NotImplementedError

    def _sparse(self, q, k, v, *pattern, **check):
        """The sparse op's output (or (out, lse)) with the held pattern; ``check``: _check_kwargs."""
        raise NotImplementedError


class _BlockCache(StepCache):
    op_name = "block_sparse_attn"

    def __init__(self, *, block_size: int, **kw):
        super().__init__(**kw)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size

    def _sparse(self, q, k, v, indices, counts, **check):
        return self._op()(q, k, v, indices, counts, block_size_q=self.block_size,
                          block_size_k=self.block_size, softmax_scale=self.softmax_scale, **check)


class SparseDCache(_BlockCache):
    """SparseD: block patterns by pooled attention mass, prompt and generation keys isolated."""

    def __init__(self, *, num_steps, skip, rho, block_size, prompt_len=None, refresh_steps=(),
                 softmax_scale=None, sparse_attention=None, backend=None):
        super().__init__(num_steps=num_steps, skip=skip, refresh_steps=refresh_steps,
                         softmax_scale=softmax_scale, sparse_attention=sparse_attention,
                         block_size=block_size)
        check_fraction("rho", rho)
        self.rho, self.prompt_len, self.backend = rho, prompt_len, backend

    def _select(self, q, k):
        return sparsed_select(q, k, block_size_q=self.block_size, block_size_k=self.block_size,
                              rho=self.rho, prompt_len=self.prompt_len,
                              softmax_scale=self.softmax_scale, backend=self.backend)


class BAAttCache(_BlockCache):
    """BA-Att: block patterns from pooled, norm-sorted Q/K statistics (top-k or cumulative mass)."""

    def __init__(self, *, num_steps, skip, block_size, rho=None, mass=None, method="corrected",
                 outliers=1, refresh_steps=(), softmax_scale=None, sparse_attention=None):
        super().__init__(num_steps=num_steps, skip=skip, refresh_steps=refresh_steps,
                         softmax_scale=softmax_scale, sparse_attention=sparse_attention,
                         block_size=block_size)
        if (rho is None) == (mass is None):
            raise ValueError(f"exactly one of rho and mass must be given, got rho={rho!r}, mass={mass!r}")
        check_fraction("rho" if mass is None else "mass", rho if mass is None else mass)
        if method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
        self.rho, self.mass, self.method, self.outliers = rho, mass, method, outliers

    def _select(self, q, k):
        return ba_att_select(q, k, block_size_q=self.block_size, block_size_k=self.block_size,
                             rho=self.rho, mass=self.mass, method=self.method,
                             outliers=self.outliers, softmax_scale=self.softmax_scale)


class PulseColCache(StepCache):
    """PulseCol: column patterns by attention mass per key, refreshed at ``refresh_steps``."""

    op_name = "column_sparse_attn"

    def __init__(self, *, num_steps, skip, keep, refresh_steps=(), sample_rows=None,
                 softmax_scale=None, sparse_attention=None):
        super().__init__(num_steps=num_steps, skip=skip, refresh_steps=refresh_steps,
                         softmax_scale=softmax_scale, sparse_attention=sparse_attention)
        check_fraction("keep", keep)
        self.keep, self.sample_rows = keep, sample_rows

    def _select(self, q, k):
        return pulsecol_select(q, k, keep=self.keep, sample_rows=self.sample_rows,
                               softmax_scale=self.softmax_scale)

    def _sparse(self, q, k, v, indices, counts, **check):
        return self._op()(q, k, v, indices, counts, softmax_scale=self.softmax_scale, **check)


def pulse_steps(num_steps: int, skip: float, pulses: int) -> tuple[int, ...]:
    """``pulses`` refresh steps spread evenly over the sparse steps after the first selection."""
    n_full = int(skip * num_steps)
    span = num_steps - n_full
    return tuple(sorted({n_full + math.ceil(span * (i + 1) / (pulses + 1))
                         for i in range(pulses)} - {num_steps}))
