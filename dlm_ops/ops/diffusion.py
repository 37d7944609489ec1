"""Block-diffusion attention family: schemas, validation, fake functions, autograd, dispatch.

Three forward/backward op pairs share one implementation:

    dlm::diffusion_attn_fwd / _bwd          (B, 2n, H, D), the BD3-LM [noisy | clean] mask
    dlm::block_causal_attn_fwd / _bwd       (B, S, H, D), key block <= query block (clean half alone)
    dlm::diffusion_attn_varlen_fwd / _bwd   packed samples (total, H, D) with int32 cu_seqlens

Forward ops return (out, lse) with lse float32 (float64 for float64 inputs), natural log,
(B, H, S) or (H, total). Backward ops
take the upstream gradient of lse too (it folds into delta, see the torch backend), so return_lse
callers can differentiate through it. The mask itself comes from ``dlm_ops.geometry``; the backend
is chosen per call from the capability table (``dlm_ops.backends``).

No ``from __future__ import annotations`` here: torch.library infers the schemas from the
annotations and needs them as real types.
"""

import math
from functools import lru_cache
from typing import Callable, Optional

import torch
from torch import Tensor

from ..backends import select
from ..backends.base import DETERMINISTIC, GQA, SOFTCAP, VARLEN, Problem, lse_dtype
from ..geometry import SequenceMask, VarlenMask
from .eager import EagerOp
from .validation import (
    check_cu_seqlens,
    check_cu_seqlens_values,
    check_even_seqlen,
    check_options,
    check_qkv,
)

BATCHED_LAYOUT = "(batch, seqlen, heads, head_dim)"
VARLEN_LAYOUT = "(total_tokens, heads, head_dim)"


def _scale(softmax_scale: Optional[float], q: Tensor) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _problem(q: Tensor, k: Tensor, softcap: float, deterministic: bool, varlen: bool) -> Problem:
    return _problem_of(q.device.type, q.dtype, q.shape[-1], k.shape[-2] != q.shape[-2],
                       softcap > 0, bool(deterministic), varlen)


@lru_cache(maxsize=256)
def _problem_of(device_type: str, dtype: torch.dtype, head_dim: int, gqa: bool, softcap: bool,
                deterministic: bool, varlen: bool) -> Problem:
    """One Problem per combination: every op call asks twice per training step, and building the
    feature set and the frozen dataclass took 1.9 us of the workstation's ~115 us step."""
    flags = ((GQA, gqa), (SOFTCAP, softcap), (DETERMINISTIC, deterministic), (VARLEN, varlen))
    return Problem(device_type, dtype, head_dim, frozenset(f for f, on in flags if on))


def _no_zero_grads(ctx) -> None:
    """An output without a gradient reaches the backward as None, not as zeros: lse, which a
    training step rarely uses, would otherwise cost a fill kernel and a read in the backward's
    preprocess at every step (the backends take dlse=None as zero; a None dout is zeroed there)."""
    ctx.set_materialize_grads(False)


def _check_batched(q, k, v, block_size, softmax_scale, softcap, even: bool) -> None:
    check_qkv(q, k, v, BATCHED_LAYOUT)
    check_options(block_size, softmax_scale, softcap)
    if even:
        check_even_seqlen(q)


def _register_batched(prefix: str, make_mask: Callable[[int, int], SequenceMask], even: bool):
    """Register ``dlm::{prefix}_fwd`` and ``dlm::{prefix}_bwd`` for one batched mask; return the
    two ops and the forward's EagerOp (what the public function calls)."""
    make_mask = lru_cache(maxsize=256)(make_mask)  # immutable masks: one per (seqlen, block_size)

    def run(q, k, v, block_size, softmax_scale, softcap, deterministic, backend):
        impl = select(_problem(q, k, softcap, deterministic, varlen=False), backend)
        mask = make_mask(q.shape[1], block_size)
        return impl.fwd(q, k, v, mask, _scale(softmax_scale, q), softcap, deterministic)

    def forward(q: Tensor, k: Tensor, v: Tensor, block_size: int, softmax_scale: Optional[float],
                softcap: float, deterministic: bool, backend: Optional[str]
                ) -> tuple[Tensor, Tensor]:
        _check_batched(q, k, v, block_size, softmax_scale, softcap, even)
        return run(q, k, v, block_size, softmax_scale, softcap, deterministic, backend)

    fwd = torch.library.custom_op(f"dlm::{prefix}_fwd", mutates_args=())(forward)

    @fwd.register_fake
    def _(q, k, v, block_size, softmax_scale, softcap, deterministic, backend):
        _check_batched(q, k, v, block_size, softmax_scale, softcap, even)
        b, s, h, _ = q.shape
        return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=lse_dtype(q.dtype))

    def backward_body(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      dlse: Optional[Tensor], block_size: int, softmax_scale: Optional[float],
                      softcap: float, deterministic: bool, backend: Optional[str]
                      ) -> tuple[Tensor, Tensor, Tensor]:
        impl = select(_problem(q, k, softcap, deterministic, varlen=False), backend)
        mask = make_mask(q.shape[1], block_size)
        return impl.bwd(dout, q, k, v, out, lse, dlse, mask, _scale(softmax_scale, q), softcap,
                        deterministic)

    bwd = torch.library.custom_op(f"dlm::{prefix}_bwd", mutates_args=())(backward_body)

    @bwd.register_fake
    def _(dout, q, k, v, out, lse, dlse, block_size, softmax_scale, softcap, deterministic,
          backend):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        q, k, v, block_size, softmax_scale, softcap, deterministic, backend = inputs
        out, lse = output
        _no_zero_grads(ctx)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block_size, ctx.softmax_scale, ctx.softcap = block_size, softmax_scale, softcap
        ctx.deterministic, ctx.backend = deterministic, backend

    def backward_with(bwd_call):
        def backward(ctx, dout, dlse):
            q, k, v, out, lse = ctx.saved_tensors
            dout = torch.zeros_like(out) if dout is None else dout
            dq, dk, dv = bwd_call(dout, q, k, v, out, lse, dlse, ctx.block_size,
                                  ctx.softmax_scale, ctx.softcap, ctx.deterministic, ctx.backend)
            return dq, dk, dv, None, None, None, None, None
        return backward

    def native(q, k, v, block_size, softmax_scale, softcap, deterministic, backend):
        impl = select(_problem(q, k, softcap, deterministic, varlen=False), backend)
        attach = getattr(impl, "fwd_with_grad", None)
        return None if attach is None else attach(
            q, k, v, make_mask(q.shape[1], block_size), _scale(softmax_scale, q), softcap,
            deterministic)

    fwd.register_autograd(backward_with(bwd), setup_context=setup_context)
    # The public function validates first, so its eager way runs the body without the check.
    return fwd, bwd, EagerOp(prefix, fwd, run, setup_context, backward_with(backward_body), native)


diffusion_attn_fwd, diffusion_attn_bwd, _diffusion_attn = _register_batched(
    "diffusion_attn", SequenceMask.block_diffusion, even=True)
block_causal_attn_fwd, block_causal_attn_bwd, _block_causal_attn = _register_batched(
    "block_causal_attn", SequenceMask.block_causal, even=False)


# -- varlen ------------------------------------------------------------------------------------


def _check_varlen(q, k, v, cu_seqlens, max_seqlen, block_size, softmax_scale, softcap) -> None:
    check_qkv(q, k, v, VARLEN_LAYOUT)
    check_options(block_size, softmax_scale, softcap)
    check_cu_seqlens(cu_seqlens, q, max_seqlen)


class _HostBounds:
    """cu_seqlens on the host, read once per tensor rather than once per call.

    The host needs the sample bounds to plan tiles, and reading a CUDA tensor waits for the device:
    in every forward and backward op of every layer that sync drained the GPU's queue (the varlen
    benchmark's 8 x 1024 packing ran its forward at 173 TFLOPS against the batched call's 293 on
    the H200). A model passes one cu_seqlens tensor to all its layers, so the bounds are kept per
    tensor: an entry holds the tensor itself, so no other tensor can take its memory while it is
    cached (same address, same storage), and the version counter, which every in-place write
    through it or its views bumps, tells whether the values may have changed. A few entries (a
    forward and its backward, a step or two in flight).
    """

    def __init__(self, size: int = 8):
        self.size = size
        self.reads = 0  # values read from the tensor (a device sync each, for CUDA tensors)
        self._entries: dict = {}  # (device, data_ptr, numel, stride) -> (tensor, version, bounds)

    def __call__(self, cu_seqlens: Tensor) -> tuple[int, ...]:
        if cu_seqlens.is_inference():  # no version counter to tell a change: read every time
            self.reads += 1
            return tuple(cu_seqlens.tolist())
        key = (cu_seqlens.device, cu_seqlens.data_ptr(), cu_seqlens.numel(), cu_seqlens.stride(0))
        hit = self._entries.pop(key, None)
        if hit is None or hit[1] != cu_seqlens._version:
            self.reads += 1
            hit = (cu_seqlens, cu_seqlens._version, tuple(cu_seqlens.tolist()))
        self._entries[key] = hit  # most recent last
        while len(self._entries) > self.size:
            del self._entries[next(iter(self._entries))]
        return hit[2]


_host_bounds = _HostBounds()


def _varlen_mask(cu_seqlens: Tensor, q: Tensor, max_seqlen: int, block_size: int) -> VarlenMask:
    cu = _host_bounds(cu_seqlens)
    check_cu_seqlens_values(cu, q.shape[0], max_seqlen)
    return VarlenMask(cu, block_size)


def _varlen_run(q, k, v, cu_seqlens, max_seqlen, block_size, softmax_scale, softcap,
                deterministic, backend):
    mask = _varlen_mask(cu_seqlens, q, max_seqlen, block_size)
    impl = select(_problem(q, k, softcap, deterministic, varlen=True), backend)
    return impl.varlen_fwd(q, k, v, mask, _scale(softmax_scale, q), softcap, deterministic)


def _varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                    block_size: int, softmax_scale: Optional[float], softcap: float,
                    deterministic: bool, backend: Optional[str]) -> tuple[Tensor, Tensor]:
    _check_varlen(q, k, v, cu_seqlens, max_seqlen, block_size, softmax_scale, softcap)
    return _varlen_run(q, k, v, cu_seqlens, max_seqlen, block_size, softmax_scale, softcap,
                       deterministic, backend)


diffusion_attn_varlen_fwd = torch.library.custom_op("dlm::diffusion_attn_varlen_fwd",
                                                    mutates_args=())(_varlen_forward)


@diffusion_attn_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, block_size, softmax_scale, softcap, deterministic, backend):
    _check_varlen(q, k, v, cu_seqlens, max_seqlen, block_size, softmax_scale, softcap)
    total, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((h, total), dtype=lse_dtype(q.dtype))


def _varlen_backward_body(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          dlse: Optional[Tensor], cu_seqlens: Tensor, max_seqlen: int,
                          block_size: int, softmax_scale: Optional[float], softcap: float,
                          deterministic: bool, backend: Optional[str]
                         ) -> tuple[Tensor, Tensor, Tensor]:
    mask = _varlen_mask(cu_seqlens, q, max_seqlen, block_size)
    impl = select(_problem(q, k, softcap, deterministic, varlen=True), backend)
    return impl.varlen_bwd(dout, q, k, v, out, lse, dlse, mask, _scale(softmax_scale, q), softcap,
                           deterministic)


diffusion_attn_varlen_bwd = torch.library.custom_op("dlm::diffusion_attn_varlen_bwd",
                                                    mutates_args=())(_varlen_backward_body)


@diffusion_attn_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, block_size, softmax_scale, softcap,
      deterministic, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, block_size, softmax_scale, softcap, deterministic, backend = \
        inputs
    out, lse = output
    _no_zero_grads(ctx)
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_seqlen, ctx.block_size, ctx.softmax_scale = max_seqlen, block_size, softmax_scale
    ctx.softcap, ctx.deterministic, ctx.backend = softcap, deterministic, backend


def _varlen_backward_with(bwd_call):
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = bwd_call(dout, q, k, v, out, lse, dlse, cu_seqlens, ctx.max_seqlen,
                              ctx.block_size, ctx.softmax_scale, ctx.softcap, ctx.deterministic,
                              ctx.backend)
        return dq, dk, dv, None, None, None, None, None, None, None
    return backward


def _varlen_native(q, k, v, cu_seqlens, max_seqlen, block_size, softmax_scale, softcap,
                   deterministic, backend):
    impl = select(_problem(q, k, softcap, deterministic, varlen=True), backend)
    attach = getattr(impl, "varlen_fwd_with_grad", None)
    return None if attach is None else attach(
        q, k, v, _varlen_mask(cu_seqlens, q, max_seqlen, block_size), _scale(softmax_scale, q),
        softcap, deterministic)


diffusion_attn_varlen_fwd.register_autograd(_varlen_backward_with(diffusion_attn_varlen_bwd),
                                            setup_context=_varlen_setup_context)
_diffusion_attn_varlen = EagerOp("diffusion_attn_varlen", diffusion_attn_varlen_fwd,
                                 _varlen_run, _varlen_setup_context,
                                 _varlen_backward_with(_varlen_backward_body), _varlen_native)


# -- public API --------------------------------------------------------------------------------

_KEYWORDS_DOC = """
    block_size: tokens per block (>= 1; need not divide n; > n means one block per half).
    softmax_scale: multiplies q.k before the softmax; None means 1/sqrt(head_dim).
    softcap: if > 0, logits become softcap * tanh(logits / softcap) (Gemma-2 style); 0 disables.
    deterministic: ask for a bitwise reproducible backward (the torch backend always is).
    return_lse: also return the float32 (float64 for float64 inputs) natural-log log-sum-exp of every query row.
    backend: force a backend by name ("torch", ...); None picks the best eligible one.
"""


# The public functions validate before calling the ops too: the dispatcher would otherwise reject
# a mistyped argument (a float block_size, a list cu_seqlens) with a schema error first.


def diffusion_attn_func(q, k, v, block_size, *, softmax_scale=None, softcap=0.0,
                        deterministic=False, return_lse=False, backend=None):
    _check_batched(q, k, v, block_size, softmax_scale, softcap, even=True)
    out, lse = _diffusion_attn((q, k, v), q, k, v, block_size, softmax_scale, float(softcap),
                               deterministic, backend)
    return (out, lse) if return_lse else out


def block_causal_attn_func(q, k, v, block_size, *, softmax_scale=None, softcap=0.0,
                           deterministic=False, return_lse=False, backend=None):
    _check_batched(q, k, v, block_size, softmax_scale, softcap, even=False)
    out, lse = _block_causal_attn((q, k, v), q, k, v, block_size, softmax_scale, float(softcap),
                                  deterministic, backend)
    return (out, lse) if return_lse else out


def diffusion_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, block_size, *, softmax_scale=None,
                               softcap=0.0, deterministic=False, return_lse=False, backend=None):
    _check_varlen(q, k, v, cu_seqlens, max_seqlen, block_size, softmax_scale, softcap)
    out, lse = _diffusion_attn_varlen((q, k, v, cu_seqlens), q, k, v, cu_seqlens, max_seqlen,
                                      block_size, softmax_scale, float(softcap), deterministic,
                                      backend)
    return (out, lse) if return_lse else out


diffusion_attn_func.__doc__ = """Block-diffusion (BD3-LM) attention over [noisy | clean] sequences.

    q: (B, 2n, H, D); k, v: (B, 2n, Hkv, D) with H % Hkv == 0. Token i is clean iff i >= n; its
    block is (i mod n) // block_size. A query sees keys of its own block in its own half, and clean
    keys of earlier blocks (noisy queries) or of earlier-or-same blocks (clean queries).
    Returns out (B, 2n, H, D), or (out, lse (B, H, 2n)) with return_lse.
""" + _KEYWORDS_DOC

block_causal_attn_func.__doc__ = """Block-causal attention: key block <= query block.

    q: (B, S, H, D); k, v: (B, S, Hkv, D). block_size 1 is causal attention; this is the clean half
    of block diffusion alone (SDAR / Fast-dLLM v2 prefill).
    Returns out (B, S, H, D), or (out, lse (B, H, S)) with return_lse.
""" + _KEYWORDS_DOC

diffusion_attn_varlen_func.__doc__ = """Block-diffusion attention over packed samples (SDAR-style).

    q: (total, H, D); k, v: (total, Hkv, D). Sample i occupies [cu_seqlens[i], cu_seqlens[i+1]), an
    even length 2*m_i laid out [noisy_i | clean_i]; blocks restart in each half; zero-length samples
    are allowed. cu_seqlens: int32 (num_samples + 1,) on q's device, starting at 0 and ending at
    total. max_seqlen: the longest sample (2*m_i) or more.
    Returns out (total, H, D), or (out, lse (H, total)) with return_lse.
""" + _KEYWORDS_DOC
