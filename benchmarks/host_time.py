"""Is a training step host-bound? ``python -m benchmarks.host_time [--n 1024] [--head-dim 128]``.

Per call, for the forward (no grad), a training step (forward with grad, then backward) and the
backward op alone, batched and packed (varlen, the same samples), the forward and the step also
"via op" (through the registered custom ops, as every call went before dlm_ops/ops/eager.py): the CPU time to enqueue
``--calls`` calls before the sync, and the wall time once the GPU has finished them. Enqueue close
to wall does not by itself mean a host-bound step: once the launch queue is full the host can only
enqueue as fast as the GPU drains it (session 7 read it that way; csrc/NOTES.md "The training step
at n = 1K"). The burst column is the host's own time per call (3 calls right after a sync, no
queue to wait on). cuDNN's causal-on-halves forward and step run in the same process as the
host's yardstick: the host's speed moves between machines and runs, the ratio much less.
``--profile`` compares the kernels' GPU time per step with the wall, and
``--gaps`` lists a step's kernels with the GPU's idle time before each, ours and cuDNN's
causal-on-halves step (session 20: at n = 1K ours idled 200-450 us per profiled step before its
backward's first kernel, the host still in the backward's Python; cuDNN's 20-40 us; session 35:
1518 us against cuDNN's 90). ``--nodes`` splits a step's host time (step_nodes; session 36: the
Python node's backward on the autograd engine's device thread was the step's excess, hence
cutlass_diffusion.NATIVE_BACKWARD, the C++ node, whose A/B against the Python node is a row).
bf16, H=16, D=128 (``--head-dim``), 16K tokens, block_size 16, the default backend. Needs a CUDA
GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dlm_ops
import dlm_ops.ops.diffusion

from . import host_path
from .contenders import python_node_backward


def per_call(f, calls: int) -> tuple[float, float, float, float]:
    """(enqueue ms, wall ms, burst enqueue ms, median burst ms) per call of ``f``, after 5 warm-up
    calls. Burst: the enqueue of 3 calls right after a sync, the best of 10 bursts: the host's
    own time per call, which no full launch queue can stretch (the long run's enqueue can); the
    median says how much the host itself wanders (session 28: the best moved 0.38-0.76 ms for one
    step between runs on one machine, hence cuDNN's rows as the yardstick of the same process)."""
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    bursts = []
    for _ in range(10):
        torch.cuda.synchronize()
        b0 = time.perf_counter()
        for _ in range(3):
            f()
        bursts.append((time.perf_counter() - b0) / 3)
    torch.cuda.synchronize()
    return (1e3 * (t1 - t0) / calls, 1e3 * (t2 - t0) / calls, 1e3 * min(bursts),
            1e3 * statistics.median(bursts))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1024, help="half length (samples of 2n tokens)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="also profile 10 batched steps (torch.profiler, CPU and CUDA): the GPU's "
                        "busy share, then the ROWS top ops by self CPU, total CPU and self GPU time")
    p.add_argument("--gaps", type=int, default=0, metavar="STEPS",
                   help="also profile STEPS batched steps, ours and cuDNN's causal on the halves: "
                        "per kernel of a step, its mean duration and the GPU's idle time before it")
    p.add_argument("--nodes", action="store_true",
                   help="also split a batched step's host time (best bursts): a trivial C++ and a "
                        "trivial Python autograd node's step, our forward with grad, our step (also "
                        "with the backward on the calling thread), and our backend's backward "
                        "called on the main thread (no autograd engine)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.host_time needs a CUDA GPU")
    h, d, n = 16, a.head_dim, a.n
    b = max(1, 16384 // (2 * n))

    def make(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = (make(b, 2 * n, h, d) for _ in range(3))
    packed = tuple(t.detach().reshape(b * 2 * n, h, d).requires_grad_() for t in (q, k, v))
    cu = torch.arange(0, b * 2 * n + 1, 2 * n, dtype=torch.int32, device="cuda")
    halves = tuple(make(2 * b, h, n, d) for _ in range(3))  # cuDNN's layout, made up front

    def cudnn_halves(q, k, v):  # the yardstick: causal attention on the 2B halves (DESIGN.md 5)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    cases = {
        "batched": ((q, k, v), lambda q, k, v: dlm_ops.diffusion_attn_func(q, k, v, 16)),
        "varlen": (packed, lambda q, k, v: dlm_ops.diffusion_attn_varlen_func(q, k, v, cu, 2 * n, 16)),
        "cuDNN causal halves": (halves, cudnn_halves),
    }
    print(f"B={b} n={n} H={h} D={d} bf16, {a.calls} calls; ms per call")
    print("| case | mode | enqueue | wall | enqueue / wall | burst enqueue | median burst |\n"
          "|---|---|---|---|---|---|---|")
    bursts = {}
    for name, (inputs, run) in cases.items():
        def fwd():
            with torch.no_grad():
                run(*inputs)

        def step():
            out = run(*inputs)
            torch.autograd.grad(out, inputs, torch.ones_like(out))

        def bwd_op():
            # The backward op alone, called as autograd does (dlse None: lse is an unused output).
            dlm_ops.ops.diffusion.diffusion_attn_bwd(*saved, 16, None, 0.0, False, None)

        def through_ops(f):
            # The A/B of dlm_ops/ops/eager.py: every call through the registered ops, as before
            # session 11 (the dispatcher and torch.library's autograd wrapper on each call).
            def g():
                with host_path.through_ops():
                    f()
            return g

        modes = [("fwd", fwd), ("step", step)]
        if not name.startswith("cuDNN"):  # the yardstick has no op of ours to go through
            modes[1:1] = [("fwd via op", through_ops(fwd))]
            modes.append(("step via op", through_ops(step)))
        if name == "batched":
            with torch.no_grad():
                out, lse = dlm_ops.diffusion_attn_func(*inputs, 16, return_lse=True)
            saved = (torch.ones_like(out), *(t.detach() for t in inputs), out, lse, None)
            modes.append(("bwd op", bwd_op))
        for mode, f in modes:
            enq, wall, burst, median = per_call(f, a.calls)
            bursts[name, mode] = burst
            print(f"| {name} | {mode} | {enq:.3f} | {wall:.3f} | {enq / wall:.2f} | {burst:.3f} "
                  f"| {median:.3f} |")
    for mode in ("fwd", "step"):
        print(f"host per batched {mode} (best burst), ours / cuDNN's: "
              f"{bursts['batched', mode] / bursts['cuDNN causal halves', mode]:.2f}")
    if a.profile:
        inputs, run = cases["batched"]
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        steps = 10
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                out = run(*inputs)
                torch.autograd.grad(out, inputs, torch.ones_like(out))
            torch.cuda.synchronize()
            wall = 1e3 * (time.perf_counter() - t0) / steps
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu = sum(e.device_time_total for e in kernels) / 1e3 / steps  # us -> ms
        print(f"batched step under the profiler: {gpu:.3f} ms of kernels per step against "
              f"{wall:.3f} ms of wall (profiler overhead included): the GPU is busy at least "
              f"{100 * gpu / wall:.0f} % of the step")
        for key in ("self_cpu_time_total", "cpu_time_total", "self_device_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=a.profile))
    if a.gaps:
        for name, case in (("dlm_ops", "batched"), ("cuDNN causal on halves", "cuDNN causal halves")):
            inputs, run = cases[case]
            step_gaps(name, lambda: _step(run, inputs), a.gaps)
    if a.nodes:
        step_nodes(*cases["batched"][0], n, a.calls)
    return 0


class _PythonNode(torch.autograd.Function):
    """A Python autograd node doing as little as a node can (one kernel each way)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def _single_threaded(f):
    """f() with autograd's multithreading off: the engine runs a CUDA backward on the calling
    thread instead of its device thread (no hand-over of the GIL to that thread)."""
    with torch.autograd.set_multithreading_enabled(False):
        return f()


def _python_node(f):
    """f() with the backward as the Python autograd node (cutlass_diffusion.NATIVE_BACKWARD off)."""
    with python_node_backward():
        return f()


def step_nodes(q, k, v, n: int, calls: int) -> None:
    """Where a batched step's host time goes (session 35: the step's best burst was 0.82 ms where
    the forward alone took 0.08 and the backward op alone 0.22, and cuDNN's whole step 0.38): the
    autograd engine's own cost with a C++ and with a Python node (on CUDA the engine runs a
    backward on its device thread, and a Python node's there needs the GIL), our forward with grad
    (the autograd.Function and its saved tensors), our step, the same with the backward on the
    calling thread (autograd's multithreading off), and our backend's backward called directly on
    the main thread (our Python and the extension without the engine)."""
    x = torch.randn(1024, device=q.device, requires_grad=True)
    gx = torch.ones_like(x)
    dout = torch.ones_like(q)
    with torch.no_grad():
        out, lse = dlm_ops.diffusion_attn_func(q, k, v, 16, return_lse=True)
    ops = dlm_ops.ops.diffusion
    impl = ops.select(ops._problem(q, k, 0.0, False, False), None)
    mask = ops.SequenceMask.block_diffusion(2 * n, 16)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    rows = {
        "engine, trivial C++ node": lambda: torch.autograd.grad(x * 2, (x,), gx),
        "engine, trivial Python node": lambda: torch.autograd.grad(_PythonNode.apply(x), (x,), gx),
        "ours, forward with grad": lambda: dlm_ops.diffusion_attn_func(q, k, v, 16),
        "ours, step": lambda: torch.autograd.grad(dlm_ops.diffusion_attn_func(q, k, v, 16),
                                                  (q, k, v), dout),
        "ours, step, the backward on the calling thread": lambda: _single_threaded(
            lambda: torch.autograd.grad(dlm_ops.diffusion_attn_func(q, k, v, 16), (q, k, v), dout)),
        "ours, step, the Python node (NATIVE_BACKWARD off)": lambda: _python_node(
            lambda: torch.autograd.grad(dlm_ops.diffusion_attn_func(q, k, v, 16), (q, k, v), dout)),
        f"ours, {impl.name} backend's bwd on the main thread": lambda: impl.bwd(
            dout, qd, kd, vd, out, lse, None, mask, q.shape[-1] ** -0.5, 0.0, False),
    }
    print("host time per call, best burst (ms): where a step's host time goes")
    print("| call | burst | median burst |\n|---|---|---|")
    for name, f in rows.items():
        _, _, burst, median = per_call(f, calls)
        print(f"| {name} | {burst:.3f} | {median:.3f} |")


def _step(run, inputs) -> None:
    out = run(*inputs)
    torch.autograd.grad(out, inputs, torch.ones_like(out))


def step_gaps(name: str, step, steps: int) -> None:
    """Print each kernel of ``step`` (by its position in the step, over ``steps`` profiled steps):
    mean duration and mean GPU idle time since the previous kernel ended."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per_step = len(kernels) // steps
    rows: dict[int, list] = {}
    for i in range(1, len(kernels)):
        row = rows.setdefault(i % per_step, [kernels[i].name[:72], 0.0, 0.0, 0])
        row[1] += kernels[i].time_range.start - kernels[i - 1].time_range.end
        row[2] += kernels[i].time_range.end - kernels[i].time_range.start
        row[3] += 1
    print(f"{name}: {per_step} kernels per step; us per step (mean over {steps} profiled steps)")
    print("| kernel | idle before | duration | name |\n|---|---|---|---|")
    for pos in sorted(rows):
        label, idle, dur, count = rows[pos]
        print(f"| {pos} | {idle / count:.1f} | {dur / count:.1f} | {label} |")
    print(f"| all | {sum(r[1] / r[3] for r in rows.values()):.1f} | "
          f"{sum(r[2] / r[3] for r in rows.values()):.1f} | |")


if __name__ == "__main__":
    raise SystemExit(main())
