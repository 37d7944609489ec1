"""FlashBlock step cache: when a denoising step recomputes the block-external attention and when it
reuses the cached one.

While a block is denoised against a fixed KV cache of clean blocks, only the block's own tokens
change between steps; the attention of the block's queries over the cache (the block-external part)
drifts slowly. FlashBlock keeps that part as (out, lse) per layer and, on reuse steps, computes only
the block-internal attention and merges it in (``dlm_ops.flashblock_attn``, one kernel). A refresh
step recomputes everything in one pass (``dlm_ops.flashblock_refresh``) and stores the new
block-external part.

Policy: refresh at the block's first step, and whenever the number of tokens unmasked since the last
refresh reaches ``tau`` (tau = math.inf: refresh once per block); reuse otherwise.

Batches: the counters are per sample, the decision is per step for the whole batch: the batch
refreshes as soon as ANY sample has reached tau, and every sample's counter restarts. A refresh is
exact for every sample, so a sample refreshed early loses nothing but time; refreshing only some
samples would need ragged gathers of q and the cache every step. ``counts`` shows the per-sample
counters (for logging how much staleness each sample sees).

Usage in a BD3-LM-style sampler (two lines in the sampler, one in the attention layer)::

    fb = dlm_ops.sparsity.FlashBlockCache(tau=4)
    for block in range(num_blocks):
        fb.begin_block()                                  # 1: the first step refreshes
        for step in range(steps_per_block):
            # in attention layer `i`, instead of attention over [cache; block]:
            #   out = fb.attend(i, q, k_cache, v_cache, k_blk, v_blk, cache_seqlens=lens)
            logits = model(x_block, kv_cache, flashblock=fb)
            x_block, unmasked = denoise_step(x_block, logits)   # unmasked: int or (B,) counts
            fb.step(unmasked)                             # 2: decides the next step
        kv_cache.append(...)                              # commit the clean block
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from ..ops.cached import flashblock_attn, flashblock_refresh


class FlashBlockCache:
    """Per-layer block-external (out, lse) of the current block and the refresh/reuse policy.

    tau: refresh when this many tokens (per sample) were unmasked since the last refresh; an int
    >= 1 or math.inf (refresh only at a block's first step). backend: forced backend of the ops.
    Works with GQA (the ops do) and batches (see the module docstring for the batch rule).
    """

    def __init__(self, tau: float = math.inf, *, backend: str | None = None):
        is_int = isinstance(tau, int) and not isinstance(tau, bool)
        if not (tau == math.inf or (is_int and tau >= 1)):
            raise ValueError(f"tau must be an int >= 1 or math.inf, got {tau!r}")
        self.tau = tau
        self.backend = backend
        self._states: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}
        self._counts: list[int] | None = None
        self._refresh = True
        self.refreshes = 0  # layer calls that ran the refresh path (for reports)
        self.reuses = 0  # layer calls that reused the cached part

    # -- the sampler's side -----------------------------------------------------------------

    def begin_block(self) -> None:
        """A new block: forget the stored parts; the next step refreshes every layer."""
        self._states.clear()
        self._counts = None
        self._refresh = True

    def step(self, unmasked) -> None:
        """After a denoising step: ``unmasked`` tokens were unmasked (an int for every sample, or a
        per-sample sequence / (B,) tensor). Decides whether the next step refreshes. A CUDA tensor
        costs one host read here, once per step (not per layer)."""
        if isinstance(unmasked, torch.Tensor):
            unmasked = unmasked.reshape(-1).tolist()
        elif isinstance(unmasked, int) and not isinstance(unmasked, bool):
            unmasked = [unmasked] * (len(self._counts) if self._counts else 1)
        unmasked = list(unmasked)
        if any(isinstance(u, bool) or int(u) != u or u < 0 for u in unmasked):
            raise ValueError(f"unmasked must be non-negative integer counts, got {unmasked}")
        if self._counts is None or self._refresh:  # counters restart at every refresh step
            self._counts = [0] * len(unmasked)
        if len(unmasked) == 1 and len(self._counts) > 1:
            unmasked = unmasked * len(self._counts)
        if len(self._counts) == 1 and len(unmasked) > 1:  # an int so far, now per sample
            self._counts = self._counts * len(unmasked)
        if len(unmasked) != len(self._counts):
            raise ValueError(f"unmasked must have one count per sample ({len(self._counts)}), "
                             f"got {len(unmasked)}")
        self._counts = [c + int(u) for c, u in zip(self._counts, unmasked)]
        self._refresh = max(self._counts) >= self.tau

    @property
    def refreshing(self) -> bool:
        """Whether the current step recomputes the block-external part."""
        return self._refresh

    @property
    def counts(self) -> list[int]:
        """Tokens unmasked per sample since the last refresh."""
        return list(self._counts or [])

    # -- the attention layer's side ---------------------------------------------------------

    def attend(self, layer: Hashable, q, k_cache, v_cache, k_block, v_block, *, cache_seqlens=None,
               softmax_scale=None, dirty=None, return_lse=False):
        """Attention of the block q (B, bs, H, D) over [cache; block] for ``layer``: a refresh
        (exact, stores the block-external part) or a reuse (cached part + block-internal
        attention). ``dirty`` (bool (B, bs)) applies on reuse steps only. Same arguments and
        outputs as ``dlm_ops.block_decode_attn`` with k_new, v_new = k_block, v_block."""
        state = self._states.get(layer)
        if self._refresh or state is None or state[0].shape != q.shape \
                or state[0].device != q.device:
            out, lse, ext_out, ext_lse = flashblock_refresh(
                q, k_cache, v_cache, k_block, v_block, cache_seqlens=cache_seqlens,
                softmax_scale=softmax_scale, backend=self.backend)
            self._states[layer] = (ext_out, ext_lse)
            self.refreshes += 1
        else:
            out, lse = flashblock_attn(q, k_block, v_block, *state, dirty=dirty,
                                       softmax_scale=softmax_scale, return_lse=True,
                                       backend=self.backend)
            self.reuses += 1
        return (out, lse) if return_lse else out

    # -- reporting --------------------------------------------------------------------------

    def memory_bytes(self) -> int:
        """Bytes held: per layer B*bs*H*D float32 (out) + B*H*bs float32 (lse)."""
        return sum(t.numel() * t.element_size() for pair in self._states.values() for t in pair)

    def __repr__(self) -> str:
        return (f"FlashBlockCache(tau={self.tau}, layers={len(self._states)}, "
                f"memory={self.memory_bytes() / 2**20:.2f} MiB, refreshing={self._refresh}, "
                f"counts={self.counts}, refreshes={self.refreshes}, reuses={self.reuses})")
