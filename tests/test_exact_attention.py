"""dlm_ops.attention: the SDPA surface, its strict contract, a deterministic backward."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import dlm_ops
from dlm_ops import UnsupportedConfig
from dlm_ops.backends.triton_backend import INTERPRET
from dlm_ops.ops import exact
from dlm_ops.reference import block_causal_mask, masked_attention_ref

from .accuracy import check_against_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
runs_here = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a GPU or TRITON_INTERPRET=1")


def _qkv(b, h, s, d, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, generator=g).to(device=DEVICE, dtype=dtype) for _ in range(3))


def _ref(q, k, v, is_causal, scale=None, **kw):
    """The reference in (B, H, S, D): its (B, S, H, D) twin, transposed in and out."""
    s = q.shape[2]
    mask = block_causal_mask(s, 1 if is_causal else max(s, 1), q.device)
    out, lse = masked_attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), mask,
                                    softmax_scale=scale, **kw)
    return out.transpose(1, 2), lse


@runs_here
@settings(max_examples=10)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 150), st.sampled_from([16, 32, 64]),
       st.booleans(), st.sampled_from([None, 0.2]),
       st.sampled_from([torch.float16] + ([torch.bfloat16] if CUDA else [])))
def test_matches_reference(b, h, s, d, is_causal, scale, dtype):
    check_against_reference(
        lambda q, k, v: exact.attention_fwd(q, k, v, is_causal, scale),
        lambda q, k, v, **kw: _ref(q, k, v, is_causal, scale, **kw),
        _qkv(b, h, s, d, dtype, seed=s), dtype)


@runs_here
def test_public_function_returns_sdpa_layout():
    q, k, v = _qkv(1, 2, 40, 32)
    out = dlm_ops.attention(q, k, v, is_causal=True)
    assert out.shape == q.shape and out.is_contiguous()
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=0)


@runs_here
def test_backward_bitwise_deterministic():
    q, k, v = _qkv(1, 2, 96, 32, seed=1)
    dout = torch.randn_like(q)
    runs = []
    for _ in range(3):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = dlm_ops.attention(*inputs, is_causal=True)
        runs.append((out, *torch.autograd.grad(out, inputs, dout)))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


@runs_here
def test_opcheck():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 24, 16))
    torch.library.opcheck(exact.attention_fwd, (q, k, v, True, None))
    out, lse = exact.attention_fwd(q, k, v, False, 0.3)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
            torch.randn_like(lse), False, 0.3)
    torch.library.opcheck(exact.attention_bwd, args)


@pytest.mark.parametrize("make,kwargs,why", [
    (lambda q, k, v: (q.float(), k.float(), v.float()), {}, "float16 or bfloat16"),
    (lambda q, k, v: (q, k[:, :1], v[:, :1]), {}, "no GQA"),
    (lambda q, k, v: (q, k[:, :, :8], v[:, :, :8]), {}, "no GQA or cross-attention"),
    (lambda q, k, v: (q[..., :24], k[..., :24], v[..., :24]), {}, "power of two in \\[16, 256\\], got 24"),
    (lambda q, k, v: (q[0], k[0], v[0]), {}, "4-D"),
    (lambda q, k, v: (q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2)), {},
     "last dimension.*contiguous"),
    (lambda q, k, v: (q, k, v), {"scale": -1.0}, "positive finite"),
    (lambda q, k, v: (q, k, v), {"is_causal": 1}, "is_causal must be a bool"),
])
def test_contract_refusals(make, kwargs, why):
    q, k, v = make(*_qkv(1, 2, 32, 32))
    assert not dlm_ops.is_eligible(q, k, v, **kwargs)
    with pytest.raises(UnsupportedConfig, match=why):
        dlm_ops.attention(q, k, v, **kwargs)


def test_cpu_is_refused_without_the_interpreter():
    code = ("import torch, dlm_ops\n"
            "q = torch.randn(1, 2, 8, 16, dtype=torch.float16)\n"
            "assert not dlm_ops.is_eligible(q, q, q)\n"
            "try:\n    dlm_ops.attention(q, q, q)\n"
            "except dlm_ops.UnsupportedConfig as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "tensors must be on a CUDA device, got cpu" in r.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_against_sdpa_flash(is_causal, d):
    q, k, v = (t.requires_grad_() for t in _qkv(2, 8, 1024, d, torch.bfloat16, seed=d))
    check_against_reference(
        lambda q, k, v: exact.attention_fwd(q, k, v, is_causal, None),
        lambda q, k, v, **kw: _ref(q, k, v, is_causal, **kw), (q, k, v), torch.bfloat16)
