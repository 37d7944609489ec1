"""``python -m benchmarks.flex_step``: a compiled training step of a small block-diffusion
transformer that calls flex_attention, as written (flex) and with dlm_ops' rewrite (issue #4).

Both variants are compiled up front (the rewrite's switch is read at compile time; two top-level
functions keep two compiled artifacts), then timed in interleaved rounds (DESIGN.md section 5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import dlm_ops

from .__main__ import _time_once, shuffled_rounds
from .models import TinyBD3, noisy_half_loss

VOCAB = 4096


def _steps(model, tokens, block_mask):
    attend = lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask)

    def step_flex():
        loss = noisy_half_loss(model, tokens, attend, VOCAB)
        loss.backward()
        return loss

    def step_rewritten():
        loss = noisy_half_loss(model, tokens, attend, VOCAB)
        loss.backward()
        return loss

    return step_flex, step_rewritten


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.flex_step", description=__doc__.splitlines()[0])
    p.add_argument("--n", default="1024,2048,4096", help="tokens per half, comma-separated")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--mode", default="max-autotune-no-cudagraphs")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU")
        return 1
    rows = []
    for n in (int(x) for x in a.n.split(",")):
        torch.manual_seed(0)
        batch = max(1, 16 * 1024 // (2 * n))
        model = TinyBD3(VOCAB, a.dim, a.heads, a.layers).cuda().to(torch.bfloat16)
        tokens = torch.randint(0, VOCAB, (batch, 2 * n), device="cuda")
        block_mask = create_block_mask(dlm_ops.masks.block_diffusion(n, a.block_size), None, None,
                                       2 * n, 2 * n)
        step_flex, step_rewritten = _steps(model, tokens, block_mask)
        compiled, rewrites = {}, {}
        for name, fn, enabled in (("flex", step_flex, False), ("rewritten", step_rewritten, True)):
            (dlm_ops.compile.enable if enabled else dlm_ops.compile.disable)()
            dlm_ops.compile.reset_stats()
            compiled[name] = torch.compile(fn, mode=a.mode)
            print(f"n={n}: compiling {name} ...", flush=True)
            compiled[name]()  # compile now, under this switch
            _time_once(None, compiled[name], 2)
            # Proof of what ran: flex calls rewritten while compiling this variant (one per layer
            # for "rewritten", none for "flex").
            rewrites[name] = dlm_ops.compile.stats().get("rewritten", 0)
        print(f"n={n}: flex calls rewritten while compiling: {rewrites}", flush=True)
        dlm_ops.compile.enable()
        times = shuffled_rounds(list(compiled), a.rounds,
                                lambda name: _time_once(None, compiled[name], 3))
        ms = {name: statistics.median(t) for name, t in times.items()}
        rows.append(dict(n=n, batch=batch, block_size=a.block_size, dim=a.dim, heads=a.heads,
                         layers=a.layers, mode=a.mode, gpu=torch.cuda.get_device_name(),
                         ms_flex=ms["flex"], ms_rewritten=ms["rewritten"], rewrites=rewrites["rewritten"],
                         speedup=ms["flex"] / ms["rewritten"]))
        print(f"n={n} B={batch}: flex {ms['flex']:.2f} ms, rewritten {ms['rewritten']:.2f} ms, "
              f"speedup {ms['flex'] / ms['rewritten']:.2f}x", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "h200_flex_step.json").write_text(json.dumps(rows, indent=1))
    lines = ["| n | batch | flex ms | rewritten ms | speedup |", "|---|---|---|---|---|"]
    lines += [f"| {r['n']} | {r['batch']} | {r['ms_flex']:.2f} | {r['ms_rewritten']:.2f} | "
              f"{r['speedup']:.2f}x |" for r in rows]
    (out / "h200_flex_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
