"""Exact attention with the SDPA surface and a strict contract.

``dlm_ops.attention(q, k, v, *, is_causal=False, scale=None)`` on (B, H, S, D) is a drop-in for
``F.scaled_dot_product_attention`` call sites that fit the contract below, with a backward that is
bitwise deterministic by construction (dK/dV and dQ in separate kernels with disjoint writes, no
atomics). It runs the block-diffusion Triton kernels: causal attention is the block-causal geometry
with block_size 1, full attention one block spanning the sequence.

The contract is strict: calls outside it raise ``UnsupportedConfig`` with every reason, and nothing
falls back to another implementation. ``is_eligible`` answers the same question without raising.
Contract: q, k, v on one CUDA device (CPU only under TRITON_INTERPRET=1, for tests), float16 or
bfloat16, identical shapes (B, H, S, D) (no GQA, no cross-attention), head_dim a power of two in
[16, 256], last dimension contiguous, scale None or a positive finite float; no mask, no dropout.

No ``from __future__ import annotations``: torch.library reads the annotations as types.
"""

import math
from typing import Optional

import torch
from torch import Tensor

from ..backends.base import new_output
from ..backends.triton_backend import _IMPORT_ERROR, INTERPRET, TritonBackend
from ..errors import UnsupportedConfig
from ..geometry import SequenceMask
from .eager import EagerOp

_KERNELS = TritonBackend()  # the one implementation of this op: no dispatch, no fallback
_DTYPES = (torch.float16, torch.bfloat16)


def _reasons(q, k, v, is_causal, scale) -> list[str]:
    if not all(isinstance(t, Tensor) for t in (q, k, v)):
        return ["q, k and v must be tensors"]
    out = [_IMPORT_ERROR] if _IMPORT_ERROR else []
    if q.dim() != 4:
        out.append(f"q must be 4-D (batch, heads, seqlen, head_dim), got shape {tuple(q.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        out.append(f"k and v must have q's shape {tuple(q.shape)}, got {tuple(k.shape)} and "
                   f"{tuple(v.shape)} (no GQA or cross-attention)")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        out.append(f"q, k, v must all be float16 or bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        out.append(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda" and not (q.device.type == "cpu" and INTERPRET):
        out.append(f"tensors must be on a CUDA device, got {q.device.type}")
    d = q.shape[-1] if q.dim() else 0
    if d < 16 or d > 256 or d & (d - 1):
        out.append(f"head_dim must be a power of two in [16, 256], got {d}")
    if any(t.dim() and t.stride(-1) != 1 for t in (q, k, v)):
        out.append("the last dimension of q, k, v must be contiguous (stride 1)")
    if not isinstance(is_causal, bool):
        out.append(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        out.append(f"scale must be None or a positive finite float, got {scale!r}")
    return out


def is_eligible(q, k, v, *, is_causal=False, scale=None) -> bool:
    """Whether ``attention`` accepts this call (it would raise UnsupportedConfig otherwise)."""
    return not _reasons(q, k, v, is_causal, scale)


def attention(q, k, v, *, is_causal=False, scale=None):
    """Exact softmax attention, (B, H, S, D) in and out, like F.scaled_dot_product_attention.

    Raises UnsupportedConfig, listing every reason, outside the contract in this module's docstring.
    """
    reasons = _reasons(q, k, v, is_causal, scale)
    if reasons:
        raise UnsupportedConfig("dlm_ops.attention cannot run this call: " + "; ".join(reasons))
    out, _ = _attention((q, k, v), q, k, v, is_causal, None if scale is None else float(scale))
    return out


def _mask(seqlen: int, is_causal: bool) -> SequenceMask:
    return SequenceMask.block_causal(seqlen, 1 if is_causal else max(seqlen, 1))


def _bshd(t: Tensor) -> Tensor:
    return t.transpose(1, 2)  # (B, H, S, D) viewed as the kernels' (B, S, H, D): no copy


def _scale(scale: Optional[float], q: Tensor) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: Optional[float]
            ) -> tuple[Tensor, Tensor]:
    out = new_output(q, q.shape)  # (B, H, S, D) contiguous, written through a (B, S, H, D) view
    _, lse = _KERNELS._fwd(_bshd(q), _bshd(k), _bshd(v), ((0, _mask(q.shape[2], is_causal)),),
                           _scale(scale, q), 0.0, out=_bshd(out))
    return out, lse


attention_fwd = torch.library.custom_op("dlm::attention_fwd", mutates_args=())(_forward)


@attention_fwd.register_fake
def _(q, k, v, is_causal, scale):
    b, h, s, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=torch.float32)


def _backward_body(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   dlse: Optional[Tensor], is_causal: bool, scale: Optional[float]
                  ) -> tuple[Tensor, Tensor, Tensor]:
    grads = tuple(new_output(t, t.shape) for t in (q, k, v))
    _KERNELS._bwd(_bshd(dout), _bshd(q), _bshd(k), _bshd(v), _bshd(out), lse, dlse,
                  ((0, _mask(q.shape[2], is_causal)),), _scale(scale, q), 0.0,
                  grads=tuple(_bshd(g) for g in grads))
    return grads


attention_bwd = torch.library.custom_op("dlm::attention_bwd", mutates_args=())(_backward_body)


@attention_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, is_causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward_with(bwd_call):
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = bwd_call(dout, q, k, v, out, lse, dlse, ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None
    return backward


attention_fwd.register_autograd(_backward_with(attention_bwd), setup_context=_setup_context)
_attention = EagerOp("attention", attention_fwd, _forward, _setup_context,
                     _backward_with(_backward_body))
