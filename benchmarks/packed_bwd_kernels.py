"""``python -m benchmarks.packed_bwd_kernels``: per-kernel GPU time of the CUTLASS backward over
packed samples, its persistent dK/dV kernel walking the snake, the balanced schedule in the plain
order, and the balanced schedule slot-major by sample (the default; cutlass_diffusion.
_varlen_dkdv_schedule), against the same work batched (equal samples). Rounds interleave the
variants in alternating order; medians; the gradients compared across the variants (the schedule
moves items between CTAs, never their arithmetic: 0 difference expected). Needs an sm90 GPU.
Session 37's run: benchmarks/results/h200_packed_bwd_schedule_s37.txt."""

import collections
import statistics

import torch

import dlm_ops
from dlm_ops.backends import cutlass_diffusion as cd

from .sparse_profile import kernel_times

def short(name):
    for key in ("preprocess", "dkdv", "dq_from_ds", "dq_kernel", "convert"):
        if key in name:
            return key
    return "other"

def kernels(fn, reps=20):
    agg, _ = kernel_times(fn, short, reps)
    agg["bwd total"] = sum(agg.values())
    return agg

real_walk = cd._walk
VARIANTS = {
    "batched": dict(balanced=True, walk=None),
    "packed snake": dict(balanced=False, walk=None),
    "packed sched plain": dict(balanced=True, walk=cd.PLAIN_ORDER),
    "packed sched": dict(balanced=True, walk=None),
}

def mixed_halves():
    out, total, i = [], 0, 0
    while True:
        n = 1 + (7919 * i * i + 104729 * i + 13) % 2047
        if total + n >= 8192:
            out.append(8192 - total); return out
        out.append(n); total, i = total + n, i + 1

CASES = [((1024,) * 8, 16), ((4096,) * 2, 16), ((1024,) * 8, 4), (tuple(mixed_halves()), 16), ((1000,) * 8, 16)]
H, D = 16, 128


def main() -> None:
    for halves, bs in CASES:
        equal = len(set(halves)) == 1
        cu_l = [0]
        for n in halves:
            cu_l.append(cu_l[-1] + 2 * n)
        total = cu_l[-1]
        torch.manual_seed(0)
        qp, kp, vp = (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.tensor(cu_l, device="cuda", dtype=torch.int32)
        dop = torch.randn_like(qp)
        times = collections.defaultdict(lambda: collections.defaultdict(list))
        grads = {}
        for rnd in range(3):
            names = list(VARIANTS) if rnd % 2 == 0 else list(reversed(VARIANTS))
            for name in names:
                if name == "batched" and not equal:
                    continue
                cfg = VARIANTS[name]
                cd.BALANCED_SCHEDULE = cfg["balanced"]
                cd._walk = (lambda *a, _w=cfg["walk"]: _w) if cfg["walk"] is not None else real_walk
                if name == "batched":
                    s = 2 * halves[0]
                    x = [t.detach().view(len(halves), s, H, D).clone().requires_grad_() for t in (qp, kp, vp)]
                    out = dlm_ops.diffusion_attn_func(*x, bs)
                    do = dop.view(len(halves), s, H, D)
                else:
                    x = [t.detach().clone().requires_grad_() for t in (qp, kp, vp)]
                    out = dlm_ops.diffusion_attn_varlen_func(*x, cu, max(2 * n for n in halves), bs)
                    do = dop
                f = lambda: torch.autograd.grad(out, x, do, retain_graph=True)
                g = [t.reshape(-1) for t in f()]
                grads.setdefault(name, g)
                for key, v in kernels(f).items():
                    times[name][key].append(v)
        cd.BALANCED_SCHEDULE, cd._walk = True, real_walk
        ref = grads["packed snake"]
        diffs = {name: max((a.float() - b.float()).abs().max().item() for a, b in zip(g, ref)) for name, g in grads.items()}
        label = f"{len(halves)} samples, halves {'x'.join(map(str, sorted(set(halves))[:3]))}{'...' if len(set(halves)) > 3 else ''} bs={bs}"
        print(f"== {label}: max |grad - snake's| " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
        base = "batched" if equal else "packed snake"
        for key in ("dkdv", "dq_from_ds", "preprocess", "bwd total"):
            cells = []
            for name in VARIANTS:
                if key in times[name]:
                    med = statistics.median(times[name][key])
                    b = statistics.median(times[base][key])
                    cells.append(f"{name} {med:8.1f} ({med / b:.3f})")
            print(f"  {key:11s} " + " | ".join(cells))


if __name__ == "__main__":
    main()
