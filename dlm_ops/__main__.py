"""``python -m dlm_ops`` (or ``dlm-ops``): what this machine can run, and one checked, timed call.

It prints the environment and every backend's eligibility, runs block-diffusion attention on the
best backend for a workload sized for the device (small on CPU), checks it against the reference
with the accuracy rule of DESIGN.md section 4, and times it against SDPA with a dense boolean mask
(what users pay today). The exit status is 1 when the check fails.

``python -m dlm_ops --prebuild`` only compiles the Hopper (cutlass) extensions, also on a machine
without a GPU, into DLM_OPS_BUILD_DIR; exit status 1 with the reason where it cannot.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import dlm_ops
from dlm_ops.backends import REGISTRIES, cutlass, report, select
from dlm_ops.backends.base import Problem
from dlm_ops.errors import UnsupportedConfig
from dlm_ops.ops.diffusion import _problem
from dlm_ops.reference import block_diffusion_mask, diffusion_attn_ref

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _parse(argv):
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="dlm-ops", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if gpu else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16" if gpu else "float32")
    p.add_argument("--batch", type=int, default=4 if gpu else 1)
    p.add_argument("--n", type=int, default=2048 if gpu else 512, help="tokens per half (2n in all)")
    p.add_argument("--heads", type=int, default=16 if gpu else 8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--head-dim", type=int, default=128 if gpu else 64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backend", default=None, help="force a backend by name")
    p.add_argument("--repeats", type=int, default=10 if gpu else 3)
    p.add_argument("--prebuild", action="store_true",
                   help="only compile the sm90 (cutlass) extensions into DLM_OPS_BUILD_DIR, with or "
                        "without a GPU, for GPU machines with the same torch, CUDA and nvcc")
    return p.parse_args(argv)


def _time_ms(fn, repeats: int, device: torch.device) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def main(argv=None) -> int:
    a = _parse(argv)
    if a.prebuild:
        try:
            for path in cutlass.prebuild():
                print(f"built {path}")
        except UnsupportedConfig as e:
            print(f"nothing built: {e}", file=sys.stderr)
            return 1
        return 0
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    kv_heads = a.kv_heads or a.heads
    print(f"dlm_ops {dlm_ops.__version__} | torch {torch.__version__} | python {platform.python_version()}")
    print("device: " + (torch.cuda.get_device_name(device) if device.type == "cuda" else
                        f"{device.type} ({torch.get_num_threads()} threads)"))

    gen = torch.Generator(device=device).manual_seed(0)
    S = 2 * a.n
    q = torch.randn(a.batch, S, a.heads, a.head_dim, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(a.batch, S, kv_heads, a.head_dim, device=device, dtype=dtype, generator=gen)
            for _ in range(2))
    problem = _problem(q, k, softcap=0.0, deterministic=False, varlen=False)
    print(f"backends for {a.dtype} head_dim {a.head_dim} on {device.type}:\n{report(problem)}")
    # The other op families dispatch through their own tables: which backend each would take, and
    # every backend's eligibility (the sparse family's cutlass backend says why it cannot run here).
    for family in sorted(set(REGISTRIES) - {"diffusion"}):
        other = Problem(device.type, dtype, a.head_dim)
        try:
            chosen = select(other, family=family).name
        except UnsupportedConfig:
            chosen = "none"
        print(f"{family} family for {a.dtype} head_dim {a.head_dim}: {chosen}\n{report(other, family)}")
    # Whether the csrc/ sources of the cutlass backends (both families) could be JIT-built here.
    print(f"cutlass (Hopper sm_90a kernels): {cutlass.availability()}")
    rewrite = "on" if dlm_ops.compile.is_enabled() else "off"
    print(f"torch.compile flex_attention rewrite: {rewrite} (DLM_OPS_REWRITE_FLEX=0 turns it off)")
    backend = select(problem, a.backend).name
    shape = f"B={a.batch} 2n={S} H={a.heads}/{kv_heads} D={a.head_dim} bs={a.block_size}"
    print(f"running {shape} {a.dtype} on backend {backend!r} ...", flush=True)

    # Accuracy: error vs an fp64/fp32 reference, against the error of plain PyTorch in this dtype.
    gold_dtype = torch.float64 if device.type == "cpu" else torch.float32
    out = dlm_ops.diffusion_attn_func(q, k, v, a.block_size, backend=backend)
    gold, _ = diffusion_attn_ref(q, k, v, a.block_size, compute_dtype=gold_dtype)
    plain, _ = diffusion_attn_ref(q, k, v, a.block_size, compute_dtype=dtype)
    err = (out.to(gold_dtype) - gold).abs().max().item()
    plain_err = (plain.to(gold_dtype) - gold).abs().max().item()
    ok = err <= 2 * plain_err + 1e-5
    del gold, plain

    mask = block_diffusion_mask(S, a.block_size, device)
    gqa = kv_heads != a.heads
    sdpa = lambda: F.scaled_dot_product_attention(  # (B, H, S, D) views of the same tensors
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=gqa)
    ours = lambda: dlm_ops.diffusion_attn_func(q, k, v, a.block_size, backend=backend)

    def step(fn, inputs):
        o = fn()
        torch.autograd.grad(o, inputs, torch.ones_like(o))

    rows = []
    for label, run_ours, run_sdpa in (
        ("fwd", ours, sdpa),
        ("fwd+bwd", lambda: step(ours, (q, k, v)), lambda: step(sdpa, (q, k, v))),
    ):
        if label == "fwd+bwd":
            for t in (q, k, v):
                t.requires_grad_(True)
        print(f"timing {label} ({a.repeats} repeats) ...", flush=True)
        ms_sdpa = _time_ms(run_sdpa, a.repeats, device)
        ms_ours = _time_ms(run_ours, a.repeats, device)
        rows.append([f"dlm_ops ({backend}) {label}", shape, f"{err:.2e}", f"{ms_ours:.2f}",
                     f"{ms_sdpa / ms_ours:.2f}x"])
        rows.append([f"SDPA dense mask {label}", shape, f"{plain_err:.2e}", f"{ms_sdpa:.2f}",
                     "1.00x"])
    print()
    print(_table(["backend", "shape", "max error", "ms", "speedup vs SDPA dense mask"], rows))
    print()
    print(f"check: {'ok' if ok else 'FAILED'} (max error {err:.2e}; plain PyTorch in {a.dtype}: "
          f"{plain_err:.2e}; rule: <= 2x + 1e-5)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
