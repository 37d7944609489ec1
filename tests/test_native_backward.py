"""The eager step's backward as a C++ autograd node (cutlass_diffusion.NATIVE_BACKWARD, the
extension's attach_bwd / run_bwd, csrc/bindings/diffusion_autograd_sm90.cpp): bitwise the Python
node's gradients on every layout the plan knows (batched, a batched call run packed, packed
samples), and the Python node's autograd behaviour (unused outputs, dout layouts, a second
differentiation, in-place changes of saved inputs, saved-tensor hooks, retain_graph).
sm90 GPUs with the extension built; the plan itself is checked on the CPU in test_cutlass_dispatch."""

import pytest
import torch

import dlm_ops
from dlm_ops.backends import cutlass_diffusion as cd

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the cutlass backend is sm90 only")]

NODE = "DiffusionAttnCutlassBackward"


def _inputs(b, s, h, hkv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, heads, d, device="cuda", generator=g).to(dtype)
            for heads in (h, hkv, hkv)]


# (name, call, tensors): batched on the 128 grid (the dS backward), D = 64 (the two-kernel dQ), a
# batched BD3 call off the grid (run as packed samples), block-causal over odd lengths, GQA, D = 256,
# and packed samples with empty ones.
def _cases():
    cu_list = [0, 200, 200, 274, 274, 1074]
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    varlen = [t[0] for t in _inputs(1, cu_list[-1], 4, 2, 128, seed=5)]
    return [
        ("bd3 ds", lambda q, k, v: dlm_ops.diffusion_attn_func(q, k, v, 16, return_lse=True),
         _inputs(2, 512, 4, 4, 128, seed=1)),
        ("bd3 d64", lambda q, k, v: dlm_ops.diffusion_attn_func(q, k, v, 4, return_lse=True),
         _inputs(2, 512, 4, 2, 64, seed=2)),
        ("bd3 off grid", lambda q, k, v: dlm_ops.diffusion_attn_func(q, k, v, 16, return_lse=True),
         _inputs(3, 600, 4, 2, 128, seed=3)),
        ("causal odd", lambda q, k, v: dlm_ops.block_causal_attn_func(q, k, v, 5, return_lse=True),
         _inputs(2, 331, 4, 1, 128, seed=4)),
        ("bd3 d256 gqa", lambda q, k, v: dlm_ops.diffusion_attn_func(q, k, v, 16, return_lse=True),
         _inputs(2, 512, 8, 2, 256, seed=6)),
        ("varlen", lambda q, k, v: dlm_ops.diffusion_attn_varlen_func(q, k, v, cu, 800, 16,
                                                                      return_lse=True), varlen),
    ]


CASES = _cases() if torch.cuda.is_available() else []


def _step(monkeypatch, native: bool, call, tensors, loss):
    monkeypatch.setattr(cd, "NATIVE_BACKWARD", native)
    x = [t.detach().clone().requires_grad_() for t in tensors]
    out, lse = call(*x)
    assert (NODE in out.grad_fn.name()) == native, out.grad_fn.name()
    return (out, lse, *torch.autograd.grad(loss(out, lse), x))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
@pytest.mark.parametrize("grads", ["out and lse", "out only", "lse only", "expanded dout"])
def test_native_node_is_bitwise_the_python_node(monkeypatch, case, grads):
    _, call, tensors = CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = torch.randn(tensors[0].shape, device="cuda", generator=gen).to(tensors[0].dtype)
    losses = {
        "out and lse": lambda out, lse: (out * w).float().sum() + (lse * lse.detach().sin()).sum(),
        "out only": lambda out, lse: (out * w).float().sum(),  # dlse arrives undefined
        "lse only": lambda out, lse: lse.sum(),  # dout undefined: zeros
        "expanded dout": lambda out, lse: out.float().sum(),  # dout an expand (zero strides)
    }
    before = dict(cd.STATS)
    native = _step(monkeypatch, True, call, tensors, losses[grads])
    python = _step(monkeypatch, False, call, tensors, losses[grads])
    runs = sum(cd.STATS[k] - before[k] for k in ("bwd", "varlen_bwd"))
    assert runs == 2 and cd.STATS["bwd_fallback"] == before["bwd_fallback"], "not CUTLASS's backward"
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), native, python):
        assert not a.isnan().any(), name
        assert torch.equal(a, b), name


def test_native_node_behaves_as_the_python_node(monkeypatch):
    """grad_fn, retain_graph, a second differentiation, an in-place change of a saved input, and
    saved-tensor hooks (the five tensors the node keeps)."""
    _, call, tensors = CASES[0]
    x = [t.detach().clone().requires_grad_() for t in tensors]
    out, lse = call(*x)
    assert NODE in out.grad_fn.name() and out.grad_fn is lse.grad_fn
    first = torch.autograd.grad(out.float().sum(), x, retain_graph=True)
    again = torch.autograd.grad(out.float().sum(), x)
    assert all(torch.equal(a, b) for a, b in zip(first, again))

    out, _ = call(*x)
    dq, _, _ = torch.autograd.grad(out.float().sum(), x, create_graph=True)
    assert dq.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.float().sum().backward()

    out, _ = call(*x)
    with torch.no_grad():
        x[1].add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out.float().sum(), x)

    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, lse = call(*x)
    assert NODE in out.grad_fn.name() and len(packed) == 5
    assert torch.autograd.grad(out.float().sum(), x)[0].shape == x[0].shape


def test_native_node_with_some_inputs_frozen(monkeypatch):
    """Only q asks for a gradient: the node still runs (one plan, all three gradients computed),
    and its dq is the Python node's."""
    _, call, tensors = CASES[0]
    grads = []
    for native in (True, False):
        monkeypatch.setattr(cd, "NATIVE_BACKWARD", native)
        q = tensors[0].clone().requires_grad_()
        out, _ = call(q, tensors[1], tensors[2])
        grads.append(torch.autograd.grad(out.float().sum(), q)[0])
    assert torch.equal(*grads)
