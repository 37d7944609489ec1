"""Cached-block attention family: block decoding over a KV cache, the LSE merge, FlashBlock.

    dlm::block_decode_attn    q (B, bs, H, D) = the current block, over a KV cache
                              (B, Smax, Hkv, D) with per-sample lengths, plus the block's own keys
                              (k_new, v_new) as if appended; no mask. -> (out, lse)
    dlm::merge_attn_states    exact merge of two partial attentions over disjoint key sets
    dlm::flashblock_attn      FlashBlock reuse: block-internal attention merged with a cached
                              block-external (out, lse), in one kernel
    dlm::flashblock_refresh   one pass over cache + block: the full (out, lse) and the
                              block-external (out, lse) to cache for later reuse steps

lse is float32 (float64 for float64 inputs), natural log, (B, H, bs); a row that sees no key has
out 0 and lse -inf. Only merge_attn_states is differentiable (a few elementwise ops); the decode
ops are inference-only and say so when a backward reaches them.
Backends: dlm_ops/backends/cached.py.

No ``from __future__ import annotations``: torch.library reads the annotations as types.
"""

import math
from typing import Optional

import torch
from torch import Tensor

from ..backends import cached as _cached_backends  # noqa: F401  (registers family "cached")
from ..backends import select
from ..backends.base import GQA, Problem, lse_dtype
from .eager import EagerOp
from .validation import DTYPES, MAX_HEAD_DIM

FAMILY = "cached"


# -- validation (before any kernel, and in the fake functions) ----------------------------------


def _check_tensor(name, t, rank, layout):
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")


def _check_like(name, t, q, dtypes=None):
    allowed = dtypes or (q.dtype,)
    if t.dtype not in allowed:
        raise ValueError(f"{name}.dtype must be {' or '.join(map(str, allowed))}, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")


def _check_q(q):
    _check_tensor("q", q, 4, "(batch, block_len, heads, head_dim)")
    if q.dtype not in DTYPES:
        raise ValueError(f"q.dtype must be one of {[str(d) for d in DTYPES]}, got {q.dtype}")
    d = q.shape[-1]
    if d < 8 or d > MAX_HEAD_DIM or d % 8:
        raise ValueError(f"head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {d}")


def _check_kv(names, k, v, q, seqlen=None):
    """k, v (B, S, Hkv, D) against q (B, bs, H, D); ``seqlen`` fixes S (else any)."""
    nk, nv = names
    for name, t in ((nk, k), (nv, v)):
        _check_tensor(name, t, 4, "(batch, seqlen, kv_heads, head_dim)")
        _check_like(name, t, q)
    if k.shape != v.shape:
        raise ValueError(f"{nv} must have {nk}'s shape {tuple(k.shape)}, got {tuple(v.shape)}")
    b, bs, h, d = q.shape
    s = k.shape[1] if seqlen is None else seqlen
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(f"{nk} must have shape {(b, 'Smax' if seqlen is None else s, 'Hkv', d)} "
                         f"to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if k.shape[2] < 1 or h % k.shape[2]:
        raise ValueError(f"q's head count ({h}) must be a multiple of {nk}'s ({k.shape[2]}) "
                         "(GQA/MQA), with at least one kv head")


def _check_scale(softmax_scale):
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float))
                                          and not isinstance(softmax_scale, bool)
                                          and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float or None "
                         f"(1/sqrt(head_dim)), got {softmax_scale!r}")


def _check_seqlens(cache_seqlens, q):
    if cache_seqlens is None:
        return
    if not isinstance(cache_seqlens, Tensor) or cache_seqlens.dtype != torch.int32:
        got = (cache_seqlens.dtype if isinstance(cache_seqlens, Tensor)
               else type(cache_seqlens).__name__)
        raise ValueError(f"cache_seqlens must be an int32 tensor or None, got {got}")
    if tuple(cache_seqlens.shape) != (q.shape[0],):
        raise ValueError(f"cache_seqlens must have shape (batch,) = ({q.shape[0]},), got "
                         f"{tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens must be on q's device ({q.device}), got "
                         f"{cache_seqlens.device}")


def _check_seqlen_values(cache_seqlens, smax):
    """Values in [0, Smax]. On CPU a plain check. On a GPU reading them on the host would cost a
    sync per decode step (measured on the H200 at B=1: 450 vs 310 us per eager call), so there the
    check is a device-side assert queued on the stream (``torch._assert_async``): a bad value
    stops the program at the next sync instead of raising here. The kernels clamp to [0, Smax]
    either way, so a bad value can never read out of bounds."""
    if cache_seqlens is None or cache_seqlens.numel() == 0 or torch.compiler.is_compiling():
        return
    if cache_seqlens.is_cuda:
        if not torch.cuda.is_current_stream_capturing():
            torch._assert_async(((cache_seqlens >= 0) & (cache_seqlens <= smax)).all(),
                                f"cache_seqlens must lie in [0, k_cache.shape[1]] = [0, {smax}]")
        return
    lo, hi = (int(x) for x in torch.aminmax(cache_seqlens))
    if lo < 0 or hi > smax:
        raise ValueError(f"cache_seqlens must lie in [0, k_cache.shape[1]] = [0, {smax}], got "
                         f"values in [{lo}, {hi}]")


def _check_decode(q, k_cache, v_cache, cache_seqlens, k_new, v_new, softmax_scale):
    _check_q(q)
    _check_kv(("k_cache", "v_cache"), k_cache, v_cache, q)
    _check_seqlens(cache_seqlens, q)
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together (or both None)")
    if k_new is not None:
        _check_kv(("k_new", "v_new"), k_new, v_new, q, seqlen=q.shape[1])
        if k_new.shape[2] != k_cache.shape[2]:
            raise ValueError(f"k_new must have k_cache's kv head count ({k_cache.shape[2]}), "
                             f"got {k_new.shape[2]}")
    _check_scale(softmax_scale)


def _check_cached_state(q, cached_out, cached_lse, dirty):
    lse_t = lse_dtype(q.dtype)
    _check_tensor("cached_out", cached_out, 4, "(batch, block_len, heads, head_dim)")
    _check_like("cached_out", cached_out, q, tuple(dict.fromkeys((q.dtype, lse_t))))
    if cached_out.shape != q.shape:
        raise ValueError(f"cached_out must have q's shape {tuple(q.shape)}, got "
                         f"{tuple(cached_out.shape)}")
    _check_tensor("cached_lse", cached_lse, 3, "(batch, heads, block_len)")
    _check_like("cached_lse", cached_lse, q, (lse_t,))
    b, bs, h, _ = q.shape
    if tuple(cached_lse.shape) != (b, h, bs):
        raise ValueError(f"cached_lse must have shape (batch, heads, block_len) = {(b, h, bs)}, "
                         f"got {tuple(cached_lse.shape)}")
    if dirty is not None:
        _check_tensor("dirty", dirty, 2, "(batch, block_len)")
        _check_like("dirty", dirty, q, (torch.bool,))
        if tuple(dirty.shape) != (b, bs):
            raise ValueError(f"dirty must have shape (batch, block_len) = {(b, bs)}, got "
                             f"{tuple(dirty.shape)}")


def _check_block(q, k_block, v_block, cached_out, cached_lse, dirty, softmax_scale):
    _check_q(q)
    _check_kv(("k_block", "v_block"), k_block, v_block, q, seqlen=q.shape[1])
    _check_cached_state(q, cached_out, cached_lse, dirty)
    _check_scale(softmax_scale)


def _check_merge(out_a, lse_a, out_b, lse_b):
    _check_tensor("out_a", out_a, 4, "(batch, seqlen, heads, head_dim)")
    if out_a.dtype not in DTYPES:
        raise ValueError(f"out_a.dtype must be one of {[str(d) for d in DTYPES]}, "
                         f"got {out_a.dtype}")
    _check_tensor("out_b", out_b, 4, "(batch, seqlen, heads, head_dim)")
    _check_like("out_b", out_b, out_a)
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b must have out_a's shape {tuple(out_a.shape)}, got "
                         f"{tuple(out_b.shape)}")
    b, s, h, _ = out_a.shape
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        _check_tensor(name, t, 3, "(batch, heads, seqlen)")
        _check_like(name, t, out_a, (lse_dtype(out_a.dtype),))
        if tuple(t.shape) != (b, h, s):
            raise ValueError(f"{name} must have shape (batch, heads, seqlen) = {(b, h, s)}, got "
                             f"{tuple(t.shape)}")


# -- ops -------------------------------------------------------------------------------------


def _float(softmax_scale):
    return None if softmax_scale is None else float(softmax_scale)  # the schema takes a float


def _scale(softmax_scale, q):
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _impl(q, kv_heads, backend):
    features = frozenset({GQA}) if kv_heads != q.shape[2] else frozenset()
    return select(Problem(q.device.type, q.dtype, q.shape[-1], features), backend, family=FAMILY)


def _inference_only(name):
    def backward(ctx, *grads):
        raise RuntimeError(f"dlm::{name} is inference-only: it has no backward. Compute it under "
                           "torch.no_grad() / torch.inference_mode(), or use a training op "
                           "(e.g. dlm_ops.diffusion_attn_func) where gradients are needed.")

    return backward


def _no_context(ctx, inputs, output):
    pass


# Each op's body is its check and then its run; the public functions validate first and their
# eager way (EagerOp, below) calls the run alone.
def _block_decode_run(q, k_cache, v_cache, cache_seqlens, k_new, v_new, softmax_scale, backend):
    impl = _impl(q, k_cache.shape[2], backend)
    out, lse, _, _ = impl.decode(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                 _scale(softmax_scale, q), False)
    return out, lse


def _block_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor],
                  k_new: Optional[Tensor], v_new: Optional[Tensor], softmax_scale: Optional[float],
                  backend: Optional[str]) -> tuple[Tensor, Tensor]:
    _check_decode(q, k_cache, v_cache, cache_seqlens, k_new, v_new, softmax_scale)
    return _block_decode_run(q, k_cache, v_cache, cache_seqlens, k_new, v_new, softmax_scale,
                             backend)


block_decode_attn_op = torch.library.custom_op("dlm::block_decode_attn",
                                               mutates_args=())(_block_decode)


@block_decode_attn_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k_new, v_new, softmax_scale, backend):
    _check_decode(q, k_cache, v_cache, cache_seqlens, k_new, v_new, softmax_scale)
    b, bs, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, bs), dtype=lse_dtype(q.dtype))


block_decode_attn_op.register_autograd(_inference_only("block_decode_attn"),
                                       setup_context=_no_context)


def _flashblock_refresh_run(q, k_cache, v_cache, k_block, v_block, cache_seqlens, softmax_scale,
                            backend):
    impl = _impl(q, k_cache.shape[2], backend)
    return impl.decode(q, k_cache, v_cache, cache_seqlens, k_block, v_block,
                       _scale(softmax_scale, q), True)


def _flashblock_refresh(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_block: Tensor,
                        v_block: Tensor, cache_seqlens: Optional[Tensor],
                        softmax_scale: Optional[float], backend: Optional[str]
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_decode(q, k_cache, v_cache, cache_seqlens, k_block, v_block, softmax_scale)
    return _flashblock_refresh_run(q, k_cache, v_cache, k_block, v_block, cache_seqlens,
                                   softmax_scale, backend)


flashblock_refresh_op = torch.library.custom_op("dlm::flashblock_refresh",
                                                mutates_args=())(_flashblock_refresh)


@flashblock_refresh_op.register_fake
def _(q, k_cache, v_cache, k_block, v_block, cache_seqlens, softmax_scale, backend):
    _check_decode(q, k_cache, v_cache, cache_seqlens, k_block, v_block, softmax_scale)
    b, bs, h, _ = q.shape
    lt = lse_dtype(q.dtype)
    return (q.new_empty(q.shape), q.new_empty((b, h, bs), dtype=lt),
            q.new_empty(q.shape, dtype=lt), q.new_empty((b, h, bs), dtype=lt))


flashblock_refresh_op.register_autograd(_inference_only("flashblock_refresh"),
                                        setup_context=_no_context)


def _flashblock_run(q, k_block, v_block, cached_out, cached_lse, dirty, softmax_scale, backend):
    impl = _impl(q, k_block.shape[2], backend)
    return impl.block(q, k_block, v_block, cached_out, cached_lse, dirty, _scale(softmax_scale, q))


def _flashblock(q: Tensor, k_block: Tensor, v_block: Tensor, cached_out: Tensor, cached_lse: Tensor,
                dirty: Optional[Tensor], softmax_scale: Optional[float], backend: Optional[str]
               ) -> tuple[Tensor, Tensor]:
    _check_block(q, k_block, v_block, cached_out, cached_lse, dirty, softmax_scale)
    return _flashblock_run(q, k_block, v_block, cached_out, cached_lse, dirty, softmax_scale,
                           backend)


flashblock_attn_op = torch.library.custom_op("dlm::flashblock_attn", mutates_args=())(_flashblock)


@flashblock_attn_op.register_fake
def _(q, k_block, v_block, cached_out, cached_lse, dirty, softmax_scale, backend):
    _check_block(q, k_block, v_block, cached_out, cached_lse, dirty, softmax_scale)
    b, bs, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, bs), dtype=lse_dtype(q.dtype))


flashblock_attn_op.register_autograd(_inference_only("flashblock_attn"), setup_context=_no_context)


def _merge_run(out_a, lse_a, out_b, lse_b, backend):
    problem = Problem(out_a.device.type, out_a.dtype, out_a.shape[-1], frozenset())
    return select(problem, backend, family=FAMILY).merge(out_a, lse_a, out_b, lse_b)


def _merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, backend: Optional[str]
          ) -> tuple[Tensor, Tensor]:
    _check_merge(out_a, lse_a, out_b, lse_b)
    return _merge_run(out_a, lse_a, out_b, lse_b, backend)


merge_attn_states_op = torch.library.custom_op("dlm::merge_attn_states", mutates_args=())(_merge)


@merge_attn_states_op.register_fake
def _(out_a, lse_a, out_b, lse_b, backend):
    _check_merge(out_a, lse_a, out_b, lse_b)
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)


def _merge_setup_context(ctx, inputs, output):
    out_a, lse_a, out_b, lse_b, backend = inputs
    out, lse = output
    ctx.save_for_backward(out_a, lse_a, out_b, lse_b, out, lse)


def _merge_backward(ctx, dout, dlse):
    """out = w_a o_a + w_b o_b with w_x = exp(lse_x - lse), lse = logaddexp(lse_a, lse_b):
        d o_x = w_x dout,   d lse_x = w_x (dlse + <o_x - out, dout>).
    A side with w_x = 0 (lse_x = -inf, or underflow) gets zero gradients, never NaN. Plain
    elementwise torch ops (not a kernel op): Inductor fuses them, and they differentiate again."""
    out_a, lse_a, out_b, lse_b, out, lse = ctx.saved_tensors
    cd = torch.float64 if out.dtype == torch.float64 else torch.float32
    dout = torch.zeros_like(out, dtype=cd) if dout is None else dout.to(cd)
    dlse = torch.zeros_like(lse, dtype=cd) if dlse is None else dlse.to(cd)
    grads = []
    for o_x, l_x in ((out_a, lse_a), (out_b, lse_b)):
        l_x = l_x.to(cd)
        live = (l_x > -math.inf) & (lse.to(cd) > -math.inf)
        w = torch.where(live, torch.exp(l_x - torch.where(live, lse.to(cd), 0.0)), 0.0)
        w_t = w.transpose(1, 2)[..., None]  # (B, S, H, 1)
        inner = ((o_x.to(cd) - out.to(cd)) * dout).sum(-1).transpose(1, 2)
        dl = torch.where(w > 0, w * (dlse + inner), 0.0)
        grads += [(w_t * dout).to(o_x.dtype), dl.to(l_x.dtype)]
    d_out_a, d_lse_a, d_out_b, d_lse_b = grads
    return d_out_a, d_lse_a.to(lse_a.dtype), d_out_b, d_lse_b.to(lse_b.dtype), None


merge_attn_states_op.register_autograd(_merge_backward, setup_context=_merge_setup_context)

# Plain eager calls without a gradient run the bodies (dlm_ops/ops/eager.py: a decoding step calls
# these once per layer, where the dispatcher round trip costs more host time than the launches).
# With a gradient the ops run: the first three raise, the merge's backward differentiates again.
_block_decode_attn = EagerOp("block_decode_attn", block_decode_attn_op, _block_decode_run)
_flashblock_refresh_attn = EagerOp("flashblock_refresh", flashblock_refresh_op,
                                   _flashblock_refresh_run)
_flashblock_attn = EagerOp("flashblock_attn", flashblock_attn_op, _flashblock_run)
_merge_attn_states = EagerOp("merge_attn_states", merge_attn_states_op, _merge_run)


# -- public API --------------------------------------------------------------------------------


def block_decode_attn(q, k_cache, v_cache, *, cache_seqlens=None, k_new=None, v_new=None,
                      softmax_scale=None, return_lse=False, backend=None):
    """Attention of the current block over a KV cache, plus the block's own keys (no mask).

    q: (B, bs, H, D), the block's queries. k_cache, v_cache: (B, Smax, Hkv, D), H % Hkv == 0.
    cache_seqlens: int32 (B,) valid cache lengths in [0, Smax] (None: all Smax slots are valid).
    k_new, v_new: (B, bs, Hkv, D) the block's own keys, attended as if appended to the cache (the
    cache is never written). softmax_scale: None means 1/sqrt(D). backend: "triton", "torch" or
    None (best eligible: Triton on CUDA). A row that sees no key gets out 0 and lse -inf.
    Returns out (B, bs, H, D), or (out, lse (B, H, bs) float32 natural log) with return_lse.
    Inference-only (no backward). The values of cache_seqlens are checked without a host sync (on
    a GPU by a device-side assert that fires at the next sync, on CPU at once);
    torch.ops.dlm.block_decode_attn skips that check (its kernels clamp to [0, Smax]).
    """
    _check_decode(q, k_cache, v_cache, cache_seqlens, k_new, v_new, softmax_scale)
    _check_seqlen_values(cache_seqlens, k_cache.shape[1])
    out, lse = _block_decode_attn((q, k_cache, v_cache, cache_seqlens, k_new, v_new), q, k_cache,
                                  v_cache, cache_seqlens, k_new, v_new, _float(softmax_scale),
                                  backend)
    return (out, lse) if return_lse else out


def merge_attn_states(out_a, lse_a, out_b, lse_b, *, backend=None):
    """Exact combination of two partial attentions over disjoint key sets.

    out_a, out_b: (B, S, H, D) normalised outputs; lse_a, lse_b: (B, H, S) natural-log LSEs,
    float32 (float64 for float64 outputs). Returns (out, lse) with lse = logaddexp(lse_a, lse_b)
    and out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b. A side whose lse is -inf is ignored
    (its out may hold anything); both -inf gives out 0, lse -inf. Differentiable.
    """
    _check_merge(out_a, lse_a, out_b, lse_b)
    return _merge_attn_states((out_a, lse_a, out_b, lse_b), out_a, lse_a, out_b, lse_b, backend)


def flashblock_attn(q, k_block, v_block, cached_out, cached_lse, *, dirty=None, softmax_scale=None,
                    return_lse=False, backend=None):
    """FlashBlock reuse step: block-internal attention merged with a cached block-external part.

    q: (B, bs, H, D); k_block, v_block: (B, bs, Hkv, D) the block's keys (no mask).
    cached_out (B, bs, H, D, q.dtype or float32) and cached_lse (B, H, bs, float32): the
    block-external attention from ``flashblock_refresh``. dirty: bool (B, bs) or None; dirty rows
    ignore the cached part (block-internal attention only). One kernel on CUDA.
    Returns out (B, bs, H, D), or (out, lse) with return_lse. Inference-only.
    """
    _check_block(q, k_block, v_block, cached_out, cached_lse, dirty, softmax_scale)
    out, lse = _flashblock_attn((q, k_block, v_block, cached_out, cached_lse, dirty), q, k_block,
                                v_block, cached_out, cached_lse, dirty, _float(softmax_scale),
                                backend)
    return (out, lse) if return_lse else out


def flashblock_refresh(q, k_cache, v_cache, k_block, v_block, *, cache_seqlens=None,
                       softmax_scale=None, backend=None):
    """FlashBlock refresh step: one pass over cache + block.

    Same inputs as ``block_decode_attn`` with k_block, v_block as k_new, v_new. Returns
    (out, lse, cached_out, cached_lse): the full attention (= block_decode_attn up to rounding)
    and the block-external part alone, cached_out float32 (float64 for float64 q). The refresh
    computes the block-external part (split-KV over the cache), then runs the reuse kernel of
    ``flashblock_attn`` on it, so a later reuse on the same block reproduces ``out`` bitwise
    (Triton: 3 launches, partials + combine + FlashBlock kernel). Inference-only.
    """
    _check_decode(q, k_cache, v_cache, cache_seqlens, k_block, v_block, softmax_scale)
    _check_seqlen_values(cache_seqlens, k_cache.shape[1])
    return _flashblock_refresh_attn((q, k_cache, v_cache, k_block, v_block, cache_seqlens), q,
                                    k_cache, v_cache, k_block, v_block, cache_seqlens,
                                    _float(softmax_scale), backend)
