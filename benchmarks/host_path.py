"""The Python host path of a training step, on any machine: ``python -m benchmarks.host_path``.

The CUTLASS diffusion backend's Python (validation, dispatch, tile plans, output allocation,
autograd) with a no-op extension in place of the kernels, on CPU tensors: per call, the forward
(no grad), the backward op and a training step (forward, then torch.autograd.grad), each the
eager way (dlm_ops/ops/eager.py) and through the registered ops, alternating in one process; the
best of ``--rounds`` rounds. What a GPU's host adds on top (CUDA allocations, launches) is not in
these figures; ``benchmarks.host_time`` measures the whole host time on a GPU. Use this to see
what a Python change does to the host path without a GPU (session 11: the eager way took a step
from 215 to 137 us on the workstation, a no-grad forward from 40 to 19 us).
"""
from __future__ import annotations

import argparse
import time
from contextlib import contextmanager
from dataclasses import replace

import torch

import dlm_ops
import dlm_ops.ops.diffusion
import dlm_ops.ops.eager
from dlm_ops.backends import cutlass
from dlm_ops.backends import cutlass_diffusion as cd


class NoOpExtension:
    """The extension's interface, launching nothing: tile orders are placeholders."""

    scratch_pad = 128
    batched_any_length = True

    def tile_order(self, n_noisy, n_clean, block_size, head_dim):
        return torch.zeros(1, dtype=torch.int32)

    def bwd_tile_orders(self, n_noisy, n_clean, block_size, head_dim):
        return tuple(torch.zeros(1, dtype=torch.int32) for _ in range(3))

    def fwd(self, *args, **kwargs):
        pass

    def bwd(self, *args, **kwargs):
        pass


@contextmanager
def cutlass_on_cpu():
    """The cutlass backend made eligible for CPU tensors, running NoOpExtension (restored after)."""
    ext, cls = NoOpExtension(), cd.CutlassDiffusionBackend
    saved = [(cd, "_EXT"), (cd, "_extension"), (cd, "_sm_count"), (cutlass, "tma_ready"),
             (cls, "auto_device_types"), (cls, "not_supported_reasons"), (cls, "capabilities")]
    missing = object()  # inherited attributes: the override is deleted again, not restored
    saved = [(owner, name, vars(owner).get(name, missing)) for owner, name in saved]
    cd._EXT, cd._extension, cd._sm_count = ext, (lambda: ext), (lambda device: 132)
    cutlass.tma_ready = lambda t: True
    cls.auto_device_types = frozenset({"cpu", "cuda"})
    cls.not_supported_reasons = lambda self, problem: []
    cls.capabilities = replace(cls.capabilities, device_types=frozenset({"cpu", "cuda"}))
    for cached in (cd._tile_order, cd._bwd_tile_orders):
        cached.cache_clear()
    try:
        yield
    finally:
        for owner, name, value in saved:
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        for cached in (cd._tile_order, cd._bwd_tile_orders):
            cached.cache_clear()


@contextmanager
def through_ops():
    """Every call through the registered ops (the dispatcher, torch.library's autograd wrapper)."""
    plain = dlm_ops.ops.eager.plain_eager
    dlm_ops.ops.eager.plain_eager = lambda tensors: False
    try:
        yield
    finally:
        dlm_ops.ops.eager.plain_eager = plain


def _best_us(f, calls: int, rounds: int) -> float:
    for _ in range(min(calls, 50)):
        f()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t0) / calls)
    return 1e6 * best


def measure(n: int = 1024, head_dim: int = 128, calls: int = 400, rounds: int = 5) -> dict:
    """{(mode, way): microseconds per call}, ways "eager" and "via op"."""
    q, k, v = (torch.randn(1, 2 * n, 1, head_dim, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def fwd():
        with torch.no_grad():
            dlm_ops.diffusion_attn_func(q, k, v, 16)

    with torch.no_grad():
        out, lse = dlm_ops.diffusion_attn_func(q, k, v, 16, return_lse=True)
    dout = torch.ones_like(out)  # one tensor for every call: a CPU fill is no launch (page faults)
    saved = (dout, q.detach(), k.detach(), v.detach(), out, lse, None)

    def step():
        torch.autograd.grad(dlm_ops.diffusion_attn_func(q, k, v, 16), (q, k, v), dout)

    def bwd_op():  # as autograd calls it (dlse None)
        dlm_ops.ops.diffusion.diffusion_attn_bwd(*saved, 16, None, 0.0, False, None)

    times = {}
    for mode, f in (("fwd", fwd), ("bwd op", bwd_op), ("step", step)):
        for _ in range(rounds):  # the two ways alternate, so that drift hits both
            for way in ("eager", "via op"):
                if mode == "bwd op" and way == "eager":
                    continue  # the op itself: there is no other way to call it
                with through_ops() if way == "via op" else _nothing():
                    t = _best_us(f, calls, 1)
                times[mode, way] = min(times.get((mode, way), float("inf")), t)
    return times


@contextmanager
def _nothing():
    yield


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1024, help="half length (one sample of 2n tokens)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--calls", type=int, default=400, help="calls per timing")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    with cutlass_on_cpu():
        times = measure(a.n, a.head_dim, a.calls, a.rounds)
    calls = cd.STATS
    print(f"CPU, cutlass backend with a no-op extension, B=1 n={a.n} H=1 D={a.head_dim} bf16; "
          f"us per call, best of {a.rounds} rounds of {a.calls}")
    print("| mode | eager way | via op | eager / via op |\n|---|---|---|---|")
    for mode in ("fwd", "step"):
        e, o = times[mode, "eager"], times[mode, "via op"]
        print(f"| {mode} | {e:.1f} | {o:.1f} | {e / o:.2f} |")
    print(f"| bwd op | - | {times['bwd op', 'via op']:.1f} | - |")
    assert calls["fwd"] > 0 and calls["bwd"] > 0, calls  # the cutlass path ran, not a fallback
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
