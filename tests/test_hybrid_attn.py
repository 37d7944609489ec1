"""Block-hybrid attention (LLaDA-Hybrid): the ops against the eager references of
dlm_ops/reference.py (written from the definitions), the decode step against the training form,
gradients in float64, opcheck, torch.compile, the Triton decode kernel (interpreter on CPU,
natively on a GPU) and argument validation."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import dlm_ops
from dlm_ops.backends.triton_backend import INTERPRET
from dlm_ops.ops import hybrid as ops
from dlm_ops.reference import (
    block_hybrid_attn_ref,
    block_hybrid_train_attn_ref,
    hybrid_state_update_ref,
)

from .accuracy import assert_rule, gold_dtype
from .strategies import HEADS, attention_problem

CUDA = torch.cuda.is_available()
FEATURES = [16, 64, 5]  # the F = 16 and 64, and an F that is no power of two


def _params(h, d, f, seed, device="cpu"):
    """feature_weight (H, D, F) fp32 scaled so that the feature softmax is neither flat nor one-hot,
    and a gate (H,) around sigmoid(0) = 0.5."""
    g = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(h, d, f, generator=g) * (2.0 / d ** 0.5)
    gate = torch.randn(h, generator=g)
    return w.to(device), gate.to(device)


def _seq(b, s, h, hkv, d, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g)
    k = torch.randn(b, s, hkv, d, generator=g)
    v = torch.randn(b, s, hkv, d, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def _state(b, h, hkv, d, f, blocks, bs, seed, device="cpu", dtype=torch.float32):
    """A state built the way decoding builds it: ``blocks`` committed random blocks (reference)."""
    w, _ = _params(h, d, f, seed, device)
    s = torch.zeros(b, h, 2 * f, d, device=device, dtype=dtype)
    z = torch.zeros(b, h, 2 * f, device=device, dtype=dtype)
    for i in range(blocks):
        _, k, v = _seq(b, bs, h, hkv, d, dtype, seed + 100 + i, device)
        s, z = hybrid_state_update_ref(s, z, k, v, w)
    return s, z


def _grads(fn, inputs, dout):
    inputs = [t.detach().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    return (out, *torch.autograd.grad((out.float() * dout.float()).sum(), inputs))


def _check_train(b, n, h, hkv, d, f, bs, dtype, seed, device="cpu", backend=None):
    """The accuracy rule on out and the gradients of q, k, v, feature_weight and gate."""
    inputs = (*_seq(b, 2 * n, h, hkv, d, dtype, seed, device), *_params(h, d, f, seed, device))
    dout = torch.randn(b, 2 * n, h, d, generator=torch.Generator().manual_seed(seed + 7))
    dout = dout.to(device=device, dtype=dtype)
    ours = _grads(lambda *t: dlm_ops.block_hybrid_train_attn(*t, bs, backend=backend), inputs, dout)
    gold = _grads(lambda *t: block_hybrid_train_attn_ref(*t, bs, compute_dtype=gold_dtype(dtype)),
                  inputs, dout)
    plain = _grads(lambda *t: block_hybrid_train_attn_ref(*t, bs, compute_dtype=dtype), inputs, dout)
    for i, name in enumerate(["out", "dq", "dk", "dv", "dfeature_weight", "dgate"]):
        assert_rule(name, ours[i], gold[i], plain[i], dtype)
    assert ours[0].dtype == dtype and ours[1].dtype == dtype and ours[4].dtype == torch.float32


def _check_decode(b, bs, h, hkv, d, f, blocks, dtype, seed, device="cpu", backend=None):
    q, k, v = _seq(b, bs, h, hkv, d, dtype, seed, device)
    w, gate = _params(h, d, f, seed, device)
    s, z = _state(b, h, hkv, d, f, blocks, bs, seed, device)
    ours = dlm_ops.block_hybrid_attn(q, k, v, s, z, w, gate, backend=backend)
    gold = block_hybrid_attn_ref(q, k, v, s, z, w, gate, compute_dtype=gold_dtype(dtype))
    plain = block_hybrid_attn_ref(q, k, v, s, z, w, gate, compute_dtype=dtype)
    assert ours.dtype == dtype
    assert_rule("out", ours, gold, plain, dtype)
    return ours, plain, gold


# -- the torch backend against the references --------------------------------------------------


@settings(max_examples=20)
@given(attention_problem(max_n=24, head_dims=(8, 16, 32)), st.sampled_from(FEATURES),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.integers(0, 99))
def test_train_matches_reference(p, f, dtype, seed):
    """Shapes, GQA, block_size from 1 to > n (partial last blocks), fwd and all five gradients."""
    _check_train(p["batch"], p["n"], p["heads"], p["kv_heads"], p["head_dim"], f, p["block_size"],
                 dtype, seed)


@settings(max_examples=25)
@given(st.integers(1, 2), st.integers(1, 20), st.sampled_from(HEADS), st.sampled_from([8, 32]),
       st.sampled_from(FEATURES), st.integers(0, 3),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.integers(0, 99))
def test_decode_matches_reference(b, bs, heads, d, f, blocks, dtype, seed):
    """blocks = 0 is the first block (an all-zero state: the clamps keep the denominator > 0)."""
    _check_decode(b, bs, *heads, d, f, blocks, dtype, seed, backend="torch")


def _check_update(b, bs, h, hkv, d, f, dtype, seed, device="cpu", backend=None):
    _, k, v = _seq(b, bs, h, hkv, d, dtype, seed, device)
    w, _ = _params(h, d, f, seed, device)
    s, z = _state(b, h, hkv, d, f, 2, 3, seed, device)
    s0, z0 = s.clone(), z.clone()
    new_s, new_z = dlm_ops.hybrid_state_update(s, z, k, v, w, backend=backend)
    # The state is fp32 whatever the inputs: against a float64 update from the same inputs, the
    # error is fp32 rounding of sums of O(bs) terms on top of values of O(1..10).
    ref_s, ref_z = hybrid_state_update_ref(s.double(), z.double(), k, v, w)
    torch.testing.assert_close(new_s.double(), ref_s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_z.double(), ref_z, rtol=1e-5, atol=1e-5)
    assert new_s.dtype == new_z.dtype == torch.float32
    assert torch.equal(s, s0) and torch.equal(z, z0)  # functional: the old state is left alone


@settings(max_examples=15)
@given(st.integers(0, 9), st.sampled_from(HEADS), st.sampled_from(FEATURES),
       st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 99))
def test_state_update_matches_reference(bs, heads, f, dtype, seed):
    _check_update(2, bs, *heads, 16, f, dtype, seed, backend="torch")


@pytest.mark.parametrize("n,bs,heads", [(7, 3, (4, 2)), (6, 1, (2, 2)), (5, 8, (3, 1)), (8, 4, (2, 1))])
def test_decode_after_committed_blocks_equals_training_rows(n, bs, heads):
    """Sampling (commit clean blocks with hybrid_state_update, decode the next block) computes the
    training form's rows of that block, in both halves: the two ops define one attention."""
    h, hkv = heads
    q, k, v = _seq(2, 2 * n, h, hkv, 16, torch.float64, n)
    w, gate = (t.double() for t in _params(h, 16, 16, n))
    train = dlm_ops.block_hybrid_train_attn(q, k, v, w, gate, bs)
    s = torch.zeros(2, h, 32, 16, dtype=torch.float64)
    z = torch.zeros(2, h, 32, dtype=torch.float64)
    for start in range(0, n, bs):
        end = min(start + bs, n)
        for half in (0, n):
            blk = slice(half + start, half + end)
            out = dlm_ops.block_hybrid_attn(q[:, blk], k[:, blk], v[:, blk], s, z, w, gate)
            torch.testing.assert_close(out, train[:, blk], rtol=1e-12, atol=1e-12)
        clean = slice(n + start, n + end)
        s, z = dlm_ops.hybrid_state_update(s, z, k[:, clean], v[:, clean], w)


@pytest.mark.parametrize("n,bs,heads", [(5, 2, (4, 2)), (4, 1, (2, 1)), (3, 9, (2, 2))])
def test_train_gradcheck_float64(n, bs, heads):
    """block_size 2 with a partial last block, 1, and > n; GQA and MHA."""
    h, hkv = heads
    inputs = (*_seq(1, 2 * n, h, hkv, 8, torch.float64, 3), *(t.double() for t in _params(h, 8, 4, 3)))
    inputs = [t.requires_grad_() for t in inputs]
    # fast_mode checks random projections of the Jacobian: seconds instead of a minute per case.
    assert torch.autograd.gradcheck(lambda *t: dlm_ops.block_hybrid_train_attn(*t, bs), inputs,
                                    fast_mode=True)


def test_train_empty_sequence():
    q, k, v = _seq(2, 0, 2, 1, 8, torch.float32, 0)
    w, gate = _params(2, 8, 4, 0)
    q.requires_grad_()
    out = dlm_ops.block_hybrid_train_attn(q, k, v, w, gate, 4)
    assert out.shape == (2, 0, 2, 8)
    out.sum().backward()
    assert q.grad.shape == q.shape


# -- opcheck and torch.compile ------------------------------------------------------------------


def test_opcheck():
    q, k, v = _seq(2, 10, 4, 2, 16, torch.float32, 0)
    w, gate = _params(4, 16, 8, 0)
    s, z = _state(2, 4, 2, 16, 8, 2, 5, 0)
    blk = (q[:, :5], k[:, :5], v[:, :5])
    torch.library.opcheck(ops.block_hybrid_attn_op, (*blk, s, z, w, gate, None, None))
    torch.library.opcheck(ops.block_hybrid_attn_op, (*blk, s, z, w, gate, 0.3, "torch"))
    torch.library.opcheck(ops.hybrid_state_update_op, (s, z, k[:, :5], v[:, :5], w, None))
    train_in = [t.clone().requires_grad_() for t in (q, k, v, w, gate)]
    torch.library.opcheck(ops.block_hybrid_train_fwd, (*train_in, 3, None, None))
    torch.library.opcheck(ops.block_hybrid_train_fwd, (*train_in, 20, 0.5, "torch"))
    torch.library.opcheck(ops.block_hybrid_train_bwd, (torch.randn_like(q), q, k, v, w, gate, 3,
                                                       None, None))


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_fullgraph_train_and_decode(fresh_dynamo):
    """One training step (fwd + bwd) and one sampling step (decode + commit) under
    torch.compile(fullgraph=True) with Inductor, equal to eager."""
    q, k, v = _seq(2, 12, 4, 2, 16, torch.float32, 1)
    w, gate = _params(4, 16, 8, 1)

    def train(q, k, v, w, gate):
        return dlm_ops.block_hybrid_train_attn(q * 2.0, k, v, w, gate, 4)

    def sample(q, k, v, s, z, w, gate):
        out = dlm_ops.block_hybrid_attn(q, k, v, s, z, w, gate)
        s, z = dlm_ops.hybrid_state_update(s, z, k, v, w)
        return out * 2.0, s, z

    counter = CompileCounterWithBackend("inductor")
    inputs = (q, k, v, w, gate)
    dout = torch.randn_like(q)
    eager = _grads(train, inputs, dout)
    compiled = _grads(torch.compile(train, backend=counter, fullgraph=True), inputs, dout)
    for x, y in zip(compiled, eager):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    s, z = _state(2, 4, 2, 16, 8, 2, 6, 1)
    blk = (q[:, :6], k[:, :6], v[:, :6])
    eager = sample(*blk, s, z, w, gate)
    # aot_eager here: the fake functions and the graph are what is checked, and a second Inductor
    # compile would cost ~10 s of the CI budget.
    sample_counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(sample, backend=sample_counter, fullgraph=True)(*blk, s, z, w, gate)
    for x, y in zip(compiled, eager):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == sample_counter.frame_count == 1


# -- the Triton decode kernel -------------------------------------------------------------------


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a GPU or TRITON_INTERPRET=1")
@settings(max_examples=8)
@given(st.integers(1, 2), st.integers(1, 40), st.sampled_from(HEADS), st.sampled_from([8, 16, 64]),
       st.sampled_from(FEATURES), st.integers(0, 2),
       st.sampled_from([torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])),
       st.integers(0, 99))
def test_triton_decode_kernel(b, bs, heads, d, f, blocks, dtype, seed):
    """Tiny shapes under the interpreter (it computes bf16 dots wrongly: fp32/fp16 only there)."""
    _check_decode(b, bs, *heads, d, f, blocks, dtype, seed, device="cuda" if CUDA else "cpu",
                  backend="triton")


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a GPU or TRITON_INTERPRET=1")
@settings(max_examples=6)
@given(st.integers(0, 40), st.sampled_from(HEADS), st.sampled_from([8, 64]),
       st.sampled_from(FEATURES), st.sampled_from([torch.float32, torch.float16]),
       st.integers(0, 99))
def test_triton_state_update_kernel(bs, heads, d, f, dtype, seed):
    """bs = 0 (an empty commit) included."""
    _check_update(2, bs, *heads, d, f, dtype, seed, device="cuda" if CUDA else "cpu",
                  backend="triton")


def test_triton_declines_what_the_kernel_cannot_hold():
    from dlm_ops.backends.hybrid import HybridProblem, HybridTritonBackend

    triton = HybridTritonBackend()
    p = HybridProblem("cuda", torch.bfloat16, 128, frozenset(), block=256, num_features=256)
    reasons = " ".join(triton.not_supported_reasons(p))
    assert "active block of 256 tokens" in reasons and "KB of shared memory" in reasons
    fits = HybridProblem("cuda", torch.bfloat16, 128, frozenset(), block=32, num_features=64)
    assert not any("shared memory" in r for r in triton.not_supported_reasons(fits))
    training = HybridProblem("cuda", torch.bfloat16, 256, frozenset(), block=0, num_features=256)
    assert not any("shared memory" in r for r in triton.not_supported_reasons(training))


# -- the Triton training kernels ----------------------------------------------------------------


@pytest.fixture
def slice_d():
    """Restores hybrid_train.SLICE_D after a test that lowers it (to run several D slices at the
    small head dims the interpreter can afford)."""
    from dlm_ops.backends import hybrid_train

    saved = hybrid_train.SLICE_D
    yield hybrid_train
    hybrid_train.SLICE_D = saved


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a GPU or TRITON_INTERPRET=1")
@settings(max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(attention_problem(max_n=40, head_dims=(8, 16, 32)), st.sampled_from(FEATURES),
       st.sampled_from([torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])),
       st.sampled_from([16, 32]), st.integers(0, 99))
def test_triton_train_kernels(slice_d, p, f, dtype, ds, seed):
    """Forward and the five gradients of the fused training kernels, by the accuracy rule: n from
    1 (tiny, partial and packed tiles: bs <= 8 packs 32 // bs blocks), block_size 1 to > n, GQA,
    one or two D slices."""
    slice_d.SLICE_D = ds
    _check_train(p["batch"], p["n"], p["heads"], p["kv_heads"], p["head_dim"], f, p["block_size"],
                 dtype, seed, device="cuda" if CUDA else "cpu", backend="triton")


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("n,bs,heads,d,f", [(70, 3, (4, 2), 32, 16), (150, 16, (2, 1), 16, 64),
                                            (100, 40, (1, 1), 16, 5)])
def test_triton_train_kernels_many_tiles(slice_d, n, bs, heads, d, f):
    """Several tiles per sequence (the state crosses tiles in both scans), packed blocks with a
    partial last tile, one block of a whole half."""
    slice_d.SLICE_D = 16
    _check_train(1, n, *heads, d, f, bs, torch.float32, n, device="cuda" if CUDA else "cpu",
                 backend="triton")


def test_triton_train_declines_and_torch_takes_over(monkeypatch):
    from dlm_ops.backends import select
    from dlm_ops.backends.hybrid import HybridProblem, HybridTritonBackend
    from dlm_ops.errors import UnsupportedConfig

    triton = HybridTritonBackend()
    monkeypatch.setenv("DLM_OPS_HYBRID_TRAIN_TRITON", "0")
    opted_out = HybridProblem("cuda", torch.bfloat16, 128, frozenset(), num_features=64,
                              train_block=32)
    assert "switched off (DLM_OPS_HYBRID_TRAIN_TRITON=0)" in " ".join(
        triton.not_supported_reasons(opted_out))
    if not CUDA:
        assert select(opted_out, family="hybrid").name == "torch"
    monkeypatch.delenv("DLM_OPS_HYBRID_TRAIN_TRITON")
    big = HybridProblem("cuda", torch.bfloat16, 128, frozenset(), num_features=64, train_block=65)
    assert "training block of 65 tokens > 64" in " ".join(triton.not_supported_reasons(big))
    wide = HybridProblem("cuda", torch.bfloat16, 256, frozenset(), num_features=64, train_block=32)
    assert "training F x D = 64 x 256" in " ".join(triton.not_supported_reasons(wide))
    many = HybridProblem("cuda", torch.bfloat16, 64, frozenset(), num_features=128, train_block=32)
    assert "take F <= 64" in " ".join(triton.not_supported_reasons(many))
    fits = HybridProblem("cuda", torch.bfloat16, 128, frozenset(), num_features=64, train_block=64)
    if not CUDA:  # (on a GPU the capability checks may add their own reasons)
        assert not triton.not_supported_reasons(fits)
    if not CUDA:  # the decision itself; on a GPU the capability checks add their own reasons
        assert select(big, family="hybrid").name == "torch"
        assert select(fits, family="hybrid").name == "triton"
    # sm90: 64-token blocks run the kernels, their bwd_q with IEEE dots (hybrid_train.EXACT_BWD_Q_SM90_ROWS)
    from dlm_ops.backends import hybrid_train

    with pytest.MonkeyPatch.context() as arch:
        arch.setattr(torch.cuda, "is_available", lambda: True)
        arch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        assert not triton.not_supported_reasons(HybridProblem(
            "cuda", torch.bfloat16, 128, frozenset(), num_features=64, train_block=64))
        cuda = torch.device("cuda")
        assert hybrid_train.exact_bwd_q(cuda, 64) and not hybrid_train.exact_bwd_q(cuda, 32)
        assert not hybrid_train.exact_bwd_q(torch.device("cpu"), 64)
        arch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
        assert not triton.not_supported_reasons(fits)
        assert not hybrid_train.exact_bwd_q(cuda, 64)
    q, k, v = _seq(1, 2 * 70, 2, 1, 16, torch.float32, 0)
    w, gate = _params(2, 16, 8, 0)
    with pytest.raises(UnsupportedConfig, match="training block of 65 tokens"):
        dlm_ops.block_hybrid_train_attn(q, k, v, w, gate, 65, backend="triton")


def test_train_kernel_geometry():
    """Tiles hold whole blocks: bs <= 16 packs 32 // bs of them, longer blocks take one tile."""
    from dlm_ops.backends.hybrid_train import geometry

    g = geometry(100, 4)
    assert (g.block_t, g.tile_len, g.num_tiles, g.multi) == (32, 32, 4, True)
    g = geometry(100, 3)
    assert (g.block_t, g.tile_len, g.num_tiles, g.multi) == (32, 30, 4, True)
    g = geometry(100, 16)
    assert (g.block_t, g.tile_len, g.num_tiles, g.multi) == (32, 32, 4, True)
    g = geometry(100, 32)
    assert (g.block_t, g.tile_len, g.num_tiles, g.multi) == (32, 32, 4, False)
    g = geometry(40, 64)  # block_size > n: one block of n tokens
    assert (g.bs, g.block_t, g.tile_len, g.num_tiles, g.multi) == (40, 64, 40, 1, False)


@pytest.mark.skipif(CUDA, reason="on a GPU the kernels compile natively in the tests above")
def test_train_kernels_compile_for_sm90():
    """The interpreter never lowers a kernel: compile the training kernels for sm90 (H100/H200) in a
    subprocess without TRITON_INTERPRET, at the configs with the most shared memory (packed bs=4
    and bs=64 tiles at D=128, F=64) and the row kernels, and check that they can launch: <= 227 KiB
    of shared memory, <= 255 registers, and no SASS instruction that computes with the stack
    pointer (issue 6: ptxas 12.8 built a wgmma descriptor from it in a spilling bwd_q). They do
    spill at F=64 (the numbers are printed, and discussed in
    dlm_ops/backends/hybrid_train.launch_config); zero spills is not asserted."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    only = ",".join([f"{k}_{s}" for s in ("bs4", "bs64") for k in ("fwd", "scan", "bwd_q", "bwd_k")]
                    + ["logits_bs32", "dW_bs32"])
    run = subprocess.run([sys.executable, "-m", "tests.hybrid_sm90_compile", "--only", only],
                         cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    if run.returncode and "cuobjdump" in run.stderr and "No such file" in run.stderr:
        pytest.skip("this Triton wheel ships no cuobjdump")
    assert run.returncode == 0, run.stderr[-2000:]
    print(run.stdout)
    lines = [line.split() for line in run.stdout.splitlines() if line.strip()]
    assert sorted(line[0] for line in lines) == sorted(only.split(","))
    for name, smem, regs, stack, sp, *_ in lines:
        assert int(smem) <= 227 * 1024, f"{name}: {smem} bytes of shared memory"
        assert int(regs) <= 255, f"{name}: {regs} registers"
        assert int(sp) == 0, f"{name}: {sp} SASS instructions compute with the stack pointer"


# -- validation ---------------------------------------------------------------------------------


def _decode_args(**over):
    q, k, v = _seq(1, 4, 4, 2, 16, torch.float32, 0)
    w, gate = _params(4, 16, 8, 0)
    s, z = torch.zeros(1, 4, 16, 16), torch.zeros(1, 4, 16)
    args = dict(q=q, k=k, v=v, state_s=s, state_z=z, feature_weight=w, gate=gate)
    args.update(over)
    return args


@pytest.mark.parametrize("over,match", [
    (dict(state_s=torch.zeros(1, 4, 16, 16, dtype=torch.float16)), "state_s.dtype must be torch.float32"),
    (dict(state_s=torch.zeros(1, 4, 8, 16)), r"state_s must have shape \(1, 4, 16, 16\)"),
    (dict(state_z=torch.zeros(1, 4, 17)), r"state_z must have shape \(1, 4, 16\)"),
    (dict(feature_weight=torch.zeros(4, 8, 8)), "feature_weight must have shape"),
    (dict(feature_weight=torch.zeros(4, 16, 8, dtype=torch.int32)), "feature_weight.dtype"),
    (dict(gate=torch.zeros(3)), r"gate must have shape \(heads=4,\)"),
    (dict(k=torch.zeros(1, 4, 3, 16), v=torch.zeros(1, 4, 3, 16)), "multiple of k's"),
    (dict(q=torch.zeros(1, 0, 4, 16), k=torch.zeros(1, 0, 2, 16), v=torch.zeros(1, 0, 2, 16)),
     "active block"),
])
def test_decode_validation(over, match):
    with pytest.raises(ValueError, match=match):
        dlm_ops.block_hybrid_attn(**_decode_args(**over))


def test_decode_validation_scale_and_backend():
    with pytest.raises(ValueError, match="softmax_scale"):
        dlm_ops.block_hybrid_attn(**_decode_args(), softmax_scale=-1.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        dlm_ops.block_hybrid_attn(**_decode_args(), backend="cutlass")


def test_state_update_and_train_validation():
    a = _decode_args()
    with pytest.raises(ValueError, match="state_z.dtype"):
        dlm_ops.hybrid_state_update(a["state_s"], a["state_z"].double(), a["k"], a["v"],
                                    a["feature_weight"])
    with pytest.raises(ValueError, match=r"k must have shape \(batch=1"):
        dlm_ops.hybrid_state_update(a["state_s"], a["state_z"], a["k"][:, :, :, :8],
                                    a["v"][:, :, :, :8], a["feature_weight"])
    with pytest.raises(ValueError, match="v must have k's shape"):
        dlm_ops.hybrid_state_update(a["state_s"], a["state_z"], a["k"], a["v"][:, :2],
                                    a["feature_weight"])
    q, k, v = _seq(1, 6, 4, 2, 16, torch.float32, 0)
    w, gate = a["feature_weight"], a["gate"]
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        dlm_ops.block_hybrid_train_attn(q, k, v, w, gate, 0)
    with pytest.raises(ValueError, match="even sequence length"):
        dlm_ops.block_hybrid_train_attn(q[:, :5], k[:, :5], v[:, :5], w, gate, 2)
    with pytest.raises(ValueError, match="gate must have shape"):
        dlm_ops.block_hybrid_train_attn(q, k, v, w, gate[None], 2)


# -- GPU (python -m pytest -m gpu) --------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_default_decode_backend_is_triton():
    from dlm_ops.backends import select
    from dlm_ops.backends.hybrid import HybridProblem

    p = HybridProblem("cuda", torch.bfloat16, 128, frozenset({"gqa"}), block=32, num_features=64)
    assert select(p, family="hybrid").name == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,bs,h,hkv,d,f,blocks", [
    (2, 32, 32, 8, 128, 64, 16), (3, 7, 16, 16, 64, 16, 3), (1, 64, 4, 1, 128, 64, 2),
    (2, 1, 8, 2, 256, 64, 5), (4, 32, 16, 16, 128, 64, 0),
])
def test_gpu_decode_accuracy_and_triton_vs_torch(dtype, b, bs, h, hkv, d, f, blocks):
    ours, plain, gold = _check_decode(b, bs, h, hkv, d, f, blocks, dtype, b * bs, device="cuda")
    q, k, v = _seq(b, bs, h, hkv, d, dtype, b * bs, "cuda")
    w, gate = _params(h, d, f, b * bs, "cuda")
    s, z = _state(b, h, hkv, d, f, blocks, bs, b * bs, "cuda")
    torch_out = dlm_ops.block_hybrid_attn(q, k, v, s, z, w, gate, backend="torch")
    assert_rule("triton vs torch", ours, torch_out, plain, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,bs,heads", [(512, 32, (8, 2)), (300, 7, (4, 4)), (64, 100, (4, 1)),
                                        (1024, 4, (4, 1)), (256, 64, (2, 2)), (97, 16, (3, 1))])
def test_gpu_train_accuracy(monkeypatch, dtype, n, bs, heads):
    """The fused Triton kernels (the default on CUDA); on sm90 the 64-token blocks (bs 64 and 100)
    take IEEE dots in bwd_q (hybrid_train.EXACT_BWD_Q_SM90_ROWS says why)."""
    monkeypatch.delenv("DLM_OPS_HYBRID_TRAIN_TRITON", raising=False)
    _check_train(2, n, *heads, 128, 64, bs, dtype, n, device="cuda")


@pytest.mark.gpu
def test_gpu_train_backend_is_triton_unless_switched_off(monkeypatch):
    from dlm_ops.backends import select
    from dlm_ops.backends.hybrid import HybridProblem

    p = HybridProblem("cuda", torch.bfloat16, 128, frozenset({"gqa"}), num_features=64,
                      train_block=32)
    monkeypatch.delenv("DLM_OPS_HYBRID_TRAIN_TRITON", raising=False)
    assert select(p, family="hybrid").name == "triton"
    monkeypatch.setenv("DLM_OPS_HYBRID_TRAIN_TRITON", "0")
    assert select(p, family="hybrid").name == "torch"


@pytest.mark.gpu
@pytest.mark.parametrize("n,bs,d,f", [(512, 32, 128, 64), (256, 4, 64, 16)])
def test_gpu_train_triton_vs_torch(monkeypatch, n, bs, d, f):
    """The two backends on the same bf16 inputs, each against the fp32 reference: the rule with
    the torch backend as the reference side (both compute in fp32 from bf16 inputs)."""
    monkeypatch.delenv("DLM_OPS_HYBRID_TRAIN_TRITON", raising=False)
    dtype = torch.bfloat16
    inputs = (*_seq(2, 2 * n, 8, 2, d, dtype, n, "cuda"), *_params(8, d, f, n, "cuda"))
    dout = torch.randn(2, 2 * n, 8, d, generator=torch.Generator().manual_seed(n))
    dout = dout.to(device="cuda", dtype=dtype)
    ours, ref = (_grads(lambda *t, be=be: dlm_ops.block_hybrid_train_attn(*t, bs, backend=be),
                        inputs, dout) for be in ("triton", "torch"))
    plain = _grads(lambda *t: block_hybrid_train_attn_ref(*t, bs, compute_dtype=dtype), inputs,
                   dout)
    for i, name in enumerate(["out", "dq", "dk", "dv", "dfeature_weight", "dgate"]):
        assert_rule(f"triton vs torch {name}", ours[i], ref[i], plain[i], dtype)


# -- the benchmark's CPU-checkable parts ---------------------------------------------------------


def test_benchmark_cases_and_table():
    from benchmarks import hybrid as bench

    a = bench.parse_args([])
    decode, train = bench.decode_cases(a), bench.train_cases(a)
    assert {(c.heads, c.kv_heads) for c in decode} == {(32, 8), (16, 16)}
    assert {c.batch for c in decode} == {1, 16} and {c.prefix for c in decode} == {1024, 4096,
                                                                                  16384, 32768}
    assert all(c.head_dim == 128 and c.block == 32 and c.features == 64 for c in decode)
    assert all(c.batch * 2 * c.n == bench.TOKENS for c in train)
    a = bench.parse_args(["--batches", "2", "--prefixes", "64", "--heads", "4/2"])
    (case,) = bench.decode_cases(a)
    rows = bench.decode_rows(case, {"eager": {"hybrid attn": 1.0, "hybrid update": 4.0,
                                              "sdpa flash": 3.0}}, steps_per_block=8)
    step = next(r for r in rows if r["contender"] == "hybrid step")
    assert step["ms"] == 1.5
    assert next(r for r in rows if r["contender"] == "sdpa flash")["ratio_sdpa_over_hybrid"] == 2.0
    table = bench.markdown(rows)
    assert "| sdpa flash / hybrid step |" in table.splitlines()[0] and "| 2.00 |" in table
    a = bench.parse_args(["--train-n", "512", "--train-blocks", "4,32", "--heads", "8/2"])
    assert [c.block_size for c in bench.train_cases(a)] == [4, 32]
    (case, _) = bench.train_cases(a)
    rows = bench.train_rows(case, {"fwd+bwd": {"hybrid train": 2.0, "hybrid train torch": 10.0,
                                               "sdpa cudnn causal": 1.0}})
    ratio = {r["contender"]: r["ratio_sdpa_over_hybrid"] for r in rows}
    assert ratio == {"hybrid train": None, "hybrid train torch": 5.0, "sdpa cudnn causal": 0.5}
    assert "| hybrid train torch / hybrid train |" in bench.markdown(rows)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,bs,h,hkv,d,f", [(2, 32, 32, 8, 128, 64), (1, 64, 4, 1, 128, 64),
                                            (3, 5, 16, 16, 256, 16)])
def test_gpu_state_update(dtype, b, bs, h, hkv, d, f):
    _check_update(b, bs, h, hkv, d, f, dtype, bs, device="cuda")  # the default backend: triton


def test_compile_dynamic_shapes(fresh_dynamo):
    """Symbolic batch and sequence length: the fake functions must not specialise on them (aot_eager:
    the graph and the fake functions are what is checked)."""
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def train(q, k, v, w, gate):
        return dlm_ops.block_hybrid_train_attn(q, k, v, w, gate, 3)

    w, gate = _params(4, 16, 8, 2)
    # sizes unlike the fixed ones (heads 4, kv heads 2, D 16, F 8): dynamo would duck-size them
    for b, s in ((3, 10), (5, 14), (3, 6)):
        inputs = (*_seq(b, s, 4, 2, 16, torch.float32, s), w, gate)
        dout = torch.randn(b, s, 4, 16)
        for x, y in zip(_grads(train, inputs, dout),
                        _grads(lambda *t: dlm_ops.block_hybrid_train_attn(*t, 3), inputs, dout)):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1
