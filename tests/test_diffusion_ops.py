"""The block-diffusion op family against the dense references (DESIGN.md section 4 accuracy rule)."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import dlm_ops
from dlm_ops.backends.torch_tiled import TorchTiledBackend
from dlm_ops.geometry import SequenceMask
from dlm_ops.reference import (
    block_causal_attn_ref,
    diffusion_attn_ref,
    diffusion_attn_varlen_ref,
)

from .accuracy import check_against_reference
from .strategies import DTYPES, attention_problem, make_qkv

SOFTCAPS = [0.0, 0.0, 2.5]  # off twice as often as on


def _batched_inputs(p, dtype, seqlen, seed):
    b, h, hkv, d = p["batch"], p["heads"], p["kv_heads"], p["head_dim"]
    return make_qkv((b, seqlen, h, d), (b, seqlen, hkv, d), dtype, seed)


@given(attention_problem(), st.sampled_from(DTYPES), st.sampled_from(SOFTCAPS), st.integers(0, 99))
def test_diffusion_attn(p, dtype, softcap, seed):
    inputs = _batched_inputs(p, dtype, 2 * p["n"], seed)
    bs = p["block_size"]
    check_against_reference(
        lambda q, k, v: dlm_ops.diffusion_attn_func(q, k, v, bs, softcap=softcap, return_lse=True),
        lambda q, k, v, **kw: diffusion_attn_ref(q, k, v, bs, softcap=softcap, **kw),
        inputs, dtype)


@given(attention_problem(), st.sampled_from(DTYPES), st.sampled_from(SOFTCAPS), st.integers(0, 99))
def test_block_causal_attn(p, dtype, softcap, seed):
    seqlen = 2 * p["n"] - seed % 2  # odd lengths are fine here
    inputs = _batched_inputs(p, dtype, seqlen, seed)
    bs = p["block_size"]
    check_against_reference(
        lambda q, k, v: dlm_ops.block_causal_attn_func(q, k, v, bs, softcap=softcap, return_lse=True),
        lambda q, k, v, **kw: block_causal_attn_ref(q, k, v, bs, softcap=softcap, **kw),
        inputs, dtype)


@given(st.lists(st.integers(0, 24), min_size=1, max_size=4), st.sampled_from([(2, 1), (2, 2), (4, 2)]),
       st.integers(1, 30), st.sampled_from(DTYPES), st.sampled_from(SOFTCAPS), st.integers(0, 99))
def test_varlen(halves, heads, block_size, dtype, softcap, seed):
    cu = torch.tensor([0] + [2 * sum(halves[: i + 1]) for i in range(len(halves))], dtype=torch.int32)
    total, (h, hkv) = int(cu[-1]), heads
    inputs = make_qkv((total, h, 16), (total, hkv, 16), dtype, seed)
    max_seqlen = 2 * max(halves)
    check_against_reference(
        lambda q, k, v: dlm_ops.diffusion_attn_varlen_func(
            q, k, v, cu, max_seqlen, block_size, softcap=softcap, return_lse=True),
        lambda q, k, v, **kw: diffusion_attn_varlen_ref(q, k, v, cu, block_size, softcap=softcap, **kw),
        inputs, dtype)


@given(attention_problem(max_n=50), st.integers(1, 17), st.integers(1, 17), st.integers(1, 40),
       st.sampled_from([torch.float32, torch.float64]), st.sampled_from(SOFTCAPS))
def test_torch_backend_any_tiling(p, block_m, block_n, max_run, dtype, softcap):
    """The backend's tiling (FULL/PARTIAL runs, merging) must not change the result."""
    be = TorchTiledBackend(block_m, block_n, max_run)
    q, k, v = _batched_inputs(p, dtype, 2 * p["n"], seed=7)
    mask = SequenceMask.block_diffusion(2 * p["n"], p["block_size"])
    scale = 1 / math.sqrt(p["head_dim"])
    out, lse = be.fwd(q, k, v, mask, scale, softcap, False)
    ref_out, ref_lse = diffusion_attn_ref(q, k, v, p["block_size"], softcap=softcap,
                                          compute_dtype=torch.float64)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol * 10, rtol=0)

    dout = torch.randn_like(out)
    dq, dk, dv = be.bwd(dout, q, k, v, out, lse, None, mask, scale, softcap, False)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    o, _ = diffusion_attn_ref(qr, kr, vr, p["block_size"], softcap=softcap, compute_dtype=torch.float64)
    ref_grads = torch.autograd.grad(o, (qr, kr, vr), dout.double())
    for ours, ref in zip((dq, dk, dv), ref_grads):
        torch.testing.assert_close(ours.double(), ref, atol=tol * 10, rtol=0)


def test_head_dim_256_and_non_contiguous_inputs():
    b, n, h, d = 1, 24, 2, 256
    gen = torch.Generator().manual_seed(0)
    # (B, H, S, D) storage viewed as (B, S, H, D): strided like many model call sites.
    q, k, v = (torch.randn(b, h, 2 * n, d, generator=gen).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    check_against_reference(
        lambda q, k, v: dlm_ops.diffusion_attn_func(q, k, v, 5, return_lse=True),
        lambda q, k, v, **kw: diffusion_attn_ref(q, k, v, 5, **kw),
        (q, k, v), torch.float32)


def test_block_causal_block_size_one_matches_sdpa_causal():
    q, k, v = make_qkv((2, 33, 4, 32), (2, 33, 4, 32), torch.float32, seed=3)
    ours = dlm_ops.block_causal_attn_func(q, k, v, 1)
    sdpa = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    torch.testing.assert_close(ours, sdpa.transpose(1, 2), atol=2e-6, rtol=0)


def test_clean_half_is_block_causal():
    """The clean half of block diffusion sees only the clean half, block-causally."""
    q, k, v = make_qkv((1, 40, 2, 16), (1, 40, 2, 16), torch.float64, seed=4)
    full = dlm_ops.diffusion_attn_func(q, k, v, 6)
    clean = dlm_ops.block_causal_attn_func(q[:, 20:], k[:, 20:], v[:, 20:], 6)
    torch.testing.assert_close(full[:, 20:], clean, atol=1e-12, rtol=0)


def test_varlen_matches_batched_for_equal_lengths():
    b, s = 3, 18
    q, k, v = make_qkv((b, s, 4, 16), (b, s, 2, 16), torch.float32, seed=5)
    out, lse = dlm_ops.diffusion_attn_func(q, k, v, 4, return_lse=True)
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
    vout, vlse = dlm_ops.diffusion_attn_varlen_func(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, s, 4, return_lse=True)
    torch.testing.assert_close(vout, out.flatten(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(vlse, lse.transpose(0, 1).flatten(1), atol=1e-6, rtol=0)


def test_varlen_all_samples_empty():
    q, k, v = make_qkv((0, 2, 8), (0, 2, 8), torch.float32, seed=0)
    cu = torch.zeros(3, dtype=torch.int32)
    out, lse = dlm_ops.diffusion_attn_varlen_func(q, k, v, cu, 0, 4, return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)


def test_softmax_scale_is_used():
    q, k, v = make_qkv((1, 16, 2, 16), (1, 16, 2, 16), torch.float64, seed=6)
    out = dlm_ops.diffusion_attn_func(q, k, v, 4, softmax_scale=0.3)
    ref, _ = diffusion_attn_ref(q, k, v, 4, softmax_scale=0.3, compute_dtype=torch.float64)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


def test_deterministic_bitwise():
    q, k, v = make_qkv((2, 64, 4, 32), (2, 64, 2, 32), torch.bfloat16, seed=8)
    dout = torch.randn(q.shape).to(torch.bfloat16)
    runs = []
    for _ in range(3):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = dlm_ops.diffusion_attn_func(*inputs, 8, deterministic=True)
        runs.append((out, *torch.autograd.grad(out, inputs, dout)))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


def test_bf16_output_is_unbiased():
    """Mean signed relative error over many problems is within 4 standard errors of zero."""
    errs = []
    for seed in range(60):
        q, k, v = make_qkv((1, 32, 2, 32), (1, 32, 2, 32), torch.bfloat16, seed=seed)
        out = dlm_ops.diffusion_attn_func(q, k, v, 4)
        gold, _ = diffusion_attn_ref(q, k, v, 4, compute_dtype=torch.float64)
        errs.append(((out.double() - gold).sum() / gold.abs().sum()).item())
    errs = torch.tensor(errs)
    mean, stderr = errs.mean().item(), (errs.std() / math.sqrt(len(errs))).item()
    assert abs(mean) <= 4 * stderr, f"mean relative error {mean:.3g} vs standard error {stderr:.3g}"


def test_lse_only_backward():
    """A loss on lse alone (out unused) still differentiates (d lse / d s = P)."""
    q, k, v = make_qkv((1, 20, 2, 16), (1, 20, 2, 16), torch.float64, seed=9)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    _, lse = dlm_ops.diffusion_attn_func(*inputs, 3, return_lse=True)
    grads = torch.autograd.grad(lse.sum(), inputs)
    ref_inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    _, ref_lse = diffusion_attn_ref(*ref_inputs, 3, compute_dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref_lse.sum(), ref_inputs, allow_unused=True)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, torch.zeros_like(g) if r is None else r, atol=1e-10, rtol=0)


def test_an_unused_lse_reaches_the_backward_as_none(monkeypatch):
    """A training step that ignores lse hands the backends dlse=None (no zeros to fill and read),
    batched and packed; a used lse still brings its gradient."""
    seen = []
    for name in ("bwd", "varlen_bwd"):
        original = getattr(TorchTiledBackend, name)

        def spy(self, dout, q, k, v, out, lse, dlse, *rest, _original=original):
            seen.append(dlse)
            return _original(self, dout, q, k, v, out, lse, dlse, *rest)

        monkeypatch.setattr(TorchTiledBackend, name, spy)

    def dlse_seen(loss, inputs):
        seen.clear()
        torch.autograd.grad(loss, inputs)
        return list(seen)

    q, k, v = make_qkv((1, 20, 2, 16), (1, 20, 2, 16), torch.float64, seed=3)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    out = dlm_ops.diffusion_attn_func(*inputs, 3, backend="torch")
    assert dlse_seen(out.sum(), inputs) == [None]
    packed = [t.detach().flatten(0, 1).requires_grad_() for t in (q, k, v)]
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    out = dlm_ops.diffusion_attn_varlen_func(*packed, cu, 12, 3, backend="torch")
    assert all(d is None for d in dlse_seen(out.sum(), packed))
    out, lse = dlm_ops.diffusion_attn_func(*inputs, 3, return_lse=True, backend="torch")
    (dlse,) = dlse_seen(out.sum() + lse.sum(), inputs)
    torch.testing.assert_close(dlse, torch.ones_like(lse))


def test_forced_backend_and_unsupported_config():
    q, k, v = make_qkv((1, 8, 2, 16), (1, 8, 2, 16), torch.float32, seed=0)
    assert torch.equal(dlm_ops.diffusion_attn_func(q, k, v, 2, backend="torch"),
                       dlm_ops.diffusion_attn_func(q, k, v, 2))
    with pytest.raises(ValueError, match="backend must be one of"):
        dlm_ops.diffusion_attn_func(q, k, v, 2, backend="nope")


def _packed_inputs(cu_list, seed, requires_grad=False):
    total = cu_list[-1]
    q, k, v = make_qkv((total, 2, 16), (total, 1, 16), torch.float64, seed)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def test_varlen_reads_cu_seqlens_once_per_tensor():
    """The host reads a cu_seqlens tensor's values once (a device sync on CUDA), not in every
    forward and backward: a model passes one tensor to all its layers."""
    from dlm_ops.ops.diffusion import _host_bounds

    cu_list = [0, 6, 6, 20]
    cu = torch.tensor(cu_list, dtype=torch.int32)
    q, k, v = _packed_inputs(cu_list, seed=7, requires_grad=True)
    reads = _host_bounds.reads
    for _ in range(3):  # three "layers": forward and backward each
        out = dlm_ops.diffusion_attn_varlen_func(q, k, v, cu, 14, 4)
        out.sum().backward()
    assert _host_bounds.reads == reads + 1
    # A new tensor with the same values is read again (another address).
    dlm_ops.diffusion_attn_varlen_func(q, k, v, cu.clone(), 14, 4)
    assert _host_bounds.reads == reads + 2


def test_varlen_rereads_cu_seqlens_written_in_place():
    """An in-place write (through the tensor or a view) bumps its version: the new bounds are used,
    never the cached ones."""
    first, second = [0, 6, 6, 20], [0, 10, 14, 20]
    cu = torch.tensor(first, dtype=torch.int32)
    q, k, v = _packed_inputs(first, seed=8)
    dlm_ops.diffusion_attn_varlen_func(q, k, v, cu, 14, 4)
    cu[1:].copy_(torch.tensor(second[1:], dtype=torch.int32))  # through a view
    out = dlm_ops.diffusion_attn_varlen_func(q, k, v, cu, 14, 4)
    gold, _ = diffusion_attn_varlen_ref(q, k, v, torch.tensor(second, dtype=torch.int32), 4,
                                        compute_dtype=torch.float64)
    torch.testing.assert_close(out, gold.to(out.dtype), atol=1e-12, rtol=0)


def test_varlen_host_bounds_inference_tensors_and_eviction():
    """Inference tensors have no version counter: read every call, still correct. The cache keeps
    a bounded number of tensors."""
    from dlm_ops.ops.diffusion import _HostBounds

    bounds = _HostBounds(size=2)
    with torch.inference_mode():
        cu = torch.tensor([0, 4, 8], dtype=torch.int32)
        assert bounds(cu) == bounds(cu) == (0, 4, 8) and bounds.reads == 2
    tensors = [torch.tensor([0, 2 * i], dtype=torch.int32) for i in range(4)]
    for i, t in enumerate(tensors):
        assert bounds(t) == (0, 2 * i)
    assert len(bounds._entries) == 2 and bounds.reads == 2 + 4
    assert bounds(tensors[-1]) == (0, 6) and bounds.reads == 6  # still cached
    assert bounds(tensors[0]) == (0, 0) and bounds.reads == 7   # evicted, read again
