"""torch.compile(fullgraph=True) on CPU, forward and backward, static and dynamic shapes."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import dlm_ops

from .strategies import make_qkv


def _loss_and_grads(fn, q, k, v):
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*inputs)
    loss = (out * out).sum() + lse.sum()
    return (loss, *torch.autograd.grad(loss, inputs))


def _assert_same(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_training_step_matches_eager(dynamic):
    def step(q, k, v):
        q = q * 2.0  # something for Inductor to fuse around the op
        return dlm_ops.diffusion_attn_func(q, k, v, 4, softcap=5.0, return_lse=True)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=dynamic)
    seqlens = [12, 20, 28] if dynamic else [12]
    for s in seqlens:
        q, k, v = make_qkv((2, s, 4, 16), (2, s, 2, 16), torch.float32, seed=s)
        _assert_same(_loss_and_grads(compiled, q, k, v), _loss_and_grads(step, q, k, v))
    assert counter.frame_count == 1, "a new length must not recompile under dynamic=True"


def test_compiled_block_causal_and_varlen():
    cu = torch.tensor([0, 8, 8, 20], dtype=torch.int32)

    def both(q, k, v):
        out, lse = dlm_ops.diffusion_attn_varlen_func(q[0], k[0], v[0], cu, 12, 3, return_lse=True)
        out2, lse2 = dlm_ops.block_causal_attn_func(q, k, v, 5, return_lse=True)
        return out + out2[0], lse + lse2[0]

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(both, backend=counter, fullgraph=True)
    q, k, v = make_qkv((1, 20, 4, 16), (1, 20, 4, 16), torch.float32, seed=0)
    _assert_same(_loss_and_grads(compiled, q, k, v), _loss_and_grads(both, q, k, v))
    assert counter.frame_count == 1


def test_compiled_validation_errors_surface_at_trace_time():
    q, k, v = make_qkv((1, 7, 2, 16), (1, 7, 2, 16), torch.float32, seed=0)
    compiled = torch.compile(lambda q, k, v: dlm_ops.diffusion_attn_func(q, k, v, 2), fullgraph=True)
    with pytest.raises(Exception, match="even sequence length"):
        compiled(q, k, v)
