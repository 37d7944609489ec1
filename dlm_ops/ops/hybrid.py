"""Block-hybrid attention (LLaDA-Hybrid): exact softmax inside the active block, linear attention
over the earlier blocks through a state, one shared normalisation.

Definitions (the references in dlm_ops/reference.py and every backend compute exactly this):

    phi_h(x) = concat(softmax(x W_h), softmax(-x W_h))     W_h = feature_weight[h] (D, F), softmax
                                                           over F in fp32: phi has 2F features
    state per query head: S (2F, D), Z (2F,), fp32
    active block, queries i and keys j of the block:
        s_ij = scale * q_i . k_j,   a_ij = exp(s_ij - max_j s_ij),   w_h = sigmoid(gate_h)
        out_i = (w * sum_j a_ij v_j + phi(q_i) S) / den_i
        den_i = max(w * sum_j a_ij, 1e-6) + max(phi(q_i) . Z, 1e-6)
    committing a block: S += sum_j phi(k_j)^T v_j,  Z += sum_j phi(k_j)

The in-block exponentials are not normalised (their row max is 1), so the in-block part weighs
against the state by sum_j a_ij; the 1e-6 clamps follow the paper's reference. GQA: query head h
reads kv head h // (H / Hkv) and applies its own W_h to its queries and to those keys; S and Z are
kept per query head.

Ops (no lse: the shared denominator is not a log-sum-exp, so there is nothing to merge):
    dlm::block_hybrid_attn            decode step: (q, k, v, S, Z, W, gate) -> out
    dlm::hybrid_state_update          (S, Z, k, v, W) -> (S', Z') new tensors
    dlm::block_hybrid_train_fwd/_bwd  training form on [noisy | clean] halves, with autograd for
                                      q, k, v, feature_weight and gate

No ``from __future__ import annotations``: torch.library reads the annotations as types.
"""

import math
from typing import Optional

import torch
from torch import Tensor

from ..backends import select
from ..backends.base import GQA, lse_dtype
from ..backends.hybrid import HybridProblem  # importing it registers the "hybrid" backends
from .eager import EagerOp
from .validation import DTYPES, check_even_seqlen, check_options, check_qkv

LAYOUT = "(batch, seqlen, heads, head_dim)"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _scale(softmax_scale: Optional[float], q: Tensor) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _impl(q: Tensor, k: Tensor, feature_weight: Tensor, backend: Optional[str], block: int = 0,
          train_block: int = 0):
    """The backend for a call; ``block`` is the active block of a decode call (the fused kernel
    holds it whole), ``train_block`` the block length min(block_size, n) of a training call (a
    fused kernel holds one or more blocks per tile). The forward and backward ops pass the same
    values, so both run on the same backend."""
    features = frozenset({GQA}) if k.shape[-2] != q.shape[-2] else frozenset()
    problem = HybridProblem(q.device.type, q.dtype, q.shape[-1], features, block=block,
                            num_features=feature_weight.shape[-1], train_block=train_block)
    return select(problem, backend, family="hybrid")


# -- validation -------------------------------------------------------------------------------


def _check_params(feature_weight, gate, q) -> None:
    """feature_weight (H, D, F) and gate (H,), floating, on q's device."""
    h, d = q.shape[-2], q.shape[-1]
    for name, t in (("feature_weight", feature_weight), ("gate", gate)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name}.dtype must be one of {[str(x) for x in _FLOATS]}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")
    if feature_weight.dim() != 3 or feature_weight.shape[:2] != (h, d) or feature_weight.shape[2] < 1:
        raise ValueError(f"feature_weight must have shape (heads={h}, head_dim={d}, F >= 1), got "
                         f"{tuple(feature_weight.shape)}")
    if gate.shape != (h,):
        raise ValueError(f"gate must have shape (heads={h},), got {tuple(gate.shape)}")


def _check_state(state_s, state_z, batch, heads, features, head_dim, dtype) -> None:
    """state_s (B, H, 2F, D), state_z (B, H, 2F) in float32 (float64 for float64 inputs)."""
    want = lse_dtype(dtype)
    for name, t, shape in (("state_s", state_s, (batch, heads, 2 * features, head_dim)),
                           ("state_z", state_z, (batch, heads, 2 * features))):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != want:
            raise ValueError(f"{name}.dtype must be {want} for {dtype} inputs, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def _check_decode(q, k, v, state_s, state_z, feature_weight, gate, softmax_scale) -> None:
    check_qkv(q, k, v, LAYOUT)
    if q.shape[1] < 1:
        raise ValueError("q must hold the active block (q.shape[1] >= 1), got 0 tokens")
    check_options(1, softmax_scale, 0.0)
    _check_params(feature_weight, gate, q)
    _check_state(state_s, state_z, q.shape[0], q.shape[2], feature_weight.shape[-1], q.shape[-1],
                 q.dtype)
    if state_s.device != q.device or state_z.device != q.device:
        raise ValueError(f"state_s and state_z must be on q's device ({q.device})")


def _check_update(state_s, state_z, k, v, feature_weight) -> None:
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor {LAYOUT}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype must be one of {[str(d) for d in DTYPES]}, got {t.dtype}")
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v must have k's shape {tuple(k.shape)} and dtype {k.dtype}, got "
                         f"{tuple(v.shape)} {v.dtype}")
    if not isinstance(state_s, Tensor) or state_s.dim() != 4:
        raise ValueError("state_s must be a 4-D tensor (batch, heads, 2F, head_dim)")
    b, h, _, d = state_s.shape
    if k.shape[0] != b or k.shape[-1] != d or k.shape[2] < 1 or h % k.shape[2]:
        raise ValueError(f"k must have shape (batch={b}, block, Hkv, head_dim={d}) with heads={h} "
                         f"a multiple of Hkv, got {tuple(k.shape)}")
    if not isinstance(feature_weight, Tensor) or feature_weight.dim() != 3 \
            or feature_weight.shape[:2] != (h, d):
        got = tuple(feature_weight.shape) if isinstance(feature_weight, Tensor) else feature_weight
        raise ValueError(f"feature_weight must have shape (heads={h}, head_dim={d}, F), got {got}")
    _check_state(state_s, state_z, b, h, feature_weight.shape[-1], d, k.dtype)
    for name, t in (("k", k), ("v", v), ("state_z", state_z), ("feature_weight", feature_weight)):
        if t.device != state_s.device:
            raise ValueError(f"{name} must be on state_s's device ({state_s.device}), got {t.device}")


def _train_block(q: Tensor, block_size: int) -> int:
    """The block length of a training call: block_size > n is one block of n tokens per half."""
    return min(block_size, q.shape[1] // 2)


def _check_train(q, k, v, feature_weight, gate, block_size, softmax_scale) -> None:
    check_qkv(q, k, v, LAYOUT)
    check_options(block_size, softmax_scale, 0.0)
    check_even_seqlen(q)
    _check_params(feature_weight, gate, q)


# -- ops --------------------------------------------------------------------------------------


# Each op's body is its check and then its run; the public functions validate first and their
# eager way (EagerOp, below) calls the run alone.
def _decode_run(q, k, v, state_s, state_z, feature_weight, gate, softmax_scale, backend):
    impl = _impl(q, k, feature_weight, backend, block=q.shape[1])
    return impl.decode(q, k, v, state_s, state_z, feature_weight, gate, _scale(softmax_scale, q))


def _decode(q: Tensor, k: Tensor, v: Tensor, state_s: Tensor, state_z: Tensor,
            feature_weight: Tensor, gate: Tensor, softmax_scale: Optional[float],
            backend: Optional[str]) -> Tensor:
    _check_decode(q, k, v, state_s, state_z, feature_weight, gate, softmax_scale)
    return _decode_run(q, k, v, state_s, state_z, feature_weight, gate, softmax_scale, backend)


block_hybrid_attn_op = torch.library.custom_op("dlm::block_hybrid_attn", mutates_args=())(_decode)


@block_hybrid_attn_op.register_fake
def _(q, k, v, state_s, state_z, feature_weight, gate, softmax_scale, backend):
    _check_decode(q, k, v, state_s, state_z, feature_weight, gate, softmax_scale)
    return q.new_empty(q.shape)


def _state_update_run(state_s, state_z, k, v, feature_weight, backend):
    # Dispatch on the keys' dtype and the state's head count (the queries are not involved).
    problem = HybridProblem(k.device.type, k.dtype, k.shape[-1],
                            frozenset({GQA}) if k.shape[2] != state_s.shape[1] else frozenset(),
                            block=k.shape[1], num_features=feature_weight.shape[-1])
    return select(problem, backend, family="hybrid").state_update(state_s, state_z, k, v,
                                                                  feature_weight)


def _state_update(state_s: Tensor, state_z: Tensor, k: Tensor, v: Tensor, feature_weight: Tensor,
                  backend: Optional[str]) -> tuple[Tensor, Tensor]:
    _check_update(state_s, state_z, k, v, feature_weight)
    return _state_update_run(state_s, state_z, k, v, feature_weight, backend)


hybrid_state_update_op = torch.library.custom_op("dlm::hybrid_state_update",
                                                 mutates_args=())(_state_update)


@hybrid_state_update_op.register_fake
def _(state_s, state_z, k, v, feature_weight, backend):
    _check_update(state_s, state_z, k, v, feature_weight)
    return state_s.new_empty(state_s.shape), state_z.new_empty(state_z.shape)


def _train_run(q, k, v, feature_weight, gate, block_size, softmax_scale, backend):
    return _impl(q, k, feature_weight, backend, train_block=_train_block(q, block_size)).train_fwd(
        q, k, v, feature_weight, gate, block_size, _scale(softmax_scale, q))


def _train_forward(q: Tensor, k: Tensor, v: Tensor, feature_weight: Tensor, gate: Tensor,
                   block_size: int, softmax_scale: Optional[float], backend: Optional[str]
                  ) -> Tensor:
    _check_train(q, k, v, feature_weight, gate, block_size, softmax_scale)
    return _train_run(q, k, v, feature_weight, gate, block_size, softmax_scale, backend)


block_hybrid_train_fwd = torch.library.custom_op("dlm::block_hybrid_train_fwd",
                                                 mutates_args=())(_train_forward)


@block_hybrid_train_fwd.register_fake
def _(q, k, v, feature_weight, gate, block_size, softmax_scale, backend):
    _check_train(q, k, v, feature_weight, gate, block_size, softmax_scale)
    return q.new_empty(q.shape)


def _train_backward_body(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, feature_weight: Tensor,
                         gate: Tensor, block_size: int, softmax_scale: Optional[float],
                         backend: Optional[str]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _impl(q, k, feature_weight, backend, train_block=_train_block(q, block_size)).train_bwd(
        dout, q, k, v, feature_weight, gate, block_size, _scale(softmax_scale, q))


block_hybrid_train_bwd = torch.library.custom_op("dlm::block_hybrid_train_bwd",
                                                 mutates_args=())(_train_backward_body)


@block_hybrid_train_bwd.register_fake
def _(dout, q, k, v, feature_weight, gate, block_size, softmax_scale, backend):
    return tuple(t.new_empty(t.shape) for t in (q, k, v, feature_weight, gate))


def _train_setup_context(ctx, inputs, output):
    q, k, v, feature_weight, gate, block_size, softmax_scale, backend = inputs
    ctx.save_for_backward(q, k, v, feature_weight, gate)  # the backward recomputes the forward
    ctx.block_size, ctx.softmax_scale, ctx.backend = block_size, softmax_scale, backend


def _train_backward_with(bwd_call):
    def backward(ctx, dout):
        q, k, v, feature_weight, gate = ctx.saved_tensors
        grads = bwd_call(dout.contiguous(), q, k, v, feature_weight, gate, ctx.block_size,
                         ctx.softmax_scale, ctx.backend)
        return (*grads, None, None, None)
    return backward


block_hybrid_train_fwd.register_autograd(_train_backward_with(block_hybrid_train_bwd),
                                         setup_context=_train_setup_context)

# The public functions' way in (dlm_ops/ops/eager.py); the decode-step ops have no backward.
_block_hybrid_attn = EagerOp("block_hybrid_attn", block_hybrid_attn_op, _decode_run)
_hybrid_state_update = EagerOp("hybrid_state_update", hybrid_state_update_op, _state_update_run)
_block_hybrid_train = EagerOp("block_hybrid_train", block_hybrid_train_fwd, _train_run,
                              _train_setup_context, _train_backward_with(_train_backward_body))


# -- public API -------------------------------------------------------------------------------


def block_hybrid_attn(q, k, v, state_s, state_z, feature_weight, gate, *, softmax_scale=None,
                      backend=None):
    """Block-hybrid attention of one active block (decode step; definitions in this module).

    q: (B, bs, H, D); k, v: (B, bs, Hkv, D), the block's own keys (H % Hkv == 0).
    state_s: (B, H, 2F, D), state_z: (B, H, 2F), float32 (float64 for float64 inputs): the
    committed blocks, built with ``hybrid_state_update`` (zeros before the first block).
    feature_weight: (H, D, F); gate: (H,) before the sigmoid.
    softmax_scale: None means 1/sqrt(D). backend: force "torch" or "triton"; None picks.
    Returns out (B, bs, H, D) in q's dtype. No autograd (a sampling op).
    """
    _check_decode(q, k, v, state_s, state_z, feature_weight, gate, softmax_scale)
    return _block_hybrid_attn((q, k, v, state_s, state_z, feature_weight, gate), q, k, v, state_s,
                              state_z, feature_weight, gate, softmax_scale, backend)


def hybrid_state_update(state_s, state_z, k, v, feature_weight, *, backend=None):
    """Commit a block: returns new (state_s + sum_j phi(k_j)^T v_j, state_z + sum_j phi(k_j)).

    k, v: (B, bs, Hkv, D) the committed block's keys and values; state_s (B, H, 2F, D) and
    state_z (B, H, 2F) as in ``block_hybrid_attn`` (not modified).
    """
    _check_update(state_s, state_z, k, v, feature_weight)
    return _hybrid_state_update((state_s, state_z, k, v, feature_weight), state_s, state_z, k, v,
                                feature_weight, backend)


def block_hybrid_train_attn(q, k, v, feature_weight, gate, block_size, *, softmax_scale=None,
                            backend=None):
    """Training form of block-hybrid attention on (B, 2n, H, D) [noisy | clean] halves.

    The queries of block b (blocks restart in each half; the last may be partial; block_size > n is
    one block) read the state built from the CLEAN blocks 0..b-1, plus exact softmax within their
    own block of their own half. k, v: (B, 2n, Hkv, D). Differentiable w.r.t. q, k, v,
    feature_weight and gate. Returns out (B, 2n, H, D).
    """
    _check_train(q, k, v, feature_weight, gate, block_size, softmax_scale)
    return _block_hybrid_train((q, k, v, feature_weight, gate), q, k, v, feature_weight, gate,
                               block_size, softmax_scale, backend)
