"""Every bad input raises a ValueError naming the argument, before any kernel runs."""

import pytest
import torch

import dlm_ops
from dlm_ops import UnsupportedConfig


def _qkv(b=1, s=8, h=4, hkv=2, d=16, dtype=torch.float32):
    return (torch.randn(b, s, h, d, dtype=dtype), torch.randn(b, s, hkv, d, dtype=dtype),
            torch.randn(b, s, hkv, d, dtype=dtype))


def _varlen(total=8, h=4, hkv=2, d=16):
    return torch.randn(total, h, d), torch.randn(total, hkv, d), torch.randn(total, hkv, d)


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v: (q[0], k, v), r"q must be 4-D"),
    (lambda q, k, v: (q, k[0], v), r"k must be 4-D"),
    (lambda q, k, v: (q[:, :7], k[:, :7], v[:, :7]), r"even sequence length 2n.*seqlen 7"),
    (lambda q, k, v: (q, k.half(), v), r"k.dtype must equal q.dtype"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), r"q.dtype must be one of"),
    (lambda q, k, v: (q, k, v[..., :8]), r"v must have k's shape"),
    (lambda q, k, v: (q, k[:, :4], v[:, :4]), r"k must have shape"),
    (lambda q, k, v: (q[:, :, :3], k, v), r"multiple of k's \(2\)"),
    (lambda q, k, v: (*_qkv(d=264),), r"head_dim must be a multiple of 8 in \[8, 256\], got 264"),
    (lambda q, k, v: (*_qkv(d=12),), r"head_dim must be a multiple of 8.*got 12"),
    (lambda q, k, v: (q, k.to("meta"), v), r"k must be on q's device"),
])
def test_bad_tensors(mutate, match):
    q, k, v = mutate(*_qkv())
    with pytest.raises(ValueError, match=match):
        dlm_ops.diffusion_attn_func(q, k, v, 2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=0), r"block_size must be >= 1, got 0"),
    (dict(block_size=2.0), r"block_size must be an int"),
    (dict(block_size=2, softmax_scale=0.0), r"softmax_scale must be > 0"),
    (dict(block_size=2, softcap=-1.0), r"softcap must be >= 0"),
])
def test_bad_options(kwargs, match):
    for fn in (dlm_ops.diffusion_attn_func, dlm_ops.block_causal_attn_func):
        with pytest.raises(ValueError, match=match):
            fn(*_qkv(), **kwargs)


def test_block_causal_takes_odd_lengths_and_checks_rank():
    q, k, v = _qkv(s=7)
    assert dlm_ops.block_causal_attn_func(q, k, v, 2).shape == q.shape
    with pytest.raises(ValueError, match="q must be 4-D"):
        dlm_ops.block_causal_attn_func(q[0], k, v, 2)


@pytest.mark.parametrize("cu,max_seqlen,match", [
    (torch.tensor([0, 4, 8], dtype=torch.int64), 4, r"cu_seqlens must be an int32 tensor"),
    ([0, 4, 8], 4, r"cu_seqlens must be an int32 tensor, got list"),
    (torch.tensor([[0, 4, 8]], dtype=torch.int32), 4, r"cu_seqlens must be 1-D"),
    (torch.tensor([2, 4, 8], dtype=torch.int32), 4, r"cu_seqlens\[0\] must be 0, got 2"),
    (torch.tensor([0, 6, 4, 8], dtype=torch.int32), 6, r"non-decreasing.*cu_seqlens\[2\] = 4"),
    (torch.tensor([0, 3, 8], dtype=torch.int32), 5, r"even length.*sample 0.*length 3"),
    (torch.tensor([0, 4, 6], dtype=torch.int32), 4, r"cu_seqlens\[-1\] must equal.*= 8, got 6"),
    (torch.tensor([0, 2, 8], dtype=torch.int32), 4, r"max_seqlen must be >= the longest sample \(6\)"),
    (torch.tensor([0, 4, 8], dtype=torch.int32), -1, r"max_seqlen must be an int >= 0"),
])
def test_bad_cu_seqlens(cu, max_seqlen, match):
    with pytest.raises(ValueError, match=match):
        dlm_ops.diffusion_attn_varlen_func(*_varlen(), cu, max_seqlen, 2)


def test_varlen_rank_and_heads():
    q, k, v = _varlen()
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q must be 3-D \(total_tokens, heads, head_dim\)"):
        dlm_ops.diffusion_attn_varlen_func(q[None], k, v, cu, 8, 2)
    with pytest.raises(ValueError, match=r"multiple of k's \(3\)"):
        dlm_ops.diffusion_attn_varlen_func(q, k.repeat(1, 2, 1)[:, :3], v.repeat(1, 2, 1)[:, :3],
                                           cu, 8, 2)


def test_forced_backend_that_cannot_run_says_why():
    torch_backend = dlm_ops.backends.BACKENDS["torch"]
    q, k, v = _qkv()
    # Every dtype we accept is one the torch backend runs, so narrow its table for this test.
    caps = torch_backend.capabilities
    narrowed = type(caps)(caps.device_types, frozenset({torch.float64}), caps.max_head_dim,
                          caps.head_dim_multiple, caps.features)
    try:
        type(torch_backend).capabilities = narrowed
        with pytest.raises(UnsupportedConfig, match=r"backend 'torch' cannot run float32 head_dim 16 on cpu with gqa: dtype torch.float32"):
            dlm_ops.diffusion_attn_func(q, k, v, 2, backend="torch")
        with pytest.raises(UnsupportedConfig, match=r"(?s)no backend can run.*torch: dtype"):
            dlm_ops.diffusion_attn_func(q, k, v, 2)
    finally:
        type(torch_backend).capabilities = caps
