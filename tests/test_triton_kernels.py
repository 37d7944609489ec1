"""The Triton kernels against the references: on CPU through TRITON_INTERPRET=1 (fp32/fp16,
S <= 512: the interpreter computes bf16 dots wrongly), on a GPU natively in every dtype."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dlm_ops
from dlm_ops.backends.triton_backend import INTERPRET, TileConfig, TritonBackend
from dlm_ops.geometry import SequenceMask
from dlm_ops.reference import (
    block_causal_attn_ref,
    diffusion_attn_ref,
    diffusion_attn_varlen_ref,
)

from .accuracy import check_against_reference
from .strategies import attention_problem, make_qkv

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
pytestmark = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a GPU or TRITON_INTERPRET=1")
FEW = settings(max_examples=12)  # the interpreter runs numpy per program: keep CI in budget


def _on_device(*ts):
    return tuple(t.to(DEVICE) for t in ts)


@FEW
@given(attention_problem(max_n=48, head_dims=(8, 16, 24, 64)), st.sampled_from(DTYPES),
       st.sampled_from([0.0, 2.5]), st.integers(0, 99))
def test_diffusion_attn(p, dtype, softcap, seed):
    b, h, hkv, d, s = p["batch"], p["heads"], p["kv_heads"], p["head_dim"], 2 * p["n"]
    inputs = _on_device(*make_qkv((b, s, h, d), (b, s, hkv, d), dtype, seed))
    bs = p["block_size"]
    check_against_reference(
        lambda q, k, v: dlm_ops.diffusion_attn_func(q, k, v, bs, softcap=softcap, return_lse=True,
                                                    backend="triton"),
        lambda q, k, v, **kw: diffusion_attn_ref(q, k, v, bs, softcap=softcap, **kw),
        inputs, dtype)


@FEW
@given(st.lists(st.integers(0, 40), min_size=1, max_size=4), st.integers(1, 20),
       st.sampled_from(DTYPES), st.integers(0, 99))
def test_varlen(halves, block_size, dtype, seed):
    cu = torch.tensor([0] + [2 * sum(halves[: i + 1]) for i in range(len(halves))], dtype=torch.int32)
    total = int(cu[-1])
    inputs = _on_device(*make_qkv((total, 4, 32), (total, 2, 32), dtype, seed))
    cu = cu.to(DEVICE)
    check_against_reference(
        lambda q, k, v: dlm_ops.diffusion_attn_varlen_func(
            q, k, v, cu, 2 * max(halves), block_size, return_lse=True, backend="triton"),
        lambda q, k, v, **kw: diffusion_attn_varlen_ref(q, k, v, cu, block_size, **kw),
        inputs, dtype)


@pytest.mark.parametrize("seqlen,block_size", [(45, 1), (64, 7), (100, 16)])
def test_block_causal(seqlen, block_size):
    inputs = _on_device(*make_qkv((1, seqlen, 2, 32), (1, seqlen, 1, 32), torch.float16, seqlen))
    check_against_reference(
        lambda q, k, v: dlm_ops.block_causal_attn_func(q, k, v, block_size, return_lse=True,
                                                       backend="triton"),
        lambda q, k, v, **kw: block_causal_attn_ref(q, k, v, block_size, **kw),
        inputs, torch.float16)


@FEW
@given(st.integers(1, 60), st.integers(1, 70), st.sampled_from([16, 32]), st.sampled_from([16, 32]),
       st.sampled_from([0.0, 4.0]))
def test_any_tiling(n, block_size, block_m, block_n, softcap):
    """Tile shapes that split blocks and halves every which way must not change the result."""
    cfg = TileConfig(block_m, block_n)
    be = TritonBackend(configs=(cfg, cfg, cfg))
    q, k, v = _on_device(*make_qkv((2, 2 * n, 4, 16), (2, 2 * n, 2, 16), torch.float32, n))
    mask = SequenceMask.block_diffusion(2 * n, block_size)
    out, lse = be.fwd(q, k, v, mask, 0.25, softcap, False)
    ref_out, ref_lse = diffusion_attn_ref(q, k, v, block_size, softmax_scale=0.25, softcap=softcap,
                                          compute_dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)
    dout = torch.randn_like(out)
    grads = be.bwd(dout, q, k, v, out, lse, None, mask, 0.25, softcap, False)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    o, _ = diffusion_attn_ref(qr, kr, vr, block_size, softmax_scale=0.25, softcap=softcap,
                              compute_dtype=torch.float64)
    for ours, ref in zip(grads, torch.autograd.grad(o, (qr, kr, vr), dout.double())):
        torch.testing.assert_close(ours.double(), ref, atol=5e-5, rtol=0)


def test_triton_agrees_with_torch_backend():
    q, k, v = _on_device(*make_qkv((2, 96, 4, 32), (2, 96, 4, 32), torch.float32, 11))
    a = dlm_ops.diffusion_attn_func(q, k, v, 8, return_lse=True, backend="triton")
    b = dlm_ops.diffusion_attn_func(q, k, v, 8, return_lse=True, backend="torch")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=0)


def test_config_fallback_when_shared_memory_does_not_fit(monkeypatch):
    """A candidate the GPU cannot hold raises OutOfResources at launch: the next one runs and is
    remembered, so later calls launch it directly."""
    from dlm_ops.backends import triton_backend as tb

    too_big, fits = TileConfig(256, 256, 8, 4), TileConfig(32, 32)
    monkeypatch.setattr(tb, "candidates", lambda role, d: [too_big, fits])
    monkeypatch.setattr(tb, "_CHOSEN", {})
    tried = []

    def launch(cfg):
        tried.append(cfg)
        if cfg is too_big:
            raise tb.OutOfResources(300_000, 232_448, "shared memory")

    q = torch.zeros(1, 8, 2, 64)
    tb.TritonBackend()._run("fwd", q, 8, launch)
    tb.TritonBackend()._run("fwd", q, 8, launch)
    assert tried == [too_big, fits, fits]

    monkeypatch.setattr(tb, "candidates", lambda role, d: [too_big])
    monkeypatch.setattr(tb, "_CHOSEN", {})
    with pytest.raises(dlm_ops.UnsupportedConfig, match="no Triton tile config for dq"):
        tb.TritonBackend()._run("dq", q, 8, launch)
