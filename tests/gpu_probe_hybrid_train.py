"""GPU probe of the fused training kernels of block_hybrid_train_attn (issue 6): run by hand on the
H200, no pytest: ``python3 tests/gpu_probe_hybrid_train.py [--variants fix,fix-w4] [--no-time]``.

Why a probe: on triton 3.6 the packed-block backward faulted with an illegal shared-memory read
(ptxas 12.8 built a wgmma descriptor from the stack pointer in a spilling bwd_q), which kills the
CUDA context; a pytest run then stops at the first case. Here every (variant, shape) runs in its
own subprocess, every kernel launch is followed by torch.cuda.synchronize() so that a fault names
its kernel, and the results come back as one line each:

    variant  shape                          ok | wrong | fault   details

``ok`` / ``wrong``: out and the five gradients against the fp32 reference by the accuracy rule of
tests/accuracy.py (error <= 2 x plain-PyTorch error + atol; the line prints the worst ratio
error / bound per tensor) and against the torch backend by the same rule. Then, for every variant
correct on every shape, fwd+bwd is timed against the torch backend (interleaved rounds in one
process, medians) at the training shapes of benchmarks/hybrid.py, and a table comes last.

Variants (selected in the child by environment or by module attributes of
dlm_ops.backends.hybrid_train, so that the code under test is the shipped code):
    fix         the defaults (issue 6's fix: bwd_q without the forward's dots, one half per
                program; packed tiles of 32 rows)
    fix-w4      4 warps for every kernel (DLM_OPS_HYBRID_TRAIN_WARPS)
    fix-ds32    D slices of 32 columns (SLICE_D)
    fix-pack64  packed tiles of 64 rows (wgmma, as before the fix: the configuration that faulted)
    mma-v2      DISABLE_MMA_V3=1: every dot on mma.sync, no wgmma descriptors (diagnostic only;
                the variable is process-wide, so it cannot ship)
Every child has its own Triton cache directory (DISABLE_MMA_V3 is not part of the cache key).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# PROBE_DEVICE=cpu with TRITON_INTERPRET=1 and --shapes tiny checks the plumbing without a GPU.
DEVICE = os.environ.get("PROBE_DEVICE", "cuda")
WARPS4 = "fwd=4,bwd_q=4,bwd_k=4,scan=4,logits=4,dW=4"
VARIANTS = {
    "fix": dict(env={}, attrs={}),
    "fix-w4": dict(env={"DLM_OPS_HYBRID_TRAIN_WARPS": WARPS4}, attrs={}),
    "fix-ds32": dict(env={}, attrs={"SLICE_D": 32}),
    "fix-pack64": dict(env={}, attrs={"PACKED_ROWS": 64}),
    "mma-v2": dict(env={"DISABLE_MMA_V3": "1"}, attrs={}),
}
# (B, n, H, Hkv, D, F, block_size, dtype): tests/test_hybrid_attn.py's GPU training cases
# (test_gpu_train_accuracy, test_gpu_train_triton_vs_torch), both dtypes where they differ in code.
SHAPES = [
    (2, 300, 4, 4, 128, 64, 7, "bfloat16"),  # the case that faulted: packed blocks, partial tiles
    (2, 512, 8, 2, 128, 64, 32, "bfloat16"),
    (2, 64, 4, 1, 128, 64, 100, "bfloat16"),  # one block of a whole half (64-row tile)
    (2, 1024, 4, 1, 128, 64, 4, "bfloat16"),
    (2, 256, 2, 2, 128, 64, 64, "bfloat16"),
    (2, 97, 3, 1, 128, 64, 16, "bfloat16"),
    (2, 256, 8, 2, 64, 16, 4, "bfloat16"),  # D=64, F=16
    (2, 300, 4, 4, 128, 64, 7, "float16"),
    (2, 256, 2, 2, 128, 64, 64, "float16"),
    (2, 512, 8, 2, 128, 64, 32, "float16"),
]
TINY = [(1, 20, 2, 1, 16, 8, 3, "float32"), (1, 24, 2, 2, 16, 8, 24, "float16")]
# benchmarks/hybrid.py's training cases (16K tokens per batch, bf16, D=128, F=64) at block 32,
# and the packed path at block 4 on one of them.
BENCH = [(8, 1024, 32, 8, 32), (2, 4096, 32, 8, 32), (8, 1024, 16, 16, 32), (2, 4096, 16, 16, 32),
         (2, 4096, 32, 8, 4)]
NAMES = ["out", "dq", "dk", "dv", "dW", "dgate"]
TIMED = ("fix", "fix-w4", "fix-ds32")  # candidates to ship; the others are diagnostics


def _label(s) -> str:
    b, n, h, hkv, d, f, bs, dt = s
    short = dict(bfloat16="bf16", float16="fp16", float32="fp32")[dt]
    return f"B={b} n={n} H={h}/{hkv} D={d} F={f} bs={bs} {short}"


# -- child ----------------------------------------------------------------------------------------


def _setup(variant: str):
    """Import the package with the variant applied; returns (torch, dlm_ops, hybrid_train)."""
    os.environ["DLM_OPS_HYBRID_TRAIN_TRITON"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch

    import dlm_ops
    from dlm_ops.backends import hybrid_train

    for name, value in VARIANTS[variant]["attrs"].items():
        setattr(hybrid_train, name, value)
    return torch, dlm_ops, hybrid_train


def _synced_launches(torch, hybrid_train, last: list):
    """Every kernel launch of the training path followed by a synchronize; ``last`` names the
    kernel running when a fault surfaces."""

    class Synced:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            launch = self.fn[grid]

            def run(*args, **kwargs):
                last[0] = self.name.replace("hybrid_", "").replace("_kernel", "")
                launch(*args, **kwargs)
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
            return run

    mod = hybrid_train.kernels
    for name in dir(mod):
        if name.endswith("_kernel"):
            setattr(mod, name, Synced(name, getattr(mod, name)))


def _grads(torch, fn, inputs, dout):
    inputs = [t.detach().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    return (out, *torch.autograd.grad((out.float() * dout.float()).sum(), inputs))


def _ratios(torch, ours, gold, plain, dtype):
    """error / (2 x plain error + atol) per tensor (tests/accuracy.py's rule: <= 1 passes)."""
    from tests.accuracy import ATOL

    out = []
    for o, g, p in zip(ours, gold, plain):
        o, g, p = (t.detach().double() for t in (o, g, p))
        if not torch.isfinite(o).all():
            out.append(float("inf"))
            continue
        err, base = (o - g).abs().max().item(), (p - g).abs().max().item()
        out.append(err / (2 * base + ATOL[dtype]))
    return out


def child_check(variant: str, shape) -> dict:
    torch, dlm_ops, hybrid_train = _setup(variant)
    from dlm_ops.reference import block_hybrid_train_attn_ref

    last = ["-"]
    _synced_launches(torch, hybrid_train, last)
    b, n, h, hkv, d, f, bs, dt = shape
    dtype = getattr(torch, dt)
    g = torch.Generator().manual_seed(n)
    q = torch.randn(b, 2 * n, h, d, generator=g)
    k, v = (torch.randn(b, 2 * n, hkv, d, generator=g) for _ in range(2))
    w = torch.randn(h, d, f, generator=g) * (2.0 / d ** 0.5)
    gate = torch.randn(h, generator=g)
    dout = torch.randn(b, 2 * n, h, d, generator=g)
    q, k, v, dout = (t.to(DEVICE, dtype) for t in (q, k, v, dout))
    inputs = (q, k, v, w.to(DEVICE), gate.to(DEVICE))
    try:
        ours = _grads(torch, lambda *t: dlm_ops.block_hybrid_train_attn(*t, bs, backend="triton"),
                      inputs, dout)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # a fault: the context is dead, report and leave
        return dict(status="fault", kernel=last[0], error=f"{type(e).__name__}: {str(e)[:160]}")
    last[0] = "reference"
    f32 = torch.float32
    gold = _grads(torch, lambda *t: block_hybrid_train_attn_ref(*t, bs, compute_dtype=f32), inputs,
                  dout)
    plain = _grads(torch, lambda *t: block_hybrid_train_attn_ref(*t, bs, compute_dtype=dtype),
                   inputs, dout)
    ref = _grads(torch, lambda *t: dlm_ops.block_hybrid_train_attn(*t, bs, backend="torch"),
                 inputs, dout)
    rule = _ratios(torch, ours, gold, plain, dtype)
    vs_torch = _ratios(torch, ours, ref, plain, dtype)
    ok = max(rule) <= 1 and max(vs_torch) <= 1
    return dict(status="ok" if ok else "wrong", rule=rule, vs_torch=vs_torch)


def child_time(variant: str, rounds: int) -> dict:
    torch, dlm_ops, _ = _setup(variant)
    rows = {}
    for b, n, h, hkv, bs in BENCH:
        d, f, dt = 128, 64, torch.bfloat16
        q = torch.randn(b, 2 * n, h, d, device="cuda", dtype=dt, requires_grad=True)
        k, v = (torch.randn(b, 2 * n, hkv, d, device="cuda", dtype=dt, requires_grad=True)
                for _ in range(2))
        w = (torch.randn(h, d, f, device="cuda") * d ** -0.5).requires_grad_()
        gate = torch.zeros(h, device="cuda", requires_grad=True)
        dout = torch.randn(b, 2 * n, h, d, device="cuda", dtype=dt)

        def step(backend):
            out = dlm_ops.block_hybrid_train_attn(q, k, v, w, gate, bs, backend=backend)
            return torch.autograd.grad(out, (q, k, v, w, gate), dout)

        ms = {"triton": [], "torch": []}
        for be in ms:  # compile / warm up
            step(be)
        torch.cuda.synchronize()
        for _ in range(rounds):  # interleaved: clocks and neighbours drift
            for be in ms:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                step(be)
                end.record()
                torch.cuda.synchronize()
                ms[be].append(start.elapsed_time(end))
        rows[f"B={b} 2n={2 * n} H={h}/{hkv} bs={bs}"] = {
            be: sorted(t)[len(t) // 2] if t else 0.0 for be, t in ms.items()}
        q = k = v = w = gate = dout = None  # free before the next case
        torch.cuda.empty_cache()
    return rows


# -- parent ---------------------------------------------------------------------------------------


def _run_child(args: list[str], variant: str, cache_root: str, timeout: float) -> dict:
    env = dict(os.environ)
    env.update(VARIANTS[variant]["env"])
    env["TRITON_CACHE_DIR"] = os.path.join(cache_root, variant)
    if DEVICE == "cuda":
        env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, *args]
    try:
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                             cwd=ROOT)
    except subprocess.TimeoutExpired:
        return dict(status="fault", kernel="?", error=f"timed out after {timeout:.0f} s")
    for line in reversed(run.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or [""]
    return dict(status="fault", kernel="?", error=f"exit {run.returncode}: {tail[0][:160]}")


def _fmt_check(variant, shape, r) -> str:
    head = f"{variant:<11} {_label(shape):<38} {r['status']:<6}"
    if r["status"] == "fault":
        return f"{head} in {r['kernel']}: {r['error']}"
    worst = " ".join(f"{nm}={x:.2f}/{y:.2f}" for nm, x, y in zip(NAMES, r["rule"], r["vs_torch"]))
    return f"{head} err/bound vs fp32 ref / vs torch: {worst}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 4),
                   help="children at once in the check phase (compiles are CPU-bound)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-time", action="store_true")
    p.add_argument("--shapes", default="test", help="test (the GPU tests' shapes) or tiny")
    p.add_argument("--child")
    p.add_argument("--shape")
    p.add_argument("--time", action="store_true")
    a = p.parse_args(argv)
    if a.child:  # one (variant, shape) check or one variant's timing, result on the last line
        if a.time:
            res = child_time(a.child, a.rounds)
        else:
            res = child_check(a.child, json.loads(a.shape))
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    t0 = time.time()
    variants = a.variants.split(",")
    shapes = SHAPES if a.shapes == "test" else TINY
    cache_root = tempfile.mkdtemp(prefix="hybrid_probe_")
    jobs = [(v, s) for v in variants for s in shapes]
    print(f"{len(jobs)} checks ({len(variants)} variants x {len(shapes)} shapes), "
          f"{a.jobs} at a time; Triton caches under {cache_root}", flush=True)
    timed = [] if a.no_time else [v for v in variants if v in TIMED]
    with ThreadPoolExecutor(a.jobs) as pool:
        # the timing children's compiles (rounds 0: one warm-up step per case) run alongside
        warm = [pool.submit(_run_child, ["--time", "--rounds", "0"], v, cache_root, 200)
                for v in timed]
        futs = {pool.submit(_run_child, ["--shape", json.dumps(s)], v, cache_root, 200): (v, s)
                for v, s in jobs}
        results = {key: fut.result() for fut, key in futs.items()}
        for f in warm:
            f.result()
    for v, s in jobs:
        print(_fmt_check(v, s, results[(v, s)]), flush=True)
    good = [v for v in variants if all(results[(v, s)]["status"] == "ok" for s in shapes)]
    print(f"check phase {time.time() - t0:.0f} s; correct on every shape: {good or 'none'}",
          flush=True)

    timing = {}
    if not a.no_time:
        for v in [v for v in timed if v in good]:  # one at a time, nothing else on the GPU
            timing[v] = _run_child(["--time", "--rounds", str(a.rounds)], v, cache_root, 240)
            if "status" in timing[v]:
                print(f"timing {v}: {timing[v]['error']}", flush=True)
                del timing[v]

    print("\n== summary ==")
    print("| variant | " + " | ".join(_label(s) for s in shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    for v in variants:
        cells = []
        for s in shapes:
            r = results[(v, s)]
            cells.append(r["status"] if r["status"] != "fault" else f"fault ({r['kernel']})")
        print(f"| {v} | " + " | ".join(cells) + " |")
    if timing:
        best = {}
        for case in next(iter(timing.values())):
            best[case] = min(timing, key=lambda v: timing[v][case]["triton"])
        print("\n| case (bf16, D=128, F=64) | fastest variant | triton ms | torch ms "
              "| torch / triton |")
        print("|---|---|---|---|---|")
        for case, v in best.items():
            tr, to = timing[v][case]["triton"], timing[v][case]["torch"]
            print(f"| {case} | {v} | {tr:.2f} | {to:.2f} | {to / tr:.2f} |")
        print("\nall timed variants, triton ms: " + "; ".join(
            f"{v}: " + ", ".join(f"{t['triton']:.2f}" for t in timing[v].values()) for v in timing))
    print(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
