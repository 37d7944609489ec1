"""Small calls of the sm90 CUTLASS kernels, each checked against the reference, for
compute-sanitizer: ``compute-sanitizer --tool racecheck python3 -m tests.sanitize_small [fwd|step]
[--persistent] [--narrow-all]``.

``fwd``: the diffusion forward at D = 64 / 128 / 256 (halves on and off the 128 grid, GQA, a
persistent grid's several items per CTA, block-causal), packed samples with a zero-length one, and
the block- and column-sparse forwards with empty and full rows. ``step``: the diffusion forward and
backward (dS and two-kernel paths, batched and packed), plus calls with more dQ items than SMs, so
that the dS backward's dQ kernel walks its balanced schedule (cutlass_diffusion.DQ_SCHEDULE; the
run fails if none was built). Shapes are small so that the sanitizers
(10-100x slower) finish in minutes, except the persistent case's training step: under racecheck
on the H200 the step's first four batched cases and that case's forward took 230 s and its
backward did not finish within them (session 27), so ``step`` leaves it out unless
``--persistent`` is given. Exits 1 if a result is off or a call ran another backend (the
backends' STATS counters). ``--narrow-all``: every forward that has a narrow-diagonal kernel
(cutlass_diffusion.NARROW_DIAG_*: D = 64 and 128, batched and packed) runs it, not only those the
shipped rules pick.
"""

from __future__ import annotations

import sys

import torch

import dlm_ops
from dlm_ops import reference as ref
from dlm_ops.backends import cutlass_diffusion as cd
from dlm_ops.backends import cutlass_sparse as cs

TOL = 2e-2  # bf16 outputs of O(1) values against an fp32 reference: a wrong tile is O(1) off


def _rand(*shape, grad=False):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> bool:
    err = (got.float() - want.float()).abs().max().item()
    ok = err <= TOL * max(1.0, want.float().abs().max().item())
    print(f"{'ok ' if ok else 'BAD'} {name}: max error {err:.3g}")
    return ok


def _grads_close(label: str, out: torch.Tensor, inputs: tuple, reference) -> bool:
    """dq, dk, dv of ``out`` against ``reference(q, k, v)`` on fp32 copies, for one random dout."""
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_inputs = tuple(t.detach().float().requires_grad_() for t in inputs)
    want = torch.autograd.grad(reference(*ref_inputs), ref_inputs, dout.float())
    ok = True
    for g, w, name in zip(grads, want, ("dq", "dk", "dv")):
        ok &= _close(f"{name} {label}", g, w)
    return ok


# (B, n, H, Hkv, D, block_size): on the grid, off it, GQA; then B * H * tiles > SMs (persistent)
SMALL = ((1, 128, 2, 2, 128, 16), (2, 200, 2, 1, 64, 4), (1, 96, 2, 2, 256, 16), (2, 256, 4, 2, 128, 1))
PERSISTENT = (3, 640, 16, 16, 128, 16)
# Few keys, many heads: 160 (D = 128, GQA) and 144+ (D = 256) dQ items, more than an H100's or H200's
# 132 SMs, so the dQ-from-dS kernel runs its schedule, several items per CTA, at a racecheck's cost.
SCHEDULED = ((1, 256, 40, 20, 128, 16), (1, 256, 36, 36, 256, 4))


def diffusion_cases(step: bool, persistent: bool) -> bool:
    ok = True
    shapes = SMALL + (SCHEDULED if step else ()) + ((PERSISTENT,) if persistent else ())
    for b, n, h, hkv, d, bs in shapes:
        q, k, v = _rand(b, 2 * n, h, d, grad=step), _rand(b, 2 * n, hkv, d, grad=step), \
            _rand(b, 2 * n, hkv, d, grad=step)
        out = dlm_ops.diffusion_attn_func(q, k, v, bs, backend="cutlass")
        want, _ = ref.diffusion_attn_ref(q.detach(), k.detach(), v.detach(), bs)
        label = f"B={b} n={n} H={h}/{hkv} D={d} bs={bs}"
        ok &= _close(f"fwd {label}", out, want)
        if step:
            ok &= _grads_close(label, out, (q, k, v), lambda *x: ref.diffusion_attn_ref(*x, bs)[0])
    q, k = _rand(1, 256, 2, 128), _rand(1, 256, 2, 128)
    v = _rand(1, 256, 2, 128)
    out = dlm_ops.block_causal_attn_func(q, k, v, 16, backend="cutlass")
    ok &= _close("fwd block-causal S=256", out, ref.block_causal_attn_ref(q, k, v, 16)[0])
    cu = torch.tensor([0, 300, 300, 556], device="cuda", dtype=torch.int32)  # a zero-length sample
    qp, kp, vp = _rand(556, 2, 128, grad=step), _rand(556, 1, 128, grad=step), _rand(556, 1, 128, grad=step)
    out = dlm_ops.diffusion_attn_varlen_func(qp, kp, vp, cu, max_seqlen=300, block_size=16,
                                             backend="cutlass")
    ok &= _close("fwd packed 300 + 0 + 256", out,
                 ref.diffusion_attn_varlen_ref(qp.detach(), kp.detach(), vp.detach(), cu, 16)[0])
    if step:
        ok &= _grads_close("packed", out, (qp, kp, vp),
                           lambda *x: ref.diffusion_attn_varlen_ref(*x, cu, 16)[0])
    return ok


def sparse_cases() -> bool:
    ok = True
    b, s, h, hkv, d, blk = 1, 1024, 4, 2, 128, 128
    q, k, v = _rand(b, s, h, d), _rand(b, s, hkv, d), _rand(b, s, hkv, d)
    nb = s // blk
    table = torch.rand(b, h, nb, nb, device="cuda") < 0.4
    table[:, 0, 0] = False  # a query block with no key block: out 0
    table[:, 1] = True      # a head that sees everything
    idx, cnt = dlm_ops.sparsity.block_table_to_indices(table)
    out = dlm_ops.block_sparse_attn(q, k, v, idx, cnt, block_size_q=blk, block_size_k=blk,
                                    backend="cutlass")
    ok &= _close("block-sparse fwd", out, ref.block_sparse_attn_ref(q, k, v, idx, cnt, blk, blk)[0])
    cols = torch.stack([torch.randperm(s, device="cuda")[:300].sort().values for _ in range(b * h)])
    cols = cols.view(b, h, 300).to(torch.int32)
    counts = torch.tensor([[300, 0, 17, 256]], device="cuda", dtype=torch.int32)
    out = dlm_ops.column_sparse_attn(q, k, v, cols, counts, backend="cutlass")
    ok &= _close("column-sparse fwd", out, ref.column_sparse_attn_ref(q, k, v, cols, counts)[0])
    return ok


def _count_dq_schedules() -> list[int]:
    """Counts the batched dQ-from-dS schedules the backend builds (one per dS backward that walks one)."""
    built, build = [0], cd._ds_dq_schedule

    def counted(*args, **kwargs):
        built[0] += 1
        return build(*args, **kwargs)

    cd._ds_dq_schedule = counted
    return built


def main(argv: list[str]) -> int:
    flags = [a for a in argv if a.startswith("--")]
    modes = [a for a in argv if not a.startswith("--")] or ["fwd"]
    if len(modes) > 1 or modes[0] not in ("fwd", "step") or set(flags) - {"--persistent", "--narrow-all"}:
        raise SystemExit("usage: python3 -m tests.sanitize_small [fwd|step] [--persistent] [--narrow-all]")
    mode = modes[0]
    if "--narrow-all" in flags:
        cd.NARROW_DIAG_HEAD_DIMS, cd.NARROW_DIAG_VARLEN = (64, 128), True
    torch.manual_seed(0)
    schedules = _count_dq_schedules()
    # The forward's persistent case is cheap under the sanitizers; the step's is not (docstring).
    ok = diffusion_cases(mode == "step", persistent=mode == "fwd" or "--persistent" in flags)
    if mode == "fwd":
        ok &= sparse_cases()
    torch.cuda.synchronize()
    fallbacks = {k: v for k, v in {**cd.STATS, **{"sparse " + k: v for k, v in cs.STATS.items()}}.items()
                 if "fallback" in k and v}
    if fallbacks:
        print("calls that ran another backend:", fallbacks)
        ok = False
    print("cutlass calls:", cd.STATS, cs.STATS, "| dQ schedules built:", schedules[0])
    if mode == "step" and cd.DQ_SCHEDULE and not schedules[0]:
        print("no call walked the dQ-from-dS schedule")
        ok = False
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
