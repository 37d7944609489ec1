"""GPU-only checks of the default CUDA backend (run with ``-m gpu`` on a CUDA machine)."""

import math

import pytest
import torch
import torch.nn.functional as F

import dlm_ops
from dlm_ops.reference import (
    block_causal_attn_ref,
    diffusion_attn_ref,
    diffusion_attn_varlen_ref,
)

from .accuracy import assert_rule, check_against_reference

pytestmark = pytest.mark.gpu


def _qkv(b, s, h, hkv, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, s, h, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, s, hkv, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, s, hkv, d, device="cuda", generator=g).to(dtype)
    return q, k, v


def test_default_backend_on_cuda():
    """cutlass where it can be built (sm90 + toolchain: its uncovered calls run Triton inside it),
    Triton elsewhere."""
    from dlm_ops.backends import cutlass_diffusion, select
    from dlm_ops.ops.diffusion import _problem

    q, k, _ = _qkv(1, 8, 2, 2, 64, torch.bfloat16)
    ready = cutlass_diffusion.CutlassDiffusionBackend().unavailable_reason() is None
    assert select(_problem(q, k, 0.0, False, False)).name == ("cutlass" if ready else "triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,block_size,d,heads", [
    (128, 16, 64, (4, 4)), (1000, 3, 128, (8, 2)), (1024, 64, 128, (4, 1)), (512, 1, 256, (4, 4)),
    (777, 5000, 128, (2, 2)), (300, 16, 96, (4, 2)),
])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_accuracy_rule(dtype, n, block_size, d, heads, softcap):
    inputs = _qkv(2, 2 * n, *heads, d, dtype, seed=n)
    check_against_reference(
        lambda q, k, v: dlm_ops.diffusion_attn_func(q, k, v, block_size, softcap=softcap,
                                                    return_lse=True),
        lambda q, k, v, **kw: diffusion_attn_ref(q, k, v, block_size, softcap=softcap, **kw),
        inputs, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_accuracy_with_empty_samples(dtype):
    halves = [0, 300, 1, 0, 1024, 77]
    cu = torch.tensor([0] + [2 * sum(halves[: i + 1]) for i in range(len(halves))],
                      dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    q, k, v = (t[0] for t in _qkv(1, total, 8, 2, 128, dtype))
    check_against_reference(
        lambda q, k, v: dlm_ops.diffusion_attn_varlen_func(q, k, v, cu, 2048, 16, return_lse=True),
        lambda q, k, v, **kw: diffusion_attn_varlen_ref(q, k, v, cu, 16, **kw),
        (q, k, v), dtype)


def test_block_causal_accuracy():
    inputs = _qkv(2, 1500, 8, 4, 128, torch.bfloat16)
    check_against_reference(
        lambda q, k, v: dlm_ops.block_causal_attn_func(q, k, v, 16, return_lse=True),
        lambda q, k, v, **kw: block_causal_attn_ref(q, k, v, 16, **kw),
        inputs, torch.bfloat16)


def test_bias_bf16():
    """Mean signed relative error of out and dq over many problems: within 4 standard errors of 0."""
    errs = {"out": [], "dq": []}
    for seed in range(40):
        q, k, v = (t.requires_grad_() for t in _qkv(1, 512, 4, 4, 64, torch.bfloat16, seed))
        out = dlm_ops.diffusion_attn_func(q, k, v, 16)
        dout = torch.randn_like(out)
        (dq,) = torch.autograd.grad(out, (q,), dout)
        qr = q.detach().float().requires_grad_()
        ref, _ = diffusion_attn_ref(qr, k.detach(), v.detach(), 16, compute_dtype=torch.float32)
        (dq_ref,) = torch.autograd.grad(ref, (qr,), dout.float())
        for name, ours, gold in (("out", out, ref), ("dq", dq, dq_ref)):
            errs[name].append(((ours.float() - gold).sum() / gold.abs().sum()).item())
    for name, e in errs.items():
        e = torch.tensor(e)
        mean, stderr = e.mean().item(), (e.std() / math.sqrt(len(e))).item()
        assert abs(mean) <= 4 * stderr, f"{name}: mean relative error {mean:.3g}, stderr {stderr:.3g}"


@pytest.mark.parametrize("deterministic", [True, False])
def test_backward_is_bitwise_reproducible(deterministic):
    """10 runs bitwise equal (the Triton backward has no atomics, so the default is too)."""
    q, k, v = _qkv(2, 2048, 8, 2, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    runs = []
    for _ in range(10):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = dlm_ops.diffusion_attn_func(*inputs, 16, deterministic=deterministic)
        runs.append((out, *torch.autograd.grad(out, inputs, dout)))
    for run in runs[1:]:
        for name, a, b in zip(("out", "dq", "dk", "dv"), runs[0], run):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("n,heads", [(1024, (4, 4)), (1000, (8, 2))])
def test_training_step_replays_from_a_cuda_graph(n, heads):
    """The README's remedy for a host-bound step at short n: forward and backward captured in one
    CUDA graph (benchmarks.step_gap's capture) and replayed on new inputs, copied into the
    captured tensors, equal an eager step on those inputs bitwise (the backward is deterministic
    by default). n = 1024: halves on the 128 grid (the dS backward); 1000: off it, GQA."""
    q, k, v = (t.requires_grad_() for t in _qkv(2, 2 * n, *heads, 128, torch.bfloat16))
    dout = torch.randn_like(q)
    result = {}

    def step():
        out = dlm_ops.diffusion_attn_func(q, k, v, 16)
        result["out"], result["grads"] = out, torch.autograd.grad(out, (q, k, v), dout)

    from benchmarks.step_gap import graphed  # warm-up on a side stream, then one capture

    replay = graphed(step)
    fresh = _qkv(2, 2 * n, *heads, 128, torch.bfloat16, seed=1)
    with torch.no_grad():
        for static, new in zip((q, k, v), fresh):
            static.copy_(new)
    replay()
    torch.cuda.synchronize()
    inputs = [t.clone().requires_grad_() for t in fresh]
    out = dlm_ops.diffusion_attn_func(*inputs, 16)
    expected = (out, *torch.autograd.grad(out, inputs, dout))
    for name, got, want in zip(("out", "dq", "dk", "dv"), (result["out"], *result["grads"]), expected):
        assert torch.equal(got, want), name


def test_clean_half_block_size_one_vs_sdpa_causal():
    q, k, v = _qkv(2, 2048, 8, 8, 128, torch.bfloat16)
    ours = dlm_ops.block_causal_attn_func(q, k, v, 1)
    sdpa = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    gold, _ = block_causal_attn_ref(q, k, v, 1, compute_dtype=torch.float32)
    # Same rule, with SDPA's flash kernel as the bf16 baseline.
    assert_rule("out", ours, gold, sdpa.transpose(1, 2), torch.bfloat16)


def test_non_contiguous_inputs():
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 8, 600, 64, device="cuda", generator=g, dtype=torch.bfloat16)
               .transpose(1, 2) for _ in range(3))
    check_against_reference(
        lambda q, k, v: dlm_ops.diffusion_attn_func(q, k, v, 8, return_lse=True),
        lambda q, k, v, **kw: diffusion_attn_ref(q, k, v, 8, **kw), (q, k, v), torch.bfloat16)


def test_torch_compile_on_cuda():
    q, k, v = _qkv(2, 512, 8, 2, 64, torch.bfloat16)

    def step(q, k, v):
        out, lse = dlm_ops.diffusion_attn_func(q * 1.5, k, v, 16, return_lse=True)
        return (out.float() ** 2).sum() + lse.sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for fn in (step, compiled):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        loss = fn(*inputs)
        grads = torch.autograd.grad(loss, inputs)
        if fn is step:
            expected = (loss, *grads)
    # The op's outputs match bitwise; Inductor's fused reductions around it may round differently.
    for a, b in zip(expected, (loss, *grads)):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the cutlass backend is sm90 only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,block_size,d,heads,layout", [
    (256, 16, 128, (4, 4), "bd3"), (512, 1, 128, (8, 2), "bd3"), (384, 5, 64, (4, 1), "bd3"),
    (1024, 300, 128, (2, 2), "bd3"), (256, 4, 64, (4, 2), "packed"), (256, 16, 128, (4, 2), "causal"),
    (256, 16, 256, (4, 2), "bd3"),  # 128 x 64 tiles
    # block sizes dividing 64 up to 64: the noisy diagonal's narrow visit (diffusion_fwd.cuh)
    (256, 64, 128, (4, 4), "bd3"), (384, 32, 64, (4, 2), "bd3"),
])
def test_cutlass_forward(monkeypatch, dtype, n, block_size, d, heads, layout):
    """The sm90 CUTLASS forward (csrc/hopper/diffusion_fwd.cuh), forced for every head dim it
    supports (the backend runs it by default only where it is faster than Triton's), meets the
    accuracy rule (the backward rides along: test_cutlass_backward checks it) and agrees with the
    Triton forward."""
    from dlm_ops.backends import cutlass_diffusion as cd

    monkeypatch.setattr(cd, "FORWARD_HEAD_DIMS", cd.SUPPORTED_HEAD_DIMS["fwd"])

    h, hkv = heads
    if layout == "packed":  # q, k, v views into one (B, S, 3, H, D) tensor: strided rows
        qkv = torch.randn(2, 2 * n, 3, h, d, device="cuda").to(dtype)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1, :hkv], qkv[:, :, 2, :hkv]
    else:
        q, k, v = _qkv(2, 2 * n, h, hkv, d, dtype, seed=n + d)
    if layout == "causal":
        def run(q, k, v, backend="cutlass"):
            return dlm_ops.block_causal_attn_func(q, k, v, block_size, return_lse=True, backend=backend)

        def ref(q, k, v, **kw):
            return block_causal_attn_ref(q, k, v, block_size, **kw)
    else:
        def run(q, k, v, backend="cutlass"):
            return dlm_ops.diffusion_attn_func(q, k, v, block_size, return_lse=True, backend=backend)

        def ref(q, k, v, **kw):
            return diffusion_attn_ref(q, k, v, block_size, **kw)

    before = cd.STATS["fwd"]
    check_against_reference(run, ref, (q, k, v), dtype)
    assert cd.STATS["fwd"] > before, "the CUTLASS forward did not run"
    with torch.no_grad():
        out_c, lse_c = run(q, k, v)
        out_t, lse_t = run(q, k, v, backend="triton")
    ref_out, ref_lse = ref(q, k, v)
    err_c = (out_c.float() - ref_out).abs().max().item()
    err_t = (out_t.float() - ref_out).abs().max().item()
    assert err_c <= 2 * err_t + 1e-3, (err_c, err_t)
    assert (lse_c - ref_lse).abs().max().item() <= 1e-3


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the cutlass backend is sm90 only")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("layout,halves,block_size", [
    ("batched", (256, 256), 16), ("batched", (300, 300), 4), ("batched", (37, 37), 1),
    ("batched", (512, 512), 64), ("varlen", (0, 100, 37, 256, 1, 300), 16),
    ("varlen", (129, 64, 0, 500), 32),
])
def test_cutlass_narrow_diagonal_kernels(monkeypatch, d, layout, halves, block_size):
    """Every forward kernel with the noisy diagonal's narrow visit (diffusion_fwd.cuh
    fwd_narrow_built: D = 64 and 128, batched and packed), forced on where the shipped rules
    (cutlass_diffusion.NARROW_DIAG_*) leave some off: the accuracy rule, and within 2x the error of
    the kernel without it against the same fp32 reference (the narrow visit sums fewer terms, in
    another order, so the two are not bitwise equal)."""
    from dlm_ops.backends import cutlass_diffusion as cd

    monkeypatch.setattr(cd, "FORWARD_HEAD_DIMS", cd.SUPPORTED_HEAD_DIMS["fwd"])
    h, hkv, dtype = 4, 2, torch.bfloat16
    if layout == "batched":
        q, k, v = _qkv(len(halves), 2 * halves[0], h, hkv, d, dtype, seed=d + block_size)

        def run(q, k, v, backend="cutlass"):
            return dlm_ops.diffusion_attn_func(q, k, v, block_size, return_lse=True, backend=backend)

        def ref(q, k, v, **kw):
            return diffusion_attn_ref(q, k, v, block_size, **kw)
    else:
        _, cu, q, k, v = _packing(halves, h, hkv, d, dtype, seed=d + block_size)

        def run(q, k, v, backend="cutlass"):
            return dlm_ops.diffusion_attn_varlen_func(q, k, v, cu, 2 * max(halves), block_size,
                                                      return_lse=True, backend=backend)

        def ref(q, k, v, **kw):
            return diffusion_attn_varlen_ref(q, k, v, cu, block_size, **kw)

    gold_out, gold_lse = ref(q, k, v, compute_dtype=torch.float32)
    errors = {}
    for narrow in (False, True):
        monkeypatch.setattr(cd, "NARROW_DIAG_HEAD_DIMS", (64, 128) if narrow else ())
        monkeypatch.setattr(cd, "NARROW_DIAG_VARLEN", narrow)
        if narrow:
            check_against_reference(run, ref, (q, k, v), dtype)
        with torch.no_grad():
            out, lse = run(q, k, v)
        errors[narrow] = ((out.float() - gold_out).abs().max().item(),
                          (lse - gold_lse).abs().max().item())
    assert errors[True][0] <= 2 * errors[False][0] + 1e-3, errors
    assert errors[True][1] <= 1e-3, errors


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the cutlass backend is sm90 only")
def test_cutlass_hands_uncovered_calls_to_triton():
    """Rows TMA cannot read (a view 2 bytes into its storage) run Triton's kernels, counted."""
    from dlm_ops.backends import cutlass_diffusion as cd

    q, k, v = _qkv(1, 2 * 300, 4, 4, 128, torch.bfloat16)
    q = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape).copy_(q)
    before = dict(cd.STATS)
    inputs = [t.clone().requires_grad_() if t is not q else t.detach().requires_grad_()
              for t in (q, k, v)]
    out = dlm_ops.diffusion_attn_func(*inputs, 16, backend="cutlass")
    grads = torch.autograd.grad(out.float().sum(), inputs)
    assert cd.STATS["fwd_fallback"] == before["fwd_fallback"] + 1 and cd.STATS["fwd"] == before["fwd"]
    assert cd.STATS["bwd_fallback"] == before["bwd_fallback"] + 1 and cd.STATS["bwd"] == before["bwd"]
    ref, _ = diffusion_attn_ref(q, k, v, 16)
    assert (out.float() - ref).abs().max().item() < 2e-2
    ref_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(diffusion_attn_ref(*ref_inputs, 16)[0].float().sum(), ref_inputs)
    for g, r in zip(grads, ref_grads):
        assert (g.float() - r.float()).abs().max().item() < 5e-2


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the cutlass backend is sm90 only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,block_size,d,heads,layout", [
    (256, 16, 128, (4, 4), "bd3"), (512, 1, 128, (8, 2), "bd3"), (384, 5, 64, (4, 1), "bd3"),
    (1024, 300, 128, (2, 2), "bd3"), (256, 128, 64, (4, 4), "bd3"), (256, 16, 128, (32, 8), "bd3"),
    (256, 4, 64, (4, 2), "packed"), (256, 16, 128, (4, 2), "causal"), (128, 1, 64, (2, 2), "causal"),
    # D = 256: the role-split dK/dV and key-split dQ kernels over 64 x 64 tiles
    (256, 16, 256, (4, 2), "bd3"), (384, 5, 256, (32, 8), "bd3"), (256, 1, 256, (2, 2), "causal"),
])
def test_cutlass_backward(dtype, n, block_size, d, heads, layout):
    """The sm90 CUTLASS backward (csrc/hopper/diffusion_bwd.cuh), forced: the accuracy rule for
    dq, dk, dv (with an upstream dlse), errors within 2x the Triton backward's against the same
    fp32 reference, and bitwise determinism."""
    from dlm_ops.backends import cutlass_diffusion as cd

    h, hkv = heads
    if layout == "packed":  # q, k, v views into one (B, S, 3, H, D) tensor: strided rows
        qkv = torch.randn(2, 2 * n, 3, h, d, device="cuda").to(dtype)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1, :hkv], qkv[:, :, 2, :hkv]
    else:
        q, k, v = _qkv(2, 2 * n, h, hkv, d, dtype, seed=n + d + h)
    attn, ref = ((dlm_ops.block_causal_attn_func, block_causal_attn_ref) if layout == "causal"
                 else (dlm_ops.diffusion_attn_func, diffusion_attn_ref))

    def run(q, k, v, backend="cutlass"):
        return attn(q, k, v, block_size, return_lse=True, backend=backend)

    before = cd.STATS["bwd"]
    check_against_reference(run, lambda q, k, v, **kw: ref(q, k, v, block_size, **kw), (q, k, v), dtype)
    assert cd.STATS["bwd"] > before, "the CUTLASS backward did not run"

    gen = torch.Generator(device="cuda").manual_seed(7)
    dout = torch.randn(q.shape, device="cuda", generator=gen).to(dtype)
    dlse = torch.randn((q.shape[0], h, q.shape[1]), device="cuda", generator=gen)

    def grads(fn):
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*inputs)
        loss = (out.float() * dout.float()).sum() + (lse * dlse).sum()
        return torch.autograd.grad(loss, inputs)

    ours = grads(run)
    again = grads(run)
    theirs = grads(lambda *t: run(*t, backend="triton"))
    gold = grads(lambda *t: ref(*t, block_size, compute_dtype=torch.float32))
    for name, c, c2, t, g in zip(("dq", "dk", "dv"), ours, again, theirs, gold):
        assert torch.equal(c, c2), f"{name}: two runs differ"
        err_c = (c.float() - g.float()).abs().max().item()
        err_t = (t.float() - g.float()).abs().max().item()
        assert err_c <= 2 * err_t + 1e-3, (name, err_c, err_t)


# -- odd lengths and varlen through the CUTLASS kernels (kBatchedStart, kStartVarlen) -------------

_SM90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                           reason="the cutlass backend is sm90 only")


def _check_cutlass(monkeypatch, run, ref, inputs, dtype, d, kind, dlse_shape):
    """The accuracy rule (fwd and bwd), STATS proving the CUTLASS kernels ran (no fallback), errors
    within 2x the Triton backend's against the same fp32 reference, and a bitwise reproducible
    backward. ``kind``: "" (batched) or "varlen_"."""
    from dlm_ops.backends import cutlass_diffusion as cd

    monkeypatch.setattr(cd, "FORWARD_HEAD_DIMS", cd.SUPPORTED_HEAD_DIMS["fwd"])
    with_bwd = d in cd.BACKWARD_HEAD_DIMS
    before = dict(cd.STATS)
    check_against_reference(run, ref, inputs, dtype)
    assert cd.STATS[kind + "fwd"] > before[kind + "fwd"], "the CUTLASS forward did not run"
    assert cd.STATS[kind + "fwd_fallback"] == before[kind + "fwd_fallback"], "forward fell back"
    if with_bwd:
        assert cd.STATS[kind + "bwd"] > before[kind + "bwd"], "the CUTLASS backward did not run"
        assert cd.STATS[kind + "bwd_fallback"] == before[kind + "bwd_fallback"], "backward fell back"

    gen = torch.Generator(device="cuda").manual_seed(7)
    dout = torch.randn(inputs[0].shape, device="cuda", generator=gen).to(dtype)
    dlse = torch.randn(dlse_shape, device="cuda", generator=gen)

    def step(fn):
        x = [t.detach().clone().requires_grad_() for t in inputs]
        out, lse = fn(*x)
        loss = (out.float() * dout.float()).sum() + (lse * dlse).sum()
        return (out, lse, *torch.autograd.grad(loss, x))

    ours, again = step(run), step(run)
    theirs = step(lambda *t: run(*t, backend="triton"))
    gold = step(lambda *t: ref(*t, compute_dtype=torch.float32))
    for name, c, c2, t, g in zip(("out", "lse", "dq", "dk", "dv"), ours, again, theirs, gold):
        assert torch.equal(c, c2), f"{name}: two runs differ"
        if c.numel():
            err_c = (c.float() - g.float()).abs().max().item()
            err_t = (t.float() - g.float()).abs().max().item()
            assert err_c <= 2 * err_t + 1e-3, (name, err_c, err_t)


@_SM90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,n,block_size,d,heads,layout", [
    (2, 1, 1, 64, (2, 2), "bd3"), (3, 3, 5, 128, (4, 2), "bd3"), (5, 100, 5, 128, (4, 1), "bd3"),
    (2, 300, 16, 64, (4, 2), "bd3"), (1, 1000, 300, 128, (2, 2), "bd3"), (16, 37, 1, 128, (8, 2), "bd3"),
    (2, 300, 16, 256, (4, 2), "bd3"),  # forward 128 x 64 tiles, backward 64 x 64
    (2, 500, 300, 128, (2, 2), "bd3"), (2, 250, 128, 64, (2, 1), "bd3"),  # short FULL key tiles
    (2, 77, 16, 128, (4, 2), "causal"), (2, 300, 1, 64, (2, 2), "causal"), (2, 3, 1, 128, (2, 1), "causal"),
])
def test_cutlass_odd_lengths(monkeypatch, dtype, batch, n, block_size, d, heads, layout):
    """Halves that are not multiples of 128 (and block-causal over an odd 2n + 1 tokens, n_noisy
    0) run the CUTLASS kernels forward and backward (kBatchedStart = kStartAny)."""
    h, hkv = heads
    s = 2 * n + (layout == "causal")
    q, k, v = _qkv(batch, s, h, hkv, d, dtype, seed=n + d)
    attn, ref = ((dlm_ops.block_causal_attn_func, block_causal_attn_ref) if layout == "causal"
                 else (dlm_ops.diffusion_attn_func, diffusion_attn_ref))

    def run(q, k, v, backend="cutlass"):
        return attn(q, k, v, block_size, return_lse=True, backend=backend)

    _check_cutlass(monkeypatch, run, lambda q, k, v, **kw: ref(q, k, v, block_size, **kw),
                   (q, k, v), dtype, d, "", (batch, h, s))


_MANY = [0 if i % 5 == 0 else (37 * i * i + 11) % 150 for i in range(30)]  # zeros and odd halves


def _packing(halves, h, hkv, d, dtype, seed):
    """A packing of samples with these halves: (cu_seqlens as a list, on the device, q, k, v)."""
    cu_list = [0]
    for n in halves:
        cu_list.append(cu_list[-1] + 2 * n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    q, k, v = (t[0] for t in _qkv(1, cu_list[-1], h, hkv, d, dtype, seed=seed))
    return cu_list, cu, q, k, v


@_SM90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("halves,block_size,d,heads", [
    ([0, 100, 37, 0, 256, 1, 300], 16, 128, (4, 2)),
    ([5, 0, 0, 64, 129, 0], 1, 64, (2, 2)),
    ([1000], 300, 128, (2, 2)),                # a single sample
    ([500], 300, 128, (2, 2)),                 # a single sample with short FULL key tiles
    ([200, 70, 0, 33, 160, 129, 250, 180, 1], 100, 128, (4, 2)),  # more short FULL tiles
    ([0, 0, 3], 5, 128, (4, 4)),               # fewer tokens than a tile
    (_MANY, 16, 64, (4, 2)),                   # many samples
    ([1024, 1024], 16, 128, (4, 4)),           # multiples of 128: the batched tiles, packed
    ([3, 100, 300, 0, 1000], 16, 256, (4, 2)),  # forward 128 x 64 tiles, backward 64 x 64
])
def test_cutlass_varlen(monkeypatch, dtype, halves, block_size, d, heads):
    """Packed samples (zero-length ones, odd halves, one sample, many) run the kStartVarlen
    kernels forward and backward."""
    h, hkv = heads
    cu_list, cu, q, k, v = _packing(halves, h, hkv, d, dtype, seed=len(halves) + d)

    def run(q, k, v, backend="cutlass"):
        return dlm_ops.diffusion_attn_varlen_func(q, k, v, cu, 2 * max(halves), block_size,
                                                  return_lse=True, backend=backend)

    _check_cutlass(monkeypatch, run,
                   lambda q, k, v, **kw: diffusion_attn_varlen_ref(q, k, v, cu, block_size, **kw),
                   (q, k, v), dtype, d, "varlen_", (h, cu_list[-1]))


@_SM90
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout,n,block_size,heads", [
    ("bd3", 1024, 4, (8, 8)),     # 256 key tiles: a persistent CTA walks two (both K / V buffers)
    ("bd3", 300, 16, (8, 2)),     # odd halves, GQA: warpgroups cut by a half's end store from registers
    ("causal", 77, 1, (4, 2)),
    ("varlen", 0, 16, (4, 2)),    # packed samples incl. empty ones
])
def test_cutlass_persistent_dkdv_is_bitwise_the_per_tile_kernel(monkeypatch, d, dtype, layout, n,
                                                                 block_size, heads):
    """The two dK/dV kernels at D = 64 / 128 (the persistent one up to PERSISTENT_DKDV_MAX_HALF, one
    CTA per key tile above) compute every item in the same order: bitwise equal gradients. The
    other tests run halves of at most 1024, so this is also where the per-tile kernel runs. The dS
    backward (D = 128 on the 128 grid and packed) always runs its persistent kernel: off here."""
    from dlm_ops.backends import cutlass_diffusion as cd

    monkeypatch.setattr(cd, "DS_SCRATCH_MAX_BYTES", 0)

    h, hkv = heads
    halves = [0, 100, 37, 0, 256, 1, 300]
    if layout == "varlen":
        _, cu, q, k, v = _packing(halves, h, hkv, d, dtype, seed=7)

        def attn(q, k, v):
            return dlm_ops.diffusion_attn_varlen_func(q, k, v, cu, 2 * max(halves), block_size)
    else:
        s = 2 * n + (layout == "causal")
        q, k, v = _qkv(2, s, h, hkv, d, dtype, seed=n)
        attn = (lambda q, k, v: dlm_ops.block_causal_attn_func(q, k, v, block_size)
                if layout == "causal" else dlm_ops.diffusion_attn_func(q, k, v, block_size))
    dout = torch.randn_like(q)

    def grads(max_half):
        monkeypatch.setattr(cd, "PERSISTENT_DKDV_MAX_HALF", max_half)
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        before = cd.STATS["varlen_bwd" if layout == "varlen" else "bwd"]
        g = torch.autograd.grad(attn(*x), x, dout)
        assert cd.STATS["varlen_bwd" if layout == "varlen" else "bwd"] == before + 1  # CUTLASS ran
        return g

    persistent, per_tile = grads(1 << 30), grads(0)
    for name, a, b in zip(("dq", "dk", "dv"), persistent, per_tile):
        assert torch.equal(a, b), name


@_SM90
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [(8, 8), (16, 4)])
def test_cutlass_balanced_schedule_is_bitwise_the_snake(monkeypatch, d, heads):
    """cutlass_diffusion.BALANCED_SCHEDULE hands each CTA of the persistent dK/dV kernel other
    items, never other arithmetic: the gradients bitwise equal to the snake walk's, at a shape
    where that kernel (D = 128: the dS backward's) has more work items (512 or 256) than SMs, so
    that the schedule is built and walked."""
    from dlm_ops.backends import cutlass_diffusion as cd

    h, hkv = heads
    q, k, v = _qkv(4, 2048, h, hkv, d, torch.bfloat16, seed=11)
    dout = torch.randn_like(q)

    def grads(balanced):
        monkeypatch.setattr(cd, "BALANCED_SCHEDULE", balanced)
        cd._dkdv_schedule.cache_clear()
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        g = torch.autograd.grad(dlm_ops.diffusion_attn_func(*x, 16), x, dout)
        return g, cd._dkdv_schedule.cache_info().currsize

    snake, none = grads(False)
    balanced, built = grads(True)
    assert none == 0 and built == 1
    for name, a, b in zip(("dq", "dk", "dv"), balanced, snake):
        assert torch.equal(a, b), name


@_SM90
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [(16, 16), (16, 4)])
def test_cutlass_packed_balanced_schedule_is_bitwise_the_snake(monkeypatch, d, heads):
    """Packed samples' balanced schedule (cutlass_diffusion._varlen_dkdv_schedule), in the plain
    order and slot-major by sample, hands the persistent dK/dV kernel's items to other CTAs, never
    with other arithmetic: the gradients bitwise equal to the snake's, on a packing of unequal and
    odd samples (a zero-length one among them) with more work items than SMs."""
    from dlm_ops.backends import cutlass_diffusion as cd

    h, hkv = heads
    halves = [1024, 1024, 0, 700, 333, 1024]
    cu = torch.tensor([0] + [2 * sum(halves[:i + 1]) for i in range(len(halves))], device="cuda",
                      dtype=torch.int32)
    q, k, v = (t[0] for t in _qkv(1, int(cu[-1]), h, hkv, d, torch.bfloat16, seed=13))
    dout = torch.randn_like(q)

    def grads(balanced, walk):
        monkeypatch.setattr(cd, "BALANCED_SCHEDULE", balanced)
        monkeypatch.setattr(cd, "_walk", lambda longest_half, head_dim, group: walk)
        cd._varlen_dkdv_schedule.cache_clear()
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        before = cd.STATS["varlen_bwd"]
        g = torch.autograd.grad(dlm_ops.diffusion_attn_varlen_func(*x, cu, 2048, 16), x, dout)
        assert cd.STATS["varlen_bwd"] == before + 1  # CUTLASS ran
        return g, cd._varlen_dkdv_schedule.cache_info().currsize

    snake, none = grads(False, cd.PLAIN_ORDER)
    assert none == 0
    for walk in (cd.PLAIN_ORDER, cd.SHORT_HALF_ORDER):
        balanced, built = grads(True, walk)
        assert built == 1
        for name, a, b in zip(("dq", "dk", "dv"), balanced, snake):
            assert torch.equal(a, b), (walk, name)


@_SM90
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (16, 4)])
@pytest.mark.parametrize("packed", [False, True])
def test_cutlass_ds_dq_schedule_is_bitwise_the_snake(monkeypatch, d, heads, packed):
    """cutlass_diffusion.DQ_SCHEDULE hands each CTA of the dS backward's dQ kernel other items
    (ds_dq_schedule, varlen_ds_dq_schedule for packed samples: unequal and odd ones, a zero-length
    one among them), never other arithmetic: the gradients bitwise equal to the snake walk's, with
    more work items than SMs so that the schedule is built and walked."""
    from dlm_ops.backends import cutlass_diffusion as cd

    h, hkv = heads
    cache = cd._varlen_ds_dq_schedule if packed else cd._ds_dq_schedule
    if packed:
        halves = [1024, 1024, 0, 700, 333, 1024]
        cu = torch.tensor([0] + [2 * sum(halves[:i + 1]) for i in range(len(halves))], device="cuda",
                          dtype=torch.int32)
        q, k, v = (t[0] for t in _qkv(1, int(cu[-1]), h, hkv, d, torch.bfloat16, seed=14))
    else:
        q, k, v = _qkv(4, 2048, h, hkv, d, torch.bfloat16, seed=15)
    dout = torch.randn_like(q)

    def grads(scheduled):
        monkeypatch.setattr(cd, "DQ_SCHEDULE", scheduled)
        cache.cache_clear()
        key = "varlen_bwd_ds" if packed else "bwd_ds"
        ds_before = cd.STATS[key]
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = dlm_ops.diffusion_attn_varlen_func(*x, cu, 2048, 16) if packed else dlm_ops.diffusion_attn_func(*x, 16)
        g = torch.autograd.grad(out, x, dout)
        assert cd.STATS[key] == ds_before + 1  # the dS backward ran
        return g, cache.cache_info().currsize

    snake, none = grads(False)
    scheduled, built = grads(True)
    assert none == 0 and built == 1
    for name, a, b in zip(("dq", "dk", "dv"), scheduled, snake):
        assert torch.equal(a, b), name


@_SM90
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (16, 4)])
def test_cutlass_slot_major_walk_is_bitwise_the_plain_order(monkeypatch, heads, d):
    """The slot-major walk (cutlass_diffusion.SHORT_HALF_ORDER) hands the forward's items and the dS
    backward's dK/dV items (on their balanced schedule) out in another order, never with other
    arithmetic: out, lse and the gradients bitwise equal to the plain order's at n = 1K, D = 128
    and 256, with more work items than SMs (512 forward; 512 or 256 dK/dV), GQA included (walked
    here, though the backend's rule keeps GQA on the plain order)."""
    from dlm_ops.backends import cutlass_diffusion as cd

    h, hkv = heads
    q, k, v = _qkv(4, 2048, h, hkv, d, torch.bfloat16, seed=12)
    dout = torch.randn_like(q)

    def run(order):
        monkeypatch.setattr(cd, "_walk", lambda longest_half, head_dim, group: order)
        cd._dkdv_schedule.cache_clear()
        ds_before = cd.STATS["bwd_ds"]
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = dlm_ops.diffusion_attn_func(*x, 16, return_lse=True)
        grads = torch.autograd.grad(out, x, dout)
        assert cd.STATS["bwd_ds"] == ds_before + 1  # the dS backward ran
        return (out, lse, *grads)

    walked = run(cd.SHORT_HALF_ORDER)
    plain = run(cd.PLAIN_ORDER)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), walked, plain):
        assert torch.equal(a, b), name


@_SM90
@pytest.mark.parametrize("cu_list", [[0], [0, 0, 0], [0, 0, 8, 8]])
def test_cutlass_varlen_empty_packings(cu_list):
    """No tokens at all, only zero-length samples, or a tiny sample among empty ones: no launch
    with an empty grid, outputs of the right shapes, the CUTLASS path counted (when it runs)."""
    from dlm_ops.backends import cutlass_diffusion as cd

    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    q, k, v = (t[0].requires_grad_() for t in _qkv(1, cu_list[-1], 4, 2, 128, torch.bfloat16))
    before = dict(cd.STATS)
    out, lse = dlm_ops.diffusion_attn_varlen_func(q, k, v, cu, 8, 4, return_lse=True,
                                                  backend="cutlass")
    grads = torch.autograd.grad((out.float().sum() + lse.sum()), (q, k, v), allow_unused=True)
    torch.cuda.synchronize()
    assert out.shape == q.shape and lse.shape == (4, cu_list[-1])
    assert all(g is None or (g.shape == t.shape and torch.isfinite(g).all()) for g, t in zip(grads, (q, k, v)))
    # Autograd calls the backward even with no token, dout and dlse expands with zero strides
    # (session 6: the Triton fallback; session 7: the binding's dlse layout check raised). The
    # backend takes the call: a token-less one launches nothing, the others a TMA-ready dout.
    assert cd.STATS["varlen_bwd_fallback"] == before["varlen_bwd_fallback"]
    assert cd.STATS["varlen_bwd"] == before["varlen_bwd"] + 1
    if cu_list[-1]:
        gold, gold_lse = diffusion_attn_varlen_ref(q.detach(), k.detach(), v.detach(), cu, 4)
        assert (out.float() - gold).abs().max().item() < 2e-2
        assert (lse - gold_lse).abs().max().item() < 1e-3


@_SM90
@pytest.mark.parametrize("cu_list,block_size,d", [
    ([0, 0, 200, 274, 274, 786, 788, 1388], 16, 128), ([0, 2000], 300, 256), ([0, 10, 10, 2058], 1, 64),
])
def test_cutlass_varlen_tables_match_geometry(cu_list, block_size, d):
    """The C++ work tables (tile, sample per entry, most expensive first over all samples) equal
    the ones written from dlm_ops.geometry (tests/test_cutlass_dispatch.py's mirror)."""
    from dlm_ops.backends import cutlass_diffusion as cd

    from .test_cutlass_dispatch import entries, varlen_ds_slots

    cd._extension()
    t = cd._varlen_tables(tuple(cu_list), block_size, d, "cuda")
    bn = 64 if d > 128 else 128  # diffusion_fwd.cuh fwd_block_n, diffusion_bwd.cuh bwd_block_n / dq_block_*
    assert t.cu_seqlens.tolist() == cu_list
    assert tuple(x.tolist() for x in t.fwd) == entries(cu_list, block_size, lambda m: m.fwd_tiles(128, bn))
    bm = 128 if d == 64 else 64  # diffusion_bwd.cuh bwd_block_m
    assert tuple(x.tolist() for x in t.dkdv) == entries(cu_list, block_size, lambda m: m.bwd_tiles(bm, bn))
    assert tuple(x.tolist() for x in t.dq) == entries(cu_list, block_size, lambda m: m.fwd_tiles(bn, bn))
    assert tuple(x.tolist() for x in t.ds_dq) == entries(cu_list, block_size, lambda m: m.fwd_tiles(128, bn))
    if d in cd.DS_HEAD_DIMS:  # the dS backward's slot table, as the mirror writes it
        slots, rows, visits, width = varlen_ds_slots(cu_list, block_size, bn)
        got = cd._varlen_ds_slots(tuple(cu_list), block_size, d, "cuda")
        assert got[0].tolist() == slots.tolist() and got[1].tolist() == rows.tolist()
        assert got[2:] == (visits, width)


def _ds_against_two_kernel(monkeypatch, run, inputs, dlse_shape, dtype, seed, layout=None):
    """Gradients of out * dout + lse * dlse (upstream dout, dlse seeded) through ``run``: twice with
    the dS backward (asserted bitwise equal: deterministic), then with it off (DS_SCRATCH_MAX_BYTES
    = 0, for the rest of the test) and, given ``layout``, on inputs copied into it. The dS path
    must give bitwise the two-kernel dk, dv (the same dK/dV tiles in the same order) and dq within
    a few units of dS's rounding (dS^T there comes from K Q^T, here from Q K^T). Returns the
    STATS before the two-kernel run, for the caller's checks of which path ran."""
    from dlm_ops.backends import cutlass_diffusion as cd

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dout = torch.randn(inputs[0].shape, device="cuda", generator=gen).to(dtype)
    dlse = torch.randn(dlse_shape, device="cuda", generator=gen)

    def grads(copy=lambda t: t):
        x = [copy(t.detach().clone()).requires_grad_() for t in inputs]
        out, lse = run(*x)
        loss = (out.float() * dout.float()).sum() + (lse * dlse).sum()
        return torch.autograd.grad(loss, x)

    ds_a, ds_b = grads(), grads()
    for name, a, b in zip(("dq", "dk", "dv"), ds_a, ds_b):
        assert torch.equal(a, b), f"{name}: not deterministic"
    others = [grads(layout)] if layout else []
    monkeypatch.setattr(cd, "DS_SCRATCH_MAX_BYTES", 0)
    before = dict(cd.STATS)
    two = grads()
    assert torch.equal(ds_a[1], two[1]) and torch.equal(ds_a[2], two[2])
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for other in (two, *others):
        assert (ds_a[0].float() - other[0].float()).abs().max() <= tol * other[0].float().abs().max()
    return before


@_SM90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("halves,block_size,heads", [
    ([0, 100, 37, 0, 256, 1, 300], 16, (4, 2)),   # odd halves, empty and one-token samples
    ([200, 70, 0, 33, 160, 129, 250, 180, 1], 100, (4, 4)),  # short FULL key tiles
    ([1024, 1024], 4, (4, 4)),                   # on the 128 grid: as batched
    ([1000], 300, (2, 2)),
])
def test_cutlass_varlen_ds_backward(monkeypatch, dtype, head_dim, halves, block_size, heads):
    """The dS backward over packed samples (session 24: the kStartVarlen dS kernels), the default at
    D = 128 and 256: it runs (STATS), meets the accuracy rule with an upstream dlse, is bitwise
    deterministic, and against the two-kernel backward (DS_SCRATCH_MAX_BYTES = 0) gives bitwise
    the same dk, dv and dq within a few units of dS's rounding. Keys a tile reads past its half
    (odd halves) must have dS^T = 0 in the scratch, or dq picks up the next half's keys."""
    from dlm_ops.backends import cutlass_diffusion as cd

    h, hkv = heads
    _, cu, q, k, v = _packing(halves, h, hkv, head_dim, dtype, seed=len(halves) + h)

    def run(q, k, v):
        return dlm_ops.diffusion_attn_varlen_func(q, k, v, cu, 2 * max(halves), block_size,
                                                  return_lse=True)

    before = cd.STATS["varlen_bwd_ds"]
    check_against_reference(run, lambda q, k, v, **kw: diffusion_attn_varlen_ref(q, k, v, cu, block_size, **kw),
                            (q, k, v), dtype)
    assert cd.STATS["varlen_bwd_ds"] == before + 1, "the dS backward did not run"

    before = _ds_against_two_kernel(monkeypatch, run, (q, k, v), (h, q.shape[0]), dtype, 5)
    assert cd.STATS["varlen_bwd_ds"] == before["varlen_bwd_ds"]
    assert cd.STATS["varlen_bwd"] == before["varlen_bwd"] + 1


@_SM90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("batch,n,block_size,heads", [(3, 300, 16, (4, 2)), (2, 1000, 4, (4, 4)),
                                                      (4, 37, 1, (2, 2))])
def test_cutlass_odd_halves_take_the_packed_ds_backward(monkeypatch, dtype, head_dim, batch, n,
                                                        block_size, heads):
    """Batched BD3 halves off the 128 grid run the dS backward as B packed samples (session 24):
    it runs (STATS), meets the accuracy rule with an upstream dlse, is deterministic, gives bitwise
    the dk, dv of the batched two-kernel backward (the same tiles in the same order) and dq within
    dS's rounding; a batch that cannot be merged into the rows (a transposed layout) runs the
    two-kernel backward."""
    from dlm_ops.backends import cutlass_diffusion as cd

    h, hkv = heads
    q, k, v = _qkv(batch, 2 * n, h, hkv, head_dim, dtype, seed=n + h)

    def run(q, k, v):
        return dlm_ops.diffusion_attn_func(q, k, v, block_size, return_lse=True)

    before = cd.STATS["bwd_ds_packed"]
    check_against_reference(run, lambda q, k, v, **kw: diffusion_attn_ref(q, k, v, block_size, **kw),
                            (q, k, v), dtype)
    assert cd.STATS["bwd_ds_packed"] == before + 1, "the packed dS backward did not run"

    start = dict(cd.STATS)
    before = _ds_against_two_kernel(monkeypatch, run, (q, k, v), (batch, h, 2 * n), dtype, 9,
                                    layout=lambda t: t.transpose(1, 2).contiguous().transpose(1, 2))
    # the two dS runs packed; the transposed layout (its batch cannot be merged) and the run with
    # the dS path off, two-kernel
    assert cd.STATS["bwd_ds_packed"] == start["bwd_ds_packed"] + 2 == before["bwd_ds_packed"]
    assert cd.STATS["bwd"] == start["bwd"] + 4


@_SM90
def test_cutlass_varlen_is_the_default_on_sm90():
    """Unforced, a varlen call selects the cutlass backend (it declares VARLEN) and runs the
    CUTLASS kernels forward and backward at D = 128."""
    from dlm_ops.backends import cutlass_diffusion as cd

    cu = torch.tensor([0, 200, 200, 458], dtype=torch.int32, device="cuda")
    q, k, v = (t[0].requires_grad_() for t in _qkv(1, 458, 4, 2, 128, torch.bfloat16))
    before = dict(cd.STATS)
    out = dlm_ops.diffusion_attn_varlen_func(q, k, v, cu, 258, 16)
    torch.autograd.grad(out.float().sum(), (q, k, v))
    assert cd.STATS["varlen_fwd"] == before["varlen_fwd"] + 1
    assert cd.STATS["varlen_bwd"] == before["varlen_bwd"] + 1


@_SM90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("n,block_size,heads,layout", [
    (256, 16, (4, 4), "bd3"), (384, 5, (8, 2), "bd3"), (1024, 300, (2, 2), "bd3"),
    (1024, 4, (4, 4), "bd3"),   # 2 x 4 x 16 = 128 dK/dV items at D = 128: one per CTA on 132 SMs
    (128, 1, (4, 2), "causal"),  # block-causal: no noisy half
])
def test_cutlass_ds_backward(monkeypatch, dtype, head_dim, n, block_size, heads, layout):
    """The dS backward (cutlass_diffusion DS_*; csrc/hopper/bwd_dq_from_ds.cuh), the default at D =
    128 and 256 with halves on the 128 grid: it runs (STATS), meets the accuracy rule for dq, dk, dv
    with an upstream dlse, is bitwise deterministic, and against the two-kernel backward (the path
    turned off by DS_SCRATCH_MAX_BYTES = 0) gives bitwise the same dk, dv (the same dK/dV tiles in
    the same order) and dq within a few units of dS's rounding (dS^T there comes from K Q^T, here
    from Q K^T)."""
    from dlm_ops.backends import cutlass_diffusion as cd

    h, hkv = heads
    q, k, v = _qkv(2, 2 * n, h, hkv, head_dim, dtype, seed=n + h)
    attn, ref = ((dlm_ops.block_causal_attn_func, block_causal_attn_ref) if layout == "causal"
                 else (dlm_ops.diffusion_attn_func, diffusion_attn_ref))

    def run(q, k, v):
        return attn(q, k, v, block_size, return_lse=True)

    before = cd.STATS["bwd_ds"]
    check_against_reference(run, lambda q, k, v, **kw: ref(q, k, v, block_size, **kw), (q, k, v), dtype)
    assert cd.STATS["bwd_ds"] == before + 1, "the dS backward did not run"

    before = _ds_against_two_kernel(monkeypatch, run, (q, k, v), (q.shape[0], h, q.shape[1]), dtype, 3)
    assert cd.STATS["bwd_ds"] == before["bwd_ds"] and cd.STATS["bwd"] == before["bwd"] + 1
