"""Argument checks shared by the op families: they run before any kernel (and inside the fake
functions, so compiled graphs fail at trace time), and every error names the argument and the
value it expected."""

from __future__ import annotations

from collections.abc import Sequence

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256


def check_qkv(q, k, v, layout: str) -> None:
    """q (..., H, D) and k, v (..., Hkv, D) with identical leading dims; ``layout`` names q's dims."""
    rank = len(layout.split(","))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype must be one of {[str(d) for d in DTYPES]}, got {t.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}.dtype must equal q.dtype ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")
    if k.shape != v.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have shape {(*q.shape[:-2], 'Hkv', q.shape[-1])} to match q, "
                         f"got {tuple(k.shape)}")
    heads, kv_heads, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"q's head count ({heads}) must be a multiple of k's ({kv_heads}) "
                         "(GQA/MQA), with at least one kv head")
    if head_dim < 8 or head_dim > MAX_HEAD_DIM or head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {head_dim}")


def check_options(block_size, softmax_scale, softcap) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, torch.SymInt)):
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0 or None (1/sqrt(head_dim)), got {softmax_scale}")
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")


def check_even_seqlen(q) -> None:
    if q.shape[1] % 2:
        raise ValueError("q, k, v must have an even sequence length 2n laid out [noisy | clean], "
                         f"got seqlen {q.shape[1]}")


def check_cu_seqlens(cu_seqlens, q, max_seqlen) -> None:
    """Metadata checks (traceable); ``check_cu_seqlens_values`` needs the values on the host."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32:
        got = cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens must be an int32 tensor, got {got}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens must be 1-D (num_samples + 1,), got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on q's device ({q.device}), got {cu_seqlens.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, torch.SymInt)) \
            or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be an int >= 0, got {max_seqlen!r}")


def check_cu_seqlens_values(cu: Sequence[int], total: int, max_seqlen: int) -> None:
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {cu[0]}")
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{i + 1}] = "
                             f"{cu[i + 1]} < cu_seqlens[{i}] = {cu[i]}")
        if n % 2:
            raise ValueError(f"every sample must have an even length 2m laid out [noisy | clean], "
                             f"but sample {i} (cu_seqlens[{i}:{i + 2}]) has length {n}")
    if cu[-1] != total:
        raise ValueError(f"cu_seqlens[-1] must equal the packed length q.shape[0] = {total}, "
                         f"got {cu[-1]}")
    longest = max(lengths, default=0)
    if max_seqlen < longest:
        raise ValueError(f"max_seqlen must be >= the longest sample ({longest}), got {max_seqlen}")
