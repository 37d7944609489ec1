"""Plain eager calls without the dispatcher round trip of a custom op.

A ``torch.library.custom_op`` with ``register_autograd`` costs a training step far more host time
than its kernels' launches: the call goes through the dispatcher into torch._library's Python
autograd wrapper (schema default filling, an alias check of the outputs, a redispatch below the
Autograd key), and the backward op does the same again. Measured on the CPU of this project's
workstation with the CUTLASS backend's Python path (a no-op extension, ``B=1 2n=2048 H=1``): 31 us
per forward, 32 per backward op, but 160 per training step; on the H200's host a D = 64 step at
n = 2K spent 1.03 ms on the host (forward 0.18, backward op 0.34) for 0.96 ms of kernels, so the
step was host-bound (session 11, csrc/NOTES.md).

So where nothing else needs to see the op (not compiling or tracing, no torch function or
dispatch mode, no functorch transform, plain tensors or parameters), the public functions run the
op's own Python body directly, under a ``torch.autograd.Function`` when a gradient is wanted. The
body and the backward are the ones the op registers: one implementation, two ways in. Everything
else (``torch.compile``, FakeTensor, ``opcheck``, a TorchDispatchMode such as FlopCounterMode,
vmap, tensor subclasses) still goes through the op.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.autograd.function import once_differentiable

# Private torch functions (present in torch 2.11 through 2.13); if one is missing every call takes
# the op, which is always correct.
_MODE_ON = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_DISPATCH_DEPTH = getattr(torch._C, "_len_torch_dispatch_stack", None)
_FUNCTORCH_ON = getattr(torch._C, "_are_functorch_transforms_active", None)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def plain_eager(tensors: Sequence) -> bool:
    """Whether a call on ``tensors`` may skip the op: eager, no modes or transforms, and every
    tensor a torch.Tensor or a plain nn.Parameter (whose torch function handling is disabled; a
    Parameter around a tensor subclass has a type of its own, and any subclass takes the op)."""
    if torch.compiler.is_compiling():  # first: under Dynamo the rest is never traced
        return False
    if _MODE_ON is None or _DISPATCH_DEPTH is None or _FUNCTORCH_ON is None:
        return False
    if _MODE_ON() or _DISPATCH_DEPTH() or _FUNCTORCH_ON():
        return False
    return all(t is None or type(t) in _PLAIN_TYPES for t in tensors)


class EagerOp:
    """An op's two ways in: ``op`` (the registered custom op) and its Python body ``forward`` (the
    op's body, or its part after the validation where the public function has validated) with
    ``setup_context`` / ``backward`` (the functions given to ``register_autograd``; the backward
    must call the backward op's body, not the op, to stay off the dispatcher too) and, optionally,
    ``native``: the same forward with a backward the backend runs as a C++ autograd node (on CUDA
    the autograd engine runs a backward on its device thread, where a Python backward cost the
    H200's host 0.2-0.4 ms per step: backends/cutlass_diffusion.py NATIVE_BACKWARD). Without a
    ``backward`` only calls that want no gradient run the body (inference-only ops, and ops whose
    backward is itself differentiable, which once_differentiable would cut)."""

    def __init__(self, name: str, op, forward: Callable, setup_context: Callable | None = None,
                 backward: Callable | None = None, native: Callable | None = None):
        # native(*args): the forward with its backward attached as a C++ autograd node, or None
        # where the backend has none for this call (the Python node then).
        self.op, self.forward, self.function, self.native = op, forward, None, native
        if backward is None:  # calls that want a gradient take the op
            return

        def function_forward(ctx, *args):
            output = forward(*args)
            setup_context(ctx, args, output)
            return output

        @once_differentiable  # the kernels are not differentiable: a double backward raises
        def function_backward(ctx, *grads):
            return backward(ctx, *grads)

        # Built with type(): autograd names the graph node after the class ("<name>_eagerBackward"
        # in a traceback or grad_fn) when the class is created, not from a later __name__.
        self.function = type(f"{name}_eager", (torch.autograd.Function,),
                             {"forward": staticmethod(function_forward),
                              "backward": staticmethod(function_backward)})

    def __call__(self, tensors: Sequence, *args):
        """``op(*args)``; ``tensors``: the tensor arguments, which decide the way in."""
        if not plain_eager(tensors):
            return self.op(*args)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            if self.function is None:
                return self.op(*args)
            output = None if self.native is None else self.native(*args)
            return self.function.apply(*args) if output is None else output
        return self.forward(*args)
