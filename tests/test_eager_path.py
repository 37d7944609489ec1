"""The public functions' two ways in (dlm_ops/ops/eager.py): plain eager calls run the op's body
under an autograd.Function, everything else goes through the registered op. Both must give the
same results, bitwise, and the op must be what modes, compile and subclasses see."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import dlm_ops
import dlm_ops.ops.eager as eager
from dlm_ops.backends.triton_backend import INTERPRET

from .strategies import make_qkv

def _small(dtype, seed):
    """q, k, v (1, 12, 2, 16) that require grad."""
    return (t.requires_grad_() for t in make_qkv((1, 12, 2, 16), (1, 12, 2, 16), dtype, seed))


_PLAIN = eager.plain_eager  # the module's own check (tests below swap it for "never")

CALLS = {
    "diffusion": lambda q, k, v, **kw: dlm_ops.diffusion_attn_func(q, k, v, 3, **kw),
    "block_causal": lambda q, k, v, **kw: dlm_ops.block_causal_attn_func(q, k, v, 3, **kw),
    "varlen": lambda q, k, v, **kw: dlm_ops.diffusion_attn_varlen_func(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
        torch.tensor([0, 8, 8, 20], dtype=torch.int32), 12, 3, **kw),
    # q (1, 20, 4, 16): 2 query blocks of 16, 2 key blocks of 16; the second list empty
    "block_sparse": lambda q, k, v, **kw: dlm_ops.block_sparse_attn(
        q, k, v, torch.tensor([[1, 0], [0, 1]], dtype=torch.int32).expand(1, 4, 2, 2),
        torch.tensor([2, 0], dtype=torch.int32).expand(1, 4, 2), block_size_q=16,
        block_size_k=16, **kw),
    "column_sparse": lambda q, k, v, **kw: dlm_ops.column_sparse_attn(
        q, k, v, torch.tensor([5, 0, 19, 7, 3], dtype=torch.int32).expand(1, 4, 5),
        torch.tensor([[5, 2, 0, 4]], dtype=torch.int32), **kw),
}


def _grads(call, inputs, use_lse, **kw):
    """out, lse and the gradients of a loss on out (and on lse with use_lse)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out, lse = call(*leaves, return_lse=True, **kw)
    torch.manual_seed(0)
    loss = (out * torch.randn_like(out)).sum() + (lse.sum() if use_lse else 0)
    return (out, lse, *torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("use_lse", [False, True])
@given(st.sampled_from([torch.float32, torch.float64]), st.integers(0, 99))
@settings(max_examples=3)
def test_the_eager_way_is_bitwise_the_op(name, use_lse, dtype, seed):
    inputs = make_qkv((1, 20, 4, 16), (1, 20, 2, 16), dtype, seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eager, "plain_eager", lambda tensors: False)
        through_op = _grads(CALLS[name], inputs, use_lse)
    direct = _grads(CALLS[name], inputs, use_lse)
    for a, b in zip(through_op, direct):
        assert torch.equal(a, b)


def test_plain_eager_calls_skip_the_dispatcher():
    q, k, v = _small(torch.float32, 1)
    out = dlm_ops.diffusion_attn_func(q, k, v, 3)
    assert type(out.grad_fn).__name__ == "diffusion_attn_eagerBackward"
    with torch.no_grad():
        assert dlm_ops.diffusion_attn_func(q, k, v, 3).grad_fn is None
    # A plain Parameter (a model's weights, e.g. the hybrid ops' feature map) is a plain tensor to
    # the dispatcher; a tensor subclass is not, and takes the op.
    p = torch.nn.Parameter(q.detach().clone())
    node = type(dlm_ops.diffusion_attn_func(p, k, v, 3).grad_fn).__name__
    assert node == "diffusion_attn_eagerBackward"

    class Sub(torch.Tensor):
        pass

    s = q.detach().clone().as_subclass(Sub).requires_grad_()
    assert "eager" not in type(dlm_ops.diffusion_attn_func(s, k, v, 3).grad_fn).__name__


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_the_ops():
    """FlopCounterMode, FakeTensorMode and the like must see dlm::*, not the body's aten calls."""
    q, k, v = _small(torch.float32, 2)
    with _Record() as mode:
        out = dlm_ops.diffusion_attn_func(q, k, v, 3)
        out.sum().backward()
    assert "dlm.diffusion_attn_fwd.default" in mode.ops
    assert "dlm.diffusion_attn_bwd.default" in mode.ops


def test_compile_sees_the_op():
    q, k, v = make_qkv((1, 12, 2, 16), (1, 12, 2, 16), torch.float32, 3)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    f = torch.compile(lambda q, k, v: dlm_ops.diffusion_attn_func(q, k, v, 3), backend=backend,
                      fullgraph=True)
    torch.testing.assert_close(f(q, k, v), dlm_ops.diffusion_attn_func(q, k, v, 3))
    assert any("dlm.diffusion_attn_fwd" in str(n.target) for g in graphs for n in g.graph.nodes)


@pytest.mark.parametrize("plain", [True, False])
def test_double_backward_raises(plain):
    """The kernels have no derivative: differentiating a gradient raises on both ways in (the op:
    no autograd formula for the backward op; the eager way: once_differentiable), not zeros."""
    q, k, v = _small(torch.float64, 4)
    with pytest.MonkeyPatch.context() as mp:
        if not plain:
            mp.setattr(eager, "plain_eager", lambda tensors: False)
        out = dlm_ops.diffusion_attn_func(q, k, v, 3)
        for loss in (out.sum(), (out ** 2).sum()):
            (dq,) = torch.autograd.grad(loss, q, create_graph=True, retain_graph=True)
            with pytest.raises(RuntimeError):
                torch.autograd.grad(dq.sum(), q)


def test_the_eager_way_records_no_op_call():
    """Neither the forward nor the backward op is dispatched on the eager way (the profiler
    records every dispatched op by name): the backward calls the body too."""
    q, k, v = _small(torch.float32, 5)

    def dispatched():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            dlm_ops.diffusion_attn_func(q, k, v, 3).sum().backward()
        return {e.name for e in prof.events() if e.name.startswith("dlm::")}

    assert dispatched() == set()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eager, "plain_eager", lambda tensors: False)
        assert dispatched() == {"dlm::diffusion_attn_fwd", "dlm::diffusion_attn_bwd"}


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                    reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("is_causal", [True, False])
def test_exact_attention_eager_way_is_bitwise_the_op(is_causal):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (t.to(device) for t in make_qkv((1, 2, 24, 16), (1, 2, 24, 16), torch.float16, 6))

    def grads():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = dlm_ops.attention(*leaves, is_causal=is_causal)
        assert ("eager" in type(out.grad_fn).__name__) == (eager.plain_eager is _PLAIN)
        return (out, *torch.autograd.grad((out.float() ** 2).sum(), leaves))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eager, "plain_eager", lambda tensors: False)
        through_op = grads()
    for a, b in zip(through_op, grads()):
        assert torch.equal(a, b)


def _cached_calls():
    """The cached family's public calls on one small decode problem (torch backend, CPU)."""
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32)
    q, kb, vb = r(2, 4, 4, 16), r(2, 4, 2, 16), r(2, 4, 2, 16)
    kc, vc = r(2, 10, 2, 16), r(2, 10, 2, 16)
    lens = torch.tensor([3, 10], dtype=torch.int32)
    refresh = lambda: dlm_ops.flashblock_refresh(q, kc, vc, kb, vb, cache_seqlens=lens)
    return {
        "block_decode_attn": lambda: dlm_ops.block_decode_attn(q, kc, vc, cache_seqlens=lens,
                                                               k_new=kb, v_new=vb, return_lse=True),
        "flashblock_refresh": refresh,
        "flashblock_attn": lambda: dlm_ops.flashblock_attn(
            q, kb, vb, *refresh()[2:], dirty=torch.tensor([[True, False, False, True]] * 2),
            return_lse=True),
        "merge_attn_states": lambda: dlm_ops.merge_attn_states(
            *dlm_ops.block_decode_attn(q, kc, vc, cache_seqlens=lens, return_lse=True),
            *dlm_ops.block_decode_attn(q, kb, vb, return_lse=True)),
    }


@pytest.mark.parametrize("name", sorted(_cached_calls()))
def test_cached_ops_eager_way_is_bitwise_the_op(name):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eager, "plain_eager", lambda tensors: False)
        through_op = _cached_calls()[name]()
    direct = _cached_calls()[name]()
    for a, b in zip(through_op, direct):
        assert torch.equal(a, b)


def test_cached_ops_with_a_gradient_take_the_op():
    """No autograd.Function for these: the decode ops' backward raises (inference-only) and the
    merge's backward must stay differentiable (its test_merge_gradcheck), so calls that want a
    gradient go through the ops."""
    oa, ob = (torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    la, lb = (torch.randn(1, 2, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out, lse = dlm_ops.merge_attn_states(oa, la, ob, lb)
    assert "eager" not in type(out.grad_fn).__name__
    (d,) = torch.autograd.grad((out ** 2).sum(), oa, create_graph=True)
    assert d.grad_fn is not None  # a second derivative exists


def test_hybrid_ops_eager_way_is_bitwise_the_op():
    """The block-hybrid family: the training op's gradients (feature_weight and gate as
    nn.Parameters, as in a model) and the decode-step ops, each way in."""
    from .test_hybrid_attn import _params, _seq

    q, k, v = _seq(2, 10, 4, 2, 16, torch.float64, 5)
    w, gate = _params(4, 16, 8, 5)
    w, gate = w.double(), gate.double()

    def run():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        params = [torch.nn.Parameter(t.detach().clone()) for t in (w, gate)]
        out = dlm_ops.block_hybrid_train_attn(*leaves, *params, 3)
        grads = torch.autograd.grad((out ** 2).sum(), leaves + params)
        with torch.no_grad():
            s, z = dlm_ops.hybrid_state_update(torch.zeros(2, 4, 16, 16, dtype=torch.float64),
                                               torch.zeros(2, 4, 16, dtype=torch.float64),
                                               k[:, 5:8], v[:, 5:8], w)
            dec = dlm_ops.block_hybrid_attn(q[:, 8:], k[:, 8:], v[:, 8:], s, z, w, gate)
        return "eager" in type(out.grad_fn).__name__, (out, *grads, s, z, dec)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eager, "plain_eager", lambda tensors: False)
        op_eager, through_op = run()
    direct_eager, direct = run()
    assert (op_eager, direct_eager) == (False, True)
    for a, b in zip(through_op, direct):
        assert torch.equal(a, b)


def test_plain_eager_sees_transforms_and_modes():
    """vmap, torch.func.grad, a TorchFunctionMode and FakeTensorMode each keep calls on the ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []

    def probe(x):
        seen.append(eager.plain_eager([x]))
        return x * 2

    torch.vmap(probe)(torch.randn(3, 4))
    torch.func.grad(lambda x: probe(x).sum())(torch.randn(3))

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        seen.append(eager.plain_eager([torch.randn(2)]))
    with FakeTensorMode():
        seen.append(eager.plain_eager([torch.empty(2)]))
    assert seen == [False] * 4
    assert eager.plain_eager([torch.randn(2), None])


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["batched", "gqa_d64", "varlen"])
def test_gpu_eager_way_is_bitwise_the_op(case):
    """On the GPU's default backend (CUTLASS on sm90, Triton elsewhere): the same kernels either way,
    so out, lse and every gradient agree bitwise (the backward has no atomics)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    h, hkv, d = (8, 2, 64) if case == "gqa_d64" else (4, 4, 128)
    q, k, v = (torch.randn(2, 512, n, d, device="cuda", generator=g).to(torch.bfloat16)
               for n in (h, hkv, hkv))
    if case == "varlen":
        cu = torch.tensor([0, 256, 256, 1024], dtype=torch.int32, device="cuda")
        call = lambda q, k, v, **kw: dlm_ops.diffusion_attn_varlen_func(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, 768, 16, **kw)
    else:
        call = lambda q, k, v, **kw: dlm_ops.diffusion_attn_func(q, k, v, 16, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eager, "plain_eager", lambda tensors: False)
        through_op = _grads(call, (q, k, v), use_lse=True)
    direct = _grads(call, (q, k, v), use_lse=True)
    for a, b in zip(through_op, direct):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["diffusion", "block_causal", "varlen"])
def test_a_backend_node_is_asked_for_plain_eager_calls_with_grad(monkeypatch, name):
    """A backend with fwd_with_grad (the cutlass one: its backward as a C++ autograd node) is asked
    for exactly the calls that would take the Python node, and its answer is the call's result;
    None keeps the Python node. Calls without a gradient and calls through the op never ask."""
    from dlm_ops.backends import REGISTRIES

    torch_backend = REGISTRIES["diffusion"]["torch"]
    attr = "varlen_fwd_with_grad" if name == "varlen" else "fwd_with_grad"
    asked, answer = [], {}

    def fwd_with_grad(q, k, v, mask, scale, softcap, deterministic):
        asked.append((tuple(q.shape), mask, scale, softcap, deterministic))
        return answer.get("out")

    monkeypatch.setattr(torch_backend, attr, fwd_with_grad, raising=False)
    q, k, v = (t.requires_grad_()
               for t in make_qkv((1, 20, 4, 16), (1, 20, 2, 16), torch.float32, 0))
    out = CALLS[name](q, k, v, softcap=0.5, deterministic=True)
    assert len(asked) == 1 and asked[0][3:] == (0.5, True) and out.grad_fn is not None
    assert "eager" in out.grad_fn.name()  # None: the Python node
    with torch.no_grad():
        CALLS[name](q, k, v)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eager, "plain_eager", lambda tensors: False)
        CALLS[name](q, k, v)
    assert len(asked) == 1
    marker = (torch.zeros(1), torch.zeros(1))
    answer["out"] = marker
    out, lse = CALLS[name](q, k, v, return_lse=True)
    assert out is marker[0] and lse is marker[1]
